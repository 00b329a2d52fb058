"""What the dashboard draws, built from step events only (no Gradio here, so it is testable and reusable).

:class:`RunView` keeps a compact record of one run -- the step at which each position entered and left
the cache, and each kept position's utility rank per step -- and renders Plotly figures from it.  Large
runs are binned (at most ``MAX_COLUMNS`` positions x ``MAX_ROWS`` steps per heatmap) and sent as uint8
so a 2k-token prompt with 256 steps stays well under 300 KB per figure.
"""

from __future__ import annotations

import html
import math
import textwrap

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..diagnostics import boundary_crossings, descending_rank, find_positions, token_history
from ..diagnostics import ranks as ascending_ranks
from ..trace import StepEvent

MAX_COLUMNS, MAX_ROWS = 512, 256
# uint8 code for "not generated yet" / "not in cache".  Not 255: base64 of 0xFF is "////", and Plotly's JSON
# escapes every "/" as six characters, which tripled the payload of mostly-empty heatmaps.
EMPTY = 200
# The rank heatmap's other non-rank cells: kept but without a finite score (protected, or before scoring
# starts), and evicted.  Blank alone used to mean all three.
UNSCORED, GONE = 150, 175
NEVER = np.iinfo(np.int32).max
KEPT_COLOR, EVICTED_COLOR, EMPTY_COLOR, UNSCORED_COLOR = "#1f3b73", "#f1c9a5", "#ffffff", "#c8c8c8"
# The heatmaps' keys, in a right margin of one fixed width (not grown to fit each key's labels), so that the
# stacked retention and rank plots' position axes line up
COLORBAR = dict(thickness=12, len=1, x=1.01, outlinewidth=1, tickfont=dict(size=11))
# Gradio turns Plotly's margin autoexpand back on: a key wider than this margin would push one plot's right
# edge in, and the rank plot's positions no longer stood under the retention plot's (hence two-line labels)
KEY_MARGIN = 105
HEATMAP_TOP = 70  # a heatmap's title and its key's line
HEATMAP_TITLE_PAD = 26
# What one line of a title holds, in its own size and in small print (<sup>), in the Live tab's plots at a
# 1000-px window: a longer line ran past the plot's right edge and was cut there.  Pixels per line of each.
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
# Sixteen that stay apart (the last was a second mid-blue, beside the first)
FOLLOW_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2",
                 "#7f7f7f", "#bcbd22", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#000000"]


