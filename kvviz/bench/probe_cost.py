"""``kvviz bench probe``: candidates per second of the damage probe, batched vs one candidate at a time.

Both run in the same process on the same prompt, step and candidates; the ratio is what batching buys.
"""

from __future__ import annotations

import json
import platform
import time
from datetime import datetime, timezone


def add_arguments(parser) -> None:
    from ..model_names import DEFAULT_MODEL, DTYPES

    parser.add_argument("--model", default=DEFAULT_MODEL, help="hub id or local path (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    parser.add_argument("--prompt-tokens", type=int, default=512,
                        help="prompt length in tokens (a haystack with a passkey; default: %(default)s)")
    parser.add_argument("--step", type=int, default=8, help="decode step probed, >= 1 (default: %(default)s)")
    parser.add_argument("--sample", type=int, default=64,
                        help="candidates probed, drawn with seed 0 (default: %(default)s)")
    parser.add_argument("--future", type=int, default=8,
                        help="W_fut: teacher-forced tokens replayed (default: %(default)s)")
    parser.add_argument("--batch", type=int, default=16,
                        help="candidates per forward pass of the batched run (default: %(default)s)")
    parser.add_argument("--out", help="also write the JSON lines to this file")


def check_arguments(args) -> None:
    """What ``bench probe`` refuses before the model loads: ValueError saying what to change."""
    for option, value in (("--prompt-tokens", args.prompt_tokens), ("--step", args.step),
                          ("--future", args.future), ("--batch", args.batch), ("--sample", args.sample)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")


def main(args) -> int:
    import numpy as np
    import torch  # here, not above: `kvviz --help` reads add_arguments and should not wait for torch

    from ..models import load_model
    from ..probe import check_fits, damage, damage_inputs
    from ..trace import model_dtype
    from .speed import haystack_prompt

    check_arguments(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    try:  # before the haystack is built (minutes, past the context) and before decoding, which would fail or crawl
        check_fits(model, range(args.prompt_tokens), args.step, args.future, step_name="--step",
                   future_name="--future")
    except ValueError as error:
        raise ValueError(f"{error} (the prompt's length is --prompt-tokens)") from None
    prompt_ids = haystack_prompt(tokenizer, args.prompt_tokens)
    prefix_len = len(prompt_ids) + args.step - 1  # the cache before --step: the prompt and the tokens before it
    if args.sample > prefix_len:  # the candidates are drawn without replacement from these entries
        raise ValueError(f"--sample {args.sample} is more than the {prefix_len} entries cached at --step {args.step} "
                         f"({len(prompt_ids)} prompt tokens + {args.step - 1} generated); choose --sample "
                         f"{prefix_len} or less, or raise --prompt-tokens or --step")
    # The probe's own inputs (kvviz probe's default seed 0), not a copy of them, so that what is timed is what
    # `kvviz probe --step` computes: the replay starts after the token --step feeds has entered the cache.
    sequence, cache_len, candidates = damage_inputs(model, tokenizer, prompt_ids, args.step, future=args.future,
                                                    sample=args.sample, seed=0)
    candidates = candidates.tolist()
    rows = [{"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": args.model,
                      "dtype": model_dtype(model), "machine": platform.node(),
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "prompt_len": len(prompt_ids), "step": args.step, "future": args.future,
                      "cache_len": cache_len, "candidate_positions": candidates}}]
    results = {}
    for label, batch in (("one at a time", 1), (f"batched ({args.batch})", args.batch)):
        start = time.perf_counter()
        results[label] = damage(model, sequence, cache_len, candidates, future=args.future, batch=batch)
        seconds = time.perf_counter() - start
        # The damage itself goes out too, so that what was timed can be checked against the probe.
        rows.append({"what": label, "candidates": len(candidates), "seconds": round(seconds, 3),
                     "candidates_per_s": round(len(candidates) / seconds, 2), "damage": results[label].tolist()})
    rows[-1]["vs_one_at_a_time"] = round(rows[-1]["candidates_per_s"] / rows[-2]["candidates_per_s"], 2)
    first, second = results.values()
    rows[-1]["max_abs_diff_vs_one_at_a_time"] = float(np.abs(first - second).max())
    lines = [json.dumps(row) for row in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")
    return 0
