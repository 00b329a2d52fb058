"""The Results figures of their own shape: measured vs paper, quality against decode speed and against the
cache held, the damage ranking's bars and the needle grid's heatmaps."""

from __future__ import annotations

import math
import textwrap

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ...policies import REGISTRY
from ...store import ranking_caveats
from .colours import Colours
from .layout import (
    GLYPHS,
    MARGIN,
    MODEBAR_STRIP,
    NOTE_HEIGHT,
    PANEL_TITLE_HEIGHT,
    SYMBOLS,
    TITLE_PAD,
    _caption,
    _cut_label,
    _empty,
    _title,
    _with_budgets,
)


def _comparison_figure(frame: pd.DataFrame, suite: str, colours: Colours, notes: list[str] = ()) -> go.Figure:
    """Paper panel(s) and the measured panel side by side, each source relative to its own full cache;
    ``notes`` (what each side averages, and the tasks left out) under the title."""
    origins = list(dict.fromkeys(frame.origin)) if not frame.empty else []
    if not origins:
        return _empty(go.Figure(), f"no paper and measured rows to compare on {suite}")
    # more models than symbols: round again (the hover names the model)
    symbols = {model: SYMBOLS[i % len(SYMBOLS)] for i, model in enumerate(sorted(set(frame.model)))}
    # The marker key is a note line: in the panel titles, three models' names ran past a half-width panel
    key = "markers: " + ", ".join(f"{GLYPHS[symbols[m]]} {m}" for m in sorted(symbols)) + " (the hover names each)"
    fig = make_subplots(rows=1, cols=len(origins), shared_yaxes=True, subplot_titles=origins)
    shown = set()
    for col, origin in enumerate(origins, start=1):
        part = frame[frame.origin == origin]
        for (model, policy), line in part.groupby(["model", "policy"]):
            fig.add_scatter(
                x=line.compression, y=line.relative, mode="lines+markers", name=policy, legendgroup=policy,
                showlegend=policy not in shown, row=1, col=col,
                line=dict(color=colours(policy), dash="dash" if origin.startswith("paper") else "solid"),
                marker=dict(symbol=symbols[model]),
                customdata=line[["score", "full_score", "tasks"]].values,
                hovertemplate=(f"{policy} · {model}<br>ρ=%{{x}}<br>relative %{{y:.3f}}<br>"
                               "score %{customdata[0]:.3g} of full %{customdata[1]:.3g}<br>"
                               "tasks %{customdata[2]}<extra></extra>"))
            shown.add(policy)
        fig.add_hline(y=1.0, line_dash="dot", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="compression ρ", row=1, col=col)
    fig.update_yaxes(title_text="score / full-cache score", row=1, col=1)
    fig.update_layout(legend=dict(font=dict(size=10)))
    fig.update_annotations(font_size=11)
    _title(fig, f"Measured vs paper: {suite}, relative to each source's full cache", [key, *notes])
    _caption(fig, "Each line is a policy's score over its own source's full-cache score (1: nothing lost), "
                  "measured and paper side by side: compare the shapes of the lines, not their levels.")
    # the panels' titles (the legend's room: query's _legend_room)
    fig.update_layout(margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT,
                      height=fig.layout.height + PANEL_TITLE_HEIGHT)
    return fig


