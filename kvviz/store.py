"""The results store: DuckDB views over the sweeps in ``results_db/`` -- the only code that writes SQL.

Each sweep is a folder with its ``config.toml`` and one or more ``rows*.jsonl`` shards (written by the
sweep runner).  The store opens an in-memory DuckDB database, checks every shard on its own, and unions
the readable ones into the view ``results``; a missing or corrupt shard is reported by name in
``problems`` and the rest still loads.  Nothing is written back: the files are only read, and every query
takes its values as parameters.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pandas as pd

ROOT = Path(__file__).resolve().parent.parent / "results_db"


class Store:
    """Read-only access to the measured (and paper-reported) rows."""

    def __init__(self, root: str | Path = ROOT):
        self.root = Path(root)
        self.con = duckdb.connect(":memory:")
        self.problems: list[str] = []
        self.shards = self._readable_shards()
        if self.shards:
            files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in self.shards)
            self.con.execute(f"CREATE VIEW results AS SELECT * FROM read_json([{files}], "
                             "format = 'newline_delimited', union_by_name = true)")
        else:
            self.con.execute("CREATE VIEW results AS SELECT NULL::VARCHAR AS sweep, NULL::VARCHAR AS source, "
                             "NULL::VARCHAR AS task, NULL::VARCHAR AS policy, NULL::DOUBLE AS compression, "
                             "NULL::DOUBLE AS score, NULL::VARCHAR AS model, NULL::JSON AS params, "
                             "NULL::JSON AS meta, NULL::DOUBLE AS decode_tok_s WHERE false")

    def _readable_shards(self) -> list[Path]:
        good = []
        if not self.root.exists():
            self.problems.append(f"{self.root}: no results folder")
            return good
        for sweep in sorted(p for p in self.root.iterdir() if p.is_dir()):
            shards = sorted(sweep.glob("rows*.jsonl"))
            if not shards:
                self.problems.append(f"{sweep.name}: no rows*.jsonl shard")
            for shard in shards:
                try:
                    self.con.execute("SELECT count(*) FROM read_json(?, format = 'newline_delimited')",
                                     [str(shard)]).fetchone()
                    good.append(shard)
                except duckdb.Error as error:
                    self.problems.append(f"{sweep.name}/{shard.name}: unreadable ({str(error).splitlines()[0]})")
        return good

    def frame(self, sql: str, params: list | None = None) -> pd.DataFrame:
        return self.con.execute(sql, params or []).df()

    def quality_vs_compression(self, task: str | None = None, model: str | None = None,
                               policies: list[str] | None = None, source: str | None = None) -> pd.DataFrame:
        """Mean score per (source, task, policy, compression) under optional filters."""
        return self.frame(
            """
            SELECT source, task, policy, compression, avg(score) AS score, count(*) AS samples
            FROM results
            WHERE (? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR source = ?)
              AND (? IS NULL OR list_contains(?, policy))
            GROUP BY ALL ORDER BY source, task, policy, compression
            """,
            [task, task, model, model, source, source, policies, policies],
        )

    def _filters(self, task, model, source, policies) -> tuple[str, list]:
        sql = ("(? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR source = ?) "
               "AND (? IS NULL OR list_contains(?, policy))")
        return sql, [task, task, model, model, source, source, policies, policies]

    def alpha_sensitivity(self, task=None, model=None, source=None) -> pd.DataFrame:
        """InertiaKV's mean score per EMA coefficient alpha (rows that set alpha), per source, task, compression."""
        where, params = self._filters(task, model, source, None)
        return self.frame(
            f"""
            SELECT source, task, compression, alpha, avg(score) AS score, count(*) AS samples FROM (
                SELECT *, TRY_CAST(json_extract_string(to_json(params), '$.alpha') AS DOUBLE) AS alpha
                FROM results WHERE policy = 'inertia' AND {where})
            WHERE alpha IS NOT NULL GROUP BY ALL ORDER BY source, task, compression, alpha
            """, params)

    def refresh_curve(self, task=None, model=None, source=None) -> pd.DataFrame:
        """Score and decode speed against the refresh interval r (0 = score-free) for the InertiaKV family."""
        where, params = self._filters(task, model, source, None)
        return self.frame(
            f"""
            SELECT source, task, compression, refresh, avg(score) AS score, avg(decode_tok_s) AS decode_tok_s,
                   count(*) AS samples FROM (
                SELECT *, CASE WHEN policy = 'score-free' THEN 0 ELSE coalesce(TRY_CAST(
                    json_extract_string(to_json(params), '$.refresh') AS INTEGER),
                    CASE policy WHEN 'inertia-lazy' THEN 4 ELSE 1 END) END AS refresh
                FROM results WHERE policy IN ('inertia', 'inertia-lazy', 'score-free') AND {where})
            GROUP BY ALL ORDER BY source, task, compression, refresh
            """, params)

    def needle_grid(self, model=None, policies=None, source=None) -> pd.DataFrame:
        """Mean score per (policy, context length, needle depth) of the needle-in-a-haystack grid."""
        where, params = self._filters("needle_grid", model, source, policies)
        return self.frame(
            f"""
            SELECT source, policy, compression,
                   TRY_CAST(json_extract_string(to_json(meta), '$.length') AS INTEGER) AS length,
                   TRY_CAST(json_extract_string(to_json(meta), '$.depth') AS DOUBLE) AS depth,
                   avg(score) AS score, count(*) AS samples
            FROM results WHERE {where} GROUP BY ALL ORDER BY source, policy, compression, length, depth
            """, params)

    def options(self, column: str) -> list[str]:
        if column not in ("task", "model", "policy", "source", "sweep"):
            raise ValueError(f"no filter on {column!r}")
        return [row[0] for row in self.con.execute(
            f"SELECT DISTINCT {column} FROM results WHERE {column} IS NOT NULL ORDER BY 1").fetchall()]
