"""What every Results figure shares: its title (at most two lines), the note kept for under it, small
multiples, cut axes, nudging coinciding points apart and the room a legend needs."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

# Plotly's modebar (download, zoom, ...) shows at the top right of a hovered figure, over whatever is there:
# every figure keeps this strip above its title free for it (a long title ran under it)
MODEBAR_STRIP = 24
MARGIN = dict(l=50, r=20, t=50 + MODEBAR_STRIP, b=40)
NOTE_HEIGHT = 22  # pixels of top margin per small line under a figure's title (a browser draws them 21 apart)
TITLE_PAD = 12 + MODEBAR_STRIP  # pixels above a title hung from the top of its figure
PANEL_TITLE_HEIGHT = 16  # pixels of top margin per line of the first row's panel titles
LEGEND_ROW = 30  # pixels a browser gives each legend entry of a line-and-marker trace
# Characters on one note line, and on a title's first line: longer ones ran past the edge of a figure in a
# 1000-px window (the page's 768-px column: ~115 small characters, ~70 of the title's)
NOTE_WIDTH, TITLE_WIDTH = 105, 70
# Marker per model in the measured-vs-paper panels, named in a note under the title.
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "pentagon")
GLYPHS = {"circle": "●", "square": "■", "diamond": "◆", "triangle-up": "▲", "x": "✕", "star": "★", "cross": "✚",
          "pentagon": "⬟"}

def _note_lines(note: str) -> list[str]:
    """``note`` as lines of at most about NOTE_WIDTH characters: broken at its "; " (between policies), where one
    line is not enough its head (up to its first "): ") on a line of its own, and a part still too long at
    spaces; none for an empty note."""
    head, colon, rest = note.partition("): ")
    if len(note) > NOTE_WIDTH and colon:
        return [*textwrap.wrap(head + "):", NOTE_WIDTH), *_note_lines(rest)]
    lines: list[str] = []
    for part in note.split("; ") if note else []:
        if lines and len(lines[-1]) + 2 + len(part) <= NOTE_WIDTH:
            lines[-1] += "; " + part
        else:
            lines += textwrap.wrap(part, NOTE_WIDTH)
    return lines


def _empty(fig: go.Figure, text: str = "no rows for these filters") -> go.Figure:
    """``fig`` saying ``text``, without axes to read (they would span a meaningless default range)."""
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


FACETS = ("source", "model", "task")  # what splits a figure into panels, when it varies
# The x axis of each kind of cell in the quality and max-length-hits figures: a compression cell sits at its ρ,
# a budget cell at its absolute budget (AvoKV-E's reasoning regime); a panel holds one kind.
CUT_AXES = {"compression": "compression ρ", "absolute_budget": "KV budget (tokens)"}


def _label(column: str, value) -> str:
    if column == "compression":
        return "full" if value != value else f"ρ={value:g}"  # NaN: the full cache has no ρ
    return str(value)


def _cut_label(compression, budget) -> str:
    """How a row cut the cache: ``B=64`` (an absolute budget), ``ρ=0.5``, or ``full`` (neither)."""
    if not pd.isna(budget):  # NaN or NA: a compression cell, or the full cache
        return f"B={budget:g}"
    return _label("compression", float("nan") if pd.isna(compression) else compression)


def _with_budgets(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with an ``absolute_budget`` column of floats, NaN where none (the store's is a nullable
    integer, whose NA neither compares nor mixes with ρ); a frame without one holds compression cells alone."""
    if "absolute_budget" not in frame:
        return frame.assign(absolute_budget=float("nan"))
    return frame.assign(absolute_budget=frame["absolute_budget"].astype(float))


def _versus(frame: pd.DataFrame) -> str:
    """What the policies' cells in ``frame`` vary, for a figure's title: compression, KV budget or both."""
    cells = _with_budgets(frame)
    cells = cells[cells.policy != "full"] if "policy" in cells else cells
    budget = cells.absolute_budget.notna()
    if budget.empty or not budget.any():
        return "compression"
    return "KV budget" if budget.all() else "compression or KV budget"


