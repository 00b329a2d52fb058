"""The Live tab's plot pieces: colours and sizes, binned heatmaps, titles that fit, and the step axes.

:class:`kvviz.ui.figures.RunView` draws its figures from these; the Compare and Analyses tabs share the
title sizes and helpers.
"""

from __future__ import annotations

import math
import textwrap

import numpy as np
import plotly.graph_objects as go

MAX_COLUMNS, MAX_ROWS = 512, 256
# uint8 code for "not generated yet" / "not in cache"; not 255, whose base64 "////" Plotly's JSON escapes sixfold
EMPTY = 200
# The rank heatmap's other non-rank cells: kept without a finite score (protected, or not scored yet), evicted
UNSCORED, GONE = 150, 175
NEVER = np.iinfo(np.int32).max
KEPT_COLOR, EVICTED_COLOR, EMPTY_COLOR, UNSCORED_COLOR = "#1f3b73", "#f1c9a5", "#ffffff", "#c8c8c8"
# The heatmaps' keys, in a right margin of one fixed width (not grown to fit each key's labels), so that the
# stacked retention and rank plots' position axes line up
COLORBAR = dict(thickness=12, len=1, x=1.01, outlinewidth=1, tickfont=dict(size=11))
# Gradio turns Plotly's margin autoexpand back on: a key wider than this would push one stacked plot's right
# edge in, out of line with the other (hence the keys' two-line labels)
KEY_MARGIN = 105
HEATMAP_TOP = 70  # a heatmap's title and its key's line
HEATMAP_TITLE_PAD = 26
# What one line of a title holds without being cut, in its own size and in small print (<sup>), in the Live
# tab's plots at a 1000-px window; then the pixels per line of each
HEAD_CHARS, NOTE_CHARS = 42, 62
HEAD_LINE, NOTE_LINE = 22, 20
LEGEND_LINE = 22  # pixels per entry of a legend listed down the page, under a plot
FOLLOWED_COLOR = "#d62728"  # followed tokens drawn over a retention heatmap: apart from its navy and its pale
HALO_COLOR = "rgba(255,255,255,0.85)"
HALO = dict(color=HALO_COLOR, width=1)
# The scrubbed step's line across a heatmap or a per-step plot, dashed: none of the heatmaps' colours (navy,
# peach, the protected bands' green, the followed tokens' red) nor a followed token's line colour
STEP_MARKER_COLOR = "#ff00ff"
STEP_MARKER = dict(line_color=STEP_MARKER_COLOR, line_width=1.5, line_dash="dash")
MAX_FOLLOWED = 16  # lines in the token-history figure: two 7-digit passkeys fit, more is unreadable
# Sixteen that stay apart
FOLLOW_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#000000"]


SHOWN_WHITESPACE = str.maketrans({"\n": "⏎", "\r": "␍", "\t": "⇥"})


def _band(low: float, high: float, color: str) -> list:
    """A flat stretch of a colourscale over the uint8 codes ``low`` to ``high``."""
    return [[low / EMPTY, color], [high / EMPTY, color]]


# The rank heatmap's colours: ranks 0..100 (% of B) from yellow to purple, then a flat band for each of
# UNSCORED, GONE and EMPTY, split halfway between their codes.
RANK_SCALE = [[0, "#fde725"], [50 / EMPTY, "#21918c"], [100 / EMPTY, "#440154"],
              *_band(100.5, (UNSCORED + GONE) / 2, UNSCORED_COLOR),
              *_band((UNSCORED + GONE) / 2 + 0.01, (GONE + EMPTY) / 2, EVICTED_COLOR),
              *_band((GONE + EMPTY) / 2 + 0.01, EMPTY, EMPTY_COLOR)]


def visible_whitespace(token: str) -> str:
    """A token for a table cell, where whitespace is a blank cell: line breaks and tabs as symbols, and a
    token of spaces only as one ␣ each (a space before a word stays a space)."""
    shown = token.translate(SHOWN_WHITESPACE)
    return shown.replace(" ", "␣") if token and not token.strip(" ") else shown