class RunView:
    """Retention and rank history of one run, updated one event at a time in O(cache size)."""

    def __init__(self, prompt_len: int, max_new_tokens: int, budget: int, tokens: list[str] | None = None,
                 pinned: tuple[int, int] = (0, 0), interval: int | None = None, terms_key: str = ""):
        self.prompt_len, self.budget, self.pinned = prompt_len, budget, pinned
        self.interval = interval  # a checkpointed policy's: every ``interval`` generated tokens it decides
        self.terms_key = terms_key  # what its decisions' terms are (the terms table's key), where it says
        self.total = prompt_len + max_new_tokens
        self.entered = np.full(self.total, NEVER, dtype=np.int32)  # step a position entered the cache
        self.entered[:prompt_len] = 0
        self.left = np.full(self.total, NEVER, dtype=np.int32)  # step whose eviction removed it
        self.ranks: list[np.ndarray] = []  # per step: float32 rank / budget per position (NaN = not ranked)
        self.events: list[StepEvent] = []
        self.tokens = list(tokens or [])
        self.ended: int | None = None  # the step whose token was the end of sequence, where the run produced one
        self._live: dict[str, go.Figure] = {}  # figures reused while streaming: only their data changes
        self._history_cache = None

    @property
    def steps(self) -> int:
        return len(self.events)

    def add(self, event: StepEvent, token_text: str | None = None) -> None:
        self.events.append(event)
        if event.step >= 1:
            self.entered[self.prompt_len + event.step - 1] = event.step
        self.left[event.evicted] = event.step
        row = np.full(self.total, np.nan, dtype=np.float32)
        if event.utility is not None and event.kept.size:
            # Only finite utilities are ranked: +inf marks what a policy protects or has not scored yet, and
            # ranking those by position would paint a gradient that means nothing.  Ties share their mean
            # rank, so a row of equal utilities (e.g. before any scoring) is one colour, not a ramp.
            scored = np.isfinite(event.utility)
            if scored.any() and np.ptp(event.utility[scored]) > 0:
                descending = scored.sum() + 1 - ascending_ranks(event.utility[scored])  # 1 = most useful
                row[event.kept[scored]] = (descending - 1) / max(self.budget, 1)
        self.ranks.append(row)
        if token_text is not None:
            self.tokens.append(token_text)

    # -- matrices --------------------------------------------------------------------------------------
    def _bins(self) -> tuple[int, int, int]:
        width = self.prompt_len + max(self.steps - 1, 0)
        col = max(1, math.ceil(width / MAX_COLUMNS))
        row = max(1, math.ceil(self.steps / MAX_ROWS))
        return width, col, row

    def _presence(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """(steps x width) bool: which positions exist after each step, and which of them are still cached."""
        steps = np.arange(self.steps)[:, None]
        exists = self.entered[None, :width] <= steps
        return exists, exists & (self.left[None, :width] > steps)

    def retention(self) -> tuple[np.ndarray, int, int]:
        """uint8 matrix (steps x positions, binned): 0-100 = % of the bin kept after that step, EMPTY = none exist."""
        width, col, row = self._bins()
        exists, kept = self._presence(width)
        return _binned_share(kept, exists, col, row), col, row

    def rank_matrix(self) -> tuple[np.ndarray, int, int]:
        """uint8 matrix: mean utility rank / budget x 100 of the ranked positions of each bin; a bin with none
        ranked is UNSCORED if it holds a kept entry, GONE if it holds only evicted ones, else EMPTY."""
        width, col, row = self._bins()
        ranks = np.stack(self.ranks)[:, :width] if self.ranks else np.zeros((0, width), np.float32)
        present = ~np.isnan(ranks)
        out = _binned_share(np.nan_to_num(ranks), present, col, row)
        exists, kept = self._presence(width)
        unranked = out == EMPTY
        out[unranked & (_binned_share(exists, exists, col, row) != EMPTY)] = GONE
        out[unranked & (_binned_share(kept, kept, col, row) != EMPTY)] = UNSCORED
        return out, col, row

    # -- figures ---------------------------------------------------------------------------------------
    def _reuse(self, name: str, z: np.ndarray, col: int, row: int, marker_step: int | None, title: str,
               title_height: int) -> go.Figure | None:
        """While streaming, update the cached figure's heatmap in place (building a figure costs ~10x more)."""
        fig = self._live.get(name)
        if fig is None or marker_step is not None:
            return None
        with fig.batch_update():
            fig.data[0].update(z=z, x0=(col - 1) / 2, dx=col, y0=(row - 1) / 2, dy=row)
            fig.update_xaxes(range=_position_range(z, col))
            _heatmap_title(fig, title, title_height)  # binning can change as the run grows
            fig.update_yaxes(dtick=step_dtick(self.steps))
        return fig

    def _retention_title(self, col: int, row: int, followed: bool = False) -> tuple[str, int]:
        binned = _cell_note(col, row)  # mixed cells shade in between
        # the key on a line of its own, in small type: one line of 17-px text was cut at a half-width plot's edge
        return titled(f"Retention (B = {self.budget})", f"dark kept · pale evicted · blank not yet generated"
                      f"{' · red followed' * followed}{binned}", self._protected_note())

    def retention_figure(self, marker_step: int | None = None, followed: list[int] | None = None) -> go.Figure:
        """Which positions the cache holds after each step, with ``followed`` positions drawn over it in red
        (:meth:`mark_positions`) on a figure of its own: the one a run streams into stays unmarked."""
        z, col, row = self.retention()
        title = self._retention_title(col, row, bool(followed))
        if not followed and (fig := self._reuse("retention", z, col, row, marker_step, *title)) is not None:
            last = max(self.steps - 1, 0)
            for shape in fig.layout.shapes:  # the pinned bands grow down (sinks) and right (tail) per step
                if shape.type == "path":
                    shape.path = self._tail_path()
                elif shape.type == "rect":
                    shape.y1 = last + 0.5
            return fig
        scale = [[0, EVICTED_COLOR], [100 / EMPTY, KEPT_COLOR], [101 / EMPTY, EMPTY_COLOR], [1, EMPTY_COLOR]]
        fig = _heatmap(z, col, row, scale, "kept: %{z}% of the cell (200 = not generated yet)", self.steps,
                       self.prompt_len, {0: "evicted", 100: "kept", EMPTY: "not yet"})
        self._pinned_bands(fig)
        _heatmap_title(fig, *title)
        _marker(fig, marker_step)
        if followed:
            return self.mark_positions(fig, followed)
        if marker_step is None:
            self._live["retention"] = fig
        return fig

    def mark_positions(self, fig: go.Figure, positions: list[int]) -> go.Figure:
        """Draw followed ``positions`` on a retention figure: a line down each one's column while it is
        cached, ending in a cross at the step that evicted it (none for one kept to the end), and a triangle
        above it to find it by among a thousand columns; hovering either names the token and its fate."""
        last = max(self.steps - 1, 0)
        line_x, line_y, top, cross = [], [], [], []
        for position in positions:
            step = self.evicted_at(position)
            line_x += [position, position, None]  # from the step it entered: 0 for the prompt
            line_y += [int(self.entered[position]) - 0.5, last + 0.5 if step is None else step - 0.5, None]
            fate = "kept to the end" if step is None else f"evicted at step {step}"
            top.append(f"#{position} {self.token_cell(position)}: {fate}")
            if step is not None:
                cross.append((position, step, top[-1]))
        # red alone, a 1-px line, all but vanished on the kept cells' navy: a white halo under it and round
        # the markers keeps it apart from navy and peach alike
        fig.add_scatter(x=line_x, y=line_y, mode="lines", line=dict(color=HALO_COLOR, width=4),
                        hoverinfo="skip", showlegend=False)
        fig.add_scatter(x=line_x, y=line_y, mode="lines", line=dict(color=FOLLOWED_COLOR, width=2),
                        hoverinfo="skip", showlegend=False)
        fig.add_scatter(x=positions, y=[-0.5] * len(positions), mode="markers", hovertext=top,
                        hoverinfo="text", showlegend=False, cliponaxis=False,
                        marker=dict(symbol="triangle-down", size=9, color=FOLLOWED_COLOR, line=HALO))
        if cross:
            x, y, text = zip(*cross)
            fig.add_scatter(x=x, y=y, mode="markers", hovertext=text, hoverinfo="text", showlegend=False,
                            marker=dict(symbol="x", size=10, color=FOLLOWED_COLOR, line=HALO))
        # the heatmap's own extent: autorange would pad it to fit the triangles, which sit on its top edge
        fig.update_yaxes(range=[last + 0.5, -0.5], autorange=False)
        return fig

    def _pinned_bands(self, fig: go.Figure) -> None:
        """Outline what the policy never evicts: the first ``sinks`` positions, and the newest ``tail`` entries
        at each step (a band that moves right one position per step)."""
        sinks, tail = self.pinned
        last = max(self.steps - 1, 0)
        if sinks:
            fig.add_shape(type="rect", x0=-0.5, x1=sinks - 0.5, y0=-0.5, y1=last + 0.5, line=dict(color="#2ca02c"),
                          fillcolor="rgba(44,160,44,0.15)")
        if tail:
            fig.add_shape(type="path", path=self._tail_path(), line=dict(color="#2ca02c"),
                          fillcolor="rgba(44,160,44,0.15)")

    def _protected_note(self) -> str:
        """What the green bands are, for the retention title ("" without any): a tail entry is protected only
        while it is among the newest (H2O's window, AvoKV-E's delay), a sink always."""
        sinks, tail = self.pinned
        which = [f"the first {sinks} always"] * bool(sinks) + [f"the newest {tail} while newest"] * bool(tail)
        return f"green: protected, {' and '.join(which)}" if which else ""

    def _tail_path(self) -> str:
        tail, last = self.pinned[1], max(self.steps - 1, 0)
        end0, end1 = self.prompt_len - 0.5, self.prompt_len + last - 0.5  # right edge of the newest entry
        return f"M {end0 - tail},-0.5 L {end0},-0.5 L {end1},{last + 0.5} L {end1 - tail},{last + 0.5} Z"

    def rank_figure(self, marker_step: int | None = None) -> go.Figure | None:
        if all(np.isnan(r).all() for r in self.ranks):
            if any(e.utility is not None for e in self.events) or not self.events:
                return None  # nothing ranked yet (a scoring policy before its first finite scores)
            return _empty_figure("This policy keeps no per-entry utility: it decides by position alone "
                                 "(e.g. StreamingLLM, Recency), so there is nothing to rank.")
        z, col, row = self.rank_matrix()
        binned = _cell_note(col, row)
        title = titled("Utility rank of kept tokens", f"yellow = most useful{binned}")
        if (fig := self._reuse("rank", z, col, row, marker_step, *title)) is not None:
            return fig
        fig = _heatmap(z, col, row, RANK_SCALE, f"rank: %{{z}}% of B ({UNSCORED} kept with no score, {GONE} evicted, "
                       f"{EMPTY} not generated yet)", self.steps, self.prompt_len,
                       {0: "rank 1", 50: "B/2", 100: "rank B+", UNSCORED: "kept,<br>no score", GONE: "evicted",
                        EMPTY: "not yet"})
        _heatmap_title(fig, *title)
        _marker(fig, marker_step)
        if marker_step is None:
            self._live["rank"] = fig
        return fig

    def timeline_figure(self, marker_step: int | None = None) -> go.Figure:
        """Per step: cache entries against B, evictions, and the time split; ``marker_step`` marks a scrubbed
        step (a figure of its own: the streaming one is reused and must stay unmarked)."""
        steps = [e.step for e in self.events]
        series = [[e.cache_size for e in self.events], [e.evicted.size for e in self.events],
                  *([1e3 * getattr(e, f) for e in self.events[1:]] for f in ("t_forward", "t_score", "t_evict"))]
        if marker_step is None and (fig := self._live.get("timeline")) is not None:
            with fig.batch_update():
                for index, values in enumerate(series):
                    fig.data[index].update(x=steps if index < 2 else steps[1:], y=values)
                    if index >= 2:
                        fig.data[index].mode = _time_mode(len(steps))
                fig.update_xaxes(dtick=step_dtick(len(steps)), range=step_range(len(steps)))
                fig.update_yaxes(range=_evicted_range(series[1]), row=2, col=1)
            return fig
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.09,
                            subplot_titles=("cache entries", "evicted this step (log scale)", "time per step (ms)"))
        fig.add_scatter(x=steps, y=[e.cache_size for e in self.events], name="cache", row=1, col=1)
        fig.add_hline(y=self.budget, line_dash="dot", line_color="#c44", row=1, col=1,
                      annotation_text=f"budget B = {self.budget}", annotation_position="top left")
        fig.add_bar(x=steps, y=[e.evicted.size for e in self.events], name="evicted", row=2, col=1)
        for field, label in (("t_forward", "forward"), ("t_score", "scoring"), ("t_evict", "eviction")):
            fig.add_scatter(x=steps[1:], y=[1e3 * getattr(e, field) for e in self.events[1:]], name=label,
                            stackgroup="time", mode=_time_mode(len(steps)), row=3, col=1)
        # log: the first step's mass eviction (L0 − B) would otherwise flatten every later single eviction
        fig.update_yaxes(type="log", dtick=1, range=_evicted_range(series[1]), row=2, col=1)
        fig.update_xaxes(title_text="decode step (0 = prefill)", row=3, col=1)
        fig.update_xaxes(dtick=step_dtick(len(steps)), range=step_range(len(steps)))
        fig.update_layout(height=440, margin=dict(l=50, r=20, t=30, b=40), showlegend=True,
                          legend=dict(orientation="h", y=-0.15, traceorder="normal"))
        if marker_step is None:
            self._live["timeline"] = fig
        else:
            fig.add_vline(x=marker_step, row="all", col=1, **STEP_MARKER)
        return fig

    def step_detail_figure(self, step: int) -> go.Figure:
        """One step in detail: each position present, its utility (or raw score), fate and token on hover.

        Entries whose utility is not finite (protected, or not scored since the last checkpoint) cannot be
        placed on the axis and are counted in the title; entries evicted at this step have no recorded
        utility (events keep it for the kept entries only) and are drawn as crosses along the bottom.
        """
        event = self.events[min(step, self.steps - 1)]
        present, evicted = event.present, set(event.evicted.tolist())
        notes = []
        if event.utility is not None:
            utility = dict(zip(event.kept.tolist(), event.utility.tolist()))
            finite = {p: u for p, u in utility.items() if math.isfinite(u)}
            order = sorted(finite, key=lambda p: (-finite[p], -p))
            rank = {p: i + 1 for i, p in enumerate(order)}
            floor = min(finite.values()) if finite else 0.0
            y = [floor if p in evicted else finite.get(int(p), np.nan) for p in present]
            label = "utility"
            unscored = len(utility) - len(finite)
            if unscored:
                notes.append(f"{unscored} kept entries with no finite score not drawn")
            if len(finite) > 1 and len(set(finite.values())) == 1:  # one flat row of dots that explains nothing
                index = min(step, self.steps - 1)
                later = next((e.step for e in self.events[index + 1:] if e.raw is not None), None)
                scored = any(e.raw is not None for e in self.events[:index + 1])
                notes.append(f"every entry's utility is {next(iter(finite.values())):.3g}" + (
                    ": nothing has told them apart yet" if scored else ": none scored yet"
                    + (f" (the first scoring is at step {later})" if later is not None else "")))
        elif event.raw is not None:
            utility, rank, y, label = {}, {}, list(event.raw), "raw score of this step"
        else:
            utility, rank, y, label = {}, {}, [0.0] * len(present), None
        if evicted and event.utility is not None:
            notes.append("× evicted now, drawn at the lowest utility (its own is not recorded)")
        terms = event.components or {}
        if terms:
            notes.append("hover: the terms this checkpoint decided from")
        text = [f"pos {p} · {html.escape(self.token_cell(int(p)))}<br>"
                + (f"utility {utility[int(p)]:.4g} · rank {rank.get(int(p), '-')}<br>" if int(p) in utility else "")
                + "".join(f"{name} {values[i]:.3g} · " for name, values in terms.items() if not np.isnan(values[i]))
                + ("evicted now" if p in evicted else "kept") for i, p in enumerate(present)]
        drawn = np.asarray([value for value in y if math.isfinite(value)], dtype=float)
        # Attention-based utilities are skewed: a sink near 0.6 put every other entry on the axis, the
        # boundary between kept and evicted out of sight.  Log where every value is positive and far apart.
        log = bool(label and drawn.size and drawn.min() > 0 and drawn.max() >= 10 * np.median(drawn))
        if log:
            notes.append("log scale: a few entries (e.g. the sinks) score far above the rest")
        fig = go.Figure(go.Scattergl(
            x=present, y=y, mode="markers", hovertext=text, hoverinfo="text",
            marker=dict(color=[EVICTED_COLOR if p in evicted else KEPT_COLOR for p in present],
                        size=[11 if p in evicted else 6 for p in present],
                        symbol=["x" if p in evicted else "circle" for p in present])))
        if log:  # decades only, as powers of ten ("100μ" read as a unit)
            fig.update_yaxes(type="log", dtick=1, exponentformat="power")
        if label is None:  # a strip of what is present and what goes: there is no score to put on an axis
            # TOVA at the prefill, or AvoKV-E before its first checkpoint, read as "decides by position"
            scored = [e.step for e in self.events if e.utility is not None or e.raw is not None]
            later = next((scored_step for scored_step in scored if scored_step > event.step), None)
            why = (f"nothing scored by this step: the first score is at step {later}" if later is not None else
                   "nothing scored at this step" if scored else
                   "no checkpoint by this step: this policy scores entries at its checkpoints only"
                   if self.interval is not None else "this policy keeps no per-entry score: it decides by position")
            top = _hang_title(fig, *titled(f"Step {event.step}: the entries present", "● kept · × evicted now", why))
            fig.update_layout(xaxis_title="absolute position", yaxis_visible=False, height=140 + top,
                              margin=dict(l=50, r=20, t=top, b=40))
            return fig
        top = _hang_title(fig, *titled(f"Step {event.step}: {label} of each entry present", *notes,
                                       "hover a point: its token, score and rank"))
        fig.update_layout(xaxis_title="absolute position", yaxis_title=label, height=260 + top,
                          margin=dict(l=50, r=20, t=top, b=40))
        return fig

    def terms_frame(self, step: int) -> tuple[pd.DataFrame | None, str]:
        """The terms of the last decision made at or before ``step`` (a checkpoint), one row per judged entry,
        lowest score first (the first to go), and a caption; ``None`` and why when there is none."""
        upto = self.events[: min(step, self.steps - 1) + 1]
        decided = [event for event in upto if event.components]
        if not decided:
            later = [event.step for event in self.events[len(upto):] if event.components][:3]
            scored = any(event.utility is not None for event in self.events)
            whole = ("its utility is the whole story (the step detail and the rank heatmap show it)" if scored
                     else "it keeps no per-entry score either, and decides by position alone")
            return None, (f"This policy records no terms per entry: {whole}."
                          if not any(event.components for event in self.events) else
                          f"No decision by step {upto[-1].step} yet; the next at step{'s' if len(later) > 1 else ''} "
                          + ", ".join(map(str, later)) + ".")
        event = decided[-1]
        terms = event.components
        judged = ~np.all([np.isnan(values) for values in terms.values()], axis=0)
        present = event.present[judged]
        frame = pd.DataFrame({"position": present, "token": [self.token_cell(int(p)) for p in present],
                              **{name: values[judged].astype(np.float64) for name, values in terms.items()}})
        score = list(terms)[-1]  # the combined score comes last (AvoKV-E's S, R-KV's score)
        sink = np.isposinf(frame[score].to_numpy())  # kept by rule, whatever their terms
        frame["fate"] = np.where(np.isin(present, event.evicted), "evicted", np.where(sink, "kept (sink)", "kept"))
        frame = frame.sort_values([score, "position"], kind="stable").reset_index(drop=True)
        # The decision first (the score and the fate), then the terms it combines: a narrow table keeps them in view
        frame = frame[["position", "token", score, "fate", *[name for name in terms if name != score]]]
        unjudged = event.present.size - int(judged.sum())
        kept = frame[frame["fate"] == "kept"][score]
        gone = frame[frame["fate"] == "evicted"][score]
        margin = ""
        if len(kept) and len(gone):
            highest, lowest = _apart(gone.max(), kept.min())
            margin = (f"; the cut fell between `{score}` {highest} (highest evicted) and {lowest} (lowest kept)"
                      if highest != lowest else f"; the cut fell within a tie at `{score}` {highest}: the older "
                      "entries went first")
        caption = (f"**Step {event.step}** (the decision behind step {upto[-1].step}'s cache): {int(judged.sum())} "
                   f"entries with terms, {event.evicted.size} evicted, lowest `{score}` first" + margin
                   + (f"; {int(sink.sum())} sinks kept by rule" if sink.any() else "")
                   + (f"; {unjudged} in the protected tail, not judged" if unjudged else "") + "."
                   + self._off_schedule(event) + (f"\n\n*{self.terms_key}.*" if self.terms_key else ""))
        return frame, caption

    def _off_schedule(self, event: StepEvent) -> str:
        """Why a checkpoint fell between the interval's multiples ("" on one): the cache would have passed
        B + interval - 1, the most such a policy holds -- at step 1 where the prompt alone did."""
        if not self.interval or event.step % self.interval == 0:
            return ""
        most = self.budget + self.interval - 1
        why = ("the prompt alone was over" if event.step == 1 and self.prompt_len > most
               else "the cache would have passed")
        return (f" A checkpoint off its every-{self.interval} schedule: {why} B + {self.interval - 1} = {most} entries, "
                "the most it holds between checkpoints.")

    # -- token history ---------------------------------------------------------------------------------
    def evicted_at(self, position: int) -> int | None:
        """The step whose eviction removed ``position``, or ``None`` if it is still cached."""
        left = int(self.left[position])
        return None if left == NEVER else left

    def follow(self, query: str | None, step: int, prompt_only: bool = False) -> tuple[list[int], str]:
        """The positions a token-history figure follows, and a note on how they were chosen.

        ``#12, #40-45`` names positions; any other text is looked up in the tokens' text (case-insensitive,
        across token boundaries: ``7342519`` finds every token of each occurrence).  Empty: the entries at
        the eviction boundary at ``step``: those it evicted, by the score the step recorded for them (see
        :meth:`_closest_evicted`), then the lowest-utility kept ones, four in all.
        ``prompt_only``: look in the prompt alone (the part several runs of one prompt share).
        """
        query = (query or "").strip()
        known = self.prompt_len + max(self.steps - 1, 0)  # positions that entered the cache (not the last token)
        known = min(known, self.prompt_len) if prompt_only else known
        if not query:
            event = self.events[min(step, self.steps - 1)]
            evicted, basis = self._closest_evicted(event)
            chosen = evicted[:4]
            if event.utility is not None and len(chosen) < 4:
                finite = np.isfinite(event.utility)
                order = np.lexsort((event.kept[finite], event.utility[finite]))  # lowest first, older first
                chosen += event.kept[finite][order][: 4 - len(chosen)].tolist()
            # Say how many of each are shown: "evicted 16, then the next in line" promised more than the four
            shown_evicted, evicted_total = min(len(evicted), 4), len(event.evicted)
            parts = [(f"{shown_evicted} of the {evicted_total} evicted" if evicted_total > shown_evicted
                      else f"the {evicted_total} evicted") + f" ({basis} first)"] if evicted_total else []
            if len(chosen) > shown_evicted:
                parts.append(f"the next {len(chosen) - shown_evicted} in line for eviction")
            what = f"at step {event.step}: " + ("" if evicted_total else "nothing evicted; ")
            return chosen, (what + ", then ".join(parts) if chosen
                            else what + "nothing to follow (no utility); type a token or #position")
        try:
            positions, note = find_positions([self.token(p) for p in range(known)], query)
        except ValueError as error:
            return [], str(error)
        if len(positions) > MAX_FOLLOWED:
            note += f"the first {MAX_FOLLOWED} of {len(positions)} positions"
            positions = positions[:MAX_FOLLOWED]
        else:
            note += f"{len(positions)} position(s)"
        return positions, note

    @staticmethod
    def _closest_evicted(event: StepEvent) -> tuple[list[int], str]:
        """The step's evicted positions in order of the score the step recorded for them, highest first: the
        decision's own score where the policy records its terms, else this step's raw score (for an EMA
        policy, not what it decided by: events keep no utility for what they evict); newest first without
        either.  Returns the positions and what they are ordered by."""
        present, evicted = event.present, event.evicted
        if event.components:
            name, score = list(event.components.items())[-1]
            basis = f"highest {name}"
        else:
            score, basis = event.raw, "highest raw score"
        if score is None or not evicted.size:
            return evicted[::-1].tolist(), "newest"
        values = np.nan_to_num(score[np.searchsorted(present, evicted)], nan=-np.inf)
        return evicted[np.lexsort((-evicted, -values))].tolist(), basis

    def _history(self, positions: list[int]):
        """token_history for ``positions``, kept while the run and the positions stay the same (scrubbing
        with a typed query asks for the same one again and again)."""
        key = (tuple(positions), self.steps)
        if self._history_cache is None or self._history_cache[0] != key:
            self._history_cache = (key, token_history(self.events, positions))
        return self._history_cache[1]

    def history_figure(self, positions: list[int], note: str = "", marker_step: int | None = None) -> go.Figure:
        """Each followed token's rank at every step: by the policy's utility (solid) and by the step's raw
        score (dotted), against the budget line; a cross where it was evicted (InertiaKV Fig. 4).

        Utility ranks count the finite utilities only (what the policy has judged); when it protects sinks or
        a tail, those never compete, and a second line marks the slots left for judged entries.
        """
        if not positions:
            return _empty_figure(note or "no token to follow")
        if all(event.utility is None and event.raw is None for event in self.events):
            return self._lifelines(positions, note, marker_step)
        history = self._history(positions)
        crossings = boundary_crossings(history, self.budget)
        fig = go.Figure()
        crosses = []  # (steps, decision ranks, name, colour) of each followed token's eviction
        evicted_at = {position: step for position in positions if (step := self.evicted_at(position)) is not None}
        for index, (position, rows) in enumerate(history.groupby("position", sort=False)):
            color, name = FOLLOW_COLORS[index % len(FOLLOW_COLORS)], f"#{position} {self.token(position)!r}"
            gone = rows[rows["evicted"]]
            fate = f"evicted at step {evicted_at[position]}" if position in evicted_at else "kept"
            legend = f"{name} · {fate}" + (f" · raw crossed B {crossings[position]}×"
                                           if rows["raw_rank"].notna().any() else "")
            hover = [f"{name} · step {s}<br>utility {u:.4g} · rank {r:g}" for s, u, r in
                     zip(rows["step"], rows["utility"], rows["utility_rank"])]
            fig.add_scatter(x=rows["step"], y=rows["utility_rank"], mode="lines+markers", name=legend,
                            legendgroup=name, line=dict(color=color), marker=dict(size=4), hovertext=hover,
                            hoverinfo="text")
            scored = rows[rows["raw_rank"].notna()]  # every step, or every r-th with Lazy refresh
            if len(scored):
                hover = [f"{name} · step {s}<br>raw {v:.4g} · rank {r:g} of {c}" for s, v, r, c in
                         zip(scored["step"], scored["raw"], scored["raw_rank"], scored["cached"])]
                fig.add_scatter(x=scored["step"], y=scored["raw_rank"], mode="lines+markers", name=name + " raw",
                                legendgroup=name, showlegend=False, line=dict(color=color, dash="dot", width=1.5),
                                marker=dict(size=3), hovertext=hover, hoverinfo="text")
            if len(gone):  # at its rank in the decision where the step recorded one, else by the step's raw
                # score (a mass eviction's tokens then spread out, not all on one point), else just past B
                ranks = [(rank, "that decision's score") if (rank := self._decision_rank(s, position)) is not None
                         else (float(raw), "the step's raw score") if np.isfinite(raw) else (None, "")
                         for s, raw in zip(gone["step"], gone["raw_rank"])]
                crosses.append((gone["step"].tolist(), ranks, name, color))
        fig.add_hline(y=self.budget + 0.5, line_dash="dash", line_color="#888",
                      annotation_text=f"budget B = {self.budget}", annotation_position="bottom left",
                      annotation_bgcolor="rgba(255,255,255,0.6)")
        # The slots left for judged entries, where the protected ones hold no finite utility and so are not
        # ranked (AvoKV-E's sinks and tail); not where they compete in the ranks (H2O's recent window).
        # Its label is in the key: written on the line, it lay across the followed tokens' lines.
        judged = self.budget - sum(self.pinned)
        last = self.events[-1 if marker_step is None else min(marker_step, self.steps - 1)]
        unranked = 0 if last.utility is None else int((~np.isfinite(last.utility)).sum())
        judged_key = ""
        if any(self.pinned) and judged > 0 and unranked >= sum(self.pinned):
            fig.add_hline(y=judged + 0.5, line_dash="dashdot", line_color="#888")
            judged_key = (f"dash-dot: the {judged} slots for judged entries (B less {sum(self.pinned)} "
                          "protected, which hold no rank)")
        _marker_x(fig, marker_step)
        # Around the boundary: the prefill and the first cut rank the whole prompt, and would flatten it; a
        # line that leaves through the bottom fell further than twice the budget.
        decoding = history[history["step"] >= 1]
        deepest = np.nanmax(decoding[["raw_rank", "utility_rank"]].to_numpy(), initial=0.0)
        deepest = max([deepest, *(rank for _, ranks, _, _ in crosses for rank, _ in ranks if rank is not None)])
        bottom = max(self.budget + 1, min(deepest, 2 * self.budget))
        below = False  # a cross deeper than the plot sits on its floor as a triangle pointing down
        for steps, ranks, name, color in crosses:
            deeper = [rank is not None and rank > bottom for rank, _ in ranks]
            below |= any(deeper)
            fig.add_scatter(x=steps, y=[self.budget + 1 if rank is None else min(rank, bottom) for rank, _ in ranks],
                            mode="markers", legendgroup=name, showlegend=False, hoverinfo="text",
                            marker=dict(color=color, size=10, symbol=["triangle-down" if d else "x" for d in deeper]),
                            hovertext=[f"{name} evicted at step {s}" + ("" if rank is None else f", rank {rank:g} by "
                                       f"{by}" + (" (below the plot)" if d else "")) for s, (rank, by), d
                                       in zip(steps, ranks, deeper)])
        # Room under the budget line for its label and the crosses, a fixed share of the plot's height.
        fig.update_yaxes(range=[bottom + max(0.7, 0.08 * bottom), 0.3], title="rank (1 = most useful)")
        # Below the plot, a legend line per followed token: the figure grows with them rather than
        # squeezing the plot (a 7-digit needle is 7 or more lines)
        rows = len(positions)  # an entry a line: three a row ran over the x title in a 1000-px window
        # The dotted lines only where the policy records a raw score (AvoKV-E and R-KV decide at checkpoints
        # and record none: the key promised lines that never came)
        dotted = " · dotted: rank by the step's raw score" if history["raw_rank"].notna().any() else ""
        # The fates first: where many crosses fall on one step they overlap, and lines leave the plot
        steps = sorted(set(evicted_at.values()))
        fates = f"{len(positions) - len(evicted_at)} of {len(positions)} kept through step {self.steps - 1}" + (
            f", {len(evicted_at)} evicted at " + (f"step {steps[0]}" if len(steps) == 1 else
                                                    f"steps {steps[0]} to {steps[-1]}") if steps else "")
        # where a cross stands: an EMA policy keeps no utility for what it evicts, so its cross is at the raw
        # rank, which can lie inside the top B (the eviction was by utility); the key says so
        bases = sorted({by for _, ranks, _, _ in crosses for _, by in ranks if by})
        crossed = "×: evicted" + (f", at its rank by {' or '.join(bases)}" if bases else "")
        top = _hang_title(fig, *titled(f"Token history: {note}", fates,
                                       f"solid: rank by the policy's utility{dotted} · below the dashed line: out of "
                                       "the top B", crossed + f" · ▼: evicted ranked below {bottom:g}" * below,
                                       judged_key))
        fig.update_layout(xaxis_title="decode step", xaxis_dtick=step_dtick(self.steps),
                          height=260 + top + LEGEND_LINE * rows, xaxis_range=step_range(self.steps),
                          margin=dict(l=50, r=20, t=top, b=60 + LEGEND_LINE * rows),
                          legend=dict(orientation="v", yanchor="top", y=-0.24))
        return fig

    def _lifelines(self, positions: list[int], note: str, marker_step: int | None) -> go.Figure:
        """The token history of a policy with no per-entry score (StreamingLLM, Recency): no rank to plot,
        so a line per followed token over the steps it was cached, and a cross at the step that evicted it."""
        fig = go.Figure()
        last = self.steps - 1
        for index, position in enumerate(positions):
            color, name = FOLLOW_COLORS[index % len(FOLLOW_COLORS)], f"#{position} {self.token(position)!r}"
            start, step = int(self.entered[position]), self.evicted_at(position)
            fate = "kept" if step is None else f"evicted at step {step}"
            fig.add_scatter(x=[start, last if step is None else step], y=[name, name], mode="lines",
                            line=dict(color=color, width=3), name=f"{name} · {fate}", hoverinfo="text",
                            hovertext=f"{name}: cached from step {start}, {fate}")
            if step is not None:
                fig.add_scatter(x=[step], y=[name], mode="markers", showlegend=False, hoverinfo="skip",
                                marker=dict(color=color, symbol="x", size=10))
        _marker_x(fig, marker_step)
        fig.update_yaxes(autorange="reversed", type="category")
        fig.update_xaxes(range=step_range(self.steps))  # the whole run, so that a line's length reads against it
        top = _hang_title(fig, *titled(f"Token history: {note}", "this policy keeps no per-entry score (it decides "
                                       "by position): each line is a token's time in the cache, × where it was evicted"))
        fig.update_layout(xaxis_title="decode step", xaxis_dtick=step_dtick(self.steps), showlegend=False,
                          height=90 + top + 22 * len(positions), margin=dict(l=120, r=20, t=top, b=50))
        return fig

    def _decision_rank(self, step: int, position: int) -> float | None:
        """Where an entry evicted at ``step`` stood in that step's decision: its rank (1 = most kept) by the
        checkpoint's score among the entries it judged (AvoKV-E's S, R-KV's score), so that tokens one
        checkpoint evicts together do not all sit on one point; ``None`` where the step recorded no score
        (a per-step policy evicts the one entry ranked just past B)."""
        event = self.events[step]
        terms = event.components or {}
        score = terms.get("S", terms.get("score"))
        if score is None:
            return None
        index = int(np.searchsorted(event.present, position))
        judged = np.isfinite(score)
        if index >= score.size or not judged[index]:
            return None
        return float(descending_rank(score[judged], score[index:index + 1])[0])

    # -- tokens ----------------------------------------------------------------------------------------
    def token(self, position: int) -> str:
        return self.tokens[position] if position < len(self.tokens) else ""

    def token_cell(self, position: int) -> str:
        """The token as a table cell shows it: :func:`visible_whitespace`."""
        return visible_whitespace(self.token(position))

    def fate_html(self, step: int | None = None, prompt_only: bool = True) -> str:
        """The tokens coloured by fate: kept to the end (or to ``step``), evicted at step s, not yet generated."""
        step = self.steps - 1 if step is None else step
        end = self.prompt_len if prompt_only else min(len(self.tokens), self.prompt_len + step)
        spans = []
        last_step = max(self.steps - 1, 1)
        for position in range(end):
            left = int(self.left[position])
            if left <= step:
                shade = 0.25 + 0.6 * left / last_step  # early evictions paler
                style = f"background: rgba(230,120,60,{shade:.2f})"
                tip = f"pos {position}: evicted at step {left}"
            else:
                style = f"background: {KEPT_COLOR}; color: white"
                tip = f"pos {position}: kept" + (" to the end" if step == self.steps - 1 else f" at step {step}")
            spans.append(f'<span title="{tip}" style="{style}">{html.escape(self.token(position))}</span>')
        # The colours' key: without it they were explained on hover only
        kept = "kept to the end" if step == self.steps - 1 else f"kept at step {step}"
        key = (f'<div style="font-size: 0.85em; margin-bottom: 4px"><span style="background: {KEPT_COLOR}; '
               f'color: white; padding: 0 4px">{kept}</span> <span style="background: rgba(230,120,60,0.25); '
               'padding: 0 4px">evicted early</span><span style="background: rgba(230,120,60,0.85); '
               'padding: 0 4px">… late</span> · hover a token for its step</div>')
        return (key + '<div style="font-family: monospace; white-space: pre-wrap; line-height: 1.6; max-height: 320px;'
                ' overflow-y: auto">' + "".join(spans) + "</div>")


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
    # columns past it, where a centred label was cut at the plot's edge
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
    # broken into lines: on one, a long message ran past both edges of a plot in a 1000-px window
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


