"""What the static step's attention costs alone, by ``value_block``: the logits, the softmax and the value product.

:func:`kvviz.fast.attend` for every layer of one step, over each layer's own slot cache (so the caches do
not sit in the L2 cache between layers, as in a real step), at the model's head layout: for each live slot
count, the value product as one product (``block`` 0, the baseline of each ``vs_one_product``) and in
blocks of 64 to 1024 slots over a cache padded to whole blocks.  Timed as one CUDA graph per setting on a
GPU (bfloat16, float32 logits), eagerly on a CPU (float32).  One JSON line per setting: ``layer_us`` (one
layer's attention), ``gb_s`` over the keys and values it reads, ``vs_one_product`` (time of block 0 over
this one's, same slot count, same run)::

    PYTHONPATH=. python3 benchmarks/value_blocks.py                                        # a GPU
    PYTHONPATH=. python3 benchmarks/value_blocks.py --config tiny --device cpu --slots 21  # tried on a CPU
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvviz.bench.speed import CONFIGS, replayed_seconds
from kvviz.fast import attend, fp32_logits_supported, padded_slots


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--slots", default="6554,3277,1639", help="live slots (budget + 1): 10%% of 64k, 32k, 16k")
    parser.add_argument("--blocks", default="0,64,128,256,512,1024")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--budget-s", type=float, default=60.0, help="settings that would start later are skipped")
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    fp32_logits = fp32_logits_supported(device, dtype)
    spec = CONFIGS[args.config]
    layers, kv_heads, head_dim = spec["num_hidden_layers"], spec["num_key_value_heads"], spec["head_dim"]
    groups = spec["num_attention_heads"] // kv_heads
    meta = {"config": args.config, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "layers": layers, "kv_heads": kv_heads, "groups": groups, "head_dim": head_dim,
            "fp32_logits": fp32_logits, "torch": torch.__version__}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(json.dumps({"meta": meta}), flush=True)
    torch.manual_seed(0)
    query = torch.randn(kv_heads, groups, head_dim, device=device, dtype=dtype)
    scaling = head_dim ** -0.5
    for slots in (int(text) for text in args.slots.split(",")):
        baseline = None
        for block in (int(text) for text in args.blocks.split(",")):
            row = {"slots": slots, "block": block}
            if time.perf_counter() - started > args.budget_s:
                print(json.dumps({**row, "skipped": f"past --budget-s {args.budget_s:g}"}), flush=True)
                continue
            padded = padded_slots(slots, block)
            caches = []
            for _ in range(layers):  # live slots random, padding zero, as the static step leaves it
                keys = torch.zeros(kv_heads, padded, head_dim, device=device, dtype=dtype)
                values = torch.zeros_like(keys)
                keys[:, :slots].normal_()
                values[:, :slots].normal_()
                caches.append((keys, values))

            def step(caches=caches, slots=slots, block=block) -> None:
                for keys, values in caches:
                    attend(query, keys, values, scaling, fp32_logits, slots, block)

            seconds = replayed_seconds(step, device, args.replays) / layers
            baseline = baseline or (seconds if block == 0 else None)
            read = 2 * kv_heads * padded * head_dim * torch.finfo(dtype).bits // 8
            row.update(padded=padded, layer_us=round(seconds * 1e6, 2), gb_s=round(read / seconds / 1e9, 1))
            if baseline:
                row["vs_one_product"] = round(baseline / seconds, 3)
            print(json.dumps(row), flush=True)
            caches.clear()  # the next setting allocates its own
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
