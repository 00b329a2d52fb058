"""Diagnostics computed from traces (InertiaKV Appendix I and §5.1).

* churn: how much a top-k set changes from one step to the next, ``1 - Jaccard(A_(t-1), A_t)`` (the
  "top-B Jaccard churn" of InertiaKV §5.3);
* raw/EMA Jaccard: agreement of this step's raw top-k (``event.raw``) with the policy's top-k utility;
* raw-top evicted rate: share of this step's raw top-k that the step evicted;
* first keep set retained: the share of the first evicting step's keep set still kept (InertiaKV §3.1);
* keep-set turnover: ``1 - Jaccard`` of consecutive keep sets.  With k = B and the cache held at B, the
  utility top-k *is* the keep set, so utility churn equals this turnover (``2 / (B + 1)`` a step when the new
  entry displaces an old one) for every policy that evicts by its utility, InertiaKV or not; both count only
  steps that evicted (growth is no churn: a full cache, a checkpointed policy between checkpoints);
* rank stability: Spearman correlation of consecutive recomputations' raw scores (or utilities) over the
  entries scored at both, the ranking inertia that churn at k = B cannot show;
* Spearman correlation and top-k Jaccard between two scorers on the same step;
* mean pairwise Jaccard of the keep sets of several policies run on the same prompt;
* token history: one token's raw score, utility and their ranks at every step, and how often its raw rank
  crosses the budget boundary (InertiaKV Fig. 4 and Appendix I's rank traces);
* read lags: how many queries pass before a generated entry is first strongly read, split by how much it
  was read at first (AvoKV-E Fig. 1b, the case for delayed eligibility).

Raw scores are the policy's un-aggregated score of the step over every position present before eviction
(``event.present``); utilities are over the positions kept after it (``event.kept``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np
import pandas as pd

from .ranking import ranks  # also diagnostics.ranks, as the probe and the UI import it
from .trace import StepEvent, Trace


def top_k(positions: np.ndarray, scores: np.ndarray, k: int) -> set[int]:
    """The ``k`` highest-scoring positions (ties: the newer position ranks higher, as eviction drops older first)."""
    order = np.lexsort((-positions, -scores))  # primary: score desc, secondary: position desc
    return set(positions[order[:k]].tolist())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def churn(previous: set, current: set) -> float:
    return 1.0 - jaccard(previous, current)


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (Pearson on tie-averaged ranks); NaN when either side is constant."""
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = np.sqrt((ra ** 2).sum() * (rb ** 2).sum())
    return float((ra * rb).sum() / denominator) if denominator else float("nan")


