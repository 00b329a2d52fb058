"""The full cache as a static step: the speed baseline a static eviction step is measured against.

Every slot a run will fill (prompt + new tokens, padded to whole value blocks) is allocated after the
prefill; each step writes the new token's key and value into the next slot and attends over all of them,
the slots not written yet masked by a ``-inf`` bias, so the step's shapes never change and on a GPU it is
captured once as a CUDA graph and replayed (:func:`kvviz.fast.capture_step`).  It uses the kernels of the
static backend's step (:func:`kvviz.fast.layer_forward`: fused projections, float32 softmax, blocked value
product), so the ratio of an eviction step's speed to this one's is what holding B entries instead of the
whole cache buys, and nothing else.  Greedy only; it evicts nothing and has no policy.
"""

from __future__ import annotations

import time

import torch

from .. import engine, fast


class StaticFullCache:
    """Greedy decoding over preallocated full-cache slots, one captured step on a GPU.

    ``fuse`` and ``value_block`` as in :class:`kvviz.backend.static.StaticBackend`.
    """

    def __init__(self, model, *, fuse: bool = True, value_block: int | None = None):
        if model.config.model_type not in fast.SUPPORTED:
            raise ValueError(f"the static step reproduces {', '.join(fast.SUPPORTED)} decoder layers, not "
                             f"{model.config.model_type!r}")
        self.model, self.layers = model, model.model.layers
        self.fp32_logits = fast.fp32_logits_supported(model.device, model.dtype)
        self.value_block = (fast.VALUE_BLOCK if model.device.type == "cuda" else 0) if value_block is None \
            else value_block
        self.projections = [fast.fused_projections(layer) if fuse else None for layer in self.layers]

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int, *, graph: bool = True, timer=None,
                 shared: engine.Prefill | None = None) -> fast.StaticRun:
        """Up to ``max_new_tokens`` greedy tokens (no stop token: a fixed length, as a benchmark wants).

        ``shared``: start from a copy of this prompt's prefill; ``timer``: called once the first token is
        out (a benchmark syncs the device there).  Steps from token 2 on are timed (``step_seconds``); the
        first one captures the graph on a GPU (``setup_steps``)."""
        model, device = self.model, self.model.device
        prompt_len = len(prompt_ids)
        if shared is not None and shared.prompt_ids != list(prompt_ids):
            raise ValueError("the shared prefill was made for another prompt")
        prefill = shared if shared is not None else engine.prefill(model, prompt_ids)
        token = prefill.logits.argmax().reshape(1, 1)
        if timer is not None:
            timer()
        first_token_time = time.perf_counter()
        if max_new_tokens <= 1:
            return fast.StaticRun([int(token)], [], first_token_time)
        padded = fast.padded_slots(prompt_len + max_new_tokens - 1, self.value_block)
        keys, values = [], []
        for layer in prefill.cache.layers:  # padding stays zero: finite, and weighed zero by the bias
            k, v = layer.keys[:, :, :prompt_len], layer.values[:, :, :prompt_len]
            keys.append(torch.cat([k, k.new_zeros(1, k.shape[1], padded - prompt_len, k.shape[3])], 2))
            values.append(torch.cat([v, v.new_zeros(1, v.shape[1], padded - prompt_len, v.shape[3])], 2))
        del prefill
        bias = torch.full((padded,), float("-inf"), device=device)
        bias[:prompt_len] = 0.0
        state = dict(token=token, free=torch.tensor([prompt_len], device=device),
                     position=torch.tensor([[prompt_len]], device=device), bias=bias)

        def step() -> None:  # in place only: a CUDA graph replays exactly these kernels
            state["bias"].index_fill_(0, state["free"], 0.0)  # the new token's slot joins the attention
            hidden = model.model.embed_tokens(state["token"])
            cos, sin = model.model.rotary_emb(hidden, state["position"])
            for layer, fused, layer_keys, layer_values in zip(self.layers, self.projections, keys, values):
                hidden, _ = fast.layer_forward(layer, hidden, cos, sin, state["free"], layer_keys, layer_values,
                                               self.fp32_logits, fused, None, self.value_block,
                                               bias=state["bias"])
            state["token"].copy_(model.lm_head(model.model.norm(hidden))[0, -1].argmax().reshape(1, 1))
            state["free"].add_(1)
            state["position"].add_(1)

        captured = graph and device.type == "cuda"
        tokens, setup_steps, replay = [token.clone()], [], None
        clock = fast.StepClock(device)
        clock.mark()
        for k in range(1, max_new_tokens):
            setup_steps.append(captured and k <= 2)  # the capture, then the first replay (graph upload)
            if replay is not None:
                replay.replay()
            elif captured:  # runs the step once, eagerly, then records it
                replay = fast.capture_step(step)
            else:
                step()
            clock.mark()
            tokens.append(state["token"].clone())
        return fast.StaticRun([int(t) for t in tokens], [], first_token_time, clock.intervals(), setup_steps)
