"""The engine against independent references: plain generate, a masked full cache, eager attention."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache

import kvviz
from kvviz import engine
from kvviz.cache import SlotCache
from kvviz.engine import resolve_budget
from kvviz.policies import REGISTRY
from kvviz.policies.checkpointed import CheckpointPolicy
from kvviz.trace import budget_note


def generate_ids(model, prompt_ids, new_tokens):
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", kvviz.models.SUPPORTED_TYPES)
def test_full_policy_equals_generate(family, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    result = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=24)
    assert result.token_ids == generate_ids(model, tiny_prompt, 24)
    assert len(result.token_ids) == 24


@pytest.mark.transformers_api
def test_stops_after_eos_like_generate(tiny_prompt):
    model, tokenizer = kvviz.load_model("tiny-random-llama")
    free_run = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=12).token_ids
    model.generation_config.eos_token_id = [free_run[4]]  # make the fifth greedy token an EOS
    result = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=200, max_new_tokens=12)
    assert result.token_ids == free_run[: free_run.index(free_run[4]) + 1]
    assert result.token_ids == generate_ids(model, tiny_prompt, 12)


@pytest.mark.transformers_api
def test_budget_above_everything_equals_generate(tiny, tiny_prompt):
    model, tokenizer = tiny
    budget = len(tiny_prompt) + 24
    result = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=budget, max_new_tokens=24)
    assert result.token_ids == generate_ids(model, tiny_prompt, 24)
    assert all(e.evicted.size == 0 for e in result.trace.events)


def masked_reference(model, prompt_ids, trace):
    """Replay with HF's own DynamicCache holding every token, hiding the positions the engine evicted through
    an ordinary 2D attention mask.  Physical eviction must give the same tokens."""
    prompt_len = len(prompt_ids)
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt_ids]), **{kvviz.engine.cache_kwarg(model): cache}).logits
        tokens = [int(logits[0, -1].argmax())]
        for event in trace.decode_steps:
            position = prompt_len + event.step - 1
            mask = torch.zeros(1, position + 1, dtype=torch.long)
            mask[0, trace.events[event.step - 1].kept] = 1  # what the previous step kept ...
            mask[0, position] = 1  # ... plus the token being fed
            logits = model(input_ids=torch.tensor([[tokens[-1]]]), attention_mask=mask,
                           position_ids=torch.tensor([[position]]), **{kvviz.engine.cache_kwarg(model): cache}).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.mark.parametrize("policy", ["inertia", "inertia-lazy", "cumulative"])
def test_physical_eviction_equals_masked_full_cache(tiny, tiny_prompt, policy):
    model, tokenizer = tiny
    result = kvviz.run(model, tokenizer, tiny_prompt, policy, compression=0.75, max_new_tokens=40)
    assert result.trace.budget == len(tiny_prompt) // 4
    assert result.token_ids == masked_reference(model, tiny_prompt, result.trace)
    # The comparison means something only if eviction changed the output.
    assert result.token_ids != generate_ids(model, tiny_prompt, 40)


@pytest.mark.transformers_api
def test_attach_warns_when_generate_was_not_given_its_cache(tiny, tiny_prompt):
    """model.generate without the cache makes one of its own and runs unevicted; attach said nothing, and an
    empty cache.events read as a run that evicted nothing.  It warns, naming the argument; with it, no warning."""
    import warnings

    model, _ = tiny
    with pytest.warns(UserWarning, match=f"the cache saw no forward pass, so nothing was evicted; pass it to "
                                         f"model.generate as {kvviz.engine.cache_kwarg(model)}=cache"):
        with kvviz.attach(model, "inertia", compression=0.5) as cache:
            model.generate(torch.tensor([tiny_prompt]), max_new_tokens=2, do_sample=False)
    assert cache.events == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        with kvviz.attach(model, "inertia", compression=0.5) as cache:
            model.generate(torch.tensor([tiny_prompt]), **{kvviz.engine.cache_kwarg(model): cache}, max_new_tokens=2,
                           do_sample=False)
    assert len(cache.events) == 2


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", [f for f in kvviz.models.SUPPORTED_TYPES if f != "llama"])
def test_physical_eviction_equals_masked_full_cache_on_every_family(family, tiny_prompt):
    """Mixtures of experts, fused QKV (Phi-3), norms after attention (OLMo-2), Granite's multipliers, Gemma's
    scaled embeddings: the engine's eviction must still equal hiding the same entries from a full cache."""
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    result = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.75, max_new_tokens=24)
    assert result.token_ids == masked_reference(model, tiny_prompt, result.trace)
    assert result.token_ids != generate_ids(model, tiny_prompt, 24)


PREFILL_ONLY = ("snapkv", "expected-attention", "kvzip")  # evict once, right after the prefill
CHECKPOINTED = tuple(name for name, spec in REGISTRY.items() if issubclass(spec.cls, CheckpointPolicy))
COMPRESSES_PREFILL = (*PREFILL_ONLY, "expected-attention-decode")  # evict at the prefill (and maybe later)


