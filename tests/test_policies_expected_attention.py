"""Expected Attention against independent computations: the Gaussian expectation by sampling, the RoPE
algebra against transformers' own rotary code, and the prefill keep set against a reference built from
the model's pre-RoPE queries (hooked at the projection) and its cached keys."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, rotate_half

import kvviz
from kvviz import scoring
from kvviz.engine import cache_kwarg
from kvviz.policies.expected_attention import expected_attention, mean_rotation, unrotate
from kvviz.scoring import LayerView


def test_expected_attention_is_the_gaussian_expectation_of_the_softmax_numerator():
    """softmax_i(s mu.k_i + s^2 k_i^T Sigma k_i / 2) = E[exp(s q.k_i)] / sum_j E[exp(s q.k_j)], q ~ N(mu, Sigma)."""
    generator = torch.Generator().manual_seed(0)
    dim, n, scaling = 4, 6, 0.5
    keys = torch.randn(1, n, dim, generator=generator, dtype=torch.float64)
    mean = torch.randn(1, dim, generator=generator, dtype=torch.float64)
    root = torch.randn(dim, dim, generator=generator, dtype=torch.float64) * 0.5
    cov = (root @ root.T)[None]
    samples = mean + torch.randn(400_000, dim, generator=generator, dtype=torch.float64) @ root.T
    numerator = torch.exp(scaling * samples @ keys[0].T).mean(0)
    excluded = torch.zeros(n, dtype=torch.bool)
    got = expected_attention(keys, torch.ones_like(keys), mean, cov, scaling, excluded, vnorm=False, epsilon=0.0)
    torch.testing.assert_close(got.double(), numerator / numerator.sum(), rtol=0.02, atol=0.0)
    # Without the covariance term it is the softmax of the mean query's logits; sinks get 0.
    excluded[0] = True
    got = expected_attention(keys, torch.ones_like(keys), mean, None, scaling, excluded, vnorm=False, epsilon=0.0)
    expected = torch.softmax(scaling * (mean @ keys[0, 1:].T)[0], -1)
    torch.testing.assert_close(got.double(), torch.cat([torch.zeros(1, dtype=torch.float64), expected]),
                               rtol=1e-5, atol=1e-7)


def test_rope_algebra_agrees_with_transformers_rotary_code(tiny):
    model, _ = tiny
    rope = scoring.rope_frequencies(model)
    dim = model.config.hidden_size // model.config.num_attention_heads
    assert rope is not None and 2 * rope.numel() == dim
    x = torch.randn(2, 5, dim, dtype=torch.float64)  # (heads, positions, dim)
    positions = torch.tensor([0, 3, 17, 40, 99])
    cos, sin = model.model.rotary_emb(x.float(), positions[None])
    rotated, _ = apply_rotary_pos_emb(x, x, cos[0].double(), sin[0].double(), unsqueeze_dim=0)
    torch.testing.assert_close(unrotate(rotated, positions, rope), x, rtol=1e-5, atol=1e-6)  # HF's cos in float32
    cos, sin = model.model.rotary_emb(x.float(), torch.arange(30, 30 + 64)[None])
    vector = x[0, 0]
    each = vector * cos[0].double() + rotate_half(vector) * sin[0].double()  # (64, dim): R_p x per position
    torch.testing.assert_close(mean_rotation(rope, 30, 64) @ vector, each.mean(0), rtol=1e-5, atol=1e-6)


class _Recorder:
    prefill_window = 1 << 30

    def __init__(self):
        self.views = {}

    def wants_layer(self, layer):
        return True

    def on_layer(self, view):
        pass

    def on_prefill_layer(self, view):
        self.views[view.layer] = view


def _pre_rope_queries(model, ids):
    """Each layer's pre-RoPE queries, ``(heads, n, dim)``, hooked where the model makes them (after the
    query bias of Qwen2 and the query norm of Qwen3 and OLMo-2; the query part of Phi-3's fused QKV
    projection), its post-RoPE prefill views, and its cached keys."""
    config = model.config
    heads = config.num_attention_heads
    width = heads * config.head_dim  # Phi-3's qkv_proj puts the queries first
    captured, hooks = {}, []
    for index, layer in enumerate(model.model.layers):
        attention = layer.self_attn
        source = getattr(attention, "q_norm", None) or getattr(attention, "q_proj", None) or attention.qkv_proj
        hooks.append(source.register_forward_hook(
            lambda module, args, out, index=index: captured.__setitem__(
                index, out[0][..., :width].reshape(len(ids), heads, -1).transpose(0, 1))))
    recorder = _Recorder()
    cache = kvviz.cache.SlotCache(config.num_hidden_layers, len(ids))
    scoring.install(model)
    try:
        with torch.inference_mode(), scoring.scoring(recorder):
            model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None],
                  **{cache_kwarg(model): cache})
    finally:
        for hook in hooks:
            hook.remove()
    return captured, recorder.views


@pytest.mark.parametrize("family", kvviz.models.SUPPORTED_TYPES)
def test_post_rope_queries_rotated_back_are_the_models_pre_rope_queries(family, tiny_prompt):
    model, _ = kvviz.models.tiny_model(family)
    pre, views = _pre_rope_queries(model, tiny_prompt)
    for layer, view in views.items():
        positions = torch.arange(len(tiny_prompt))
        torch.testing.assert_close(unrotate(view.queries, positions, view.rope).float(), pre[layer].float(),
                                   rtol=1e-4, atol=1e-5)


def _reference_scores(model, queries, keys, values, scaling, start, future, sinks, *, covariance=True, vnorm=True,
                      epsilon=0.0):
    """Expected Attention written out: per head the population mean and covariance of the pre-RoPE
    ``queries`` (per layer, ``(heads, m, dim)``, sinks already left out), the mean of transformers' own
    rotations over positions ``start .. start + future - 1``, then the formula over the cached ``keys`` and
    ``values`` (per layer, ``(kv heads, n, dim)``, post-RoPE); the first ``sinks`` entries score 0.  Returns
    the layer-mean ``(n,)`` float64 scores."""
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(start, start + future)[None])
    cos, sin = cos[0].double(), sin[0].double()
    dim = cos.shape[-1]
    eye = torch.eye(dim, dtype=torch.float64)
    rotation = torch.stack([(eye * c + rotate_half(eye) * s).T for c, s in zip(cos, sin)]).mean(0)
    per_layer = []
    for layer in sorted(queries):
        layer_queries = queries[layer].double()
        layer_keys, layer_values = keys[layer].double(), values[layer].double()
        n = layer_keys.shape[1]
        group = layer_queries.shape[0] // layer_keys.shape[0]
        score = torch.zeros(layer_keys.shape[0], n, dtype=torch.float64)
        for head in range(layer_queries.shape[0]):
            mean = rotation @ layer_queries[head].mean(0)
            k = layer_keys[head // group]
            logits = scaling * k @ mean
            if covariance:
                cov = rotation @ torch.cov(layer_queries[head].T, correction=0) @ rotation.T
                logits = logits + scaling ** 2 / 2 * ((k @ cov) * k).sum(-1)
            probs = torch.zeros(n, dtype=torch.float64)
            probs[sinks:] = torch.softmax(logits[sinks:], -1)
            score[head // group] += probs / group
        if vnorm:
            score = (score + epsilon) * layer_values.norm(dim=-1)
            score[:, :sinks] = 0.0
        per_layer.append(score.mean(0))
    return torch.stack(per_layer).mean(0)


def _reference_prefill_scores(model, ids, future, sinks, **settings):
    """The written-out scores of a prompt's entries from the hooked pre-RoPE queries and the cached keys."""
    pre, views = _pre_rope_queries(model, ids)
    return _reference_scores(model, {layer: pre[layer][:, sinks:] for layer in views},
                             {layer: view.keys for layer, view in views.items()},
                             {layer: view.values for layer, view in views.items()},
                             views[0].scaling, len(ids), future, sinks, **settings)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_keep_set_and_utility_equal_the_written_out_formula(family, tiny_prompt):
    model, tokenizer = kvviz.models.tiny_model(family)
    budget, sinks = 30, 4
    reference = _reference_prefill_scores(model, tiny_prompt, future=512, sinks=sinks)
    result = kvviz.run(model, tokenizer, tiny_prompt, "expected-attention", budget=budget, max_new_tokens=4)
    events = result.trace.events
    ranked = sinks + torch.argsort(reference[sinks:], descending=True)
    expected = sorted(range(sinks)) + sorted(ranked[:budget - sinks].tolist())
    assert events[0].kept.tolist() == sorted(expected)
    kept = torch.from_numpy(events[0].kept)
    torch.testing.assert_close(torch.from_numpy(events[0].utility)[sinks:].double(), reference[kept[sinks:]],
                               rtol=1e-4, atol=1e-7)
    assert all(e.evicted.size == 0 for e in events[1:])  # prefill-time: nothing evicted while decoding


