"""The Results figures drawn as lines over small multiples: quality, max-length hits, paired differences,
the refresh interval and needle depth; and which policies a figure draws by default."""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ...store import NOT_RANKED, RANKED_FLOOR
from .colours import PALETTE, Colours
from .layout import (
    GLYPHS,
    _axis_key,
    _axis_titles,
    _caption,
    _cut_label,
    _dodge,
    _empty,
    _facets,
    _hover_counts,
    _nudge_step,
    _on_cut_axes,
    _readable_range,
    _shared_extents,
    _versus,
    _with_budgets,
)


def _line_figure(frame: pd.DataFrame, x: str, y: str, title: str, xlabel: str, ylabel: str,
                 colours: Colours | None = None, join_fewer_than: int = 0, notes: list[str] = (),
                 read: str = "") -> go.Figure:
    """``y`` against ``x``, a panel per source / model / task, a line per policy (and compression or budget,
    if not x).  With x = ``"compression"``, budget cells are drawn against their budget in panels of their own
    (:func:`_on_cut_axes`), and ``xlabel`` is the compression axis's title only.

    A line has one colour and one legend entry across the panels (a policy its usual colour); clicking it
    in the legend toggles it everywhere.  Paper rows are dashed.  A line of fewer than ``join_fewer_than``
    points is drawn as markers alone (α: two far-apart values joined would read as measured in between).
    The hover gives each point's value, standard error and what it averages; ``read`` says how to read it.
    """
    cuts = [c for c in ("compression", "absolute_budget") if c in frame]
    reference = x == "compression"  # the full cache is then a flat line across each panel
    offsets = pd.Series(0.0, index=frame.index)
    extents = {}
    if reference:
        frame, x, cuts = _on_cut_axes(frame), "position", []
        offsets = _dodge(frame, y)
        extents = _shared_extents(frame[frame.policy != "full"], x)
        if offsets.ne(0).any():
            notes = [*notes, "points of several policies that coincide are nudged apart on x around their cut"]
    fig, panels = _facets(frame, title, ylabel, notes=notes)
    line_cols = [c for c in ("policy",) if c in frame] + cuts
    palette = {}  # lines that are not a single policy (α sensitivity: one per ρ) share colours across panels
    shown = set()
    for _, panel, row, col in panels:
        for keys, part in panel.groupby(line_cols, dropna=False, sort=True):
            keys = keys if isinstance(keys, tuple) else (keys,)
            values = dict(zip(line_cols, keys))
            policy = values.get("policy")
            label = " · ".join([str(policy)] * ("policy" in values) + [
                _cut_label(values.get("compression"), values.get("absolute_budget"))] * bool(cuts))
            colour, marker = _line_style(colours if line_cols == ["policy"] else None, policy, label, palette)
            paper = part["source"].iloc[0] == "paper"
            dash = "dash" if paper else "solid"
            xs, ys = part[x] + offsets[part.index], part[y]
            stderr = part["stderr"] if "stderr" in part and not paper else pd.Series(np.nan, index=part.index)
            where = [_cut_label(c, b) for c, b in zip(part.compression, part.absolute_budget)] if reference \
                else [f"{xlabel} = {position:g}" for position in xs]
            hover = _point_hovers(part, label, where, ys, stderr, ylabel)
            mode = "lines+markers" if len(part) >= join_fewer_than else "markers"
            if reference and policy == "full" and len(part) == 1 and panel[x].notna().any():
                # The full cache does not depend on the compression: a reference across the x axis the panel
                # shares, the same length in each panel (across its own cuts, it stopped short where a panel
                # ran fewer cuts than its neighbours)
                xs, ys, dash, mode = extents[_axis_key(panel)], [ys.iloc[0]] * 2, "dot", "lines"
                hover = [f"full cache (no cut)<br>{ylabel} {part[y].iloc[0]:.3f}<br>{_hover_counts(part)[0]}"] * 2
            # ± one standard error over samples, where there are several; a paper row's "samples" are the
            # printed figures it averages, often one number printed twice: no error of anything
            error = dict(type="data", array=stderr, visible=True, thickness=1) \
                if stderr.notna().any() and len(xs) == len(part) else None
            fig.add_scatter(x=xs, y=ys, name=label, legendgroup=label, showlegend=label not in shown,
                            mode=mode, line=dict(dash=dash, color=colour), marker=marker, error_y=error,
                            hovertext=hover, hoverinfo="text", row=row, col=col)
            shown.add(label)
        if not panel.empty and "source" in panel and panel["source"].iloc[0] == "paper":
            _readable_range(fig, panel[y], row, col)
    _axis_titles(fig, panels, xlabel)
    return _caption(fig, read)


