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

from typing import Any

import pandas as pd

# The sentences about these rows live in kvviz.notes, shared with the app; imported here where callers found them.
from ..notes import HELD_OVER_WHY, held_over_note, suite_notes  # noqa: F401
from .columns import (  # noqa: F401 -- kvviz.store.X, as before the split
    ACCEPTED,
    COLUMNS,
    FULL_CACHE_FLOOR,
    GENERATION,
    HELD_OVER,
    LABEL_PARAMS,
    NOT_RANKED,
    PER_DRAW,
    PREFIXES,
    QUALITY_METRICS,
    RANKED_FLOOR,
    RANKING_METRICS,
    ROOT,
    SHOWN_LINES,
    SUITES,
    _decoded,
    _literal,
    _setting_order,
    held_over_budget,
    named_by_setting,
    policy_added_parameters,
    policy_defaults,
    policy_kinds,
    ranking_caveats,
    setting_names,
    suite_of,
)
from .load import Loaded


class Store(Loaded):
    """Read-only access to the measured (and paper-reported) rows."""

    def frame(self, sql: str, params: list | None = None) -> pd.DataFrame:
        with self._lock:
            return self.con.execute(sql, params or []).df()

    def _column(self, sql: str, params: list) -> list:
        """The first column of a query's rows."""
        with self._lock:
            return [row[0] for row in self.con.execute(sql, params).fetchall()]

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

    def speed_vs_quality(self, task=None, model=None, policies=None, settings: bool = False,
                         sweeps=None) -> pd.DataFrame:
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

    def max_length_hits(self, task=None, model=None, policies=None, settings: bool = False,
                        sweeps=None) -> pd.DataFrame:
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
        # by value, not as text: alpha=0.9 before alpha=0.95
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
        (:func:`kvviz.stats.paired_table`, which reads ``metric`` as the task): same sweep (one probe, over the
        entries all its policies judged), model, task, sample, seed, prompt, step and metric.  Rows: ``model``,
        ``suite`` (NULL), ``task`` (the row's task, sweep and metric, ``"t · s: auroc"``), ``metric``, ``policy``,
        ``compression``, ``absolute_budget`` (NULL), ``sample``, ``score``, ``reference_score``."""
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
