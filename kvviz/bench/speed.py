"""``kvviz bench speed``: decode speed of plain ``model.generate`` vs the engine's policies, in one run.

CPU default: the default model, a ~2k-token prompt, 64 new tokens, 90% compression.  With ``--config``
the model is built from a config with random weights (``llama-3.1-8b``, ``qwen2.5-7b``, or ``tiny`` to try
the script quickly) and the prompt is random token ids at each ``--contexts`` length; this is the mode for
a GPU machine, which cannot download weights.

Every figure is measured in the same process and reported next to the ``generate`` baseline as a ratio.
Each configuration runs ``--repeats`` times, interleaved, and the best run is kept (least disturbed).
The prompt is prefilled once (the ``prefill`` row) and every engine and static run starts from a copy of
it; ``generate`` prefills on its own, and so does Expected Attention where its reading of every prompt query
would make the shared prefill record more than ``engine.SHARED_QUERIES_BYTES`` of queries.
``first_token_s`` is a run's time to its first token from that copy (from its own prefill for those),
``peak_memory_gb`` (CUDA) its peak beyond the resident shared prefill (model weights included);
for the static path ``decode_peak_memory_gb`` is the same once its B + 1 slots have replaced the
prompt-sized cache of step 1 (which alone sets ``peak_memory_gb`` at long contexts).
Rows come out as their configurations finish -- ``generate``, the static path, then the engine policies --
so that a run stopped by a time limit or killed keeps what it measured, the GPU targets first (with
``--repeats`` above 1, as each configuration finishes its last repeat).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from collections.abc import Iterator
from datetime import datetime, timezone

# torch is imported inside the functions that use it: `kvviz --help` reads add_arguments and should
# not wait seconds for it.

CONFIGS = {
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rope_theta=500000.0, max_position_embeddings=131072),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       rope_theta=1000000.0, max_position_embeddings=131072, sliding_window=None),
    "tiny": dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=8192),
}
POLICIES = ("full", "inertia", "inertia-lazy", "score-free")
CONTEXTS = "16384,32768,65536"


def add_arguments(parser) -> None:
    from ..model_names import DEFAULT_MODEL, DTYPES

    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local path (default: %(default)s)")
    parser.add_argument("--config", choices=sorted(CONFIGS), help="random-weight model built from a config")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="prompt length in tokens of --model's haystack prompt (without --config; default: "
                             "%(default)s)")
    parser.add_argument("--contexts", default=CONTEXTS, help="prompt lengths with --config (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens decoded per run (default: %(default)s)")
    parser.add_argument("--compression", type=float, default=0.9,
                        help="rho in [0, 1), the share of the prompt's cache evicted: B = floor((1 - rho) x prompt "
                             "length) (default: %(default)s)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="engine policies to time, comma-separated (default: %(default)s); a prefill-time "
                             "one's first_token_s is its cost beyond the shared prefill (e.g. kvzip's extra pass)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each configuration, interleaved; the best is kept (default: %(default)s)")
    parser.add_argument("--static", action=argparse.BooleanOptionalAction, default=True,
                        help="time the static decode path too (B slots, InertiaKV computed beside the attention; "
                             "the GPU targets; default): --no-static times generate and the --policies rows only")
    parser.add_argument("--backend-policies", default="",
                        help="policies to time on the static backend (kvviz.backend: any every-step policy over B + 1 "
                             "slots), comma-separated, one backend-<name> row each (default: none), e.g. "
                             "inertia,tova,h2o,knorm,streaming")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="static path through torch.compile (auto: on a GPU; there, uncompiled rows are added; "
                             "default: %(default)s)")
    parser.add_argument("--time-limit", type=float, default=0.0,
                        help="seconds for the whole run, the model's build included: a context that would end after "
                             "it (judged by the last one's duration) is skipped, and past it no configuration "
                             "starts but generate and the static rows issue 6's targets need; the first context "
                             "always starts (default: 0, no limit)")
    parser.add_argument("--out", help="also write the JSON lines to this file")


def error_text(error: BaseException) -> str:
    """A failed configuration's row text, its traceback on stderr (the row alone would not say where).

    An error inside a CUDA-graph capture surfaces as the capture's own failure ("operation failed due to
    a previous error during capture"); the error that caused it is the context, so it goes in too."""
    traceback.print_exc(file=sys.stderr)
    text = f"{type(error).__name__}: {str(error)[:500]}"
    cause = error.__cause__ or error.__context__
    if cause is not None:
        text += f" (during: {type(cause).__name__}: {str(cause)[:500]})"
    return text