def _comparable(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows whose means can stand side by side, one point per (model, policy, cut), and what they cover.

    Per model and kind of cut (compression or absolute budget): only the tasks that every policy has at
    every cut of that kind, and the full cache over those same tasks, once per kind (column ``kind``).
    Averaging whatever tasks each point has would put a policy run on three tasks next to one run on four,
    or a greedy reasoning sweep's mean next to a sampled one's.  The notes, one per (model, kind), name the
    tasks and those left out.
    """
    cells = _with_budgets(frame)
    cells = cells.assign(kind=cells.absolute_budget.notna().map({True: "budget", False: "compression"}))
    full, evicting = cells[cells.policy == "full"], cells[cells.policy != "full"]
    if evicting.empty:  # the full cache alone: one point per task set it has, nothing to match
        return full.assign(kind="full"), [f"full cache: mean over {', '.join(sorted(set(full.task)))}"]
    several = evicting.model.nunique() > 1
    parts, notes = [], []
    for (model, kind), part in evicting.groupby(["model", "kind"]):
        tasks = part.groupby(["policy", "compression", "absolute_budget"], dropna=False).task.agg(frozenset)
        common = sorted(frozenset.intersection(*tasks))
        left_out = sorted(set(part.task) - set(common))
        parts += [part[part.task.isin(common)], full[(full.model == model) & full.task.isin(common)].assign(kind=kind)]
        note = (f"{kind} cells: mean over {', '.join(common)}" if common else
                f"{kind} cells: no task is run at every point, so none is shown; pick a task")
        if common and left_out:
            note += f"; {', '.join(left_out)} left out (not run at every point)"
        notes.append(f"{model}, {note}" if several else note)
    return pd.concat(parts), notes


def _per_point(frame: pd.DataFrame, values: list[str]) -> pd.DataFrame:
    """``values`` averaged per (model, kind, policy, compression or absolute budget) over the tasks of
    :func:`_comparable`'s ``frame``; with a ``sweeps`` column, also the sweeps each point's rows come from
    (speeds compare within one run, not across machines)."""
    groups = _with_budgets(frame).groupby(["model", "kind", "policy", "compression", "absolute_budget"],
                                          dropna=False)
    points = groups[values].mean()
    if "sweeps" in frame:
        points["sweeps"] = groups.sweeps.agg(lambda names: ", ".join(sorted(
            {name for joined in names.dropna() for name in joined.split(", ")})) or "not recorded")
    return points.reset_index()


def _point_labels(part: pd.DataFrame, kinds: int) -> list[str]:
    """Each point's cut for the hover; the full cache's says which kind's tasks it averages, if both show."""
    return [f"full ({kind} tasks)" if policy == "full" and kinds > 1 else _cut_label(c, b)
            for policy, kind, c, b in zip(part.policy, part.kind, part.compression, part.absolute_budget)]


SWEEPS_WIDTH = 45  # characters of sweep names on one line of a speed panel's title (half of a 1000-px figure)


KIND_SYMBOLS = {"compression": "circle", "budget": "square", "full": "circle"}


def _cut_order(part: pd.DataFrame) -> pd.Series:
    """How hard each of a kind's cells cuts the cache, 0 (least) to 1 (most): a compression's ρ up, an absolute
    budget down; the full cache 0."""
    budget = part.absolute_budget.notna()
    severity = part.compression.where(~budget, -part.absolute_budget).astype(float)
    ranks = severity.rank(method="dense") - 1
    top = ranks.max()
    return (ranks / top).fillna(0.0) if top and top > 0 else pd.Series(0.0, index=part.index)


def _speed_figure(frame: pd.DataFrame, colours: Colours) -> go.Figure:
    """Quality against measured decode speed, one point per (policy, compression or budget), averaged over
    the tasks every point has (:func:`_comparable`).

    A panel per kind of cell: compression cells and absolute-budget cells come from other sweeps, prompts and
    lengths, so their speeds never share an axis (each panel names the sweeps its points come from).  A line
    per policy joins its cells in order of the cut, the marker the larger the harder the cut."""
    if frame.empty:
        return _empty(go.Figure(), "no measured rows with a decode speed for these filters")
    rows, notes = _comparable(frame)
    per_point = _per_point(rows, ["score", "decode_tok_s", "decode_cache"])
    several = per_point.model.nunique() > 1
    kinds = sorted(per_point.kind.unique(), key=["compression", "budget", "full"].index)
    names = {"compression": "compression cells (ρ)", "budget": "absolute-budget cells", "full": "full cache"}
    titles = []
    for kind in kinds:
        sweeps = sorted({name for joined in per_point[per_point.kind == kind].sweeps for name in joined.split(", ")})
        # what the panel holds on a line, its sweeps wrapped under it: on one line, four sweeps' names ran into
        # the next panel's title at 1000 px
        wrapped = textwrap.wrap(", ".join(sweeps), SWEEPS_WIDTH, break_on_hyphens=False)  # a name stays whole
        titles.append("<br>".join([names[kind], *wrapped]))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=titles, horizontal_spacing=0.08)
    shown = set()
    for col, kind in enumerate(kinds, start=1):
        panel = per_point[per_point.kind == kind]
        order = _cut_order(panel[panel.policy != "full"]).reindex(panel.index, fill_value=0.0)
        for (model, policy), part in panel.assign(order=order).groupby(["model", "policy"]):
            part = part.sort_values("order")
            cuts = _point_labels(part, 1)
            name = f"{policy} · {model}" if several else policy
            # No text on the points: a dozen policies share one cluster of speeds; the hover names the cut.
            fig.add_scatter(x=part.decode_tok_s, y=part.score, name=name, legendgroup=name,
                            showlegend=name not in shown, mode="lines+markers",
                            line=dict(color=colours(policy), width=1),
                            marker=dict(size=7 + 7 * part.order, color=colours(policy), symbol=KIND_SYMBOLS[kind]),
                            customdata=list(zip(cuts, part.decode_cache, part.sweeps)),
                            hovertemplate=(f"{policy}<br>%{{customdata[0]}}<br>score %{{y:.3f}}<br>"
                                           "%{x:.2f} tok/s<br>largest cache while decoding %{customdata[1]:.0f}"
                                           "<br>run: %{customdata[2]}<extra></extra>"), row=1, col=col)
            shown.add(name)
        fig.update_xaxes(title_text="decode tok/s", row=1, col=col)
    fig.update_yaxes(title_text="mean score", row=1, col=1)
    fig.update_layout(legend=dict(font=dict(size=10)))
    fig.update_annotations(font_size=11)
    _title(fig, "Quality vs decode speed (measured)", notes)
    _caption(fig, "Up and to the right is better: each line joins a policy's cells, the marker the larger the "
                  "harder the cut; compare speeds within one run only.")
    lines = max(title.count("<br>") + 1 for title in titles)  # the panels' titles
    fig.update_layout(margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT * lines + 4,
                      height=fig.layout.height + PANEL_TITLE_HEIGHT * lines + 4)
    return fig

