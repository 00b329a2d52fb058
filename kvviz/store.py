"""The results store: DuckDB views over the sweeps in ``results_db/`` -- the only code that writes SQL.

Each sweep is a folder with its ``config.toml`` and one or more ``rows*.jsonl`` shards (written by the
sweep runner).  The store opens an in-memory DuckDB database, reads every shard line by line, and unions
the well-formed rows into the in-memory table ``results``.  A missing or unreadable shard, and every row that
is not UTF-8, is not a JSON object or has a value of the wrong type (a string score, a non-finite number,
``params`` that is not an object), is reported in ``problems`` by shard and line, and the rest still loads.
Nothing is written back: the files are only read, and every query takes its values as parameters.

``generations`` holds one row per generation; ``results``, which every figure reads, one per sample and
cell: the mean over a sampled sweep's draws of that sample (``draws`` says how many), so that draws of one
prompt never count as independent samples (a greedy sweep's rows are unchanged).

Two derived columns keep comparisons honest: ``setting`` (the parameters a row changes from its policy's
registry defaults, ``'{}'`` at the defaults; read from every parameter it ran with, ``policy_params``, where the
row records them, else from those its config spelled out; a parameter added to the policy since the row was
written, R-KV's ``pooling``, at the value that row ran, ``"head-mean"``) keeps α and refresh sweeps out of the
per-policy curves, and
``suite`` (the benchmark a task belongs to: the RULER-style generators -> ``RULER``) pairs measured tasks
with a paper's aggregate.  A row's ``policy`` is the registry name that states what it ran with the fewest
changes, as the Compare tab labels a setting (:func:`kvviz.policies.setting_label`): ``inertia`` run with
alpha = 0 is ``single-step`` at its defaults, one policy however a sweep spelled it.
"""

from __future__ import annotations

import json
import os
import threading
import tomllib
from pathlib import Path
from typing import Any

import duckdb
import pandas as pd

# The sentences about these rows live in kvviz.notes, shared with the app; imported here where callers found them.
from .notes import HELD_OVER_WHY, held_over_note, suite_notes  # noqa: F401

# The repository's results_db/ (the package is installed editable, or run from the checkout as the Space
# image does); KVVIZ_RESULTS points elsewhere, e.g. for an installed copy.
ROOT = Path(os.environ.get("KVVIZ_RESULTS") or Path(__file__).resolve().parent.parent / "results_db")
# Columns every query may use; shards that lack one (paper rows have no decode speed) read it as NULL.
COLUMNS = {"sweep": "VARCHAR", "source": "VARCHAR", "paper": "VARCHAR", "table": "VARCHAR", "model": "VARCHAR",
           "task": "VARCHAR", "policy": "VARCHAR", "params": "JSON", "compression": "DOUBLE",
           "absolute_budget": "INTEGER", "metric": "VARCHAR",
           "score": "DOUBLE", "sample": "INTEGER", "seed": "INTEGER", "meta": "JSON", "decode_tok_s": "DOUBLE", "prompt_len": "INTEGER",
           "budget": "INTEGER", "max_cache": "INTEGER", "max_decode_cache": "INTEGER", "max_new_tokens": "INTEGER", "chat": "BOOLEAN",
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
            "new_tokens": "avg(new_tokens)", "hit_max_tokens": "CASE WHEN count(*) = 1 THEN bool_or(hit_max_tokens) END"}
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
    from .policies import default_params

    return default_params()


def policy_added_parameters() -> dict[str, dict[str, Any]]:
    """Each registered name's parameters added after rows were stored, with the value each row without it ran
    (:attr:`kvviz.policies.base.Policy.added_parameters`: R-KV's ``pooling``, ``"head-mean"``); names whose
    parameters all date from their first rows are left out."""
    from .policies import REGISTRY

    return {name: dict(spec.cls.added_parameters) for name, spec in REGISTRY.items() if spec.cls.added_parameters}


def policy_kinds() -> dict[str, str]:
    """Each registered name's class.  Names of one class are one policy at different parameters (InertiaKV
    with alpha = 0 is ``single-step``); a subclass changes the rule, not a parameter, and is a kind of its own."""
    from .policies import REGISTRY

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
    from .policies import shown_value

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


