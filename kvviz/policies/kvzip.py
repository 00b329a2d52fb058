"""KVzip: keep the entries the model needs to reconstruct its own context.

Kim et al. 2025, the reconstruction-based baseline of InertiaKV's Table 4 (higher RULER quality than
InertiaKV there, at several times the prefill cost).  After the prefill the engine feeds "Repeat the
previous context exactly." plus the prompt itself, teacher-forced, over the prefilled cache
(:func:`kvviz.reconstruction.reconstruct`), in chunks of 2,048 tokens; a later chunk's instruction asks to repeat
"starting with" the previous chunk's last 8 tokens.  Each prompt entry scores the largest attention any
repeat query of its chunk pays it, over the query heads of its KV head; the softmax runs over the sinks,
the chunk and the repeat tokens (causal among those), as in the original.  The repeat tokens are then
dropped, so decoding starts from the prefill's cache cut to ``B``; generated tokens accumulate, like
SnapKV's.

kvviz keeps one keep set, so the score is averaged over KV heads and layers (the original ranks
(layer, head, entry) triples against one global threshold).  The whole prompt is reconstructed,
chat-template tokens included, and the instruction is not wrapped in a chat turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..scoring import PrefillView
from .base import NO_SLOTS, BudgetTooSmall, Policy, lowest, param

QUERY_BLOCK = 256  # repeat queries scored at once: bounds the (heads, block, keys) logits


def reconstruction_scores(view: PrefillView, positions: torch.Tensor, chunk: tuple[int, int],
                          sinks: int) -> torch.Tensor:
    """Largest attention from a repeat query to each entry of ``chunk``, KV-head mean.

    Parameters
    ----------
    view : PrefillView
        ``queries`` ``(num_heads, q, head_dim)``: the repeat tokens', which are the last ``q`` live slots;
        ``keys`` ``(num_kv_heads, n, head_dim)`` in slot order.
    positions : torch.Tensor
        ``(n,)`` absolute position of each slot.
    chunk : (int, int)
        The prompt positions ``[start, end)`` this pass repeats.

    Returns
    -------
    torch.Tensor
        ``(end - start,)`` float32 on CPU, in position order.
    """
    heads, count, dim = view.queries.shape
    num_kv = view.keys.shape[0]
    start, end = chunk
    repeat = torch.zeros_like(positions, dtype=torch.bool)
    repeat[-count:] = True
    columns = (positions < sinks) | ((positions >= start) & (positions < end)) | repeat
    keys = view.keys[:, columns.to(view.keys.device)].float()
    key_positions = positions[columns].to(view.keys.device)
    query_positions = positions[-count:].to(view.keys.device)
    in_chunk = (key_positions >= start) & (key_positions < end)
    best = torch.zeros(num_kv, int(in_chunk.sum()), device=keys.device)
    queries = view.queries.float().reshape(num_kv, heads // num_kv, count, dim)
    for first in range(0, count, QUERY_BLOCK):
        block = queries[:, :, first:first + QUERY_BLOCK]  # (kv heads, group, block, dim)
        logits = (block @ keys[:, None].transpose(-1, -2)) * view.scaling  # (kv heads, group, block, keys)
        future = key_positions[None] > query_positions[first:first + QUERY_BLOCK, None]
        probs = torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)[..., in_chunk]
        best = torch.maximum(best, probs.amax(dim=(1, 2)))
    order = torch.argsort(key_positions[in_chunk])
    return best.mean(0)[order].cpu()


@dataclass
class KVzip(Policy):
    """Prefill-time selection by how much a context-reconstruction pass attends to each prompt entry."""

    prefill_window: ClassVar[int] = 1  # evicts at prefill; its scores come from the reconstruction pass
    reconstructs: ClassVar[bool] = True

    sinks: int = param(4, low=0, high=64, help="first prompt tokens always kept")

    def __post_init__(self):
        if self.sinks < 0:
            raise ValueError(f"sinks must be >= 0, got {self.sinks}")

    def reset(self, prompt_len: int, budget: int, num_layers: int = 0) -> None:
        if budget <= self.sinks:
            raise BudgetTooSmall(budget, self.sinks, f"the {self.sinks} sink tokens KVzip always keeps", "sinks")
        super().reset(prompt_len, budget, num_layers)
        self.total = torch.zeros(prompt_len)  # summed over the layers that scored each position
        self.layers_seen = torch.zeros(prompt_len)

    def observe_reconstruction(self, view: PrefillView, positions: torch.Tensor, chunk: tuple[int, int]) -> None:
        start, end = chunk
        self.total[start:end] += reconstruction_scores(view, positions, chunk, self.sinks)
        self.layers_seen[start:end] += 1

    def reconstruction_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the reconstruction pass scored, for a run of this setting on the same prompt at another budget."""
        return self.total.clone(), self.layers_seen.clone()

    def restore_reconstruction(self, state: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.total, self.layers_seen = (tensor.clone() for tensor in state)

    def select_evictions(self, step: int, positions: torch.Tensor, budget: int) -> torch.Tensor:
        count = positions.numel() - budget
        if step != 0 or count <= 0:
            return NO_SLOTS
        return lowest(self.utility(positions), positions, count)

    def utility(self, positions: torch.Tensor) -> torch.Tensor:
        prompt = positions < self.prompt_len
        score = torch.full(positions.shape, float("inf"))  # generated tokens: never judged, never evicted
        index = positions[prompt]
        score[prompt] = self.total[index] / self.layers_seen[index].clamp_min(1)
        return torch.where(positions < self.sinks, float("inf"), score)

    def pinned(self, budget: int) -> tuple[int, int]:
        return self.sinks, 0

    def cache_bound(self, budget: int, step: int) -> int:
        return budget + step
