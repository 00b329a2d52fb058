"""The one prepared script for a GPU session (issue 6): speed at the target context, then exactness, then more.

In order of value, so that a session cut short keeps the most important results (every line is flushed to
stdout and to ``--out`` / ``<out>-checks.jsonl`` as it is made):

0. A one-line ``torch.compile`` probe: without a working compiler toolchain on the machine the compiled
   cases are left out (and said so) rather than each failing slowly.
1. ``kvviz bench speed --device DEVICE --config CONFIG --contexts FIRST``: its JSON lines, unchanged, with
   a time limit that keeps ``--checks-s`` for part 2 (inside it ``generate`` and the static rows the targets
   need run first, whatever the limit; configurations that would start later become ``skipped`` rows); then
   a ``targets`` line (issue 6's three targets at that context) and a ``backend policies`` line: each
   ``--backend-policies`` row (TOVA, H2O, K-norm, StreamingLLM on the static backend, :mod:`kvviz.backend`,
   timed after the static rows) against the backend's InertiaKV.  It runs as a child process, killed
   ``--grace-s`` after its limit: a hang cannot eat the session, and a CUDA error that poisons a process
   (an illegal memory access at 64k) cannot fail every exactness case after it.
2. For tiny random Llama / Qwen2 models (float32) on the device: the static decode path -- eager, replayed
   from CUDA graphs, and with each layer through ``torch.compile`` -- against the reference engine on the
   same device: same tokens and keep sets at every step for InertiaKV (r = 1), InertiaKV-Lazy (r = 4) and
   Score-Free, with the step's default ``value_block`` and with ``value_block`` 4 (several blocks over a
   padded cache, as at 64k).  One JSON line per case; the compiled cases are judged apart (``compiled_equal``: Inductor
   may fuse the EMA's multiply-add into one rounding) and give way first when time is short.  Then the
   same tiny Llama in bfloat16 (the speed runs' dtype, where the static step takes float32 logits straight
   from the half-precision keys): agreement with the reference engine, reported, not required (two
   attention kernels round differently in bfloat16).  Then the static backend (CUDA graphs on a GPU)
   against the engine, tiny Llama in float32: ``backend == engine`` lines, counted in ``all_equal``, for
   a setting of every kind it runs (``BACKEND_EXACTNESS``: every-step, prefill-time, checkpointed, and
   Expected Attention at every step), unless ``--backend-policies`` is empty.
3. With the time left of ``--budget-s`` (counted from the script's start): the other contexts, then the
   ``--also`` config at the first context.

Needs only torch, transformers and tqdm (which transformers needs); no pandas, pyarrow, pytest or network.
On a CPU it runs part 2 without graphs and without the bfloat16 check, and the speed parts on the tiny
config, which is how it is tried before a GPU is spent on it:

    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --config tiny --contexts 512,256 --also tiny \
        --new-tokens 8 --budget-s 120
    PYTHONPATH=. python3 benchmarks/gpu_check.py --out $OUT/speed.jsonl   # GPU: cuda, llama-3.1-8b, 64k-16k
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # --budget-s counts from here: the session's limit includes importing torch

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no network there: nothing may wait on the hub's timeouts

import torch  # noqa: E402

PROMPT = "the quick brown fox jumps over the lazy dog " * 6
COMPILE_CASE_S = 60.0  # a compiled check case compiles two step variants cold: skipped with less time left
CHECKS: list = []  # an open file for report(), set by main(): the tool keeps only the last 12k characters of output


def report(record: dict) -> None:
    """One JSON line to stdout and to the checks file, flushed: a killed run keeps every line it printed."""
    line = json.dumps(record)
    print(line, flush=True)
    for handle in CHECKS:
        handle.write(line + "\n")
        handle.flush()


def _failure(error: BaseException) -> dict:
    """An error's line: the innermost frames (where it failed, in kvviz, transformers or Inductor), and the
    error a failed CUDA-graph capture masks ("operation failed due to a previous error during capture")."""
    record = {"error": f"{type(error).__name__}: {error}"[:800], "trace": traceback.format_exc(limit=-8)[-2500:]}
    cause = error.__cause__ or error.__context__
    if cause is not None:
        record["during"] = f"{type(cause).__name__}: {cause}"[:800]
    return record


def _case(case: dict, run) -> bool:
    """Run one check, report its JSON line; an exception is reported and the script goes on."""
    try:
        ok = run(case)
    except Exception as error:  # noqa: BLE001 -- printed with its trace: the point of this script
        case.update(_failure(error))
        ok = False
    report(case)
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
    report({"check": "torch.compile works", "device": device, "works": works, "error": error,
            "seconds": round(time.perf_counter() - started, 1)})
    return works


def _static_equals_reference(case: dict, model, tokenizer, prompt, refresh: int, reference, expected: list,
                              graph: bool, compile: bool, value_block: int | None) -> bool:
    """One exactness case: the static path's tokens and keep sets against the reference engine's run."""
    from kvviz.fast import StaticInertia

    static = StaticInertia(model, refresh=refresh, compile=compile, value_block=value_block).generate(
        tokenizer, prompt, 20, 30, record_kept=True, graph=graph)
    first = next((i for i, (a, b) in enumerate(zip(static.kept, expected)) if a != b), None)
    case.update(tokens=static.token_ids == reference.token_ids, kept=static.kept == expected,
                first_different_step=first)
    if first is not None:  # one swapped pair reads as a near-tie; more as a real difference
        case.update(only_static_kept=sorted(set(static.kept[first]) - set(expected[first]))[:8],
                    only_reference_kept=sorted(set(expected[first]) - set(static.kept[first]))[:8])
    return case["tokens"] and case["kept"]


def exactness(device: str, compiles: bool = True, left=lambda: float("inf")) -> tuple[bool, bool | None]:
    """Static path == reference engine: (eager and graph-replayed cases all equal, compiled cases all equal
    or None if none ran).  The compiled cases are judged apart: Inductor may fuse the EMA's multiply-add
    into one rounding, which can flip a near-tie that the eager step (the engine's own expression) cannot.
    With under ``COMPILE_CASE_S`` seconds left, compiled cases are skipped (each compiles cold)."""
    import kvviz
    from kvviz.models import tiny_model

    ok, compiled_ok = True, None
    cuda = torch.device(device).type == "cuda"
    # (graph, compile, value_block): the step's default (one block of 256 slots on a GPU, so one product
    # for 21 slots), and 6 blocks of 4 over a cache padded to 24 slots (what 64k runs, in float32)
    variants = [(graph, False, value_block) for value_block in (None, 4) for graph in ((False, True) if cuda else
                                                                                        (False,))]
    for family in ("llama", "qwen2"):
        try:
            model, tokenizer = tiny_model(family)
            model.to(device)
            prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        except Exception as error:  # noqa: BLE001 -- reported; the other family still runs
            report({"check": "static == reference", "device": device, "family": family, **_failure(error)})
            ok = False
            continue
        for refresh in (1, 4, 0):
            try:
                reference = kvviz.run(model, tokenizer, prompt, kvviz.make_policy("inertia", refresh=refresh),
                                      budget=20, max_new_tokens=30)
            except Exception as error:  # noqa: BLE001 -- the reference engine itself failed on this device
                report({"check": "reference engine", "device": device, "family": family, "refresh": refresh,
                        **_failure(error)})
                ok = False
                continue
            expected = [e.kept.tolist() for e in reference.trace.decode_steps]
            # r = 4 has both step variants (scoring and not): the compiled cases run there.
            cases = variants + ([(False, True, None), (True, True, None)] if refresh == 4 and compiles else [])
            for graph, compile, value_block in cases:
                if compile and left() < COMPILE_CASE_S:
                    report({"check": "static == reference", "device": device, "family": family, "refresh": refresh,
                            "graph": graph, "compile": True, "skipped": f"{left():.0f} s left"})
                    continue
                check = functools.partial(_static_equals_reference, model=model, tokenizer=tokenizer,
                                          prompt=prompt, refresh=refresh, reference=reference, expected=expected,
                                          graph=graph, compile=compile, value_block=value_block)
                equal = _case({"check": "static == reference", "device": device, "family": family,
                               "refresh": refresh, "graph": graph, "compile": compile,
                               **({"value_block": value_block} if value_block is not None else {})}, check)
                if compile:
                    compiled_ok = equal if compiled_ok is None else compiled_ok and equal
                else:
                    ok &= equal
    return ok, compiled_ok


BACKEND_POLICIES = "inertia,tova,h2o,knorm,streaming,rkv,avokv"  # the static backend's speed rows (kvviz.backend)
# The exactness cases: a setting of every kind the backend runs -- every-step (graph-captured on a GPU),
# prefill-time (cut by the engine's pass, then slots), decided on the host (checkpointed at interval 4, so
# they evict within 30 steps, and Expected Attention at every step) -- with a budget each can hold.
BACKEND_EXACTNESS = {"inertia": 20, "inertia-lazy": 20, "tova": 20, "h2o": 20, "knorm": 20, "streaming": 20,
                     "keydiff": 20, "snapkv window=8": 20, "kvzip": 20, "expected-attention": 20,
                     "expected-attention-decode": 20, "avokv interval=4": 40, "rkv interval=4": 20,
                     "lazyeviction interval=4": 20}


def backend_exactness(device: str, settings: dict[str, int]) -> bool:
    """The static backend (CUDA graphs on a GPU where a step allows) against the engine on the same device,
    tiny Llama in float32, greedy: same tokens and keep sets at every step, one line per setting as typed."""
    from kvviz.backend.static import StaticBackend
    from kvviz.engine import decode
    from kvviz.models import tiny_model
    from kvviz.policies import build_setting

    model, tokenizer = tiny_model("llama")
    model.to(device)
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    ok = True
    for name, budget in settings.items():
        def check(case, name=name, budget=budget):
            reference = list(decode(model, tokenizer, prompt, build_setting(name)[1], budget=budget,
                                    max_new_tokens=30))
            static = list(StaticBackend(model, build_setting(name)[1]).stream(tokenizer, prompt, budget=budget,
                                                                              max_new_tokens=30))
            kept = [(a.kept.tolist(), b.kept.tolist()) for a, b in zip(reference, static)]
            first = next((step for step, (a, b) in enumerate(kept) if a != b), None)
            case.update(tokens=[e.new_token_id for e in static] == [e.new_token_id for e in reference],
                        kept=first is None and len(static) == len(reference), first_different_step=first)
            return case["tokens"] and case["kept"]

        ok &= _case({"check": "backend == engine", "device": device, "family": "llama", "policy": name}, check)
    return ok


def backend_summary(rows: list[dict], context: int) -> dict:
    """Each backend row's rate against the backend's InertiaKV row at one context: what another policy costs
    on the same static step."""
    by_name = {row["what"]: row for row in rows if row.get("prompt_len") == context and "decode_tok_s" in row}
    inertia = by_name.get("backend-inertia")
    summary: dict = {"check": "backend policies", "prompt_len": context}
    events = by_name.pop("backend-inertia-events", None)
    if inertia and events:  # issue 42: events for the UI cost at most 20% (setup counted on both sides)
        summary["events_vs_bare"] = round(events["decode_tok_s"] / inertia["with_setup_tok_s"], 3)
        summary["events_at_least_0.8_of_bare"] = summary["events_vs_bare"] >= 0.8
    for name, row in by_name.items():
        if name.startswith("backend-"):
            summary[f"{name.removeprefix('backend-')}_tok_s"] = row["decode_tok_s"]
            if inertia:
                summary[f"{name.removeprefix('backend-')}_vs_inertia"] = round(
                    row["decode_tok_s"] / inertia["decode_tok_s"], 3)
    return summary


def bfloat16_agreement(device: str, compiles: bool, left=lambda: float("inf")) -> None:
    import kvviz
    from kvviz.fast import StaticInertia, fp32_logits_supported
    from kvviz.models import tiny_model

    try:
        model, tokenizer = tiny_model("llama", dtype=torch.bfloat16)  # built so: RoPE frequencies stay float32
        model.to(device)
        prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
        reference = kvviz.run(model, tokenizer, prompt, "inertia", budget=20, max_new_tokens=30)
    except Exception as error:  # noqa: BLE001 -- reported; the script goes on
        report({"check": "bfloat16 agreement (reported, not required)", "device": device, **_failure(error)})
        return
    expected = [set(e.kept.tolist()) for e in reference.trace.decode_steps]
    for compile in (False, True) if compiles else (False,):
        if compile and left() < COMPILE_CASE_S:
            report({"check": "bfloat16 agreement (reported, not required)", "device": device, "compile": True,
                    "skipped": f"{left():.0f} s left"})
            continue

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


def float32_settings() -> dict:
    """What could make float32 matmuls round as TF32, and so fail the float32 exactness cases for a reason
    that is not the static path's: torch's switches and the environment's overrides."""
    return {"allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
            "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            **{name: os.environ[name] for name in ("TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "NVIDIA_TF32_OVERRIDE")
               if name in os.environ}}


