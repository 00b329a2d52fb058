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
# Columns every query may use; shards that lack one (paper rows have no decode speed) read it as NULL.
COLUMNS = {"sweep": "VARCHAR", "source": "VARCHAR", "paper": "VARCHAR", "table": "VARCHAR", "model": "VARCHAR",
           "task": "VARCHAR", "policy": "VARCHAR", "params": "JSON", "compression": "DOUBLE", "metric": "VARCHAR",
           "score": "DOUBLE", "meta": "JSON", "decode_tok_s": "DOUBLE", "notes": "VARCHAR"}
# Metrics that are a quality score of a run (paper tables also report deltas, best alphas, AUROCs ...).
QUALITY_METRICS = ("score", "accuracy", "string_match", "exact_match", "rouge_l", "token_f1", "math",
                   "edit_similarity")


class Store:
    """Read-only access to the measured (and paper-reported) rows."""

    def __init__(self, root: str | Path = ROOT):
        self.root = Path(root)
        self.con = duckdb.connect(":memory:")
        self.problems: list[str] = []
        self.shards = self._readable_shards()
        if self.shards:
            files = ", ".join("'" + str(p).replace("'", "''") + "'" for p in self.shards)
            self.con.execute(f"CREATE VIEW raw_rows AS SELECT * FROM read_json([{files}], "
                             "format = 'newline_delimited', union_by_name = true)")
            present = {row[0] for row in self.con.execute("DESCRIBE raw_rows").fetchall()}
        else:
            self.con.execute("CREATE VIEW raw_rows AS SELECT 1 AS none WHERE false")
            present = set()
        select = ", ".join(
            (f'CAST(to_json("{name}") AS JSON)' if kind == "JSON" else f'CAST("{name}" AS {kind})')
            + f' AS "{name}"' if name in present else f'NULL::{kind} AS "{name}"' for name, kind in COLUMNS.items())
        self.con.execute(f"CREATE VIEW results AS SELECT {select} FROM raw_rows")

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
        """Mean score per (source, model, task, policy, compression) under optional filters."""
        return self.frame(
            """
            SELECT source, model, task, policy, compression, avg(score) AS score, count(*) AS samples
            FROM results
            WHERE (? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR source = ?)
              AND (? IS NULL OR list_contains(?, policy)) AND list_contains(?, metric)
            GROUP BY ALL ORDER BY source, model, task, policy, compression
            """,
            [task, task, model, model, source, source, policies, policies, list(QUALITY_METRICS)],
        )

    def _filters(self, task, model, source, policies) -> tuple[str, list]:
        sql = ("(? IS NULL OR task = ?) AND (? IS NULL OR model = ?) AND (? IS NULL OR source = ?) "
               "AND (? IS NULL OR list_contains(?, policy)) AND list_contains(?, metric)")
        return sql, [task, task, model, model, source, source, policies, policies, list(QUALITY_METRICS)]

    def alpha_sensitivity(self, task=None, model=None, source=None) -> pd.DataFrame:
        """InertiaKV's mean score per EMA coefficient alpha (rows that set alpha), per source, task, compression."""
        where, params = self._filters(task, model, source, None)
        return self.frame(
            f"""
            SELECT source, model, task, compression, alpha, avg(score) AS score, count(*) AS samples FROM (
                SELECT *, TRY_CAST(json_extract_string(to_json(params), '$.alpha') AS DOUBLE) AS alpha
                FROM results WHERE policy = 'inertia' AND {where})
            WHERE alpha IS NOT NULL GROUP BY ALL ORDER BY source, model, task, compression, alpha
            """, params)

    def refresh_curve(self, task=None, model=None, source=None) -> pd.DataFrame:
        """Score and decode speed against the refresh interval r (0 = score-free) for the InertiaKV family."""
        where, params = self._filters(task, model, source, None)
        return self.frame(
            f"""
            SELECT source, model, task, compression, refresh, avg(score) AS score, avg(decode_tok_s) AS decode_tok_s,
                   count(*) AS samples FROM (
                SELECT *, CASE WHEN policy = 'score-free' THEN 0 ELSE coalesce(TRY_CAST(
                    json_extract_string(to_json(params), '$.refresh') AS INTEGER),
                    CASE policy WHEN 'inertia-lazy' THEN 4 ELSE 1 END) END AS refresh
                FROM results WHERE policy IN ('inertia', 'inertia-lazy', 'score-free') AND {where})
            GROUP BY ALL ORDER BY source, model, task, compression, refresh
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
