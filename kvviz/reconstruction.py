"""KVzip's context reconstruction: after the prefill, the model is asked to repeat its prompt chunk by chunk
(teacher-forced), the policy scores the cached entries from those repeat queries' attention, and the repeated
tokens are dropped again.  Driven by :func:`kvviz.engine.decode` for a policy that ``reconstructs``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from . import scoring

if TYPE_CHECKING:
    from .engine import EvictingCache, Prefill

RECONSTRUCTION_CHUNK = 2048  # prompt tokens repeated per pass (KVzip's chunk size)
REPEAT_ALL = "\n\nRepeat the previous context exactly."
REPEAT_FROM = "\n\nRepeat the part of the previous context exactly, starting with"


class _ReconstructionSink:
    """Score sink for one reconstruction pass: hands the policy every repeat query's view."""

    def __init__(self, cache: EvictingCache, count: int, chunk: tuple[int, int]):
        self.cache, self.prefill_window, self.chunk = cache, count, chunk

    def wants_layer(self, layer: int) -> bool:
        return self.cache.policy.wants_layer(layer)

    def on_layer(self, view) -> None:  # never called: a reconstruction pass has several queries
        pass

    def on_prefill_layer(self, view) -> None:
        self.cache.policy.observe_reconstruction(view, self.cache.live_positions(), self.chunk)


def repeat_passes(tokenizer, prompt_ids: list[int]) -> Iterator[tuple[int, int, list[int]]]:
    """KVzip's reconstruction passes: for each chunk ``[start, end)`` of the prompt, the ids fed after it --
    an instruction to repeat it, the previous chunk's last 8 tokens ("starting with"), the chunk itself."""
    for start in range(0, len(prompt_ids), RECONSTRUCTION_CHUNK):
        end = min(start + RECONSTRUCTION_CHUNK, len(prompt_ids))
        instruction = tokenizer(REPEAT_ALL if start == 0 else REPEAT_FROM, add_special_tokens=False)["input_ids"]
        yield start, end, instruction + prompt_ids[max(0, start - 8):start] + prompt_ids[start:end]


def reconstruct(model, tokenizer, cache: EvictingCache, prompt_ids: list[int]) -> float:
    """KVzip's context reconstruction, after the prefill: for each chunk of the prompt, feed an instruction
    to repeat it plus the chunk itself (teacher-forced), let the policy see those queries' views, then drop
    the repeated tokens so that the cache is the prefill's again.  Returns the seconds it took."""
    from .engine import cache_kwarg, settle  # the engine imports this module; imported at call time, no cycle

    start_time = time.perf_counter()
    prompt_len, device, capacity = len(prompt_ids), model.device, cache.layers[0].capacity
    for start, end, ids in repeat_passes(tokenizer, prompt_ids):
        with scoring.scoring(_ReconstructionSink(cache, len(ids), (start, end))):
            model(input_ids=torch.tensor([ids], device=device),
                  position_ids=torch.arange(prompt_len, prompt_len + len(ids), device=device)[None],
                  logits_to_keep=1, **{cache_kwarg(model): cache})
        cache.evict(torch.nonzero(cache.live_positions() >= prompt_len).flatten())
        cache.seen = prompt_len
    cache.resize(capacity)  # the repeat tokens grew the slots; hand that memory back
    settle(device)
    return time.perf_counter() - start_time


def reconstruct_once(model, tokenizer, cache: EvictingCache, prompt_ids: list[int], shared: Prefill | None) -> float:
    """:func:`reconstruct`, run once per prompt and policy setting where a shared prefill keeps what it
    scored: the pass reads the prompt and the setting, never the budget, so the cells of one sample at
    several budgets (a sweep's, a comparison's) restore its scores instead of repeating it.  Returns the
    seconds spent here (0 for a restored run)."""
    policy = cache.policy
    if shared is None or shared.prompt_ids != list(prompt_ids):
        return reconstruct(model, tokenizer, cache, prompt_ids)
    key = (type(policy).__name__, tuple(sorted(policy.params().items())))
    if key in shared.reconstructions:
        policy.restore_reconstruction(shared.reconstructions[key])
        return 0.0
    seconds = reconstruct(model, tokenizer, cache, prompt_ids)
    shared.reconstructions[key] = policy.reconstruction_state()
    return seconds