def blindspot_figure(spot) -> go.Figure:
    """AvoKV-E Fig. 1(a) from a :class:`kvviz.probe.Blindspot`: the high-damage share per (read-pressure rank,
    payload rank) bin, each cell labelled high-damage / entries, the blindspot cell outlined."""
    bins = spot.grid_entries.shape[0]
    edges = [f"{i / bins:.1f}–{(i + 1) / bins:.1f}" for i in range(bins)]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(spot.grid_entries > 0, spot.grid_high / spot.grid_entries, np.nan)
    labels = [[f"{spot.grid_high[r, c]}/{spot.grid_entries[r, c]}" for c in range(bins)] for r in range(bins)]
    fig = go.Figure(go.Heatmap(
        z=share, x=edges, y=edges, text=labels, texttemplate="%{text}", colorscale="Reds", zmin=0, zmax=0.5,
        colorbar=dict(title="high-damage<br>share"),
        hovertemplate="N(p) %{x}<br>N(b) %{y}<br>high-damage %{text} (%{z:.0%})<extra></extra>"))
    # N(p) <= 0.2, N(b) >= 0.8: the first column, top row
    fig.add_shape(type="rect", x0=-0.5, x1=0.5, y0=bins - 1.5, y1=bins - 0.5, line=dict(color="#1f3b73", width=3))
    # The test's line, broken to fit (on one line it ran past the plot's edge), under the plot's label chip
    lines = textwrap.wrap("Blindspot: " + spot.summary().replace("<=", "≤").replace(">=", "≥"), TITLE_12_CHARS)
    top = CHIP_HEIGHT + SMALL_LINE * len(lines) + TITLE_GAP
    fig.update_layout(
        title=dict(text="<br>".join(lines), font=dict(size=12), yref="container", y=1, yanchor="top",
                   pad_t=CHIP_HEIGHT),
        xaxis_title="read-pressure rank N(p) (AvoKV-E)", yaxis_title="payload rank N(b)", height=330 + top,
        margin=dict(l=60, r=20, t=top, b=50))
    return fig


