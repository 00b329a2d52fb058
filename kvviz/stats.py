"""Paired comparisons of a policy with a reference policy on the same samples.

A sweep runs every policy on the same prompts, so the honest question "is Lazy refresh worse than full
refresh?" is about the per-sample differences, not about two means with their own error bars: most samples
score the same under both, and the noise of the task cancels out of the difference.  This module gives, for
such differences, what the papers report for their deltas (InertiaKV Tables 3 and 14): the mean difference,
its paired-bootstrap 95% confidence interval, and how many samples each policy wins, plus an exact sign test.

Whether two policies differ at all is the sign test's question, not the interval's: with 0/1 scores most
pairs tie, and a bootstrap over the few that differ is too narrow (three losses in twenty resample to an
interval that excludes 0, though three coin flips all landing one way happen a quarter of the time).  The
percentile interval is used -- BCa, tuned for smooth statistics, excluded 0 for equal policies in about one
run in ten in a simulation of such data -- and describes the size of a difference, not its existence.

Differences may come in strata (one array per task).  The statistic is then the mean over tasks of each
task's mean difference -- the change in a benchmark score that averages its tasks, as RULER's does -- and the
bootstrap resamples within each task (a stratified bootstrap), so a task with more samples does not weigh more.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np
import pandas as pd
from scipy import stats

# Two metric values closer than this are a tie (the metrics are ratios of small counts).
TIE = 1e-9
# The sign test's level for calling two policies different.
ALPHA = 0.05


@dataclass(frozen=True)
class PairedDelta:
    """The difference policy − reference over paired samples.

    ``delta`` is the mean over strata of each stratum's mean difference; ``low`` and ``high`` bound its
    percentile-bootstrap interval (NaN with fewer than two pairs in a stratum; equal to ``delta`` when every
    difference is the same, since resampling then cannot move it).  ``wins`` / ``ties`` / ``losses`` count
    samples where the policy scored higher / the same / lower, and ``p_sign`` is the two-sided exact sign test
    of wins against losses (ties dropped; 1.0 when there are none): ``significant`` reads it at ``ALPHA``.
    """

    delta: float
    low: float
    high: float
    pairs: int
    wins: int
    ties: int
    losses: int
    p_sign: float
    # The smallest |mean difference| this many pairs would detect (:func:`detectable_difference`)
    detectable: float = float("nan")

    @property
    def significant(self) -> bool:
        """The sign test rejects "neither policy scores higher more often" at ``ALPHA`` (two-sided)."""
        return self.p_sign < ALPHA


def _mean_of_means(*strata: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean([stratum.mean(axis=axis) for stratum in strata], axis=0)


def paired_delta(strata: Sequence[np.ndarray], confidence: float = 0.95, resamples: int = 9999,
                 seed: int = 0) -> PairedDelta:
    """Mean paired difference, its bootstrap confidence interval and a sign test.

    Parameters
    ----------
    strata : sequence of arrays, each of shape (n_i,)
        Per-sample differences policy − reference, one array per stratum (task); empty arrays are ignored.
    confidence : float
        Confidence level of the interval.
    resamples : int
        Bootstrap resamples.
    seed : int
        Seed of the resampling, so that a table is the same every time it is computed.
    """
    strata = [np.asarray(s, dtype=float) for s in strata if len(s)]
    if not strata:
        raise ValueError("no paired samples to compare")
    return _paired_delta(tuple(s.tobytes() for s in strata), confidence, resamples, seed)


@functools.lru_cache(maxsize=4096)
def _paired_delta(strata_bytes: tuple[bytes, ...], confidence: float, resamples: int, seed: int) -> PairedDelta:
    """:func:`paired_delta` of the strata given as float64 bytes: kept, because the Results tab's filters ask
    again for the same cells' differences, and the bootstrap is seeded, so the answer is the same."""
    strata = [np.frombuffer(stratum, dtype=float) for stratum in strata_bytes]
    pooled = np.concatenate(strata)
    wins, losses = int((pooled > TIE).sum()), int((pooled < -TIE).sum())
    ties = len(pooled) - wins - losses
    delta = float(_mean_of_means(*strata))
    p_sign = _sign_test(wins, wins + losses) if wins + losses else 1.0
    if any(len(s) < 2 for s in strata):  # a one-sample stratum cannot be resampled
        low = high = float("nan")
    elif np.ptp(pooled) <= TIE:  # nothing to resample: every difference is the same
        low = high = delta
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy warns of degenerate resamples; the percentiles stand
            result = stats.bootstrap(strata, _mean_of_means, vectorized=True, n_resamples=resamples,
                                     confidence_level=confidence, method="percentile",
                                     rng=np.random.default_rng(seed))
        low, high = (float(v) for v in result.confidence_interval)
    return PairedDelta(delta, low, high, len(pooled), wins, ties, losses, p_sign,
                       detectable_difference(len(pooled), wins + losses, float(np.abs(pooled).sum())))


@functools.lru_cache(maxsize=None)
def _sign_test(wins: int, discordant: int) -> float:
    """The two-sided exact sign test's p-value (kept: a Results query asks for the same few counts hundreds of
    times, and each answer costs scipy a millisecond)."""
    return float(stats.binomtest(wins, discordant).pvalue)


