"""The static decode path gives the reference engine's tokens and keep sets (float32, tiny models)."""

from __future__ import annotations

import pytest

import kvviz
from kvviz.fast import StaticInertia


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("refresh", [1, 4, 0])  # InertiaKV, InertiaKV-Lazy, Score-Free
def test_static_path_equals_the_reference_engine(family, refresh, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=refresh),
                          budget=20, max_new_tokens=30)
    static = StaticInertia(model, refresh=refresh).generate(tokenizer, tiny_prompt, 20, 30, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


@pytest.mark.parametrize("family, refresh", [("llama", 0), ("qwen3", 0), ("llama", 4)])
def test_static_path_equals_the_engine_over_a_long_run_with_a_tiny_budget(family, refresh, tiny_prompt):
    """Hundreds of evictions from 5 entries.  Under Score-Free every new token enters at the cache mean, so
    consecutive entries differ by about one float32 ulp: the mean must not depend on the entries' order
    (slots here, positions in the engine), or the two paths evict different tokens after ~150 steps."""
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=refresh),
                          budget=5, max_new_tokens=300)
    static = StaticInertia(model, refresh=refresh).generate(tokenizer, tiny_prompt, 5, 300, record_kept=True)
    assert len(static.token_ids) == 300
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert static.token_ids == reference.token_ids


# 21 slots: padded to 24 (6 blocks), 3 blocks of 7 (no padding), padded to one block of 64 (one product)
@pytest.mark.parametrize("value_block", [4, 7, 64])
@pytest.mark.parametrize("refresh", [1, 4, 0])
def test_blocked_value_product_over_a_padded_cache_equals_the_reference_engine(value_block, refresh, tiny_prompt):
    """What a GPU runs by default (``value_block`` 256 there), on the CPU: zero-weight padding after the 21
    live slots where they are not whole blocks, the value product in blocks summed in float32, and still the
    engine's tokens and keep sets."""
    model, tokenizer = kvviz.load_model("tiny-random-qwen2")
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=refresh),
                          budget=20, max_new_tokens=30)
    path = StaticInertia(model, refresh=refresh, value_block=value_block)
    static = path.generate(tokenizer, tiny_prompt, 20, 30, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert all(len(kept) == 20 for kept in static.kept)  # padding never counts as a kept entry


def test_the_value_block_is_one_product_on_a_cpu_and_refused_below_zero(tiny):
    model, _ = tiny
    assert StaticInertia(model).value_block == 0 and StaticInertia(model, value_block=32).value_block == 32
    with pytest.raises(ValueError, match="value_block must be 0"):
        StaticInertia(model, value_block=-1)


@pytest.mark.parametrize("value_block", [4, 8])  # 6 slots: 2 blocks, 8 of them padded to one block of 8
def test_blocked_and_padded_static_path_equals_the_engine_over_a_long_run_with_a_tiny_budget(value_block,
                                                                                             tiny_prompt):
    """Score-Free's ulp-close near-ties over 300 steps at B = 5, with the cache padded and the value product in
    blocks: the softmax runs over the live slots alone, since a longer (masked) row sums in another order and
    moves probabilities by an ulp."""
    model, tokenizer = kvviz.load_model("tiny-random-llama")
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=0),
                          budget=5, max_new_tokens=300)
    static = StaticInertia(model, refresh=0, value_block=value_block).generate(tokenizer, tiny_prompt, 5, 300,
                                                                               record_kept=True)
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert static.token_ids == reference.token_ids


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: q/k/v carry biases
def test_unfused_static_path_gives_the_fused_paths_tokens_and_keep_sets(family, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    unfused = StaticInertia(model, fuse=False).generate(tokenizer, tiny_prompt, 20, 24, record_kept=True)
    fused = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 24, record_kept=True)
    assert fused.token_ids == unfused.token_ids and fused.kept == unfused.kept


