"""InertiaKV's appendix tables 8-11 and 13 in results_db/paper/, checked against the paper's own text."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.store import Store

REPOSITORY = Path(__file__).resolve().parent.parent
PAPER_ROWS = REPOSITORY / "results_db" / "paper"
INERTIAKV = Path("/work/shared/papers/inertiakv.txt")
needs_text = pytest.mark.skipif(not INERTIAKV.exists(), reason="the paper's text is not on this machine")


@pytest.fixture(scope="module")
def paper_store(tmp_path_factory):
    """A store over the paper rows alone (the shipped sweeps are not needed here)."""
    root = tmp_path_factory.mktemp("store")
    (root / "paper").symlink_to(PAPER_ROWS, target_is_directory=True)
    store = Store(root)
    assert store.problems == []
    return store


def printed_line(table: int, *first_cells: str) -> list[str]:
    """The tab-separated cells of the line of InertiaKV Table ``table`` whose first cells are ``first_cells``:
    the table is the block of tab-separated lines just above its caption."""
    lines = INERTIAKV.read_text().splitlines()
    caption = next(i for i, line in enumerate(lines) if line.startswith(f"Table {table}:"))
    block = []
    for line in reversed(lines[:caption]):
        if "\t" not in line:
            if block:
                break
            continue
        block.append(line.split("\t"))
    header = block[-1]
    matches = [cells for cells in block[:-1] if cells[: len(first_cells)] == list(first_cells)]
    assert len(matches) == 1, (table, first_cells)
    return dict(zip(header, matches[0]))


def stored(store: Store, table: str, **where) -> float:
    """The one InertiaKV row of ``table`` matching ``where`` (column = value; params as JSON text)."""
    clauses = " AND ".join(f'"{column}" = ?' if column != "params" else "params::VARCHAR = ?" for column in where)
    found = store.con.execute(f"SELECT score FROM results WHERE paper = 'InertiaKV' AND \"table\" = ? AND {clauses}",
                              [table, *where.values()]).fetchall()
    assert len(found) == 1, (table, where, found)
    return found[0][0]


def test_each_new_table_has_its_rows(paper_store):
    counts = dict(paper_store.con.execute(
        "SELECT \"table\", count(*) FROM results WHERE paper = 'InertiaKV' GROUP BY ALL").fetchall())
    # 3 benchmarks x 5 columns; 2 x 4; 2 models x 3 benchmarks x 4; 2 benchmarks x 2 budgets x 8; 6 traces x 5
    assert {table: counts.get(table) for table in ("Table 8", "Table 9", "Table 10", "Table 11", "Table 13")} == \
        {"Table 8": 15, "Table 9": 8, "Table 10": 24, "Table 11": 32, "Table 13": 30}
    assert paper_store.con.execute("SELECT count(*) FROM results WHERE source = 'paper'").fetchone()[0] == 376


@needs_text
def test_spot_values_equal_the_printed_tables(paper_store):
    cells = printed_line(8, "RULER")
    assert stored(paper_store, "Table 8", task="RULER", policy="no mom.") == float(cells["No Mom."])
    assert stored(paper_store, "Table 8", task="RULER", policy="full") == float(cells["Full"])
    cells = printed_line(8, "LongBench-v2")
    assert stored(paper_store, "Table 8", task="LongBench-v2", policy="high res.") == float(cells["High Res."])
    cells = printed_line(9, "LongBench subset")
    assert stored(paper_store, "Table 9", task="LongBench subset", policy="inertia") == float(cells["InertiaKV"])
    cells = printed_line(10, "Qwen2.5-14B", "RULER")
    assert stored(paper_store, "Table 10", model="Qwen2.5-14B", task="RULER", policy="cumulative") == \
        float(cells["H2O-style"])
    assert stored(paper_store, "Table 10", model="Qwen2.5-14B", task="RULER", policy="inertia-lazy") == \
        float(cells["Lazy4"])
    cells = printed_line(10, "Mistral-7B", "LongBench-v2†")
    assert stored(paper_store, "Table 10", model="Mistral-7B", task="LongBench-v2",
                  policy="full") == float(cells["Full"])
    cells = printed_line(11, "RULER", "2048")
    assert stored(paper_store, "Table 11", task="RULER", absolute_budget=2048, policy="tova+ema",
                  params='{"alpha":0.9}') == float(cells["TOVA+EMA(0.9)"])
    assert stored(paper_store, "Table 11", task="RULER", absolute_budget=2048, policy="knorm+ema") == \
        float(cells["KNorm+EMA"])
    cells = printed_line(13, "RULER", "0.80")
    for metric, column in (("raw_churn", "Raw Churn"), ("utility_churn", "EMA Churn"),
                           ("raw_utility_jaccard", "Raw/EMA Jaccard"), ("raw_top_evicted_rate", "Raw-Top Evicted"),
                           ("trace_accuracy", "Trace Acc.")):
        key = next(name for name in cells if column in name)  # the churn headers print TeX around top-k
        assert stored(paper_store, "Table 13", task="RULER", metric=metric, params='{"alpha":0.8}') == \
            float(cells[key]), metric


def test_table_13_names_the_apps_diagnostics_and_keeps_trace_accuracy_out_of_quality(paper_store):
    from kvviz import diagnostics
    from kvviz.store import QUALITY_METRICS

    metrics = {m for (m,) in paper_store.con.execute(
        "SELECT DISTINCT metric FROM results WHERE \"table\" = 'Table 13' AND paper = 'InertiaKV'").fetchall()}
    assert metrics == {"raw_churn", "utility_churn", "raw_utility_jaccard", "raw_top_evicted_rate", "trace_accuracy"}
    # every name but the trace accuracy is one of the app's diagnostics (a function of a trace, by that name)
    assert all(callable(getattr(diagnostics, metric, None)) for metric in metrics - {"trace_accuracy"})
    assert "trace_accuracy" not in QUALITY_METRICS


def test_the_delay_ablation_at_1024_is_marked_as_the_full_methods_setting(paper_store):
    notes = dict(paper_store.con.execute(
        "SELECT absolute_budget, notes FROM results WHERE paper = 'AvoKV-E' AND \"table\" = 'Table 4' "
        "AND policy = 'avokv' AND params::VARCHAR = '{\"delay\":8}'").fetchall())
    assert sorted(notes) == [256, 512, 1024]
    assert "full method's own setting" in notes[1024] and "W_delay = 8 = W_obs" in notes[1024]
    assert "full method" not in notes[256] and "full method" not in notes[512]
