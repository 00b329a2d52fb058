"""The ``kvviz`` command: generate with a policy, list policies, run benchmarks, serve the app."""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import numpy as np
import time
from pathlib import Path


# How the generate and trace summaries label their rates: the one over the whole run counts the prefill's time
# (most of a short run's on a long prompt), the decode one only the decode steps' forward, scoring and eviction.
WITH_PREFILL = "including the prefill"
WITHOUT_PREFILL = "without the prefill"


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


def _validate_generate(args) -> None:
    if args.compression is not None and not 0.0 <= args.compression < 1.0:
        raise ValueError(f"--compression must be in [0, 1), got {args.compression}")
    if args.budget is not None and args.budget < 1:
        raise ValueError(f"--budget must be at least 1, got {args.budget}")
    # --alpha and --refresh are checked by the registry with every other parameter (refresh 0 = score-free).
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a number >= 0 (0 = greedy), got {args.temperature}")
    if args.temperature == 0 and (args.top_p is not None or args.seed is not None):
        given = " and ".join(flag for flag, value in (("--top-p", args.top_p), ("--seed", args.seed))
                             if value is not None)
        raise ValueError(f"{given} shape sampling, and --temperature 0 decodes greedily: add --temperature T > 0 "
                         "(the random policy's own seed is --param seed=N)")
    args.top_p = 1.0 if args.top_p is None else args.top_p
    args.seed = 0 if args.seed is None else args.seed
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
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


def _check_writable(path: str, option: str, example: str = "trace.parquet") -> None:
    """Refuse an output file that cannot be written, before minutes of loading and decoding are spent.

    Checks what can be known up front (a folder that exists and may be written into; the path itself not
    a folder nor a read-only file); the save afterwards still reports anything else (a full disk).
    """
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path!r} is a folder; give a file path such as {str(target / example)!r}")
    if not folder.exists():
        raise ValueError(f"{option} {path!r}: the folder {str(folder)!r} does not exist; create it or choose "
                         "another path")
    if not folder.is_dir():
        raise ValueError(f"{option} {path!r}: {str(folder)!r} is a file, not a folder; choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path!r} is not writable (permission denied); choose a writable path")


def cmd_generate(args) -> int:
    from . import engine
    from .models import load_model
    from .policies import make_policy
    from .policies.base import BudgetTooSmall
    from .trace import Trace, checkpoint_note, model_dtype, time_split

    _validate_generate(args)
    prompt = _read_prompt(args)
    policy = make_policy(args.policy, **_policy_params(args))
    compression = args.compression if args.budget is None and args.compression is not None else None
    if args.budget is None and args.compression is None and args.policy != "full":
        compression = 0.9  # the papers' aggressive regime
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    engine.check_prompt(model, prompt_ids, args.max_new_tokens)
    budget = _generate_budget(args, len(prompt_ids), compression)
    if compression is not None:  # a policy's refusal of the budget, told as the --compression to give
        try:
            policy.reset(len(prompt_ids), budget, model.config.num_hidden_layers)
        except BudgetTooSmall as error:
            raise ValueError(engine.at_compression(error, compression, len(prompt_ids), option="--compression",
                                                   given=_compression_given(args, compression))) from None
    if args.static:
        return _generate_static(args, model, tokenizer, prompt_ids, policy, budget)

    events = []
    sampler = engine.Sampler(args.temperature, args.top_p, args.seed)
    start = time.perf_counter()
    for event in engine.decode(model, tokenizer, prompt_ids, policy, budget=budget,
                               max_new_tokens=args.max_new_tokens, sampler=sampler):
        events.append(event)
        if not args.json:
            print(event.text, end="", flush=True)
    elapsed = time.perf_counter() - start
    trace = Trace(prompt_ids, budget, args.policy, policy.params(), args.model, events, sampler.settings(),
                  model_dtype(model), args.max_new_tokens, compression=compression, prompt=prompt, chat=args.chat)
    decode_seconds = sum(time_split(events).values())
    note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over budget, if it did
    summary = {
        "prompt_len": len(prompt_ids),
        "budget": budget if args.policy != "full" else None,  # the full cache holds no budget (as the text says)
        "final_cache_size": events[-1].cache_size,
        "new_tokens": len(trace.token_ids),
        "tok_per_s": len(trace.token_ids) / elapsed,
        "decode_tok_per_s": len(trace.decode_steps) / decode_seconds if decode_seconds else None,
    }
    if args.json:
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
    else:
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
    if args.trace:  # checked before the run; still after the output, so that a failing save keeps the result
        try:
            trace.save(args.trace)
        except OSError as error:
            raise ValueError(f"the run finished but --trace {args.trace!r} could not be written "
                             f"({error.strerror or error}): choose a writable path") from None
    return 0


def _generate_budget(args, prompt_len: int, compression: float | None) -> int:
    """The budget ``generate`` runs at.  A compression that leaves no cache is refused naming the option and
    whether its value is the default, which nobody typed (engine.resolve_budget's message names neither)."""
    from . import engine

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
    from . import engine
    from .fast import StaticInertia

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


def _read_prompt(args) -> str:
    if getattr(args, "prompt_file", None):
        try:
            prompt = Path(args.prompt_file).read_text()
        except OSError as error:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file!r}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise ValueError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text (byte {error.start}); "
                             "save it as UTF-8") from None
    else:
        prompt = args.prompt
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    return prompt