def test_stacked_biases_of_attention_and_mlp_give_the_engines_tokens_and_keep_sets(tiny_prompt):
    """Llama with ``attention_bias`` and ``mlp_bias``: both stacked matrices carry a bias (random here: the
    init leaves them zero, which would hide a bias applied to the wrong rows)."""
    import torch

    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama", attention_bias=True, mlp_bias=True)
    with torch.no_grad():
        for layer in model.model.layers:
            for module in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.mlp.gate_proj, layer.mlp.up_proj):
                module.bias.normal_(std=0.3)
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia"), budget=20, max_new_tokens=16)
    path = StaticInertia(model)
    assert all(fused is not None and fused[1] is not None and fused[3] is not None for fused in path.projections())
    static = path.generate(tokenizer, tiny_prompt, 20, 16, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


def test_weights_replaced_after_the_path_is_built_are_the_ones_it_decodes_with(tiny_prompt):
    """A weight or bias swapped in after construction (``param.data = ...``, as ``.to()`` does) leaves the
    stacked matrix stale: ``generate`` stacks again, decodes with the model as it is now, and the old stacked
    matrices are freed."""
    import gc

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama", attention_bias=True)
    path = StaticInertia(model)
    before = path.generate(tokenizer, tiny_prompt, 20, 16, record_kept=True)
    old = [StorageWeakRef(fused[0].untyped_storage()) for fused in path.projections()]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.data = layer.self_attn.q_proj.weight.data * 3.0
            layer.self_attn.k_proj.bias.data = torch.randn_like(layer.self_attn.k_proj.bias) * 0.3
            layer.mlp.up_proj.weight.data = -layer.mlp.up_proj.weight.data
    assert all(fused is not None for fused in path.projections())
    gc.collect()
    assert all(storage.expired() for storage in old)
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia"), budget=20, max_new_tokens=16)
    after = path.generate(tokenizer, tiny_prompt, 20, 16, record_kept=True)
    assert (after.token_ids, after.kept) != (before.token_ids, before.kept)  # the swap changed the decoding
    assert after.token_ids == reference.token_ids
    assert after.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


@pytest.mark.transformers_api
def test_fusing_leaves_the_hf_forward_as_it_was(tiny_prompt):
    import copy

    import torch

    from kvviz.models import tiny_model

    model, _ = tiny_model("qwen3")
    fresh = copy.deepcopy(model)
    assert all(fused is not None for fused in StaticInertia(model).projections())  # every layer stacked
    ids = torch.tensor([tiny_prompt])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, fresh(ids).logits)


def test_fused_projections_share_the_layers_weights_and_compute_what_the_modules_did():
    """The fused matrices hold the q/k/v (gate/up) weights stacked in that order; the modules' weights become
    row slices of them (one copy in memory, not two); each module computes what it computed before; a second
    call reuses the same matrices."""
    import copy
    import gc

    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    from kvviz.fast import fused_projections
    from kvviz.models import tiny_model

    model, _ = tiny_model("qwen2")
    fresh = copy.deepcopy(model)
    layer, before = model.model.layers[1], fresh.model.layers[1]
    originals = [StorageWeakRef(module.weight.untyped_storage()) for module in (layer.self_attn.q_proj,
                                                                                 layer.mlp.up_proj)]
    qkv_weight, qkv_bias, gate_up_weight, gate_up_bias = fused_projections(layer)
    attn, mlp = layer.self_attn, layer.mlp
    assert torch.equal(qkv_weight, torch.cat([before.self_attn.q_proj.weight, before.self_attn.k_proj.weight,
                                              before.self_attn.v_proj.weight]))
    assert torch.equal(qkv_bias, torch.cat([before.self_attn.q_proj.bias, before.self_attn.k_proj.bias,
                                            before.self_attn.v_proj.bias]))
    assert torch.equal(gate_up_weight, torch.cat([before.mlp.gate_proj.weight, before.mlp.up_proj.weight]))
    assert gate_up_bias is None  # Qwen2's MLP has no bias
    for module in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert module.weight.untyped_storage().data_ptr() == qkv_weight.untyped_storage().data_ptr()
        assert module.bias.untyped_storage().data_ptr() == qkv_bias.untyped_storage().data_ptr()
    for module in (mlp.gate_proj, mlp.up_proj):
        assert module.weight.untyped_storage().data_ptr() == gate_up_weight.untyped_storage().data_ptr()
    gc.collect()
    assert all(original.expired() for original in originals)  # the originals went: nothing is held twice
    x = torch.randn(1, 1, model.config.hidden_size)
    with torch.no_grad():
        for name in ("q_proj", "k_proj", "v_proj"):
            assert torch.equal(getattr(attn, name)(x), getattr(before.self_attn, name)(x))
        assert torch.equal(mlp(x), before.mlp(x))
    again = fused_projections(layer)  # a view over the same rows: no second stacking
    for view, stacked in zip(again, (qkv_weight, qkv_bias, gate_up_weight)):
        assert view.data_ptr() == stacked.data_ptr() and view.stride() == stacked.stride()
        assert torch.equal(view, stacked)


