"""Loading ``results_db/`` into the store's DuckDB tables: every shard line checked, the draws of a sample made
one row, the problems found reported by shard and line.  Part of the store, the only code that writes SQL."""

from __future__ import annotations

import json
import threading
import tomllib
from pathlib import Path
from typing import Any

import duckdb

from .columns import (
    ACCEPTED,
    COLUMNS,
    GENERATION,
    LABEL_PARAMS,
    PER_DRAW,
    QUALITY_METRICS,
    RANKING_METRICS,
    ROOT,
    SHOWN_LINES,
    _decoded,
    _literal,
    policy_added_parameters,
    policy_defaults,
    policy_kinds,
    suite_of,
)


class Loaded:
    """The store's tables, read once from ``root`` (:class:`kvviz.store.Store` adds the queries)."""

    # How a row cut the cache, as the figures group it: its compression or its absolute budget, never both;
    # the full cache's rows (stored at a sweep's first compression, or at neither) have neither.
    _CUT_BY = {"compression": "CASE WHEN policy = 'full' THEN NULL ELSE compression END",
               "absolute_budget": "CASE WHEN policy = 'full' THEN NULL ELSE absolute_budget END"}
    _CUT = ", ".join(f"{expression} AS {name}" for name, expression in _CUT_BY.items())

    def __init__(self, root: str | Path = ROOT, defaults: dict[str, dict[str, Any]] | None = None,
                 kinds: dict[str, str] | None = None, added: dict[str, dict[str, Any]] | None = None):
        self.root = Path(root)
        self.defaults = policy_defaults() if defaults is None else defaults
        # name -> the parameters added since rows were stored, with the value a measured row without them ran
        self.added = policy_added_parameters() if added is None else added
        # name -> class: which names can state one another's settings (a name without one is its own kind)
        self.kinds = policy_kinds() if kinds is None else kinds
        self._named: dict[tuple, tuple[str | None, str]] = {}
        self.problems: list[str] = []
        self._connect()
        self.shards = self._read_shards()
        self._check_lines()
        # The experiment a measured row belongs to; a cell is that plus its draw.
        # A ranking sweep stores five metrics of one trace and policy: each its own row, never one mean.
        experiment = ["model", "task", "sample", "seed", "policy", "setting", *self._CUT_BY.values(), "prompt_len",
                      "metric", "ranking_sweep", *GENERATION]
        self._build_generations(experiment)
        self._build_results(experiment)
        self._report_unknown_settings()
        self._report_mixed_generation()
        self._report_mixed_prompts()

    def _connect(self) -> None:
        """Open the in-memory database with the Python functions the SQL calls and the tables the shards fill."""
        self.con = duckdb.connect(":memory:")
        # One connection, many threads (the app's sessions, its start-up drawing): a query and the fetch of its
        # result go together, or one thread's fetch could return another's rows
        self._lock = threading.RLock()
        self.con.execute("SET enable_progress_bar = false")  # a slow load on a busy machine drew one on stdout
        # null_handling="special": rows without params (or a policy) still get a setting, '{}'
        self.con.create_function("setting", self._setting, ["VARCHAR", "VARCHAR"], "VARCHAR", null_handling="special")
        self.con.create_function("named", self._name, ["VARCHAR", "VARCHAR"], "VARCHAR", null_handling="special")
        self.con.create_function("suite", suite_of, ["VARCHAR"], "VARCHAR", null_handling="special")
        # One row per line of every shard; ``text`` is NULL where the line's bytes are not UTF-8.
        self.con.execute("CREATE TABLE shard_lines (shard VARCHAR, line_no INTEGER, text VARCHAR)")
        self.con.execute("CREATE TABLE sweep_settings (folder VARCHAR, "
                         + ", ".join(f"{name} {COLUMNS[name]}" for name in GENERATION) + ")")

    def _check_lines(self) -> None:
        """Parse and type-check every shard line into ``checked_lines``; report the shards with bad lines."""
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

    @staticmethod
    def _read(name: str, kind: str) -> str:
        """One JSON value of ``checked_lines.value`` as its column's SQL type."""
        return (f'value."{name}"' if kind == "JSON" else f"""json_extract_string(value."{name}", '$')"""
                if kind == "VARCHAR" else f'CAST(value."{name}" AS {kind})')

    def _row_select(self) -> str:
        """The SELECT list that turns a checked line (joined to its sweep's ``settings``) into a row's columns."""
        read = self._read
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
                                      for name in GENERATION)
        select += " AS unknown_settings, split_part(shard, '/', 1) AS folder"
        # A damage-ranking row belongs to its sweep's probe (its step, and the entries all of that sweep's
        # policies judged): two ranking sweeps of one sample are two experiments, never one row or one mean.
        select += (f""", CASE WHEN list_contains({list(RANKING_METRICS)}, json_extract_string(value."metric", '$')) """
                   """THEN coalesce(json_extract_string(value."sweep", '$'), split_part(shard, '/', 1)) END """
                   "AS ranking_sweep")
        return select

    # A row outside the per-sample experiments (a paper's, or one without a sample) is kept as it is
    _SINGLE = "source IS DISTINCT FROM 'measured' OR sample IS NULL"

    def _build_generations(self, experiment: list[str]) -> None:
        """Materialise ``generations``: every good line as a row, a cell run by two sweeps counted once."""
        # Materialised once: the files never change while the app runs, and the derived columns call Python.
        # ``policy`` = the registry name that states the row's parameters with the fewest changes, and
        # ``setting`` = those changes ('{}' at its defaults), both from the policy as run (the inner SELECT);
        # ``suite`` = the benchmark its task belongs to.
        # A measured cell run by two sweeps (sweep-2k-inertia's alpha = 0.8 is sweep-2k's inertia, its alpha = 0
        # sweep-2k's single-step) counts once -- the full cache whatever ρ or budget each sweep filed it under,
        # since it has neither; a cell generated with other settings (max_new_tokens, chat template) is another
        # experiment and stays.
        # ``ran_in``: every sweep that ran the row's experiment (a row written by hand, without a sweep name,
        # by its folder), so that a sweep's filter keeps the cells it shares with a sweep kept in its place.
        single = self._SINGLE
        # Every row first, duplicates included, so that duplicates that disagree can be reported below
        self.con.execute(
            f"CREATE TEMP TABLE every_generation AS SELECT *, CASE WHEN {single} THEN [coalesce(sweep, folder)] ELSE "
            f"list(DISTINCT coalesce(sweep, folder) ORDER BY coalesce(sweep, folder)) OVER (PARTITION BY "
            f"{', '.join(experiment)}) END AS ran_in "
            "FROM (SELECT * REPLACE (named(policy, CAST(params AS VARCHAR)) "
            "AS policy) FROM (SELECT *, setting(policy, CAST(params AS VARCHAR)) AS setting, suite(task) AS suite "
            f"FROM (SELECT {self._row_select()} FROM checked_lines LEFT JOIN sweep_settings AS settings "
            "ON settings.folder = split_part(shard, '/', 1) WHERE problem = '')))")
        self.con.execute(
            f"CREATE TABLE generations AS SELECT * FROM every_generation QUALIFY {single} OR row_number() OVER "
            f"(PARTITION BY {', '.join(experiment)}, coalesce(draw, 0) ORDER BY sweep) = 1")
        self._report_conflicting_duplicates(experiment, single)
        self.con.execute("DROP TABLE every_generation")

    def _build_results(self, experiment: list[str]) -> None:
        """Materialise ``results``: one row per measured sample and cell, its draws averaged."""
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

    def _report_unknown_settings(self) -> None:
        """Say which folders' measured rows fell back to the runner's generation defaults."""
        for folder, rows in self.con.execute(
                "SELECT folder, count(*) FROM results WHERE source = 'measured' AND unknown_settings "
                "GROUP BY folder ORDER BY folder").fetchall():
            self.problems.append(f"{folder}: {rows} rows say neither max_new_tokens nor chat and their folder has no "
                                 f"config.toml; read as the runner's defaults ({GENERATION['max_new_tokens']} new "
                                 "tokens, chat template on)")

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
                from ..policies import fewest_changes

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