def cmd_probe(args) -> int:
    from . import engine, probe
    from .models import load_model
    from .policies import REGISTRY, build_setting

    if args.step < 1:
        raise ValueError(f"--step must be >= 1, got {args.step}")
    for option, value in (("--future", args.future), ("--batch", args.batch)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample must be >= 1 (leave it out to probe every entry), got {args.sample}")
    names = list(REGISTRY) if args.policies == "all" else [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:  # otherwise the whole probe runs and prints an empty ranking
        raise ValueError("--policies names no policy; give registry names, e.g. --policies inertia,tova, or 'all'")
    policies = dict(build_setting(name) for name in names)  # a name, or a setting such as 'avokv delay=32'
    prompt = _read_prompt(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    probe.check_fits(model, prompt_ids, args.step, args.future, step_name="--step", future_name="--future")
    result = probe.probe(model, tokenizer, prompt_ids, args.step, policies=policies, sample=args.sample,
                         seed=args.seed, future=args.future, batch=args.batch)
    quality, aligned = probe.aligned_quality(result.utilities, result.damage) if result.utilities else ({}, None)
    # AvoKV-E's ranks are the blindspot's axes: after the damage pass, so that its refusal loses nothing above
    spot, spot_note = probe.blindspot_at(model, tokenizer, prompt_ids, result) if args.blindspot else (None, "")
    if args.json:
        print(json.dumps({"step": args.step, "prompt_len": len(prompt_ids), "future": args.future,
                          "candidates": result.candidates.tolist(), "damage": result.damage.tolist(),
                          "candidates_per_second": result.candidates_per_second, "ranking": quality,
                          "ranked": [] if aligned is None else result.candidates[aligned].tolist(),
                          **({"blindspot": _blindspot_json(spot) if spot else {"none": spot_note}}
                             if args.blindspot else {})}))
        return 0
    print(f"probe at step {args.step}: {len(result.candidates)} candidates, {args.future} future tokens, "
          f"{result.candidates_per_second:.1f} candidates/s")
    protected = probe.protection_note(policies, len(prompt_ids), args.step)
    if protected:
        print(protected)
    if aligned is not None and not aligned.all():
        print(f"ranked over the {int(aligned.sum())} entries every policy judged "
              f"({int((~aligned).sum())} left out: a protected tail, sinks or a window some policy never judges)")
    width = max([20, *(len(name) + 2 for name in quality)])  # expected-attention-decode is 25 characters
    print(f"{'policy':<{width}}{'AUROC':>8}{'p':>8}{'AP':>8}{'top-k rec':>11}{'false-safe':>12}{'Spearman':>10}")
    for name, q in sorted(quality.items(), key=lambda item: -np.nan_to_num(item[1]["auroc"])):
        p_value = "<0.001" if q["auroc_p"] < 0.001 else f"{q['auroc_p']:.3f}"  # 0.000 read as certainty
        print(f"{name:<{width}}{q['auroc']:>8.3f}{p_value:>8}{q['average_precision']:>8.3f}"
              f"{q['topk_recall']:>11.3f}{q['false_safe_rate']:>12.3f}{q['spearman']:>10.3f}")
    if quality:  # what the columns measure, with this probe's own k
        k = int(probe.top_decile(result.damage[aligned]).sum())
        print(f"(label: the top decile of damage, k = {k} of {int(aligned.sum())} entries; p: the AUROC against "
              "chance (0.5), two-sided Mann-Whitney, exact and counting ties, large with few high-damage entries; "
              "top-k rec: the share of them in a policy's own k highest utilities; false-safe: the share of them "
              "in its k lowest, the first it would evict)")
        tied = probe.tied_rankings({name: result.utilities[name] for name in quality}, aligned)
        if tied:
            print("(mostly one tied score: " + ", ".join(f"{name} ({share:.0%})" for name, share in tied.items())
                  + " of the ranked entries share it, so that AUROC comes largely from ties' half credit)")
    skipped = sorted(set(names) - set(quality))
    if skipped:
        print(f"(no per-entry utility to rank: {', '.join(skipped)})")
    if spot:
        _print_blindspot(spot, spot_note)
    elif args.blindspot:
        print(f"\nblindspot: {spot_note}")
    return 0


def _prompt_and_model_arguments(parser, default_model: str) -> None:
    from .model_names import DTYPES

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--model", default=default_model,
                        help="HF hub id, local folder, or tiny-random-<model_type> (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: float32 on the CPU, bfloat16 on a GPU)")


def _chat_argument(parser) -> None:
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the chat template (default); --no-chat tokenises it as is, "
                             "without special tokens")


def cmd_scorers(args) -> int:
    from . import engine
    from .models import load_model
    from .probe import check_fits
    from .spectrum import spectrum

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if not 0.0 <= args.compression < 1.0:
        raise ValueError(f"--compression must be in [0, 1), got {args.compression}")
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha must be in [0, 1], got {args.alpha}")
    prompt = _read_prompt(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    # spectrum's own check speaks of max_new_tokens (steps + 1), which this command has no option for
    check_fits(model, prompt_ids, args.steps, 1, step_name="--steps", doing="")
    result = spectrum(model, prompt_ids, steps=args.steps, layer=args.layer, compression=args.compression,
                      alpha=args.alpha)
    rows, cross = result.table(), result.cross_layer_summary()
    if args.json:
        finite = lambda value: value if math.isfinite(value) else None  # strict JSON has no NaN
        print(json.dumps({"layer": result.layer, "num_layers": result.num_layers, "compression": args.compression,
                          "prompt_len": len(prompt_ids), "steps": result.steps, "cache_sizes": result.cache_sizes,
                          "budgets": result.budgets,
                          "scorers": [{key: finite(value) if isinstance(value, float) else value
                                       for key, value in row.items()} for row in rows],
                          "by_layer": {name: [finite(float(value)) for value in values]
                                       for name, values in result.layer_profile().items()},
                          **{key: finite(value) for key, value in cross.items()}}))
        return 0
    span = lambda first, last: f"{first}" if first == last else f"{first}-{last}"
    sizes, keep = result.cache_sizes, result.budgets
    print(f"scorers against attention over decode steps {span(1, result.steps[-1])} of a full-cache greedy run "
          f"({span(sizes[0], sizes[-1])} entries); top-B at {100 * (1 - args.compression):.3g}% "  # 0.1%, not 0%
          f"(B = {span(keep[0], keep[-1])})")
    level = f"layer {result.layer} of {result.num_layers}"
    print(f"{'':<12}{level:^20}{'InertiaKV utility':^20}")
    print(f"{'scorer':<12}" + f"{'Spearman':>10}{'Jaccard':>10}" * 2)
    for row in rows:
        print(f"{row['scorer']:<12}{row['layer_spearman']:>10.3f}{row['layer_jaccard']:>10.3f}"
              f"{row['utility_spearman']:>10.3f}{row['utility_jaccard']:>10.3f}")
    if args.by_layer:
        profile = result.layer_profile()
        print("\nSpearman with attention at each layer (mean over steps)")
        print(f"{'layer':<8}" + "".join(f"{name:>11}" for name in profile))
        for index in range(result.num_layers):
            print(f"{index:<8}" + "".join(f"{values[index]:>11.3f}" for values in profile.values()))
    print(f"\ncross-layer agreement of attention: top-B Jaccard between layers {cross['cross_layer_jaccard']:.3f} "
          f"(sd over layer pairs {cross['cross_layer_jaccard_std']:.3f}); layer {result.layer}'s top-B churn "
          f"between steps {cross['layer_churn']:.3f}")
    return 0


def _blindspot_json(spot) -> dict:
    def finite(value: float) -> float | None:  # strict JSON has no NaN or Infinity
        return value if math.isfinite(value) else None

    return {"grid_entries": spot.grid_entries.tolist(), "grid_high_damage": spot.grid_high.tolist(),
            "entries_in": spot.entries_in, "high_damage_in": spot.high_damage_in, "entries_out": spot.entries_out,
            "high_damage_out": spot.high_damage_out, "wilson": [finite(v) for v in spot.wilson],
            "enrichment": finite(spot.enrichment), "fisher_p": finite(spot.fisher_p)}


def _print_blindspot(spot, note: str) -> None:
    """AvoKV-E Fig. 1(a) as a table: high-damage / entries per (payload rank, read-pressure rank) bin."""
    bins = spot.grid_entries.shape[0]
    edges = [f"{i / bins:.1f}-{(i + 1) / bins:.1f}" for i in range(bins)]
    print(f"\nblindspot (AvoKV-E Fig. 1a): high-damage entries / entries, by read-pressure rank N(p) (columns) "
          f"and payload rank N(b) (rows); {note}")
    corner = "N(b) \\ N(p)"
    print(f"{corner:<12}" + "".join(f"{edge:>10}" for edge in edges))
    for row in reversed(range(bins)):
        print(f"{edges[row]:<12}" + "".join(f"{f'{spot.grid_high[row, col]}/{spot.grid_entries[row, col]}':>10}"
                                            for col in range(bins)))
    print(spot.summary())


def cmd_trace(args) -> int:
    """A saved run (``kvviz generate --trace``, the app's download): what it was, its diagnostics, and what
    happened to the tokens ``--follow`` names."""
    from . import diagnostics
    from .trace import Trace, budget_note, checkpoint_note, run_note, time_split

    if args.follow is not None and not args.follow.strip():  # e.g. an unset shell variable: not the summary
        raise ValueError("--follow is empty; give text to find in the tokens (e.g. 7342519) or positions (#12, "
                         "#40-45), or leave --follow out for the run's summary")
    # Options another view would silently drop: refused before the file is read.
    if args.read_lag and (args.follow or args.csv):
        given = " and ".join(flag for flag, on in (("--follow", args.follow), ("--csv", args.csv)) if on)
        raise ValueError(f"--read-lag prints its own table over every generated entry, which {given} would not "
                         f"change: drop {given}, or run it without --read-lag")
    if args.csv and not args.follow:
        raise ValueError("--csv prints the followed tokens' steps; add --follow TEXT_OR_POSITIONS")
    trace = Trace.load(args.file)
    steps = trace.decode_steps
    if args.read_lag:
        return _print_read_lags(trace)
    if not args.follow:
        params = ", ".join(f"{key}={value}" for key, value in trace.params.items())
        print(f"{trace.policy}" + (f" ({params})" if params else "") + f"{run_note(trace)}: "
              f"prompt {trace.prompt_len} tokens, {budget_note(trace)}, {len(steps)} decode steps, "
              f"{sum(e.evicted.size for e in trace.events)} evictions"
              + (f", stopped (of {trace.max_new_tokens} new tokens asked for)" if trace.stopped else ""))
        if trace.prompt:  # recorded since traces keep the text they ran from
            shown = trace.prompt if len(trace.prompt) <= 72 else trace.prompt[:69] + "..."
            print(f"prompt ({'through the chat template' if trace.chat else 'as is'}): {shown!r}")
        note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over budget, if it did
        if note:
            print(note)
        seconds = time_split(trace.events)
        total = sum(seconds.values())
        if total:
            print(f"decode {len(steps) / total:.1f} tok/s {WITHOUT_PREFILL}: " + ", ".join(
                f"{part} {value / total:.0%}" for part, value in seconds.items()))
        values = diagnostics.summary(trace)
        for name, value in values.items():
            print(f"{name.replace('_', ' '):<24}{'n/a' if np.isnan(value) else f'{value:.4f}'}")
        if any(np.isnan(value) for value in values.values()):
            print(f"({diagnostics.NOT_AVAILABLE})")
        decided = [e.step for e in trace.events if e.components]
        if decided:
            print(f"terms recorded at {len(decided)} decision(s), steps {', '.join(map(str, decided[:8]))}"
                  + (" ..." if len(decided) > 8 else ""))
        return 0
    tokens = _trace_tokens(trace, args.model)
    positions, note = diagnostics.find_positions(tokens, args.follow)
    history = diagnostics.token_history(trace.events, positions)
    history.insert(2, "token", [tokens[p] for p in history["position"]])
    if args.csv:  # %g: a rank is 165, not 165.0 (tied ranks share their mean: 30.5)
        print(history.to_csv(index=False, float_format="%.10g"), end="")
        return 0
    crossings = diagnostics.boundary_crossings(history, trace.budget)
    print(f"{note}{len(positions)} position(s); {budget_note(trace)}; ranks count from 1 = most useful")
    print(f"{'position':>8}  {'token':<12}{'fate':<20}{'raw crossed B':>14}{'utility rank (mean, worst)':>28}")
    for position, rows in history.groupby("position", sort=False):
        gone = rows[rows["evicted"]]
        fate = f"evicted at step {int(gone['step'].iloc[0])}" if len(gone) else (
            "kept" if rows["kept"].iloc[-1] else "never cached")
        ranked = rows.loc[rows["step"] >= 1, "utility_rank"].dropna()
        rank = f"{ranked.mean():.1f}, {ranked.max():g}" if len(ranked) else "-"
        raw = crossings[position] if rows["raw_rank"].notna().any() else "-"
        print(f"{position:>8}  {repr(tokens[position])[:11]:<12}{fate:<20}{raw:>14}{rank:>28}")
    return 0


def _print_read_lags(trace) -> int:
    """AvoKV-E Fig. 1(b): when generated entries are first strongly read, split by how much they were read at first."""
    from . import diagnostics

    record = "kvviz generate --policy inertia --budget 100000 --max-new-tokens 256 --trace F"
    if not diagnostics.scores_attention(trace.policy, trace.params):
        scorer = f" (scorer {trace.params['scorer']})" if "scorer" in trace.params else ""
        raise ValueError(f"{trace.policy}{scorer} does not record attention as its per-step score; record a run "
                         f"of a policy that does, e.g. {record}")
    lags = diagnostics.read_lags(trace.events, trace.prompt_len)
    if not lags.positions.size:
        raise ValueError(f"no generated entry has {lags.horizon} later queries in this trace ({len(trace.decode_steps)} "
                         f"decode steps): record a longer run, e.g. {record}")
    split = diagnostics.read_lag_split(lags)
    print(f"read lags (AvoKV-E Fig. 1b): {lags.positions.size} generated entries with {lags.horizon} later queries "
          f"({lags.dropped} too near the end left out); a strong read reaches 85% of the entry's peak attention")
    times = list(split["low"]["read_by"])
    print(f"{'first read':<28}{'entries':>8}" + "".join(f"{f'F({t})':>8}" for t in times) + f"{'never':>8}")
    for name, label in (("low", "N(early) <= 0.4 (rarely)"), ("high", "N(early) >= 0.6 (well)")):
        group = split[name]
        print(f"{label:<28}{group['entries']:>8}" + "".join(f"{group['read_by'][t]:>8.0%}" for t in times)
              + f"{group['never']:>8.0%}")
    print(f"one-sided KS p that the well read are read sooner: {split['ks_p']:.3g}")
    first = times[0]
    if all(split[name]["read_by"][first] == 1.0 for name in ("low", "high") if split[name]["entries"]):
        # The next query is each entry's peak reader (common on a small model): nothing is left to split.
        print(f"every entry was strongly read at lag {first}: the split says nothing about delayed reads here; "
              "a larger model or a longer run reads later")
    return 0


def _trace_tokens(trace, model_name: str | None) -> list[str]:
    """Each position's text: the prompt through the run's tokenizer (no weights; ids where it cannot load),
    then the generated tokens as the run recorded them."""
    try:
        from .models import load_tokenizer

        tokenizer = load_tokenizer(model_name or trace.model)
        prompt = [tokenizer.decode([i]) for i in trace.prompt_ids]
    except Exception as error:  # noqa: BLE001 -- the trace is still readable by positions
        print(f"kvviz: prompt tokens shown as ids ({model_name or trace.model or 'no model'} did not load: "
              f"{type(error).__name__}; --model names another)", file=sys.stderr)
        prompt = [f"⟨{i}⟩" for i in trace.prompt_ids]
    return prompt + [event.text for event in trace.events]


def cmd_policies(args) -> int:
    from .policies import REGISTRY

    if args.json:
        print(json.dumps([{"name": s.name, "display": s.display, "family": s.family, "description": s.description,
                           "paper": s.paper, "parameters": s.parameters()} for s in REGISTRY.values()], default=str))
        return 0
    width = max(len(name) for name in REGISTRY)
    families = max(len(spec.family) for spec in REGISTRY.values())
    for spec in REGISTRY.values():
        print(f"{spec.name:<{width}} {spec.family:<{families}} {spec.description}")
        for p in spec.parameters():
            bounds = f"choices {list(p['choices'])}" if p.get("choices") else (
                f"range [{p['low']}, {p['high']}]" if p.get("low") is not None else "")
            parts = [f"--param {p['name']}={p['default']}", bounds, p.get("help", "")]
            print(f"{'':<16}" + "  ".join(part for part in parts if part))  # no wide gap where a part is empty
    return 0


def cmd_bench(args) -> int:
    from .bench import probe_cost, speed, sweep

    if args.bench == "run":
        from . import store

        config = sweep.load_config(args.config)
        # The store's folder, not ./results_db: wherever this runs from, `kvviz results` reads what it writes.
        out = Path(args.out) if args.out else store.ROOT / config["name"]
        if args.status:
            sweep.check_store(config, out)  # counts against another config's rows would mean nothing
            progress = sweep.status(config, out)
            # with absolute budgets, also how far each cut is: the full cache, each ρ, each B=...
            by_cut = sweep.status(config, out, by_cut=True) \
                if any(budgets for _, budgets in sweep.setting_grids(config).values()) else {}
            for task, (finished, total) in progress.items():
                print(f"{config['name']} {task}: {finished} of {total} cells")
                for (_, cut), (finished, total) in ((key, value) for key, value in by_cut.items() if key[0] == task):
                    print(f"  {cut}: {finished} of {total} cells")
            finished, total = (sum(v[i] for v in progress.values()) for i in (0, 1))
            print(f"{config['name']}: {finished} of {total} cells done")
            return 0
        # Options the chosen backend would silently ignore: ray deals out the samples itself, local needs no cluster.
        if args.backend == "ray" and (args.shard or args.shards != 1):
            raise ValueError("--backend ray runs every sample as its own task on the cluster: drop --shards and --shard")
        if args.ray_address and args.backend != "ray":
            raise ValueError("--ray-address applies to --backend ray only; add --backend ray or drop --ray-address")
        sweep.check_shard(args.shard if args.backend == "local" else 0, args.shards)
        text = _sweep_folder(config, args.config, out)
        if args.backend == "ray":
            written = sweep.run_ray(config, out, address=args.ray_address, config_text=text)
        else:
            written = sweep.run(config, out, shard=(args.shard, args.shards), config_text=text)
        print(f"{written} new rows in {out}")
        return 0
    if args.bench == "ranking":
        return _bench_ranking(args)
    if args.out:  # refused before the model loads, not by a traceback after the measurements
        _check_writable(args.out, "--out", "results.jsonl")
    return {"speed": speed.main, "probe": probe_cost.main}[args.bench](args)


def _bench_ranking(args) -> int:
    """Run (or resume, or count) a damage-ranking sweep into the store's folder for it."""
    from . import store
    from .bench import ranking, sweep

    config = ranking.load_config(args.config)
    out = Path(args.out) if args.out else store.ROOT / config["name"]
    sweep.check_store(config, out)  # rows of another config in that folder: neither counted nor added to
    if args.status:
        progress = ranking.status(config, out)
        for task, (finished, total) in progress.items():
            print(f"{config['name']} {task}: {finished} of {total} traces")
        return 0
    text = _sweep_folder(config, args.config, out)
    written = ranking.run(config, out, config_text=text)
    print(f"{written} new rows in {out}")
    return 0


def _sweep_folder(config: dict, config_path: str, out: Path) -> bytes:
    """Make a sweep's folder, refusing a file in its place or a folder of another config's rows (before the run
    saves this config over the config that made them); returns the config file's text, which the run saves."""
    from .bench import sweep

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; a sweep writes a folder (its rows and config), so "
                         "give a folder path")
    sweep.check_store(config, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"the sweep's folder {str(out)!r} cannot be made ({error.strerror or error}); "
                         "choose another --out") from None
    return Path(config_path).read_bytes()


def cmd_results(args) -> int:
    """Print the stored sweeps as tables: mean score (and samples) per policy x compression (or absolute
    budget) for each task."""
    import pandas as pd

    from .store import ROOT, Store, setting_names, suite_notes

    root = Path(args.root) if args.root else ROOT
    store = Store(root)
    for problem in store.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not store.shards:  # nothing to filter: say where results were looked for, not "no rows for these filters"
        raise ValueError(f"no sweep results under {root} (expected {root}/<sweep>/rows*.jsonl, or "
                         f"{root}/rows*.jsonl for one sweep's folder); run `kvviz bench run CONFIG` or pass --root")
    policies = [name.strip() for name in args.policies.split(",") if name.strip()] if args.policies else None
    if policies == []:  # e.g. --policies , : otherwise "no rows for these filters together"
        raise ValueError("--policies names no policy; give registry names, e.g. --policies inertia,tova, or leave "
                         "it out for every policy")
    sweeps = [name.strip() for name in args.sweeps.split(",") if name.strip()] if args.sweeps else None
    if sweeps == []:
        raise ValueError("--sweeps names no sweep; give folder names under results_db/, e.g. --sweeps sweep-2k, or "
                         "leave it out for every sweep")
    _check_filters(store, root, {"--task": ("task", [args.task] if args.task else []),
                                 "--model": ("model", [args.model] if args.model else []),
                                 "--policies": ("policy", policies or []),
                                 "--sweeps": ("sweep", sweeps or [])})
    args.sweep_list = sweeps  # for the paired and ranking tables
    if args.paper and (args.vs or args.ranking):
        raise ValueError(f"--paper and {'--vs' if args.vs else '--ranking'} are two different tables; give one of "
                         "them")
    if args.settings and args.paper:
        raise ValueError("--paper compares each policy at its defaults: drop --settings")
    ignored = [flag for flag, value in (("--task", args.task), ("--model", args.model), ("--source", args.source),
                                        ("--sweeps", args.sweeps)) if value]
    if args.paper and ignored:  # the comparison is every model's paper and measured rows over the suite's tasks
        raise ValueError(f"--paper compares every model's paper and measured rows over all of {args.paper}'s tasks, "
                         f"which {' and '.join(ignored)} would not change: drop {' and '.join(ignored)} "
                         "(--policies applies)")
    if args.paper:
        frame = store.paper_comparison(args.paper, policies)
        if frame.empty:
            raise ValueError(f"no paper and measured rows on {args.paper!r}; "
                             f"comparable: {', '.join(store.comparable_suites()) or 'none'}")
        if args.csv:
            frame.to_csv(sys.stdout, index=False)
            return 0
        table = frame.pivot_table(index=["origin", "model", "policy"], columns="compression", values="relative")
        print(f"{args.paper}: score / full-cache score (paper: printed aggregate; measured: mean over tasks)")
        print(table.round(3).to_string())
        for note in suite_notes(frame, store.left_out_of_suite(args.paper, policies), args.paper):
            print(note)
        return 0
    if args.ranking:
        return _print_ranking_paired(store, root, args, policies) if args.vs else _print_ranking(store, args, policies)
    if args.vs:
        return _print_paired(store, root, args, policies)
    frame = store.quality_vs_compression(args.task, args.model, policies, args.source, settings=args.settings,
                                         sweeps=sweeps)
    others = store.other_settings(args.task, args.model, policies, args.source, sweeps)
    others_here = store.other_settings(args.task, args.model, policies, args.source, sweeps, per_table=True)
    if frame.empty and len(others):  # e.g. AvoKV-E run only at interval=16
        raise ValueError("these filters match only rows with non-default parameters (" + _settings_listed(others)
                         + "): add --settings to list them")
    if frame.empty and len(store.damage_ranking(args.task, args.model, policies, args.source, True, sweeps)):
        raise ValueError("these filters match only damage-ranking rows (AUROC, AP, ...: how a policy ranks the "
                         "damage of removing one entry): add --ranking to print them")
    if frame.empty:  # each value is stored (checked above), but not in combination
        raise ValueError("no rows for these filters together; drop one, or see `kvviz results --help`")
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return 0
    measured = store.speed_vs_quality(args.task, args.model, policies, settings=args.settings, sweeps=sweeps)
    # Compression and budget cells come from different sweeps, run at other times under other loads: a mean
    # over both would compare nothing, so each kind gets its own speed column where a table holds both
    kinds = measured.assign(kind=measured.absolute_budget.isna().map({True: "ρ", False: "B"}))
    speed = kinds.groupby(["model", "task", "policy", "kind"]).decode_tok_s.mean()
    for (source, model, task), part in frame.groupby(["source", "model", "task"]):
        draws = int(part.draws.max())
        digits = _score_digits(part.score)
        full = part[part.policy == "full"]
        part = part[part.policy != "full"]
        cells = part.assign(cell=[f"{s:.{digits}f} ({n})" for s, n in zip(part.score, part.samples)])
        table = _by_cut(cells, "cell")
        if source == "measured":
            present = [kind for kind in ("ρ", "B") if (part.absolute_budget.isna() if kind == "ρ"
                                                         else part.absolute_budget.notna()).any()]
            for kind in present:  # decode tok/s, the mean over the row's cells of that kind
                table["tok/s" if len(present) == 1 else f"tok/s ({kind} cells)"] = [
                    f"{speed.get((model, task, p, kind), float('nan')):.2f}" for p in table.index]
        # The count in brackets is samples for a sweep, but how many printed figures a paper cell averages (one
        # number can be printed in several tables): said once per table, not guessed.
        counted = "mean score (samples)" if source == "measured" else "mean printed score (figures)"
        print(f"\n{task} · {model} · {source} · {counted}"
              + (f" · full cache {full.score.iloc[0]:.{digits}f} ({full.samples.iloc[0]})" if len(full) else "")
              + (f" · each sample the mean of up to {draws} sampled draws" if draws > 1 else ""))
        with pd.option_context("display.width", 200):
            print(table.to_string())
        if source == "measured":
            _print_cache_over_budget(measured[(measured.model == model) & (measured.task == task)])
        # Without --settings each table is every policy at its defaults: say, under it, what it hides.
        hidden = others_here[(others_here.model == model) & (others_here.task == task)
                             & (others_here.source == source)] if not args.settings else others_here.iloc[0:0]
        if len(hidden):
            print(f"{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden "
                  f"({', '.join(setting_names(hidden.policy, hidden.setting))}): use --settings")
    if args.source != "paper":  # papers print no per-run max-length hits
        _print_max_length_hits(store.max_length_hits(args.task, args.model, policies, settings=args.settings,
                                                     sweeps=sweeps))
    # The whole list, and where else the settings are shown, once under all the tables.
    if len(others) and not args.settings:
        print(f"\nnot in these tables: {int(others.rows.sum())} rows with non-default parameters (policy, setting, "
              f"rows): {_settings_listed(others)}; --settings lists each setting as its own row, --vs POLICY "
              "--settings pairs them, and the app's Results tab plots the α and refresh sweeps")
    return 0


RANKING_COLUMNS = {"auroc": "AUROC", "ap": "AP", "topk_recall": "top-k rec", "false_safe_rate": "false-safe",
                   "spearman": "Spearman"}


def _ranking_frame(store, args, policies):
    """The damage-ranking rows for the filters, or a ValueError saying whether another filter has some."""
    frame = store.damage_ranking(args.task, args.model, policies, args.source, settings=args.settings,
                                 sweeps=args.sweep_list)
    if frame.empty:
        if len(store.damage_ranking(settings=True)):
            raise ValueError("no damage-ranking rows for these filters together (`kvviz results --ranking "
                             "--settings` lists every one); drop a filter")
        raise ValueError("no damage-ranking rows stored; run `kvviz bench ranking configs/ranking-arithmetic.toml`")
    return frame


def _print_ranking(store, args, policies) -> int:
    """Per source, model, task and sweep, each policy's damage ranking (AvoKV-E's Table 3 metrics): a measured
    cell is the mean over traces ± its standard error, a paper cell the printed figure."""
    import pandas as pd

    from .store import ranking_caveats

    frame = _ranking_frame(store, args, policies)
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return 0
    frame = frame.assign(paper=frame.paper.fillna(""))  # measured rows have none; groupby drops a null key
    for (source, _, model, task, sweep), part in frame.groupby(["source", "paper", "model", "task", "sweep"],
                                                               sort=False):
        measured = source == "measured"
        cells = part.assign(cell=[f"{score:.3f}" + (f" ± {stderr:.3f}" if measured and stderr == stderr else "")
                                  for score, stderr in zip(part.score, part.stderr)])
        table = cells.pivot(index="policy", columns="metric", values="cell")
        table = table[[metric for metric in RANKING_COLUMNS if metric in table]].rename(columns=RANKING_COLUMNS)
        # by AUROC, best first; a policy with no AUROC row (undefined in every trace) after them
        by_auroc = list(part[part.metric == "auroc"].sort_values("score", ascending=False).policy)
        table = table.loc[by_auroc + sorted(set(table.index) - set(by_auroc))]
        if measured:
            counts = part.groupby("policy")[["traces", "candidates"]].max()
            table["traces"] = counts.traces.astype(int)
            table["ranked"] = counts.candidates.map(lambda count: "?" if pd.isna(count) else int(count))
            caveats = ranking_caveats(part).iloc[0]
            past_end, by_step = int(caveats.past_end), int(caveats.ended_by_step)
            heading = (f"{sweep}: mean over traces ± standard error; probed at step {part.step.iloc[0]}; ranked: "
                       "entries every policy judged, summed over traces"
                       + (f", {caveats.prompt_share:.0%} of them the prompt's"
                          if caveats.prompt_share == caveats.prompt_share else "")
                       + (f"; in {past_end} trace(s) the answer ended within or before the replay"
                          + (f" ({by_step} at or before the step)" if by_step else "") if past_end else ""))
        else:
            # what every row's note says after naming its own row ("row 'attention only'; ranking vs ...")
            shared = {re.sub(r"^row '[^']*'; ", "", note) for note in part.notes.dropna()}
            heading = part.paper.iloc[0] + (f": {shared.pop()}" if len(shared) == 1 else "")
        print(f"\n{task} · {model} · {source} · damage ranking ({heading})")
        with pd.option_context("display.width", 200, "display.max_colwidth", 40):
            print(table.to_string())
    if not args.settings:  # as the quality tables say what they leave out
        every = store.damage_ranking(args.task, args.model, policies, args.source, settings=True,
                                     sweeps=args.sweep_list)
        hidden = sorted(set(every.policy) - set(frame.policy))
        if hidden:
            print(f"\n{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden ({', '.join(hidden)}): "
                  "use --settings")
    print("\n(high damage: the top decile of each trace's oracle damage; top-k rec: its share among the k highest "
          "utilities; false-safe: its share among the k lowest, the first evicted (random: about 0.1); AUROC 0.5 "
          "and Spearman 0 are chance; `--vs POLICY` pairs the policies trace by trace)")
    return 0


def _print_ranking_paired(store, root: Path, args, policies) -> int:
    """Per model, task and sweep, each policy's damage-ranking metrics against ``--vs``'s on the same traces:
    mean Δ, its paired-bootstrap interval, wins/ties/losses and the sign test, as ``--vs`` prints for quality.
    The false-safe rate is better lower, so its Δ is the reduction (reference − policy): a win is a better
    ranking in every column."""
    import pandas as pd

    from .stats import ALPHA, paired_table

    if args.source == "paper":
        raise ValueError("--vs pairs measured traces; the papers print one figure over all their traces: drop "
                         "--source paper")
    if policies and set(policies) <= {args.vs}:
        raise ValueError(f"the policies chosen are only the reference, {args.vs}: add another to --policies, or "
                         "drop it")
    pairs = store.ranking_pairs(args.vs, args.task, args.model, policies, settings=args.settings,
                                sweeps=args.sweep_list)
    if pairs.empty:
        ranked = sorted(set(store.damage_ranking(source="measured").policy))
        raise ValueError(f"--vs {args.vs}: no measured damage-ranking traces pair with it under these filters; "
                         f"ranked: {', '.join(ranked) or 'none'} (under {root})")
    lower_better = pairs.metric == "false_safe_rate"
    pairs = pairs.assign(score=pairs.score.where(~lower_better, -pairs.score),
                         reference_score=pairs.reference_score.where(~lower_better, -pairs.reference_score))
    table = paired_table(pairs).merge(pairs[["task", "metric"]].drop_duplicates(), on="task")
    if args.csv:
        table.to_csv(sys.stdout, index=False)
        return 0
    print(f"damage ranking, paired difference policy − {args.vs} on the same traces (false-safe: {args.vs} − "
          "policy, the reduction, so that in every column + and a win are the better ranking): mean Δ [95% "
          f"paired-bootstrap interval] wins/ties/losses; * the exact sign test says they differ (p < {ALPHA}; "
          "each test on its own: among many policies and metrics, some stars are chance)")
    table = table.assign(task=table.task.str.rsplit(": ", n=1).str[0])
    columns = {**RANKING_COLUMNS, "false_safe_rate": "false-safe ↓"}
    for (model, task), part in table.groupby(["model", "task"], sort=False):
        cells = part.assign(cell=[f"{row.delta:+.3f} [{row.low:+.3f}, {row.high:+.3f}] {row.wins}/{row.ties}/"
                                  f"{row.losses}" + (" *" if row.significant else "") for row in part.itertuples()])
        grid = cells.pivot(index="policy", columns="metric", values="cell")
        grid = grid[[metric for metric in columns if metric in grid]].rename(columns=columns)
        print(f"\n{task} · {model} · vs {args.vs} ({int(part.pairs.max())} traces)")
        with pd.option_context("display.width", 250, "display.max_colwidth", 40):
            print(grid.to_string())
    return 0


def _score_digits(scores) -> int:
    """Decimals to print scores with: 3 for 0-1 metrics (a paper's 0.288 and 0.294 are not both 0.29), 2 on
    a 0-100 scale."""
    return 3 if scores.dropna().abs().max() <= 1 else 2


def _settings_listed(others) -> str:
    """The first eight (policy, setting, rows) of :meth:`Store.other_settings`, as one phrase."""
    from .store import setting_names

    names = setting_names(others.policy, others.setting)
    listed = ", ".join(f"{name} ({rows})" for name, rows in zip(names[:8], others.rows[:8]))
    return listed + (f", and {len(others) - 8} more" if len(others) > 8 else "")


def _print_paired(store, root: Path, args, policies) -> int:
    """Per task and model, each policy's paired difference to ``--vs`` on the same samples, policy x compression."""
    import pandas as pd

    from .stats import ALPHA, paired_table
    from .store import QUALITY_METRICS, setting_names

    measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
    reference_policy, reference_setting = store.setting_of(args.vs)  # "avokv lambda_b=0": one of its settings
    if reference_policy not in measured:  # paper rows name policies too, but have no samples to pair
        raise ValueError(f"--vs {args.vs}: no measured quality rows of that policy under {root}"
                         + (" (only damage-ranking rows: add --ranking)" if args.vs in store.options(
                             "policy", source="measured") else "") + f"; measured: {', '.join(measured) or 'none'}")
    if args.source == "paper":
        raise ValueError("--vs pairs measured samples; the papers print aggregates, not samples: drop --source paper")
    sweeps = args.sweep_list
    table = paired_table(store.paired_scores(args.vs, args.task, args.model, policies, settings=args.settings,
                                             sweeps=sweeps))
    if table.empty and reference_setting == "{}" and store.quality_vs_compression(
            args.task, args.model, [args.vs], "measured", sweeps=sweeps).empty:
        others = store.other_settings(args.task, args.model, [args.vs], "measured", sweeps)
        if len(others):  # pairs are made against the reference at its defaults
            raise ValueError(f"--vs {args.vs}: under these filters {args.vs} ran only with non-default parameters "
                             f"({_settings_listed(others)}), and pairs are made against its defaults; pick a "
                             f"reference run at its defaults, or name a setting (e.g. --vs "
                             f"'{setting_names(others.policy, others.setting)[0]}')")
    if table.empty:
        raise ValueError(f"no measured samples pair with {args.vs} under these filters (same task, sample and "
                         f"compression); drop a filter or pick another --vs")
    if args.csv:
        table.to_csv(sys.stdout, index=False)
        return 0
    print(f"paired difference policy − {args.vs} on the same samples: mean Δ [95% paired-bootstrap interval] "
          f"wins/ties/losses; * the exact sign test says they differ (p < {ALPHA})")
    # The reference's cache counts as much as the policies': every name of the table, the reference's too
    held = store.speed_vs_quality(args.task, args.model, settings=args.settings or reference_setting != "{}",
                                  sweeps=sweeps)
    for (model, task), part in table.groupby(["model", "task"], sort=False):
        cells = part.assign(cell=[
            f"{row.delta:+.3f} [{row.low:+.3f}, {row.high:+.3f}] {row.wins}/{row.ties}/{row.losses}"
            + (" *" if row.significant else "") for row in part.itertuples()])
        covered = part.tasks.iloc[0]
        print(f"\n{task}" + (f" ({covered})" if covered != task else "") + f" · {model} · vs {args.vs}")
        with pd.option_context("display.width", 250):
            print(_by_cut(cells, "cell").to_string())
        _print_cache_over_budget(held[(held.model == model) & (held.task == task)
                                      & held.policy.isin([*part.policy, args.vs])])
    return 0


def _print_cache_over_budget(frame) -> None:
    """Name the cells whose policy held well over its nominal budget (:func:`kvviz.store.held_over_note`):
    one B is not one memory size, and AvoKV-E compares at matched measured cache sizes."""
    from .store import held_over_note

    note = held_over_note(frame)
    if note:
        print(note)
    # A budget no cell of a column ever filled: its cells are the full cache's run under the policies' names
    budgets = frame[frame.absolute_budget.notna() & (frame.policy != "full")]
    unfilled = [f"B={int(budget)} (largest cache {part.decode_cache.max():.0f})"
                for budget, part in budgets.groupby("absolute_budget") if (part.decode_cache < budget).all()]
    if unfilled:
        print(f"never filled: {', '.join(unfilled)}: those cells evicted nothing, so they ran as the full cache")


def _by_cut(part, values: str):
    """``values`` per policy (rows) and cut of the cache (columns): each compression ρ as before, then each
    absolute budget as ``B=...``, which a ρ could otherwise be mistaken for; empty where a policy has none."""
    import pandas as pd

    budget = part.absolute_budget.notna()
    tables = []
    if (~budget).any():  # each ρ written as typed (0.5), the same in every table (pandas wrote 0.50 in some)
        table = part[~budget].pivot(index="policy", columns="compression", values=values)
        tables.append(table.set_axis([f"{rho:g}" for rho in table.columns], axis=1))
    if budget.any():
        table = part[budget].pivot(index="policy", columns="absolute_budget", values=values)
        tables.append(table.set_axis([f"B={int(tokens)}" for tokens in table.columns], axis=1))
    table = pd.concat(tables, axis=1).fillna("")
    table.columns.name = "compression" if not budget.any() else "KV budget" if budget.all() else "compression / budget"
    return table


def _print_max_length_hits(frame) -> None:
    """Per task and model, the share of generations that reached max_new_tokens instead of ending, policy x
    compression (or absolute budget); nothing when no selected row records it (rows written before the field)."""
    import pandas as pd

    if not frame.recorded.sum():
        return
    print("\nmax-length hits: share of generations that reached max_new_tokens instead of ending "
          "(hits/rows that record it)")
    for (model, task), part in frame[frame.recorded > 0].groupby(["model", "task"]):
        full = part[part.policy == "full"]
        part = part[part.policy != "full"]
        print(f"\n{task} · {model} · max-length hits" + (
            f" · full cache {full.hit_rate.iloc[0]:.2f} ({full.hits.iloc[0]}/{full.recorded.iloc[0]})" if len(full)
            else ""))
        if len(part):
            cells = part.assign(cell=[f"{rate:.2f} ({hits}/{recorded})"
                                      for rate, hits, recorded in zip(part.hit_rate, part.hits, part.recorded)])
            with pd.option_context("display.width", 200):
                print(_by_cut(cells, "cell").to_string())
    unrecorded = int((frame.rows - frame.recorded).sum())
    if unrecorded:
        print(f"\nnot in the max-length tables: {unrecorded} rows written before sweeps recorded hit_max_tokens")


def _check_filters(store, root: Path, filters: dict[str, tuple[str, list[str]]]) -> None:
    """Refuse a filter value the store does not hold, listing the values it does.

    ``filters`` maps an option to the store column it filters and the values given (empty: not given).
    """
    for option, (column, values) in filters.items():
        stored = store.options(column) if values else []
        unknown = [value for value in values if value not in stored]
        if unknown:
            raise ValueError(f"{option} {', '.join(unknown)}: not in the results under {root}; stored: "
                             f"{', '.join(stored) or 'none'}")


def cmd_serve(args) -> int:
    from .ui.app import launch
    from .ui.config import Limits

    overrides = {"device": args.device, "dtype": args.dtype, "figures_per_second": args.figures_per_second,
                 "host": args.host, "port": args.port}
    if args.models is not None:
        overrides["models"] = tuple(dict.fromkeys(name.strip() for name in args.models.split(",") if name.strip()))
    # The same app as `python app.py`, the flags over the environment.
    launch(Limits.from_env(**{key: value for key, value in overrides.items() if value is not None}))
    return 0


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (what to change), not a usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from .model_names import DEFAULT_MODEL, DTYPES

    parser = _Parser(prog="kvviz", description="Explore decoding-time KV-cache eviction.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    gen = sub.add_parser("generate", help="generate text with an eviction policy")
    _prompt_and_model_arguments(gen, DEFAULT_MODEL)
    gen.add_argument("--policy", default="inertia", help="a name from `kvviz policies` (default: %(default)s)")
    budget = gen.add_mutually_exclusive_group()
    budget.add_argument("--compression", type=float,
                        help="rho in [0, 1): budget B = floor((1 - rho) x prompt length); default 0.9 when neither "
                             "this nor --budget is given (except --policy full: no eviction). The library's "
                             "kvviz.run defaults to no compression instead")
    budget.add_argument("--budget", type=int, help="absolute cache budget in tokens (instead of --compression)")
    gen.add_argument("--alpha", type=float, help="EMA coefficient in [0, 1] (InertiaKV family; default: the policy's, "
                                                 "see `kvviz policies`)")
    gen.add_argument("--refresh", type=int, help="score every r-th step (InertiaKV family; 1 = every step, 0 = "
                                                 "score-free; default: the policy's)")
    gen.add_argument("--param", action="append", metavar="NAME=VALUE",
                     help="any other policy parameter, repeatable (names and ranges: `kvviz policies`)")
    _chat_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling, with --temperature (default 1: the whole "
                                                 "distribution)")
    gen.add_argument("--seed", type=int, help="sampling seed, with --temperature (default 0)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--trace", help="save the per-step trace to this parquet file")
    gen.add_argument("--static", action="store_true",
                     help="InertiaKV on the static decode path (greedy; a CUDA graph per step on a GPU)")
    gen.add_argument("--compile", action="store_true", help="with --static: fuse each layer with torch.compile")
    gen.set_defaults(func=cmd_generate)

    pol = sub.add_parser("policies", help="list the policy registry")
    pol.add_argument("--json", action="store_true", help="print the registry as one JSON list instead")
    pol.set_defaults(func=cmd_policies)

    probe = sub.add_parser("probe", help="oracle damage probe: which entries hurt to remove, and who ranks them")
    _prompt_and_model_arguments(probe, DEFAULT_MODEL)
    probe.add_argument("--step", type=int, default=8, help="decode step to probe, >= 1 (default: %(default)s)")
    probe.add_argument("--sample", type=int, help="probe a seeded sample of this many entries (default: all)")
    probe.add_argument("--seed", type=int, default=0, help="seed of --sample's draw (default: %(default)s)")
    probe.add_argument("--future", type=int, default=8,
                       help="W_fut: teacher-forced tokens replayed (default: %(default)s)")
    probe.add_argument("--batch", type=int, default=16, help="candidates per forward pass (default: %(default)s)")
    probe.add_argument("--policies", default="inertia,inertia-lazy,tova,h2o,rkv,avokv,keydiff,knorm,recency",
                       help="comma-separated registry names or settings ('avokv delay=32'), or 'all' "
                       "(default: %(default)s)")
    _chat_argument(probe)
    probe.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    probe.add_argument("--blindspot", action="store_true", help="also AvoKV-E's blindspot test (Fig. 1a): "
                       "high-damage share by read-pressure and payload rank, from AvoKV-E's ranks at --step (computed "
                       "apart when avokv is not among --policies; the ranking table lists --policies only)")
    probe.set_defaults(func=cmd_probe)

    sc = sub.add_parser("scorers", help="each scorer's ranking against attention, per layer and through "
                        "the EMA (InertiaKV §5.1), and how much layers agree")
    _prompt_and_model_arguments(sc, DEFAULT_MODEL)
    sc.add_argument("--steps", type=int, default=8,
                    help="decode steps compared, each with the whole cache (default: %(default)s)")
    sc.add_argument("--layer", type=int, help="layer of the per-layer comparison (default: the middle one)")
    sc.add_argument("--compression", type=float, default=0.9,
                    help="rho in [0, 1): top-B sets at B = (1 - rho) x cache size (default: %(default)s)")
    sc.add_argument("--alpha", type=float, default=0.8,
                    help="EMA coefficient in [0, 1] of the utilities compared (default: %(default)s)")
    sc.add_argument("--by-layer", action="store_true", help="also each scorer's Spearman at every layer")
    _chat_argument(sc)
    sc.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    sc.set_defaults(func=cmd_scorers)

    tr = sub.add_parser("trace", help="a saved trace: its diagnostics, or what happened to chosen tokens")
    tr.add_argument("file", help="a parquet trace (kvviz generate --trace, or the app's download)")
    tr.add_argument("--follow", metavar="TEXT_OR_POSITIONS",
                    help="text to find in the tokens (e.g. 7342519) or positions (#12, #40-45)")
    tr.add_argument("--csv", action="store_true", help="with --follow: every step of every followed token as CSV")
    tr.add_argument("--read-lag", action="store_true", help="when generated entries are first strongly read, split "
                    "by their early attention (AvoKV-E Fig. 1b; needs a run that scored every step and kept the cache)")
    tr.add_argument("--model", help="tokenizer for the prompt's text (default: the model the trace names)")
    tr.set_defaults(func=cmd_trace)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from .bench import probe_cost, speed

    speed.add_arguments(bench_sub.add_parser("speed", help="decode speed: generate vs engine policies"))
    probe_cost.add_arguments(bench_sub.add_parser("probe", help="damage-probe cost: batched vs one at a time"))
    run = bench_sub.add_parser("run", help="run (or resume) a sweep from a TOML config")
    run.add_argument("config", help="a sweep's TOML file, e.g. configs/needle-grid.toml")
    run.add_argument("--out", help="folder for rows and config (default: the repository's results_db/<name>, "
                     "kvviz.store.ROOT, where `kvviz results` and the app read; not relative to the current folder)")
    run.add_argument("--shards", type=int, default=1,
                     help="split the samples into this many shards (default: %(default)s)")
    run.add_argument("--shard", type=int, default=0,
                     help="which shard this process runs, 0 to --shards - 1 (default: %(default)s)")
    run.add_argument("--backend", choices=("local", "ray"), default="local",
                     help="ray: run each sample's cells as a Ray task (one GPU each on a cuda config), the rows "
                     "written by this process to rows.jsonl; resumable as local is (default: %(default)s)")
    run.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one on loopback)")
    run.add_argument("--status", action="store_true", help="only print how many cells are done, per task")
    rank = bench_sub.add_parser("ranking", help="run (or resume) a damage-ranking sweep (AvoKV-E's Table 3 "
                                "measured) from a TOML config")
    rank.add_argument("config", help="a ranking sweep's TOML file, e.g. configs/ranking-arithmetic.toml")
    rank.add_argument("--out", help="folder for rows and config (default: the repository's results_db/<name>)")
    rank.add_argument("--status", action="store_true", help="only print how many traces are done, per task")
    bench.set_defaults(func=cmd_bench)

    res = sub.add_parser("results", help="print the stored sweeps (results_db/) as tables")
    res.add_argument("--task", help="one task label, e.g. single_needle")
    res.add_argument("--model", help="one model name")
    res.add_argument("--policies", help="comma-separated registry names")
    res.add_argument("--source", choices=("measured", "paper"), help="only measured or only paper rows")
    res.add_argument("--sweeps", help="comma-separated sweep names (folders under results_db/): only the cells they "
                     "ran, e.g. to compare decode speeds within one run")
    res.add_argument("--paper", metavar="SUITE", help="measured vs paper on this benchmark, e.g. RULER")
    res.add_argument("--vs", metavar="POLICY", help="each policy's paired difference to this one on the same "
                     "samples, with a bootstrap confidence interval and wins/ties/losses, e.g. --vs inertia, or "
                     "to one setting as --settings names it, e.g. --vs 'avokv lambda_b=0'")
    res.add_argument("--settings", action="store_true", help="also every other parameter setting run (the α "
                     "and refresh sweeps, ablations), each its own row such as 'avokv interval=16'; with --vs, "
                     "paired against the reference as --vs names it")
    res.add_argument("--ranking", action="store_true", help="the damage-ranking rows instead (AUROC, AP, top-k "
                     "recall, false-safe rate, Spearman of each policy's utility against oracle damage: AvoKV-E's "
                     "Table 3 and `kvviz bench ranking`)")
    res.add_argument("--csv", action="store_true", help="the long table as CSV instead")
    res.add_argument("--root", help="results folder (default: the repository's results_db/)")
    res.set_defaults(func=cmd_results)

    serve = sub.add_parser("serve", help="start the Gradio app (same as python app.py)")
    serve.add_argument("--device", help="where every model runs: cpu, cuda or cuda:N (default: $KVVIZ_DEVICE or cpu)")
    serve.add_argument("--dtype", choices=DTYPES,
                       help="model dtype (default: $KVVIZ_DTYPE, else float32 on the CPU, bfloat16 on a GPU)")
    serve.add_argument("--models", help="the models offered, comma-separated, the first the default (default: "
                                        "$KVVIZ_DEFAULT_MODEL and $KVVIZ_MODELS)")
    serve.add_argument("--figures-per-second", type=float,
                       help="most redraws a second of a streaming run's heatmap, 0 to 60; 0 for none until it ends "
                            "(default: $KVVIZ_FIGURES_PER_SECOND, else 10; fewer keep a slow browser responsive)")
    serve.add_argument("--host", help="address to listen on; 0.0.0.0 for every interface (default: "
                                      "$GRADIO_SERVER_NAME, else 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: $GRADIO_SERVER_PORT, else 7860)")
    serve.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvviz: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvviz trace F --follow X | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
