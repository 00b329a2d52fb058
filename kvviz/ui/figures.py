"""What the dashboard draws, built from step events only (no Gradio here, so it is testable and reusable).

:class:`RunView` keeps a compact record of one run -- the step at which each position entered and left
the cache, and each kept position's utility rank per step -- and renders Plotly figures from it.  Large
runs are binned (at most ``MAX_COLUMNS`` positions x ``MAX_ROWS`` steps per heatmap) and sent as uint8
so a 2k-token prompt with 256 steps stays well under 300 KB per figure.
"""

from __future__ import annotations

import html
import math

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..diagnostics import ranks as ascending_ranks
from ..trace import StepEvent

# Importable from here as before: the tabs and the tests import them from this module
from .analysis_figures import blindspot_figure, spectrum_figure, spectrum_layers_figure  # noqa: F401
from .history import TokenHistory
from .plots import (  # noqa: F401
    EMPTY,
    EMPTY_COLOR,
    EVICTED_COLOR,
    FOLLOW_COLORS,
    FOLLOWED_COLOR,
    GONE,
    HALO,
    HALO_COLOR,
    HEAD_CHARS,
    KEPT_COLOR,
    LEGEND_LINE,
    MAX_COLUMNS,
    MAX_FOLLOWED,
    MAX_ROWS,
    NEVER,
    NOTE_CHARS,
    RANK_SCALE,
    STEP_MARKER,
    STEP_MARKER_COLOR,
    TITLE_12_CHARS,
    UNSCORED,
    _apart,
    _binned_share,
    _cell_note,
    _empty_figure,
    _evicted_range,
    _hang_title,
    _heatmap,
    _heatmap_title,
    _marker,
    _position_range,
    _time_mode,
    step_dtick,
    step_range,
    titled,
    visible_whitespace,
)


class RunView(TokenHistory):
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
        # the key on a line of its own, in small type, to fit a half-width plot
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
        index = min(step, self.steps - 1)
        event = self.events[index]
        present, evicted = event.present, set(event.evicted.tolist())
        utility, rank, y, label, notes = self._step_scores(index, evicted)
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
        if label is None:
            return self._entries_strip(fig, event)
        top = _hang_title(fig, *titled(f"Step {event.step}: {label} of each entry present", *notes,
                                       "hover a point: its token, score and rank"))
        fig.update_layout(xaxis_title="absolute position", yaxis_title=label, height=260 + top,
                          margin=dict(l=50, r=20, t=top, b=40))
        return fig

    def _step_scores(self, index: int, evicted: set[int]) -> tuple[dict, dict, list, str | None, list[str]]:
        """Event ``index``'s (utility by position, rank by position, y per present entry, the y axis's name or
        None where there is no score, notes for its title): the policy's utility, else the step's raw score."""
        event = self.events[index]
        present, notes = event.present, []
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
                notes.append(self._flat_note(index, next(iter(finite.values()))))
        elif event.raw is not None:
            utility, rank, y, label = {}, {}, list(event.raw), "raw score of this step"
        else:
            utility, rank, y, label = {}, {}, [0.0] * len(present), None
        if evicted and event.utility is not None:
            notes.append("× evicted now, drawn at the lowest utility (its own is not recorded)")
        return utility, rank, y, label, notes

    def _flat_note(self, index: int, value: float) -> str:
        """Why every entry's utility at event ``index`` is one ``value``: nothing told them apart, or none is
        scored yet."""
        later = next((e.step for e in self.events[index + 1:] if e.raw is not None), None)
        scored = any(e.raw is not None for e in self.events[:index + 1])
        return f"every entry's utility is {value:.3g}" + (
            ": nothing has told them apart yet" if scored else ": none scored yet"
            + (f" (the first scoring is at step {later})" if later is not None else ""))

    def _entries_strip(self, fig: go.Figure, event: StepEvent) -> go.Figure:
        """The step detail with no score to put on an axis: a strip of what is present and what goes, titled
        with why there is none (TOVA at the prefill, or AvoKV-E before its first checkpoint, read as "decides
        by position")."""
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
        return (f" A checkpoint off its every-{self.interval} schedule: {why} B + {self.interval - 1} = {most} "
                "entries, the most it holds between checkpoints.")

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
        # The colours' key, above the tokens
        kept = "kept to the end" if step == self.steps - 1 else f"kept at step {step}"
        key = (f'<div style="font-size: 0.85em; margin-bottom: 4px"><span style="background: {KEPT_COLOR}; '
               f'color: white; padding: 0 4px">{kept}</span> <span style="background: rgba(230,120,60,0.25); '
               'padding: 0 4px">evicted early</span><span style="background: rgba(230,120,60,0.85); '
               'padding: 0 4px">… late</span> · hover a token for its step</div>')
        return (key + '<div style="font-family: monospace; white-space: pre-wrap; line-height: 1.6; max-height: 320px;'
                ' overflow-y: auto">' + "".join(spans) + "</div>")

