"""The timed runs of ``kvviz bench speed``, one configuration each: plain ``generate``, an engine policy, the
static decode path and the static backend, and the untimed checks of what the static ones keep.

:func:`kvviz.bench.speed.measure` runs them, repeats them and makes their rows.
"""

from __future__ import annotations

import time

# torch is imported inside the functions that use it: `kvviz --help` imports this module through bench speed.


def _sync(device) -> None:
    import torch
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def replayed_seconds(step, device, replays: int) -> float:
    """Seconds per call of ``step`` (no arguments): on a GPU, one CUDA graph of it replayed ``replays`` times
    between two events (no launch gaps, as a decode step runs); elsewhere eager calls after one warm-up."""
    import torch
    if torch.device(device).type != "cuda":
        step()
        start = time.perf_counter()
        for _ in range(replays):
            step()
        return (time.perf_counter() - start) / replays
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (cuBLAS handles, compiled kernels) on the capture's stream
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / replays



class _TokenClock:
    """A ``generate`` streamer that timestamps tokens: the first ``put`` is the prompt, the next the first
    generated token (end of prefill), the rest one per decode step -- the same split the engine reports."""

    def __init__(self, device):
        self.device, self.stamps = device, []

    def put(self, value) -> None:
        _sync(self.device)
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def time_generate(model, prompt_ids: list[int], new_tokens: int, device) -> dict:
    """Plain ``model.generate`` with HF's default dynamic cache (the baseline), timed per token."""
    import torch
    ids = torch.tensor([prompt_ids], device=device)
    clock = _TokenClock(device)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       streamer=clock)
    _sync(device)
    first_token, end = clock.stamps[1], time.perf_counter()
    decode = end - first_token
    return {"prefill_s": first_token - start, "decode_s": decode, "decode_tok_s": (new_tokens - 1) / decode}


def time_static_full(model, tokenizer, prompt_ids: list[int], new_tokens: int, device, shared=None) -> dict:
    """The full cache on the static backend (:func:`time_backend` with a budget it never reaches): every prompt +
    new-token slot allocated at once, the unwritten ones masked, one step shape (one CUDA graph on a GPU) --
    the eviction rows' own step with the whole cache, the fair baseline for their speed."""
    result = time_backend(model, tokenizer, prompt_ids, "full", new_tokens, len(prompt_ids) + new_tokens, device,
                          False, shared=shared)
    return {**result, "final_cache": len(prompt_ids) + new_tokens - 1}  # the last token's key is never made


def time_engine(model, tokenizer, prompt_ids: list[int], policy_name: str, new_tokens: int, budget: int,
                device, shared=None) -> dict:
    from ..engine import decode
    from ..policies import make_policy

    policy = make_policy(policy_name)
    _sync(device)
    start = time.perf_counter()
    prefill_done, score, evict, steps = None, 0.0, 0.0, 0
    for event in decode(model, tokenizer, prompt_ids, policy, budget=None if policy_name == "full" else budget,
                        max_new_tokens=new_tokens, ignore_eos=True, shared=shared):
        if event.step == 0:
            _sync(device)
            prefill_done = time.perf_counter()
        else:
            score, evict, steps = score + event.t_score, evict + event.t_evict, steps + 1
    _sync(device)
    decode_s = time.perf_counter() - prefill_done
    return {"first_token_s": prefill_done - start, "decode_s": decode_s, "decode_tok_s": steps / decode_s,
            "score_share": score / decode_s, "evict_share": evict / decode_s,
            "final_cache": int(event.cache_size)}


# static-no-scoring: the B-slot step without scoring or an eviction choice (a ring), the baseline of every
# static row's scoring_eviction_share
STATIC = {"static-no-scoring": dict(scoring=False), "static-inertia": {}, "static-inertia-lazy": dict(refresh=4),
          "static-score-free": dict(refresh=0)}
