"""Expected Attention against independent computations: the Gaussian expectation by sampling, the RoPE
algebra against transformers' own rotary code, and the prefill keep set against a reference built from
the model's pre-RoPE queries (hooked at the projection) and its cached keys."""

from __future__ import annotations

import pytest
import torch
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
    torch.testing.assert_close(got.double(), torch.cat([torch.zeros(1, dtype=torch.float64), expected]), rtol=1e-5, atol=1e-7)


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
            model(input_ids=torch.tensor([ids]), position_ids=torch.arange(len(ids))[None], **{cache_kwarg(model): cache})
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


def _reference_prefill_scores(model, ids, future, sinks):
    """Expected Attention written out from the hooked pre-RoPE queries: population mean and covariance per
    head, the mean of transformers' own rotations over the next ``future`` positions, then the formula."""
    pre, views = _pre_rope_queries(model, ids)
    n = len(ids)
    cos, sin = model.model.rotary_emb(torch.zeros(1), torch.arange(n, n + future)[None])
    cos, sin = cos[0].double(), sin[0].double()
    dim = cos.shape[-1]
    eye = torch.eye(dim, dtype=torch.float64)
    rotation = torch.stack([(eye * c + rotate_half(eye) * s).T for c, s in zip(cos, sin)]).mean(0)
    per_layer = []
    for layer, view in sorted(views.items()):
        queries = pre[layer][:, sinks:].double()  # (heads, n - sinks, dim)
        keys, values = view.keys.double(), view.values.double()
        group = queries.shape[0] // keys.shape[0]
        score = torch.zeros(keys.shape[0], n, dtype=torch.float64)
        for head in range(queries.shape[0]):
            mean = rotation @ queries[head].mean(0)
            cov = rotation @ torch.cov(queries[head].T, correction=0) @ rotation.T
            k = keys[head // group]
            logits = view.scaling * k @ mean + view.scaling ** 2 / 2 * ((k @ cov) * k).sum(-1)
            probs = torch.zeros(n, dtype=torch.float64)
            probs[sinks:] = torch.softmax(logits[sinks:], -1)
            score[head // group] += probs / group
        per_layer.append((score * values.norm(dim=-1)).mean(0))
    return torch.stack(per_layer).mean(0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_keep_set_and_utility_equal_the_written_out_formula(family, tiny_prompt):
    model, tokenizer = kvviz.models.tiny_model(family)
    budget, sinks = 30, 4
    reference = _reference_prefill_scores(model, tiny_prompt, future=512, sinks=sinks)
    events = kvviz.run(model, tokenizer, tiny_prompt, "expected-attention", budget=budget, max_new_tokens=4).trace.events
    ranked = sinks + torch.argsort(reference[sinks:], descending=True)
    expected = sorted(range(sinks)) + sorted(ranked[:budget - sinks].tolist())
    assert events[0].kept.tolist() == sorted(expected)
    kept = torch.from_numpy(events[0].kept)
    torch.testing.assert_close(torch.from_numpy(events[0].utility)[sinks:].double(), reference[kept[sinks:]],
                               rtol=1e-4, atol=1e-7)
    assert all(e.evicted.size == 0 for e in events[1:])  # prefill-time: nothing evicted while decoding


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


def test_refuses_models_and_budgets_it_cannot_serve():
    policy = kvviz.make_policy("expected-attention-decode")
    policy.reset(prompt_len=10, budget=8)
    policy.begin_step(1, torch.arange(10), 10)
    view = LayerView(0, torch.zeros(2, 4), torch.zeros(1, 11, 4), torch.zeros(1, 11, 4), 0.5, rope=None)
    with pytest.raises(ValueError, match="rotary position embeddings"):
        policy.observe(view, torch.arange(11))
    with pytest.raises(ValueError, match="budget 4 must exceed the 4 sink tokens"):
        kvviz.make_policy("expected-attention").reset(prompt_len=10, budget=4)