def targets(rows: list[dict], context: int) -> dict:
    """Issue 6's targets at one context, from the speed rows (Llama-3.1-8B shape, 90%)."""
    by_name = {row["what"]: row for row in rows if row.get("prompt_len") == context and "decode_tok_s" in row}
    verdict: dict = {"check": "targets", "prompt_len": context}
    inertia, lazy = by_name.get("static-inertia"), by_name.get("static-inertia-lazy")
    if inertia is None and "static-inertia-uncompiled" in by_name:  # compiling failed: judge the eager step
        inertia, lazy = by_name["static-inertia-uncompiled"], by_name.get("static-inertia-lazy-uncompiled")
        verdict["compiled"] = False
    if inertia:
        verdict["inertia_tok_s"] = inertia["decode_tok_s"]
        verdict["inertia_at_least_150"] = inertia["decode_tok_s"] >= 150
        # against the same B-slot step with neither scoring nor an eviction choice
        verdict["scoring_eviction_share"] = inertia.get("scoring_eviction_share")
        if verdict["scoring_eviction_share"] is not None:
            verdict["scoring_eviction_at_most_5_percent"] = verdict["scoring_eviction_share"] <= 0.05
        # reported, not a target: in bfloat16 the static step and the engine round differently
        verdict["engine_kept_overlap"] = inertia.get("engine_kept_overlap")
    if inertia and lazy:
        verdict["lazy_gain"] = round(lazy["decode_tok_s"] / inertia["decode_tok_s"], 3)
        verdict["lazy_gain_at_most_1.05"] = verdict["lazy_gain"] <= 1.05
    verdict["vs_paper_39.1"] = round(inertia["decode_tok_s"] / 39.1, 2) if inertia else None
    # issue 42: the static backend's InertiaKV against the full cache as a graph-captured static step (HBM
    # bandwidth allows at most ~1.49x at 90%)
    backend, full = by_name.get("backend-inertia"), by_name.get("static-full-cache")
    if full:
        verdict["full_cache_graph_tok_s"] = full["decode_tok_s"]
    for name, row in (("inertia", inertia), ("backend_inertia", backend)):
        if row and full:
            verdict[f"{name}_vs_full_cache_graph"] = round(row["decode_tok_s"] / full["decode_tok_s"], 3)
            verdict[f"{name}_vs_full_cache_graph_at_least_1.35"] = verdict[f"{name}_vs_full_cache_graph"] >= 1.35
    if backend:
        verdict["backend_inertia_tok_s"] = backend["decode_tok_s"]
        verdict["backend_inertia_at_least_200"] = backend["decode_tok_s"] >= 200
    # what stacking q/k/v and gate/up bought, and what the value product in blocks bought
    for gain, variant in (("fused_gain", "static-inertia-unfused"), ("blocked_gain", "static-inertia-unblocked")):
        if inertia and variant in by_name and verdict.get("compiled", True):
            verdict[gain] = round(inertia["decode_tok_s"] / by_name[variant]["decode_tok_s"], 3)
    return verdict