def spectrum_figure(spectrum) -> go.Figure:
    """InertiaKV §5.1's correlation spectrum from a :class:`kvviz.spectrum.Spectrum`: each scorer's mean
    Spearman with attention, at the chosen layer and through the InertiaKV utility, as grouped bars."""
    rows = spectrum.table()
    names = [row["scorer"] for row in rows]
    fig = go.Figure()
    for key, label, color in (("layer_spearman", f"layer {spectrum.layer}", "#7a9cc6"),
                              ("utility_spearman", "InertiaKV utility (EMA over layers)", "#1f3b73")):
        jaccard = key.replace("spearman", "jaccard")
        fig.add_bar(x=names, y=[row[key] for row in rows], name=label, marker_color=color,
                    customdata=[row[jaccard] for row in rows],
                    hovertemplate="%{x}<br>Spearman %{y:.3f}<br>top-B Jaccard %{customdata:.3f}<extra>" + label + "</extra>")
    fig.update_layout(barmode="group", yaxis=dict(title="Spearman with attention", range=[-1, 1.05]), height=340,
                      title=dict(text=f"Scorers against last-query attention, steps 1–{spectrum.steps[-1]}",
                                 font=dict(size=12)),
                      legend=dict(orientation="h", y=-0.2), margin=dict(l=60, r=20, t=50, b=40))
    return fig


def spectrum_layers_figure(spectrum) -> go.Figure:
    """Each scorer's Spearman with attention at every layer (mean over steps): where on the spectrum a
    scorer sits depends on the layer, and the paper reports one (15).  The compared layer is outlined."""
    profile = spectrum.layer_profile()
    names = list(profile)
    z = np.array([profile[name] for name in names])
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(spectrum.num_layers)), y=names, colorscale="RdBu", zmid=0, zmin=-1, zmax=1,
        colorbar=dict(title="Spearman"), hovertemplate="%{y} at layer %{x}<br>Spearman %{z:.3f}<extra></extra>"))
    fig.add_shape(type="rect", x0=spectrum.layer - 0.5, x1=spectrum.layer + 0.5, y0=-0.5, y1=len(names) - 0.5,
                  line=dict(color="#222", width=2))
    fig.update_layout(title=dict(text="Spearman with attention at each layer (mean over steps)", font=dict(size=12)),
                      xaxis=dict(title="layer (from 0)", dtick=1 if spectrum.num_layers <= 40 else None),  # no 0.5
                      yaxis=dict(autorange="reversed"),  # the bar chart's order, top down
                      height=300, margin=dict(l=80, r=20, t=50, b=40))
    return fig
