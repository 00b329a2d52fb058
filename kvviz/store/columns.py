"""What the store's rows hold: their columns and types, the generation settings that tell experiments apart,
the metrics, the benchmarks tasks belong to, and the helpers that name a row's setting."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

# The repository's results_db/ (the package is installed editable, or run from the checkout as the Space
# image does); KVVIZ_RESULTS points elsewhere, e.g. for an installed copy.
ROOT = Path(os.environ.get("KVVIZ_RESULTS") or Path(__file__).resolve().parents[2] / "results_db")
# Columns every query may use; shards that lack one (paper rows have no decode speed) read it as NULL.
COLUMNS = {"sweep": "VARCHAR", "source": "VARCHAR", "paper": "VARCHAR", "table": "VARCHAR", "model": "VARCHAR",
           "task": "VARCHAR", "policy": "VARCHAR", "params": "JSON", "compression": "DOUBLE",
           "absolute_budget": "INTEGER", "metric": "VARCHAR",
           "score": "DOUBLE", "sample": "INTEGER", "seed": "INTEGER", "meta": "JSON", "decode_tok_s": "DOUBLE",
           "prompt_len": "INTEGER", "budget": "INTEGER", "max_cache": "INTEGER", "max_decode_cache": "INTEGER",
           "max_new_tokens": "INTEGER", "chat": "BOOLEAN",
           "temperature": "DOUBLE", "top_p": "DOUBLE", "dtype": "VARCHAR", "draw": "INTEGER",
           "new_tokens": "INTEGER", "hit_max_tokens": "BOOLEAN", "notes": "VARCHAR", "policy_params": "JSON"}
# What a stored value of each type may be, in json_type()'s names (null or absent is always allowed), and
# how a problem names it.  Numbers must also be finite: one NaN score would make its whole group's mean NaN.
ACCEPTED = {"VARCHAR": (("VARCHAR",), "a string"), "DOUBLE": (("BIGINT", "UBIGINT", "DOUBLE"), "a finite number"),
            "INTEGER": (("BIGINT", "UBIGINT"), "an integer"), "JSON": (("OBJECT",), "an object"),
            "BOOLEAN": (("BOOLEAN",), "true or false")}
# How a sweep generated (the runner's defaults where its config is silent): rows that differ here are
# different experiments, never one cell counted once.
GENERATION = {"max_new_tokens": 32, "chat": True, "temperature": 0.0, "top_p": 1.0, "dtype": "float32"}
# What one sample's draws (sampled generations) become in ``results``: the mean over them, as AvoKV-E
# reports mean@k; ``generations`` keeps one row per draw.
PER_DRAW = {"score": "avg(score)", "decode_tok_s": "avg(decode_tok_s)", "max_cache": "max(max_cache)",
            # NULL unless every draw records it (a draw without it could have held more)
            "max_decode_cache": "CASE WHEN count(max_decode_cache) = count(*) THEN max(max_decode_cache) END",
            "new_tokens": "avg(new_tokens)",
            "hit_max_tokens": "CASE WHEN count(*) = 1 THEN bool_or(hit_max_tokens) END"}
# Bad lines named per shard in a problem; the rest are counted.
SHOWN_LINES = 5
# Metrics that are a quality score of a run (paper tables also report deltas, best alphas, AUROCs ...).
QUALITY_METRICS = ("score", "accuracy", "string_match", "whole_match", "exact_match", "rouge_l", "token_f1", "math",
                   "edit_similarity")
# Metrics of how well a policy's utility ranks oracle damage (AvoKV-E's Table 3; `kvviz bench ranking`), one
# row per trace and metric: drawn by their own figure, never averaged with a quality score.
RANKING_METRICS = ("auroc", "ap", "topk_recall", "false_safe_rate", "spearman")
# Parameters that only label a row (Table 1 prints its budget as "10%"; compression already says it).
LABEL_PARAMS = ("kv_budget",)
# The benchmark each measured task stands in for, so that measured rows can sit next to a paper's
# aggregate: the synthetic generators are RULER's subtasks; loader labels carry their benchmark as a prefix.
SUITES = {"single_needle": "RULER", "multi_key_needle": "RULER", "multi_value": "RULER", "multi_query": "RULER",
          "variable_tracking": "RULER", "common_words": "RULER", "needle_grid": "NIAH", "longbench_v2": "LongBench-v2",
          "math500": "MATH-500", "aime25": "AIME25"}
PREFIXES = {"ruler/": "RULER", "longbench/": "LongBench"}
# A measured task counts towards a benchmark's aggregate only where the full cache itself scores at least this:
# SmolLM2-135M's full cache scores 0.12 on variable tracking, so a policy's score there is mostly noise, and a
# mean over tasks that includes it says little about eviction.  The papers' 8B full caches pass it on every task.
FULL_CACHE_FLOOR = 0.5
# Issue 43: a task ranks policies only where the full cache itself scores at least this on it; under it a
# policy's loss is mostly the model's own failure, and the task is marked "full cache fails: not ranked".
RANKED_FLOOR = 0.8
NOT_RANKED = "full cache fails: not ranked"
# A cell is said to have held over its budget past this factor (one B is not one memory size: a checkpointed
# policy runs up to B + interval - 1, a prefill-time one grows by the tokens generated).
HELD_OVER = 1.1


def suite_of(task: str | None) -> str | None:
    """The benchmark a task label belongs to: ``"RULER"`` for ``"single_needle"`` and ``"ruler/niah_single_1"``,
    ``"LongBench"`` for ``"LongBench/hotpotqa"``; a paper's aggregate (``"RULER"``) is its own suite."""
    if task is None:
        return None
    if task in SUITES:
        return SUITES[task]
    for prefix, suite in PREFIXES.items():
        if task.lower().startswith(prefix):
            return suite
    return task.split("/")[0]