def without_cudnn_on_failure(run, cuda: bool) -> tuple[dict, str | None]:
    """``run()``, and once more with cuDNN attention off (for the rest of the process) if it failed there.

    The prefill has its own fallback; this one is for the decode shape, one query over the whole cache,
    which a context first meets in ``generate`` or in a run's first step.  Returns the result and the
    fallback's note (None if there was none)."""
    import torch
    try:
        return run(), None
    except Exception as error:  # noqa: BLE001 -- re-raised unless it is cuDNN's
        failure = f"{type(error).__name__}: {error} {error.__cause__ or error.__context__ or ''}"
        if not (cuda and "cudnn" in failure.lower() and torch.backends.cuda.cudnn_sdp_enabled()):
            raise
        torch.backends.cuda.enable_cudnn_sdp(False)
        note = f"cuDNN attention disabled after: {type(error).__name__}: {str(error)[:500]}"
    return run(), note


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


def haystack_prompt(tokenizer, tokens: int) -> list[int]:
    """A deterministic ~``tokens``-token chat prompt: varied filler sentences around a passkey question."""
    subjects = ["The river", "A lantern", "The old map", "Our neighbour", "The committee", "A small boat"]
    verbs = ["drifted past", "lit up", "pointed toward", "argued about", "waited near", "circled"]
    objects = ["the quiet harbour", "a row of houses", "the northern hills", "the last train", "an empty field"]
    sentences, i = [], 0
    from ..engine import encode_prompt

    while True:
        sentences.append(f"{subjects[i % 6]} {verbs[(i * 7) % 6]} {objects[(i * 5) % 5]} on day {i}.")
        if i == 40:
            sentences.append("The passkey is 7342519. Remember it.")
        i += 1
        if i % 20 == 0:
            ids = encode_prompt(tokenizer, " ".join(sentences) + " What is the passkey? Then summarise the text.")
            if len(ids) >= tokens:
                return ids[:tokens]