@pytest.mark.parametrize("name", sorted(REGISTRY))
def test_every_policy_respects_its_bound_and_reports_consistent_sets(tiny, tiny_prompt, name):
    check_policy_run(*tiny, tiny_prompt, name, max_new_tokens=40)


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", [f for f in kvviz.models.SUPPORTED_TYPES if f != "llama"])
def test_every_policy_runs_within_its_bound_on_every_family(family, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    for name in sorted(REGISTRY):
        check_policy_run(model, tokenizer, tiny_prompt, name, max_new_tokens=18)


def check_policy_run(model, tokenizer, tiny_prompt, name, max_new_tokens):
    """Run ``name`` at B = 40 and check every event's sets and cache size against the policy's rule."""
    budget = 40  # above SnapKV's window (32) and AvoKV-E's protected tail + sinks (32 + 4)
    policy = kvviz.make_policy(name, **({"interval": 16} if name in CHECKPOINTED else {}))
    result = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=max_new_tokens)
    events = result.trace.events
    assert len(events) == max_new_tokens
    prompt_len = len(tiny_prompt)
    prefill = events[0]
    if name not in COMPRESSES_PREFILL:  # decode-time: never evicts at prefill (AvoKV-E only records queries there)
        assert prefill.kept.tolist() == list(range(prompt_len))
    assert set(prefill.kept.tolist()) | set(prefill.evicted.tolist()) == set(range(prompt_len))
    for previous, event in zip(events, events[1:]):
        new = prompt_len + event.step - 1
        before = set(previous.kept.tolist()) | {new}
        assert set(event.evicted.tolist()) <= before
        assert set(event.kept.tolist()) == before - set(event.evicted.tolist())
        assert np.all(np.diff(event.kept) > 0)
    assert prompt_len > budget
    for event in events:
        # Cache sizes written out by rule, not read from the policy's own cache_bound().
        if name == "full":
            assert event.cache_size == prompt_len + max(event.step, 0)
        elif name in PREFILL_ONLY:  # cut to B at prefill, then every generated token stays
            assert event.cache_size == budget + max(event.step, 0)
        elif name in CHECKPOINTED:  # cut to B at checkpoints (every 16th token), growing in between
            if event.step >= 16:
                assert event.cache_size == budget + event.step % 16
        elif event.step >= 1:  # per-step policies: exactly B after every decode step
            assert event.cache_size == budget
        bound = policy.cache_bound(budget, event.step)
        if bound is not None and (event.step >= 1 or name in COMPRESSES_PREFILL):
            assert event.cache_size <= bound
        if event.utility is not None:
            assert event.utility.shape == event.kept.shape
        if event.raw is not None:
            assert event.raw.shape == event.present.shape


def test_cache_memory_is_physically_reduced(tiny, tiny_prompt):
    model, tokenizer = tiny
    config = model.config
    per_slot = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4  # float32 K and V
    result = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=16, max_new_tokens=8)
    prefill, steps = result.trace.events[0], result.trace.decode_steps
    assert prefill.cache_bytes == (len(tiny_prompt) + 1) * per_slot
    assert all(e.cache_bytes == 17 * per_slot for e in steps)  # B slots + one for the incoming token


@pytest.mark.transformers_api
@pytest.mark.parametrize("policy", ["inertia", "inertia-lazy", "score-free"])
def test_generate_integration_matches_engine(tiny, tiny_prompt, policy):
    model, tokenizer = tiny
    result = kvviz.run(model, tokenizer, tiny_prompt, policy, compression=0.5, max_new_tokens=20)
    with kvviz.attach(model, policy, compression=0.5) as cache:
        out = model.generate(torch.tensor([tiny_prompt]), **{kvviz.engine.cache_kwarg(model): cache}, max_new_tokens=20,
                             do_sample=False)
    assert out[0, len(tiny_prompt):].tolist() == result.token_ids
    assert [e.kept.tolist() for e in cache.events] == [e.kept.tolist() for e in result.trace.events]


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", [f for f in kvviz.models.SUPPORTED_TYPES if f != "llama"])
def test_generate_integration_matches_engine_on_other_families(family, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    result = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=12)
    with kvviz.attach(model, "inertia", compression=0.5) as cache:
        out = model.generate(torch.tensor([tiny_prompt]), **{kvviz.engine.cache_kwarg(model): cache},
                             max_new_tokens=12, do_sample=False)
    assert out[0, len(tiny_prompt):].tolist() == result.token_ids
    assert [e.kept.tolist() for e in cache.events] == [e.kept.tolist() for e in result.trace.events]


@pytest.mark.transformers_api
@pytest.mark.parametrize("name, params", [("avokv", dict(interval=2, delay=8, sinks=1)), ("snapkv", dict(window=1)),
                                          ("rkv", dict(interval=2, window=8, prompt_queries=True))])
def test_a_one_token_prompt_is_still_a_prefill_for_policies_that_read_prompt_queries(tiny, name, params):
    """A one-token prompt reaches the attention wrapper as a single query, like a decode step: the policies
    that read the prompt's queries must still see it as the prefill (AvoKV-E crashed there), and the engine,
    the shared prefill and model.generate must agree on tokens and keep sets."""
    from kvviz.engine import decode_many

    model, tokenizer = tiny
    prompt = [42]
    policy = kvviz.make_policy(name, **params)
    events = kvviz.stream(model, tokenizer, prompt, policy, budget=10, max_new_tokens=24)
    next(events)  # the prefill
    if name != "snapkv":  # the prompt's one query, at position 0, starts every layer's window
        assert [[position for position, _ in buffer] for buffer in policy.queries.values()] == \
            [[0]] * model.config.num_hidden_layers
    reference = kvviz.run(model, tokenizer, prompt, kvviz.make_policy(name, **params), budget=10,
                          max_new_tokens=24).trace
    if name != "snapkv":  # SnapKV compresses the prompt only, which fits here
        assert any(event.evicted.size for event in reference.events)  # the keep rule ran
    shared = [event for who, event in decode_many(model, tokenizer, prompt, {name: kvviz.make_policy(name, **params),
                                                                            "full": kvviz.make_policy("full")},
                                                   budget=10, max_new_tokens=24) if who == name]
    assert [e.kept.tolist() for e in shared] == [e.kept.tolist() for e in reference.events]
    with kvviz.attach(model, kvviz.make_policy(name, **params), budget=10) as cache:
        out = model.generate(torch.tensor([prompt]), **{kvviz.engine.cache_kwarg(model): cache}, max_new_tokens=24,
                             do_sample=False)
    assert out[0, 1:].tolist() == reference.token_ids
    assert [e.kept.tolist() for e in cache.events] == [e.kept.tolist() for e in reference.events]