def _line_style(colours: Colours | None, policy, label: str, palette: dict) -> tuple[str, dict | None]:
    """A line's colour and marker: a policy's own colour and symbol where ``colours`` names policies; otherwise
    the next colour of ``palette`` (kept per label, so a line has one colour across panels) and no marker."""
    if colours is not None and policy is not None:
        return colours(policy), dict(symbol=colours.symbol(policy))
    return palette.setdefault(label, PALETTE[len(palette) % len(PALETTE)]), None


def _point_hovers(part: pd.DataFrame, label: str, where: list[str], ys, stderr, ylabel: str) -> list[str]:
    """Each point's hover: its line, where it lies, its value ± standard error and what it averages."""
    return [f"{label}<br>{at}<br>{ylabel} {value:.3f}" + ("" if pd.isna(error) else f" ± {error:.3f}")
            + (f"<br>{count}" if count else "") for at, value, error, count in
            zip(where, ys, stderr, _hover_counts(part))]


def _hits_figure(frame: pd.DataFrame, colours: Colours, settings: bool = False, empty: str | None = None) -> go.Figure:
    """The quality figure's panels and lines for the share of generations that reached max_new_tokens instead
    of ending, from the groups where some row records it (rows written before the field do not).  ``empty``:
    what to say when there are no rows (default: that there are none measured for these filters)."""
    recorded = frame[frame.recorded > 0]
    if recorded.empty:
        return _empty(go.Figure(), (empty or "no measured rows for these filters") if frame.empty else
                      f"none of the {int(frame.rows.sum())} measured rows for these filters records max-length hits "
                      "(hit_max_tokens): they were written before sweeps recorded it; a new sweep records it")
    fig = _line_figure(recorded, "compression", "hit_rate", f"Max-length hits vs {_versus(recorded)} (share of "
                       "generations that reached max_new_tokens instead of ending; "
                       + ("every setting run, each its own line)" if settings else "each policy at its defaults)"),
                       "compression ρ", "max-length hit rate", colours,
                       read="Each line is the share of a policy's generations that ran to max_new_tokens instead of "
                            "ending: above the full cache's share, the policy lost the end of its answers.")
    fig.update_yaxes(range=[-0.05, 1.05])  # a share: 1 of 20 should not fill the panel
    return fig


PAIRED_DODGE = 0.012  # of a panel's span: how far apart on x the paired figure draws neighbouring policies


def _paired_figure(frame: pd.DataFrame, reference: str, colours: Colours, empty: str | None = None,
                   notes: list[str] = (), read: str = "", title: str | None = None) -> go.Figure:
    """Each policy's paired difference to ``reference`` against compression (budget cells against their budget,
    in panels of their own), with its bootstrap interval, a panel per model / task (and per suite over its
    tasks); the policies are nudged apart on x so that intervals at the same cut do not hide each other.
    ``empty``: what to say when no pair is left (default: that none pairs under these filters); ``notes``: small
    lines under the note; ``read`` and ``title``: the figure's own where it is not the Paired section's.
    """
    if frame.empty:
        return _empty(go.Figure(), empty or f"no measured samples pair with {reference} under these filters")
    frame = frame.assign(source="measured")
    placed = _on_cut_axes(frame)
    fig, panels = _facets(placed, (title or f"Paired difference to {reference}") + " (mean Δ on the same samples; "
                          "bars: 95% paired-bootstrap interval; filled: sign test p < 0.05; policies nudged apart "
                          "on x around their cut)", f"Δ score vs {reference}", notes=notes)
    policies = sorted(frame.policy.unique()) if not frame.empty else []
    shown = set()
    for _, panel, row, col in panels:
        fig.add_hline(y=0, line=dict(color="grey", width=1), row=row, col=col)
        # the panel's policies centred on their cut, never so far apart that they reach a neighbouring cut's
        present = [policy for policy in policies if policy in set(panel.policy)]
        spread = _nudge_step(PAIRED_DODGE * ((panel.position.max() - panel.position.min()) or 1), panel.position,
                             len(present)) if len(panel) else 0
        for policy, part in panel.groupby("policy", sort=True):
            nudge = spread * (present.index(policy) - (len(present) - 1) / 2)
            fig.add_trace(_paired_trace(part, policy, reference, colours, nudge, policy not in shown),
                          row=row, col=col)
            shown.add(policy)
    _axis_titles(fig, panels, "compression ρ")
    return _caption(fig, read or f"Each point is a policy's mean score minus {reference}'s on the same samples: "
                             "above 0 it beat the reference; a filled marker: the sign test tells the two apart.")


