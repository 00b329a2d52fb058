"""The token-history half of :class:`kvviz.ui.figures.RunView`: which tokens to follow, and their ranks
and fates over the run's steps."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..diagnostics import boundary_crossings, descending_rank, find_positions, token_history
from ..trace import StepEvent
from .plots import (
    FOLLOW_COLORS,
    LEGEND_LINE,
    MAX_FOLLOWED,
    NEVER,
    _empty_figure,
    _hang_title,
    _marker_x,
    step_dtick,
    step_range,
    titled,
)


class TokenHistory:
    """Following tokens through a run: mixed into RunView, whose ``events``, ``entered``, ``left``, ``budget``,
    ``pinned`` and ``token`` it reads."""

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
        evicted_at = {position: step for position in positions if (step := self.evicted_at(position)) is not None}
        fig = go.Figure()
        crosses = self._rank_lines(fig, history, evicted_at)
        fig.add_hline(y=self.budget + 0.5, line_dash="dash", line_color="#888",
                      annotation_text=f"budget B = {self.budget}", annotation_position="bottom left",
                      annotation_bgcolor="rgba(255,255,255,0.6)")
        judged_key = self._judged_line(fig, marker_step)
        _marker_x(fig, marker_step)
        bottom = self._rank_floor(history, crosses)
        below = self._eviction_marks(fig, crosses, bottom)
        # Room under the budget line for its label and the crosses, a fixed share of the plot's height.
        fig.update_yaxes(range=[bottom + max(0.7, 0.08 * bottom), 0.3], title="rank (1 = most useful)")
        # Below the plot, a legend line per followed token: the figure grows with them rather than
        # squeezing the plot (a 7-digit needle is 7 or more lines)
        rows = len(positions)  # an entry a line: three a row would run over the x title
        top = _hang_title(fig, *titled(f"Token history: {note}", *self._history_notes(
            positions, history, evicted_at, crosses, bottom, below), judged_key))
        fig.update_layout(xaxis_title="decode step", xaxis_dtick=step_dtick(self.steps),
                          height=260 + top + LEGEND_LINE * rows, xaxis_range=step_range(self.steps),
                          margin=dict(l=50, r=20, t=top, b=60 + LEGEND_LINE * rows),
                          legend=dict(orientation="v", yanchor="top", y=-0.24))
        return fig

    def _rank_lines(self, fig: go.Figure, history, evicted_at: dict[int, int]) -> list:
        """Draw each followed token's utility rank (solid) and raw rank (dotted); returns its evictions as
        (steps, [(rank, what ranked it)], name, colour), for :meth:`_eviction_marks`."""
        crossings = boundary_crossings(history, self.budget)
        crosses = []
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
        return crosses

    def _judged_line(self, fig: go.Figure, marker_step: int | None) -> str:
        """The slots left for judged entries, where the protected ones hold no finite utility and so are not
        ranked (AvoKV-E's sinks and tail); not where they compete in the ranks (H2O's recent window).
        Returns its key line: written on the line, its label would lie across the followed tokens' lines."""
        judged = self.budget - sum(self.pinned)
        last = self.events[-1 if marker_step is None else min(marker_step, self.steps - 1)]
        unranked = 0 if last.utility is None else int((~np.isfinite(last.utility)).sum())
        if not (any(self.pinned) and judged > 0 and unranked >= sum(self.pinned)):
            return ""
        fig.add_hline(y=judged + 0.5, line_dash="dashdot", line_color="#888")
        return (f"dash-dot: the {judged} slots for judged entries (B less {sum(self.pinned)} protected, "
                "which hold no rank)")

    def _rank_floor(self, history, crosses: list) -> float:
        """The plot's deepest rank: around the boundary, as the prefill and the first cut rank the whole prompt
        and would flatten it; a line that leaves through the bottom fell further than twice the budget."""
        decoding = history[history["step"] >= 1]
        deepest = np.nanmax(decoding[["raw_rank", "utility_rank"]].to_numpy(), initial=0.0)
        deepest = max([deepest, *(rank for _, ranks, _, _ in crosses for rank, _ in ranks if rank is not None)])
        return max(self.budget + 1, min(deepest, 2 * self.budget))

    def _eviction_marks(self, fig: go.Figure, crosses: list, bottom: float) -> bool:
        """A cross at each eviction's rank, or a triangle pointing down on the plot's floor for one deeper than
        ``bottom``; returns whether any was that deep."""
        below = False
        for steps, ranks, name, color in crosses:
            deeper = [rank is not None and rank > bottom for rank, _ in ranks]
            below |= any(deeper)
            fig.add_scatter(x=steps, y=[self.budget + 1 if rank is None else min(rank, bottom) for rank, _ in ranks],
                            mode="markers", legendgroup=name, showlegend=False, hoverinfo="text",
                            marker=dict(color=color, size=10, symbol=["triangle-down" if d else "x" for d in deeper]),
                            hovertext=[f"{name} evicted at step {s}" + ("" if rank is None else f", rank {rank:g} by "
                                       f"{by}" + (" (below the plot)" if d else "")) for s, (rank, by), d
                                       in zip(steps, ranks, deeper)])
        return below

    def _history_notes(self, positions: list[int], history, evicted_at: dict[int, int], crosses: list,
                       bottom: float, below: bool) -> tuple[str, str, str]:
        """The token history's key: the fates first (where many crosses fall on one step they overlap, and
        lines leave the plot), then what the lines and the crosses are."""
        steps = sorted(set(evicted_at.values()))
        fates = f"{len(positions) - len(evicted_at)} of {len(positions)} kept through step {self.steps - 1}" + (
            f", {len(evicted_at)} evicted at " + (f"step {steps[0]}" if len(steps) == 1 else
                                                    f"steps {steps[0]} to {steps[-1]}") if steps else "")
        # The dotted lines only where the policy records a raw score (AvoKV-E and R-KV decide at checkpoints
        # and record none)
        dotted = " · dotted: rank by the step's raw score" if history["raw_rank"].notna().any() else ""
        # where a cross stands: an EMA policy keeps no utility for what it evicts, so its cross is at the raw
        # rank, which can lie inside the top B (the eviction was by utility); the key says so
        bases = sorted({by for _, ranks, _, _ in crosses for _, by in ranks if by})
        crossed = "×: evicted" + (f", at its rank by {' or '.join(bases)}" if bases else "")
        return (fates, f"solid: rank by the policy's utility{dotted} · below the dashed line: out of the top B",
                crossed + f" · ▼: evicted ranked below {bottom:g}" * below)

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
                                       "by position): each line is a token's time in the cache, × where it was "
                                       "evicted"))
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