def test_checkpoint_terms_explain_each_eviction_and_survive_generate_and_parquet(tiny, tiny_prompt, tmp_path):
    """AvoKV-E's recorded terms at each checkpoint: S from the percentile ranks by its own formula, the
    protected tail unjudged, the kept candidates exactly the top of S (their utility S), and the same terms
    from model.generate through an evicting cache and after a parquet round trip."""
    from kvviz.diagnostics import ranks

    model, tokenizer = tiny
    policy = dict(interval=8, delay=16, sinks=2)
    result = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("avokv", **policy), budget=40,
                       max_new_tokens=20)
    decided = [e for e in result.trace.events if e.components is not None]
    assert [e.step for e in decided] == [e.step for e in result.trace.events if e.evicted.size]
    assert len(decided) >= 2
    for event in decided:
        terms, present = event.components, event.present
        judged = ~np.isnan(terms["S"])
        assert judged.sum() == present.size - 16 and not judged[-16:].any()  # the newest 16: the tail
        for name in ("p", "r", "b"):  # (rank - 1) / (n - 1), from our own tie-averaging ranks
            values = terms[name][judged].astype(np.float64)
            assert terms[f"N({name})"][judged] == pytest.approx((ranks(values) - 1) / (values.size - 1), abs=1e-6)
        finite = judged & np.isfinite(terms["S"])
        assert np.isinf(terms["S"][judged]).sum() == 2  # the sinks
        expected = 0.1 * terms["N(p)"] - 0.9 * terms["N(r)"] + 0.05 * terms["N(b)"]
        assert terms["S"][finite] == pytest.approx(expected[finite], abs=1e-6)
        kept = np.isin(present, event.kept)
        assert terms["S"][judged & ~kept].max() <= terms["S"][judged & kept].min()
        kept_judged = np.isin(event.kept, present[judged])
        assert event.utility[kept_judged] == pytest.approx(terms["S"][judged & kept])
    with kvviz.attach(model, kvviz.make_policy("avokv", **policy), budget=40) as cache:
        model.generate(torch.tensor([tiny_prompt]), **{kvviz.engine.cache_kwarg(model): cache}, max_new_tokens=20,
                       do_sample=False)
    for ours, theirs in zip(result.trace.events, cache.events):
        assert (ours.components is None) == (theirs.components is None)
        if ours.components:
            assert all(np.array_equal(ours.components[k], theirs.components[k], equal_nan=True)
                       for k in ours.components)
    result.trace.save(tmp_path / "avokv.parquet")
    loaded = kvviz.Trace.load(tmp_path / "avokv.parquet")
    for ours, theirs in zip(result.trace.events, loaded.events):
        assert (ours.components is None) == (theirs.components is None)
        if ours.components:
            assert all(np.array_equal(ours.components[k], theirs.components[k], equal_nan=True)
                       for k in ours.components)


class Recorder:
    prefill_window = 0

    def __init__(self):
        self.attn = {}

    def wants_layer(self, layer):
        return True

    def on_layer(self, view):
        self.attn[view.layer] = view.attn.clone()


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", kvviz.models.SUPPORTED_TYPES)
def test_captured_scores_equal_eager_attention(family, tiny_prompt):
    """The SDPA-side capture (grouped queries, no repeat_kv) equals eager attention's own weights, with each
    family's own softmax scale (Granite's attention multiplier is 0.5 in its tiny model, not 1/sqrt(16))."""
    model, _ = kvviz.load_model(f"tiny-random-{family}")
    cache = SlotCache(model.config.num_hidden_layers)
    recorder = Recorder()
    ids = tiny_prompt + [17]
    with torch.inference_mode():
        model(input_ids=torch.tensor([tiny_prompt]), **{kvviz.engine.cache_kwarg(model): cache})
        with kvviz.scoring.scoring(recorder):
            model(input_ids=torch.tensor([[17]]), position_ids=torch.tensor([[len(tiny_prompt)]]),
                  **{kvviz.engine.cache_kwarg(model): cache})
        eager = copy.deepcopy(model)
        eager.set_attn_implementation("eager")
        attentions = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    assert sorted(recorder.attn) == list(range(model.config.num_hidden_layers))
    for layer, weights in enumerate(attentions):
        torch.testing.assert_close(recorder.attn[layer], weights[0, :, -1, :].float(), rtol=1e-4, atol=1e-6)


def capture_state(model):
    """The attention implementation and which attention modules carry a ``kvviz_rope`` attribute."""
    return model.config._attn_implementation, [hasattr(m, "kvviz_rope") for m in model.modules()]


@pytest.mark.transformers_api
def test_installed_gives_someone_elses_model_back_as_it_was(tiny_prompt):
    from kvviz.models import tiny_model

    model, _ = tiny_model("llama")
    fresh = copy.deepcopy(model)
    assert capture_state(model) == ("sdpa", [False] * len(list(model.modules())))
    with kvviz.scoring.installed(model):
        implementation, ropes = capture_state(model)
        assert implementation == "kvviz_sdpa" and sum(ropes) == model.config.num_hidden_layers
    assert capture_state(model) == capture_state(fresh)
    assert generate_ids(model, tiny_prompt, 8) == generate_ids(fresh, tiny_prompt, 8)
    # Blocks that overlap (threads, interleaved generators) restore once the last of them closes.
    first, second = kvviz.scoring.installed(model), kvviz.scoring.installed(model)
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert model.config._attn_implementation == "kvviz_sdpa"  # the second block still runs with the capture
    second.__exit__(None, None, None)
    assert capture_state(model) == capture_state(fresh)


@pytest.mark.transformers_api
def test_installed_leaves_a_model_installed_by_load_model_installed():
    model, _ = kvviz.load_model("tiny-random-llama")
    before = capture_state(model)
    with kvviz.scoring.installed(model):
        pass
    assert capture_state(model) == before and before[0] == "kvviz_sdpa"


@pytest.mark.transformers_api
def test_install_refuses_another_attention_before_changing_anything():
    from kvviz.models import tiny_model

    model, _ = tiny_model("llama")
    model.set_attn_implementation("eager")
    before = capture_state(model)
    for attempt in (kvviz.scoring.install, lambda m: kvviz.scoring.installed(m).__enter__()):
        with pytest.raises(ValueError, match="attn_implementation='eager'"):
            attempt(model)
        assert capture_state(model) == before


def attach_and_generate(model, tokenizer, prompt_ids):
    with kvviz.attach(model, "inertia", budget=20) as cache:
        model.generate(torch.tensor([prompt_ids]), **{kvviz.engine.cache_kwarg(model): cache}, max_new_tokens=4,
                       do_sample=False)


