"""The Compare tab's views of a comparison: a retention panel per policy, the divergence lines and Jaccard
plot, the followed prompt tokens' fates and the stability table.  Plain values; :mod:`.compare` places them."""

from __future__ import annotations

import textwrap

import gradio as gr
import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .. import diagnostics
from ..trace import Trace
from .common import column_widths, diagnostic_rows
from .figures import LEGEND_LINE, MAX_FOLLOWED, NEVER, RunView, step_dtick, step_range

PANEL_TITLE_CHARS = 20  # what a quarter-width panel's title holds on a line
PROMPT_END_GAP = 14  # pixels between a Compare panel's title and its plot, where "prompt end" is written


def panel_title(name: str, view: RunView, followed: list[int] | None = None) -> list[str]:
    """The lines of a Compare panel's title: the setting's label, then the key in small print."""
    # Narrow columns: the policy's name, and the key in small print below it (not the Live tab's
    # long title, which ran past the panel's edge).
    key = "dark kept · pale evicted" + (" · green protected" if any(view.pinned) else "")
    key += " · red followed" if followed else ""
    key += f" · ended at step {view.ended}" if view.ended is not None else ""
    # A setting's label wrapped at its spaces: cut at the panel's edge, the part that tells two
    # settings apart ("... lambda_b=0", "... normalise=false") was the part lost.  The key in small print
    # holds about twice the characters, and wraps at its dots (four panels cut it at "· r").
    lines = textwrap.wrap(name, PANEL_TITLE_CHARS) or [name]
    keys = [""]
    for item in key.split(" · "):
        joined = f"{keys[-1]} · {item}" if keys[-1] else item
        keys[-1:] = [joined] if len(joined) <= 2 * PANEL_TITLE_CHARS or not keys[-1] else [keys[-1], item]
    return lines + [f"<span style='font-size:10px'>{line}</span>" for line in keys]


def compare_panel(name: str, view: RunView, followed: list[int] | None = None, title_lines: int = 0) -> go.Figure:
    """One policy's retention panel in the Compare tab, with the ``followed`` prompt positions drawn on a
    copy (the streaming figure that ``view`` reuses stays unmarked).  ``title_lines``: the most title lines
    of the panels shown beside it, so that every panel's plot starts at the same height (a label that
    wraps made one panel taller, its axes out of line with the others')."""
    figure = view.retention_figure(followed=followed)
    figure.update_traces(showscale=False, selector=dict(type="heatmap"))  # a narrow panel: its title is the key
    lines = panel_title(name, view, followed)
    rows = max(len(lines), title_lines) - 1
    # The title hangs from the top, with a gap above the plot for the "prompt end" label, which the key's
    # last line overlapped in a narrow panel
    height = 320 + 20 * rows + PROMPT_END_GAP
    figure.update_layout(title=dict(text="<br>".join(lines), yref="container", yanchor="top", y=1 - 18 / height,
                                    pad_t=0),
                         height=height, margin=dict(l=40, r=10, t=40 + 20 * rows + PROMPT_END_GAP, b=35,
                                                    autoexpand=True),
                         xaxis_title="position", yaxis_title="step")
    return figure


def compare_panels(views: dict[str, RunView], followed: list[int] | None = None) -> list[go.Figure]:
    """Every compared policy's panel (:func:`compare_panel`), their plots at one height and on the same
    position and step ranges: a run that ended early (end of sequence) drew its fewer steps over the panel's
    full height, and its cells read as larger than its neighbours'."""
    lines = max(len(panel_title(name, view, followed)) for name, view in views.items())
    panels = [compare_panel(name, view, followed, lines) for name, view in views.items()]
    cells = [next(trace for trace in panel.data if trace.type == "heatmap") for panel in panels]
    positions = max(len(cell.z[0]) * cell.dx if len(cell.z) else 0 for cell in cells)  # a binned cell spans dx
    steps = max(len(cell.z) * cell.dy for cell in cells)
    for panel in panels:
        panel.update_xaxes(range=[-0.5, positions - 0.5])
        panel.update_yaxes(range=step_range(steps)[::-1], autorange=False, dtick=step_dtick(steps))  # step 0 on top
    return panels


def ended_note(view: RunView) -> str:
    """``" · ended at step 12 (end of sequence)"`` for a run that produced its end of sequence, else ""."""
    return "" if view.ended is None else f" · ended at step {view.ended} (end of sequence)"


def compared_labels(views: dict[str, RunView]) -> list[str]:
    """The compared runs' panel labels: each setting, and where its run produced its end of sequence."""
    return [name + ended_note(view) for name, view in views.items()]


def divergence_markdown(names, views) -> str:
    """The comparison's sizes (L0, B and what each policy's cache reached while decoding, over B where it
    checkpoints or evicted at the prefill only), then where each policy's text first left the first's."""
    tokens = {n: [e.new_token_id for e in views[n].events] for n in names}
    reference = names[0]
    first_view = views[reference]
    held = ", ".join(f"{name} {max(e.cache_size for e in views[name].events[1:])}" for name in names
                     if len(views[name].events) > 1)
    lines = [f"**prompt** {first_view.prompt_len} tokens · **budget** B = {first_view.budget}"
             + (f" · **largest cache while decoding**: {held}" if held else "")]
    for name in names[1:]:
        a, b = tokens[reference], tokens[name]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        lines.append(f"- **{name}** vs **{reference}**: " + (
            f"first different token at step {first}" if first is not None else
            f"identical for the {count} token{'s' * (count != 1)} both produced"
            if (count := min(len(a), len(b))) else "no token from both yet"))
    # A run that ended early has no later steps to compare: its panel is shorter, its fates end there
    lines += [f"- **{name}** ended at step {views[name].ended}: it produced its end of sequence"
              for name in names if views[name].ended is not None]
    return "\n".join(lines)