def _paired_trace(part: pd.DataFrame, policy: str, reference: str, colours: Colours, nudge: float,
                  legend: bool) -> go.Scatter:
    """One policy's paired differences in one panel; the hover gives the interval, wins / ties / losses, the
    sign test (McNemar's on 0/1 scores), the smallest difference the run could detect, and where the pairs
    were made at equal cache held, the reference's cut they paired with."""
    symbol = colours.symbol(policy)  # filled or open: the sign test; the shape: the setting
    cuts = [_cut_label(c, b) for c, b in zip(part.compression, part.absolute_budget)]
    if "reference_compression" in part:
        cuts = [cut if not isinstance(at, str) or not at else f"{cut} (at equal cache held: {reference} ρ={at})"
                for cut, at in zip(cuts, part.reference_compression)]
    detectable = part.detectable if "detectable" in part else [np.nan] * len(part)
    return go.Scatter(
        x=part.position + nudge, y=part.delta, name=policy, legendgroup=policy, showlegend=legend,
        mode="lines+markers", line=dict(color=colours(policy)),
        marker=dict(symbol=[symbol if flag else f"{symbol}-open" for flag in part.significant], size=8),
        error_y=dict(type="data", array=part.high - part.delta, arrayminus=part.delta - part.low, visible=True,
                     thickness=1),
        customdata=list(zip(cuts, *(part[c] for c in ("low", "high", "wins", "ties", "losses", "pairs", "p_sign")),
                            [f"{d:.3f}" if pd.notna(d) else "none (too few differing samples)" for d in detectable])),
        hovertemplate=(f"{policy} − {reference}<br>%{{customdata[0]}}<br>Δ %{{y:+.3f}} "
                       "[%{customdata[1]:+.3f}, %{customdata[2]:+.3f}]<br>wins/ties/losses "
                       "%{customdata[3]}/%{customdata[4]}/%{customdata[5]} of %{customdata[6]}"
                       "<br>sign test p = %{customdata[7]:.3g}<br>smallest |Δ| detectable (80% power): "
                       "%{customdata[8]}<extra></extra>"))


# How the refresh figure draws the points of each sweep's speed line: a line never joins two runs
SWEEP_SYMBOLS = ("diamond", "triangle-up", "square", "cross", "x", "star")


def _score_free_lines(add, rows: pd.DataFrame, label: str, colour: str, span: list, place: dict) -> None:
    """Score-Free's rows (r = 0) as horizontal lines across ``span``: its score, and its speed on the right axis."""
    for free in rows.itertuples():
        add(f"{label} score-free score", x=span, y=[free.score] * 2, mode="lines",
            line=dict(dash="dashdot", color=colour, width=1), secondary_y=False,
            hovertemplate=f"score-free · {label}<br>score {free.score:.3f}<extra></extra>", **place)
        if not pd.isna(free.decode_tok_s):
            run = getattr(free, "sweeps", None)
            add(f"{label} score-free tok/s", x=span, y=[free.decode_tok_s] * 2, mode="lines",
                line=dict(dash="longdashdot", color=colour, width=1), secondary_y=True,
                hovertemplate=f"score-free · {label}<br>{free.decode_tok_s:.2f} tok/s"
                              + (f"<br>run: {run}" if isinstance(run, str) else "") + "<extra></extra>", **place)


