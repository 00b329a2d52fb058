"""``kvviz generate``: one run of a policy, streamed or as JSON, on the engine or the static path."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from .. import settings
from ..settings import CLI_NAMES, Settings
from .common import WITH_PREFILL, WITHOUT_PREFILL, _check_writable, _read_prompt


def _policy_params(args) -> dict:
    params = {}
    if args.alpha is not None:
        params["alpha"] = args.alpha
    if args.refresh is not None:
        params["refresh"] = args.refresh
    for item in args.param or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--param takes NAME=VALUE, got {item!r}")
        if key in params:  # --alpha 0.7 --param alpha=0.5: one of them would be silently dropped
            flag = key in ("alpha", "refresh") and getattr(args, key) is not None
            given = f"--{key}" if flag else f"--param {key}="
            raise ValueError(f"{key} is given twice ({given}... and --param {item}); give it once")
        params[key] = value  # the registry converts and checks it (kvviz.policies.coerce)
    return params


def _validate_generate(args) -> Settings:
    """The run ``generate`` was asked for (its default compression still unapplied); ValueError otherwise.
    --alpha and --refresh are checked by the registry with every other parameter (refresh 0 = score-free)."""
    if args.temperature == 0 and (args.top_p is not None or args.seed is not None):
        raise settings.greedy_but_given([flag for flag, value in (("--top-p", args.top_p), ("--seed", args.seed))
                                         if value is not None], "--temperature",
                                        "add --temperature T > 0 (the random policy's own seed is --param seed=N)")
    asked = Settings(compression=args.compression, budget=args.budget, temperature=args.temperature,
                     top_p=1.0 if args.top_p is None else args.top_p, seed=0 if args.seed is None else args.seed,
                     max_new_tokens=args.max_new_tokens, names=CLI_NAMES)
    if args.compile and not args.static:  # otherwise it would be silently ignored: only the static path compiles
        raise ValueError("--compile applies to --static only; add --static or drop --compile")
    if args.static and (args.temperature != 0.0 or args.trace):  # before --trace's own checks: it cannot apply
        given = " and ".join(flag for flag, on in (("--temperature", args.temperature != 0.0), ("--trace", args.trace))
                             if on)
        raise ValueError(f"--static decodes greedily and keeps no per-step trace: drop {given}, or drop --static to "
                         "use the engine")
    if args.trace:
        _check_writable(args.trace, "--trace")
        if Path(args.trace).suffix != ".parquet":  # what is written, and what `kvviz trace` and the app open
            raise ValueError(f"--trace writes a parquet file: name it .parquet, e.g. "
                             f"{str(Path(args.trace).with_suffix('.parquet'))!r}")
    return asked


def cmd_generate(args) -> int:
    from .. import engine
    from ..models import load_model
    from ..notes import checkpoint_note
    from ..policies import make_policy
    from ..trace import Trace, model_dtype

    asked = _validate_generate(args)
    prompt = _read_prompt(args)
    policy = make_policy(args.policy, **_policy_params(args))
    compression = args.compression if args.budget is None and args.compression is not None else None
    if args.budget is None and args.compression is None and args.policy != "full":
        compression = 0.9  # the papers' aggressive regime
    asked = dataclasses.replace(asked, compression=compression)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    engine.check_prompt(model, prompt_ids, args.max_new_tokens)
    budget = _generate_budget(args, len(prompt_ids), compression)
    if compression is not None:
        _check_policy_budget(args, model, policy, len(prompt_ids), budget, compression)
    if args.static:
        return _generate_static(args, model, tokenizer, prompt_ids, policy, budget)

    events, elapsed = _decode_streaming(args, asked, model, tokenizer, prompt_ids, policy, budget)
    trace = Trace.from_run(asked, prompt_ids, budget, args.policy, policy.params(), events, model=args.model,
                           dtype=model_dtype(model), prompt=prompt, chat=args.chat)
    summary = _generate_summary(args, trace, events, budget, elapsed)
    note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over budget, if it did
    if args.json:
        _print_generate_json(args, tokenizer, trace, policy, summary, note)
    else:
        _print_generate_footer(args, events, budget, summary, note)
    if args.trace:  # checked before the run; still after the output, so that a failing save keeps the result
        try:
            trace.save(args.trace)
        except OSError as error:
            raise ValueError(f"the run finished but --trace {args.trace!r} could not be written "
                             f"({error.strerror or error}): choose a writable path") from None
    return 0


def _check_policy_budget(args, model, policy, prompt_len: int, budget: int, compression: float) -> None:
    """A policy's refusal of the budget, told as the --compression to give."""
    from .. import engine
    from ..policies.base import BudgetTooSmall

    try:
        policy.reset(prompt_len, budget, model.config.num_hidden_layers)
    except BudgetTooSmall as error:
        raise ValueError(engine.at_compression(error, compression, prompt_len, option="--compression",
                                               given=_compression_given(args, compression))) from None