def test_rows_back_to_back_in_one_storage_are_viewed_as_their_stack_and_no_others():
    import torch

    from kvviz.fast import _stacked_view

    base = torch.arange(24.0).reshape(6, 4)
    assert torch.equal(_stacked_view([base[:1], base[1:3], base[3:]]), base)
    assert torch.equal(_stacked_view([base[0, :2], base[0, 2:]]), base[0])  # biases: one dimension
    assert torch.equal(_stacked_view([base[:0], base]), base)  # an empty block adds no rows
    assert _stacked_view([base[:2], base[3:]]) is None  # a gap
    assert _stacked_view([base[1:3], base[:1]]) is None  # out of order
    assert _stacked_view([base[:2], base[2:4].clone()]) is None  # another storage
    assert _stacked_view([base[:2, :2], base[2:4, :2]]) is None  # not contiguous
    # a one-row tensor reads as contiguous whatever its row stride: refused (its stride would misplace the stack)
    assert _stacked_view([base[:1].as_strided((1, 4), (1, 1)), base[1:3]]) is None


def test_a_layer_whose_projections_are_not_plain_linears_is_left_as_it_is(tiny_prompt):
    """A quantised, wrapped or offloaded projection cannot be stacked: the layer keeps its modules, one product
    each, and the static path still gives the engine's tokens and keep sets."""
    import torch

    from kvviz.fast import fused_projections

    class Wrapped(torch.nn.Module):  # stands in for a quantised linear
        def __init__(self, linear):
            super().__init__()
            self.linear = linear

        def forward(self, x):
            return self.linear(x)

    model, tokenizer = kvviz.load_model("tiny-random-llama")
    layer = model.model.layers[0]
    layer.mlp.up_proj = Wrapped(layer.mlp.up_proj)
    weight = layer.self_attn.q_proj.weight
    assert fused_projections(layer) is None
    assert layer.self_attn.q_proj.weight is weight
    hooked = kvviz.load_model("tiny-random-llama")[0].model.layers[0]
    hooked.layer_idx_hook = torch.nn.Identity()
    hooked.layer_idx_hook._hf_hook = object()  # accelerate's offloading hook (on any submodule): it moves weights
    assert fused_projections(hooked) is None

    class Quantised(torch.Tensor):  # quantised and sharded weights are tensor subclasses
        pass

    subclassed = kvviz.load_model("tiny-random-llama")[0].model.layers[0]
    gate = subclassed.mlp.gate_proj
    gate.weight = torch.nn.Parameter(gate.weight.detach().as_subclass(Quantised))
    assert fused_projections(subclassed) is None
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia"), budget=20, max_new_tokens=12)
    static = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 12, record_kept=True)
    assert fused_projections(model.model.layers[0]) is None and fused_projections(model.model.layers[1]) is not None
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


def test_static_path_with_another_alpha_differs_from_the_default(tiny, tiny_prompt):
    model, tokenizer = tiny
    default = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 20, record_kept=True)
    other = StaticInertia(model, alpha=0.0).generate(tokenizer, tiny_prompt, 20, 20, record_kept=True)
    reference = kvviz.run(model, tokenizer, tiny_prompt, "single-step", budget=20, max_new_tokens=20)
    assert other.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert other.kept != default.kept  # the comparison above can tell rules apart


def test_static_path_releases_the_engines_prompt_sized_cache_before_decoding(tiny, tiny_prompt):
    """Step 1 runs through the engine on a cache with room for the whole prompt; once the B + 1 slots hold
    the cache, nothing may keep that one alive (at 64k on an 8B model it is gigabytes)."""
    import gc

    from kvviz.engine import EvictingCache

    def caches() -> int:
        gc.collect()
        return sum(isinstance(o, EvictingCache) for o in gc.get_objects())

    model, tokenizer = tiny
    before, alive = caches(), []  # other tests' traces may hold some: only this run's count
    plain = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 12, record_kept=True)
    released = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 12, record_kept=True,
                                             on_ready=lambda: alive.append(caches()))
    assert alive == [before]
    assert released.token_ids == plain.token_ids and released.kept == plain.kept


