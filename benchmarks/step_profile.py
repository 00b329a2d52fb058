"""Where the static decode step's time goes: its kernels, grouped, per step, next to the replayed step's time.

``kvviz bench speed`` says how fast the static step is; this says why.  On a ``--config`` model (random
weights) it prefills ``--context`` random tokens once, then runs :class:`kvviz.fast.StaticInertia` twice from
that prefill:

1. replayed from CUDA graphs, unprofiled: the steady step time (``step_ms``), as the speed rows measure it;
2. launched kernel by kernel (same compiled kernels, no graph), under ``torch.profiler`` from the moment the
   B + 1 slots hold the cache: each kernel's GPU time per static step, summed by group (matrix products from
   cuBLAS/CUTLASS, Inductor's Triton kernels, the rest) and the heaviest kernels by name.

Kernel time is what the GPU is busy with in either run; a graph's step time above it is the gaps between
kernels.  Prints JSON lines.  On a CPU (``--device cpu --config tiny``, how it is tried first) the groups are
the CPU operators' own time instead::

    PYTHONPATH=. python3 benchmarks/step_profile.py --config llama-3.1-8b --context 65536
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from kvviz import engine
from kvviz.bench.speed import CONFIGS, _NullTokenizer, build_from_config
from kvviz.fast import StaticInertia

MATRIX = ("gemv", "gemm", "nvjet", "cutlass", "xmma", "sm90", "splitk", "cublas")  # kernel names' marks


def group_of(name: str) -> str:
    lowered = name.lower()
    if any(mark in lowered for mark in MATRIX) or lowered in ("aten::mm", "aten::bmm", "aten::addmm"):
        return "matrix products (cuBLAS/CUTLASS)"
    if lowered.startswith("triton"):
        return "Inductor (Triton)"
    return "other"


def kernel_times(profile, device: torch.device) -> dict[str, list[float]]:
    """Kernel (GPU) or operator (CPU, self time) name -> its durations in microseconds."""
    times: dict[str, list[float]] = defaultdict(list)
    if device.type == "cuda":
        for event in profile.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                times[event.name].append(event.time_range.elapsed_us())
    else:
        for average in profile.key_averages():
            times[average.key].extend([average.self_cpu_time_total / max(average.count, 1)] * average.count)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--compression", type=float, default=0.9)
    parser.add_argument("--new-tokens", type=int, default=18, help="the first two run through the engine")
    parser.add_argument("--refresh", type=int, default=1, help="1 InertiaKV, 4 Lazy, 0 Score-Free")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="default: on a GPU")
    parser.add_argument("--fuse", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    device = torch.device(args.device)
    compile = device.type == "cuda" if args.compile is None else args.compile
    started = time.perf_counter()
    model = build_from_config(args.config, args.device)
    prompt = torch.randint(3, model.config.vocab_size, (args.context,), generator=torch.Generator().manual_seed(0))
    prompt_ids = prompt.tolist()
    budget = engine.resolve_budget(len(prompt_ids), compression=args.compression)
    shared = engine.prefill(model, prompt_ids)
    static = StaticInertia(model, refresh=args.refresh, compile=compile, fuse=args.fuse)
    tokenizer = _NullTokenizer()
    steps = args.new_tokens - 2
    meta = {"config": args.config, "device": str(device), "context": args.context, "budget": budget,
            "refresh": args.refresh, "compiled": compile, "fused": args.fuse, "static_steps": steps,
            "torch": torch.__version__}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(json.dumps({"meta": meta}), flush=True)

    replayed = static.generate(tokenizer, prompt_ids, budget, args.new_tokens, graph=True, shared=shared)
    print(json.dumps({"run": "graph replay" if device.type == "cuda" else "timed",
                      "step_ms": round(1000 / replayed.steady_tok_s(), 4), "tok_s": round(replayed.steady_tok_s(), 2)}),
          flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profile = torch.profiler.profile(activities=activities)
    launched = static.generate(tokenizer, prompt_ids, budget, args.new_tokens, graph=False, shared=shared,
                               on_ready=profile.start)
    if device.type == "cuda":
        torch.cuda.synchronize()
    profile.stop()
    times = kernel_times(profile, device)
    groups: dict[str, float] = defaultdict(float)
    for name, durations in times.items():
        groups[group_of(name)] += sum(durations)
    total_us = sum(groups.values())
    print(json.dumps({"run": "kernel by kernel, profiled", "step_ms": round(1000 / launched.steady_tok_s(), 4),
                      "busy_ms_per_step": round(total_us / steps / 1000, 4),
                      "kernels_per_step": round(sum(map(len, times.values())) / steps, 1),
                      "groups_ms_per_step": {group: round(us / steps / 1000, 4) for group, us in
                                             sorted(groups.items(), key=lambda item: -item[1])}}), flush=True)
    heaviest = sorted(times.items(), key=lambda item: -sum(item[1]))[:args.top]
    for name, durations in heaviest:
        print(json.dumps({"kernel": name[:160], "group": group_of(name), "per_step": round(len(durations) / steps, 2),
                          "ms_per_step": round(sum(durations) / steps / 1000, 4),
                          "share": round(sum(durations) / total_us, 4)}), flush=True)
    print(json.dumps({"done": round(time.perf_counter() - started, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