def run_snapkv_and_inertia(model, tokenizer, prompt_ids):
    kvviz.run(model, tokenizer, prompt_ids, "inertia", budget=20, max_new_tokens=4)
    list(kvviz.engine.decode_many(model, tokenizer, prompt_ids, {"snapkv": kvviz.make_policy("snapkv", window=8),
                                                                "inertia": kvviz.make_policy("inertia")},
                                  budget=20, max_new_tokens=4))


@pytest.mark.transformers_api
@pytest.mark.parametrize("use", [attach_and_generate, run_snapkv_and_inertia])
def test_the_engine_gives_the_model_back_as_it_was(use, tiny_prompt):
    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama")
    fresh = copy.deepcopy(model)
    use(model, tokenizer, tiny_prompt)
    assert capture_state(model) == capture_state(fresh)
    assert generate_ids(model, tiny_prompt, 8) == generate_ids(fresh, tiny_prompt, 8)


def test_slot_cache_compaction_moves_survivors_into_holes():
    cache = SlotCache(num_layers=2, capacity=8)
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)  # key value == position, easy to follow
    for layer in range(2):
        cache.update(keys, keys + 100, layer)
    cache.evict(torch.tensor([1, 4]))  # drop positions 1 and 4: slot 1 is refilled from slot 5
    assert cache.live_positions().tolist() == [0, 5, 2, 3]
    for layer in cache.layers:
        assert layer.keys[0, 0, :4, 0].tolist() == [0, 5, 2, 3]
        assert layer.values[0, 0, :4, 0].tolist() == [100, 105, 102, 103]
    new = torch.tensor([[[[6.0]]]])
    for layer in range(2):
        k, v = cache.update(new, new + 100, layer)
    assert cache.live_positions().tolist() == [0, 5, 2, 3, 6] and k[0, 0, :, 0].tolist() == [0, 5, 2, 3, 6]
    assert cache.get_seq_length() == 5


def test_slot_cache_copy_continues_the_sources_positions():
    """A copy of a cache that has evicted entries gives the next token the position the source would: one
    past every token ever written (6), not past the live count (4), which would repeat position 4."""
    source = SlotCache(num_layers=2, capacity=8)
    keys = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1)
    for layer in range(2):
        source.update(keys, keys + 100, layer)
    source.evict(torch.tensor([1, 4]))
    copy_ = SlotCache(num_layers=2, capacity=8)
    copy_.copy_from(source)
    assert copy_.live_positions().tolist() == [0, 5, 2, 3]
    new = torch.tensor([[[[6.0]]]])
    for cache in (source, copy_):
        for layer in range(2):
            cache.update(new, new + 100, layer)
    assert copy_.live_positions().tolist() == source.live_positions().tolist() == [0, 5, 2, 3, 6]
    assert copy_.seen == source.seen == 7


@pytest.mark.parametrize(
    "prompt_len, kwargs, expected",
    [(100, dict(compression=0.9), 10), (1000, dict(compression=0.9), 100), (57, dict(compression=0.5), 28),
     (10, dict(budget=3), 3), (10, {}, 10), (30, dict(compression=0.0), 30)],
)
def test_resolve_budget(prompt_len, kwargs, expected):
    assert resolve_budget(prompt_len, **kwargs) == expected


@pytest.mark.parametrize("kwargs", [dict(compression=1.0), dict(compression=-0.1), dict(budget=0),
                                    dict(compression=0.99), dict(budget=12.5)])
def test_resolve_budget_rejects(kwargs):
    with pytest.raises(ValueError):
        resolve_budget(50, **kwargs)
    assert resolve_budget(50, budget=12.0) == 12  # a whole number written as a float is that number


def test_a_compression_refusal_names_a_compression_that_works(tiny):
    """floor((1 - 0.9) * 6) = 0: the largest compression to two places that leaves an entry of 6 is 0.83
    (0.17 * 6 = 1.02; 0.16 * 6 = 0.96).  A policy that protects 8 entries, at a compression that leaves it
    10 of 100 but 8, is told to lower the compression to 0.91 (floor(0.09 * 100) = 9), not to raise a budget
    nobody gave; given as a budget, it is told of the budget."""
    from kvviz.engine import largest_compression

    with pytest.raises(ValueError, match=r"^compression 0.9 leaves no cache for a 6-token prompt; lower it to 0.83 "
                                         r"or less, or use a longer prompt$"):
        resolve_budget(6, compression=0.9)
    assert resolve_budget(6, compression=0.83) == 1
    with pytest.raises(ValueError, match="only compression 0 leaves any of it"):
        resolve_budget(1, compression=0.5)
    assert largest_compression(100, 9) == 0.91 and largest_compression(5, 9) is None
    model, tokenizer = tiny
    prompt = list(range(3, 103))
    with pytest.raises(ValueError, match=r"^compression 0.92 leaves a budget of 8 of this 100-token prompt, not more "
                                         r"than the 8 sink tokens StreamingLLM always keeps: lower the compression to "
                                         r"0.91 or less \(or lower sinks\)$"):
        kvviz.engine.run(model, tokenizer, prompt, "streaming", compression=0.92, sinks=8, max_new_tokens=2)
    assert len(kvviz.engine.run(model, tokenizer, prompt, "streaming", compression=0.91, sinks=8,
                                max_new_tokens=2).trace.events) == 2
    with pytest.raises(ValueError, match=r"^budget 8 must exceed the 8 sink tokens"):
        kvviz.engine.run(model, tokenizer, prompt, "streaming", budget=8, sinks=8, max_new_tokens=2)