def _cache_figure(frame: pd.DataFrame, colours: Colours) -> go.Figure:
    """Quality against the cache each policy really held: one point per (policy, compression or budget), at
    the mean over samples of the largest cache any decode step held, averaged over the tasks every point
    has (:func:`_comparable`), with the full cache's score over the same tasks as a dotted line.  The same
    nominal B is not the same memory: a checkpointed policy (AvoKV-E, R-KV, LazyEviction) runs up to
    B + interval - 1, a prefill-time one grows by the tokens generated; AvoKV-E compares policies at matched
    active-KV sizes, which this axis shows."""
    fig = go.Figure()
    evicting = frame[frame.policy != "full"]
    if evicting.empty:
        return _empty(fig, "no measured rows of an evicting policy with a decode speed for these filters")
    # The largest cache while decoding: a row's max_cache also counts the prefill, where at a compression
    # every decode-time policy once held its whole prompt.  Older rows that cannot tell the two apart are
    # left out (decode_cache: the store says how).
    if evicting.decode_cache.isna().all():
        return _empty(fig, "no measured cells with a decode-time cache size for these filters (rows written "
                           "before sweeps recorded max_decode_cache cannot tell it at a compression for "
                           "policies that evict while decoding)")
    rows, notes = _comparable(frame[frame.decode_cache.notna() | (frame.policy == "full")])
    per_point = _per_point(rows, ["score", "decode_cache"])
    kinds = per_point[per_point.policy != "full"].kind.nunique()
    several = per_point.model.nunique() > 1
    shown = set()
    # One line per policy and kind of cut: absolute budgets and compressions come from other prompts and tasks
    for (model, policy, kind), part in per_point[per_point.policy != "full"].groupby(["model", "policy", "kind"]):
        part = part.sort_values("decode_cache")
        cuts = _point_labels(part, kinds)
        name = f"{policy} · {model}" if several else policy
        fig.add_scatter(x=part.decode_cache, y=part.score, name=name, legendgroup=name,
                        showlegend=name not in shown, mode="lines+markers",
                        marker=dict(size=9, color=colours(policy), symbol=KIND_SYMBOLS[kind]),
                        line=dict(color=colours(policy), width=1),
                        customdata=cuts, hovertemplate=(f"{policy}<br>%{{customdata}}<br>score %{{y:.3f}}<br>"
                                                        "largest cache while decoding %{x:.0f} entries"
                                                        "<extra></extra>"))
        shown.add(name)
    # The full cache's scores as dotted lines named in the legend (a label on the plot sat on the points)
    evicting_cache = per_point[per_point.policy != "full"].decode_cache
    span = [evicting_cache.min(), evicting_cache.max()]
    for row in per_point[per_point.policy == "full"].itertuples():
        what = " · ".join(filter(None, [row.model if several else "", f"{row.kind} tasks" if kinds > 1 else ""]))
        name = f"full cache{f' ({what})' if what else ''}: {row.score:.2f}"
        fig.add_scatter(x=span, y=[row.score] * 2, name=name, mode="lines", hoverinfo="name",
                        line=dict(dash="dashdot" if row.kind == "budget" else "dot", color=colours("full"), width=1))
    fig.update_layout(xaxis_title="largest cache while decoding (entries, mean over samples)",
                      yaxis_title="mean score", legend=dict(font=dict(size=10)))
    _title(fig, "Quality vs the cache actually held (measured)",
           notes + (["squares: budget cells; dotted (dash-dot for the budget cells): the full cache over the same "
                     "tasks"] if kinds > 1
                    else ["dotted: the full cache over the same tasks"]))
    _caption(fig, "Each point is a policy's score against the cache it really held while decoding: at equal x, "
                  "the higher point keeps more of the answer for the same memory.")
    return fig