def topk_jaccard(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Jaccard of the top-``k`` index sets of two score vectors over the same positions."""
    index = np.arange(len(a))
    return jaccard(top_k(index, np.asarray(a), k), top_k(index, np.asarray(b), k))


def _raw_top(event: StepEvent, k: int) -> set[int] | None:
    # A cache of k entries or fewer is its own top-k: its churn would be growth, its agreement trivially 1
    # (a budget of 100000 on a 2462-entry run read "raw utility jaccard 1.0000")
    if event.raw is None or len(event.present) <= k:
        return None
    return top_k(event.present, event.raw, k)


def _utility_top(event: StepEvent, k: int) -> set[int] | None:
    return None if event.utility is None else top_k(event.kept, event.utility, k)


def _consecutive_churn(sets: list[tuple[int, set | None]]) -> list[tuple[int, float]]:
    out = []
    for (step_a, a), (step_b, b) in zip(sets, sets[1:]):
        if a is not None and b is not None and step_b == step_a + 1:
            out.append((step_b, churn(a, b)))
    return out


def raw_churn(trace: Trace, k: int | None = None) -> list[tuple[int, float]]:
    """(step, churn of the raw top-k against the previous step), for consecutive scored steps."""
    k = k or trace.budget
    return _consecutive_churn([(e.step, _raw_top(e, k)) for e in trace.decode_steps])


def utility_churn(trace: Trace, k: int | None = None) -> list[tuple[int, float]]:
    """(step, churn of the top-k by the policy's utility (the EMA for InertiaKV) against the previous step),
    for consecutive steps of which the later evicted, the steps :func:`keep_turnover` pairs.  A step that
    evicts nothing decided nothing: between AvoKV-E's or R-KV's checkpoints each new entry, not judged yet,
    enters the top-k at +inf and pushes the lowest judged one out, 2 / (k + 1) a step that counted would
    read as churn (and match any policy's turnover at k = B)."""
    k = k or trace.budget
    evicted = {e.step for e in trace.decode_steps if e.evicted.size}
    return [(step, value) for step, value in _consecutive_churn([(e.step, _utility_top(e, k))
                                                                 for e in trace.decode_steps])
            if step in evicted]


def raw_utility_jaccard(trace: Trace, k: int | None = None) -> list[tuple[int, float]]:
    """(step, Jaccard of the raw top-k and the utility top-k) for steps that have both."""
    k = k or trace.budget
    out = []
    for event in trace.decode_steps:
        raw, utility = _raw_top(event, k), _utility_top(event, k)
        if raw is not None and utility is not None:
            out.append((event.step, jaccard(raw, utility)))
    return out


def raw_top_evicted_rate(trace: Trace, k: int | None = None) -> list[tuple[int, float]]:
    """(step, share of the step's raw top-k that the step evicted)."""
    k = k or trace.budget
    out = []
    for event in trace.decode_steps:
        raw = _raw_top(event, k)
        if raw is not None and raw:
            out.append((event.step, len(raw & set(event.evicted.tolist())) / len(raw)))
    return out


def keep_turnover(trace: Trace) -> list[tuple[int, float]]:
    """(step, churn of the keep set against the previous step's), for consecutive decode steps that evicted:
    a step that only adds its new entry replaces nothing (the full cache, a checkpointed policy between
    checkpoints, a prefill-time one), and counted it would read as turnover."""
    steps = trace.decode_steps
    return [(b.step, churn(set(a.kept.tolist()), set(b.kept.tolist())))
            for a, b in zip(steps, steps[1:]) if b.step == a.step + 1 and b.evicted.size]


def first_keep_set_retained(trace: Trace) -> list[tuple[int, float]]:
    """(step, share of the first evicting decode step's keep set still kept), from that step on.  InertiaKV
    §3.1 saw the top-B set stay its first-step set through a 79-step run (1.0 throughout): every later step
    then evicted only what arrived after it.  It can only fall, as an evicted entry never returns."""
    steps = trace.decode_steps
    first = next((event for event in steps if event.evicted.size), None)
    if first is None:
        return []
    base = set(first.kept.tolist())
    return [(event.step, len(base & set(event.kept.tolist())) / len(base)) for event in steps
            if event.step >= first.step]


def _common_values(positions_a, values_a, positions_b, values_b) -> tuple[np.ndarray, np.ndarray]:
    """Two steps' scores of the positions present at both, aligned."""
    _, in_a, in_b = np.intersect1d(positions_a, positions_b, assume_unique=True, return_indices=True)
    return np.asarray(values_a, np.float64)[in_a], np.asarray(values_b, np.float64)[in_b]


def _finite_spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman over the entries both scored finitely (AvoKV-E's +inf: not judged); NaN with fewer than
    three such entries or a constant side."""
    finite = np.isfinite(a) & np.isfinite(b)
    return spearman(a[finite], b[finite]) if finite.sum() >= 3 else float("nan")


def raw_rank_stability(trace: Trace) -> list[tuple[int, float]]:
    """(step, Spearman of this step's raw scores and the last scored step's over the entries present at both),
    for every scored step after the first: step to step for a policy that scores every step, refresh to
    refresh for Lazy refresh."""
    steps = [e for e in trace.decode_steps if e.raw is not None]
    return [(b.step, _finite_spearman(*_common_values(a.present, a.raw, b.present, b.raw)))
            for a, b in zip(steps, steps[1:])]


def utility_rank_stability(trace: Trace) -> list[tuple[int, float]]:
    """(step, Spearman of this step's utilities and those they replaced, over the entries kept at both), for
    each step whose utilities changed: step to step for a policy that rescores every step, refresh to
    refresh (Lazy) or checkpoint to checkpoint (AvoKV-E, R-KV, LazyEviction) otherwise.  A step that leaves
    every kept entry's utility as it was is no new ranking, so it is not paired: counted, it would read as a
    perfectly stable one (Score-Free, which never rescores, has no pair at all).

    Within one policy this is how much each recomputation reorders what it keeps.  Across policies, mind
    that each is measured on its own keep set, without the entry it evicts."""
    out, previous = [], None
    for event in trace.decode_steps:
        if event.utility is None:
            continue
        if previous is not None:
            before, after = _common_values(previous.kept, previous.utility, event.kept, event.utility)
            if np.array_equal(before, after, equal_nan=True):
                continue  # unchanged: the ranking it carries is the previous one (compare the next against that)
            out.append((event.step, _finite_spearman(before, after)))
        previous = event
    return out


def mean_pairwise_jaccard(traces: list[Trace]) -> float:
    """Mean over steps and policy pairs of the Jaccard of their keep sets (same prompt; common steps)."""
    values = []
    for a, b in combinations(traces, 2):
        for ea, eb in zip(a.decode_steps, b.decode_steps):
            values.append(jaccard(set(ea.kept.tolist()), set(eb.kept.tolist())))
    return float(np.mean(values)) if values else float("nan")


def keep_set_jaccard_over_time(a: Trace, b: Trace) -> list[tuple[int, float]]:
    """(step, Jaccard of two runs' keep sets) -- for the side-by-side comparison."""
    return [(ea.step, jaccard(set(ea.kept.tolist()), set(eb.kept.tolist())))
            for ea, eb in zip(a.events, b.events)]


# Why a summary value is n/a, for the tables that print one (the app's, `kvviz trace`)
NOT_AVAILABLE = ("n/a: this policy records no raw per-step score (or no utility) to compare, or no two consecutive "
                 "steps have one (raw churn pairs consecutive steps: Lazy refresh, Score-Free and the checkpointed "
                 "policies score too seldom; their rank stability pairs one scoring with the next); or the cache "
                 "never held more than k entries, so its top-k was all of it (for utility churn and keep turnover: "
                 "no two consecutive steps of which the later evicted; for the first keep set retained: no step "
                 "evicted after the first that did)")


def summary(trace: Trace, k: int | None = None) -> dict[str, float]:
    """Means of each diagnostic over the run (NaN where the policy records no raw scores or utility, or where
    nothing pairs: no two consecutive scored steps for a churn, no two recomputations for a rank stability),
    but the first keep set's share retained, which is at the run's end (NaN where no decode step after the
    first evicting one evicted)."""
    def mean(pairs):
        values = [v for _, v in pairs if not np.isnan(v)]  # a rank stability is NaN on a constant step
        return float(np.mean(values)) if values else float("nan")

    retained = first_keep_set_retained(trace)
    # Retained 1.0 means something only once later steps have evicted: with none, it holds by construction
    # (a checkpointed policy that checkpointed once), as churn is n/a without two evicting steps
    evicting = {event.step for event in trace.decode_steps if event.evicted.size}
    tested = [step for step, _ in retained[1:] if step in evicting]

    return {
        "raw_churn": mean(raw_churn(trace, k)),
        "utility_churn": mean(utility_churn(trace, k)),
        "keep_turnover": mean(keep_turnover(trace)),
        "raw_utility_jaccard": mean(raw_utility_jaccard(trace, k)),
        "raw_top_evicted_rate": mean(raw_top_evicted_rate(trace, k)),
        "raw_rank_stability": mean(raw_rank_stability(trace)),
        "utility_rank_stability": mean(utility_rank_stability(trace)),
        "first_keep_set_retained": retained[-1][1] if tested else float("nan"),
    }


# "#12, #40-45"; a trailing comma (a list being typed) is allowed
POSITION_QUERY = re.compile(r"^\s*#\d+(\s*-\s*#?\d+)?(\s*[,\s]\s*#\d+(\s*-\s*#?\d+)?)*(\s*,)?\s*$")


MAX_QUERY = 2000  # characters of a follow query: a phrase or a list of positions, never a document


def find_positions(tokens: Sequence[str], query: str) -> tuple[list[int], str]:
    """The positions ``query`` names among ``tokens`` (each position's text), and a note on what was found.

    ``#12, #40-45`` names positions; any other text is looked up in the tokens' text, case-insensitive and
    across token boundaries, so ``7342519`` finds every token of each occurrence however it was split.
    Raises ``ValueError`` saying what to change when nothing matches.
    """
    query = query.strip()
    if len(query) > MAX_QUERY:  # an 80 KB paste took seconds of a handler other sessions queue behind
        raise ValueError(f"the text to follow is {len(query)} characters; give at most {MAX_QUERY} (a phrase, or "
                         "positions as #12, #40-45)")
    if POSITION_QUERY.match(query):
        positions: dict[int, None] = {}
        beyond = False
        for low, high in re.findall(r"#(\d+)(?:\s*-\s*#?(\d+))?", query):
            low, high = sorted((int(low), int(high or low)))  # "#8-2" means the same as "#2-8"
            beyond |= max(low, high) >= len(tokens)
            # clipped before it is expanded: "#0-9999999999" is a typo, not ten billion positions
            positions.update(dict.fromkeys(range(low, min(high, len(tokens) - 1) + 1)))
        if not positions:
            raise ValueError(f"no position in {query!r} exists: the last is #{len(tokens) - 1}")
        return list(positions), (f"positions past the last (#{len(tokens) - 1}) left out; " if beyond else "")
    starts = np.cumsum([0] + [len(token) for token in tokens])
    found: dict[int, None] = {}
    for match in re.finditer(re.escape(query), "".join(tokens), re.IGNORECASE):
        first = int(np.searchsorted(starts, match.start(), side="right") - 1)
        last = int(np.searchsorted(starts, match.end() - 1, side="right") - 1)
        found.update(dict.fromkeys(range(first, last + 1)))
    if not found:
        raise ValueError(f"no token text contains {query!r}; give other text, or positions as #12, #40-45")
    return list(found), f"{query!r}: "


HISTORY_COLUMNS = ["step", "position", "present", "kept", "evicted", "raw", "raw_rank", "utility", "utility_rank",
                   "cached"]


def descending_rank(values: np.ndarray, of: np.ndarray) -> np.ndarray:
    """Rank of each of ``of`` among ``values``, 1 = highest; ties share their average rank; NaN for NaN."""
    values, of = np.asarray(values, np.float64)[None, :], np.asarray(of, np.float64)[:, None]
    rank = 1 + (values > of).sum(1) + ((values == of).sum(1) - 1) / 2
    return np.where(np.isnan(of[:, 0]), np.nan, rank)


def token_history(events: Iterable[StepEvent], positions: Sequence[int]) -> pd.DataFrame:
    """What happened to each of ``positions`` at every step: InertiaKV's rank traces (Fig. 4, Appendix I).

    Parameters
    ----------
    events : iterable of StepEvent
        A run's events in step order (``trace.events``; step 0, the prefill, included).
    positions : sequence of int
        Absolute positions to follow.

    Returns
    -------
    pandas.DataFrame
        One row per (step, position) with ``HISTORY_COLUMNS``: ``present`` (in the cache during the step,
        before its eviction), ``kept`` (still there after it), ``evicted`` (dropped at this step), ``raw`` and
        ``raw_rank`` (the step's un-aggregated score and its rank among the entries present; NaN on steps
        that computed none), ``utility`` and ``utility_rank`` (the policy's utility after the step and its
        rank among the kept entries whose utility is finite; NaN when not kept, not finite -- protected or
        not judged yet -- or the policy has none), ``cached`` (entries present).
        Ranks count from 1 = highest, ties averaged.  A position not yet generated is not present.
    """
    positions = np.asarray(list(positions), dtype=np.int64)
    rows = []
    for event in events:
        present = event.present
        where_present = np.isin(positions, present)
        where_kept = np.isin(positions, event.kept)
        raw = np.full(positions.size, np.nan)
        raw_rank = np.full(positions.size, np.nan)
        if event.raw is not None and where_present.any():
            index = np.searchsorted(present, positions[where_present])
            raw[where_present] = event.raw[index]
            raw_rank[where_present] = descending_rank(event.raw, event.raw[index])
        utility = np.full(positions.size, np.nan)
        utility_rank = np.full(positions.size, np.nan)
        if event.utility is not None and where_kept.any():
            index = np.searchsorted(event.kept, positions[where_kept])
            utility[where_kept] = event.utility[index]
            # Among finite utilities only: +inf marks what a policy protects or has not judged yet (sinks,
            # a checkpointed policy's tail and new tokens); counting those would push every judged entry
            # one rank down per step between checkpoints with nothing decided.
            judged = np.isfinite(event.utility)
            ranks = descending_rank(event.utility[judged], event.utility[index])
            utility_rank[where_kept] = np.where(np.isfinite(event.utility[index]), ranks, np.nan)
        for i, position in enumerate(positions.tolist()):
            rows.append((event.step, position, bool(where_present[i]), bool(where_kept[i]),
                         bool(where_present[i] and not where_kept[i]), raw[i], raw_rank[i], utility[i],
                         utility_rank[i], present.size))
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


def boundary_crossings(history: pd.DataFrame, k: int, rank: str = "raw_rank") -> dict[int, int]:
    """Per position: how often its ``rank`` column moves across the top-``k`` boundary from one step that
    ranks it to the next that does (every step for InertiaKV, every r-th for Lazy refresh; InertiaKV Fig. 4:
    raw scores near the boundary flip, the EMA does not)."""
    crossings = {}
    for position, rows in history.groupby("position", sort=False):
        inside = (rows.sort_values("step")[rank].dropna() <= k).to_numpy()
        crossings[int(position)] = int((inside[1:] != inside[:-1]).sum())
    return crossings


# ------------------------------------------------------------------------- delayed first reads (AvoKV-E)

def scores_attention(policy: str, params: dict) -> bool:
    """Whether a run of ``policy`` (a registry name) with ``params`` (as its trace records them) records
    last-query attention as its raw score (:meth:`Policy.records_attention`): read lags mean something only
    for these.  (Lazy refresh and Score-Free also score attention, on some steps only: read_lags refuses
    those gaps.)  A name or parameters this version does not know: False."""
    from .policies import REGISTRY  # the policies import nothing of the diagnostics

    spec = REGISTRY.get(policy)
    try:
        return spec is not None and spec.cls(**{**spec.preset, **params}).records_attention()
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class ReadLags:
    """AvoKV-E Figure 1(b): how long after it is written a generated entry is first strongly read.

    ``lag[i]`` is the distance from ``positions[i]`` to the first later query whose attention to it reaches
    ``threshold`` of the most attention it gets from any later query in the run (its peak), ``inf`` when that
    happens beyond ``horizon`` queries (right-censored); ``early_rank[i]`` is the percentile rank, among the
    candidates, of its mean attention from the first ``observe`` queries after it -- what a policy that judged
    it at once would have seen.  ``dropped`` counts generated entries too close to the end of the run for a
    full horizon.
    """

    positions: np.ndarray
    lag: np.ndarray
    early_rank: np.ndarray
    horizon: int
    dropped: int

    def read_by(self, t: int, group: np.ndarray | None = None) -> float:
        """F(t): the share of candidates (of ``group``, a boolean mask) strongly read within ``t`` queries."""
        lag = self.lag if group is None else self.lag[group]
        return float((lag <= t).mean()) if lag.size else float("nan")


def read_lags(events: Sequence[StepEvent], prompt_len: int, threshold: float = 0.85, horizon: int = 32,
              observe: int = 8) -> ReadLags:
    """First-strong-read lags of the generated entries of a run that scored every step (AvoKV-E App. D).

    Parameters
    ----------
    events : sequence of StepEvent
        The run's events in step order; every decode step must carry ``raw`` (the step's last-query
        attention over the entries present), e.g. InertiaKV with a budget that keeps the whole cache.
    prompt_len : int
        Prompt tokens: the query of decode step ``k`` sits at position ``prompt_len + k - 1``.
    threshold, horizon, observe : float, int, int
        A strong read reaches ``threshold`` of the entry's peak; lags beyond ``horizon`` queries are censored;
        the early read is the mean attention from the first ``observe`` queries (``observe <= horizon``).
    """
    if not 0 < threshold <= 1 or not 1 <= observe <= horizon:
        raise ValueError(f"need 0 < threshold <= 1 and 1 <= observe <= horizon, got {threshold}, {observe}, {horizon}")
    steps = [e for e in events if e.step >= 1]
    unscored = [e.step for e in steps if e.raw is None]
    if unscored:
        raise ValueError(f"steps {unscored[:3]} recorded no attention: read lags need a policy that scores every "
                         "step (inertia, not inertia-lazy or score-free)")
    evicting = [e.step for e in events if e.evicted.size]
    if evicting:  # an evicted entry is never read again, and the rest share its attention: lags would lie
        raise ValueError(f"this run evicted entries (first at step {evicting[0]}): read lags need one that keeps "
                         "the whole cache, e.g. a budget above the prompt plus the new tokens")
    last = len(steps)  # queries at positions prompt_len .. prompt_len + last - 1
    # attention[k - 1, position] from the query of step k; NaN where the entry was not in the cache
    attention = np.full((last, prompt_len + last), np.nan)
    for row, event in enumerate(steps):
        attention[row, event.present] = event.raw
    candidates, lags, early, dropped = [], [], [], 0
    for position in range(prompt_len, prompt_len + last):
        first_row = position - prompt_len + 1  # the first query after it is at position + 1
        window = attention[first_row:first_row + horizon, position]
        if window.size < horizon or np.isnan(window).any():
            dropped += 1
            continue
        peak = np.nanmax(attention[first_row:, position])
        strong = np.flatnonzero(window >= threshold * peak) if peak > 0 else np.empty(0)  # never read at all
        candidates.append(position)
        lags.append(strong[0] + 1 if strong.size else np.inf)
        early.append(window[:observe].mean())
    early_values = np.asarray(early)
    early_rank = (ranks(early_values) - 1) / max(early_values.size - 1, 1) if early_values.size else early_values
    return ReadLags(np.asarray(candidates, dtype=np.int64), np.asarray(lags, dtype=float), early_rank, horizon,
                    dropped)


def read_lag_split(lags: ReadLags, low: float = 0.4, high: float = 0.6,
                   at: Sequence[int] = (1, 2, 4, 8, 16, 32)) -> dict:
    """F(t) of the rarely read early (``early_rank <= low``) and the well read (``>= high``), the share never
    strongly read within the horizon, and the one-sided two-sample Kolmogorov-Smirnov p that the well read
    are read sooner (censored lags count as ``horizon + 1``)."""
    from scipy import stats

    groups = {"low": lags.early_rank <= low, "high": lags.early_rank >= high}
    out = {name: {"entries": int(mask.sum()),
                  "read_by": {t: lags.read_by(t, mask) for t in at if t <= lags.horizon},
                  "never": float(np.isinf(lags.lag[mask]).mean()) if mask.any() else float("nan")}
           for name, mask in groups.items()}
    censored = np.where(np.isinf(lags.lag), lags.horizon + 1, lags.lag)
    if groups["low"].any() and groups["high"].any():
        out["ks_p"] = float(stats.ks_2samp(censored[groups["high"]], censored[groups["low"]],
                                           alternative="greater").pvalue)
    else:
        out["ks_p"] = float("nan")
    return out
