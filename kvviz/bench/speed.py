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
``static-full-cache`` is the full cache on the static backend (prompt + new-token slots, the unwritten ones
masked, one CUDA graph on a GPU), the baseline a static eviction step's speed is judged against with nothing
but the cache size changed.
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

# Looked up here when a context runs, so that a test can replace any of them on this module
from .speed_runs import (  # noqa: F401
    STATIC,
    UNBLOCKED,
    UNCOMPILED,
    UNFUSED,
    VARIANTS,
    _sync,
    backend_agreement,
    replayed_seconds,
    static_agreement,
    static_baseline,
    static_configurations,
    time_backend,
    time_backend_events,
    time_engine,
    time_generate,
    time_static,
    time_static_full,
)

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
    a previous error during capture"); the error that caused it is the context, so it goes in too.  A
    policy's refusal of the budget (BudgetTooSmall: AvoKV-E's 36 protected entries at a tiny context) says
    all there is in its row: no traceback."""
    from ..policies.base import BudgetTooSmall

    if not isinstance(error, BudgetTooSmall):
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


# Issue 6's targets need these rows (the ratio's baseline, the step without scoring, full and Lazy refresh),
# issue 42's the full cache as a static, graph-captured step: they run even past --time-limit, which only
# skips the configurations after them.
FULL_GRAPH = "static-full-cache"
EVENTS_ROW = "backend-inertia-events"  # the backend's InertiaKV with its events read at the app's frame rate
TARGET_ROWS = ("generate", FULL_GRAPH, "static-no-scoring", "static-inertia", "static-inertia-lazy")


def measure(model, tokenizer, prompt_ids, args, deadline: float | None = None) -> Iterator[dict]:
    """Yield the rows of one context, each as soon as its configuration has run its last repeat.

    Order: the shared prefill, ``generate`` (the baseline every ratio needs), the static configurations
    (the GPU targets), then the engine policies; a run killed part-way keeps every row already yielded.
    Past ``deadline`` (``time.perf_counter()``), configurations not yet started are ``skipped`` rows, except
    the first repeat of ``TARGET_ROWS`` (with ``--no-static``, ``generate`` alone), and of their ``-uncompiled``
    rows once a compiled static row has failed (the other compiled static rows are then not run).
    """
    import torch

    from ..engine import resolve_budget

    policies = policy_names(args.policies)
    budget = resolve_budget(len(prompt_ids), compression=args.compression)
    cuda = torch.device(args.device).type == "cuda"
    shared, prefill_row = _shared_prefill(model, prompt_ids, policies, args.device, cuda)
    yield prefill_row
    if shared is None:
        return
    context = _Context(model, tokenizer, prompt_ids, args, budget, shared, cuda)
    runs = context.runs(policies)
    emitted: set[str] = set()
    order = [(repeat, name) for repeat in range(args.repeats) for name in runs]  # interleaved: drift hits all alike
    for index, (repeat, name) in enumerate(order):
        past = index and deadline is not None and time.perf_counter() > deadline
        if past and not (repeat == 0 and context.target(name)):  # the rest is skipped
            continue
        context.keep(name, runs[name]())
        if repeat == args.repeats - 1:
            emitted.add(name)
            yield context.row_of(name)
    for name in runs:  # cut short by the deadline: the best run so far, or skipped
        if name not in emitted:
            yield context.row_of(name)
    del shared, context


def _shared_prefill(model, prompt_ids, policies: list[str], device, cuda: bool) -> tuple:
    """The one prefill every engine and static run copies, and its row: ``(None, error row)`` if it failed.

    At 64k on an 8B model a prefill costs seconds, and one per configuration would eat a GPU session (the
    sweep runner shares it too); ``generate`` keeps its own.  Peak memory is reported beyond this copy."""
    import torch

    from ..engine import prefill, shared_window
    from ..policies import make_policy

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
            return None, {"what": "prefill", "prompt_len": len(prompt_ids), "error": failure}
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
            return None, {"what": "prefill", "prompt_len": len(prompt_ids), "error": failure,
                          "retry_without_cudnn": error_text(retry)}
    row = {"what": "prefill", "prompt_len": len(prompt_ids), "prefill_s": round(shared.seconds, 5)}
    if fallback:
        row["sdpa_fallback"] = fallback
    if cuda:
        row["peak_memory_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    return shared, row


class _Context:
    """One context's configurations after its shared prefill: each run (a failure kept as its error), the
    best of its repeats, and its row."""

    def __init__(self, model, tokenizer, prompt_ids, args, budget: int, shared, cuda: bool):
        self.model, self.tokenizer, self.prompt_ids, self.args = model, tokenizer, prompt_ids, args
        self.budget, self.shared, self.cuda = budget, shared, cuda
        self.resident = shared.cache.nbytes()
        self.compile = args.compile == "on" or (args.compile == "auto" and cuda)
        self.statics = static_configurations(self.compile, blocked=cuda) if args.static else {}
        self.backend_rows = {f"backend-{name}": name for name in policy_names(args.backend_policies, empty=True)}
        self.best: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.first_setup: dict[str, float] = {}
        self.agreement: dict[tuple, dict] = {}  # one per step variant: compiling does not change what is kept

    def runs(self, policies: list[str]) -> dict:
        """Each configuration's run, by row name, in the order the rows come out."""
        model, tokenizer, prompt_ids, args = self.model, self.tokenizer, self.prompt_ids, self.args
        budget, device, shared, measured = self.budget, args.device, self.shared, self.measured
        runs = {"generate": lambda: measured("generate", time_generate, model, prompt_ids, args.new_tokens, device)}
        if args.static:
            runs[FULL_GRAPH] = lambda: measured(FULL_GRAPH, time_static_full, model, tokenizer, prompt_ids,
                                                args.new_tokens, device, shared=shared)
        for name, options in self.statics.items():
            runs[name] = lambda name=name, options=options: measured(
                name, time_static, model, tokenizer, prompt_ids, args.new_tokens, budget, device, options,
                shared=shared)
        for row_name, name in self.backend_rows.items():
            runs[row_name] = lambda row_name=row_name, name=name: measured(
                row_name, time_backend, model, tokenizer, prompt_ids, name, args.new_tokens, budget, device,
                self.compile, shared=shared)
        if "backend-inertia" in self.backend_rows:  # what streaming every step's event to a UI costs
            runs[EVENTS_ROW] = lambda: measured(EVENTS_ROW, time_backend_events, model, tokenizer, prompt_ids,
                                                "inertia", args.new_tokens, budget, device, shared=shared)
        for name in policies:
            runs[name] = lambda name=name: measured(name, time_engine, model, tokenizer, prompt_ids, name,
                                                    args.new_tokens, budget, device, shared=shared)
        return runs

    def compiled_failure(self) -> str | None:
        """The compiled static row that failed, if one has."""
        return next((other for other in self.errors if other in self.statics and self.statics[other].get("compile")),
                    None)

    def target(self, name: str) -> bool:
        """A row that runs past the deadline: a target row, or, once the compiled step has failed, the same
        row uncompiled (judged in its place)."""
        return name in TARGET_ROWS or (self.compiled_failure() is not None and name.endswith("-uncompiled")
                                       and name.removesuffix("-uncompiled") in TARGET_ROWS)

    def measured(self, name, function, *call_args, **call_kwargs) -> dict | None:
        """One configuration; a failure becomes an ``error`` row and the run goes on to the next one."""
        import torch

        if name in self.errors:
            return None
        failed = self.compiled_failure()
        if name in self.statics and self.statics[name].get("compile") and failed:
            # Dynamo does not remember a failed compile: each compiled row would spend its time failing alike,
            # while the -uncompiled rows, the targets' stand-ins now, wait behind them.
            self.errors[name] = f"not run: the compiled static step failed in {failed} (see its row)"
            return None

        def attempt() -> dict:
            if self.cuda:
                torch.cuda.reset_peak_memory_stats()
            try:
                return function(*call_args, **call_kwargs)
            finally:
                if self.cuda:
                    torch.cuda.empty_cache()  # a failed capture must not hold memory for the next configuration

        try:
            result, fallback_note = without_cudnn_on_failure(attempt, self.cuda)
        except Exception as error:  # noqa: BLE001 -- reported in the output, not swallowed
            self.errors[name] = error_text(error)
            return None
        if fallback_note:
            result["sdpa_fallback"] = fallback_note
        if self.cuda:
            # The static path resets the counter once its slots replace step 1's prompt-sized cache: its
            # peak is the larger of the two phases', and the decode phase's is reported on its own.
            peak = max(torch.cuda.max_memory_allocated(), result.pop("_setup_peak_bytes", 0))
            result["peak_memory_gb"] = (peak - self.resident) / 2**30
            if "_decode_peak_bytes" in result:
                result["decode_peak_memory_gb"] = (result.pop("_decode_peak_bytes") - self.resident) / 2**30
        return result

    def keep(self, name: str, result: dict | None) -> None:
        """Keep a repeat's result if it is the fastest so far, and the setup time of the first."""
        if result is not None and "setup_s" in result:
            self.first_setup.setdefault(name, result["setup_s"])  # the repeat that compiled, if any did
        if result is not None and (name not in self.best or result["decode_tok_s"] > self.best[name]["decode_tok_s"]):
            self.best[name] = result

    def row_of(self, name: str) -> dict:
        """A configuration's row: its best repeat, rounded, with its agreement and its ratios."""
        prompt_len, new_tokens = len(self.prompt_ids), self.args.new_tokens
        row = {"what": name, "prompt_len": prompt_len, "budget": self.budget if name not in
               ("generate", "full", FULL_GRAPH) else prompt_len + new_tokens, "new_tokens": new_tokens}
        if name in self.statics or name in self.backend_rows:
            row["compiled"] = self.compile and not name.endswith("-uncompiled")
        if name in self.errors:
            return {**row, "error": self.errors[name]}
        if name not in self.best:
            return {**row, "skipped": f"not started within --time-limit {self.args.time_limit:g} s"}
        result = dict(self.best[name])
        if name in self.first_setup:
            result["first_setup_s"] = self.first_setup[name]
        result.update(self.agreement_of(name))
        # rounded numbers; the text (an sdpa_fallback note, an error) and the flags as they are
        row = {**row, **{k: round(v, 5) if isinstance(v, float) else v for k, v in result.items()}}
        best = self.best
        if "generate" in best:
            row["vs_generate"] = round(result["decode_tok_s"] / best["generate"]["decode_tok_s"], 3)
        # The static step cannot time its parts: what scoring and eviction cost together is its slowdown against
        # the same step with neither (the ring of static-no-scoring, same compile setting), which runs before it.
        baseline = static_baseline(name)
        if (name in self.statics or name in self.backend_rows) and not name.startswith("static-no-scoring") \
                and baseline in best:
            row["scoring_eviction_share"] = round(1 - result["decode_tok_s"] / best[baseline]["decode_tok_s"], 4)
        return row

    def agreement_of(self, name: str) -> dict:
        """What a static or backend row keeps against the engine (untimed), or why it has no count."""
        import torch

        model, tokenizer, prompt_ids, new_tokens = self.model, self.tokenizer, self.prompt_ids, self.args.new_tokens
        if name in self.statics:
            variant = tuple(sorted((k, v) for k, v in self.statics[name].items() if k != "compile"))
            if variant not in self.agreement:
                try:
                    self.agreement[variant] = static_agreement(model, tokenizer, prompt_ids, new_tokens, self.budget,
                                                               self.statics[name], shared=self.shared)
                except Exception as error:  # noqa: BLE001 -- the timing stands; the row says why it has no count
                    self.agreement[variant] = {"agreement_error": error_text(error)}
                    if self.cuda:
                        torch.cuda.empty_cache()
            return self.agreement[variant]
        if name in self.backend_rows:
            try:
                return backend_agreement(model, tokenizer, prompt_ids, self.backend_rows[name], new_tokens,
                                         self.budget, shared=self.shared)
            except Exception as error:  # noqa: BLE001 -- the timing stands; the row says why it has no count
                return {"agreement_error": error_text(error)}
        return {}


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
    if not args.time_limit >= 0:  # NaN too: a negative limit would skip every configuration but generate
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
    check_arguments(args)  # refused before the model loads
    started = time.perf_counter()  # --time-limit counts the model's build too
    meta = _meta(args)
    model, tokenizer, prompts = _model_and_prompts(args, meta)
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


def _meta(args) -> dict:
    """The run's first line: when, where, on what software and device (the model and dtype are added later)."""
    import torch
    import transformers

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
    return meta


def _model_and_prompts(args, meta: dict) -> tuple:
    """The model, its tokenizer and the prompts to time, each checked against the model's context; names the
    model and its dtype in ``meta``."""
    import torch

    from ..models import load_model
    from ..trace import model_dtype

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
    return model, tokenizer, prompts


class _NullTokenizer:
    """Random-weight models have no tokenizer; the engine only needs ``decode`` for text pieces."""

    eos_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [3 + len(word) for word in text.split()]}  # any ids will do: random weights

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""
