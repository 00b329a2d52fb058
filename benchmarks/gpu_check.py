"""The one prepared script for a GPU session (issue 6): exactness of the static path on the device, then speed.

1. For tiny random Llama / Qwen2 models (float32) on the device: the static decode path -- eager, replayed
   from CUDA graphs, and with each layer through ``torch.compile`` -- against the reference engine on the
   same device: same tokens and keep sets at every step for InertiaKV (r = 1), InertiaKV-Lazy (r = 4) and
   Score-Free.  One JSON line per case.
2. The same tiny Llama in bfloat16 (the speed runs' dtype, where the static step takes float32 logits
   straight from the half-precision keys): agreement with the reference engine, reported, not required
   (two different attention kernels round differently in bfloat16).
3. ``kvviz bench speed --device DEVICE --config CONFIG --contexts ...``: its JSON lines, unchanged, with
   a time limit so that the whole script ends within ``--budget-s`` (a context starts only if one as long
   as the last would still end in time); then a ``targets`` line (issue 6's three targets at the first
   context) and, if time is left, the ``--also`` config at that context.

First of all, a one-line ``torch.compile`` probe: without a working compiler toolchain on the machine the
compiled cases are left out (and said so) rather than each failing slowly.

Needs only torch, transformers, pandas, pyarrow and tqdm (no pytest, no network).  On a CPU it runs part 1
without graphs, skips part 2 and runs part 3 on the tiny config, which is how it is tried before a GPU is
spent on it:

    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --config tiny --contexts 512,256 --also tiny \
        --new-tokens 8 --budget-s 120
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT/speed.jsonl   # GPU: cuda, llama-3.1-8b, 64k-16k
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

PROMPT = "the quick brown fox jumps over the lazy dog " * 6


def _case(case: dict, run) -> bool:
    """Run one check, print its JSON line; an exception is reported and the script goes on."""
    try:
        ok = run(case)
    except Exception as error:  # noqa: BLE001 -- printed with its trace: the point of this script
        case.update(error=f"{type(error).__name__}: {error}"[:800], trace=traceback.format_exc(limit=4)[-1500:])
        ok = False
    print(json.dumps(case), flush=True)
    return ok


def compile_works(device: str) -> bool:
    """torch.compile needs a C compiler and Python headers on the machine (Triton builds its launcher);
    find out in seconds instead of losing every compiled case to it."""
    started = time.perf_counter()
    try:
        works = bool(torch.compile(lambda x: x + 1)(torch.ones(4, device=device)).sum() == 8)
        error = None
    except Exception as failure:  # noqa: BLE001 -- reported, then the script goes on without compiling
        works, error = False, f"{type(failure).__name__}: {failure}"[:800]
    print(json.dumps({"check": "torch.compile works", "device": device, "works": works, "error": error,
                      "seconds": round(time.perf_counter() - started, 1)}), flush=True)
    return works


def exactness(device: str, compiles: bool = True) -> bool:
    import kvviz
    from kvviz.fast import StaticInertia
    from kvviz.models import tiny_model

    ok = True
    cuda = torch.device(device).type == "cuda"
    variants = [(False, False), (True, False)] if cuda else [(False, False)]  # (graph, compile)
    for family in ("llama", "qwen2"):
        model, tokenizer = tiny_model(family)
        model.to(device)
        prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        for refresh in (1, 4, 0):
            reference = kvviz.run(model, tokenizer, prompt, kvviz.make_policy("inertia", refresh=refresh), budget=20,
                                  max_new_tokens=30)
            expected = [e.kept.tolist() for e in reference.trace.decode_steps]
            # r = 4 has both step variants (scoring and not): the compiled cases run there.
            cases = variants + ([(False, True), (True, True)] if refresh == 4 and compiles else [])
            for graph, compile in cases:
                def check(case, graph=graph, compile=compile):
                    static = StaticInertia(model, refresh=refresh, compile=compile).generate(
                        tokenizer, prompt, 20, 30, record_kept=True, graph=graph)
                    first = next((i for i, (a, b) in enumerate(zip(static.kept, expected)) if a != b), None)
                    case.update(tokens=static.token_ids == reference.token_ids, kept=static.kept == expected,
                                first_different_step=first)
                    return case["tokens"] and case["kept"]

                ok &= _case({"check": "static == reference", "device": device, "family": family, "refresh": refresh,
                             "graph": graph, "compile": compile}, check)
    return ok


def bfloat16_agreement(device: str, compiles: bool) -> None:
    import kvviz
    from kvviz.fast import StaticInertia, fp32_logits_supported
    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama")
    model.to(device=device, dtype=torch.bfloat16)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    reference = kvviz.run(model, tokenizer, prompt, "inertia", budget=20, max_new_tokens=30)
    expected = [set(e.kept.tolist()) for e in reference.trace.decode_steps]
    for compile in (False, True) if compiles else (False,):
        def check(case, compile=compile):
            static = StaticInertia(model, compile=compile).generate(tokenizer, prompt, 20, 30, record_kept=True,
                                                                    graph=True)
            same = [a == b for a, b in zip(static.token_ids, reference.token_ids)]
            overlap = [len(set(a) & b) / len(b) for a, b in zip(static.kept, expected)]
            case.update(fp32_logits=fp32_logits_supported(model.device, model.dtype),
                        tokens_equal_until=same.index(False) if False in same else len(same),
                        kept_overlap_mean=round(sum(overlap) / len(overlap), 4))
            return True

        _case({"check": "bfloat16 agreement (reported, not required)", "device": device, "compile": compile}, check)


def targets(rows: list[dict], context: int) -> dict:
    """Issue 6's targets at one context, from the speed rows (Llama-3.1-8B shape, 90%)."""
    by_name = {row["what"]: row for row in rows if row.get("prompt_len") == context and "decode_tok_s" in row}
    verdict: dict = {"check": "targets", "prompt_len": context}
    inertia, lazy = by_name.get("static-inertia"), by_name.get("static-inertia-lazy")
    if inertia:
        verdict["inertia_tok_s"] = inertia["decode_tok_s"]
        verdict["inertia_at_least_150"] = inertia["decode_tok_s"] >= 150
        verdict["scoring_overhead"] = inertia.get("scoring_overhead_vs_no_scoring")
        if verdict["scoring_overhead"] is not None:
            verdict["scoring_at_most_5_percent"] = verdict["scoring_overhead"] <= 0.05
    if inertia and lazy:
        verdict["lazy_gain"] = round(lazy["decode_tok_s"] / inertia["decode_tok_s"], 3)
        verdict["lazy_gain_at_most_1.05"] = verdict["lazy_gain"] <= 1.05
    verdict["vs_paper_39.1"] = round(inertia["decode_tok_s"] / 39.1, 2) if inertia else None
    return verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="65536,32768,16384", help="the target (64k) first")
    parser.add_argument("--also", default="qwen2.5-7b", help="then this config at the first context, if time is left "
                        "('' for none)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="the whole script's time; contexts that would start too late are skipped")
    parser.add_argument("--build-s", type=float, default=40.0, help="allowance for building the --also model")
    parser.add_argument("--out", default="/tmp/kvviz-speed.jsonl", help="the speed rows (JSON lines)")
    args = parser.parse_args()

    start = time.perf_counter()
    compiles = compile_works(args.device)
    exact = exactness(args.device, compiles)
    if torch.device(args.device).type == "cuda":
        bfloat16_agreement(args.device, compiles)
    elapsed = time.perf_counter() - start
    print(json.dumps({"check": "exactness done", "all_equal": exact, "seconds": round(elapsed, 1)}), flush=True)
    from kvviz.cli import main as cli

    def speed(config: str, contexts: str, out: str) -> list[dict]:
        limit = max(1.0, args.budget_s - (time.perf_counter() - start))
        cli(["bench", "speed", "--device", args.device, "--config", config, "--contexts", contexts, "--new-tokens",
             str(args.new_tokens), "--repeats", str(args.repeats), "--time-limit", f"{limit:.0f}", "--out", out,
             "--compile", "auto" if compiles else "off"])
        with open(out) as handle:
            return [json.loads(line) for line in handle]

    rows = speed(args.config, args.contexts, args.out)
    first = int(args.contexts.split(",")[0])
    print(json.dumps({"config": args.config, **targets(rows, first)}), flush=True)
    left = args.budget_s - (time.perf_counter() - start)
    first_took = next((row["seconds"] for row in rows if row.get("what") == "context done"), float("inf"))
    # Another model at the first context: its build, its recompiles, then about what that context took.
    if args.also and left > 1.2 * first_took + args.build_s:
        import gc

        gc.collect()
        if torch.device(args.device).type == "cuda":
            torch.cuda.empty_cache()
        also_out = args.out.replace(".jsonl", f"-{args.also}.jsonl")
        also = speed(args.also, str(first), also_out)
        print(json.dumps({"config": args.also, **targets(also, first)}), flush=True)
    elif args.also:
        print(json.dumps({"check": f"{args.also} skipped", "seconds_left": round(left, 1),
                          "first_context_took": first_took}), flush=True)
    print(json.dumps({"check": "done", "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