def all_checks(device: str, compiles: bool, backend_policies: str, left) -> bool:
    """Part 2: the static path and the static backend against the engine, then bfloat16 agreement, each guarded
    so that the rest goes on; reports the closing ``exactness done`` line and returns its ``all_equal``."""
    checks_start = time.perf_counter()
    try:
        exact, compiled_exact = exactness(device, compiles, left)
    except Exception as error:  # noqa: BLE001 -- whatever escaped the per-case guards
        report({"check": "exactness", **_failure(error)})
        exact, compiled_exact = False, None
    try:
        exact &= backend_exactness(device, BACKEND_EXACTNESS if backend_policies else {})
    except Exception as error:  # noqa: BLE001 -- e.g. the backend's import: reported, the rest goes on
        report({"check": "backend == engine", **_failure(error)})
        exact = False
    if torch.device(device).type == "cuda" and left() > 15:
        try:
            bfloat16_agreement(device, compiles, left)
        except Exception as error:  # noqa: BLE001 -- e.g. an import the device lacks: reported, the rest goes on
            report({"check": "bfloat16 agreement (reported, not required)", **_failure(error)})
    report({"check": "exactness done", "all_equal": exact, "compiled_equal": compiled_exact,
            "seconds": round(time.perf_counter() - checks_start, 1), **float32_settings()})
    return exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="65536,32768,16384", help="the target (64k) first")
    parser.add_argument("--also", default="qwen2.5-7b", help="then this config at the first context, if time is left "
                        "('' for none)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=380.0,
                        help="the whole script's time from its start; work that would start too late is skipped")
    parser.add_argument("--checks-s", type=float, default=150.0,
                        help="time kept for the exactness checks, which run after the first context's speed rows")
    parser.add_argument("--build-s", type=float, default=40.0, help="allowance for building the --also model")
    parser.add_argument("--grace-s", type=float, default=75.0,
                        help="a speed run still going this long after its time limit is killed (the limit only "
                        "stops configurations from starting; the target rows run past it)")
    parser.add_argument("--backend-policies", default=BACKEND_POLICIES,
                        help="policies timed on the static backend after the static rows, and checked against the "
                        "engine after the static path's cases ('' for none; default: %(default)s)")
    parser.add_argument("--out", default="/tmp/kvviz-speed.jsonl", help="the speed rows (JSON lines); the checks "
                        "go to the same name with -checks")
    args = parser.parse_args()

    def beside(suffix: str) -> str:  # speed.jsonl -> speed-checks.jsonl, also for an --out without .jsonl
        stem = args.out[:-len(".jsonl")] if args.out.endswith(".jsonl") else args.out
        return f"{stem}-{suffix}.jsonl"

    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    CHECKS.append(open(beside("checks"), "w"))

    def left() -> float:
        return args.budget_s - (time.perf_counter() - STARTED)

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}

    def speed(config: str, contexts: str, out: str, limit: float) -> list[dict]:
        """``kvviz bench speed`` within ``limit`` seconds (out of time: the rows it always runs, as 0 would
        mean no limit), in a child process killed ``--grace-s`` later; its rows, or none if it failed outright."""
        open(out, "w").close()  # a warm machine's rerun must not read the last run's rows as this one's
        limit = max(1e-3, limit)
        command = [sys.executable, "-c", "import sys; from kvviz.cli import main; sys.exit(main(sys.argv[1:]))",
                   "bench", "speed", "--device", args.device, "--config", config,
                   "--contexts", contexts, "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats),
                   "--time-limit", f"{limit:.3f}", "--out", out, "--compile", "auto" if compiles else "off",
                   "--backend-policies", args.backend_policies]
        # Its own process group, so that a kill also ends the compiler's worker processes; its lines go straight out.
        child = subprocess.Popen(command, env=env, start_new_session=True)
        try:
            if child.wait(timeout=limit + args.grace_s):
                report({"check": f"speed {config} {contexts}", "error": f"exit status {child.returncode}"})
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            report({"check": f"speed {config} {contexts}",
                    "error": f"killed {args.grace_s:g} s past its --time-limit of {limit:.0f} s"})
        rows = []
        with open(out) as handle:
            for line in handle:
                try:
                    rows.append(json.loads(line))
                except ValueError:  # the line a killed run was writing
                    pass
        return rows

    # Order of value: the target context's speed rows (generate and the target rows first inside it), then
    # exactness, then the other contexts and the --also config with whatever time is left.
    compiles = compile_works(args.device)
    contexts = args.contexts.split(",")
    first = int(contexts[0])
    rows = speed(args.config, contexts[0], args.out, left() - args.checks_s)
    report({"config": args.config, **targets(rows, first)})
    if args.backend_policies:
        report({"config": args.config, **backend_summary(rows, first)})
    first_took = next((row["seconds"] for row in rows if row.get("what") == "context done"), float("inf"))

    exact = all_checks(args.device, compiles, args.backend_policies, left)

    if len(contexts) > 1:
        # Shorter contexts decode faster, but their new slot counts recompile both step variants as the
        # first context did, and the time limit is checked only between configurations.
        if left() > first_took:
            speed(args.config, ",".join(contexts[1:]), beside("more"), left())
        else:
            report({"check": f"contexts {','.join(contexts[1:])} skipped", "seconds_left": round(left(), 1)})
    # Another model at the first context: its build, its recompiles, then about what that context took.
    if args.also and left() > 1.2 * first_took + args.build_s:
        also = speed(args.also, str(first), beside(args.also), left())
        report({"config": args.also, **targets(also, first)})
    elif args.also:
        report({"check": f"{args.also} skipped", "seconds_left": round(left(), 1),
                "first_context_took": None if first_took == float("inf") else first_took})
    report({"check": "done", "seconds": round(time.perf_counter() - STARTED, 1)})
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())
