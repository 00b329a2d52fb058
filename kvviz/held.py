"""Comparisons at equal cache actually held, and quality against needle depth (issue 43).

One nominal budget B is not one memory size.  A policy that evicts at every step holds B entries after each
step's eviction; one that compresses once at prefill (SnapKV) holds B + the tokens generated so far; a
checkpointed one (R-KV, AvoKV-E) up to B + interval − 1.  Rows record what each cell really held while
decoding (``max_decode_cache``), so two policies are compared at equal memory by pairing *cells*, not
nominal budgets: policy P's cell of a sample at any compression is paired with the reference's cell of the
same sample whose largest decode cache is within ``tolerance`` entries of P's.  A sweep makes such pairs by
running the over-holding policy also at a slightly higher compression (``configs/prose-2k-headline.toml``
runs SnapKV at ρ = 0.905 beside the others at 0.9: B − 10 + 9 new tokens = the others' B − 1).

Why pair cells rather than rescale a budget inside the runner: the held size is measured, not derived from a
bound (a checkpointed policy's bound B + interval − 1 is far above what it holds in a short generation), the
same rows serve both the nominal-B and the equal-memory comparison, and a pair exists only where both cells
were really run -- nothing is interpolated.  A policy's cell pairs where it held no more than the reference's
cell (and not over 5% less): a fair comparison gives it no extra memory.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from .stats import paired_table
from .store import NOT_RANKED, QUALITY_METRICS, RANKED_FLOOR, Store


def held_pairs(store: Store, reference: str, task: str | None = None, model: str | None = None,
               policies: list[str] | None = None, tolerance: int = 1, slack: float = 0.05) -> pd.DataFrame:
    """Each measured cell of a policy (at its defaults) next to the reference's cell of the same sample (same
    model, task, prompt, seed and generation settings) that held the least cache among those that held at
    least as much as it did (up to ``tolerance`` entries less) and no more than ``slack`` (a share of the
    reference's) above it: the policy never gets more memory than the reference, nor much less.  Cells with no
    such partner are left out.

    "At least as much", not "as much": a prefill-time policy holds B + the tokens it has generated, so one that
    stops early (SnapKV answering "64." of 6478942) held less than its bound; run at the budget whose bound is
    the reference's B (ρ = 0.905 against 0.9 here), it holds that or less, and pairs.

    Rows: ``model``, ``suite``, ``task``, ``policy``, ``compression``, ``absolute_budget``, ``sample``,
    ``score``, ``reference_score``, ``held``, ``reference_held``, ``reference_compression`` -- the columns
    :func:`kvviz.stats.paired_table` reads, and what was held on either side."""
    return store.frame(
        """
        WITH rows AS (SELECT * FROM results WHERE source = 'measured' AND sample IS NOT NULL AND setting = '{}'
                                          AND max_decode_cache IS NOT NULL AND list_contains(?, metric)
                                          AND (? IS NULL OR task = ?) AND (? IS NULL OR model = ?))
        SELECT p.model, p.suite, p.task, p.policy, p.compression, p.absolute_budget, p.sample, p.score,
               r.score AS reference_score, p.max_decode_cache AS held, r.max_decode_cache AS reference_held,
               r.compression AS reference_compression
        FROM rows p JOIN rows r
          ON r.policy = ? AND p.policy NOT IN ('full', ?) AND p.model = r.model AND p.task = r.task
         AND p.sample = r.sample AND p.seed IS NOT DISTINCT FROM r.seed AND p.prompt_len = r.prompt_len
         AND p.max_new_tokens = r.max_new_tokens AND p.chat = r.chat AND p.temperature = r.temperature
         AND p.top_p = r.top_p AND p.dtype IS NOT DISTINCT FROM r.dtype AND p.draws = r.draws
         AND p.max_decode_cache <= r.max_decode_cache + ?
         AND r.max_decode_cache - p.max_decode_cache <= ? * r.max_decode_cache
        WHERE (? IS NULL OR list_contains(?, p.policy))
        QUALIFY row_number() OVER (PARTITION BY p.model, p.task, p.policy, p.compression, p.absolute_budget, p.sample
                                   ORDER BY r.max_decode_cache, r.compression) = 1
        ORDER BY p.model, p.task, p.policy, p.compression, p.sample
        """, [list(QUALITY_METRICS), task, task, model, model, reference, reference, tolerance, slack, policies,
              policies])


def held_table(store: Store, reference: str, task: str | None = None, model: str | None = None,
               policies: list[str] | None = None, tolerance: int = 1, slack: float = 0.05) -> pd.DataFrame:
    """:func:`kvviz.stats.paired_table` over :func:`held_pairs`: per (model, task, policy, compression) the
    paired difference to the reference at equal cache held, with the mean held on either side and the
    reference's compression(s) it paired with."""
    pairs = held_pairs(store, reference, task, model, policies, tolerance, slack)
    table = paired_table(pairs)
    if table.empty:
        return table.assign(held=pd.Series(dtype=float), reference_held=pd.Series(dtype=float),
                            reference_compression=pd.Series(dtype=object))
    sides = pairs.groupby(["model", "task", "policy", "compression"], dropna=False).agg(
        held=("held", "mean"), reference_held=("reference_held", "mean"),
        reference_compression=("reference_compression",
                               lambda values: ", ".join(f"{v:g}" for v in sorted(set(values.dropna())))))
    return table.merge(sides.reset_index(), on=["model", "task", "policy", "compression"], how="left")


def depth_bins(depth: pd.Series, bins: int = 10) -> pd.Series:
    """The stratum of each needle depth in [0, 1): ⌊depth · bins⌋ (a depth of 1 in the last)."""
    return np.minimum((depth * bins).astype(int), bins - 1)


def quality_vs_depth(store: Store, task: str | None = None, model: str | None = None,
                     policies: list[str] | None = None, bins: int = 10,
                     sweeps: list[str] | None = None) -> pd.DataFrame:
    """Mean score per (model, task, policy, compression, needle-depth stratum) over the measured rows whose
    sample records its needle's depth (``meta.depth``: the prose tasks, single_needle, needle_grid), at each
    policy's defaults; ``depth`` is the stratum's midpoint, ``samples`` how many it averages, and
    ``stderr`` the standard error of that mean."""
    frame = store.frame(
        """
        SELECT model, task, policy, CASE WHEN policy = 'full' THEN NULL ELSE compression END AS compression,
               sample, score, TRY_CAST(json_extract_string(meta, '$.depth') AS DOUBLE) AS depth
        FROM results WHERE source = 'measured' AND sample IS NOT NULL AND setting = '{}'
          AND list_contains(?, metric) AND absolute_budget IS NULL
          AND (? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR list_contains(?, policy))
          AND (? IS NULL OR list_has_any(ran_in, ?))
        """, [list(QUALITY_METRICS), task, task, model, model, policies, policies, sweeps, sweeps])
    frame = frame[frame.depth.notna()]
    columns = ["model", "task", "policy", "compression", "depth_bin", "depth", "score", "stderr", "samples"]
    if frame.empty:
        return pd.DataFrame(columns=columns)
    frame = frame.assign(depth_bin=depth_bins(frame.depth, bins))
    out = frame.groupby(["model", "task", "policy", "compression", "depth_bin"], dropna=False).score.agg(
        score="mean", stderr=lambda s: s.std(ddof=1) / np.sqrt(len(s)) if len(s) > 1 else np.nan,
        samples="count").reset_index()
    out = out.assign(depth=(out.depth_bin + 0.5) / bins)
    return out[columns].sort_values(["model", "task", "policy", "compression", "depth_bin"], na_position="first") \
        .reset_index(drop=True)


def full_cache_ranking(store: Store, floor: float = RANKED_FLOOR) -> pd.DataFrame:
    """Per measured (model, task, max_new_tokens, chat): the full cache's mean score and samples, and whether
    the task ranks policies -- its full cache scores at least ``floor`` -- or is marked :data:`NOT_RANKED`."""
    frame = store.frame(
        """
        SELECT model, task, max_new_tokens, chat, avg(score) AS full_score, count(*) AS samples
        FROM results WHERE source = 'measured' AND policy = 'full' AND sample IS NOT NULL
          AND list_contains(?, metric)
        GROUP BY ALL ORDER BY model, task, max_new_tokens, chat
        """, [list(QUALITY_METRICS)])
    ranked = frame.full_score >= floor
    return frame.assign(ranked=ranked, status=ranked.map({True: "ranked", False: NOT_RANKED}))