def _binned_share(values: np.ndarray, weight: np.ndarray, col: int, row: int) -> np.ndarray:
    """Weighted mean of ``values`` (in [0, 1]) over each bin of a (steps x positions) matrix, as 0..100;
    bins with no weight become EMPTY."""
    steps, width = values.shape
    pad_r, pad_c = (-steps) % row, (-width) % col
    values = np.pad(values.astype(np.float32), ((0, pad_r), (0, pad_c)))
    weight = np.pad(weight.astype(np.float32), ((0, pad_r), (0, pad_c)))
    shape = (values.shape[0] // row, row, values.shape[1] // col, col)
    total = weight.reshape(shape).sum((1, 3))
    summed = (values * weight).reshape(shape).sum((1, 3))
    share = np.divide(summed, total, out=np.zeros_like(summed), where=total > 0)
    out = np.clip(np.rint(share * 100), 0, 100).astype(np.uint8)
    out[total == 0] = EMPTY
    return out


def _evicted_range(counts: list[int]) -> list[float]:
    """The log axis range of evictions per step: from below 1, so a single eviction shows as a bar."""
    return [math.log10(0.5), math.log10(max(counts, default=1) or 1) + 0.2]


def step_dtick(steps: int) -> int | None:
    """The tick spacing of a decode-step axis over ``steps`` steps: every step while there are few (Plotly's
    own ticks fell on half steps, -0.5 and 0.5, in a run of one or two), else Plotly's choice (None)."""
    return 1 if steps <= 10 else None


def step_range(steps: int) -> list[float]:
    """A decode-step axis over ``steps`` steps, half a step past each end: autoranged, it ended on the last
    step, and the scrubbed-step line drawn there was cut in half by the plot's edge."""
    return [-0.5, max(steps - 1, 0) + 0.5]


def _time_mode(steps: int) -> str:
    """The time split's traces: with markers while few steps (one decode step is a single point, an area of
    no width that drew nothing)."""
    return "lines+markers" if steps <= 10 else "lines"


def _heatmap(z: np.ndarray, col: int, row: int, colorscale, hover: str, steps: int, prompt_len: int,
             key: dict[int, str]) -> go.Figure:
    """A (steps x positions) heatmap of uint8 codes, with ``key`` (code: label) as its colour bar, in the right
    margin that every heatmap shares so that stacked ones line up."""
    fig = go.Figure(go.Heatmap(z=z, x0=(col - 1) / 2, dx=col, y0=(row - 1) / 2, dy=row, zmin=0, zmax=EMPTY,
                               colorscale=colorscale, colorbar=dict(tickvals=list(key), ticktext=list(key.values()),
                                                                    **COLORBAR),
                               hovertemplate="position %{x}<br>step %{y}<br>" + hover + "<extra></extra>"))
    fig.update_layout(xaxis_title="absolute position", yaxis_title="decode step", height=360,
                      margin=dict(l=50, r=KEY_MARGIN, t=HEATMAP_TOP, b=40, autoexpand=False),
                      title=dict(yref="container", y=1, yanchor="top", pad_t=HEATMAP_TITLE_PAD))
    fig.update_xaxes(range=_position_range(z, col))
    fig.update_yaxes(autorange="reversed", dtick=step_dtick(steps))
    # the label above the plot, where it hides no cell, and left of the line: the axis ends a few generated
    # columns past it, where a centred label would be cut at the plot's edge
    fig.add_vline(x=prompt_len - 0.5, line_dash="dot", line_color="#888", annotation_text="prompt end",
                  annotation_position="top", annotation_xanchor="right", annotation_font=dict(size=9, color="#555"))
    return fig


def titled(head: str, *notes: str) -> tuple[str, int]:
    """A title: ``head`` in the title's size, then each of ``notes`` in small print (empty ones left out), broken
    into lines that fit a Live-tab plot at a 1000-px window (at " · " where it can, else at spaces).  Returns
    the text and its height in pixels."""
    heads = textwrap.wrap(head, HEAD_CHARS) or [head]
    lines = []
    for note in filter(None, notes):
        line = ""
        for part in note.split(" · "):
            joined = f"{line} · {part}" if line else part
            if line and len(joined) > NOTE_CHARS:
                lines.append(line)
                joined = part
            line = joined
        lines.append(line)
    lines = [piece for line in lines for piece in textwrap.wrap(line, NOTE_CHARS, break_long_words=False)]
    text = "<br>".join(heads) + "".join(f"<br><sup>{line}</sup>" for line in lines)
    return text, HEAD_LINE * len(heads) + NOTE_LINE * len(lines)


TITLE_PAD, TITLE_GAP = 14, 8  # pixels above a title hung from the top of its figure, and between it and the plot
CHIP_HEIGHT, SMALL_LINE = 40, 16  # a plot's label chip, at its top left, and a line of a 12-px title
TITLE_12_CHARS = 52  # what a line of a 12-px title holds in the Compare tab's accordions at a 1000-px window


def _hang_title(fig: go.Figure, text: str, height: int) -> int:
    """Hang ``titled``'s title from the top of the figure (centred in the margin, Plotly's default, its last
    line touched the plot); returns the top margin it needs."""
    fig.update_layout(title=dict(text=text, yref="container", y=1, yanchor="top", pad_t=TITLE_PAD))
    return TITLE_PAD + height + TITLE_GAP


def _heatmap_title(fig: go.Figure, text: str, height: int) -> None:
    """A heatmap's title and the top margin it needs: HEATMAP_TOP holds a title of one line and one line of
    key (the "prompt end" label sits under the key, above the plot)."""
    fig.update_layout(title_text=text, margin_t=HEATMAP_TOP + height - HEAD_LINE - NOTE_LINE)


def _cell_note(col: int, row: int) -> str:
    """What one cell of a binned heatmap holds, for its title ("" unbinned)."""
    return "" if col == row == 1 else f" · cell = {col} pos × {row} step{'s' * (row > 1)}"


def _position_range(z: np.ndarray, col: int) -> list[float]:
    """The heatmap's own columns, set rather than autoranged: a shape past them (the protected tail's band)
    widened one heatmap's axis, and the stacked retention and rank plots no longer lined up."""
    return [-0.5, z.shape[1] * col - 0.5]


def _apart(first: float, second: float) -> tuple[str, str]:
    """Two scores with the fewest significant digits (4 to 12) that tell them apart; the same text where
    they are equal.  At 4 digits two LazyEviction scores 1e-8 apart both read 0.2384."""
    for digits in range(4, 13):
        shown = f"{first:.{digits}g}", f"{second:.{digits}g}"
        if shown[0] != shown[1]:
            return shown
    return shown


def _empty_figure(text: str) -> go.Figure:
    # broken into lines, to fit a plot in a 1000-px window
    lines = textwrap.wrap(text, TITLE_12_CHARS) or [text]
    fig = go.Figure()
    fig.add_annotation(text="<br>".join(lines), showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(height=140 + SMALL_LINE * len(lines), margin=dict(l=20, r=20, t=20, b=20), xaxis_visible=False,
                      yaxis_visible=False)
    return fig


def _marker(fig: go.Figure, step: int | None) -> None:
    if step is not None:
        fig.add_hline(y=step, **STEP_MARKER)


def _marker_x(fig: go.Figure, step: int | None) -> None:
    if step is not None:
        fig.add_vline(x=step, **STEP_MARKER)

