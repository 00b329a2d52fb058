"""Hostile and careless trace files: each is refused from its sizes, quickly and with bounded memory, before
anything in it becomes Python objects (issue 44's files: millions of rows, a 20M-entry list, a text cell of
hundreds of MB, an oversized or deeply nested metadata, all a few KB of compressed parquet)."""

from __future__ import annotations

import gc
import json
import time

import gradio as gr
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvviz
from kvviz.trace import Trace, TraceBounds
from kvviz.ui import checks, live, traces
from kvviz.ui.config import Limits

TINY = "tiny-random-llama"
META = {"prompt_ids": list(range(1, 40)), "budget": 20, "policy": "inertia", "params": {}, "model": TINY}
# What one refusal may cost: the old reader took 600 MB to 4 GB and up to 76 s on these files.  A bound to
# catch that again, not a timing: a refusal from the footer takes milliseconds.
MAX_GROWTH = 150 * 2**20
MAX_SECONDS = 20


def rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(field)


def write(path, columns: dict, meta: dict | None = None, raw_meta: bytes | None = None):
    table = pa.table(columns)
    table = table.replace_schema_metadata({b"kvviz": raw_meta if raw_meta is not None else json.dumps(meta or META)})
    pq.write_table(table, path, compression="zstd")
    return path


def steps(n: int, **extra) -> dict:
    """``n`` well-formed empty steps (each keeps the first ten positions)."""
    return {"step": pa.array(np.arange(n)), "token_id": pa.array(np.full(n, 5)),
            "new_token_id": pa.array(np.full(n, 5)), "text": pa.array(["a"] * n, pa.large_string()),
            "kept": pa.array([list(range(10))] * n if n < 10_000 else
                             pa.ListArray.from_arrays(np.arange(0, 10 * n + 1, 10, dtype=np.int32),
                                                      np.tile(np.arange(10), n))),
            "evicted": pa.array([[]] * n, pa.list_(pa.int64())), "utility": pa.nulls(n, pa.list_(pa.float64())),
            "raw": pa.nulls(n, pa.list_(pa.float64())), "scored": pa.array(np.zeros(n, bool)),
            **{clock: pa.array(np.zeros(n)) for clock in ("t_forward", "t_score", "t_evict")},
            "cache_bytes": pa.array(np.zeros(n, np.int64)), **extra}


def hostile_files(tmp_path) -> dict:
    huge_text = "x" * (100 * 2**20)
    files = {
        "two million rows": write(tmp_path / "rows.parquet", steps(2_000_000)),
        "one 20M-entry list": write(tmp_path / "list.parquet", {
            **steps(1), "kept": pa.ListArray.from_arrays(np.array([0, 20_000_000], np.int32),
                                                          np.zeros(20_000_000, np.int64))}),
        "a 100 MB text cell": write(tmp_path / "text.parquet", {**steps(1), "text": pa.array([huge_text],
                                                                                          pa.large_string())}),
        "a 20 MB prompt in the metadata": write(tmp_path / "prompt.parquet", steps(2),
                                                meta={**META, "prompt": huge_text[:20 * 2**20]}),
        "a million prompt ids": write(tmp_path / "ids.parquet", steps(2),
                                      meta={**META, "prompt_ids": [7] * 1_000_000}),
        "parameters nested 100k deep": write(tmp_path / "deep.parquet", steps(2), raw_meta=(
            b'{"prompt_ids": [1], "budget": 1, "policy": "inertia", "params": ' + b"[" * 100_000 + b"]" * 100_000
            + b"}")),
        "a 300-term decision": write(tmp_path / "terms.parquet", {**steps(2), "components": pa.array(
            [{f"t{i}": [0.0] * 10 for i in range(300)}] * 2)}),
    }
    del huge_text
    gc.collect()
    return files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return hostile_files(tmp_path_factory.mktemp("hostile"))


LIMITS = Limits(models=(TINY,), max_prompt_tokens=4096, max_new_tokens=512)


def live_tab():
    """The Live tab's components, which the open handler returns its outputs by."""
    with gr.Blocks():
        return live.layout(LIMITS)


@pytest.mark.parametrize("what", ["two million rows", "one 20M-entry list", "a 100 MB text cell",
                                  "a 20 MB prompt in the metadata", "a million prompt ids",
                                  "parameters nested 100k deep", "a 300-term decision"])