# Measured again with one matrix-vector product per projection module (fuse=False), to show what stacking
# q/k/v and gate/up into one product each buys.
UNFUSED = ("static-no-scoring", "static-inertia")
# Measured again without compile, to show what it buys -- and the targets' rows if compiling fails, when they
# too run past the time limit.
UNCOMPILED = ("static-no-scoring", "static-inertia", "static-inertia-lazy")
# Measured again with the value product as one product over all slots (value_block=0), to show what blocks
# of slots buy; a GPU only, the one place the step runs in blocks by default.
UNBLOCKED = ("static-no-scoring", "static-inertia")
# Each such row's scoring_eviction_share is against its own baseline (static_baseline).
VARIANTS = ("-unfused", "-uncompiled", "-unblocked")


def time_static(model, tokenizer, prompt_ids: list[int], new_tokens: int, budget: int, device,
                options: dict, shared=None) -> dict:
    """The static decode path (:mod:`kvviz.fast`): B + 1 slots, scores from the attention pass, EMA and
    arg-min on the device, one CUDA graph per step variant on a GPU."""
    import torch

    from ..fast import StaticInertia

    static = StaticInertia(model, **options)  # outside the clock: importing the compiler is not prefill
    cuda = torch.device(device).type == "cuda"
    setup_peak: list[int] = []

    def on_ready() -> None:  # the B + 1 slots now hold the cache: the decode phase's peak counts from here
        if cuda:
            setup_peak.append(torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    _sync(device)
    start = time.perf_counter()
    run = static.generate(tokenizer, prompt_ids, budget, new_tokens, graph=True, timer=lambda: _sync(device),
                          shared=shared, on_ready=on_ready)
    _sync(device)
    end = time.perf_counter()
    decode_s = end - run.first_token_time
    setup_s = run.setup_seconds()
    # decode_tok_s is the steady state (setup steps out); with_setup_tok_s counts compile and capture too.
    result = {"first_token_s": run.first_token_time - start, "decode_s": decode_s, "setup_s": setup_s,
              "decode_tok_s": run.steady_tok_s(), "with_setup_tok_s": (new_tokens - 1) / decode_s}
    if setup_peak:  # absolute byte counts, made relative by measure()
        result["_setup_peak_bytes"], result["_decode_peak_bytes"] = setup_peak[0], torch.cuda.max_memory_allocated()
    return result


AGREEMENT_TOKENS = 6  # tokens of the untimed agreement run: four static steps after the engine's two


def static_agreement(model, tokenizer, prompt_ids: list[int], new_tokens: int, budget: int, options: dict,
                     shared=None) -> dict:
    """What the static step keeps at this shape, against the reference engine from the same shared prefill.

    Reading kept positions syncs with the device every step, so the timed runs cannot: this is an untimed
    run of the same step (eager, no graph) for up to ``AGREEMENT_TOKENS`` tokens, and the engine's run of the
    policy it computes (``recency`` for the step without scoring).  Returns ``final_cache`` (entries live
    after the last step), ``engine_tokens_equal`` and ``engine_kept_overlap`` (the share of the engine's
    kept positions the static step also keeps, at its last step): in float32 they agree exactly (the tests);
    in bfloat16 two attention kernels round differently, and this is how far that goes at the real shape.
    """
    from ..engine import decode
    from ..fast import StaticInertia

    tokens = min(new_tokens, AGREEMENT_TOKENS)
    path = StaticInertia(model, **{**options, "compile": False})
    static = path.generate(tokenizer, prompt_ids, budget, tokens, record_kept=True, shared=shared)
    events = list(decode(model, tokenizer, prompt_ids, path.reference_policy(), budget=budget, max_new_tokens=tokens,
                         ignore_eos=True, shared=shared))
    engine_kept = set(events[-1].kept.tolist())
    return {"final_cache": len(static.kept[-1]),
            "engine_tokens_equal": static.token_ids == [event.new_token_id for event in events],
            "engine_kept_overlap": len(set(static.kept[-1]) & engine_kept) / len(engine_kept)}


def time_backend(model, tokenizer, prompt_ids: list[int], policy_name: str, new_tokens: int, budget: int, device,
                 compile: bool, shared=None) -> dict:
    """A policy on the static backend (:mod:`kvviz.backend`): as :func:`time_static`, the policy's scorer asked
    for a per-slot utility beside the attention, the slot freed by a device reduction, CUDA graphs on a GPU."""
    import torch

    from ..backend.static import StaticBackend
    from ..policies import make_policy

    static = StaticBackend(model, make_policy(policy_name), compile=compile)
    _sync(device)
    start = time.perf_counter()
    run = static.generate(tokenizer, prompt_ids, budget, new_tokens, timer=lambda: _sync(device), shared=shared)
    _sync(device)
    decode_s = time.perf_counter() - run.first_token_time
    del static
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"first_token_s": run.first_token_time - start, "decode_s": decode_s, "setup_s": run.setup_seconds(),
            "decode_tok_s": run.steady_tok_s(), "with_setup_tok_s": (new_tokens - 1) / decode_s}