def jaccard_figure(names, views) -> go.Figure:
    fig = go.Figure()
    reference = names[0]
    for name in names[1:]:
        pairs = diagnostics.keep_set_jaccard_over_time(
            Trace([], 0, reference, events=views[reference].events), Trace([], 0, name, events=views[name].events))
        fig.add_scatter(x=[s for s, _ in pairs], y=[j for _, j in pairs], name=f"{name} vs {reference}")
    steps = max(view.steps for view in views.values())
    # the legend under the plot, a pair a line: beside it, four long settings' pairs left the plot 60 px wide
    pairs = len(names) - 1
    fig.update_layout(title="Jaccard of the keep sets over time", xaxis_title="decode step", yaxis_title="Jaccard",
                      xaxis_dtick=step_dtick(steps), yaxis_range=[0, 1.02], height=300 + LEGEND_LINE * pairs,
                      margin=dict(l=50, r=20, t=40, b=80 + LEGEND_LINE * pairs), showlegend=True,
                      legend=dict(orientation="v", yanchor="top", y=-0.3, x=0))
    if steps <= 10:  # the steps there are: a comparison stopped at the prefill autoranged to steps -1 to 1
        fig.update_xaxes(range=step_range(steps))
    return fig


def compare_diagnostics(views: dict[str, RunView] | None):
    """InertiaKV Appendix I's stability diagnostics side by side, a column per compared policy: raw and utility
    top-B churn, keep turnover, raw/utility Jaccard, the share of each step's raw top-B that it evicted and
    the raw and utility rank stabilities (means over steps, k = the budget; n/a where a policy records no raw
    score or no utility), as the Live tab lists them: a row per diagnostic, a column per policy, and a last
    row counting the steps the raw rows average over."""
    if not views:
        return gr.update(value=None, visible=False)
    columns = {}
    for name, view in views.items():
        # the diagnostics read the budget and the decode events only; the prompt's ids are not kept here
        trace = Trace([0] * view.prompt_len, view.budget, name, events=view.events)
        values = diagnostic_rows(trace)
        columns.setdefault("diagnostic", list(values))
        columns[name] = list(values.values())
    # a column per policy (at most four), a row per diagnostic: the eight diagnostics as columns scrolled sideways
    return gr.update(value=pd.DataFrame(columns), visible=True,
                     column_widths=column_widths(36, others=len(columns) - 1))


def followed_prompt_tokens(views: dict[str, RunView], query: str) -> tuple[list[int], str]:
    """The prompt positions a comparison follows, and how they were found: those ``query`` names, or with
    nothing typed those some policies keep to the end and others evict (the first MAX_FOLLOWED)."""
    names = list(views)
    first = views[names[0]]
    if (query or "").strip():
        return first.follow(query, first.steps - 1, prompt_only=True)
    cached = np.array([views[name].left[:first.prompt_len] == NEVER for name in names])  # kept to the end
    disputed = np.flatnonzero(cached.any(0) & ~cached.all(0)).tolist()
    note = (f"{len(disputed)} prompt tokens some policies keep to the end and others evict"
            + (f" (the first {MAX_FOLLOWED})" if len(disputed) > MAX_FOLLOWED else "")
            if disputed else "the policies keep the same prompt tokens to the end")
    return disputed[:MAX_FOLLOWED], note


def compare_fates(views: dict[str, RunView] | None, query: str, followed: tuple | None = None) -> tuple:
    """For each followed prompt token, what each compared policy did with it: kept to the end, or the step
    that evicted it.  With nothing typed: the prompt tokens the policies disagree on at the end.
    ``followed``: :func:`followed_prompt_tokens` of ``query``, where the caller has it already."""
    if not views:
        # also while one runs (its state is set as it ends)
        return "*The fates show once a comparison has ended: follow the prompt tokens that matter (e.g. the " \
            "needle).*", \
            gr.update(value=None, visible=False)
    positions, note = followed or followed_prompt_tokens(views, query)
    if not positions:
        return f"*{note}*", gr.update(value=None, visible=False)
    names = list(views)
    first = views[names[0]]
    fates = {name: [views[name].evicted_at(p) for p in positions] for name in names}
    # Runs that diverge end at different steps: each column says how far its "kept" reaches.
    # "#", as positions are typed (#12): a word header broke mid-word in a column as wide as its values
    frame = pd.DataFrame({"#": positions, "token": [first.token_cell(p) for p in positions],
                          **{f"{name} (to step {views[name].steps - 1})":
                             ["kept" if step is None else f"evicted at step {step}" for step in steps]
                             for name, steps in fates.items()}})
    kept_counts = ", ".join(f"**{name}** {sum(step is None for step in steps)}" for name, steps in fates.items())
    marked = " Marked in red on the retention panels." if (query or "").strip() else ""
    ends = {name: views[name].steps - 1 for name in names}
    # A run that ended early (its end-of-sequence, as sampling often draws) had fewer steps in which to evict
    horizon = min(ends.values())  # where every run was still going: the counts that compare like with like
    uneven = ("" if len(set(ends.values())) == 1 else " The runs ended at different steps ("
              + ", ".join(f"{name} {end}" for name, end in ends.items())
              + "): each policy's count here, and its stability column, cover its own run only. Still kept at "
              f"step {horizon}, where the shortest ended: "
              + ", ".join(f"**{name}** {sum(step is None or step > horizon for step in steps)}"
                          for name, steps in fates.items()) + ".")
    return f"Followed: {note}. Kept to the end, of {len(positions)}: {kept_counts}.{marked}{uneven}", \
        gr.update(value=frame, visible=True, column_widths=column_widths(9, 21, others=len(names)))