def _refresh_figure(frame: pd.DataFrame) -> go.Figure:
    """Score (left axis) and decode speed (right axis, dotted) against the refresh interval r >= 1, a panel per
    source / model / task and a colour per compression (or absolute budget).

    Score-Free (r = 0 in the store) scores once, at the first decode step, and never again: InertiaKV's separate
    operating point, neither r = 0 nor the limit r -> inf.  It is a horizontal line in each panel (its score,
    and its speed on the right axis), joined to no r.  A speed line joins the points of one sweep only
    (``sweeps``, a marker each): two runs differ in the machine's load, which a line across them would show as
    the cost of refreshing."""
    runs = sorted(set(frame["sweeps"].dropna())) if "sweeps" in frame else []
    symbols = {run: SWEEP_SYMBOLS[i % len(SWEEP_SYMBOLS)] for i, run in enumerate(runs)}
    notes = ["score-free (scores at step 1 only, never refreshes): a horizontal line, a separate operating point, "
             "not r → ∞"]
    if len(runs) > 1:
        notes.append("speed: one line per sweep (" + ", ".join(f"{GLYPHS.get(symbols[run], symbols[run])} {run}"
                                                              for run in runs)
                     + "): runs at other times differ in machine load")
    # two panels a row: each has a right-hand axis, whose title ran over the next panel's ticks three a row
    fig, panels = _facets(frame, "Refresh interval r: quality and decode speed (r: decode steps between scorings; "
                          "bars: ± 1 standard error)",
                          "mean score", y2label="decode tok/s (measured)", columns=2,
                          notes=notes)
    palette, shown = {}, set()

    def add(name: str, **trace) -> None:  # one legend entry per name across the panels
        fig.add_scatter(name=name, legendgroup=name, showlegend=name not in shown, **trace)
        shown.add(name)

    # score-free's lines across the r of every panel sharing the x axis: across a panel's own, they stopped
    # short where a task ran fewer r than its neighbours (one r: a short line around it)
    extents = _shared_extents(frame[frame.refresh > 0], "refresh", lone=0.5)
    for _, panel, row, col in panels:
        span = extents.get(_axis_key(panel), [0.5, 1.5])
        for cut, part in _with_budgets(panel).groupby(["compression", "absolute_budget"], dropna=False, sort=True):
            label = _cut_label(*cut)
            colour = palette.setdefault(label, PALETTE[len(palette) % len(PALETTE)])
            dash = "dash" if part["source"].iloc[0] == "paper" else "solid"
            place = dict(row=row, col=col)
            lines = part[part.refresh > 0]
            if len(lines):
                error = dict(type="data", array=lines.stderr, visible=True, thickness=1) \
                    if dash == "solid" and "stderr" in lines and lines.stderr.notna().any() else None  # measured
                add(f"{label} score", x=lines.refresh, y=lines.score, mode="lines+markers", error_y=error,
                    line=dict(dash=dash, color=colour), secondary_y=False, **place)
                timed = lines[lines.decode_tok_s.notna()]
                by_run = timed.groupby("sweeps", dropna=False, sort=True) if "sweeps" in timed else [(None, timed)]
                for run, points in by_run:
                    run = None if pd.isna(run) else run
                    add(f"{label} tok/s" + (f" · {run}" if len(runs) > 1 and run else ""), x=points.refresh,
                        y=points.decode_tok_s, mode="lines+markers", line=dict(dash="dot", color=colour),
                        marker=dict(symbol=symbols.get(run, "diamond")), secondary_y=True,
                        hovertemplate="r = %{x}<br>%{y:.2f} tok/s" + (f"<br>run: {run}" if run else "")
                                      + "<extra></extra>", **place)
            _score_free_lines(add, part[part.refresh == 0], label, colour, span, place)
    _axis_titles(fig, panels, "refresh interval r (steps)")  # longer, two bottom titles ran together at 900 px
    return _caption(fig, "Solid lines are the score, dotted ones the decode speed, against the steps between "
                         "scorings: a flat score beside a rising speed means refreshing less often costs nothing.")



# What a figure draws when no policy is chosen: the reference, the paper's method, then issue 43's headline
# baselines (more lines tangle); the others a click away ("Show all policies", or the Policies filter)
DEFAULT_POLICIES = ("full", "inertia", "tova", "h2o", "snapkv", "streaming", "knorm", "keydiff")
SHOWN_MOST = 8
SHOW_ALL = "Show all policies"
DEPTH_POLICIES, DEPTH_FIRST = SHOWN_MOST, DEFAULT_POLICIES