def _decode_streaming(args, asked: Settings, model, tokenizer, prompt_ids, policy, budget) -> tuple[list, float]:
    """Decode on the --backend's decoder, printing each token's text as it comes (unless --json); the events and
    seconds."""
    from .. import engine

    events = []
    start = time.perf_counter()
    stream = engine.stream(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=args.max_new_tokens,
                           temperature=asked.temperature, top_p=asked.top_p, seed=asked.seed, backend=args.backend)
    for event in stream:
        events.append(event)
        if not args.json:
            print(event.text, end="", flush=True)
    return events, time.perf_counter() - start


def _generate_summary(args, trace, events, budget: int, elapsed: float) -> dict:
    """The run's sizes and rates, as both the JSON and the text footer report them."""
    from ..trace import time_split

    decode_seconds = sum(time_split(events).values())
    return {
        "prompt_len": len(trace.prompt_ids),
        "budget": budget if args.policy != "full" else None,  # the full cache holds no budget (as the text says)
        "final_cache_size": events[-1].cache_size,
        "new_tokens": len(trace.token_ids),
        "tok_per_s": len(trace.token_ids) / elapsed,
        "decode_tok_per_s": len(trace.decode_steps) / decode_seconds if decode_seconds else None,
    }


def _print_generate_json(args, tokenizer, trace, policy, summary: dict, note: str) -> None:
    out = {
        "text": tokenizer.decode(trace.token_ids, skip_special_tokens=True),
        "token_ids": trace.token_ids,
        "policy": args.policy,
        "params": policy.params(),
        "model": args.model,
        **summary,
        "note": note or None,
        "steps": [e.to_json() for e in trace.decode_steps],
    }
    print(json.dumps(out))


def _print_generate_footer(args, events, budget: int, summary: dict, note: str) -> None:
    """The line after the streamed text: the prompt, what the budget held, the rates."""
    # The full cache evicts nothing: a budget given with it (one command line for every policy) is not held.
    held = f"budget {budget}" if args.policy != "full" else "no eviction (full cache)"
    if args.policy != "full" and not any(event.evicted.size for event in events):
        held += " (never reached: nothing evicted)"  # a budget past the run, as a read-lag study sets
    # Two rates that differ by the prefill (2.2x on a 2k prompt): each says which it is, as `kvviz trace` does
    decode = summary["decode_tok_per_s"]
    print(f"\n\n-- prompt {summary['prompt_len']} tokens, {held}, final cache "
          f"{summary['final_cache_size']}, {summary['new_tokens']} new tokens at {summary['tok_per_s']:.1f} tok/s "
          f"{WITH_PREFILL}" + (f" (decode {decode:.1f} tok/s {WITHOUT_PREFILL})" if decode else ""),
          file=sys.stderr)
    if note:
        print(f"-- {note}", file=sys.stderr)


