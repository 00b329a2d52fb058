"""The benchmark commands run end to end and print every row they promise (timings are not asserted)."""

from __future__ import annotations

import json

from kvviz.cli import main


def test_speed_bench_prints_every_configuration(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "128", "--new-tokens", "6", "--repeats", "1",
                 "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "meta" in rows[0]
    names = [row["what"] for row in rows[1:]]
    assert names == ["generate", "full", "inertia", "inertia-lazy", "score-free", "static-no-scoring",
                     "static-inertia", "static-inertia-lazy", "static-score-free"]
    assert all(row["decode_tok_s"] > 0 and "vs_generate" in row for row in rows[1:])
    assert all(row["final_cache"] == row["budget"] == 12 for row in rows[1:] if row["what"] not in ("generate", "full"))


def test_probe_bench_compares_batched_with_one_at_a_time(tmp_path):
    out = tmp_path / "probe.jsonl"
    assert main(["bench", "probe", "--model", "tiny-random-llama", "--prompt-tokens", "120", "--step", "3",
                 "--sample", "6", "--future", "3", "--batch", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row.get("what") for row in rows[1:]] == ["one at a time", "batched (4)"]
    assert rows[-1]["max_abs_diff_vs_one_at_a_time"] < 1e-4
