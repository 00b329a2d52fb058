"""Paired differences for the Results tab: at the same nominal cut, at equal cache held where a policy holds
more than the reference at that cut (:mod:`kvviz.held`), and InertiaKV's own settings against its defaults."""

from __future__ import annotations

import functools

import pandas as pd

from ...held import held_table
from ...stats import paired_table
from ...store import Store
from .colours import Colours
from .layout import _cut_label
from .lines import _paired_figure

# How the paired section pairs samples: the first is the default
PAIRINGS = ("at equal cache held where policies hold different amounts", "at the same nominal cut")
CELL = ["model", "task", "policy", "compression", "absolute_budget"]
HELD_TOLERANCE = 1  # entries: as kvviz.held pairs cells


@functools.lru_cache(maxsize=32)
def paired(store: Store, reference: str, task: str | None, model: str | None,
           policies: tuple[str, ...] | None, settings: bool = False,
           sweeps: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The paired-difference table (a few seconds of resampling: kept per filter combination; the store never
    changes while the app runs)."""
    return paired_table(store.paired_scores(reference, task, model, list(policies) if policies else None,
                                            settings=settings, sweeps=sweeps))


@functools.lru_cache(maxsize=32)
def held(store: Store, reference: str, task: str | None, model: str | None,
         policies: tuple[str, ...]) -> pd.DataFrame:
    """:func:`kvviz.held.held_table` for ``policies``, kept per filter combination as :func:`paired` is."""
    table = held_table(store, reference, task, model, list(policies))
    return table.assign(absolute_budget=table.absolute_budget.astype(float))


def _keys(frame: pd.DataFrame) -> pd.Series:
    """Each row's cell as a hashable key, NaN as None (two NaNs are not equal, so would never match)."""
    cells = frame[CELL].astype(object).where(frame[CELL].notna(), None)
    return pd.Series([tuple(None if value is None else float(value) if column in ("compression", "absolute_budget")
                            else value for column, value in zip(CELL, row))
                      for row in cells.itertuples(index=False, name=None)], index=frame.index, dtype=object)


def _held_more(speed: pd.DataFrame, reference: str) -> pd.DataFrame:
    """The cells (:meth:`Store.speed_vs_quality` rows) whose policy held more cache while decoding than the
    reference did at the same model, task and nominal cut."""
    cut = ["model", "task", "compression", "absolute_budget"]
    cells = speed.assign(absolute_budget=speed.absolute_budget.astype(float))
    own = cells[cells.policy == reference][[*cut, "decode_cache"]].rename(columns={"decode_cache": "reference_held"})
    both = cells[~cells.policy.isin([reference, "full"])].merge(own, on=cut)
    return both[both.decode_cache > both.reference_held + HELD_TOLERANCE]


def matched_memory(store: Store, nominal: pd.DataFrame, speed: pd.DataFrame, reference: str, task: str | None,
                   model: str | None) -> tuple[pd.DataFrame, list[str]]:
    """``nominal`` (:func:`paired` at the same cut) with each cell whose policy held more than ``reference``
    replaced by the pairs at equal cache held, and the cells that pair only there added (SnapKV at ρ = 0.905
    against the reference at 0.9); ``paired_at`` says which.  The full cache holds everything: nothing to
    match.  Returns the table and notes naming what moved."""
    nominal = nominal.assign(paired_at="same cut")
    if reference == "full" or nominal.empty or speed.empty:
        return nominal, []
    over = _held_more(speed, reference)
    unpaired = speed[~speed.policy.isin([reference, "full"]) & ~_keys(speed).isin(set(_keys(nominal)))]
    policies = sorted({*over.policy, *unpaired.policy} - {reference, "full"})
    if not policies:
        return nominal, []
    suites = nominal.tasks != nominal.task  # a suite's mean: dropped with any of its cells held over
    over_keys = set(_keys(over))
    over_cuts = {(m, p, c, b) for m, _, p, c, b in over_keys}
    cuts = _keys(nominal).map(lambda key: (key[0], *key[2:]))
    drop = _keys(nominal).isin(over_keys) | (suites & cuts.isin(over_cuts))
    kept = nominal[~drop]
    matched = held(store, reference, task, model, tuple(policies))
    matched = matched[~_keys(matched).isin(set(_keys(kept)))]
    matched = matched.assign(paired_at=[f"equal cache held ({reference} at ρ={at})"
                                        for at in matched.reference_compression])
    notes = []
    if len(matched):
        notes.append(f"paired at equal cache held (each policy given no more than {reference} held): "
                     + _cells(matched))
    lost = over[~_keys(over).isin(set(_keys(matched)))]
    if len(lost):
        notes.append(f"held more than {reference} at the same cut, with no cell at equal memory, so not shown "
                     f"(choose '{PAIRINGS[1]}' to see them): " + _cells(lost))
    return pd.concat([kept, matched], ignore_index=True), notes


def _cells(frame: pd.DataFrame) -> str:
    """``"snapkv ρ=0.905, 0.95; tova B=80"``: the cells of ``frame`` per policy."""
    cuts = frame.assign(cut=[_cut_label(c, b) for c, b in zip(frame.compression, frame.absolute_budget)])
    return "; ".join(f"{policy} " + ", ".join(dict.fromkeys(part.cut))
                     for policy, part in cuts.groupby("policy", sort=True))


def inertia_family(store: Store) -> list[str]:
    """InertiaKV's registered names that score as it does (attention, EMA) and differ in α, the refresh
    interval or how layers are combined: inertia, single-step, inertia-lazy, score-free, inertia-decoupled."""
    base = store.defaults.get("inertia")
    if not base:
        return []
    return [name for name, values in store.defaults.items()
            if all(values.get(key) == base.get(key) for key in ("scorer", "aggregation"))]


INERTIA_READ = ("Each point is an InertiaKV setting's mean score minus InertiaKV's at its defaults (α 0.8, "
                "refreshed every step) on the same samples: a hollow marker whose bar spans 0 is a setting the "
                "run cannot tell from the defaults.")


def inertia_figure(store: Store, task: str | None, model: str | None, sweeps: tuple | None,
                   colours: Colours, source: str | None):
    """The InertiaKV settings section: each setting of the family against InertiaKV's defaults, with what the
    sign test found and the smallest difference the run could detect; and its table."""
    family = inertia_family(store)
    if source == "paper" or not family:
        differences = paired_table(pd.DataFrame())
    else:
        differences = paired(store, "inertia", task, model, tuple(family), True, sweeps)
    empty = ("papers print no per-sample scores: choose the measured source" if source == "paper" else
             "no InertiaKV setting pairs with InertiaKV at its defaults under these filters")
    figure = _paired_figure(differences, "inertia", colours, empty, _inertia_notes(differences), INERTIA_READ,
                            "InertiaKV settings vs its defaults")
    return figure, differences, "inertia_settings_vs_defaults"


def _inertia_notes(differences: pd.DataFrame) -> list[str]:
    """Which settings differ detectably from the defaults, and the smallest difference each run could see."""
    cells = differences[differences.tasks == differences.task] if len(differences) else differences
    if cells.empty:
        return []
    found = cells[cells.significant.astype(bool)]
    said = "sign test (McNemar's on 0/1 scores) p < 0.05: " + ("; ".join(
        f"{row.policy} on {row.task} {_cut_label(row.compression, row.absolute_budget)} Δ {row.delta:+.3f} "
        f"[{row.low:+.3f}, {row.high:+.3f}]" for row in found.itertuples())
        if len(found) else "no setting differs from the defaults in any cell")
    detectable = cells.detectable.dropna()
    reach = (f"the smallest |Δ| these runs could detect (80% power): {detectable.min():.3f} to "
             f"{detectable.max():.3f} (column `detectable`)" if len(detectable) else "")
    return [said, reach]