def _generate_budget(args, prompt_len: int, compression: float | None) -> int:
    """The budget ``generate`` runs at.  A compression that leaves no cache is refused naming the option and
    whether its value is the default, which nobody typed (engine.resolve_budget's message names neither)."""
    from .. import engine

    try:
        return engine.resolve_budget(prompt_len, compression=compression, budget=args.budget)
    except ValueError:
        if compression is None:
            raise
    most = engine.largest_compression(prompt_len, 1) or 0.0
    given = _compression_given(args, compression)
    lower = f"--compression {most:g} or lower" if most > 0 else "--compression 0"
    raise ValueError(f"{given} leaves no cache for a {prompt_len}-token prompt; give {lower}, a --budget in tokens, "
                     "or a longer prompt")


def _compression_given(args, compression: float) -> str:
    """How ``generate`` was given its compression, for a refusal: typed, or the default nobody typed."""
    return f"--compression {compression:g}" if args.compression is not None else \
        f"the default --compression {compression:g} (used when neither --compression nor --budget is given)"


def _generate_static(args, model, tokenizer, prompt_ids, policy, budget) -> int:
    """``generate --static``: the static decode path (one CUDA graph per step variant on a GPU)."""
    from .. import engine
    from ..fast import StaticInertia

    static = StaticInertia.from_policy(model, policy, compile=args.compile)
    start = time.perf_counter()
    # --json reports every step's keep set, as the engine's does: reading it costs one small device-to-host
    # copy per step, next to the sync the EOS check already makes.
    run = static.generate(tokenizer, prompt_ids, budget, args.max_new_tokens, graph=model.device.type == "cuda",
                          stop_ids=engine.eos_ids(model, tokenizer), record_kept=args.json)
    elapsed = time.perf_counter() - start
    text = tokenizer.decode(run.token_ids, skip_special_tokens=True)
    steady = run.steady_tok_s()  # NaN when no step only replayed (too few tokens): JSON gets null
    summary = {"prompt_len": len(prompt_ids), "budget": budget, "new_tokens": len(run.token_ids),
               "tok_per_s": len(run.token_ids) / elapsed, "decode_tok_per_s": steady if math.isfinite(steady) else None,
               "setup_s": run.setup_seconds()}
    if args.json:
        print(json.dumps({"text": text, "token_ids": run.token_ids, "policy": args.policy, "params": policy.params(),
                          "model": args.model, "path": "static", "compiled": args.compile, **summary,
                          "steps": _static_steps(len(prompt_ids), run.token_ids, run.kept)}))
    else:
        print(text)
        print(f"\n-- static path: prompt {summary['prompt_len']} tokens, budget {budget}, {summary['new_tokens']} "
              f"new tokens at {summary['tok_per_s']:.1f} tok/s {WITH_PREFILL} and setup (steady decode {steady:.1f} "
              f"tok/s {WITHOUT_PREFILL})", file=sys.stderr)
    return 0


def _static_steps(prompt_len: int, token_ids: list[int], kept: list[list[int]]) -> list[dict]:
    """The engine's ``--json`` steps, as far as the static path knows them: step, token_id, kept, evicted.

    ``kept[i]`` is the keep set after decode step ``i + 1`` (step 1 runs through the engine, later steps
    statically).  The static path decodes step 1 even when only one token is asked for, so only the first
    ``len(token_ids) - 1`` entries are steps of this run.  InertiaKV never evicts at prefill, so the
    cache before step 1 is the whole prompt, and each step's evictions follow from consecutive keep sets.
    """
    steps = []
    before = set(range(prompt_len))
    for step, (consumed, after) in enumerate(zip(token_ids, kept[:len(token_ids) - 1]), start=1):
        present = before | {prompt_len + step - 1}  # step k feeds generated token k at position L0 + k - 1
        steps.append({"step": step, "token_id": consumed, "kept": after,
                      "evicted": sorted(present - set(after))})
        before = set(after)
    return steps
