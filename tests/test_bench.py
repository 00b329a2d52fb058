"""The benchmark commands run end to end and print every row they promise (timings are not asserted); a bad
sweep config, rows file, output folder or shard is refused with one line before anything runs or is lost."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvviz
from kvviz.bench import sweep
from kvviz.cli import main

FIXTURES = Path(__file__).parent / "fixtures"


def test_speed_bench_prints_every_configuration(tmp_path, capsys):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "128", "--new-tokens", "6", "--repeats", "1",
                 "--compile", "on", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["meta"]["dtype"] == "float32"  # the CPU's default
    assert rows[1]["what"] == "prefill" and rows[1]["prefill_s"] > 0  # one prefill, shared by engine and static runs
    assert rows[-1]["what"] == "context done" and rows[-1]["seconds"] > 0
    rows = [rows[0], *rows[2:-1]]
    names = [row["what"] for row in rows[1:]]
    # The baseline, then the static path (a GPU run's targets), then the engine: the order rows are measured in.
    assert names == ["generate", "static-full-cache", "static-no-scoring", "static-inertia", "static-inertia-lazy",
                     "static-score-free", "static-no-scoring-unfused", "static-inertia-unfused",
                     "static-no-scoring-uncompiled", "static-inertia-uncompiled", "static-inertia-lazy-uncompiled",
                     "full", "inertia", "inertia-lazy", "score-free"]
    assert all(row["decode_tok_s"] > 0 for row in rows[1:])
    # Each rate against the generate row's, rounded to 3 places (from unrounded rates: half a unit of slack).
    generate = rows[1]
    assert all(abs(row["vs_generate"] - row["decode_tok_s"] / generate["decode_tok_s"]) <= 5e-4 + 1e-6
               for row in rows[1:])
    # 90% of a 128-token prompt: floor(12.8) = 12 entries, measured at the end of the engine and static runs.
    assert all(row["final_cache"] == row["budget"] == 12 for row in rows[1:]
               if row["what"] not in ("generate", "full", "static-full-cache"))
    # the full cache as a static step holds every token, as generate does, and no compile setting applies
    assert rows[2]["budget"] == 128 + 6 and rows[2]["final_cache"] == 128 + 5 and "compiled" not in rows[2]
    static = {row["what"]: row for row in rows[1:] if row["what"].startswith("static-") and row is not rows[2]}
    assert all(row["compiled"] == (not name.endswith("-uncompiled")) for name, row in static.items())
    # Compiling is setup, kept out of the steady-state rate; the uncompiled CPU step has none.
    assert static["static-no-scoring"]["setup_s"] > 0
    assert static["static-no-scoring"]["first_setup_s"] >= static["static-no-scoring"]["setup_s"]
    assert static["static-inertia-uncompiled"]["setup_s"] == 0
    assert all("scoring_eviction_share" in row for name, row in static.items()
               if not name.startswith("static-no-scoring"))
    # In float32 the static step keeps what the engine keeps at this shape, from the same shared prefill
    assert all(row["engine_tokens_equal"] and row["engine_kept_overlap"] == 1.0 for row in static.values())


def test_speed_bench_times_chosen_policies_prefill_time_ones_from_the_shared_prefill(tmp_path):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--policies", "inertia, kvzip,expected-attention", "--dtype", "bfloat16",
                 "--out", str(out)]) == 0
    rows = {row.get("what"): row for row in map(json.loads, out.read_text().splitlines())}
    assert rows[None]["meta"]["dtype"] == "bfloat16"  # as asked, on the CPU too
    assert [name for name in rows if name in ("inertia", "kvzip", "expected-attention", "full")] == \
        ["inertia", "kvzip", "expected-attention"]
    for name in ("kvzip", "expected-attention"):  # cut at prefill: B plus the 3 decoded tokens
        assert "error" not in rows[name] and rows[name]["final_cache"] == 12 + 3 and rows[name]["first_token_s"] > 0
    assert main(["bench", "speed", "--config", "tiny", "--policies", "inertia,magic"]) == 2


def test_bench_outputs_and_a_prompt_past_the_context_are_refused_in_one_line(tmp_path, capsys, monkeypatch):
    """An --out that cannot be written is refused before a model is built (not a traceback after the
    measurements); a prompt past the model's context (the tiny config's 8192) before anything is timed."""
    from kvviz.bench import speed

    def built(*args, **kwargs):
        raise AssertionError("a model was built")

    monkeypatch.setattr(speed, "build_from_config", built)
    monkeypatch.setattr("kvviz.models.load_model", built)
    (tmp_path / "rows.jsonl").mkdir()
    for command in (["speed", "--config", "tiny"], ["probe"]):
        for out, message in ((tmp_path / "rows.jsonl", "is a folder; give a file path such as"),
                             (tmp_path / "missing" / "x.jsonl", "does not exist; create it")):
            assert main(["bench", *command, "--out", str(out)]) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"kvviz: error: --out {str(out)!r}") and message in err and err.count("\n") == 1
    monkeypatch.undo()
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "9000", "--new-tokens", "4",
                 "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert "exceeds the model's context of 8192 tokens" in err and "lower --contexts or --new-tokens" in err


def test_a_sweep_out_that_is_a_file_is_refused(tmp_path, capsys, no_model):
    config = write_config(tmp_path / "c.toml")
    (tmp_path / "rows").write_text("")
    assert main(["bench", "run", str(config), "--out", str(tmp_path / "rows")]) == 2
    assert "is a file; a sweep writes a folder" in capsys.readouterr().err


def test_speed_bench_reports_what_the_static_path_kept_not_its_budget(tmp_path, monkeypatch):
    from kvviz import fast

    real = fast.StaticInertia.generate

    def leaky(self, *args, record_kept=False, **kwargs):  # a static step that keeps one entry too many
        run = real(self, *args, record_kept=record_kept, **kwargs)
        if record_kept:
            run.kept[-1] = [*run.kept[-1], -1]
        return run

    monkeypatch.setattr(fast.StaticInertia, "generate", leaky)
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--out", str(out)]) == 0
    rows = {row["what"]: row for row in map(json.loads, out.read_text().splitlines()[1:])}
    assert {name: row["final_cache"] for name, row in rows.items()
            if name.startswith("static-") and name != "static-full-cache"} == {
        "static-no-scoring": 13, "static-inertia": 13, "static-inertia-lazy": 13, "static-score-free": 13,
        "static-no-scoring-unfused": 13, "static-inertia-unfused": 13}
    assert rows["inertia"]["final_cache"] == 12  # the engine path is untouched


@pytest.mark.parametrize("args, message", [
    (["--contexts", "256"], "--contexts sets the prompt lengths of a --config model (random weights); for "
                            "SmolLM2-135M-Instruct give its prompt length with --prompt-tokens"),
    (["--config", "tiny", "--contexts", "256,abc"], "--contexts takes prompt lengths of at least 2 tokens, "
                                                    "comma-separated (e.g. 16384,32768), got 'abc' in '256,abc'"),
    (["--config", "tiny", "--contexts", "256", "--new-tokens", "1"], "--new-tokens must be at least 2"),
    (["--config", "tiny", "--contexts", "256", "--repeats", "0"], "--repeats must be at least 1"),
    (["--config", "tiny", "--contexts", "256", "--compression", "1"], "--compression must be in [0, 1)"),
    (["--prompt-tokens", "1"], "--prompt-tokens must be at least 2"),
    # a negative limit skipped every configuration after generate, with exit 0
    (["--time-limit", "-5"], "--time-limit must be seconds >= 0 (0: no limit), got -5"),
    (["--time-limit", "nan"], "--time-limit must be seconds >= 0"),
])
def test_speed_bench_refuses_what_it_would_ignore_or_fail_on_before_loading_a_model(args, message, capsys,
                                                                                  monkeypatch):
    from kvviz import models

    def loaded(*args, **kwargs):
        raise AssertionError("the model loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_model", loaded)
    assert main(["bench", "speed", *args]) == 2
    assert capsys.readouterr().err.startswith(f"kvviz: error: {message}")


def test_speed_bench_without_the_static_path_times_generate_and_the_named_policies(tmp_path):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "3", "--repeats", "1",
                 "--policies", "tova", "--no-static", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["what"] for row in rows] == ["prefill", "generate", "tova", "context done"]


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
    assert len(rows) == 2 * 12  # generate, the full cache's static step, 6 static rows (2 unfused), 4 engine policies
    failed = [row for row in rows if "error" in row]
    assert [row["what"] for row in failed] == ["static-inertia-lazy"] * 2
    assert failed[0]["error"] == "RuntimeError: capture failed" and "decode_tok_s" not in failed[0]
    assert all(row["decode_tok_s"] > 0 for row in rows if "error" not in row)


def test_speed_bench_names_the_error_a_failed_capture_masks_and_prints_where_it_failed(tmp_path, monkeypatch,
                                                                                       capsys):
    from kvviz.bench import speed

    def masked(*args, **kwargs):  # what torch.cuda.graph's exit does to an error raised inside the capture
        try:
            raise IndexError("index 7 is out of bounds")
        except IndexError:
            raise RuntimeError("operation failed due to a previous error during capture") from None

    def caused(*args, **kwargs):
        try:
            raise IndexError("index 7 is out of bounds")
        except IndexError as error:
            raise RuntimeError("capture failed") from error

    for function in (masked, caused):
        monkeypatch.setattr(speed, "time_static", function)
        out = tmp_path / "speed.jsonl"
        assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "3", "--repeats", "1",
                     "--compile", "off", "--policies", "full", "--out", str(out)]) == 0
        failed = [json.loads(line) for line in out.read_text().splitlines()[1:] if '"error"' in line]
        assert len(failed) == 6 and len({row["error"] for row in failed}) == 1  # every static row
        message = "operation failed due to a previous error during capture" if function is masked else "capture failed"
        # `from None` hides the context from the traceback, not from the error: it is still named
        assert failed[0]["error"] == f"RuntimeError: {message} (during: IndexError: index 7 is out of bounds)"
        err = capsys.readouterr().err
        assert err.count("Traceback") >= 6 and f"in {function.__name__}" in err


def test_a_cudnn_attention_failure_reruns_once_without_cudnn(monkeypatch):
    from kvviz.bench import speed

    enabled = {"cudnn": True}
    monkeypatch.setattr(torch.backends.cuda, "cudnn_sdp_enabled", lambda: enabled["cudnn"])
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: enabled.update(cudnn=on))
    calls = []

    cudnn_error = RuntimeError("cuDNN Frontend error: No valid execution plans built.")

    def run(error=cudnn_error):
        calls.append(enabled["cudnn"])
        if enabled["cudnn"]:
            raise error
        return {"decode_tok_s": 1.0}

    assert speed.without_cudnn_on_failure(run, cuda=True) == (
        {"decode_tok_s": 1.0}, "cuDNN attention disabled after: RuntimeError: cuDNN Frontend error: No valid "
                               "execution plans built.")
    assert calls == [True, False] and not enabled["cudnn"]
    assert speed.without_cudnn_on_failure(run, cuda=True) == ({"decode_tok_s": 1.0}, None)  # stays off
    # Not cuDNN's failure, not on CUDA, or cuDNN already off: the error stands, and nothing is rerun.
    for cuda, cudnn, error in ((True, True, RuntimeError("CUDA out of memory")),
                               (False, True, RuntimeError("cudnn error")), (True, False, RuntimeError("cudnn error"))):
        enabled["cudnn"], calls[:] = cudnn, []

        def failing(error=error):
            calls.append(1)
            raise error

        with pytest.raises(RuntimeError, match=str(error)):
            speed.without_cudnn_on_failure(failing, cuda=cuda)
        assert calls == [1] and enabled["cudnn"] == cudnn


def test_speed_bench_keeps_every_finished_row_when_killed_and_survives_a_failed_prefill(tmp_path, monkeypatch):
    from kvviz import engine
    from kvviz.bench import speed

    def killed(*args, **kwargs):  # the session's time runs out during the engine rows
        raise KeyboardInterrupt

    monkeypatch.setattr(speed, "time_engine", killed)
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--out", str(out)]) == 130
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["what"] for row in rows] == ["prefill", "generate", "static-full-cache", "static-no-scoring",
                                             "static-inertia", "static-inertia-lazy", "static-score-free",
                                             "static-no-scoring-unfused", "static-inertia-unfused"]
    assert all(row["decode_tok_s"] > 0 for row in rows[1:])

    monkeypatch.undo()
    real = engine.prefill

    def out_of_memory(model, prompt_ids, **kwargs):
        if len(prompt_ids) == 96:
            raise RuntimeError("CUDA out of memory")
        return real(model, prompt_ids, **kwargs)

    monkeypatch.setattr(engine, "prefill", out_of_memory)
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert rows[0] == {"what": "prefill", "prompt_len": 96, "error": "RuntimeError: CUDA out of memory"}
    assert rows[1]["what"] == "context done" and rows[2] == {**rows[2], "what": "prefill", "prompt_len": 128}
    assert sum(row.get("prompt_len") == 128 and row.get("decode_tok_s", 0) > 0 for row in rows) == 12


def test_speed_bench_stops_at_its_time_limit(tmp_path):
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--time-limit", "1e-9", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert {row["prompt_len"] for row in rows if row["what"] != "skipped"} == {96}  # the first context always starts
    assert [row for row in rows if row["what"] == "skipped"] == [
        {"what": "skipped", "prompt_len": 128, "why": "would not end within --time-limit 1e-09 s"}]
    # Within it, past the limit, only the rows issues 6's and 42's targets need run (generate, the full cache as
    # a static step, the static step without scoring, with full and with Lazy refresh); the others say so.
    first = [row for row in rows if row["prompt_len"] == 96 and row["what"] not in ("prefill", "context done")]
    assert [row["what"] for row in first[:5]] == ["generate", "static-full-cache", "static-no-scoring",
                                                  "static-inertia", "static-inertia-lazy"]
    assert all(row["decode_tok_s"] > 0 for row in first[:5])
    assert len(first) == 12 and all(row["skipped"] == "not started within --time-limit 1e-09 s"
                                    and "decode_tok_s" not in row for row in first[5:])
    # --no-static: generate alone
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "4", "--repeats", "1",
                 "--no-static", "--time-limit", "1e-9", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["what"] for row in rows if row.get("decode_tok_s", 0) > 0] == ["generate"]
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96,128", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--time-limit", "3600", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[1:]]
    assert [row["prompt_len"] for row in rows if row["what"] == "context done"] == [96, 128]


def test_a_row_that_fell_back_from_cudnn_keeps_its_note_and_the_others_their_rows(tmp_path, monkeypatch):
    """The decode-shape fallback's note is text in a row of numbers: it must come out as it is, not fail the
    rounding of that row (which ended the whole context)."""
    from kvviz.bench import speed

    monkeypatch.setattr(speed, "without_cudnn_on_failure", lambda run, cuda: (run(), "cuDNN attention disabled "
                                                                              "after: RuntimeError: cuDNN error"))
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "off", "--policies", "inertia", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()[2:-1]]
    assert [row["what"] for row in rows] == ["generate", "static-full-cache", "static-no-scoring", "static-inertia",
                                             "static-inertia-lazy", "static-score-free", "static-no-scoring-unfused",
                                             "static-inertia-unfused", "inertia"]
    assert all(row["sdpa_fallback"] == "cuDNN attention disabled after: RuntimeError: cuDNN error"
               and row["decode_tok_s"] > 0 for row in rows)


def test_once_the_compiled_step_fails_its_uncompiled_rows_stand_in_for_the_targets(tmp_path, monkeypatch):
    """A failed compile is not remembered: each compiled row would fail alike and spend its time doing so.
    The first failure stops the other compiled static rows, and the uncompiled ones -- the targets' rows
    now -- run past the time limit."""
    from kvviz import fast

    def broken():
        def layer_step(*args, **kwargs):
            raise RuntimeError("BackendCompilerFailed: no lowering")
        return layer_step

    monkeypatch.setattr(fast, "compiled_decode_layer", broken)
    out = tmp_path / "speed.jsonl"
    assert main(["bench", "speed", "--config", "tiny", "--contexts", "96", "--new-tokens", "4", "--repeats", "1",
                 "--compile", "on", "--time-limit", "1e-9", "--out", str(out)]) == 0
    rows = {row["what"]: row for row in map(json.loads, out.read_text().splitlines()[2:-1])}
    assert rows["static-no-scoring"]["error"].startswith("RuntimeError: BackendCompilerFailed: no lowering")
    for name in ("static-inertia", "static-inertia-lazy"):
        assert rows[name]["error"] == "not run: the compiled static step failed in static-no-scoring (see its row)"
    assert [name for name, row in rows.items() if row.get("decode_tok_s", 0) > 0] == [
        "generate", "static-full-cache", "static-no-scoring-uncompiled", "static-inertia-uncompiled",
        "static-inertia-lazy-uncompiled"]
    assert "scoring_eviction_share" in rows["static-inertia-uncompiled"]
    assert all("skipped" in rows[name] for name in ("static-score-free", "full", "inertia", "inertia-lazy",
                                                    "score-free"))


def test_probe_bench_compares_batched_with_one_at_a_time(tmp_path):
    out = tmp_path / "probe.jsonl"
    assert main(["bench", "probe", "--model", "tiny-random-llama", "--prompt-tokens", "120", "--step", "3",
                 "--sample", "6", "--future", "3", "--batch", "4", "--out", str(out)]) == 0
    meta, one, batched = [json.loads(line) for line in out.read_text().splitlines()]
    assert [one["what"], batched["what"]] == ["one at a time", "batched (4)"] and meta["meta"]["dtype"] == "float32"
    # Recompute the probe outside the bench: the prompt, its full-cache continuation from model.generate,
    # and the damage of each candidate removed on its own.
    from kvviz import load_model, probe
    from kvviz.bench.speed import haystack_prompt

    model, tokenizer = load_model("tiny-random-llama")
    prompt_ids = haystack_prompt(tokenizer, 120)
    with torch.inference_mode():
        continuation = model.generate(torch.tensor([prompt_ids]), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                      pad_token_id=0)[0].tolist()
    # Step 3 feeds position 122 (tokens 1 and 2 are cached before it): the decision is made on the cache
    # 0 .. 122, the candidates come from 0 .. 121, and the replay starts at 123.
    assert meta["meta"]["cache_len"] == 120 + 3
    candidates = meta["meta"]["candidate_positions"]
    assert len(candidates) == 6 == len(set(candidates)) and all(0 <= c < 122 for c in candidates)
    expected = probe.damage(model, continuation, 123, candidates, future=3, batch=1)
    assert np.allclose(one["damage"], expected, rtol=1e-5, atol=1e-7)
    assert np.allclose(batched["damage"], expected, rtol=1e-4, atol=1e-6)
    assert batched["max_abs_diff_vs_one_at_a_time"] == pytest.approx(
        np.abs(np.array(batched["damage"]) - expected).max(), abs=1e-6)
    # And what `kvviz probe --step 3 --sample 6` reports: the same candidates and the same damage.
    reported = probe.probe(model, tokenizer, prompt_ids, 3, sample=6, future=3, batch=1)
    assert reported.candidates.tolist() == candidates
    assert np.allclose(one["damage"], reported.damage, rtol=1e-5, atol=1e-7)


def test_probe_bench_refuses_counts_below_one_before_the_model_loads(capsys, monkeypatch):
    def built(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvviz.models.load_model", built)
    for option in ("--step", "--future", "--batch", "--sample", "--prompt-tokens"):
        for value in ("0", "-3"):
            assert main(["bench", "probe", option, value]) == 2
            err = capsys.readouterr().err
            assert err == f"kvviz: error: {option} must be >= 1, got {value}\n"
    # several at once: the first is named, still in one line and not a traceback
    assert main(["bench", "probe", "--step", "-3", "--future", "0", "--batch", "0"]) == 2
    assert capsys.readouterr().err == "kvviz: error: --step must be >= 1, got -3\n"


def built_haystack(*args, **kwargs):
    raise AssertionError("the haystack was built: past the context, that takes minutes before the refusal")


def test_speed_bench_refuses_a_prompt_past_the_context_before_building_it(capsys, monkeypatch):
    monkeypatch.setattr("kvviz.bench.speed.haystack_prompt", built_haystack)
    assert main(["bench", "speed", "--model", "tiny-random-llama", "--prompt-tokens", "100000"]) == 2
    assert capsys.readouterr().err == (
        "kvviz: error: prompt (100000 tokens) + max_new_tokens (64) exceeds the model's context of 4096 tokens; "
        "shorten the prompt or generate fewer tokens (here: lower --prompt-tokens or --new-tokens)\n")


def test_probe_bench_refuses_a_sample_past_the_prefix_or_a_probe_past_the_context_before_decoding(capsys,
                                                                                                  monkeypatch):
    def decoded(*args, **kwargs):
        raise AssertionError("the probe decoded")

    monkeypatch.setattr("kvviz.engine.decode", decoded)
    # 10 prompt tokens + 1 generated before step 2: 11 entries to draw candidates from
    assert main(["bench", "probe", "--model", "tiny-random-llama", "--prompt-tokens", "10", "--step", "2",
                 "--sample", "12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvviz: error: --sample 12 is more than the 11 entries cached at --step 2 (10 prompt "
                          "tokens + 1 generated); choose --sample 11 or less") and err.count("\n") == 1
    # The tiny model's context is 4096: step 8 and 8 future tokens after 4090 prompt tokens pass it.
    monkeypatch.setattr("kvviz.bench.speed.haystack_prompt", built_haystack)
    assert main(["bench", "probe", "--model", "tiny-random-llama", "--prompt-tokens", "4090"]) == 2
    err = capsys.readouterr().err
    assert err == ("kvviz: error: probing --step 8 decodes 16 tokens after this 4090-token prompt, beyond the "
                   "model's context of 4096; lower --future to 5 or less (with --step 1), or use a shorter prompt "
                   "(the prompt's length is --prompt-tokens)\n")


# ------------------------------------------------------------------------------------------- bench run (sweep)

BASE = {"name": '"t"', "model": '"tiny-random-llama"', "max_new_tokens": "3", "compression": "[0.5]",
        "tasks": '[{ name = "single_needle", length = 220, samples = 1 }]', "policies": '["tova"]'}


def write_config(path: Path, **keys: str) -> Path:
    path.write_text("".join(f"{key} = {value}\n" for key, value in {**BASE, **keys}.items()))
    return path


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: a bad config must be refused before."""
    def load_model(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr("kvviz.models.load_model", load_model)


@pytest.mark.parametrize("key, value, message", [
    ("compression", "0.5", "key 'compression': must be a list of ratios in [0, 1)"),
    ("compression", "[0.5, 1.0]", "key 'compression': each ratio must be in [0, 1), got 1.0"),
    ("tasks", '"x"', "key 'tasks': must be a list of tables"),
    ("tasks", '[{ name = "single_needle", length = 100 }]', "tasks[0] (single_needle): has no 'samples'; add samples"),
    ("tasks", '[{ name = "single_needle", samples = 1 }]', "tasks[0] (single_needle): has no 'length'; add length"),
    ("tasks", '[{ name = "single_needle", length = 220, samples = 1, colour = "red" }]',
     "tasks[0] (single_needle): unknown key 'colour'; single_needle takes name, label, length, samples, haystack"),
    ("tasks", '[{ name = "single_needle", length = 220, samples = 1, haystack = "hay" }]',
     "tasks[0] (single_needle): haystack must be one of noise, prose"),
    ("tasks", '[{ name = "needle_grid", depths = [0.5] }]', "tasks[0] (needle_grid): lengths must be a non-empty list"),
    ("tasks", '[{ name = "single_needl", length = 220, samples = 1 }]', "tasks[0] (single_needl): unknown task"),
    ("tasks", '[{ name = "single_needle", length = 1, samples = 1 }]',
     "tasks[0] (single_needle): compression 0.5 leaves no cache for a 1-token prompt"),
    ("tasks", '[{ name = "single_needle", length = 220, samples = 1, chat = false }]',
     "tasks[0] (single_needle): chat is the sweep's setting, not a task's: set chat = false at the top"),
    ("name", '"../../etc"', "key 'name': '../../etc' must be a plain folder name"),
    ("policies", '[{ params = { alpha = 0.5 } }]', "policies[0]: has no name"),
    ("policies", '[{ name = "inertia", params = 3 }]', "policies[0] (inertia): params must be a table"),
    ("policies", '[{ name = "inertia", params = { alpha = ["x"] } }]',
     "policies[0] (inertia): params alpha = 'x' must be a number"),
    ("policies", '[{ name = "inertia", params = { alpha = [0.5, 2.0] } }]',
     "policies[0] (inertia): params {'alpha': 2.0} are refused"),
    ("policies", '[{ name = "inertia-lazy", params = { refresh = 2.0 } }]',
     "policies[0] (inertia-lazy): params refresh = 2.0 must be a whole number"),
    ("policies", '["tovaa"]', "policies[0]: unknown policy 'tovaa'; choose one of full, inertia"),
    ("policies", '["tova", "tova"]', "policies[1]: repeats the setting of policies[0] (tova)"),
    # Two spellings of one setting would run it twice and store one row: the store names both single-step.
    ("policies", '["single-step", { name = "inertia", params = { alpha = [0.5, 0.0] } }]',
     "policies[1] (inertia): repeats the setting of policies[0] spelt another way: inertia alpha = 0.0 and "
     "single-step are both single-step"),
    ("policies", '["inertia", { name = "inertia", params = { alpha = 0.8 } }]',
     "policies[1] (inertia): repeats the setting of policies[0] spelt another way: inertia alpha = 0.8 and "
     "inertia are both inertia"),
    ("max_new_token", "3", "key 'max_new_token': not a sweep setting"),
    ("dtype", '"fp16"', "key 'dtype': must be one of float32, bfloat16, float16, got 'fp16'"),
    ("policies", '[{ name = "snapkv", compression = 0.5 }]',
     "policies[0] (snapkv) compression: must be a list of ratios in [0, 1)"),
    ("policies", '[{ name = "snapkv", colour = "red" }]',
     "policies[0] (snapkv): unknown key 'colour'; a policy table has name, params and compression"),
    # 100 tokens at ρ = 0.5: budget 50, not above a SnapKV window of 64
    ("policies", '[{ name = "snapkv", params = { window = 128 } }]',
     "1 policy × task × compression cell(s) cannot run: snapkv window = 128 at compression 0.5 on single_needle "
     "(220 tokens, budget 110): budget 110 must exceed SnapKV's observation window of 128 tokens: raise the budget "
     "above 128 (or lower window). In the config: "
     "change such a policy's params, or, where its budget is too small, give it its own compressions"),
])
def test_a_malformed_sweep_config_is_refused_in_one_line_before_a_model_loads(tmp_path, capsys, no_model, key,
                                                                               value, message):
    config = write_config(tmp_path / "bad.toml", **{key: value})
    for extra in ([], ["--status"]):
        assert main(["bench", "run", str(config), "--out", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvviz: error: sweep config {config}: {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_sweep_loads_its_model_in_the_configs_dtype_and_records_it(tmp_path):
    config = write_config(tmp_path / "bf16.toml", dtype='"bfloat16"')
    assert main(["bench", "run", str(config), "--out", str(tmp_path / "out")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "rows.jsonl").read_text().splitlines()]
    assert [row["policy"] for row in rows] == ["tova"] and rows[0]["dtype"] == "bfloat16"


def test_a_policy_runs_at_its_own_compressions_where_the_sweeps_would_refuse_it(tmp_path, tiny):
    """A policy table's own compression list replaces the sweep's for that policy only; every cell it leaves
    out is listed, before a model loads, when it is missing."""
    model, tokenizer = tiny
    config = {"name": "t", "max_new_tokens": 3, "compression": [0.5, 0.9],
              "tasks": [{"name": "single_needle", "length": 220, "samples": 1}],
              "policies": ["full", "tova", {"name": "avokv", "params": {"interval": 4}}]}
    # budget 110 holds AvoKV-E's 32-entry tail and 4 sinks; budget 22 does not
    with pytest.raises(ValueError, match=r"1 policy × task × compression cell\(s\) cannot run: avokv interval = 4 "
                                         r"at compression 0.9 on single_needle \(220 tokens, budget 22\): budget 22 "
                                         r"must exceed the 36 entries AvoKV-E"):
        sweep.validate(config)
    config["policies"][2]["compression"] = [0.1, 0.5]
    assert [(c.policy, c.compression) for c in sweep.cells(config)] == [
        ("full", 0.5), ("tova", 0.5), ("tova", 0.9), ("avokv", 0.1), ("avokv", 0.5)]
    assert sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 5
    stored = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [(r["policy"], r["compression"]) for r in stored][-2:] == [("avokv", 0.1), ("avokv", 0.5)]
    assert [r["budget"] for r in stored][-2:] == [int(0.9 * stored[0]["prompt_len"]), stored[0]["prompt_len"] // 2]


def test_a_benchmark_prompt_too_short_for_a_policys_budget_is_refused_before_its_cells_decode(tmp_path, tiny):
    """A benchmark record's length is known only at run time: a cell whose budget the policy refuses stops
    the sweep before that sample decodes, naming the sample, the cell and the fix; stored rows stay."""
    model, tokenizer = tiny
    out = tmp_path / "out"
    good = {"name": "t", "max_new_tokens": 3, "compression": [0.5], "policies": ["tova"],
            "tasks": [{"name": "single_needle", "length": 400, "samples": 1}]}
    assert sweep.run(good, out, model=model, tokenizer=tokenizer, progress=False) == 1
    stored = (out / "rows.jsonl").read_bytes()
    # window 100: within the needle's budget of 200, beyond a short math500 prompt's
    bench = {**good, "policies": ["tova", {"name": "snapkv", "params": {"window": 100}}],
             "tasks": [*good["tasks"], {"name": "math500", "path": str(FIXTURES / "math500.jsonl"), "samples": 1}]}
    sweep.validate(bench)  # nothing to judge before the record is read
    with pytest.raises(ValueError, match=r"1 policy × task × compression cell\(s\) cannot run on this model: snapkv "
                                         r"window = 100 at compression 0.5 on math500 \(1 sample\(s\), first sample 0: "
                                         r"\d+ tokens, budget \d+: budget \d+ must exceed SnapKV's observation window "
                                         r"of 100 tokens: raise the budget above 100 \(or lower window\)\). In the "
                                         r"config: change such a policy's params"):
        sweep.run(bench, out, model=model, tokenizer=tokenizer, progress=False)
    assert (out / "rows.jsonl").read_bytes().startswith(stored)
    assert {json.loads(line)["task"] for line in (out / "rows.jsonl").read_text().splitlines()} == {"single_needle"}


def test_every_cell_is_judged_on_its_real_prompt_and_model_before_anything_decodes(tmp_path, tiny):
    """validate() judges nominal lengths without a model; the run judges the real prompts (shorter without
    the chat template) and the loaded model's layers, for every cell, before the first one decodes."""
    model, tokenizer = tiny
    config = {"name": "t", "max_new_tokens": 3, "compression": [0.5], "chat": False,
              "tasks": [{"name": "single_needle", "length": 200, "samples": 2}],
              "policies": ["tova", {"name": "snapkv", "params": {"window": 99}},
                           {"name": "inertia", "params": {"layers": "40"}}]}
    sweep.validate(config)  # nominal: budget 100 holds a 99-token window; no model, no layer count
    with pytest.raises(ValueError, match=r"2 policy × task × compression cell\(s\) cannot run on this model: snapkv "
                                         r"window = 99 at compression 0.5 on single_needle \(2 sample\(s\), first "
                                         r"sample 0: \d+ tokens, budget \d+: budget \d+ must exceed SnapKV's "
                                         r"observation window of 99 tokens: .*\); "
                                         r"inertia layers = '40' .*names a layer beyond this model's"):
        sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False)
    assert not (tmp_path / "rows.jsonl").exists() or not (tmp_path / "rows.jsonl").read_bytes()  # nothing decoded


def test_an_unreadable_sweep_config_names_the_file(tmp_path, capsys, no_model):
    broken = tmp_path / "broken.toml"
    broken.write_text('name = "t"\ncompression = [0.5\n')
    assert main(["bench", "run", str(broken)]) == 2
    assert capsys.readouterr().err.startswith(f"kvviz: error: sweep config {broken} is not valid TOML: ")
    assert main(["bench", "run", str(tmp_path / "missing.toml")]) == 2
    assert capsys.readouterr().err.startswith(f"kvviz: error: cannot read sweep config {tmp_path / 'missing.toml'}")


def test_a_length_beyond_the_models_context_is_refused_before_decoding(tmp_path, tiny):
    model, tokenizer = tiny  # 4096 positions
    # Known from a config.json on disk: refused while reading the config.
    model.config.save_pretrained(tmp_path / "model")
    config = write_config(tmp_path / "long.toml", model=f'"{tmp_path / "model"}"', max_new_tokens="6",
                          tasks='[{ name = "single_needle", length = 4300, samples = 1 }]')
    with pytest.raises(ValueError, match=r"long\.toml: tasks\[0\] \(single_needle\): length 4300 \+ max_new_tokens 6 "
                                         r"exceeds the context of .* \(4096 tokens\); lower length to at most 4090"):
        sweep.load_config(config)
    # Known only from the loaded model: refused before the first cell, rows already stored kept as they were.
    out = tmp_path / "out"
    good = {"name": "t", "max_new_tokens": 6, "compression": [0.5], "policies": ["tova"],
            "tasks": [{"name": "single_needle", "length": 220, "samples": 1}]}
    assert sweep.run(good, out, model=model, tokenizer=tokenizer, progress=False) == 1
    stored = (out / "rows.jsonl").read_bytes()
    for length in (4300, 100000):
        long = {**good, "tasks": [*good["tasks"], {"name": "single_needle", "label": "long", "length": length,
                                                   "samples": 1}]}
        with pytest.raises(ValueError, match=f"length {length} \\+ max_new_tokens 6 exceeds .* lower length to at "
                                             "most 4090"):
            sweep.run(long, out, model=model, tokenizer=tokenizer, progress=False)
        assert (out / "rows.jsonl").read_bytes() == stored
    # A benchmark prompt's length is known only once it is read: refused before its cells decode.
    bench = {**good, "max_new_tokens": 4090,
             "tasks": [{"name": "math500", "path": str(FIXTURES / "math500.jsonl"), "samples": 1}]}
    with pytest.raises(ValueError, match=r"math500 sample 0: prompt \(\d+ tokens\) \+ max_new_tokens \(4090\) exceeds "
                                         r"the model's context of 4096 tokens"):
        sweep.run(bench, out, model=model, tokenizer=tokenizer, progress=False)
    assert (out / "rows.jsonl").read_bytes() == stored


def test_resuming_with_a_different_config_is_refused_and_the_store_is_untouched(tmp_path, capsys):
    out = tmp_path / "out"
    first = write_config(tmp_path / "first.toml")
    assert main(["bench", "run", str(first), "--out", str(out)]) == 0
    capsys.readouterr()
    stored = {p.name: p.read_bytes() for p in out.iterdir()}
    assert sorted(stored) == ["config.toml", "rows.jsonl"] and stored["config.toml"] == first.read_bytes()
    other = write_config(tmp_path / "other.toml", tasks='[{ name = "single_needle", length = 240, samples = 1 }]')
    for status in ([], ["--status"]):  # --status too: another config's counts would mean nothing
        assert main(["bench", "run", str(other), "--out", str(out), *status]) == 2
        assert capsys.readouterr().err == (f"kvviz: error: {out} holds rows of a different config "
                                           f"({out / 'config.toml'} differs in tasks); pass --out with a new folder, "
                                           f"or resume with {out / 'config.toml'}\n")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == stored
    # The same config (spelled differently) resumes: nothing left to do.
    same = tmp_path / "same.toml"
    same.write_text("# a comment\n" + first.read_text().replace("[0.5]", "[ 0.5 ]"))
    assert main(["bench", "run", str(same), "--out", str(out)]) == 0
    assert capsys.readouterr().out == f"0 new rows in {out}\n"


def test_raising_samples_grows_a_finished_sweep_to_the_rows_of_a_fresh_run(tmp_path, capsys):
    """More samples of the same tasks is the same experiment extended: the stored rows stay as they are, the
    new samples' rows are those a fresh run of the larger config writes, and fewer samples is refused."""
    small = write_config(tmp_path / "small.toml", tasks='[{ name = "single_needle", length = 220, samples = 1 }]')
    large = write_config(tmp_path / "large.toml", tasks='[{ name = "single_needle", length = 220, samples = 3 }]')
    grown, fresh = tmp_path / "grown", tmp_path / "fresh"
    assert main(["bench", "run", str(small), "--out", str(grown)]) == 0
    first = (grown / "rows.jsonl").read_text()
    assert main(["bench", "run", str(large), "--out", str(grown)]) == 0
    assert main(["bench", "run", str(large), "--out", str(fresh)]) == 0
    capsys.readouterr()
    assert (grown / "rows.jsonl").read_text().startswith(first)
    assert (grown / "config.toml").read_bytes() == large.read_bytes()

    def measured(folder):  # what a cell measured, not when or how fast
        rows = [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]
        return sorted((row["cell"], row["score"], row["prediction"], row["max_cache"], row["meta"]) for row in rows)

    assert {json.loads(line)["sample"] for line in (grown / "rows.jsonl").read_text().splitlines()} == {0, 1, 2}
    assert measured(grown) == measured(fresh)
    stored = (grown / "rows.jsonl").read_bytes()
    assert main(["bench", "run", str(small), "--out", str(grown)]) == 2
    assert "holds rows of a different config" in capsys.readouterr().err
    assert (grown / "rows.jsonl").read_bytes() == stored


@pytest.mark.parametrize("change, grows", [
    ({}, True),
    ({"tasks": [{"name": "single_needle", "length": 220, "samples": 5}]}, True),
    ({"tasks": [{"name": "single_needle", "length": 220, "samples": 1}]}, False),  # fewer
    ({"tasks": [{"name": "single_needle", "length": 240, "samples": 5}]}, False),  # another prompt length
    ({"tasks": [{"name": "single_needle", "length": 220, "samples": 2},
                {"name": "single_needle", "length": 240, "samples": 1}]}, False),  # another task
    ({"tasks": [{"name": "single_needle", "length": 220, "samples": 5, "label": "x"}]}, False),
    ({"max_new_tokens": 4}, False),
    ({"seed": 1}, False),  # a key the first config left to its default
])
def test_grown_allows_only_more_samples_of_the_same_tasks(change, grows):
    previous = {"name": "t", "max_new_tokens": 3, "tasks": [{"name": "single_needle", "length": 220, "samples": 2}]}
    assert sweep.grown(previous, {**previous, **change}) is grows


@pytest.mark.parametrize("flags, message", [
    (["--shards", "-1"], "--shards must be at least 1, got -1"),
    (["--shards", "0"], "--shards must be at least 1, got 0"),
    (["--shard", "5", "--shards", "2"], "--shard 5 is not one of 2 shard(s); use --shard 0 to 1"),
    (["--shard", "-1", "--shards", "2"], "--shard -1 is not one of 2 shard(s); use --shard 0 to 1"),
    # silently ignored before: ray runs every shard, and only ray joins a cluster
    (["--backend", "ray", "--shards", "2", "--shard", "1"], "--backend ray runs every sample as its own task on "
                                                            "the cluster: drop --shards and --shard"),
    (["--backend", "ray", "--shards", "2"], "--backend ray runs every sample as its own task on the cluster: drop "
                                            "--shards and --shard"),
    (["--ray-address", "10.0.0.1:6379"], "--ray-address applies to --backend ray only; add --backend ray or drop "
                                         "--ray-address"),
])
def test_a_shard_that_does_not_exist_is_refused(tmp_path, capsys, no_model, flags, message):
    config = write_config(tmp_path / "c.toml")
    assert main(["bench", "run", str(config), "--out", str(tmp_path / "out"), *flags]) == 2
    assert capsys.readouterr().err == f"kvviz: error: {message}\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("line, problem", [
    ("garbage", "line 2 is not a JSON row (Expecting value: line 1 column 1 (char 0)); repair or delete that line"),
    ('{"task": "t"}', 'line 2 has no "cell" key, so it is not a sweep row; repair or delete that line'),
])
def test_a_bad_line_in_the_rows_names_the_file_and_changes_nothing(tmp_path, capsys, line, problem):
    out = tmp_path / "out"
    config = write_config(tmp_path / "c.toml")
    assert main(["bench", "run", str(config), "--out", str(out)]) == 0
    capsys.readouterr()
    rows = out / "rows.jsonl"
    # a bad complete line, then a torn one: neither is dropped while the file is refused
    damaged = rows.read_bytes() + line.encode() + b"\n" + b'{"cell": "half'
    rows.write_bytes(damaged)
    for extra in ([], ["--status"]):
        assert main(["bench", "run", str(config), "--out", str(out), *extra]) == 2
        assert capsys.readouterr().err == f"kvviz: error: {rows} {problem}\n"
        assert rows.read_bytes() == damaged


def test_a_checkpointed_cell_that_would_reach_no_checkpoint_is_refused_before_anything_decodes(tmp_path, tiny):
    """AvoKV-E at B = 64 on a 156-token prompt with 6 new tokens: its first checkpoint (once the cache passes
    B + 127) would come at step 36, after the last decode step (5), and the row would be the full cache's under
    AvoKV-E's name.  The sweep refuses it, saying what would reach one; with interval 4, the first checkpoint is
    at step 1 and it runs."""
    model, tokenizer = tiny
    config = {"name": "t", "max_new_tokens": 6, "budget": [64], "policies": ["avokv", "tova"],
              "tasks": [{"name": "arithmetic_reasoning", "samples": 1}]}
    prompt_len = len(kvviz.engine.encode_prompt(tokenizer, sweep.make_sample(
        config["tasks"][0], tokenizer, 0, 0, True).prompt, chat=True))
    first = 64 + 127 - prompt_len + 1  # the cache holds prompt_len + k at step k: over 64 + 127 from this step
    with pytest.raises(ValueError, match=rf"avokv at budget 64 on arithmetic_reasoning \(1 sample\(s\), first sample "
                                         rf"0: {prompt_len} tokens, budget 64: its first checkpoint would be at step "
                                         rf"{first}, after the last decode step \(5\), so nothing would be decoded "
                                         rf"from a cache it cut and the row would be the full cache's: raise "
                                         rf"max_new_tokens to at least {first + 2}, or lower its interval\)"):
        sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False)
    assert not (tmp_path / "rows.jsonl").exists() or not (tmp_path / "rows.jsonl").read_text()
    config["policies"][0] = {"name": "avokv", "params": {"interval": 4}}
    assert sweep.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 2  # avokv, tova


def test_on_a_gpu_the_static_rows_add_the_value_product_as_one_product():
    """The ``-unblocked`` rows exist where the step runs its value product in blocks by default (a GPU): the
    same configurations with ``value_block=0``, compiled alike, each against its own no-scoring baseline."""
    from kvviz.bench.speed import STATIC, static_baseline, static_configurations

    on_cpu, on_gpu = static_configurations(True), static_configurations(True, blocked=True)
    assert not any(name.endswith("-unblocked") for name in on_cpu)
    added = {name: options for name, options in on_gpu.items() if name not in on_cpu}
    assert added == {"static-no-scoring-unblocked": dict(STATIC["static-no-scoring"], compile=True, value_block=0),
                     "static-inertia-unblocked": dict(compile=True, value_block=0)}
    assert static_baseline("static-inertia-unblocked") == "static-no-scoring-unblocked"
    assert static_baseline("static-inertia-lazy-uncompiled") == "static-no-scoring-uncompiled"
    assert static_baseline("static-inertia") == "static-no-scoring"