def policy_defaults() -> dict[str, dict[str, Any]]:
    from ..policies import default_params

    return default_params()


def policy_added_parameters() -> dict[str, dict[str, Any]]:
    """Each registered name's parameters added after rows were stored, with the value each row without it ran
    (:attr:`kvviz.policies.base.Policy.added_parameters`: R-KV's ``pooling``, ``"head-mean"``); names whose
    parameters all date from their first rows are left out."""
    from ..policies import REGISTRY

    return {name: dict(spec.cls.added_parameters) for name, spec in REGISTRY.items() if spec.cls.added_parameters}


def policy_kinds() -> dict[str, str]:
    """Each registered name's class.  Names of one class are one policy at different parameters (InertiaKV
    with alpha = 0 is ``single-step``); a subclass changes the rule, not a parameter, and is a kind of its own."""
    from ..policies import REGISTRY

    return {name: f"{spec.cls.__module__}.{spec.cls.__qualname__}" for name, spec in REGISTRY.items()}


def _literal(value) -> str:
    """A Python default as SQL: a quoted string, or JSON's true / false / number (which SQL reads alike)."""
    return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else json.dumps(value)


def _decoded(line: bytes) -> str | None:
    """One shard line as text, or None where its bytes are not UTF-8."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        return None


def setting_names(policies, settings) -> list[str]:
    """Each row's policy, named by the parameters its setting changes (``"inertia alpha=0.9"``; the defaults,
    ``{}``, keep the bare name), each value written as the Compare tab writes it (``alpha=0``, ``true``)."""
    from ..policies import shown_value

    return [policy if setting == "{}" else f"{policy} " + " ".join(
        f"{name}={shown_value(value)}" for name, value in json.loads(setting).items())
        for policy, setting in zip(policies, settings)]


def _setting_order(setting: str) -> tuple:
    """A setting's sort key: its parameters by name, numbers by value (0.9 before 0.95), then the rest as text."""
    return tuple((name, (0, float(value)) if isinstance(value, (int, float)) else (1, str(value)))
                 for name, value in sorted(json.loads(setting).items()))


def named_by_setting(frame: pd.DataFrame) -> pd.DataFrame:
    """A frame with ``policy`` and ``setting`` columns, each policy named by its setting, ``setting`` dropped."""
    return frame.assign(policy=setting_names(frame.policy, frame.setting)).drop(columns="setting")


def held_over_budget(frame: pd.DataFrame) -> pd.DataFrame:
    """The cells of :meth:`Store.speed_vs_quality` whose policy held over HELD_OVER times its nominal budget
    while decoding, one per (policy, compression or absolute budget): where several tasks or models have the
    cell, the one that held the most over its budget.  The full cache and cells whose decode-time cache is not
    known (``decode_cache`` NULL) are left out."""
    # The largest cache while decoding (the store's decode_cache): the prefill's is left out, where at a
    # compression every decode-time policy "held" its whole prompt once.
    over = frame[(frame.policy != "full") & frame.decode_cache.notna()].assign(
        ratio=lambda cells: cells.decode_cache / cells.budget.astype(float))
    over = over[over.ratio > HELD_OVER]
    cut = ["policy", "compression", "absolute_budget"]
    return (over.sort_values("ratio", ascending=False).drop_duplicates(cut)
            .sort_values(cut, na_position="first").reset_index(drop=True))


def ranking_caveats(frame: pd.DataFrame) -> pd.DataFrame:
    """Per measured sweep of :meth:`Store.damage_ranking` rows, what qualifies its means: ``past_end`` and
    ``ended_by_step`` (traces, as there) and ``prompt_share``, the share of the ranked entries that are the
    prompt's (NaN: not recorded).  Every policy of a sweep ranks the same entries, so any of its rows that
    counts every trace says."""
    measured = frame[frame.source == "measured"].sort_values("traces", ascending=False, kind="stable")
    return pd.DataFrame({
        sweep: {"past_end": int(part.past_end.max()), "ended_by_step": int(part.ended_by_step.max()),
                "prompt_share": next(iter((part.prompt_ranked / part.candidates).dropna()), float("nan"))}
        for sweep, part in measured.groupby("sweep")}).T