EVENT_READS_PER_SECOND = 10.0  # the app's default figures_per_second (KVVIZ_FIGURES_PER_SECOND)


def time_backend_events(model, tokenizer, prompt_ids: list[int], policy_name: str, new_tokens: int, budget: int,
                        device, shared=None) -> dict:
    """The backend's step events taken as the Live tab takes them: every step's event, the device read in
    blocks at the app's default frame rate (:meth:`~kvviz.backend.static.StaticBackend.stream`).  Its rate
    counts setup (capture) as the bare row's ``with_setup_tok_s`` does, to be read against that."""
    from ..backend.static import StaticBackend
    from ..policies import make_policy

    static = StaticBackend(model, make_policy(policy_name))
    _sync(device)
    start, first, events = time.perf_counter(), None, []
    for event in static.stream(tokenizer, prompt_ids, budget=budget, max_new_tokens=new_tokens, ignore_eos=True,
                               shared=shared, reads_per_second=EVENT_READS_PER_SECOND):
        first = first or time.perf_counter()
        events.append(event)
    decode_s = time.perf_counter() - first
    return {"first_token_s": first - start, "decode_s": decode_s, "decode_tok_s": (len(events) - 1) / decode_s,
            "final_cache": int(events[-1].cache_size), "reads_per_second": EVENT_READS_PER_SECOND}


def backend_agreement(model, tokenizer, prompt_ids: list[int], policy_name: str, new_tokens: int, budget: int,
                      shared=None) -> dict:
    """The backend's events against the engine's for up to ``AGREEMENT_TOKENS`` tokens (untimed), as
    :func:`static_agreement` reports them."""
    from ..backend.static import StaticBackend
    from ..engine import decode
    from ..policies import make_policy

    tokens = min(new_tokens, AGREEMENT_TOKENS)
    static = list(StaticBackend(model, make_policy(policy_name)).stream(
        tokenizer, prompt_ids, budget=budget, max_new_tokens=tokens, ignore_eos=True, shared=shared))
    events = list(decode(model, tokenizer, prompt_ids, make_policy(policy_name), budget=budget, max_new_tokens=tokens,
                         ignore_eos=True, shared=shared))
    engine_kept = set(events[-1].kept.tolist())
    return {"final_cache": int(static[-1].cache_size),
            "engine_tokens_equal": [e.new_token_id for e in static] == [e.new_token_id for e in events],
            "engine_kept_overlap": len(set(static[-1].kept.tolist()) & engine_kept) / len(engine_kept)}


def static_baseline(name: str) -> str:
    """The ring a static row's ``scoring_eviction_share`` is measured against: the same variant's."""
    return "static-no-scoring" + next((suffix for suffix in VARIANTS if name.endswith(suffix)), "")


def static_configurations(compile: bool, blocked: bool = False) -> dict[str, dict]:
    """The static rows: ``blocked`` (a GPU, where the value product runs in blocks) adds the unblocked ones."""
    configurations = {name: dict(options, compile=compile) for name, options in STATIC.items()}
    configurations.update({f"{name}-unfused": dict(STATIC[name], compile=compile, fuse=False) for name in UNFUSED})
    if blocked:
        configurations.update({f"{name}-unblocked": dict(STATIC[name], compile=compile, value_block=0)
                               for name in UNBLOCKED})
    if compile:
        configurations.update({f"{name}-uncompiled": dict(STATIC[name], compile=False) for name in UNCOMPILED})
    return configurations

