"""KVzip against an independent computation: the attention rows of the repeat tokens, taken from a plain
eager forward of the prompt followed by the reconstruction input, renormalised over the keys KVzip's
softmax runs over; and the engine's reconstruction pass leaves the prefill's cache exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvviz
from kvviz import engine, reconstruction
from kvviz.policies.kvzip import KVzip


def _reference_scores(family, tokenizer, prompt, chunk, sinks):
    """Per prompt position: layer mean of the KV-head mean of the largest (group head, repeat query)
    attention, with each row renormalised over the sinks, the chunk and the repeat tokens."""
    model, _ = kvviz.models.tiny_model(family)  # same seed, same weights as the model under test
    model.set_attn_implementation("eager")
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    length = len(prompt)
    scores = torch.zeros(length)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        text = engine.REPEAT_ALL if start == 0 else engine.REPEAT_FROM
        repeat = (tokenizer(text, add_special_tokens=False)["input_ids"] + prompt[max(0, start - 8):start]
                  + prompt[start:end])
        with torch.no_grad():
            attentions = model(input_ids=torch.tensor([prompt + repeat]), output_attentions=True).attentions
        columns = torch.zeros(length + len(repeat), dtype=torch.bool)
        columns[:sinks], columns[start:end], columns[length:] = True, True, True
        in_chunk = torch.zeros_like(columns)
        in_chunk[start:end] = True
        per_layer = []
        for attention in attentions:  # (1, heads, T, T)
            rows = attention[0, :, length:][:, :, columns]
            rows = rows / rows.sum(-1, keepdim=True)
            best = rows[:, :, in_chunk[columns]].amax(1)  # (heads, chunk)
            per_layer.append(best.view(config.num_key_value_heads, group, -1).amax(1).mean(0))
        scores[start:end] = torch.stack(per_layer).mean(0)
    return scores


@pytest.mark.parametrize("family, chunk", [("llama", 2048), ("qwen2", 2048), ("llama", 32)])
def test_keep_set_and_utility_equal_the_repeat_tokens_attention(family, chunk, tiny_prompt, monkeypatch):
    monkeypatch.setattr(reconstruction, "RECONSTRUCTION_CHUNK", chunk)
    model, tokenizer = kvviz.models.tiny_model(family)
    budget, sinks = 30, 4
    reference = _reference_scores(family, tokenizer, tiny_prompt, chunk, sinks)
    events = kvviz.run(model, tokenizer, tiny_prompt, "kvzip", budget=budget, max_new_tokens=4).trace.events
    ranked = sinks + torch.argsort(reference[sinks:], descending=True)
    assert events[0].kept.tolist() == sorted(list(range(sinks)) + ranked[:budget - sinks].tolist())
    kept = torch.from_numpy(events[0].kept)[sinks:]
    torch.testing.assert_close(torch.from_numpy(events[0].utility)[sinks:], reference[kept], rtol=1e-4, atol=1e-6)
    assert all(e.evicted.size == 0 for e in events[1:])  # prefill-time: nothing evicted while decoding
    assert all(e.raw is None for e in events)  # its score is the reconstruction's utility, not a per-step raw score


def test_reconstruction_leaves_the_prefill_cache_and_the_output_unchanged(tiny, tiny_prompt, monkeypatch):
    monkeypatch.setattr(reconstruction, "RECONSTRUCTION_CHUNK", 40)  # several passes
    model, tokenizer = tiny
    length = len(tiny_prompt)
    cache = engine.EvictingCache(model, KVzip(), budget=length, capacity=length + 1)
    first = next(engine.decode(model, tokenizer, tiny_prompt, cache.policy, budget=length, max_new_tokens=4,
                               cache=cache))
    assert first.kept.tolist() == list(range(length)) and cache.seen == length
    plain = engine.prefill(model, tiny_prompt)
    order = torch.argsort(cache.live_positions())
    for ours, theirs in zip(cache.layers, plain.cache.layers):
        assert torch.equal(ours.keys[:, :, :length][:, :, order], theirs.keys[:, :, :length])
        assert torch.equal(ours.values[:, :, :length][:, :, order], theirs.values[:, :, :length])
    # With room for everything it generates what the full cache (and so model.generate) does.
    roomy = kvviz.run(model, tokenizer, tiny_prompt, "kvzip", budget=length + 20, max_new_tokens=16)
    assert roomy.token_ids == kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=16).token_ids
    assert roomy.trace.events[0].t_score > 0  # the reconstruction is the policy's cost


def test_model_generate_integration_refuses_it(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="reconstruction pass .* use kvviz.run or kvviz.stream"):
        with kvviz.attach(model, "kvzip", compression=0.5):
            pass


def test_cells_of_one_prompt_at_several_budgets_run_the_reconstruction_once(tiny, tiny_prompt, monkeypatch):
    """The pass reads the prompt and the setting, not the budget: from one shared prefill, a second budget (and
    the static backend's cut) restore its scores, and every run's events equal those of a run on its own;
    another setting (sinks) runs its own pass."""
    from kvviz.backend.static import StaticBackend

    model, tokenizer = tiny
    calls = []
    real = reconstruction.reconstruct
    monkeypatch.setattr(reconstruction, "reconstruct", lambda *args: calls.append(1) or real(*args))

    def events(budget: int, shared=None, sinks: int = 4) -> list:
        return list(engine.decode(model, tokenizer, tiny_prompt, KVzip(sinks=sinks), budget=budget,
                                  max_new_tokens=6, shared=shared))

    alone = {budget: events(budget) for budget in (20, 30)}
    assert len(calls) == 2
    shared = engine.prefill(model, tiny_prompt, window=1)
    together = {budget: events(budget, shared) for budget in (20, 30)}
    assert len(calls) == 3  # the first shared run's pass alone
    for budget in (20, 30):
        assert [e.new_token_id for e in together[budget]] == [e.new_token_id for e in alone[budget]]
        assert all(np.array_equal(a.kept, b.kept) and np.array_equal(a.utility, b.utility)
                   for a, b in zip(together[budget], alone[budget]))
    static = list(StaticBackend(model, KVzip()).stream(tokenizer, tiny_prompt, budget=25, max_new_tokens=6,
                                                      shared=shared))
    assert len(calls) == 3 and [e.new_token_id for e in static] == [e.new_token_id for e in events(25)]
    events(20, shared, sinks=2)
    assert len(calls) == 5  # sinks=2 is another setting: its own pass (and events(25) ran one on its own)
