"""benchmarks/gpu_check.py, the one script a GPU session runs, tried on CPU as the device would run it: without
the packages that machine lacks, in its order of value, and cut short by its time budget without losing lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICE_SIM = Path(__file__).parent / "fixtures" / "device_sim"  # blocks pandas, pyarrow, gradio, duckdb, scipy, ...


def run_check(tmp_path: Path, *args: str) -> tuple[int, list[dict], list[dict]]:
    # Kept: a PYTHONPATH already set (make test-oldest layers the GPU machine's transformers 5.17 with it).
    path = os.pathsep.join(filter(None, [str(DEVICE_SIM), str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    out = tmp_path / "speed.jsonl"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--config",
                           "tiny", "--contexts", "256,128", "--also", "tiny", "--new-tokens", "6", "--out", str(out),
                           *args], env=env, capture_output=True, text=True, timeout=600)
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    checks = [json.loads(line) for line in (tmp_path / "speed-checks.jsonl").read_text().splitlines()]
    speed = [json.loads(line) for line in out.read_text().splitlines()]
    return done.returncode, checks, speed


def test_gpu_check_runs_without_the_packages_the_device_lacks(tmp_path):
    code, checks, speed = run_check(tmp_path, "--budget-s", "300")
    assert code == 0
    names = [line.get("check") for line in checks]
    # Target context's verdict first, then exactness, then the rest.
    assert names[:2] == ["torch.compile works", "targets"] and names[-1] == "done"
    assert names.index("targets") < names.index("static == reference") < names.index("exactness done")
    exact = [line for line in checks if line.get("check") == "static == reference"]
    assert len(exact) == 2 * (3 + 2) and all(line["tokens"] and line["kept"] for line in exact)  # 2 compiled cases
    done = next(line for line in checks if line.get("check") == "exactness done")
    assert done["all_equal"] is True and done["compiled_equal"] is True
    target = checks[1]
    assert target["prompt_len"] == 256 and target["inertia_tok_s"] > 0 and "lazy_gain" in target
    assert [row["what"] for row in speed if row.get("what", "").startswith("static-")] == [
        "static-no-scoring", "static-inertia", "static-inertia-lazy", "static-score-free"]
    more = [json.loads(line) for line in (tmp_path / "speed-more.jsonl").read_text().splitlines()]
    assert [row["prompt_len"] for row in more if row.get("what") == "context done"] == [128]
    assert (tmp_path / "speed-tiny.jsonl").exists() and [line.get("config") for line in checks].count("tiny") == 2


def test_gpu_check_out_of_time_keeps_the_first_rows_and_still_checks_exactness(tmp_path):
    code, checks, speed = run_check(tmp_path, "--budget-s", "1", "--checks-s", "0")
    assert code == 0
    rows = [row for row in speed if row.get("prompt_len") == 256 and row["what"] not in ("prefill", "context done")]
    assert rows[0]["what"] == "generate" and rows[0]["decode_tok_s"] > 0  # one configuration always runs
    assert all("skipped" in row for row in rows[1:]) and len(rows) == 9
    names = [line.get("check") for line in checks]
    assert "exactness done" in names and "contexts 128 skipped" in names and "tiny skipped" in names
    # Out of time, the compiled cases (a cold compile each) give way; the eager ones, the verdict, still run.
    exact = [line for line in checks if line.get("check") == "static == reference"]
    assert [line["compile"] for line in exact if "skipped" in line] == [True] * 4
    assert len(exact) == 2 * (3 + 2) and all(line["tokens"] and line["kept"] for line in exact if "skipped" not in line)
    assert not (tmp_path / "speed-more.jsonl").exists()


def test_a_failure_line_shows_where_it_failed_and_the_error_a_capture_masked():
    """The device's output is all there is to debug with: the innermost frames (not the script's outer
    ones), and the error that a failed CUDA-graph capture replaces with its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def slot_of_the_new_token():
        raise IndexError("index 7 is out of bounds for dimension 2 with size 7")

    def deep(levels: int):  # the script's own frames, many of them above the failing one
        return deep(levels - 1) if levels else slot_of_the_new_token()

    try:
        try:
            deep(20)
        except IndexError:
            raise RuntimeError("operation failed due to a previous error during capture")  # as the capture's exit
    except RuntimeError as error:
        record = gpu_check._failure(error)
    assert record["error"] == "RuntimeError: operation failed due to a previous error during capture"
    assert record["during"] == "IndexError: index 7 is out of bounds for dimension 2 with size 7"
    assert "in slot_of_the_new_token" in record["trace"] and "deep(20)" not in record["trace"]