def test_a_trace_of_a_policy_object_is_named_by_its_registry_entry(tiny, tiny_prompt):
    """run() with a policy object named the trace after its class ('FullCache', 'TOVA'); what looks a trace up
    by name then missed it: the full cache's trace read as 'budget B = 40', TOVA's read lags were refused."""
    from kvviz import diagnostics
    from kvviz.policies import Policy, make_policy

    model, tokenizer = tiny
    run = lambda policy: kvviz.run(model, tokenizer, tiny_prompt, policy, budget=40, max_new_tokens=3).trace
    assert run(make_policy("tova")).policy == "tova" and diagnostics.scores_attention("tova", {})
    assert budget_note(run(make_policy("full"))) == "no eviction (full cache)"
    # parameters that make another entry name that entry, as the Compare tab would; they are all recorded
    summed = run(make_policy("inertia", aggregation="sum"))
    assert summed.policy == "cumulative" and summed.params["aggregation"] == "sum"
    assert REGISTRY[summed.policy].build(**summed.params).params() == make_policy("cumulative").params()

    class Oldest(Policy):  # a policy of one's own, not registered: its class names it
        def select_evictions(self, step, positions, budget):
            return torch.argsort(positions)[:max(0, positions.numel() - budget)]

    assert run(Oldest()).policy == "Oldest"


def test_decode_refuses_a_cache_made_for_another_budget_or_policy(tiny, tiny_prompt):
    """A cache passed to decode runs at its own budget: one naming another was silently overridden."""
    from kvviz.engine import EvictingCache, decode
    from kvviz.policies import make_policy

    model, tokenizer = tiny
    policy = make_policy("tova")
    cache = EvictingCache(model, policy, budget=40, capacity=len(tiny_prompt) + 4)
    with pytest.raises(ValueError, match="made for TOVA at {'budget': 40, 'compression': None}, this call names "
                                         "TOVA at budget=20"):
        next(decode(model, tokenizer, tiny_prompt, policy, budget=20, max_new_tokens=3, cache=cache))
    with pytest.raises(ValueError, match="this call names StreamingLLM"):
        next(decode(model, tokenizer, tiny_prompt, make_policy("streaming"), budget=40, max_new_tokens=3,
                    cache=cache))
    assert len(list(decode(model, tokenizer, tiny_prompt, policy, budget=40, max_new_tokens=3, cache=cache))) == 3


def test_sampler_draws_from_the_tempered_nucleus():
    """p = (.5, .3, .2): top_p = .6 keeps the smallest prefix reaching .6, {0, 1}, renormalised to
    (.625, .375); temperature 2 gives p**(1/2) normalised = (.4155, .3218, .2628).  4000 seeded draws,
    tolerance about four standard errors."""
    from kvviz.engine import Sampler

    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))

    def frequencies(sampler):
        draws = [sampler(logits) for _ in range(4000)]
        return np.bincount(draws, minlength=3) / len(draws)

    np.testing.assert_allclose(frequencies(Sampler(1.0, 0.6, seed=0)), [0.625, 0.375, 0.0], atol=0.03)
    np.testing.assert_allclose(frequencies(Sampler(2.0, 1.0, seed=0)), [0.4155, 0.3218, 0.2628], atol=0.03)
    with pytest.raises(ValueError, match="temperature"):
        Sampler(float("nan"))
    # logits / T overflow float32 at such temperatures (inf - inf = NaN in the softmax): the limit is greedy
    peaked = torch.tensor([3.0, 7.5, -2.0, 7.0])
    assert all(Sampler(t, 1.0, seed=0)(peaked) == 1 for t in (1e-38, 1e-45, 5e-324))


def test_sampling_is_seeded_and_top_p_near_zero_is_greedy(tiny, tiny_prompt):
    model, tokenizer = tiny
    sample = lambda seed, top_p=1.0: kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=16,
                                                temperature=1.0, top_p=top_p, seed=seed).token_ids
    assert sample(1) == sample(1)
    assert sample(1) != sample(2)
    assert sample(3, top_p=1e-6) == kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=16).token_ids


def test_a_sampled_runs_trace_records_how_it_decoded(tiny, tiny_prompt, tmp_path):
    """kvviz.run's trace says how to decode it again: the sampled one carries (temperature, top_p, seed) and
    replaying those arguments gives its tokens; a greedy one carries nothing."""
    model, tokenizer = tiny
    sampled = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=12,
                        temperature=0.7, top_p=0.9, seed=5).trace
    assert sampled.sampling == {"temperature": 0.7, "top_p": 0.9, "seed": 5}
    sampled.save(tmp_path / "t.parquet")
    again = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=12,
                      **kvviz.Trace.load(tmp_path / "t.parquet").sampling).trace
    assert again.token_ids == sampled.token_ids
    assert kvviz.run(model, tokenizer, tiny_prompt, "inertia", max_new_tokens=4).trace.sampling == {}


def test_trace_round_trips_through_parquet(tiny, tiny_prompt, tmp_path):
    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=8).trace
    trace.save(tmp_path / "t.parquet")
    loaded = kvviz.Trace.load(tmp_path / "t.parquet")
    assert trace.model == "tiny-random-llama"  # the name to load it by again
    assert loaded.meta() == trace.meta()
    assert loaded.token_ids == trace.token_ids
    for a, b in zip(loaded.events, trace.events):
        assert a.kept.tolist() == b.kept.tolist() and a.evicted.tolist() == b.evicted.tolist()
        assert np.allclose(a.utility, b.utility) and a.text == b.text and a.step == b.step
    assert loaded.max_new_tokens == 8 and loaded.stopped is False
    assert loaded.compression == 0.5 and budget_note(loaded) == f"budget B = {loaded.budget} (compression ρ = 0.5)"
    # a budget given in tokens records no ρ
    by_tokens = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=loaded.budget, max_new_tokens=2).trace
    assert by_tokens.compression is None and budget_note(by_tokens) == f"budget B = {loaded.budget}"