def build_from_config(name: str, device: str, dtype: str | None = None):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .. import scoring
    from ..models import default_dtype

    spec = dict(CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    dtype = getattr(torch, dtype) if dtype else default_dtype(device)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    scoring.install(model)
    return model


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
# Issue 6's targets need these rows (the ratio's baseline, the step without scoring, full and Lazy refresh):
# they run even past --time-limit, which only skips the configurations after them.
TARGET_ROWS = ("generate", "static-no-scoring", "static-inertia", "static-inertia-lazy")
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


def measure(model, tokenizer, prompt_ids, args, deadline: float | None = None) -> Iterator[dict]:
    """Yield the rows of one context, each as soon as its configuration has run its last repeat.

    Order: the shared prefill, ``generate`` (the baseline every ratio needs), the static configurations
    (the GPU targets), then the engine policies; a run killed part-way keeps every row already yielded.
    Past ``deadline`` (``time.perf_counter()``), configurations not yet started are ``skipped`` rows, except
    the first repeat of ``TARGET_ROWS`` (with ``--no-static``, ``generate`` alone), and of their ``-uncompiled``
    rows once a compiled static row has failed (the other compiled static rows are then not run).
    """
    import torch
    from ..engine import prefill, resolve_budget, shared_window
    from ..policies import make_policy

    policies = policy_names(args.policies)
    budget = resolve_budget(len(prompt_ids), compression=args.compression)
    device = args.device
    best: dict[str, dict] = {}
    cuda = torch.device(device).type == "cuda"

    compile = args.compile == "on" or (args.compile == "auto" and cuda)
    errors: dict[str, str] = {}
    first_setup: dict[str, float] = {}

    # One prefill per prompt, copied by every engine and static run (as the sweep runner does): at 64k on
    # an 8B model a prefill costs seconds, and eleven of them would eat a GPU session. `generate` keeps
    # its own. Peak memory is reported beyond this resident copy.
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    _sync(device)
    # past SHARED_QUERIES_BYTES (64k on an 8B shape) Expected Attention prefills on its own
    window = shared_window([make_policy(name) for name in policies], model, len(prompt_ids))
    fallback = None
    try:  # prefill-time policies score this same prefill through the queries it records (as in Compare)
        shared = prefill(model, prompt_ids, window=window)
        _sync(device)
    except Exception as error:  # noqa: BLE001 -- e.g. out of memory: no configuration can run on this context
        failure = error_text(error)
        if not (cuda and torch.backends.cuda.cudnn_sdp_enabled()):
            yield {"what": "prefill", "prompt_len": len(prompt_ids), "error": failure}
            return
        # cuDNN is SDPA's first choice on Hopper in recent torch; a long-context failure there must not
        # cost the whole context. Without it SDPA falls back to flash / memory-efficient kernels, for every
        # run from here on (the prefill row says so).
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.cuda.empty_cache()
        fallback = f"cuDNN attention disabled after: {failure}"
        try:
            shared = prefill(model, prompt_ids, window=window)
            _sync(device)
        except Exception as retry:  # noqa: BLE001
            yield {"what": "prefill", "prompt_len": len(prompt_ids), "error": failure,
                   "retry_without_cudnn": error_text(retry)}
            return
    resident = shared.cache.nbytes()
    prefill_row = {"what": "prefill", "prompt_len": len(prompt_ids), "prefill_s": round(shared.seconds, 5)}
    if fallback:
        prefill_row["sdpa_fallback"] = fallback
    if cuda:
        prefill_row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    yield prefill_row

    def compiled_failure() -> str | None:
        """The compiled static row that failed, if one has."""
        return next((other for other in errors if other in statics and statics[other].get("compile")), None)

    def measured(name, function, *call_args, **call_kwargs) -> dict | None:
        """One configuration; a failure becomes an ``error`` row and the run goes on to the next one."""
        if name in errors:
            return None
        failed = compiled_failure()
        if name in statics and statics[name].get("compile") and failed:
            # Dynamo does not remember a failed compile: each compiled row would spend its time failing alike,
            # while the -uncompiled rows, the targets' stand-ins now, wait behind them.
            errors[name] = f"not run: the compiled static step failed in {failed} (see its row)"
            return None

        def attempt() -> dict:
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                return function(*call_args, **call_kwargs)
            finally:
                if cuda:
                    torch.cuda.empty_cache()  # a failed capture must not hold memory for the next configuration

        try:
            result, fallback_note = without_cudnn_on_failure(attempt, cuda)
        except Exception as error:  # noqa: BLE001 -- reported in the output, not swallowed
            errors[name] = error_text(error)
            return None
        if fallback_note:
            result["sdpa_fallback"] = fallback_note
        if cuda:
            # The static path resets the counter once its slots replace step 1's prompt-sized cache: its
            # peak is the larger of the two phases', and the decode phase's is reported on its own.
            peak = max(torch.cuda.max_memory_allocated(), result.pop("_setup_peak_bytes", 0))
            result["peak_memory_gb"] = (peak - resident) / 2**30
            if "_decode_peak_bytes" in result:
                result["decode_peak_memory_gb"] = (result.pop("_decode_peak_bytes") - resident) / 2**30
        return result

    statics = static_configurations(compile, blocked=torch.device(device).type == "cuda") if args.static else {}
    runs = {"generate": lambda: measured("generate", time_generate, model, prompt_ids, args.new_tokens, device)}
    for name, options in statics.items():
        runs[name] = lambda name=name, options=options: measured(
            name, time_static, model, tokenizer, prompt_ids, args.new_tokens, budget, device, options, shared=shared)
    backend_rows = {f"backend-{name}": name for name in policy_names(args.backend_policies, empty=True)}
    for row_name, name in backend_rows.items():
        runs[row_name] = lambda row_name=row_name, name=name: measured(
            row_name, time_backend, model, tokenizer, prompt_ids, name, args.new_tokens, budget, device, compile,
            shared=shared)
    for name in policies:
        runs[name] = lambda name=name: measured(name, time_engine, model, tokenizer, prompt_ids, name,
                                                args.new_tokens, budget, device, shared=shared)
    agreement: dict[tuple, dict] = {}  # one per step variant: compiling does not change what is kept

    def row_of(name: str) -> dict:
        row = {"what": name, "prompt_len": len(prompt_ids), "budget": budget if name not in
               ("generate", "full") else len(prompt_ids) + args.new_tokens, "new_tokens": args.new_tokens}
        if name.startswith("static-") or name in backend_rows:
            row["compiled"] = compile and not name.endswith("-uncompiled")
        if name in errors:
            return {**row, "error": errors[name]}
        if name not in best:
            return {**row, "skipped": f"not started within --time-limit {args.time_limit:g} s"}
        result = dict(best[name])
        if name in first_setup:
            result["first_setup_s"] = first_setup[name]
        if name in statics:
            variant = tuple(sorted((k, v) for k, v in statics[name].items() if k != "compile"))
            if variant not in agreement:
                try:
                    agreement[variant] = static_agreement(model, tokenizer, prompt_ids, args.new_tokens, budget,
                                                          statics[name], shared=shared)
                except Exception as error:  # noqa: BLE001 -- the timing stands; the row says why it has no count
                    agreement[variant] = {"agreement_error": error_text(error)}
                    if cuda:
                        torch.cuda.empty_cache()
            result.update(agreement[variant])
        if name in backend_rows:
            try:
                result.update(backend_agreement(model, tokenizer, prompt_ids, backend_rows[name], args.new_tokens,
                                                budget, shared=shared))
            except Exception as error:  # noqa: BLE001 -- the timing stands; the row says why it has no count
                result["agreement_error"] = error_text(error)
        # rounded numbers; the text (an sdpa_fallback note, an error) and the flags as they are
        row = {**row, **{k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}}
        if "generate" in best:
            row["vs_generate"] = round(result["decode_tok_s"] / best["generate"]["decode_tok_s"], 3)
        # The static step cannot time its parts: what scoring and eviction cost together is its slowdown against
        # the same step with neither (the ring of static-no-scoring, same compile setting), which runs before it.
        baseline = static_baseline(name)
        if (name in statics or name in backend_rows) and not name.startswith("static-no-scoring") and baseline in best:
            row["scoring_eviction_share"] = round(1 - result["decode_tok_s"] / best[baseline]["decode_tok_s"], 4)
        return row

    def target(name: str) -> bool:
        """A row that runs past the deadline: a target row, or, once the compiled step has failed, the same
        row uncompiled (judged in its place)."""
        return name in TARGET_ROWS or (compiled_failure() is not None and name.endswith("-uncompiled")
                                       and name.removesuffix("-uncompiled") in TARGET_ROWS)

    emitted: set[str] = set()
    order = [(repeat, name) for repeat in range(args.repeats) for name in runs]  # interleaved: drift hits all alike
    for index, (repeat, name) in enumerate(order):
        past = index and deadline is not None and time.perf_counter() > deadline
        if past and not (repeat == 0 and target(name)):  # the rest is skipped
            continue
        result = runs[name]()
        if result is not None and "setup_s" in result:
            first_setup.setdefault(name, result["setup_s"])  # the repeat that compiled, if any did
        if result is not None and (name not in best or result["decode_tok_s"] > best[name]["decode_tok_s"]):
            best[name] = result
        if repeat == args.repeats - 1:
            emitted.add(name)
            yield row_of(name)
    for name in runs:  # cut short by the deadline: the best run so far, or skipped
        if name not in emitted:
            yield row_of(name)
    del shared


def check_arguments(args) -> None:
    """What ``bench speed`` refuses, before anything is built: ValueError saying what to change."""
    policy_names(args.policies)
    policy_names(args.backend_policies, empty=True)
    if args.new_tokens < 2:  # decode speed is timed from the first new token to the last
        raise ValueError(f"--new-tokens must be at least 2 (decode speed runs from the first new token to the "
                         f"last), got {args.new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if not 0.0 <= args.compression < 1.0:
        raise ValueError(f"--compression must be in [0, 1), got {args.compression}")
    if not args.time_limit >= 0:  # NaN too: a negative limit skipped every configuration but generate
        raise ValueError(f"--time-limit must be seconds >= 0 (0: no limit), got {args.time_limit:g}")
    if args.config:
        for length in args.contexts.split(","):
            if not length.strip().isdigit() or int(length) < 2:
                raise ValueError(f"--contexts takes prompt lengths of at least 2 tokens, comma-separated (e.g. "
                                 f"16384,32768), got {length.strip()!r} in {args.contexts!r}")
    elif args.contexts != CONTEXTS:
        raise ValueError("--contexts sets the prompt lengths of a --config model (random weights); for "
                         f"{args.model} give its prompt length with --prompt-tokens")
    elif args.prompt_tokens < 2:
        raise ValueError(f"--prompt-tokens must be at least 2, got {args.prompt_tokens}")


def _check_context(model, prompts, args) -> None:
    """Refuse a prompt past the model's context, which would fail (or crawl) mid-measurement."""
    from .. import engine

    for prompt in prompts:
        try:
            engine.check_prompt(model, prompt, args.new_tokens)
        except ValueError as error:
            raise ValueError(f"{error} (here: lower {'--contexts' if args.config else '--prompt-tokens'} or "
                             "--new-tokens)") from None


def policy_names(text: str, empty: bool = False) -> list[str]:
    """The ``--policies`` (``empty``: ``--backend-policies``, which may be empty) list, each name checked against
    the registry."""
    from ..policies import get_spec

    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names and not empty:
        raise ValueError("--policies is empty; name at least one policy, e.g. --policies full,inertia")
    for name in names:
        get_spec(name)
    return names


def main(args) -> int:
    import torch
    import transformers

    from ..models import load_model
    from ..trace import model_dtype

    check_arguments(args)  # refused before the model loads
    started = time.perf_counter()  # --time-limit counts the model's build too
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.node(),
            "processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__, "device": args.device,
            "compile": args.compile}
    if args.device.startswith("cuda"):
        meta["gpu"] = torch.cuda.get_device_name()
        # Which fused attention kernels SDPA may pick (cuDNN leads on Hopper in recent torch).
        meta["sdpa_enabled"] = [name for name, on in (
            ("cudnn", torch.backends.cuda.cudnn_sdp_enabled()), ("flash", torch.backends.cuda.flash_sdp_enabled()),
            ("mem_efficient", torch.backends.cuda.mem_efficient_sdp_enabled())) if on]
    if args.config:
        model = build_from_config(args.config, args.device, args.dtype)
        tokenizer = _NullTokenizer()
        generator = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, model.config.vocab_size, (int(n),), generator=generator).tolist()
                   for n in args.contexts.split(",")]
        meta["model"] = f"{args.config} (random weights)"
    else:
        model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
        # checked before the haystack is built: building one past the context takes minutes, to be refused
        _check_context(model, [range(args.prompt_tokens)], args)
        prompts = [haystack_prompt(tokenizer, args.prompt_tokens)]
        meta["model"] = args.model
    meta["dtype"] = model_dtype(model)
    _check_context(model, prompts, args)
    out = open(args.out, "w") if args.out else None

    def emit(record: dict) -> None:  # line by line: a run cut short by a time limit keeps what it measured
        print(json.dumps(record), flush=True)
        if out is not None:
            out.write(json.dumps(record) + "\n")
            out.flush()

    emit({"meta": meta})
    last = 0.0
    deadline = started + args.time_limit if args.time_limit else None
    try:
        for index, prompt_ids in enumerate(prompts):
            # A context starts only if one as long as the last one would still end in time (contexts
            # are meant to come longest first, so that is an upper bound); within the first, which always
            # starts, configurations past the limit are skipped.
            if index and args.time_limit and time.perf_counter() - started + last > args.time_limit:
                emit({"what": "skipped", "prompt_len": len(prompt_ids),
                      "why": f"would not end within --time-limit {args.time_limit:g} s"})
                continue
            context_start = time.perf_counter()
            try:
                for row in measure(model, tokenizer, prompt_ids, args, deadline):
                    emit(row)
            except Exception as error:  # noqa: BLE001 -- outside any configuration: this context ends, the next runs
                emit({"what": "context failed", "prompt_len": len(prompt_ids), "error": error_text(error)})
            last = time.perf_counter() - context_start
            emit({"what": "context done", "prompt_len": len(prompt_ids), "seconds": round(last, 1)})
    finally:
        if out is not None:
            out.close()
    return 0


class _NullTokenizer:
    """Random-weight models have no tokenizer; the engine only needs ``decode`` for text pieces."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + len(word) for word in text.split()]}  # any ids will do: random weights

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""