@pytest.mark.parametrize("value_block", [0, 8])  # 8: the ring's 21 slots inside a 24-slot padded cache
def test_static_path_without_scoring_is_a_sliding_window(value_block, tiny, tiny_prompt):
    """The baseline's ring of 21 slots goes round twice in 48 static steps, and keeps what ``recency`` keeps."""
    model, tokenizer = tiny
    static = StaticInertia(model, scoring=False, value_block=value_block).generate(tokenizer, tiny_prompt, 20, 50,
                                                                                  record_kept=True)
    reference = kvviz.run(model, tokenizer, tiny_prompt, "recency", budget=20, max_new_tokens=50)
    assert len(static.token_ids) == 50
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


@pytest.mark.parametrize("value_block", [0, 8])  # 8: a GPU's blocked value product over a padded cache
def test_compiled_static_path_equals_the_reference_engine_with_one_graph_per_variant(value_block, tiny_prompt):
    """torch.compile fuses each layer; the keep sets and tokens stay the reference engine's, and one compiled
    graph serves all layers (the parameters are inputs): two graphs for InertiaKV-Lazy, which has a scoring
    and a non-scoring step, not one per layer."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, tokenizer = kvviz.load_model("tiny-random-llama")
    assert model.config.num_hidden_layers >= 2
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=4), budget=20,
                          max_new_tokens=16)
    path = StaticInertia(model, refresh=4, compile=True, value_block=value_block)
    static = path.generate(tokenizer, tiny_prompt, 20, 16, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert counters["stats"]["unique_graphs"] - before == 2
    # A second run takes new views over the stacked weights: the same graphs serve it, no recompiling.
    assert path.generate(tokenizer, tiny_prompt, 20, 16).token_ids == static.token_ids
    assert counters["stats"]["unique_graphs"] - before == 2
    # The first step of each variant (k = 2 without scoring, k = 5 with) is where it compiled.
    assert static.setup_steps == [k in (2, 5) for k in range(2, 16)]
    assert len(static.step_seconds) == 14 and all(s > 0 for s in static.step_seconds)


def test_attention_of_the_static_step_matches_a_plain_softmax():
    """``attend`` against the textbook formula, per query head, with grouped KV heads."""
    import torch

    from kvviz.fast import attend

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(2, 3, 8, generator=generator)  # 2 KV heads x 3 query heads each
    keys, values = torch.randn(2, 5, 8, generator=generator), torch.randn(2, 5, 8, generator=generator)
    out, probs = attend(query, keys, values, scaling=0.5)
    for kv in range(2):
        for group in range(3):
            weights = torch.softmax(0.5 * keys[kv] @ query[kv, group], dim=0)
            torch.testing.assert_close(probs[kv, group], weights)
            torch.testing.assert_close(out[kv, group], weights @ values[kv])


@pytest.mark.parametrize("block", [0, 2, 3, 6])
def test_padding_gets_no_weight_and_blocks_sum_to_the_whole_value_product(block):
    """5 live slots padded to 6 (zero values, as the static cache leaves them; the keys' padding is random
    to show it is masked, not merely small): the textbook softmax over the 5 live slots, whatever the block."""
    import torch

    from kvviz.fast import attend

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 3, 8, generator=generator)
    keys = torch.randn(2, 6, 8, generator=generator)
    values = torch.cat([torch.randn(2, 5, 8, generator=generator), torch.zeros(2, 1, 8)], 1)
    out, probs = attend(query, keys, values, scaling=0.5, slots=5, block=block)
    assert probs.shape == (2, 3, 5)
    for kv in range(2):
        for group in range(3):
            weights = torch.softmax(0.5 * keys[kv, :5] @ query[kv, group], dim=0)
            torch.testing.assert_close(probs[kv, group], weights)
            torch.testing.assert_close(out[kv, group], weights @ values[kv, :5])


@pytest.mark.parametrize("padded, block", [(8, 0), (8, 4), (256, 0), (256, 128)])
def test_padding_changes_no_bit_of_the_probabilities(padded, block):
    """The probabilities feed the EMA and the eviction's arg-min, whose near-ties are an ulp apart: 6 live
    slots padded to 8 or 256 give bit for bit the probabilities of the 6 slots alone (a softmax over the
    padded row with -inf padding moved a third of them by an ulp)."""
    import torch

    from kvviz.fast import attend

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(8, 4, 64, generator=generator)
    keys, values = torch.randn(8, padded, 64, generator=generator), torch.randn(8, padded, 64, generator=generator)
    values[:, 6:] = 0
    _, probs = attend(query, keys, values, 0.125, slots=6, block=block)
    _, alone = attend(query, keys[:, :6].contiguous(), values[:, :6].contiguous(), 0.125)
    assert torch.equal(probs, alone)


def test_the_half_precision_step_of_a_gpu_traces_as_one_graph():
    """The bfloat16 branch (float32 logits straight from bfloat16 keys, ``bmm(..., out_dtype=float32)``) has
    no CPU kernel, so it runs only on a GPU; on meta tensors it still composes with the decoder layer and
    traces without a graph break (Dynamo, AOT) under inference mode, as :meth:`StaticInertia.generate` runs
    it.  Its numbers are the GPU run's to check (``benchmarks/gpu_check.py``)."""
    import torch

    from kvviz.fast import decode_layer, fused_projections
    from kvviz.models import tiny_model

    model, _ = tiny_model("llama", dtype=torch.bfloat16)
    model.to("meta")
    layer, config, slots = model.model.layers[0], model.config, 9
    head_dim = layer.self_attn.head_dim

    def empty(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    cache = (1, config.num_key_value_heads, 12, head_dim)  # 9 live slots padded to 3 blocks of 4
    inputs = (empty(1, 1, config.hidden_size), empty(1, 1, head_dim), empty(1, 1, head_dim),
              torch.zeros(1, dtype=torch.long, device="meta"), empty(*cache), empty(*cache),
              empty(slots, dtype=torch.float32))
    compiled = torch.compile(decode_layer, fullgraph=True, dynamic=False, backend="aot_eager")
    with torch.inference_mode():
        fused = fused_projections(layer)  # under inference mode, as generate() takes it (meta: always stacked)
        for step in (decode_layer, compiled):
            for projections in (None, fused):
                for block in (0, 4):  # one value product over all 12 slots (padding weighs 0), or blocks
                    hidden = step(layer, *inputs, 0.8, True, projections, slots, block)
                    assert hidden.shape == (1, 1, config.hidden_size) and hidden.dtype == torch.bfloat16
                    assert inputs[-1].dtype == torch.float32  # the utilities stay float32


def test_static_path_stops_after_a_stop_token(tiny, tiny_prompt):
    model, tokenizer = tiny
    full = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 16)
    stop = full.token_ids[6]
    first = full.token_ids.index(stop)  # the stop token may already occur earlier
    stopped = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 16, stop_ids={stop})
    assert stopped.token_ids == full.token_ids[: first + 1]
    assert len(stopped.step_seconds) == len(stopped.setup_steps) == max(0, first + 1 - 2)