def test_a_trace_saved_before_max_new_tokens_and_stopped_were_recorded_still_loads(tiny, tiny_prompt, tmp_path):
    import json

    import pyarrow.parquet as pq

    model, tokenizer = tiny
    text = tokenizer.decode(tiny_prompt)
    kvviz.run(model, tokenizer, text, "inertia", compression=0.5, max_new_tokens=4, chat=False).trace.save(
        tmp_path / "t.parquet")
    table = pq.read_table(tmp_path / "t.parquet")
    meta = json.loads(table.schema.metadata[b"kvviz"])
    assert (meta["prompt"], meta["chat"]) == (text, False)  # the text it ran from, and how it was read
    del meta["max_new_tokens"], meta["stopped"], meta["compression"], meta["prompt"], meta["chat"]
    pq.write_table(table.replace_schema_metadata({b"kvviz": json.dumps(meta)}), tmp_path / "old.parquet")
    old = kvviz.Trace.load(tmp_path / "old.parquet")
    assert (old.max_new_tokens, old.stopped, old.compression, len(old.events)) == (0, False, None, 4)
    assert (old.prompt, old.chat) == ("", None)
    for key, value, message in (("stopped", "yes", "its stopped is 'yes', not true or false"),
                                ("compression", 1.5, "its compression is 1.5, not absent .* or a ratio in"),
                                ("prompt", 7, "its prompt is 7, not a string"),
                                ("chat", "yes", "its chat is 'yes', not absent, true or false")):
        pq.write_table(table.replace_schema_metadata({b"kvviz": json.dumps({**meta, key: value})}),
                       tmp_path / "bad.parquet")
        with pytest.raises(ValueError, match=message):
            kvviz.Trace.load(tmp_path / "bad.parquet")


@pytest.mark.parametrize("name", list(REGISTRY))
def test_every_policys_trace_loads_back_as_one_consistent_run(tiny, tiny_prompt, tmp_path, name):
    """Saved and loaded, a trace passes Trace.check: steps 0, 1, 2, ..., positions that exist at each step,
    one utility per kept entry (budget below the prompt, and above it: eviction once generation fills it)."""
    model, tokenizer = tiny
    # checkpoints every 4 tokens and a short SnapKV window, so that 10 steps evict under every policy
    params = {**{checkpointed: {"interval": 4} for checkpointed in CHECKPOINTED}, "snapkv": {"window": 8}}.get(name, {})
    for budget in (40, len(tiny_prompt) + 4):
        policy = kvviz.make_policy(name, **params)
        trace = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=10).trace
        prefill_only = name in PREFILL_ONLY and budget > len(tiny_prompt)  # they compress the prompt only
        assert (name == "full" or prefill_only) == (sum(e.evicted.size for e in trace.events) == 0)
        trace.save(tmp_path / "t.parquet")
        assert [e.kept.tolist() for e in kvviz.Trace.load(tmp_path / "t.parquet").events] == \
            [e.kept.tolist() for e in trace.events]


def test_a_file_that_is_not_a_consistent_trace_is_refused_with_the_reason(tiny, tiny_prompt, tmp_path):
    import pandas as pd

    model, tokenizer = tiny
    (tmp_path / "notes.parquet").write_text("not parquet")
    with pytest.raises(ValueError, match="notes.parquet is not a readable parquet file"):
        kvviz.Trace.load(tmp_path / "notes.parquet")
    pd.DataFrame({"a": [1]}).to_parquet(tmp_path / "table.parquet")
    with pytest.raises(ValueError, match="not a kvviz trace .no kvviz metadata"):
        kvviz.Trace.load(tmp_path / "table.parquet")
    import zipfile

    with zipfile.ZipFile(tmp_path / "comparison.zip", "w") as bundle:  # the Compare tab's download, not unzipped
        bundle.write(tmp_path / "table.parquet", "inertia.parquet")
    with pytest.raises(ValueError, match=r"comparison.zip is a zip \(a comparison's download\?\), not a trace; unzip "
                                         "it and open one of its .parquet files"):
        kvviz.Trace.load(tmp_path / "comparison.zip")
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=12, max_new_tokens=6).trace
    prompt_len = trace.prompt_len
    broken = [
        (lambda t: t.events.pop(2), "row 2 is step 3"),
        (lambda t: setattr(t.events[3], "kept", np.append(t.events[3].kept, prompt_len + 3)),
         f"step 3 has kept positions outside 0..{prompt_len + 2}"),
        (lambda t: setattr(t.events[1], "evicted", np.array([-1])), "step 1 has evicted positions outside"),
        (lambda t: setattr(t.events[4], "utility", t.events[4].utility[:-1]), "step 4 has 11 utilities for 12 kept"),
        (lambda t: setattr(t.events[2], "raw", t.events[2].raw[:-1]), "step 2 has 12 raw scores for 13 entries"),
        (lambda t: setattr(t.events[2], "components", {"S": np.zeros(3, np.float32)}),
         "step 2 has 3 values of 'S' for 13 entries"),
        (lambda t: setattr(t.events[2], "evicted", t.events[2].kept[:1]), "step 2 has positions both kept and evicted"),
        (lambda t: setattr(t.events[2], "kept", np.sort(np.append(t.events[2].kept, t.events[2].kept[0]))),
         "step 2 lists a kept position twice"),
        (lambda t: setattr(t, "budget", "24"), "its budget is '24', not a whole number >= 1"),
        (lambda t: setattr(t, "budget", None), "its budget is None, not a whole number >= 1"),
        (lambda t: setattr(t, "params", [1]), "its params is \\[1\\], not an object"),
        (lambda t: setattr(t, "prompt_ids", 5), "its prompt_ids is 5, not a list of token ids"),
    ]
    for damage, message in broken:
        damaged = kvviz.Trace.load(_saved(trace, tmp_path / "ok.parquet"))
        damage(damaged)
        damaged.save(tmp_path / "bad.parquet")
        with pytest.raises(ValueError, match=message):
            kvviz.Trace.load(tmp_path / "bad.parquet")
    # read by the views' statistics, which failed on them with a TypeError (a file written by other means)
    for field, value in [("t_forward", "0.1"), ("t_evict", -1.0), ("t_score", float("nan")), ("cache_bytes", 1.5),
                         ("scored", "yes")]:
        damaged = kvviz.Trace.load(tmp_path / "ok.parquet")
        setattr(damaged.events[2], field, value)
        with pytest.raises(ValueError, match="bad: step 2 has times, a cache size or a scored flag of the wrong type"):
            damaged.check("bad")