def policy_of(name: str) -> str:
    """The policy a drawn name is a setting of (``"inertia alpha=0.9"``: inertia), or the name itself."""
    head, _, rest = name.partition(" ")
    return head if rest and all("=" in word for word in rest.split()) else name


def curated(frame: pd.DataFrame, first=DEFAULT_POLICIES, most: int = SHOWN_MOST) -> tuple[pd.DataFrame, list[str]]:
    """``frame``'s rows of at most ``most`` policies (each with its other settings): those of ``first`` it has,
    in that order, then the others in the frame's order; and a note naming those left out."""
    if frame.empty or "policy" not in frame:
        return frame, []
    bases = frame.policy.map(policy_of)
    present = list(dict.fromkeys(bases))
    names = [name for name in first if name in present] + [name for name in present if name not in first]
    kept, left = names[:most], names[most:]
    if not left:
        return frame, []
    more = f"{len(left)} more polic{'ies' if len(left) > 1 else 'y'} ({', '.join(left[:4])}{', ...' * (len(left) > 4)})"
    return frame[bases.isin(kept)], [f"{more}: tick '{SHOW_ALL}' or choose them in Policies"]


def _depth_shown(frame: pd.DataFrame, chosen: bool) -> tuple[pd.DataFrame, list[str]]:
    """The rows a depth figure draws: the full cache and the evicting policies at the most-run compression
    (the largest on a tie), the default policies only unless policies were chosen; and notes saying what was
    left out."""
    notes = []
    evicting = frame[frame.compression.notna()]
    if evicting.empty:
        return frame, notes
    runs = evicting.groupby("compression").policy.nunique()
    rho = max(runs[runs == runs.max()].index)
    if len(runs) > 1:
        notes.append(f"other compressions ({', '.join(f'{c:g}' for c in runs.index if c != rho)}): "
                     "filter the sweeps, or see the table")
    frame = frame[frame.compression.isna() | (frame.compression == rho)].sort_values("policy", kind="stable")
    if chosen:
        return frame, notes
    frame, left = curated(frame)
    return frame, notes + left


def _depth_figure(frame: pd.DataFrame, colours: Colours, chosen: bool = False) -> go.Figure:
    """Mean score per needle-depth decile, a line per policy at one compression, a panel per model / task;
    only rows whose sample records its needle's depth (the prose tasks, single_needle)."""
    if frame.empty:
        return _empty(go.Figure(), "no rows with a recorded needle depth for these filters (the prose tasks and "
                                   "single_needle record one)")
    shown, notes = _depth_shown(frame, chosen)
    full = frame[frame.policy == "full"]
    full = full.assign(total=full.score * full.samples).groupby(["model", "task"])[["total", "samples"]].sum()
    weak = full[full.total < RANKED_FLOOR * full.samples].reset_index()
    if len(weak):
        notes.append(f"{NOT_RANKED} (full cache under {RANKED_FLOOR:g}): "
                     + ", ".join(f"{row.task} ({row.total / row.samples:.2f})" for row in weak.itertuples()))
    rho = shown.compression.dropna().unique()
    notes.append(f"n per point: {shown.samples.min():g} to {shown.samples.max():g} samples; "
                 "a depth with few samples moves in large steps")
    title = f"Quality vs needle depth{f' at ρ = {rho[0]:g}' if len(rho) else ''} (mean score per tenth of the text; " \
            "bars: ± 1 standard error)"
    lines = shown.drop(columns=["compression"]).assign(source="measured")
    return _line_figure(lines, "depth", "score", title, "needle depth (share of the text before it)", "mean score",
                        colours, notes=notes, read=DEPTH_CAPTION)


DEPTH_CAPTION = ("Read each line left to right: its score on the samples whose needle lies in that tenth of the "
                 "text (0: the start, 1: just before the question); a policy that keeps only recent entries "
                 "rises to the right, one that retrieves stays flat.")


# AvoKV-E's Table 3 metrics as panels: title, and a random ranking's value (the dotted line).  High damage is