@pytest.mark.transformers_api
def test_static_path_gives_the_model_back_as_it_was(tiny, tiny_prompt):
    """Its first two steps run through the engine's score capture; afterwards the caller's SDPA model is
    SDPA again, with no kvviz attribute left on its attention modules, and decodes as a fresh copy does."""
    import copy

    import torch

    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama")
    fresh = copy.deepcopy(model)
    static = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 6)
    assert static.token_ids == StaticInertia(tiny[0]).generate(tokenizer, tiny_prompt, 20, 6).token_ids  # same weights
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(module, "kvviz_rope") for module in model.modules())
    ids = torch.tensor([tiny_prompt])
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False),
                       fresh.generate(ids, max_new_tokens=6, do_sample=False))


def test_static_path_refuses_what_it_cannot_compute_exactly(tiny, tiny_prompt):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="prompt length"):
        StaticInertia(model).generate(tokenizer, tiny_prompt, len(tiny_prompt) + 2, 8)
    with pytest.raises(ValueError, match=r"attention scorer.*; got InertiaKV \(alpha=0.8, refresh=1, aggregation=sum,"):
        StaticInertia.from_policy(model, kvviz.make_policy("inertia", aggregation="sum"))
    with pytest.raises(ValueError, match="; got TOVA: use the engine for this policy$"):  # no empty "{}"
        StaticInertia.from_policy(model, kvviz.make_policy("tova"))
    with pytest.raises(ValueError, match="attention scorer"):  # a subclass with another update rule
        StaticInertia.from_policy(model, kvviz.make_policy("inertia-decoupled"))
    assert StaticInertia.from_policy(model, kvviz.make_policy("score-free")).refresh == 0