def test_a_trace_saved_before_terms_were_recorded_still_loads(tiny, tiny_prompt, tmp_path):
    import pyarrow.parquet as pq

    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=12, max_new_tokens=4).trace
    trace.save(tmp_path / "new.parquet")
    table = pq.read_table(tmp_path / "new.parquet")
    pq.write_table(table.drop_columns(["components"]), tmp_path / "old.parquet")  # the older layout
    loaded = kvviz.Trace.load(tmp_path / "old.parquet")
    assert [e.components for e in loaded.events] == [None] * len(trace.events)
    assert [e.kept.tolist() for e in loaded.events] == [e.kept.tolist() for e in trace.events]


def test_a_missing_trace_file_is_said_not_to_exist(tmp_path):
    missing = tmp_path / "missing.parquet"
    with pytest.raises(ValueError, match="missing.parquet does not exist") as refused:
        kvviz.Trace.load(missing)
    assert "not a readable parquet file" not in str(refused.value)


def _saved(trace, path):
    trace.save(path)
    return path


def test_step_k_consumes_token_k(tiny, tiny_prompt):
    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=6).trace
    tokens = trace.token_ids
    assert [e.token_id for e in trace.decode_steps] == tokens[:-1]
    assert [e.step for e in trace.events] == list(range(6))


def test_text_pieces_concatenate_to_the_decoded_text(tiny, tiny_prompt):
    model, tokenizer = tiny
    result = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=20)
    assert "".join(e.text for e in result.trace.events) == result.text


def test_prompt_over_context_is_refused(tiny):
    model, tokenizer = tiny
    too_long = [5] * (model.config.max_position_embeddings)
    with pytest.raises(ValueError, match="context"):
        kvviz.run(model, tokenizer, too_long, "full", max_new_tokens=4)


@pytest.mark.transformers_api
def test_shared_prefill_gives_the_same_runs_as_separate_prefills(tiny, tiny_prompt):
    model, tokenizer = tiny
    names = ["inertia", "tova", "snapkv", "full", "expected-attention", "expected-attention-decode", "kvzip"]
    policies = {name: kvviz.make_policy(name, **({"window": 8} if name == "snapkv" else {})) for name in names}
    together: dict[str, list] = {name: [] for name in names}
    for name, event in kvviz.engine.decode_many(model, tokenizer, tiny_prompt, policies, budget=24,
                                                max_new_tokens=16):
        together[name].append(event)
    for name in names:
        policy = kvviz.make_policy(name, **({"window": 8} if name == "snapkv" else {}))
        alone = kvviz.run(model, tokenizer, tiny_prompt, policy, budget=24, max_new_tokens=16).trace.events
        assert [e.new_token_id for e in together[name]] == [e.new_token_id for e in alone]
        assert [e.kept.tolist() for e in together[name]] == [e.kept.tolist() for e in alone]


def test_a_stream_that_reaches_eos_drops_out_of_decode_many_while_the_others_go_on(tiny_prompt):
    """Full cache and Recency at B = 20 write different texts; an EOS set to a token that only Recency's first
    12 contain ends Recency there, and the full cache decodes its 12 tokens, each as it does alone."""
    model, tokenizer = kvviz.load_model("tiny-random-llama")  # its own copy: the EOS is changed below
    alone = {name: kvviz.run(model, tokenizer, tiny_prompt, name, budget=20, max_new_tokens=12).token_ids
             for name in ("full", "recency")}
    only_recency = [token for token in alone["recency"] if token not in alone["full"]]
    assert only_recency, "the two texts must differ for this test"
    stop = alone["recency"].index(only_recency[0]) + 1
    assert stop < 12
    model.generation_config.eos_token_id = [only_recency[0]]
    together: dict[str, list[int]] = {"full": [], "recency": []}
    for name, event in kvviz.engine.decode_many(model, tokenizer, tiny_prompt,
                                                {name: kvviz.make_policy(name) for name in together}, budget=20,
                                                max_new_tokens=12):
        together[name].append(event.new_token_id)
    assert together == {"full": alone["full"], "recency": alone["recency"][:stop]}


def test_the_engines_own_refusals_say_what_to_change(tiny, tiny_prompt):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="give either a compression ratio or an absolute budget, not both"):
        resolve_budget(50, compression=0.5, budget=10)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1, got 0"):
        kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=0)
    for top_p in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"top_p must be above 0 and at most 1, got (0.0|1.5)"):
            kvviz.engine.Sampler(1.0, top_p)
    shared = kvviz.engine.prefill(model, tiny_prompt[:-1])
    refusal = "the shared prefill was made for another prompt"
    with kvviz.scoring.installed(model), pytest.raises(ValueError, match=refusal):
        next(kvviz.engine.decode(model, tokenizer, tiny_prompt, kvviz.make_policy("tova"), budget=20, shared=shared))


def test_a_shared_prefill_records_queries_up_to_its_byte_limit_and_a_policy_past_it_prefills_itself(
        tiny, tiny_prompt, monkeypatch):
    """Expected Attention reads every prompt query.  While they fit SHARED_QUERIES_BYTES the shared prefill
    records all of them (the window clipped to the prompt) and serves it; past the limit only SnapKV's 8 are
    recorded and Expected Attention runs its own prefill.  Its keep sets are the same either way."""
    model, tokenizer = tiny
    config = model.config
    per_query = config.num_hidden_layers * config.num_attention_heads * config.head_dim * 4  # float32 queries
    assert model.dtype == torch.float32
    windows = []
    original = kvviz.engine.prefill
    monkeypatch.setattr(kvviz.engine, "prefill", lambda *args, window=0: windows.append(window) or
                        original(*args, window=window))
    runs = []
    for limit in (per_query * len(tiny_prompt), per_query * len(tiny_prompt) - 1):
        monkeypatch.setattr(kvviz.engine, "SHARED_QUERIES_BYTES", limit)
        policies = {"snapkv": kvviz.make_policy("snapkv", window=8), "ea": kvviz.make_policy("expected-attention")}
        events = {}
        for name, event in kvviz.engine.decode_many(model, tokenizer, tiny_prompt, policies, budget=24,
                                                    max_new_tokens=3):
            events.setdefault(name, []).append(event)
        runs.append(events)
    assert windows == [len(tiny_prompt), 8]
    fits, past = runs
    assert fits["ea"][0].t_forward == 0.0 < past["ea"][0].t_forward and past["snapkv"][0].t_forward == 0.0
    assert [e.kept.tolist() for e in fits["ea"]] == [e.kept.tolist() for e in past["ea"]]
    assert kvviz.engine.shared_window([kvviz.make_policy("inertia")], model, len(tiny_prompt)) == 0