def test_a_hostile_trace_is_refused_quickly_within_bounded_memory(files, what):
    path = str(files[what])
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:  # resets the peak (VmHWM) to the current size
        refs.write("5")
    before, start = rss(), time.monotonic()
    with pytest.raises(gr.Error) as refusal:  # the upload's check: the app's bounds
        traces.check_trace(path, LIMITS)
    elapsed, peak = time.monotonic() - start, rss("VmHWM")
    assert "failed" not in str(refusal.value) and len(str(refusal.value)) < 400  # a reason, not a crash
    assert elapsed < MAX_SECONDS and peak - before < MAX_GROWTH, (elapsed, (peak - before) / 2**20)
    with pytest.raises(gr.Error):  # the open handler, as an API call reaches it without the check
        traces.make_open_handler(LIMITS, live_tab())(path)
    gc.collect()
    assert rss() - before < MAX_GROWTH  # and the memory of the refused file is not kept


def test_the_library_reads_a_large_trace_it_refuses_in_the_app(files):
    """The bounds are the reader's: `kvviz trace FILE` of one's own long run reads what the app refuses."""
    with pytest.raises(ValueError, match="this app opens traces of up to 4096 prompt tokens and 512 steps"):
        Trace.load(files["a million prompt ids"], LIMITS.trace_bounds())
    with pytest.raises(ValueError, match="step text"):  # too long a text for any reader
        Trace.load(files["a 100 MB text cell"])


def test_bounds_admit_every_real_run_at_the_limits(tmp_path):
    """A run at exactly the limits opens: the bounds follow from the prompt and the steps, not a fixed size."""
    model, tokenizer = kvviz.load_model(TINY)
    prompt = tokenizer("word " * 60, add_special_tokens=False)["input_ids"]
    limits = Limits(models=(TINY,), max_prompt_tokens=len(prompt), max_new_tokens=30)
    for policy in ("full", "avokv", "tova"):
        trace = kvviz.run(model, tokenizer, prompt, policy, budget=50, max_new_tokens=31).trace
        trace.save(tmp_path / f"{policy}.parquet")
        opened = Trace.load(tmp_path / f"{policy}.parquet", limits.trace_bounds())
        assert [e.kept.tolist() for e in opened.events] == [e.kept.tolist() for e in trace.events]
        assert [None if e.utility is None else e.utility.tolist() for e in opened.events] == \
            [None if e.utility is None else e.utility.astype(np.float32).tolist() for e in trace.events]
        assert opened.token_ids == trace.token_ids and "".join(e.text for e in opened.events) == \
            "".join(e.text for e in trace.events)
    one_less = Limits(models=(TINY,), max_prompt_tokens=len(prompt) - 1, max_new_tokens=30)
    with pytest.raises(ValueError, match=f"has a {len(prompt)}-token prompt and 30 decode steps"):
        Trace.load(tmp_path / "full.parquet", one_less.trace_bounds())


def test_a_list_longer_than_its_step_allows_is_refused_from_the_buffers(tmp_path):
    """The footer's counts are the writer's word: a list longer than the prompt plus the steps so far is
    refused from arrow's buffers too, whatever the footer says in total."""
    columns = steps(3)
    columns["kept"] = pa.array([list(range(10)), list(range(10)), list(range(45))])  # 39 + 2 positions exist
    with pytest.raises(ValueError, match="more entries at a step than the prompt and the tokens so far"):
        Trace.load(write(tmp_path / "long.parquet", columns))


def test_opening_a_trace_loads_a_tokenizer_not_the_model(monkeypatch, tmp_path):
    """Traces open outside the models' queue: they need a tokenizer, never a model load."""
    model, tokenizer = kvviz.load_model(TINY)
    kvviz.run(model, tokenizer, "word " * 30, "tova", chat=False, budget=20, max_new_tokens=4).trace.save(
        tmp_path / "run.parquet")

    def no_load(*args):
        raise AssertionError("opening a trace loaded a model")

    monkeypatch.setattr(checks, "get_model", no_load)
    monkeypatch.setattr(checks, "_models", {})
    tab = live_tab()
    outputs = traces.make_open_handler(LIMITS, tab)(str(tmp_path / "run.parquet"))
    assert "opened" in outputs[tab.stats] and "shown as ids" not in outputs[tab.stats]
    assert TINY in checks._tokenizers
    assert TraceBounds().max_steps > LIMITS.max_new_tokens  # the library's own reader is not the app's
