"""The one prepared script for a GPU session (issue 6): exactness of the static path on the device, then speed.

1. For tiny random Llama / Qwen2 models on the device: the static decode path (eager, and replayed from
   CUDA graphs) against the reference engine on the same device -- same tokens and keep sets at every
   step for InertiaKV (r = 1), InertiaKV-Lazy (r = 4) and Score-Free.  One JSON line per case.
2. ``kvviz bench speed --device DEVICE --config CONFIG --contexts ...``: its JSON lines, unchanged.

Needs only torch, transformers, pandas, pyarrow and tqdm (no pytest, no network).  On a CPU it runs part 1
without graphs and part 2 on the tiny config, which is how it is tried before a GPU is spent on it:

    PYTHONPATH=. python3 benchmarks/gpu_check.py --device cpu --config tiny --contexts 512 --new-tokens 8
    PYTHONPATH=. python3 benchmarks/gpu_check.py          # on the GPU machine: cuda, llama-3.1-8b, 16k-64k
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch


def exactness(device: str) -> bool:
    import kvviz
    from kvviz.fast import StaticInertia
    from kvviz.models import tiny_model

    ok = True
    graphs = [False, True] if torch.device(device).type == "cuda" else [False]
    for family in ("llama", "qwen2"):
        model, tokenizer = tiny_model(family)
        model.to(device)
        prompt = tokenizer("the quick brown fox jumps over the lazy dog " * 6, add_special_tokens=False)["input_ids"]
        for refresh in (1, 4, 0):
            reference = kvviz.run(model, tokenizer, prompt, kvviz.make_policy("inertia", refresh=refresh), budget=20,
                                  max_new_tokens=30)
            expected = [e.kept.tolist() for e in reference.trace.decode_steps]
            for graph in graphs:
                case = {"check": "static == reference", "device": device, "family": family, "refresh": refresh,
                        "graph": graph}
                try:
                    static = StaticInertia(model, refresh=refresh).generate(tokenizer, prompt, 20, 30,
                                                                            record_kept=True, graph=graph)
                    same_tokens = static.token_ids == reference.token_ids
                    same_kept = static.kept == expected
                    first = next((i for i, (a, b) in enumerate(zip(static.kept, expected)) if a != b), None)
                    case.update(tokens=same_tokens, kept=same_kept, first_different_step=first)
                    ok &= same_tokens and same_kept
                except Exception as error:  # report and go on: the speed part still has something to say
                    case.update(error=f"{type(error).__name__}: {error}", trace=traceback.format_exc(limit=3))
                    ok = False
                print(json.dumps(case), flush=True)
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", default="llama-3.1-8b")
    parser.add_argument("--contexts", default="16384,32768,65536")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", help="also write the speed rows to this file")
    args = parser.parse_args()

    start = time.perf_counter()
    exact = exactness(args.device)
    print(json.dumps({"check": "exactness done", "all_equal": exact, "seconds": round(time.perf_counter() - start, 1)}),
          flush=True)
    from kvviz.cli import main as cli

    speed = ["bench", "speed", "--device", args.device, "--config", args.config, "--contexts", args.contexts,
             "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    code = cli(speed + (["--out", args.out] if args.out else []))
    return 0 if exact and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