@pytest.mark.transformers_api
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_prefill_time_policy_scores_a_shared_prefill_exactly(family, tiny_prompt):
    model, tokenizer = kvviz.models.tiny_model(family)
    shared = kvviz.engine.prefill(model, tiny_prompt, window=8)
    assert shared.window == 8 and len(shared.queries) == model.config.num_hidden_layers
    for window in (4, 8):  # a shorter observation window reads the tail of the recorded queries
        runs = []
        for source in (shared, None):
            events = list(kvviz.engine.decode(model, tokenizer, tiny_prompt, kvviz.make_policy("snapkv", window=window),
                                              budget=20, max_new_tokens=8, shared=source))
            runs.append(events)
        with_shared, alone = runs
        assert with_shared[0].t_forward == 0.0 < alone[0].t_forward  # the shared run did not prefill again
        assert [e.new_token_id for e in with_shared] == [e.new_token_id for e in alone]
        assert [e.kept.tolist() for e in with_shared] == [e.kept.tolist() for e in alone]
        torch.testing.assert_close(torch.from_numpy(with_shared[0].utility), torch.from_numpy(alone[0].utility))
    # a prefill that recorded too short a window is not used: the policy prefills itself
    short = kvviz.engine.prefill(model, tiny_prompt, window=4)
    events = list(kvviz.engine.decode(model, tokenizer, tiny_prompt, kvviz.make_policy("snapkv", window=8), budget=20,
                                      max_new_tokens=2, shared=short))
    assert events[0].t_forward > 0


def test_run_names_its_own_keywords_and_refuses_what_it_would_ignore(tiny, tiny_prompt):
    """A typo of run()'s own keyword is not blamed on the policy alone; sampling settings without a temperature,
    and parameters beside a policy object, would be silently ignored: refused, saying what to do."""
    model, tokenizer = tiny
    own = "backend, budget, chat, compression, max_new_tokens, seed, temperature, top_p"
    with pytest.raises(ValueError, match=f"has no parameter\\(s\\) budgt; .*; and run\\(\\) itself takes {own}"):
        kvviz.run(model, tokenizer, tiny_prompt, "inertia", budgt=10)
    with pytest.raises(ValueError, match="seed= shape sampling, and temperature 0 decodes greedily"):
        kvviz.run(model, tokenizer, tiny_prompt, "random", budget=10, seed=2)  # meant for the policy
    with pytest.raises(ValueError, match="top_p= shape sampling"):
        kvviz.run(model, tokenizer, tiny_prompt, "full", top_p=0.9, temperature=0)
    with pytest.raises(ValueError, match="not alpha: set a policy object's parameters where it is made"):
        kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia"), alpha=0.5)
    seeded = [kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("random", seed=seed), budget=10,
                        max_new_tokens=6).trace for seed in (1, 2)]
    assert [e.evicted.tolist() for e in seeded[0].events] != [e.evicted.tolist() for e in seeded[1].events]


def test_each_timed_part_of_a_step_waits_for_the_device_before_its_clock_is_read(tiny, tiny_prompt, monkeypatch):
    """On CUDA a forward returns before its kernels have run: without a wait, the scores' copy to the host
    would bill the layer's attention to scoring, and the forward would look free.  Each step waits after the
    forward, before and after each layer's scoring, and at the end of the eviction: on a CPU a no-op."""
    import kvviz.engine as engine_module

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    engine_module.settle(torch.device("cpu"))
    assert calls == []
    engine_module.settle(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]

    model, tokenizer = tiny
    waits = []
    monkeypatch.setattr(engine_module, "settle", lambda device: waits.append(device))
    layers = model.config.num_hidden_layers
    events = list(engine_module.decode(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia"), budget=20,
                                       max_new_tokens=4, ignore_eos=True))
    # the prefill: after its forward; then per decode step: the forward, 2 per scored layer, the eviction
    assert len(events) == 4 and len(waits) == 1 + 3 * (1 + 2 * layers + 1)
    assert set(waits) == {model.device}


MULTI_BYTE = "Family 👨‍👩‍👧 and ideas 💡💡 in 中文 text, ok."


def test_text_pieces_hold_a_character_split_across_tokens_until_it_is_whole(tiny):
    _, tokenizer = tiny
    ids = tokenizer(MULTI_BYTE, add_special_tokens=False)["input_ids"]
    assert len(ids) > len(MULTI_BYTE)  # the byte-level tokenizer does split characters
    pieces = engine.TextPieces(tokenizer)
    given = [pieces.add(token) for token in ids]
    assert "".join(given) == MULTI_BYTE
    assert not any("\ufffd" in piece for piece in given)
    assert "" in given  # the parts of a character were held back, not given out broken


def test_text_pieces_flush_gives_out_an_incomplete_character_at_the_end(tiny):
    _, tokenizer = tiny
    ids = tokenizer("ok 💡", add_special_tokens=False)["input_ids"]
    pieces = engine.TextPieces(tokenizer)
    given = [pieces.add(token) for token in ids[:-2]] + [pieces.add(ids[-2], flush=True)]
    assert "".join(given) == tokenizer.decode(ids[:-1]) == "ok \ufffd"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_runs_streamed_pieces_join_to_the_decode_of_its_tokens(tiny, seed):
    # a random byte-level model writes bytes that often split or break characters
    model, tokenizer = tiny
    result = kvviz.run(model, tokenizer, MULTI_BYTE * 3, "inertia", compression=0.5, max_new_tokens=48,
                       temperature=1.0, seed=seed)
    assert "".join(event.text for event in result.trace.events) == result.text
