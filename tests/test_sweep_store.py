"""The sweep runner (resumable, crash-safe) and the DuckDB store over its rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvviz.bench import sweep
from kvviz.store import Store

CONFIG = Path(__file__).parent / "fixtures" / "sweep_tiny.toml"


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(folder.glob("rows*.jsonl")) for line in p.read_text().splitlines()]


def test_cells_expand_the_grid():
    config = sweep.load_config(CONFIG)
    cells = sweep.cells(config)
    # 3 samples x (full once + streaming x 2 + inertia(alpha 0, .8) x 2 compressions) = 3 x 7
    assert len(cells) == 21 and len({c.key for c in cells}) == 21
    assert {c.params for c in cells if c.policy == "inertia"} == {(("alpha", 0.0),), (("alpha", 0.8),)}


def test_rerun_skips_finished_cells_and_a_torn_line_is_dropped(tmp_path, tiny):
    config = sweep.load_config(CONFIG)
    model, tokenizer = tiny
    assert sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 21
    first = rows(tmp_path)
    assert len(first) == 21 and all(r["source"] == "measured" and 0 <= r["score"] <= 1 for r in first)
    assert {"model", "git_commit", "torch", "transformers", "device", "seed", "date"} <= set(first[0])
    with open(tmp_path / "rows.jsonl", "ab") as handle:
        handle.write(b'{"cell": "half a row')  # what a kill in the middle of a write leaves
    assert sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 0
    assert rows(tmp_path) == first


def test_sigkill_loses_at_most_the_cell_in_flight_and_never_duplicates(tmp_path):
    command = [sys.executable, "-m", "kvviz.cli", "bench", "run", str(CONFIG), "--out", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows_file, deadline = tmp_path / "rows.jsonl", time.time() + 120
    while time.time() < deadline:  # let a few cells finish, then kill without warning
        if rows_file.exists() and len(rows_file.read_bytes().splitlines()) >= 5:
            break
        time.sleep(0.05)
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    partial = len(rows_file.read_bytes().splitlines())
    assert 0 < partial < 21
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300)
    keys = [r["cell"] for r in rows(tmp_path)]
    assert len(keys) == 21 == len(set(keys))


def test_store_queries_rows_and_reports_bad_shards(tmp_path, tiny):
    config = sweep.load_config(CONFIG)
    model, tokenizer = tiny
    good = tmp_path / "tiny-test"
    sweep.run(config, good, model=model, tokenizer=tokenizer, progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "rows.jsonl").write_text("{not json at all\n")
    (tmp_path / "empty").mkdir()
    store = Store(tmp_path)
    assert any("broken/rows.jsonl" in p for p in store.problems)
    assert any(p.startswith("empty") for p in store.problems)
    table = store.quality_vs_compression(task="single_needle", policies=["inertia", "streaming"])
    assert set(table.policy) == {"inertia", "streaming"} and set(table.compression) == {0.5, 0.75}
    assert (table.samples == [4, 4, 2, 2]).all()  # inertia has two alphas x 2 samples; streaming 2 samples
    assert store.options("task") == ["multi_key_needle", "single_needle"]
    with pytest.raises(ValueError):
        store.options("score; DROP TABLE x")
