"""benchmarks/gpu_check.py, the one script a GPU session runs, tried on CPU as the device would run it: without
the packages that machine lacks, in its order of value, and cut short by its time budget without losing lines."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.device_script
def test_gpu_check_runs_without_the_packages_the_device_lacks(tmp_path):
    code, checks, speed = run_check(tmp_path, "--budget-s", "300")
    assert code == 0
    names = [line.get("check") for line in checks]
    # Target context's verdict first, then exactness, then the rest.
    assert names[:2] == ["torch.compile works", "targets"] and names[-1] == "done"
    assert names.index("targets") < names.index("static == reference") < names.index("exactness done")
    exact = [line for line in checks if line.get("check") == "static == reference"]
    # per family: 3 refresh settings x (default, value_block 4), and 2 compiled cases
    assert len(exact) == 2 * (3 * 2 + 2) and all(line["tokens"] and line["kept"] for line in exact)
    assert sum(line.get("value_block") == 4 for line in exact) == 2 * 3
    done = next(line for line in checks if line.get("check") == "exactness done")
    assert done["all_equal"] is True and done["compiled_equal"] is True
    target = checks[1]
    assert target["prompt_len"] == 256 and target["inertia_tok_s"] > 0 and "lazy_gain" in target
    # issue 42's: InertiaKV, on the static path and on the backend, against the full cache as a static step
    assert target["full_cache_graph_tok_s"] > 0 and target["backend_inertia_tok_s"] > 0
    assert {"inertia_vs_full_cache_graph", "backend_inertia_vs_full_cache_graph",
            "backend_inertia_at_least_200"} <= set(target)
    assert [row["what"] for row in speed if row.get("what", "").startswith("static-")] == [
        "static-full-cache", "static-no-scoring", "static-inertia", "static-inertia-lazy", "static-score-free",
        "static-no-scoring-unfused", "static-inertia-unfused"]
    backend = [line for line in checks if line.get("check") == "backend == engine"]
    assert [line["policy"] for line in backend] == [  # a setting of every kind the backend runs
        "inertia", "inertia-lazy", "tova", "h2o", "knorm", "streaming", "keydiff", "snapkv window=8", "kvzip",
        "expected-attention", "expected-attention-decode", "avokv interval=4", "rkv interval=4",
        "lazyeviction interval=4"]
    assert all(line["tokens"] and line["kept"] for line in backend)
    summary = next(line for line in checks if line.get("check") == "backend policies")
    assert summary["inertia_vs_inertia"] == 1.0 and summary["knorm_tok_s"] > 0
    backend_rows = {row["what"]: row for row in speed if row.get("what", "").startswith("backend-")}
    assert list(backend_rows) == ["backend-inertia", "backend-tova", "backend-h2o", "backend-knorm",
                                  "backend-streaming", "backend-rkv", "backend-avokv", "backend-inertia-events"]
    # InertiaKV's events read at the app's frame rate, against its bare run with setup counted alike
    events = backend_rows.pop("backend-inertia-events")
    assert events["decode_tok_s"] > 0 and events["final_cache"] == 25 and events["reads_per_second"] == 10.0
    # AvoKV-E protects 36 entries, more than this tiny context's B = 25: a row saying so (64k gives 6,553)
    assert backend_rows.pop("backend-avokv")["error"].startswith("BudgetTooSmall: budget 25 must exceed the 36")
    assert all(row["engine_tokens_equal"] and row["engine_kept_overlap"] == 1.0 for row in backend_rows.values())
    assert summary["rkv_tok_s"] > 0 and summary["events_vs_bare"] > 0 and "events_at_least_0.8_of_bare" in summary
    assert "inertia-events_tok_s" not in summary
    more = [json.loads(line) for line in (tmp_path / "speed-more.jsonl").read_text().splitlines()]
    assert [row["prompt_len"] for row in more if row.get("what") == "context done"] == [128]
    assert (tmp_path / "speed-tiny.jsonl").exists() and [line.get("config") for line in checks
                                                   if line.get("check") == "targets"].count("tiny") == 2


@pytest.mark.device_script
def test_gpu_check_out_of_time_keeps_the_first_rows_and_still_checks_exactness(tmp_path):
    code, checks, speed = run_check(tmp_path, "--budget-s", "1", "--checks-s", "0")
    assert code == 0
    rows = [row for row in speed if row.get("prompt_len") == 256 and row["what"] not in ("prefill", "context done")]
    # the rows issue 6's targets need run whatever the time; the rest are skipped
    assert [row["what"] for row in rows if row.get("decode_tok_s", 0) > 0] == [
        "generate", "static-full-cache", "static-no-scoring", "static-inertia", "static-inertia-lazy"]
    # 7 backend rows (--backend-policies' default) and InertiaKV's events row among the skipped ones
    assert all("skipped" in row for row in rows[5:]) and len(rows) == 20
    target = next(line for line in checks if line.get("check") == "targets")
    assert "lazy_gain" in target and "scoring_eviction_share" in target and target["engine_kept_overlap"] == 1.0
    names = [line.get("check") for line in checks]
    assert "exactness done" in names and "contexts 128 skipped" in names and "tiny skipped" in names
    # Out of time, the compiled cases (a cold compile each) give way; the eager ones, the verdict, still run.
    exact = [line for line in checks if line.get("check") == "static == reference"]
    assert [line["compile"] for line in exact if "skipped" in line] == [True] * 4
    assert len(exact) == 2 * (3 * 2 + 2) and all(line["tokens"] and line["kept"] for line in exact
                                                 if "skipped" not in line)
    assert not (tmp_path / "speed-more.jsonl").exists()


@pytest.mark.device_script
def test_a_speed_run_past_its_grace_is_killed_and_the_checks_still_run(tmp_path):
    """With no time and no grace the speed run (a child process) is killed at once: a line says so, the
    targets line has no figures, and the exactness checks run and pass as ever."""
    # (the backend's exactness cases left out: the full run checks them)
    code, checks, speed = run_check(tmp_path, "--budget-s", "1", "--checks-s", "0", "--grace-s", "0", "--also", "",
                                    "--backend-policies", "")
    assert code == 0
    killed = next(line for line in checks if line.get("check") == "speed tiny 256")
    assert killed["error"].startswith("killed 0 s past its --time-limit")
    target = next(line for line in checks if line.get("check") == "targets")
    assert "inertia_tok_s" not in target and target["vs_paper_39.1"] is None
    assert not any("decode_tok_s" in row for row in speed)
    done = next(line for line in checks if line.get("check") == "exactness done")
    assert done["all_equal"] is True


def load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_bfloat16_agreement_line_runs_on_cpu_as_it_will_on_the_device(monkeypatch):
    """The script calls it on a GPU only, where it would run for the first time: here, on CPU (no graphs),
    it must report how far the static bfloat16 step agrees with the engine, not an error."""
    gpu_check = load_gpu_check()
    lines = []
    monkeypatch.setattr(gpu_check, "report", lines.append)
    gpu_check.bfloat16_agreement("cpu", compiles=False)
    assert len(lines) == 1 and "error" not in lines[0], lines
    line = lines[0]
    assert line["check"] == "bfloat16 agreement (reported, not required)" and line["compile"] is False
    assert 0 <= line["tokens_equal_until"] <= 30 and 0 < line["kept_overlap_mean"] <= 1  # of 30 tokens
    assert isinstance(line["fp32_logits"], bool)


def test_a_failure_line_shows_where_it_failed_and_the_error_a_capture_masked():
    """The device's output is all there is to debug with: the innermost frames (not the script's outer
    ones), and the error that a failed CUDA-graph capture replaces with its own."""
    gpu_check = load_gpu_check()

    def slot_of_the_new_token():
        raise IndexError("index 7 is out of bounds for dimension 2 with size 7")

    def deep(levels: int):  # the script's own frames, many of them above the failing one
        return deep(levels - 1) if levels else slot_of_the_new_token()

    try:
        try:
            deep(20)
        except IndexError:
            # as the capture's exit raises it: chained implicitly, the case _failure must read
            raise RuntimeError("operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as error:
        record = gpu_check._failure(error)
    assert record["error"] == "RuntimeError: operation failed due to a previous error during capture"
    assert record["during"] == "IndexError: index 7 is out of bounds for dimension 2 with size 7"
    assert "in slot_of_the_new_token" in record["trace"] and "deep(20)" not in record["trace"]


def test_targets_are_judged_on_the_uncompiled_rows_when_compiling_failed():
    gpu_check = load_gpu_check()
    rows = [{"what": "generate", "prompt_len": 64, "decode_tok_s": 50.0},
            {"what": "static-no-scoring", "prompt_len": 64, "error": "BackendCompilerFailed: ..."},
            {"what": "static-inertia", "prompt_len": 64, "error": "not run: the compiled static step failed in ..."},
            {"what": "static-no-scoring-uncompiled", "prompt_len": 64, "decode_tok_s": 200.0},
            {"what": "static-inertia-uncompiled", "prompt_len": 64, "decode_tok_s": 160.0,
             "scoring_eviction_share": 0.2, "engine_kept_overlap": 0.98},
            {"what": "static-inertia-lazy-uncompiled", "prompt_len": 64, "decode_tok_s": 180.0}]
    assert gpu_check.targets(rows, 64) == {
        "check": "targets", "prompt_len": 64, "compiled": False, "inertia_tok_s": 160.0, "inertia_at_least_150": True,
        "scoring_eviction_share": 0.2, "scoring_eviction_at_most_5_percent": False, "engine_kept_overlap": 0.98,
        "lazy_gain": 1.125, "lazy_gain_at_most_1.05": False, "vs_paper_39.1": 4.09}


def test_targets_of_the_compiled_step_say_what_fusing_the_projections_and_blocking_the_values_bought():
    gpu_check = load_gpu_check()
    rows = [{"what": "generate", "prompt_len": 64, "decode_tok_s": 20.0},
            {"what": "static-no-scoring", "prompt_len": 64, "decode_tok_s": 160.0},
            {"what": "static-inertia", "prompt_len": 64, "decode_tok_s": 156.4, "scoring_eviction_share": 0.0225,
             "engine_kept_overlap": 1.0},
            {"what": "static-inertia-lazy", "prompt_len": 64, "decode_tok_s": 158.0},
            {"what": "static-inertia-unfused", "prompt_len": 64, "decode_tok_s": 136.0},
            {"what": "static-inertia-unblocked", "prompt_len": 64, "decode_tok_s": 127.2},
            {"what": "static-inertia", "prompt_len": 128, "decode_tok_s": 99.0}]  # another context: not read
    assert gpu_check.targets(rows, 64) == {
        "check": "targets", "prompt_len": 64, "inertia_tok_s": 156.4, "inertia_at_least_150": True,
        "scoring_eviction_share": 0.0225, "scoring_eviction_at_most_5_percent": True, "engine_kept_overlap": 1.0,
        "lazy_gain": 1.01, "lazy_gain_at_most_1.05": True, "vs_paper_39.1": 4.0, "fused_gain": 1.15,
        "blocked_gain": 1.23}


def run_script(name: str, args: list[str], monkeypatch, capsys) -> list[dict]:
    """A benchmark script's ``main`` in this process (its imports are this process's: no second torch start),
    its JSON lines."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", [f"{name}.py", *args])
    capsys.readouterr()
    assert script.main() == 0
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]