# the top decile, so a random ranking finds a tenth of it among any k entries and has that precision.
RANKING_PANELS = {"auroc": ("AUROC", 0.5), "ap": ("average precision", 0.1), "topk_recall": ("top-k recall", 0.1),
                  "false_safe_rate": ("false-safe rate (lower is better)", 0.1), "spearman": ("Spearman", 0.0)}
RANKING_BAR = 17  # pixels per bar of a ranking panel
PAPER_GREY = "#A0A0A0"  # a paper's scorer that is none of our policies ('attention only', 'ThinKV-style proxy')


def _ranking_labels(frame: pd.DataFrame) -> pd.Series:
    """Each row's bar label: the policy; a paper's scorer as ``AvoKV-E: attention only``; and where measured rows
    come from more than one ranking sweep (another model, task or step), the measured ones with their sweep."""
    measured = frame.source == "measured"
    several = frame[measured].sweep.nunique() > 1
    return pd.Series([f"{row.paper}: {row.policy}" if row.source == "paper"
                      else f"{row.policy} · {row.sweep}" if several else row.policy
                      for row in frame.itertuples()], index=frame.index)


def _ranking_hover(bar, metric: str) -> str:
    """A bar's hover: a measured mean with its standard error, traces and entries; a paper's printed figure
    with where the paper says it comes from."""
    if bar.source == "paper":
        where = "<br>".join(textwrap.wrap(bar.notes, 80)) if isinstance(bar.notes, str) else "the paper's figure"
        return f"{bar.label}<br>{metric} {bar.score:.3f} (printed)<br>{where}"
    spread = f" ± {bar.stderr:.3f}" if pd.notna(bar.stderr) else ""
    entries = f", {int(bar.candidates)} entries ranked" if pd.notna(bar.candidates) else ""
    return (f"{bar.label}<br>{metric} {bar.score:.3f}{spread}<br>{bar.model} · {bar.task} · {bar.sweep}<br>"
            f"{int(bar.traces)} trace(s){entries}")