@pytest.mark.parametrize("settings", [dict(covariance=False), dict(vnorm=False), dict(epsilon=0.5)])
def test_each_setting_changes_the_prefill_scores_as_the_written_out_formula_does(tiny_prompt, settings):
    """The mean query alone (no covariance term), no value norm, and ``(p + epsilon) * |v|``: each the
    reference with that change, and each a different score from the default's."""
    model, tokenizer = kvviz.models.tiny_model("llama")
    budget, sinks = 30, 4
    reference = _reference_prefill_scores(model, tiny_prompt, 512, sinks, **settings)
    assert not torch.allclose(reference, _reference_prefill_scores(model, tiny_prompt, 512, sinks), rtol=1e-3)
    policy = kvviz.make_policy("expected-attention", **settings)
    event = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=1).trace.events[0]
    ranked = sinks + torch.argsort(reference[sinks:], descending=True)
    assert event.kept.tolist() == sorted(list(range(sinks)) + ranked[:budget - sinks].tolist())
    kept = torch.from_numpy(event.kept)
    torch.testing.assert_close(torch.from_numpy(event.utility)[sinks:].double(), reference[kept[sinks:]],
                               rtol=1e-4, atol=1e-7)


def test_decode_mode_evicts_the_lowest_reported_score_and_learns_from_every_query(tiny, tiny_prompt):
    model, tokenizer = tiny
    policy = kvviz.make_policy("expected-attention-decode")
    events = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=30, max_new_tokens=12).trace.events
    prefill_only = kvviz.run(model, tokenizer, tiny_prompt, "expected-attention", budget=30, max_new_tokens=1).trace
    assert events[0].kept.tolist() == prefill_only.events[0].kept.tolist()  # the same cut at prefill
    for event in events[1:]:
        present = event.present
        candidates = present >= policy.sinks
        assert event.evicted.tolist() == [present[candidates][event.raw[candidates].argmin()]]
    steps = len(events) - 1
    assert {stats.count for stats in policy.stats.values()} == {len(tiny_prompt) - policy.sinks + steps}