def _rejections(discordant: int, alpha: float) -> np.ndarray:
    """The win counts (of ``discordant`` non-tied pairs) at which the two-sided exact sign test rejects."""
    return np.array([w for w in range(discordant + 1) if _sign_test(w, discordant) < alpha], dtype=int)


@functools.lru_cache(maxsize=None)
def _least_win_rate(discordant: int, alpha: float, power: float) -> float:
    """The least probability q that a discordant pair is a win at which the exact sign test rejects with
    probability ``power``; NaN where no q gets there.  It depends on the counts alone, so it is kept."""
    reject = _rejections(discordant, alpha)
    if not len(reject):
        return float("nan")
    upper = reject[reject > discordant / 2]  # the one-sided half: more wins than losses

    def reached(q: float) -> float:
        return float(stats.binom.pmf(upper, discordant, q).sum())

    if reached(1.0) < power:
        return float("nan")
    low, high = 0.5, 1.0
    for _ in range(50):  # bisection on q: the power grows with it
        middle = (low + high) / 2
        low, high = (middle, high) if reached(middle) < power else (low, middle)
    return high


def detectable_difference(pairs: int, discordant: int, magnitude: float | None = None, alpha: float = ALPHA,
                          power: float = 0.8) -> float:
    """The smallest |mean paired difference| that the exact sign test (McNemar's, for 0/1 scores) would find
    at level ``alpha`` with probability ``power``, given ``pairs`` pairs of which ``discordant`` differ.

    Conditional on the discordant pairs: each is a win with probability q, and the mean difference is
    (2q − 1) · ``magnitude`` / ``pairs``, where ``magnitude`` is the summed |difference| over the discordant
    pairs (their count for 0/1 scores).  The answer is that at the least q whose power reaches ``power``.
    With too few discordant pairs for any q to get there -- fewer than 6, the least for which even all of them
    one way gives p < 0.05 -- it is NaN: the run cannot tell the two apart at its observed disagreement.

    Example: 100 pairs, 6 discordant: only 6 wins of 6 rejects, so q⁶ ≥ 0.8, q ≥ 0.9635 and Δ ≥ 0.927 · 6 / 100
    ≈ 0.056; with 20 discordant q ≥ 0.80 and Δ ≈ 0.12.
    """
    if pairs < 1 or discordant < 1:
        return float("nan")
    magnitude = float(discordant) if magnitude is None else magnitude
    return (2 * _least_win_rate(discordant, alpha, power) - 1) * magnitude / pairs


def paired_table(pairs: pd.DataFrame, confidence: float = 0.95, resamples: int = 9999) -> pd.DataFrame:
    """Per (model, task, policy, compression or absolute budget), the paired difference to the reference; and
    per benchmark suite with two or more tasks, the same over its tasks (stratified by task), labelled
    ``"<suite>: mean of k tasks"``.

    Parameters
    ----------
    pairs : DataFrame
        One row per paired sample, as :meth:`kvviz.store.Store.paired_scores` returns it: ``model``,
        ``suite``, ``task``, ``policy``, ``compression``, ``absolute_budget`` (optional), ``score`` and
        ``reference_score``.

    Returns
    -------
    DataFrame
        ``model``, ``task``, ``policy``, ``compression``, ``absolute_budget`` (NaN for a compression cell),
        ``score`` and ``reference`` (the two means over
        the pairs), then the :class:`PairedDelta` fields, ``significant`` and ``tasks`` (those a suite's row
        averages, comma-separated; a task's row: the task).
    """
    columns = ["model", "task", "policy", "compression", "absolute_budget", "score", "reference",
               *PairedDelta.__dataclass_fields__, "significant", "tasks"]
    if pairs.empty:
        return pd.DataFrame(columns=columns)
    pairs = pairs.assign(difference=pairs.score - pairs.reference_score)
    if "absolute_budget" not in pairs:
        pairs = pairs.assign(absolute_budget=float("nan"))
    # the store's nullable integer: NA would not group with NaN-free keys
    pairs = pairs.assign(absolute_budget=pairs.absolute_budget.astype(float))
    rows = []
    keys = ["model", "policy", "compression", "absolute_budget"]
    for (model, policy, compression, budget), group in pairs.groupby(keys, dropna=False, sort=True):
        cut = dict(compression=compression, absolute_budget=budget)
        by_task = {task: part for task, part in group.groupby("task", sort=True)}
        for task, part in by_task.items():
            result = paired_delta([part.difference.to_numpy()], confidence, resamples)
            rows.append(dict(model=model, task=task, policy=policy, **cut,
                             score=part.score.mean(), reference=part.reference_score.mean(), **asdict(result),
                             significant=result.significant, tasks=task))
        for suite, part in group.groupby("suite", sort=True):
            tasks = sorted(part.task.unique())
            if len(tasks) < 2:
                continue
            result = paired_delta([by_task[t].difference.to_numpy() for t in tasks], confidence, resamples)
            rows.append(dict(model=model, task=f"{suite}: mean of {len(tasks)} tasks", policy=policy, **cut,
                             score=np.mean([by_task[t].score.mean() for t in tasks]),
                             reference=np.mean([by_task[t].reference_score.mean() for t in tasks]),
                             **asdict(result), significant=result.significant, tasks=", ".join(tasks)))
    return pd.DataFrame(rows, columns=columns)