def _ranking_caveats(measured: pd.DataFrame) -> list[str]:
    """What qualifies the measured bars: traces whose replay ran past the answer's end, and how many of the
    ranked entries were the prompt's (per sweep; every policy of a sweep ranks the same entries)."""
    lines = []
    caveats = ranking_caveats(measured)
    several = len(caveats) > 1
    # the probe decodes past the end of a short answer: its replay there is not the answer's
    ended = [f"{int(row.past_end)} trace(s){f' of {sweep}' if several else ''}"
             + (f" ({int(row.ended_by_step)} at or before the probed step)" if row.ended_by_step else "")
             for sweep, row in caveats.iterrows() if row.past_end]
    if ended:
        lines.append(f"in {'; '.join(ended)} the full-cache answer ended within or before the probe's replay")
    shares = [f"{row.prompt_share:.0%}" + (f" in {sweep}" if several else "")
              for sweep, row in caveats.iterrows() if row.prompt_share == row.prompt_share]
    if shares:
        lines.append(f"prompt entries among those ranked: {', '.join(shares)} (the rest were generated)")
    return lines


def _ranking_figure(frame: pd.DataFrame, colours: Colours, notes: list[str] = ()) -> go.Figure:
    """AvoKV-E's oracle ranking table as bars: a panel per metric, a bar per scorer (measured: the mean over
    traces with ± 1 standard error; a paper's: its one printed figure, hatched), the scorers in the order of
    their AUROC within each source and measured sweep, and a random ranking's value dotted."""
    if frame.empty:
        return _empty(go.Figure(), "no damage-ranking rows for these filters (run `kvviz bench ranking "
                                   "configs/ranking-arithmetic.toml`)")
    frame = frame.assign(paper=frame.paper.fillna("paper"))  # a paper row may not say which paper
    frame = frame.assign(label=_ranking_labels(frame))
    auroc = frame[frame.metric == "auroc"].set_index("label").score
    sweep_of = frame.drop_duplicates("label").set_index("label").sweep
    # measured first, each sweep's bars together (they ranked different entries), by AUROC within it
    order = sorted(frame.label.unique(), key=lambda label: (
        not frame[frame.label == label].source.eq("measured").any(), str(sweep_of[label]),
        -auroc.get(label, -np.inf), label))
    metrics = [metric for metric in RANKING_PANELS if metric in set(frame.metric)]
    columns = min(3, len(metrics))
    grid_rows = -(-len(metrics) // columns)
    fig = make_subplots(rows=grid_rows, cols=columns, shared_yaxes=True, horizontal_spacing=0.03,
                        vertical_spacing=0.1, subplot_titles=[RANKING_PANELS[m][0] for m in metrics])
    for index, metric in enumerate(metrics):
        row, col = index // columns + 1, index % columns + 1
        part = frame[frame.metric == metric].set_index("label").reindex(order).dropna(subset=["score"])
        paper = part.source == "paper"
        fig.add_bar(
            x=part.score, y=part.index, orientation="h", row=row, col=col, showlegend=False,
            marker=dict(color=[colours(bar.policy) if bar.source == "measured" or bar.policy in REGISTRY
                               else PAPER_GREY for bar in part.itertuples()],
                        pattern=dict(shape=["/" if p else "" for p in paper], solidity=0.4)),
            # none for a paper's figure or a lone trace (a zero-width bar would read as certainty)
            error_x=dict(array=[None if value != value else value for value in part.stderr], thickness=1, width=3,
                         color="#404040"),
            hovertext=[_ranking_hover(bar, RANKING_PANELS[metric][0]) for bar in part.reset_index().itertuples()],
            hovertemplate="%{hovertext}<extra></extra>")
        chance = RANKING_PANELS[metric][1]
        fig.add_vline(x=chance, line_dash="dot", line_color="grey", row=row, col=col)
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], tickfont=dict(size=10))
    fig.update_annotations(font_size=11)
    measured = frame[frame.source == "measured"]
    papers = frame[frame.source == "paper"]
    lines = []
    if len(measured):
        lines.append(f"solid: measured, the mean over {int(measured.traces.max())} traces ± 1 standard error; "
                     f"{', '.join(sorted(set(measured.model)))} on {', '.join(sorted(set(measured.task)))}")
    lines += _ranking_caveats(measured)
    if len(papers):
        lines.append(f"hatched: {', '.join(sorted(set(papers.paper)))}'s printed figures, over all its traces "
                     f"({', '.join(sorted(set(papers.model)))}, {', '.join(sorted(set(papers.task)))}): "
                     "compare orders, not levels")
    lines.append("dotted: a random ranking (high damage = the top decile of a trace's oracle damage)")
    _title(fig, "Damage ranking: each utility against the oracle damage of one entry", [*lines, *notes])
    _caption(fig, "Each bar is how well a policy's utility ranks the entries whose removal hurts most: past the "
                  "dotted line (a random ranking) is better than chance, and false-safe is better lower.")
    bars = len(order)
    panel = max(RANKING_BAR * bars, 120)
    fig.update_layout(height=fig.layout.height - 400 + grid_rows * (panel + 60) + 40,
                      margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT, margin_l=10)
    fig.update_yaxes(automargin=True)
    return fig