def test_decode_modes_first_step_equals_the_formula_with_its_query_added_and_the_window_moved_on(tiny_prompt):
    """Step 1 of ``decode=True`` against a reference built apart from the engine: HF's DynamicCache holds the
    prompt and the first generated token, the entries the prefill cut hidden from that token by an ordinary
    attention mask.  The statistics are the prompt's queries (sinks left out) plus the new token's, the
    rotation is averaged over the ``future`` positions after it, and the scores are over the entries
    present: the prefill's keep set and the new token.  The lowest non-sink score is evicted."""
    model, tokenizer = kvviz.models.tiny_model("llama")
    budget, sinks, future = 30, 4, 64
    policy = kvviz.make_policy("expected-attention-decode", future=future)
    events = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=2).trace.events
    n = len(tiny_prompt)
    kept, step = torch.from_numpy(events[0].kept), events[1]
    present = torch.cat([kept, torch.tensor([n])])
    assert step.present.tolist() == present.tolist()

    config = model.config
    heads, width = config.num_attention_heads, config.num_attention_heads * config.head_dim
    captured, hooks = {}, []
    for index, layer in enumerate(model.model.layers):
        hooks.append(layer.self_attn.q_proj.register_forward_hook(
            lambda module, args, out, index=index: captured.setdefault(index, []).append(
                out[0][..., :width].reshape(-1, heads, config.head_dim).transpose(0, 1))))
    cache = DynamicCache(config=config)
    mask = torch.zeros(1, n + 1, dtype=torch.long)
    mask[0, present] = 1
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([tiny_prompt]), **{cache_kwarg(model): cache})
            model(input_ids=torch.tensor([[step.token_id]]), attention_mask=mask, position_ids=torch.tensor([[n]]),
                  **{cache_kwarg(model): cache})
    finally:
        for hook in hooks:
            hook.remove()
    layers = range(config.num_hidden_layers)
    queries = {layer: torch.cat([captured[layer][0][:, sinks:], captured[layer][1]], dim=1) for layer in layers}
    keys = {layer: cache.layers[layer].keys[0][:, present] for layer in layers}
    values = {layer: cache.layers[layer].values[0][:, present] for layer in layers}
    scaling = config.head_dim ** -0.5
    reference = _reference_scores(model, queries, keys, values, scaling, n + 1, future, sinks)
    torch.testing.assert_close(torch.from_numpy(step.raw)[sinks:].double(), reference[sinks:], rtol=1e-4, atol=1e-7)
    assert step.evicted.tolist() == [int(present[sinks + reference[sinks:].argmin()])]
    # the window left where the prefill put it (from n, not n + 1) would be another score: the test tells them apart
    stale = _reference_scores(model, queries, keys, values, scaling, n, future, sinks)
    assert not torch.allclose(stale[sinks:], reference[sinks:], rtol=1e-4)


def test_refuses_models_and_budgets_it_cannot_serve():
    policy = kvviz.make_policy("expected-attention-decode")
    policy.reset(prompt_len=10, budget=8)
    policy.begin_step(1, torch.arange(10), 10)
    view = LayerView(0, torch.zeros(2, 4), torch.zeros(1, 11, 4), torch.zeros(1, 11, 4), 0.5, rope=None)
    with pytest.raises(ValueError, match="rotary position embeddings"):
        policy.observe(view, torch.arange(11))
    with pytest.raises(ValueError, match="budget 4 must exceed the 4 sink tokens"):
        kvviz.make_policy("expected-attention").reset(prompt_len=10, budget=4)
