"""The benchmark commands run end to end and print every row they promise (timings are not asserted)."""

from __future__ import annotations

import json

from kvviz.cli import main


def test_speed_bench_prints_every_configuration(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "128", "--new-tokens", "6", "--repeats", "1",
                 "--compile", "on", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert "meta" in rows[0]
    assert rows[1]["what"] == "prefill" and rows[1]["prefill_s"] > 0  # one prefill, shared by engine and static runs
    assert rows[-1]["what"] == "context done" and rows[-1]["seconds"] > 0
    rows = [rows[0], *rows[2:-1]]
    names = [row["what"] for row in rows[1:]]
    assert names == ["generate", "full", "inertia", "inertia-lazy", "score-free", "static-no-scoring",
                     "static-inertia", "static-inertia-lazy", "static-score-free", "static-no-scoring-uncompiled",
                     "static-inertia-uncompiled"]
    assert all(row["decode_tok_s"] > 0 and "vs_generate" in row for row in rows[1:])
    assert all(row["final_cache"] == row["budget"] == 12 for row in rows[1:] if row["what"] not in ("generate", "full"))
    static = {row["what"]: row for row in rows[1:] if row["what"].startswith("static-")}
    assert all(row["compiled"] == (not name.endswith("-uncompiled")) for name, row in static.items())
    # Compiling is setup, kept out of the steady-state rate; the uncompiled CPU step has none.
    assert static["static-no-scoring"]["setup_s"] > 0
    assert static["static-no-scoring"]["first_setup_s"] >= static["static-no-scoring"]["setup_s"]
    assert static["static-inertia-uncompiled"]["setup_s"] == 0
    assert all("scoring_overhead_vs_no_scoring" in row for name, row in static.items()
               if not name.startswith("static-no-scoring"))


def test_speed_bench_reports_a_failed_configuration_and_measures_the_rest(tmp_path, monkeypatch):
    from kvviz.bench import speed

    real = speed.time_static

    def failing(*args, **kwargs):
        if args[-1].get("refresh") == 4:  # the static options
            raise RuntimeError("capture failed")
        return real(*args, **kwargs)

    monkeypatch.setattr(speed, "time_static", failing)
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "5", "--repeats", "1",
                 "--compile", "off", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["what"] for row in rows].count("prefill") == 2
    rows = [row for row in rows if row["what"] not in ("prefill", "context done")]
    assert len(rows) == 2 * 9
    failed = [row for row in rows if "error" in row]
    assert [row["what"] for row in failed] == ["static-inertia-lazy"] * 2
    assert failed[0]["error"] == "RuntimeError: capture failed" and "decode_tok_s" not in failed[0]
    assert all(row["decode_tok_s"] > 0 for row in rows if "error" not in row)


def test_speed_bench_stops_at_its_time_limit(tmp_path):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--time-limit", "1e-9", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert {row["prompt_len"] for row in rows if row["what"] != "skipped"} == {96}  # the first context always runs
    assert [row for row in rows if row["what"] == "skipped"] == [
        {"what": "skipped", "prompt_len": 128, "why": "would not end within --time-limit 1e-09 s"}]
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--time-limit", "3600", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["prompt_len"] for row in rows if row["what"] == "context done"] == [96, 128]


def test_probe_bench_compares_batched_with_one_at_a_time(tmp_path):
    out = tmp_path / "probe.jsonl"
    assert main(["bench", "probe", "--model", "tiny-random-llama", "--prompt-tokens", "120", "--step", "3",
                 "--sample", "6", "--future", "3", "--batch", "4", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row.get("what") for row in rows[1:]] == ["one at a time", "batched (4)"]
    assert rows[-1]["max_abs_diff_vs_one_at_a_time"] < 1e-4