def test_the_weight_read_floor_script_times_every_layout_over_the_same_bytes(monkeypatch, capsys):
    """``benchmarks/gemv_floor.py`` on the CPU with the tiny config (how it is tried before a GPU): one row per
    layout, the stacked and the separate layouts reading the same weights (the tiny config's 3 layers of
    q/k/v/o/gate/up/down plus the 320 x 64 head, float32)."""
    lines = run_script("gemv_floor", ["--config", "tiny", "--device", "cpu", "--replays", "2"], monkeypatch, capsys)
    assert lines[0]["meta"]["layers"] == 3 and lines[0]["meta"]["dtype"] == "float32"
    rows = {line["layout"]: line for line in lines[1:]}
    assert list(rows) == ["separate", "fused", "fused-inductor"]  # no cuBLASLt on a CPU
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 2 * 128 * 64 + 64 * 128  # qkv (4x16 q, 2x16 k and v), o, gate_up, down
    weight_bytes = 4 * (3 * per_layer + 320 * 64)
    assert all(row["weight_bytes"] == weight_bytes and row["step_ms"] > 0 for row in rows.values())


def test_the_step_profile_counts_each_layers_products_and_what_fusing_removes(monkeypatch, capsys):
    """``benchmarks/step_profile.py`` on the CPU with the tiny config (3 layers): per static step each layer runs
    two batched products (logits, output) and one softmax, and RoPE's angles take one more batched product
    in some transformers releases (5.17) and none in others (5.24); stacking q/k/v and gate/up removes 3 of
    each layer's 7 projection products, 9 matrix products per step in all."""
    per_step = {}
    for fuse in ("--fuse", "--no-fuse"):  # each run builds its own model
        lines = run_script("step_profile", ["--config", "tiny", "--device", "cpu", "--context", "256",
                                            "--new-tokens", "10", fuse, "--top", "60"], monkeypatch, capsys)
        assert lines[0]["meta"]["static_steps"] == 8 and lines[0]["meta"]["fused"] == (fuse == "--fuse")
        profiled = next(line for line in lines if line.get("run") == "kernel by kernel, profiled")
        assert profiled["groups_ms_per_step"]["matrix products (cuBLAS/CUTLASS)"] > 0 and profiled["step_ms"] > 0
        per_step[fuse] = {line["kernel"]: line["per_step"] for line in lines if "kernel" in line}
    assert per_step["--fuse"]["aten::bmm"] == per_step["--no-fuse"]["aten::bmm"] in (2 * 3, 2 * 3 + 1)
    assert per_step["--fuse"]["aten::_softmax"] == 3
    assert per_step["--no-fuse"]["aten::mm"] - per_step["--fuse"]["aten::mm"] == 3 * 3


def test_the_value_block_script_times_each_block_against_one_product_over_padded_caches(monkeypatch, capsys):
    """``benchmarks/value_blocks.py`` on the CPU with the tiny config: per live slot count, block 0 first
    (its own baseline), then each block over a cache padded to whole blocks."""
    lines = run_script("value_blocks", ["--config", "tiny", "--device", "cpu", "--slots", "21,7", "--blocks", "0,4,8",
                                        "--replays", "2"], monkeypatch, capsys)
    assert lines[0]["meta"]["layers"] == 3 and lines[0]["meta"]["fp32_logits"] is False
    rows = {(line["slots"], line["block"]): line for line in lines[1:]}
    assert list(rows) == [(21, 0), (21, 4), (21, 8), (7, 0), (7, 4), (7, 8)]
    assert [rows[key]["padded"] for key in rows] == [21, 24, 24, 7, 8, 8]
    assert rows[(21, 0)]["vs_one_product"] == rows[(7, 0)]["vs_one_product"] == 1.0
    assert all(row["layer_us"] > 0 and row["vs_one_product"] > 0 for row in rows.values())