def _grid_figure(frame: pd.DataFrame, empty: str = "no needle-grid rows for these filters") -> go.Figure:
    """One heatmap (depth × context length) per (policy, compression or absolute budget), each cell's score
    written in it."""
    if frame.empty:
        return _empty(go.Figure(), empty)
    panels = list(_with_budgets(frame).groupby(["model", "policy", "compression", "absolute_budget"], dropna=False))
    several = frame.model.nunique() > 1  # a panel per model too, named
    # three a row: five in a 1000-px window ran each panel's depth labels over its neighbour's cells and its
    # title into the next one's
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    titles = [(f"{m}<br>" if several else "") + ("full cache" if p == "full" else f"{p} {_cut_label(c, b)}")
              for (m, p, c, b), _ in panels]
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=titles, horizontal_spacing=0.07,
                        vertical_spacing=0.12 / max(rows, 1) + 0.04)
    for index, (_, part) in enumerate(panels):
        pivot = part.pivot_table(index="depth", columns="length", values="score")
        fig.add_heatmap(z=pivot.values, x=[str(c) for c in pivot.columns], y=[f"{d:.0%}" for d in pivot.index],
                        colorscale="RdYlGn", zmin=0, zmax=1, showscale=index == 0, texttemplate="%{z:.2f}",
                        textfont=dict(size=9),
                        hovertemplate="length %{x}<br>depth %{y}<br>ROUGE-L %{z:.2f}<extra></extra>",
                        row=index // columns + 1, col=index % columns + 1)
    fig.update_layout(title=dict(text="Needle in a haystack: ROUGE-L F by context length and needle depth<br><sup>"
                                      "x: the context in prompt tokens; y: the share of it before the needle</sup>",
                                 yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      height=100 + MODEBAR_STRIP + 200 * rows + PANEL_TITLE_HEIGHT * several,
                      margin={**MARGIN, "t": MARGIN["t"] + NOTE_HEIGHT + PANEL_TITLE_HEIGHT * several})
    fig.update_annotations(font_size=10)
    return _caption(fig, "Each cell is the score with the needle at that depth (row) in a context of that length "
                         "(column): green kept it, red lost it; compare a policy's panel with the full cache's.")