class Store:
    """Read-only access to the measured (and paper-reported) rows."""

    def __init__(self, root: str | Path = ROOT, defaults: dict[str, dict[str, Any]] | None = None,
                 kinds: dict[str, str] | None = None, added: dict[str, dict[str, Any]] | None = None):
        self.root = Path(root)
        self.defaults = policy_defaults() if defaults is None else defaults
        # name -> the parameters added since rows were stored, with the value a measured row without them ran
        self.added = policy_added_parameters() if added is None else added
        # name -> class: which names can state one another's settings (a name without one is its own kind)
        self.kinds = policy_kinds() if kinds is None else kinds
        self._named: dict[tuple, tuple[str | None, str]] = {}
        self.con = duckdb.connect(":memory:")
        # One connection, many threads (the app's sessions, its start-up drawing): a query and the fetch of its
        # result go together, or one thread's fetch could return another's rows
        self._lock = threading.RLock()
        self.con.execute("SET enable_progress_bar = false")  # a slow load on a busy machine drew one on stdout
        # null_handling="special": rows without params (or a policy) still get a setting, '{}'
        self.con.create_function("setting", self._setting, ["VARCHAR", "VARCHAR"], "VARCHAR", null_handling="special")
        self.con.create_function("named", self._name, ["VARCHAR", "VARCHAR"], "VARCHAR", null_handling="special")
        self.con.create_function("suite", suite_of, ["VARCHAR"], "VARCHAR", null_handling="special")
        self.problems: list[str] = []
        # One row per line of every shard; ``text`` is NULL where the line's bytes are not UTF-8.
        self.con.execute("CREATE TABLE shard_lines (shard VARCHAR, line_no INTEGER, text VARCHAR)")
        self.con.execute("CREATE TABLE sweep_settings (folder VARCHAR, "
                         + ", ".join(f"{name} {COLUMNS[name]}" for name in GENERATION) + ")")
        self.shards = self._read_shards()
        fields = "{" + ", ".join(f'"{name}": "JSON"' for name in COLUMNS) + "}"
        # One parse per line: every column as a JSON value (JSON null reads as NULL), checked before any cast.
        self.con.execute(
            "CREATE TABLE checked_lines AS SELECT shard, line_no, value, concat_ws('; ', "
            "CASE WHEN text IS NULL THEN 'not valid UTF-8' WHEN doc IS NULL THEN 'not valid JSON' "
            "WHEN json_type(doc) <> 'OBJECT' THEN left(text, 40) || ' is not a JSON object' END, "
            + ", ".join(self._type_check(name, kind) for name, kind in COLUMNS.items()) +
            f") AS problem FROM (SELECT *, CASE WHEN json_type(doc) = 'OBJECT' THEN json_transform(doc, '{fields}') "
            "END AS value FROM (SELECT *, CASE WHEN json_valid(text) THEN text::JSON END AS doc "
            "FROM shard_lines WHERE text IS NULL OR trim(text) <> ''))")
        for shard, bad, total, lines in self.con.execute(
                "SELECT shard, count(*) FILTER (problem <> '') AS bad, count(*), "
                "list('line ' || line_no || ': ' || problem ORDER BY line_no) FILTER (problem <> '')[1:?] "
                "FROM checked_lines GROUP BY shard HAVING bad > 0 ORDER BY shard", [SHOWN_LINES]).fetchall():
            more = f"; and {bad - len(lines)} more" if bad > len(lines) else ""
            self.problems.append(f"{shard}: skipped {bad} of {total} rows ({'; '.join(lines)}{more}); "
                                 "fix or delete those lines")
        def read(name: str, kind: str) -> str:  # one JSON value as its column's SQL type
            return (f'value."{name}"' if kind == "JSON" else f"""json_extract_string(value."{name}", '$')"""
                    if kind == "VARCHAR" else f'CAST(value."{name}" AS {kind})')

        # A row's ``params`` are what its policy ran with: every parameter where the row records them
        # (``policy_params``, written since a changed registry default could otherwise relabel old rows), else
        # the ones its config spelled out (the rest were the defaults of the day).
        select = ", ".join(f'{read(name, kind)} AS "{name}"' for name, kind in COLUMNS.items()
                           if name not in (*GENERATION, "params", "policy_params"))
        # A measured row whose parameters lack one added to its policy since ran the value from before it
        # (R-KV's rows from before ``pooling`` ran "head-mean", not today's default): named in its params, so
        # that the new default cannot take the old row in.  A paper's rows are the paper's own method.
        measured = """json_extract_string(value."source", '$') = 'measured'"""  # papers print no such settings
        as_run = 'coalesce(value."policy_params", value."params")'
        earlier = " ".join(f"""WHEN {measured} AND json_extract_string(value."policy", '$') = {_literal(name)} """
                           f"THEN json_merge_patch({_literal(json.dumps(values))}, coalesce({as_run}, '{{}}'))"
                           for name, values in self.added.items())
        select += f', CASE {earlier} ELSE {as_run} END AS "params"' if earlier else f', {as_run} AS "params"'
        # Rows written before they carried their generation settings take them from their sweep's config, and
        # failing that the runner's defaults (counted in unknown_settings and reported below).
        select += ", " + ", ".join(f'CASE WHEN {measured} THEN coalesce({read(name, COLUMNS[name])}, '
                                   f'settings."{name}", {_literal(default)}) END AS "{name}"'
                                   for name, default in GENERATION.items())
        select += ", " + " AND ".join(f'value."{name}" IS NULL AND settings."{name}" IS NULL'
                                      for name in GENERATION) + " AS unknown_settings, split_part(shard, '/', 1) AS folder"
        # A damage-ranking row belongs to its sweep's probe (its step, and the entries all of that sweep's
        # policies judged): two ranking sweeps of one sample are two experiments, never one row or one mean.
        select += (f""", CASE WHEN list_contains({list(RANKING_METRICS)}, json_extract_string(value."metric", '$')) """
                   """THEN coalesce(json_extract_string(value."sweep", '$'), split_part(shard, '/', 1)) END """
                   "AS ranking_sweep")
        # Materialised once: the files never change while the app runs, and the derived columns call Python.
        # ``policy`` = the registry name that states the row's parameters with the fewest changes, and
        # ``setting`` = those changes ('{}' at its defaults), both from the policy as run (the inner SELECT);
        # ``suite`` = the benchmark its task belongs to.
        # A measured cell run by two sweeps (sweep-2k-inertia's alpha = 0.8 is sweep-2k's inertia, its alpha = 0
        # sweep-2k's single-step) counts once -- the full cache whatever ρ or budget each sweep filed it under,
        # since it has neither; a cell generated with other settings (max_new_tokens, chat template) is another
        # experiment and stays.
        # The experiment a measured row belongs to; a cell is that plus its draw.
        # A ranking sweep stores five metrics of one trace and policy: each its own row, never one mean.
        experiment = ["model", "task", "sample", "seed", "policy", "setting", *self._CUT_BY.values(), "prompt_len",
                      "metric", "ranking_sweep", *GENERATION]
        # ``ran_in``: every sweep that ran the row's experiment (a row written by hand, without a sweep name,
        # by its folder), so that a sweep's filter keeps the cells it shares with a sweep kept in its place.
        single = "source IS DISTINCT FROM 'measured' OR sample IS NULL"
        # Every row first, duplicates included, so that duplicates that disagree can be reported below
        self.con.execute(
            f"CREATE TEMP TABLE every_generation AS SELECT *, CASE WHEN {single} THEN [coalesce(sweep, folder)] ELSE "
            f"list(DISTINCT coalesce(sweep, folder) ORDER BY coalesce(sweep, folder)) OVER (PARTITION BY "
            f"{', '.join(experiment)}) END AS ran_in "
            "FROM (SELECT * REPLACE (named(policy, CAST(params AS VARCHAR)) "
            "AS policy) FROM (SELECT *, setting(policy, CAST(params AS VARCHAR)) AS setting, suite(task) AS suite "
            f"FROM (SELECT {select} FROM checked_lines LEFT JOIN sweep_settings AS settings "
            "ON settings.folder = split_part(shard, '/', 1) WHERE problem = '')))")
        self.con.execute(
            f"CREATE TABLE generations AS SELECT * FROM every_generation QUALIFY {single} OR row_number() OVER "
            f"(PARTITION BY {', '.join(experiment)}, coalesce(draw, 0) ORDER BY sweep) = 1")
        self._report_conflicting_duplicates(experiment, single)
        self.con.execute("DROP TABLE every_generation")
        # One row per measured sample and cell: the mean over its draws (a greedy sweep has one draw, so its
        # rows are unchanged), so that every figure, count and paired test is per sample -- draws of one
        # prompt are not independent samples.  Grouped by the experiment alone (the draws may come from two
        # sweeps, or a full cache filed under two ρ); every other column is the first draw's.  Paper rows are
        # kept as printed.
        per_sample = "source IS NOT DISTINCT FROM 'measured' AND sample IS NOT NULL"
        columns = [column[0] for column in self.con.execute("SELECT * FROM generations LIMIT 0").description]
        per_row = [f'"{name}"' if name in experiment else f'arg_min("{name}", coalesce(draw, 0)) AS "{name}"'
                   for name in columns if name not in ("draw", *PER_DRAW)]
        self.con.execute(
            f"CREATE TABLE results AS SELECT * EXCLUDE (draw), 1 AS draws FROM generations WHERE NOT ({per_sample}) "
            f"UNION ALL BY NAME SELECT {', '.join(per_row)}, "
            + ", ".join(f"{expression} AS {name}" for name, expression in PER_DRAW.items())
            + f", count(*) AS draws FROM generations WHERE {per_sample} GROUP BY {', '.join(experiment)}")
        for folder, rows in self.con.execute(
                "SELECT folder, count(*) FROM results WHERE source = 'measured' AND unknown_settings "
                "GROUP BY folder ORDER BY folder").fetchall():
            self.problems.append(f"{folder}: {rows} rows say neither max_new_tokens nor chat and their folder has no "
                                 f"config.toml; read as the runner's defaults ({GENERATION['max_new_tokens']} new "
                                 "tokens, chat template on)")
        self._report_mixed_generation()
        self._report_mixed_prompts()

    def _report_conflicting_duplicates(self, experiment: list[str], single: str) -> None:
        """Say where one cell (and draw) was stored twice with different scores or sample facts (``meta``: the
        needle's depth, the keys) -- two sweeps that gave one task label other task options, a shard run again
        on another machine --, since only one of them counts."""
        for model, task, sweeps, cells in self.con.execute(
                "SELECT model, task, list_sort(list_distinct(flatten(list(sweeps)))), count(*) FROM (SELECT model, "
                "task, list(DISTINCT coalesce(sweep, folder)) AS sweeps FROM every_generation "
                f"WHERE NOT ({single}) GROUP BY {', '.join(experiment)}, coalesce(draw, 0) "
                "HAVING count(DISTINCT score) > 1 OR count(DISTINCT CAST(meta AS VARCHAR)) > 1) "
                "GROUP BY model, task ORDER BY model, task").fetchall():
            self.problems.append(f"{model} / {task}: {cells} cell(s) stored more than once with different scores "
                                 "or sample facts "
                                 f"(in {', '.join(sweeps)}); each counts once, as the first sweep's by name: "
                                 "remove the rows of one, or give one sweep's task another label")

    def _report_mixed_prompts(self) -> None:
        """Say where one sample of a task was given prompts of different lengths by different sweeps (another
        task length or other task options under one label): the figures would average them as one task."""
        for model, task, sweeps, samples in self.con.execute(
                "WITH mixed AS (SELECT model, task, sample, seed FROM results WHERE source = 'measured' "
                "AND sample IS NOT NULL AND list_contains(?, metric) GROUP BY ALL "
                "HAVING count(DISTINCT prompt_len) > 1) "
                "SELECT r.model, r.task, list(DISTINCT coalesce(r.sweep, r.folder) ORDER BY coalesce(r.sweep, "
                "r.folder)), count(DISTINCT r.sample) FROM results AS r JOIN mixed AS m ON r.model = m.model "
                "AND r.task = m.task AND r.sample = m.sample AND r.seed IS NOT DISTINCT FROM m.seed "
                "WHERE r.source = 'measured' AND list_contains(?, r.metric) "
                "GROUP BY r.model, r.task ORDER BY r.model, r.task",
                [list(QUALITY_METRICS), list(QUALITY_METRICS)]).fetchall():
            self.problems.append(f"{model} / {task}: sweeps {', '.join(sweeps)} gave {samples} sample(s) prompts "
                                 "of different lengths, which the figures average as one task; give one of them "
                                 "another task label to keep them apart")

    def _report_mixed_generation(self) -> None:
        """Say where the figures average rows generated differently: the same task and policy from sweeps
        that gave the model a different number of new tokens or a different prompt format."""
        # Grouped as the figures average: per model, task, policy, setting and compression or absolute budget
        # (NULL for the other kind of cell, hence the null-safe join).  A row that does
        # not name its sweep (written by hand, not by the runner) is named by its folder.
        for model, task, sweeps, settings in self.con.execute(
                "WITH mixed AS (SELECT model, task, policy, setting, compression, absolute_budget FROM results "
                "WHERE source = 'measured' AND list_contains(?, metric) GROUP BY ALL "
                "HAVING count(DISTINCT (max_new_tokens, chat, temperature, top_p, dtype)) > 1) "
                "SELECT model, task, list(DISTINCT coalesce(sweep, folder) ORDER BY coalesce(sweep, folder)), "
                "list(DISTINCT max_new_tokens || ' new tokens, chat ' || chat || CASE WHEN temperature > 0 THEN "
                "', temperature ' || temperature || ', top-p ' || top_p ELSE '' END "
                "|| CASE WHEN dtype <> 'float32' THEN ', ' || dtype ELSE '' END) "
                "FROM results JOIN mixed USING (model, task, policy, setting) "
                "WHERE source = 'measured' AND results.compression IS NOT DISTINCT FROM mixed.compression "
                "AND results.absolute_budget IS NOT DISTINCT FROM mixed.absolute_budget "
                "GROUP BY model, task ORDER BY model, task", [list(QUALITY_METRICS)]).fetchall():
            self.problems.append(f"{model} / {task}: sweeps {', '.join(sweeps)} generated with different settings "
                                 f"({'; '.join(sorted(settings))}) are averaged together; give one of them "
                                 "another task label to keep them apart")

    @staticmethod
    def _type_check(name: str, kind: str) -> str:
        """SQL for what is wrong with one column's JSON value (NULL when it is absent, null or fine)."""
        value = f'value."{name}"'
        types, what = ACCEPTED[kind]
        # TRY_CAST: OR does not short-circuit, and a cast that raised would abort the whole load
        wrong = f"json_type({value}) NOT IN ({', '.join(repr(t) for t in types)})" + (
            f" OR NOT isfinite(TRY_CAST({value} AS DOUBLE))" if kind == "DOUBLE" else
            f" OR TRY_CAST({value} AS INTEGER) IS NULL" if kind == "INTEGER" else "")
        return f"CASE WHEN {wrong} THEN '{name} is ' || left(CAST({value} AS VARCHAR), 40) || ', not {what}' END"

    def _setting(self, policy: str | None, params: str | None) -> str:
        """Canonical JSON of the parameters that are neither labels nor equal to the defaults of the name
        :meth:`_name` gives the row, in the registry's order of parameters (then any it does not know, sorted)."""
        return self._canonical(policy, params)[1]

    def _name(self, policy: str | None, params: str | None) -> str | None:
        """The registry name that states ``policy`` run with ``params`` with the fewest changes (the first in
        the registry on a tie), as :func:`kvviz.policies.setting_label` labels it: ``inertia`` with alpha = 0
        is ``single-step``, ``inertia-lazy`` with refresh = 1 is ``inertia``."""
        return self._canonical(policy, params)[0]

    def _canonical(self, policy: str | None, params: str | None) -> tuple[str | None, str]:
        key = (policy, params)
        if key not in self._named:
            values = json.loads(params) if params else {}
            # A parameter stored as null is unset; a label (kv_budget) changes nothing.
            values = {k: v for k, v in (values or {}).items() if v is not None and k not in LABEL_PARAMS}
            defaults = self.defaults.get(policy, {})
            kind = self.kinds.get(policy)
            if kind is not None and set(values) <= set(defaults):  # every parameter is one of the policy's own
                from .policies import fewest_changes

                ran = {**defaults, **values}
                policy = fewest_changes(ran, {name: own for name, own in self.defaults.items()
                                              if self.kinds.get(name) == kind and own.keys() == defaults.keys()})
                kept = {k: v for k, v in ran.items() if v != self.defaults[policy][k]}
            else:  # not a registered policy, or parameters it does not take (a paper's "ablation"): as stored
                kept = {k: v for k, v in values.items() if not (k in defaults and defaults[k] == v)}
            order = list(self.defaults.get(policy, {}))
            self._named[key] = policy, json.dumps(dict(sorted(
                kept.items(), key=lambda item: (item[0] not in order, order.index(item[0]) if item[0] in order
                                                else 0, item[0]))))
        return self._named[key]

    def _read_shards(self) -> list[Path]:
        """Every line of every readable shard into ``shard_lines``, the shards read in order.

        Read here as bytes and split on newlines, so that a line whose bytes are not UTF-8 (a torn or
        hand-edited write) is that line's problem (``text`` NULL, reported by ``checked_lines`` with its line
        number), not the whole shard's.  All the lines go in as one Arrow table: no SQL is built from them."""
        read = []
        names: list[str] = []
        numbers: list[int] = []
        texts: list[str | None] = []
        if not self.root.is_dir():
            self.problems.append(f"{self.root}: no results folder")
            return read
        # The root holds sweep folders; a sweep's own folder (the runner's --out) is read as the one sweep.
        sweeps = ([self.root] if any(self.root.glob("rows*.jsonl")) else []) + \
            sorted(p for p in self.root.iterdir() if p.is_dir())
        for sweep in sweeps:
            self._read_settings(sweep)
            shards = sorted(sweep.glob("rows*.jsonl"))
            if not shards:
                self.problems.append(f"{sweep.name}: no rows*.jsonl shard")
            for shard in shards:
                name = f"{sweep.name}/{shard.name}"
                try:
                    content = shard.read_bytes()
                except OSError as error:
                    self.problems.append(f"{name}: unreadable ({error.strerror or error})")
                    continue
                try:  # the usual case: the whole shard decodes at once
                    lines: list[str | None] = content.decode("utf-8").split("\n")
                except UnicodeDecodeError:  # a newline byte is never part of a longer UTF-8 character
                    lines = [_decoded(line) for line in content.split(b"\n")]
                names.extend([name] * len(lines))
                numbers.extend(range(1, len(lines) + 1))
                texts.extend(lines)
                read.append(shard)
        if texts:
            import pyarrow as pa

            self.con.register("read_lines", pa.table({"shard": pa.array(names, pa.string()),
                                                      "line_no": pa.array(numbers, pa.int32()),
                                                      "text": pa.array(texts, pa.large_string())}))
            try:
                self.con.execute("INSERT INTO shard_lines SELECT shard, line_no, text FROM read_lines")
            finally:
                self.con.unregister("read_lines")
        return read

    def _read_settings(self, sweep: Path) -> None:
        """The generation settings of a sweep folder's ``config.toml`` (none for a folder without one, e.g.
        the paper rows)."""
        try:
            with open(sweep / "config.toml", "rb") as handle:
                config = tomllib.load(handle)
        except FileNotFoundError:
            return
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
            self.problems.append(f"{sweep.name}/config.toml: unreadable ({error}); its rows' generation settings "
                                 "are taken from the rows alone")
            return
        # Rows that do not say their dtype ran in the config's, else the runner's default for its device.
        device_default = "float32" if str(config.get("device", "cpu")).startswith("cpu") else "bfloat16"
        defaults = {**GENERATION, "dtype": device_default}
        values = [config.get(name, default) for name, default in defaults.items()]
        number = (int, float)
        kinds = [isinstance(values[0], int), isinstance(values[1], bool), isinstance(values[2], number),
                 isinstance(values[3], number), isinstance(values[4], str)]
        if not all(kinds) or any(isinstance(value, bool) for value in (values[0], values[2], values[3])):
            self.problems.append(f"{sweep.name}/config.toml: max_new_tokens, chat, temperature, top_p or dtype of "
                                 "the wrong type; ignored")
            return
        self.con.execute(f"INSERT INTO sweep_settings VALUES (?{', ?' * len(GENERATION)})", [sweep.name, *values])

    def frame(self, sql: str, params: list | None = None) -> pd.DataFrame:
        with self._lock:
            return self.con.execute(sql, params or []).df()

    def _column(self, sql: str, params: list) -> list:
        """The first column of a query's rows."""
        with self._lock:
            return [row[0] for row in self.con.execute(sql, params).fetchall()]

    # How a row cut the cache, as the figures group it: its compression or its absolute budget, never both;
    # the full cache's rows (stored at a sweep's first compression, or at neither) have neither.
    _CUT_BY = {"compression": "CASE WHEN policy = 'full' THEN NULL ELSE compression END",
               "absolute_budget": "CASE WHEN policy = 'full' THEN NULL ELSE absolute_budget END"}
    _CUT = ", ".join(f"{expression} AS {name}" for name, expression in _CUT_BY.items())

    def _filters(self, task, model, source, policies, sweeps=None, metrics=QUALITY_METRICS) -> tuple[str, list]:
        """The WHERE clause of the filters (None: any), ``sweeps`` a list of sweep names: rows any of them ran;
        rows of ``metrics`` only (quality scores, unless a query asks for others)."""
        sql = ("(? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR source = ?) "
               "AND (? IS NULL OR list_contains(?, policy)) AND (?::VARCHAR[] IS NULL OR list_has_any(ran_in, ?)) "
               "AND list_contains(?, metric)")
        sweeps = list(sweeps) if sweeps else None
        return sql, [task, task, model, model, source, source, policies, policies, sweeps, sweeps, list(metrics)]

    def quality_vs_compression(self, task: str | None = None, model: str | None = None,
                               policies: list[str] | None = None, source: str | None = None,
                               settings: bool = False, sweeps: list[str] | None = None) -> pd.DataFrame:
        """Mean score and its standard error per (source, model, task, policy, compression or absolute budget)
        of each policy at its default setting (the α and refresh sweeps have their own queries), under
        optional filters; over samples, each the mean of its ``draws`` where a sweep sampled several.  A
        compression cell has ``absolute_budget`` NULL, a budget cell ``compression`` NULL; the full cache has
        neither (one reference for both).  With ``settings``, every other parameter setting that was run too,
        each its own policy named by what it changes (``"avokv interval=16"``)."""
        where, params = self._filters(task, model, source, policies, sweeps)
        frame = self.frame(
            f"""
            SELECT source, model, task, policy, setting, {self._CUT}, avg(score) AS score,
                   stddev_samp(score) / sqrt(count(*)) AS stderr, count(*) AS samples, max(draws) AS draws
            FROM results WHERE (setting = '{{}}' OR ?) AND {where}
            GROUP BY ALL ORDER BY source, model, task, policy, setting, absolute_budget NULLS FIRST,
                                  compression NULLS FIRST
            """, [settings, *params])
        return named_by_setting(frame)

    def _family(self, parameter: str) -> dict[str, Any]:
        """Every registered name whose defaults differ from ``inertia``'s in ``parameter`` alone, with its
        default value of it: InertiaKV's points along that parameter (α: inertia 0.8, single-step 0)."""
        base = {k: v for k, v in self.defaults.get("inertia", {}).items() if k != parameter}
        return {name: values[parameter] for name, values in self.defaults.items()
                if parameter in values and {k: v for k, v in values.items() if k != parameter} == base}

    def alpha_sensitivity(self, task=None, model=None, source=None, sweeps=None) -> pd.DataFrame:
        """InertiaKV's mean score per EMA coefficient α, from rows that change nothing but α, per compression
        or absolute budget.  The family is every registered name whose defaults differ from ``inertia``'s in α
        alone (inertia α = 0.8, single-step α = 0, where the store files InertiaKV run at α = 0), at its own
        default α."""
        where, params = self._filters(task, model, source, None, sweeps)
        family = self._family("alpha")
        return self.frame(
            f"""
            SELECT source, model, task, compression, absolute_budget, alpha, avg(score) AS score,
                   stddev_samp(score) / sqrt(count(*)) AS stderr, count(*) AS samples FROM (
                SELECT *, coalesce(TRY_CAST(json_extract_string(params, '$.alpha') AS DOUBLE),
                                   default_alpha) AS alpha
                FROM results JOIN (SELECT unnest(?::VARCHAR[]) AS policy, unnest(?::DOUBLE[]) AS default_alpha)
                     USING (policy)
                WHERE list_has_all(['alpha'], json_keys(setting::JSON)) AND {where})
            WHERE alpha IS NOT NULL GROUP BY ALL ORDER BY source, model, task, compression, absolute_budget, alpha
            """, [list(family), list(family.values()), *params])

    def refresh_curve(self, task=None, model=None, source=None, sweeps=None) -> pd.DataFrame:
        """Score and decode speed against the refresh interval r (0 = score-free) for the InertiaKV family,
        from rows that change nothing but r.  The family is every registered name whose defaults differ from
        ``inertia``'s in r alone (inertia r = 1, inertia-lazy r = 4, score-free r = 0), at its own default r;
        per compression or absolute budget.  ``sweeps`` names the sweeps each point's rows come from: speeds
        compare within one run only."""
        where, params = self._filters(task, model, source, None, sweeps)
        family = self._family("refresh")
        return self.frame(
            f"""
            SELECT source, model, task, compression, absolute_budget, refresh,
                   -- r = 0 is no schedule of refreshes but InertiaKV's Score-Free point: the table and its CSV
                   -- say so, not only this docstring
                   CASE WHEN refresh = 0 THEN 'score-free: scored at step 1 only'
                        WHEN refresh = 1 THEN 'every step' ELSE 'every ' || refresh || ' steps' END AS scoring,
                   avg(score) AS score,
                   stddev_samp(score) / sqrt(count(*)) AS stderr, avg(decode_tok_s) AS decode_tok_s,
                   count(*) AS samples, string_agg(DISTINCT sweep, ', ' ORDER BY sweep) AS sweeps FROM (
                SELECT *, coalesce(TRY_CAST(json_extract_string(params, '$.refresh') AS INTEGER),
                                   default_refresh) AS refresh
                FROM results JOIN (SELECT unnest(?::VARCHAR[]) AS policy, unnest(?::INTEGER[]) AS default_refresh)
                     USING (policy)
                WHERE list_has_all(['refresh'], json_keys(setting::JSON)) AND {where})
            GROUP BY ALL ORDER BY source, model, task, compression, absolute_budget, refresh
            """, [list(family), list(family.values()), *params])

    def speed_vs_quality(self, task=None, model=None, policies=None, settings: bool = False, sweeps=None) -> pd.DataFrame:
        """Measured decode throughput, cache size and score per (model, task, policy, compression or absolute
        budget) at defaults (``settings``: every setting run, named as in :meth:`quality_vs_compression`).

        ``decode_cache`` is the mean over samples of the largest cache kept while decoding:
        ``max_decode_cache`` where a row records it; for older rows ``max_cache`` where that cannot be the
        prefill's -- it differs from the prompt length (the prefill holds at most the prompt, and a decode
        step's cache is never smaller than a prefill-time policy's B), or the prompt fits an absolute budget;
        NULL for the cell unless every sample says.  ``budget`` is the mean resolved budget; ``sweeps`` names
        the sweeps the rows come from (speeds compare within one run)."""
        where, params = self._filters(task, model, "measured", policies, sweeps)
        frame = self.frame(
            f"""
            SELECT model, task, policy, setting, {self._CUT}, avg(score) AS score,
                   avg(decode_tok_s) AS decode_tok_s,
                   avg(max_cache) AS max_cache, avg(prompt_len) AS prompt_len, count(*) AS samples,
                   CASE WHEN count(decoding) = count(*) THEN avg(decoding) END AS decode_cache,
                   avg(budget) AS budget, string_agg(DISTINCT sweep, ', ' ORDER BY sweep) AS sweeps
            FROM (SELECT *, coalesce(max_decode_cache, CASE WHEN max_cache <> prompt_len
                                                     OR prompt_len <= absolute_budget THEN max_cache END) AS decoding
                  FROM results WHERE (setting = '{{}}' OR ?) AND decode_tok_s IS NOT NULL AND {where})
            GROUP BY ALL ORDER BY model, task, policy, setting, absolute_budget NULLS FIRST, compression NULLS FIRST
            """, [settings, *params])
        return named_by_setting(frame)

    def max_length_hits(self, task=None, model=None, policies=None, settings: bool = False, sweeps=None) -> pd.DataFrame:
        """How many generations reached ``max_new_tokens`` instead of ending with end-of-sequence, per (model,
        task, policy, compression or absolute budget) of each policy at its defaults (AvoKV-E's Table 2 counts
        the same, per absolute budget).

        Per generation, every draw of a sampled sweep counted.  ``rows`` counts every generation of the group,
        ``recorded`` those that record ``hit_max_tokens`` (older rows
        lack it and are never guessed), ``hits`` those that reached the cap; ``hit_rate`` = hits / recorded,
        NULL where no row records it.  Measured rows only: the papers print counts per table, not per run.
        """
        where, params = self._filters(task, model, "measured", policies, sweeps)
        frame = self.frame(
            f"""
            SELECT source, model, task, policy, setting, {self._CUT},
                   count(*) AS rows, count(hit_max_tokens) AS recorded, count(*) FILTER (hit_max_tokens) AS hits,
                   count(*) FILTER (hit_max_tokens) / nullif(count(hit_max_tokens), 0) AS hit_rate
            FROM generations WHERE (setting = '{{}}' OR ?) AND {where}
            GROUP BY ALL ORDER BY model, task, policy, setting, absolute_budget NULLS FIRST, compression NULLS FIRST
            """, [settings, *params])
        return named_by_setting(frame)

    # Per task, each policy's mean score next to the full cache's on the same task and model (a task whose
    # full cache scores 0 cannot be normalised and is left out, and a measured task whose full cache scores
    # under the floor, the second parameter, says little about eviction).  Paper rows: the printed aggregate
    # only.  Compression cells only: the papers' tables compared here are per compression ratio.
    _RELATIVE = """
        WITH rows AS (
            SELECT suite, CASE source WHEN 'paper' THEN 'paper: ' || paper ELSE 'measured' END AS origin,
                   model, task, policy, CASE WHEN policy = 'full' THEN NULL ELSE compression END AS compression,
                   score
            FROM results
            WHERE setting = '{}' AND list_contains(?, metric) AND (source = 'measured' OR task = suite)
              AND (policy = 'full' OR absolute_budget IS NULL)),
        per_task AS (SELECT suite, origin, model, task, policy, compression, avg(score) AS score,
                            count(*) AS samples FROM rows GROUP BY ALL),
        full_cache AS (SELECT suite, origin, model, task, score AS full_score FROM per_task
                       WHERE policy = 'full' AND score > 0 AND (origin <> 'measured' OR score >= ?)),
        relative AS (SELECT p.*, f.full_score, p.score / f.full_score AS relative
                     FROM per_task p JOIN full_cache f USING (suite, origin, model, task)
                     WHERE policy <> 'full' AND compression IS NOT NULL)
    """

    def paper_comparison(self, suite: str = "RULER", policies: list[str] | None = None) -> pd.DataFrame:
        """Paper-reported and measured quality on one benchmark, each relative to its own full cache.

        Paper rows are the benchmark's aggregate as printed (task = suite: InertiaKV's RULER is the mean over
        its 13 subtasks, on each of which its 8B full caches score well); measured rows are the tasks of the
        suite (e.g. the RULER-style generators) on which the full cache of the same model scores at least
        FULL_CACHE_FLOOR (:meth:`left_out_of_suite` names the others), each paired with that full-cache
        score.  ``relative`` is the mean score over tasks divided by the mean full-cache score, as a paper's
        aggregate would be (a mean of per-task ratios lets a task the model fails even with the full cache
        dominate: 0.2 / 0.12 is 1.7).  ``relative`` = 1 is full-cache quality; ``task_names`` lists the tasks.
        """
        return self.frame(
            self._RELATIVE + """
            SELECT origin, model, policy, compression, avg(score) AS score, avg(full_score) AS full_score,
                   avg(score) / nullif(avg(full_score), 0) AS relative, count(*) AS tasks, sum(samples) AS samples,
                   string_agg(task, ', ' ORDER BY task) AS task_names
            FROM relative WHERE suite = ? AND (? IS NULL OR list_contains(?, policy))
            GROUP BY ALL ORDER BY origin DESC, model, policy, compression
            """, [list(QUALITY_METRICS), FULL_CACHE_FLOOR, suite, policies, policies])

    def left_out_of_suite(self, suite: str = "RULER", policies: list[str] | None = None) -> pd.DataFrame:
        """The measured tasks of ``suite`` that :meth:`paper_comparison` leaves out of its aggregate, and why:
        per model and task with compression cells of an evicting policy (of ``policies``), ``full_score`` (the
        full cache's mean score there, NULL where it has no row) and ``reason`` -- ``"no full-cache row"``, or
        ``"full cache below the floor"`` (under FULL_CACHE_FLOOR, or 0: nothing to be relative to)."""
        return self.frame(
            self._RELATIVE + """
            SELECT model, task, max(cached.score) AS full_score,
                   CASE WHEN max(cached.score) IS NULL THEN 'no full-cache row' ELSE 'full cache below the floor'
                   END AS reason
            FROM per_task AS evicting
            LEFT JOIN (SELECT origin, model, task, score FROM per_task WHERE policy = 'full') AS cached
                 USING (origin, model, task)
            WHERE evicting.origin = 'measured' AND evicting.suite = ? AND evicting.policy <> 'full'
              AND evicting.compression IS NOT NULL AND (? IS NULL OR list_contains(?, evicting.policy))
            GROUP BY model, task HAVING max(cached.score) IS NULL OR max(cached.score) < greatest(?, 1e-12)
            ORDER BY model, task
            """, [list(QUALITY_METRICS), FULL_CACHE_FLOOR, suite, policies, policies, FULL_CACHE_FLOOR])

    def comparable_suites(self) -> list[str]:
        """Benchmarks on which both a paper and a measurement have quality relative to a full cache."""
        return self._column(
            self._RELATIVE + """
            SELECT suite FROM relative GROUP BY suite
            HAVING count(DISTINCT origin = 'measured') = 2 ORDER BY suite
            """, [list(QUALITY_METRICS), FULL_CACHE_FLOOR])

    def needle_grid(self, model=None, policies=None, source=None, sweeps=None) -> pd.DataFrame:
        """Mean score per (model, policy, compression or absolute budget, context length, needle depth) of the
        needle-in-a-haystack grid (two models' grids are never averaged into one)."""
        where, params = self._filters("needle_grid", model, source, policies, sweeps)
        return self.frame(
            f"""
            SELECT source, model, policy, {self._CUT},
                   TRY_CAST(json_extract_string(meta, '$.length') AS INTEGER) AS length,
                   TRY_CAST(json_extract_string(meta, '$.depth') AS DOUBLE) AS depth,
                   avg(score) AS score, count(*) AS samples
            FROM results WHERE setting = '{{}}' AND {where}
            GROUP BY ALL ORDER BY source, model, policy, absolute_budget NULLS FIRST, compression NULLS FIRST, length,
                                  depth
            """, params)

    def setting_of(self, name: str) -> tuple[str, str]:
        """The (policy, setting) a stored setting's name stands for, as :func:`setting_names` writes it
        (``"avokv lambda_b=0"``); a bare policy name is its defaults, ``"{}"``, and so is a name that no
        stored setting has (which then matches no row)."""
        policy = name.split(" ", 1)[0]
        if policy != name:
            settings = self._column("SELECT DISTINCT setting FROM results WHERE policy = ?", [policy])
            named = dict(zip(setting_names([policy] * len(settings), settings), settings))
            if name in named:
                return policy, named[name]
        return name, "{}"

    def paired_scores(self, reference: str, task=None, model=None, policies=None, settings: bool = False,
                      sweeps=None) -> pd.DataFrame:
        """Each measured sample's score under a policy next to its score under ``reference`` (a policy at its
        defaults, or one stored setting of it as :func:`setting_names` writes it, ``"inertia alpha=0.9"``)
        on the same prompt, for paired comparisons (:mod:`kvviz.stats`); every policy at its defaults, and with
        ``settings`` also every other parameter setting that was run (α and refresh sweeps, ablations), each
        named by what it changes (``"inertia alpha=0.9"``), the reference's own included.

        A pair is the same model, task, sample, seed, prompt length, generation settings and number of draws
        (the means of the same random streams: a sampled sweep still running has fewer draws of some cells), at
        the same compression or absolute budget -- except against the full cache, which has neither and pairs
        with every cut.  The full cache is not compared with another reference (it has no cut to pair at:
        compare against ``full`` instead).  Rows: ``model``, ``suite``, ``task``, ``policy``, ``compression``,
        ``absolute_budget``, ``sample``, ``score``, ``reference_score``, ``setting``.
        """
        where, params = self._filters(task, model, "measured", None, sweeps)
        named = self.setting_of(reference)  # (policy, setting)
        frame = self.frame(
            f"""
            WITH rows AS (SELECT * FROM results WHERE (setting = '{{}}' OR ? OR (policy = ? AND setting = ?))
                                              AND sample IS NOT NULL AND {where})
            SELECT p.model, p.suite, p.task, p.policy, p.compression, p.absolute_budget, p.sample, p.score,
                   r.score AS reference_score, p.setting
            FROM rows p JOIN rows r
              ON r.policy = ? AND r.setting = ? AND p.policy <> 'full'
             AND NOT (p.policy = r.policy AND p.setting = r.setting) AND p.model = r.model AND p.task = r.task
             AND p.sample = r.sample AND p.seed IS NOT DISTINCT FROM r.seed
             AND p.prompt_len IS NOT DISTINCT FROM r.prompt_len
             AND p.max_new_tokens = r.max_new_tokens AND p.chat = r.chat
             AND p.temperature = r.temperature AND p.top_p = r.top_p AND p.dtype = r.dtype AND p.draws = r.draws
             AND (r.policy = 'full' OR (p.compression IS NOT DISTINCT FROM r.compression
                                        AND p.absolute_budget IS NOT DISTINCT FROM r.absolute_budget))
            WHERE (? IS NULL OR list_contains(?, p.policy))
            ORDER BY p.model, p.task, p.policy, p.setting, p.absolute_budget NULLS FIRST, p.compression, p.sample
            """, [settings, *named, *params, *named, policies, policies])
        return frame.assign(policy=setting_names(frame.policy, frame.setting))

    def other_settings(self, task=None, model=None, policies=None, source=None, sweeps=None,
                       per_table: bool = False) -> pd.DataFrame:
        """Rows that the per-policy queries leave out because they change a parameter from its default (α and
        refresh sweeps, ablations): how many per (policy, setting), so that a table can say what it omits;
        ``per_table``: per (source, model, task, policy, setting), a table's own."""
        where, params = self._filters(task, model, source, policies, sweeps)
        table = "source, model, task, " if per_table else ""
        frame = self.frame(
            f"""
            SELECT {table}policy, setting, count(*) AS rows FROM results WHERE setting <> '{{}}' AND {where}
            GROUP BY ALL
            """, params)
        # by value, not as text: "alpha=0.95, alpha=0.9" read as out of order
        order = sorted(range(len(frame)), key=lambda i: (
            *(frame[c].iloc[i] for c in ("source", "model", "task") if per_table), frame.policy.iloc[i],
            _setting_order(frame.setting.iloc[i])))
        return frame.iloc[order].reset_index(drop=True)

    def damage_ranking(self, task=None, model=None, policies=None, source=None, settings: bool = False,
                       sweeps=None) -> pd.DataFrame:
        """How well each policy's utility ranks the oracle damage of removing one entry (AvoKV-E's Table 3):
        per (source, model, task, sweep, policy, metric) the mean over traces, its standard error and
        ``traces`` (a measured trace is one probe of one sample, :mod:`kvviz.bench.ranking`; a paper row is its
        one printed figure), ``candidates`` (measured: the entries ranked, summed over the traces counted),
        ``step`` (the decode step probed), ``past_end`` (traces whose full-cache answer ended within the
        probe's replay or before it: some of the replayed predictions follow the answer), ``ended_by_step``
        (those that ended at or before the probed step: all of them do), ``prompt_ranked`` (measured: how many
        of the ``candidates`` are prompt entries; NULL where a trace counted was written before the sweep
        recorded it) and ``notes`` (a paper row's provenance); :func:`ranking_caveats` sums these up per sweep.
        Two ranking sweeps are never averaged: each probed its own step over the entries its own policies all
        judged.  A trace whose metric is
        undefined (Spearman of a constant utility) is left out of that metric's mean and count (undefined in
        every trace: no row).  Each policy at its defaults, and with ``settings`` every setting run, named by
        what it changes."""
        where, params = self._filters(task, model, source, policies, sweeps, metrics=RANKING_METRICS)
        frame = self.frame(
            f"""
            SELECT source, paper, model, task, coalesce(sweep, folder) AS sweep, policy, setting, metric,
                   avg(score) AS score, stddev_samp(score) / sqrt(count(score)) AS stderr, count(score) AS traces,
                   sum(TRY_CAST(json_extract_string(meta, '$.aligned') AS INTEGER)) FILTER (score IS NOT NULL)
                       AS candidates,
                   string_agg(DISTINCT json_extract_string(meta, '$.step'), ', ') AS step,
                   count(*) FILTER (TRY_CAST(json_extract_string(meta, '$.ended_at') AS INTEGER)
                                    <= TRY_CAST(json_extract_string(meta, '$.step') AS INTEGER)
                                       + TRY_CAST(json_extract_string(meta, '$.future') AS INTEGER)) AS past_end,
                   count(*) FILTER (TRY_CAST(json_extract_string(meta, '$.ended_at') AS INTEGER)
                                    <= TRY_CAST(json_extract_string(meta, '$.step') AS INTEGER)) AS ended_by_step,
                   -- NULL unless every trace counted recorded it (rows written before it was would understate it)
                   CASE WHEN count(json_extract_string(meta, '$.prompt_ranked')) FILTER (score IS NOT NULL)
                             = count(score)
                        THEN sum(TRY_CAST(json_extract_string(meta, '$.prompt_ranked') AS INTEGER))
                                 FILTER (score IS NOT NULL) END AS prompt_ranked,
                   any_value(notes) AS notes
            FROM results WHERE (setting = '{{}}' OR ?) AND {where}
            GROUP BY ALL HAVING count(score) > 0
            ORDER BY source, model, task, sweep, policy, setting, metric
            """, [settings, *params])
        return named_by_setting(frame)

    def ranking_pairs(self, reference: str, task=None, model=None, policies=None, settings: bool = False,
                      sweeps=None) -> pd.DataFrame:
        """Each measured trace's damage-ranking metric under a policy next to ``reference``'s (a policy at its
        defaults, or one stored setting of it: :meth:`setting_of`) on the same trace, for paired comparisons
        (:func:`kvviz.stats.paired_table`, which reads ``metric`` as the task): same sweep (one probe, over the entries all its policies judged), model, task, sample,
        seed, prompt, step and metric.  Rows: ``model``, ``suite`` (NULL), ``task`` (the row's task, sweep and
        metric, ``"t · s: auroc"``), ``metric``, ``policy``, ``compression``, ``absolute_budget`` (NULL),
        ``sample``, ``score``, ``reference_score``."""
        where, params = self._filters(task, model, "measured", None, sweeps, metrics=RANKING_METRICS)
        named = self.setting_of(reference)  # (policy, setting)
        frame = self.frame(
            f"""
            WITH rows AS (SELECT * FROM results WHERE (setting = '{{}}' OR ? OR (policy = ? AND setting = ?))
                                              AND score IS NOT NULL AND {where})
            SELECT p.model, NULL::VARCHAR AS suite, p.task || ' · ' || p.ranking_sweep || ': ' || p.metric AS task,
                   p.metric, p.policy,
                   p.setting, NULL::DOUBLE AS compression, NULL::INTEGER AS absolute_budget, p.sample, p.score,
                   r.score AS reference_score
            FROM rows p JOIN rows r
              ON r.policy = ? AND r.setting = ? AND NOT (p.policy = r.policy AND p.setting = r.setting)
             AND p.model = r.model AND p.task = r.task AND p.metric = r.metric AND p.sample = r.sample
             AND p.ranking_sweep = r.ranking_sweep
             AND p.seed IS NOT DISTINCT FROM r.seed AND p.prompt_len IS NOT DISTINCT FROM r.prompt_len
             AND p.max_new_tokens IS NOT DISTINCT FROM r.max_new_tokens
             AND json_extract_string(p.meta, '$.step') IS NOT DISTINCT FROM json_extract_string(r.meta, '$.step')
            WHERE (? IS NULL OR list_contains(?, p.policy))
            ORDER BY p.model, p.task, p.metric, p.policy, p.setting, p.sample
            """, [settings, *named, *params, *named, policies, policies])
        return named_by_setting(frame)

    def where_run(self, policies: list[str]) -> pd.DataFrame:
        """Where each of ``policies`` has rows, whatever the filters: its distinct (policy, source, task,
        metric) and whether the metric is a quality one (the figures draw no other), so that a figure drawing
        none of one can say where its rows are, or that they are not quality."""
        return self.frame(
            "SELECT DISTINCT policy, source, task, metric, list_contains(?, metric) AS quality FROM results "
            "WHERE list_contains(?, policy) ORDER BY ALL", [list(QUALITY_METRICS), list(policies)])

    def options(self, column: str, source: str | None = None, metrics: tuple[str, ...] | None = None) -> list[str]:
        """The distinct values of a filter column, of one source's rows or of all, and of rows of ``metrics``
        only where given (``QUALITY_METRICS``: the policies the quality figures draw)."""
        if column not in ("task", "model", "policy", "source", "sweep"):
            raise ValueError(f"no filter on {column!r}")
        values = "unnest(ran_in)" if column == "sweep" else column  # a shared cell counts for every sweep it ran in
        metrics = list(metrics) if metrics else None
        return self._column(
            f"SELECT DISTINCT * FROM (SELECT {values} AS value FROM results WHERE (? IS NULL OR source = ?) "
            "AND (?::VARCHAR[] IS NULL OR list_contains(?, metric))) WHERE value IS NOT NULL ORDER BY 1",
            [source, source, metrics, metrics])