def _on_cut_axes(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each row's x axis (``axis``: a key of CUT_AXES) and its place on it (``position``).

    The full cache has neither a ρ nor a budget: it is drawn, as the usual flat reference, in every panel of
    its source / model / task, of either kind."""
    frame = _with_budgets(frame)
    budget = frame["absolute_budget"].notna()
    placed = frame.assign(axis=budget.map({True: "absolute_budget", False: "compression"}),
                          position=frame["absolute_budget"].where(budget, frame["compression"]))
    full = placed.policy.eq("full") if "policy" in placed else pd.Series(False, index=placed.index)
    if not full.any() or not budget.any():
        return placed
    facets = [c for c in FACETS if c in placed]
    kinds = placed[~full][[*facets, "axis"]].drop_duplicates()
    references = placed[full].drop(columns="axis").merge(kinds, on=facets, how="left")
    return pd.concat([placed[~full], references.fillna({"axis": "compression"})], ignore_index=True)


# Of a figure's plot width, between panels with a right-hand axis: its ticks, its title and the next panel's
# ticks side by side (at 0.1, a 1000-px figure's titles ran over the next panel's ticks; at 0.14, those of a
# figure in a 1000-px window, whose legend leaves its two panels ~380 px)
Y2_SPACING = 0.22


def _facets(frame: pd.DataFrame, title: str, ylabel: str, y2label: str | None = None, columns: int = 3,
            notes: list[str] = ()):
    """Small multiples: one panel per combination of source / model / task that varies in ``frame``.

    A column that takes one value goes into the title instead. Measured panels share their y range (all
    fractions); paper panels keep their own, as each printed table has its own scale; ``y2label``
    gives every panel a right-hand axis, shared the same way and titled on each panel. Returns the
    figure and ``[(panel keys, rows, row, col)]`` in drawing order; :func:`_axis_titles` labels the x axes
    once the traces are in.  ``notes`` and the title's parenthetical go to the note under the figure.
    """
    # ``axis`` (from _on_cut_axes) splits panels too, where both kinds occur; each panel's x title names it
    varying = [c for c in (*FACETS, "axis") if c in frame and frame[c].nunique(dropna=False) > 1]
    fixed = [_label(c, frame[c].iloc[0]) for c in FACETS if c in frame and c not in varying and not frame.empty]
    groups = list(frame.groupby(varying, dropna=False, sort=True)) if varying else [((), frame)]
    columns = min(columns, len(groups))
    rows = math.ceil(len(groups) / columns)
    titles = [_panel_title([_label(c, v) for c, v in zip(varying, keys if isinstance(keys, tuple) else (keys,))
                            if c != "axis"]) for keys, _ in groups] if varying else None
    title_lines = max((title.count("<br>") + 1 for title in titles), default=0) if titles else 0
    height = 120 + 260 * rows
    gap = 95 if "axis" in varying else 70  # room for ticks and a title (and an x title on every panel)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=titles,
                        horizontal_spacing=Y2_SPACING if y2label else 0.06,
                        vertical_spacing=gap / (height - MARGIN["t"] - MARGIN["b"]),
                        specs=[[{"secondary_y": bool(y2label)}] * columns] * rows)
    panels, first_axis = [], {}  # (source, secondary) -> the axis the others of that source match
    first_x = {}  # kind of x axis -> the x axis the other panels of that kind match
    # Each panel's axes updated directly: fig.update_yaxes(row=, col=) scans every axis of the figure for each
    # call, a quarter of a Results query's time on the shipped store.
    for index, (keys, part) in enumerate(groups):
        row, col = index // columns + 1, index % columns + 1
        panels.append((keys, part, row, col))
        source = part["source"].iloc[0] if "source" in part and not part.empty else None
        axes = {secondary: fig.get_subplot(row, col, secondary_y=secondary)
                for secondary in ((False, True) if y2label else (False,))}
        for secondary, panel in axes.items():
            if source == "paper" and not secondary:
                continue  # each printed table has its own scale (0-100, 0-1, %): each paper panel its own axis
            if (source, secondary) in first_axis:
                panel.yaxis.update(matches=first_axis[source, secondary])
            else:
                first_axis[source, secondary] = panel.yaxis.plotly_name.replace("axis", "")  # "y3"
        if y2label:  # on every panel: between two panels, an untitled right axis read as the next one's left
            axes[True].yaxis.update(title_text=y2label)
        axes[False].yaxis.update(title_text=ylabel if col == 1 else None)
        kind = part["axis"].iloc[0] if "axis" in part and not part.empty else None
        x_axis = axes[False].xaxis.plotly_name.replace("axis", "")  # "x3"
        if first_x.setdefault((source, kind), x_axis) != x_axis:
            # one x range per source and kind: measured panels compare at a glance, and a paper's budgets
            # (AvoKV-E's up to 1024) do not squeeze a measured sweep's into a corner
            axes[False].xaxis.update(matches=first_x[source, kind])
    _titled(fig, title, fixed, notes, extra=PANEL_TITLE_HEIGHT * title_lines)
    fig.update_layout(height=height + fig.layout.margin.t - MARGIN["t"], legend=dict(font=dict(size=10)))
    if y2label:  # the legend clear of the right-hand axis's ticks and title (by default it lay over the title)
        fig.update_layout(legend_x=1.09)
    fig.update_annotations(font_size=11)
    if frame.empty:
        _empty(fig)
    return fig, panels


def _panel_title(labels: list[str]) -> str:
    """A panel's title from its facet values: the last (the task) on a line of its own under the others
    (source, model); on one line, "paper · Llama-3.1-8B-Instruct · LongBench/2wikimqa" ran into its
    neighbours' titles in a figure under 1000 px wide."""
    return " · ".join(labels[:-1]) + "<br>" + labels[-1] if len(labels) > 1 else "".join(labels)


def _axis_titles(fig: go.Figure, panels: list, xlabel: str) -> None:
    """The x title under the lowest panel of each column only: above, it would collide with the titles of
    the panels below.  Panels on a compression and on a budget axis (:func:`_on_cut_axes`) each have their
    own title, with room made for it; panels all on one such axis get its name instead of ``xlabel``."""
    kinds = [part["axis"].iloc[0] if "axis" in part and not part.empty else None for _, part, _, _ in panels]
    if len(set(kinds)) > 1:
        for (_, _, row, col), kind in zip(panels, kinds):
            fig.get_subplot(row, col).xaxis.update(title_text=CUT_AXES[kind])
        return
    xlabel = CUT_AXES.get(kinds[0], xlabel) if kinds else xlabel
    lowest = {}
    for _, _, row, col in panels:
        lowest[col] = max(row, lowest.get(col, 0))
    for col, row in lowest.items():
        fig.get_subplot(row, col).xaxis.update(title_text=xlabel)


def _hover_counts(part: pd.DataFrame) -> list[str]:
    """What each point averages, for its hover: samples (a paper row: printed figures), or generations."""
    if "recorded" in part:
        return [f"{hits:g} of {recorded:g} generations" for hits, recorded in zip(part.hits, part.recorded)]
    if "samples" not in part:
        return [""] * len(part)
    unit = "printed figures" if "source" in part and part["source"].iloc[0] == "paper" else "samples"
    return [f"n = {n:g} {unit}" for n in part.samples]



def _axis_key(panel: pd.DataFrame) -> tuple:
    """The x axis a panel of :func:`_facets` shares with the others of its source and kind of cut."""
    return tuple(panel[c].iloc[0] if c in panel and not panel.empty else None for c in ("source", "axis"))


def _shared_extents(frame: pd.DataFrame, x: str, lone: float | None = None) -> dict[tuple, list[float]]:
    """Per x axis the panels share (:func:`_axis_key`), the span of ``x`` over all of them: where a reference
    line runs in each of its panels.  An axis of one value gets a short span around it, ``lone`` either side
    (default a tenth of the value, at least 0.05), or the line would be a point under that cut's markers."""
    extents = {}
    columns = [c for c in ("source", "axis") if c in frame]
    for _, part in frame.groupby(columns, dropna=False) if columns else [((), frame)]:
        low, high = part[x].min(), part[x].max()
        pad = 0.0 if high > low else (lone if lone is not None else max(abs(low) * 0.1, 0.05))
        extents[_axis_key(part)] = [low - pad, high + pad]
    return extents


DODGE = 0.025  # of an axis's span: how far apart on x coinciding points are drawn (a marker's width)
CLUSTER_ROOM = 0.6  # of the smallest gap between a panel's cuts: the widest a cluster of nudged points is drawn
DODGE_MOST = 4  # a larger cluster (every policy at 0 at ρ = 0.95) would spread past the cut: left as it is


def _dodge(frame: pd.DataFrame, y: str) -> pd.Series:
    """Per row of ``frame`` (placed by :func:`_on_cut_axes`), an x offset that draws apart the points of
    several lines at one cut with the same value (to 3 decimals) in one panel: tova, AvoKV-E and its
    interval-16 setting all at 0.063 on B=80 showed as one marker.  Points that stand alone, and clusters of
    more than DODGE_MOST, stay where they are; the full cache, a line across the panel, is never moved.  The
    step is DODGE of the span of the axis the panel shares (source and kind of cut), or of the cut itself
    where that axis holds one; at most what keeps a cluster within CLUSTER_ROOM of the panel's smallest gap
    between cuts (:func:`_nudge_step`)."""
    offsets = pd.Series(0.0, index=frame.index)
    if frame.empty:
        return offsets
    facets = [c for c in (*FACETS, "axis") if c in frame]
    moving = frame[frame.policy != "full"] if "policy" in frame else frame
    for _, axis in moving.groupby([c for c in ("source", "axis") if c in frame], dropna=False):
        span = axis.position.max() - axis.position.min()
        for _, panel in axis.groupby(facets, dropna=False):
            for _, group in panel.assign(value=panel[y].round(3)).groupby(["position", "value"], dropna=False):
                if 1 < len(group) <= DODGE_MOST:
                    step = _nudge_step(DODGE * (span or abs(group.position.iloc[0]) or 1.0), panel.position,
                                       len(group))
                    offsets[group.index] = step * (np.arange(len(group)) - (len(group) - 1) / 2)
    return offsets


def _nudge_step(step: float, cuts: pd.Series, points: int) -> float:
    """``step``, the x distance between neighbouring points of a cluster of ``points`` nudged apart around
    one cut, made small enough that the cluster spans at most CLUSTER_ROOM of the smallest gap between the
    panel's ``cuts``: wider, the clusters of neighbouring cuts (ρ 0.9 and 0.95) interleaved, and no point
    could be told to its cut."""
    distinct = np.unique(cuts.dropna())
    if points < 2 or len(distinct) < 2:
        return step
    return min(step, CLUSTER_ROOM * float(np.diff(distinct).min()) / (points - 1))


def _readable_range(fig: go.Figure, values: pd.Series, row: int, col: int) -> None:
    """A paper panel's y range, at least 10% of its largest value tall: printed figures that differ in the
    second decimal (52.52 against 52.62) would otherwise fill the panel as if they differed a lot."""
    low, high = values.min(), values.max()
    least = 0.1 * max(abs(low), abs(high))
    if pd.isna(low) or high - low >= least or least == 0:
        return
    middle = (low + high) / 2
    fig.get_subplot(row, col).yaxis.update(range=[middle - 0.6 * least, middle + 0.6 * least])



def _title(fig: go.Figure, title: str, notes: list[str]) -> None:
    """``title`` on the figure (hung from the top, clear of the modebar) and ``notes`` in the note under it."""
    fig.update_layout(title=dict(text=title, yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      margin=MARGIN, height=400 + MODEBAR_STRIP)
    _caption(fig, notes=notes)


def _titled(fig: go.Figure, title: str, fixed: list[str], notes: list[str], extra: int = 0) -> None:
    """A faceted figure's title: what it is, then the rows every panel shares (on a second, small line where
    one would run past a 1000-px figure's edge); its parenthetical and ``notes`` into the note under it."""
    head, paren, rest = title.partition(" (")
    shown = " · ".join(fixed)
    second = bool(fixed) and len(head) + 3 + len(shown) > TITLE_WIDTH
    text = f"{head}<br><sup>{shown}</sup>" if second else f"{head} · {shown}" if fixed else head
    top = MARGIN["t"] + NOTE_HEIGHT * second + extra
    fig.update_layout(title=dict(text=text, yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      margin={**MARGIN, "t": top})
    _caption(fig, notes=[f"({rest}" if paren else "", *notes])


def _caption(fig: go.Figure, read: str | None = None, notes: list[str] = ()) -> go.Figure:
    """Keep on ``fig`` (its ``layout.meta``) what the tab writes under it: one sentence on how to read it,
    and its caveats, each added to those it has."""
    meta = dict(fig.layout.meta or {})
    meta["read"] = read or meta.get("read", "")
    meta["notes"] = [*meta.get("notes", []), *(note for note in notes if note)]
    fig.update_layout(meta=meta)
    return fig


def caption_of(fig: go.Figure) -> tuple[str, list[str]]:
    """The how-to-read sentence and the caveats :func:`_caption` kept on ``fig``."""
    meta = fig.layout.meta or {}
    return meta.get("read", ""), list(meta.get("notes", []))


def note_markdown(fig: go.Figure) -> str:
    """What the tab shows under ``fig``: how to read it, then its caveats as a list."""
    read, notes = caption_of(fig)
    return "\n".join([f"**How to read it:** {read}" if read else "", *(f"- {note}" for note in notes)])


def legend_entries(fig: go.Figure) -> int:
    """How many entries ``fig``'s legend lists: its named scatter traces not left out of it (Plotly lists a
    trace whose ``showlegend`` is unset where the figure has more than one)."""
    scatters = [trace for trace in fig.data if trace.type == "scatter" and trace.name]
    return sum(trace.showlegend or (trace.showlegend is None and len(fig.data) > 1) for trace in scatters)


def _legend_room(fig: go.Figure) -> None:
    """``fig`` made tall enough that its legend, beside the plot, fits its plot area (Plotly's bound for such
    a legend): a longer one scrolled (every setting shown, 17-27 entries in figures 400-700 px tall)."""
    margin = fig.layout.margin
    top, bottom = (100 if margin.t is None else margin.t), (80 if margin.b is None else margin.b)  # or Plotly's
    height = fig.layout.height or 450  # Plotly's default
    needed = top + bottom + LEGEND_ROW * legend_entries(fig)
    if needed > height:
        fig.update_layout(height=needed, margin=dict(t=top, b=bottom))


