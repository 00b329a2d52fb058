"""A static decode step for InertiaKV: B + 1 preallocated slots, attention and scores from one pass.

The reference engine (:mod:`kvviz.engine`) goes through the HF forward, a second pass over the keys for
the scores and host-side eviction.  Here, once the cache sits at its budget, one decode step is a fixed
sequence of tensor ops with static shapes:

* the new token's key/value are written into the slot freed by the previous eviction (no copies);
* each layer computes its float32 attention probabilities once and uses them both for the output and,
  head-averaged, for the layer-sequential EMA ``m <- a*m + (1-a)*s``;
* the next token (greedy) and the slot to free (lowest ``m``, ties to the older position) are chosen
  with device reductions, so nothing waits on the host.

That is the shape CUDA graphs need (``graph=True`` captures the step on a GPU and replays it).  Prefill
and the first decode step (which attends to the whole prompt) run as in the reference engine.  Llama,
Qwen2/2.5/3 and Mistral layouts; batch size 1; greedy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from . import engine
from .policies.inertia import InertiaKV
from .policies.recency import Recency


@dataclass
class StaticRun:
    token_ids: list[int]
    kept: list[list[int]]  # sorted positions after each decode step (only when record_kept)
    first_token_time: float = 0.0  # perf_counter when token 1 was out (end of prefill), for benchmarks


class StaticInertia:
    """InertiaKV decoding over a static slot cache (attention scorer, all layers eligible).

    ``refresh`` as in :class:`~kvviz.policies.inertia.InertiaKV` (1 every step, r lazy, 0 score-free);
    ``scoring=False`` never computes a score, so every utility stays 0 and the oldest entry goes: the
    B-slot cache without scoring (a sliding window, equal to the ``recency`` policy) -- the speed baseline.
    """

    def __init__(self, model, *, alpha: float = 0.8, refresh: int = 1, scoring: bool = True):
        self.model, self.alpha, self.refresh, self.scoring = model, alpha, refresh, scoring
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.heads = model.config.num_attention_heads
        self.kv_heads = model.config.num_key_value_heads
        self.head_dim = attn.head_dim
        self.scaling = attn.scaling

    def _layer(self, index: int, hidden: torch.Tensor, cos, sin, free: torch.Tensor, keys, values,
               m: torch.Tensor | None) -> torch.Tensor:
        layer = self.layers[index]
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, 1, self.heads, self.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, 1, self.kv_heads, self.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, 1, self.kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys.index_copy_(2, free, k)
        values.index_copy_(2, free, v)
        groups = self.heads // self.kv_heads
        logits = torch.matmul(q.float().view(self.kv_heads, groups, self.head_dim),
                              keys[0].float().transpose(1, 2)) * self.scaling  # (kv, g, n)
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, values[0].float()).to(hidden.dtype)  # (kv, g, d)
        if m is not None:  # layer-sequential EMA from the same probabilities
            m.mul_(self.alpha).add_(probs.mean((0, 1)), alpha=1.0 - self.alpha)
        hidden = hidden + attn.o_proj(out.reshape(1, 1, self.heads * self.head_dim))
        return hidden + layer.mlp(layer.post_attention_layernorm(hidden))

    @torch.inference_mode()
    def generate(self, tokenizer, prompt_ids: list[int], budget: int, max_new_tokens: int,
                 record_kept: bool = False, graph: bool = False, timer=None) -> StaticRun:
        model, device = self.model, self.model.device
        policy = InertiaKV(alpha=self.alpha, refresh=self.refresh) if self.scoring else Recency()
        # Prefill and step 1 through the reference engine: step 1 attends to the whole prompt.
        cache = engine.EvictingCache(model, policy, budget=budget, capacity=len(prompt_ids) + 1)
        events = engine.decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=2,
                               ignore_eos=True, cache=cache)
        first = next(events)
        if timer is not None:
            timer()
        first_token_time = time.perf_counter()
        second = next(events)
        tokens = [first.new_token_id, second.new_token_id]
        kept_log = [second.kept.tolist()] if record_kept else []
        if max_new_tokens <= 2:
            return StaticRun(tokens[:max_new_tokens], kept_log, first_token_time)

        slots = budget + 1
        size = cache.size
        keys = [layer.keys[:, :, :size].clone() for layer in cache.layers]
        values = [layer.values[:, :, :size].clone() for layer in cache.layers]
        keys = [torch.cat([k, k.new_zeros(1, k.shape[1], slots - size, k.shape[3])], 2) for k in keys]
        values = [torch.cat([v, v.new_zeros(1, v.shape[1], slots - size, v.shape[3])], 2) for v in values]
        positions = torch.full((slots,), -1, dtype=torch.long, device=device)
        positions[:size] = cache.live_positions().to(device)
        m = torch.zeros(slots, dtype=torch.float32, device=device)
        if self.scoring:
            m[:size] = policy.m[cache.live_positions()].to(device)
        free = torch.tensor([size], device=device)  # the empty slot takes the next token
        token = torch.tensor([[tokens[-1]]], device=device)
        position = torch.tensor([[len(prompt_ids) + 1]], device=device)
        big = torch.iinfo(torch.long).max

        def step(scoring: bool) -> None:  # in place only: a CUDA graph replays exactly these kernels
            m_enter = torch.zeros((), device=device) if scoring else \
                (m.sum() - m[free].sum()) / (slots - 1)  # mean of the entries already cached
            m.index_fill_(0, free, 0.0)
            m.index_add_(0, free, m_enter.reshape(1))
            positions.index_copy_(0, free, position[0])
            hidden = model.model.embed_tokens(token)
            cos, sin = model.model.rotary_emb(hidden, position)
            for index in range(len(self.layers)):
                hidden = self._layer(index, hidden, cos, sin, free, keys[index], values[index], m if scoring else None)
            logits = model.lm_head(model.model.norm(hidden))[0, -1]
            token.copy_(logits.argmax().reshape(1, 1))
            lowest = torch.where(m == m.min(), positions, big).argmin()  # ties: the older position goes
            free.copy_(lowest.reshape(1))
            position.add_(1)

        graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        for k in range(2, max_new_tokens):
            scoring = self.scoring and ((k - 1) % self.refresh == 0 if self.refresh else False)
            if graph and device.type == "cuda" and scoring in graphs:
                graphs[scoring].replay()
            else:
                step(scoring)  # eagerly; on a GPU this also warms up, then the same step is recorded once
                if graph and device.type == "cuda":
                    graphs[scoring] = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graphs[scoring]):  # recorded, not executed
                        step(scoring)
            tokens.append(token.clone())  # stays on the device: converted once at the end
            if record_kept:  # test-only: reading the kept set syncs with the host
                live = positions[torch.arange(slots, device=device) != free[0]]
                kept_log.append(sorted(live.tolist()))
        tokens = tokens[:2] + [int(t) for t in tokens[2:]]
        return StaticRun(tokens, kept_log, first_token_time)
