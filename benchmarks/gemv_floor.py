"""What one batch-1 decode step's weight reads cost alone: every layer's projections and the LM head, nothing else.

At batch 1 each projection is a matrix-vector product that reads its whole weight once, so this is the floor
under any decode step of the model (the static step adds attention over B slots, norms, RoPE, the EMA and the
arg-mins).  Against the measured step (``kvviz bench speed``) it says how much of the step is weight
streaming, and against the memory bandwidth how well the matrix-vector kernels stream.

Layouts, each timed as one CUDA graph of all layers (no launch gaps) on a GPU, eagerly on a CPU:

* ``separate``: q, k, v, o, gate, up, down, one product each (the HF modules);
* ``fused``: q/k/v and gate/up stacked (what :func:`kvviz.fast.fused_projections` makes), four per layer;
* ``fused-cublaslt``: the same through cuBLASLt (``torch.backends.cuda.preferred_blas_library``; GPU only);
* ``fused-inductor``: the same as ``(weight * x).sum(-1)`` through ``torch.compile``, so that Inductor writes
  the reductions itself (Triton kernels on a GPU; skipped with less than ``--compile-s`` left).

Prints one JSON line per layout: ``step_ms``, the bytes read per step and ``tb_s``; the first line
names the machine.  Random bfloat16 weights (float32 on a CPU)::

    PYTHONPATH=. python3 benchmarks/gemv_floor.py --config llama-3.1-8b          # a GPU
    PYTHONPATH=. python3 benchmarks/gemv_floor.py --config tiny --device cpu     # tried on a CPU first
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvviz.bench.speed import CONFIGS, replayed_seconds


def layer_weights(spec: dict, layers: int, device, dtype) -> list[dict]:
    """Per layer, the stacked matrices and the separate ones as row slices of them (one copy in memory)."""
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    q_rows = spec["num_attention_heads"] * spec["head_dim"]
    kv_rows = spec["num_key_value_heads"] * spec["head_dim"]
    weights = []
    for _ in range(layers):
        qkv = torch.randn(q_rows + 2 * kv_rows, hidden, device=device, dtype=dtype) * 0.02
        gate_up = torch.randn(2 * inter, hidden, device=device, dtype=dtype) * 0.02
        weights.append({
            "qkv": qkv, "gate_up": gate_up,
            "o": torch.randn(hidden, q_rows, device=device, dtype=dtype) * 0.02,
            "down": torch.randn(hidden, inter, device=device, dtype=dtype) * 0.02,
            "q": qkv[:q_rows], "k": qkv[q_rows:q_rows + kv_rows], "v": qkv[q_rows + kv_rows:],
            "gate": gate_up[:inter], "up": gate_up[inter:]})
    return weights


def step_function(weights: list[dict], head: torch.Tensor, layout: str):
    """One step's products in ``layout``; inputs are fixed vectors (the floor, not the model's arithmetic)."""
    names = ("q", "k", "v", "o", "gate", "up", "down") if layout == "separate" else ("qkv", "o", "gate_up", "down")
    if layout == "fused-inductor":  # Inductor writes the reduction itself
        linear = torch.compile(lambda x, weight: (weight * x).sum(-1), dynamic=False, fullgraph=True)
    else:
        linear = F.linear
    inputs = {width: torch.randn(1, width, device=head.device, dtype=head.dtype) * 0.1
              for width in {weight.shape[1] for layer in weights for weight in layer.values()}}
    outputs: list[torch.Tensor] = []

    def step() -> None:
        outputs.clear()
        for layer in weights:
            for name in names:
                weight = layer[name]
                outputs.append(linear(inputs[weight.shape[1]], weight))
        outputs.append(linear(inputs[head.shape[1]], head))

    names_bytes = sum(layer[name].numel() * layer[name].element_size() for layer in weights for name in names)
    return step, names_bytes + head.numel() * head.element_size()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="llama-3.1-8b", choices=sorted(CONFIGS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, help="default: the config's")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--compile-s", type=float, default=90.0,
                        help="skip fused-inductor if less than this is left of --budget-s (its compile is slow)")
    parser.add_argument("--budget-s", type=float, default=150.0)
    args = parser.parse_args()
    started = time.perf_counter()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = CONFIGS[args.config]
    torch.manual_seed(0)
    weights = layer_weights(spec, args.layers or spec["num_hidden_layers"], device, dtype)
    head = torch.randn(spec["vocab_size"], spec["hidden_size"], device=device, dtype=dtype) * 0.02
    meta = {"config": args.config, "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "layers": len(weights), "torch": torch.__version__}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    print(json.dumps({"meta": meta}), flush=True)
    layouts = ["separate", "fused"] + (["fused-cublaslt"] if device.type == "cuda" else []) + ["fused-inductor"]
    for layout in layouts:
        row = {"layout": layout}
        if layout == "fused-inductor" and time.perf_counter() - started > args.budget_s - args.compile_s:
            print(json.dumps({**row, "skipped": f"less than --compile-s {args.compile_s:g} s left"}), flush=True)
            continue
        library = torch.backends.cuda.preferred_blas_library() if device.type == "cuda" else None
        try:
            if layout == "fused-cublaslt":
                torch.backends.cuda.preferred_blas_library("cublaslt")
            step, weight_bytes = step_function(weights, head, layout)
            seconds = replayed_seconds(step, device, args.replays)
            row.update(step_ms=round(seconds * 1000, 4), weight_bytes=weight_bytes,
                       weight_gb=round(weight_bytes / 1e9, 3), tb_s=round(weight_bytes / seconds / 1e12, 3))
        except Exception as error:  # noqa: BLE001 -- one layout's failure is its row; the others still run
            row["error"] = f"{type(error).__name__}: {error}"[:600]
        finally:
            if library is not None:
                torch.backends.cuda.preferred_blas_library(library)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
