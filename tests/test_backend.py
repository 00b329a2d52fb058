"""The static backend (kvviz.backend) gives the hook engine's events: tokens, kept and evicted positions at
every step, utility and raw scores to float32 rounding, text, for every policy it runs, greedy and sampled
(float32, tiny random models of each supported family)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvviz
from kvviz import backend
from kvviz.backend import scorers
from kvviz.backend.sampling import DeviceSampler
from kvviz.backend.static import StaticBackend
from kvviz.engine import Sampler, decode
from kvviz.models import tiny_model
from kvviz.policies import build_setting
from kvviz.policies.base import lowest

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
# Every every-step setting the registry offers (each InertiaKV scorer, aggregation, layer subset and refresh),
# and the baselines; id -> setting as typed.
SETTINGS = {
    "inertia": "inertia", "inertia-lazy": "inertia-lazy", "score-free": "score-free", "single-step": "single-step",
    "cumulative": "cumulative", "inertia-vnorm": "inertia-vnorm", "inertia-entropy": "inertia-entropy",
    "inertia-keydiff": "inertia-keydiff", "inertia-knorm": "inertia-knorm", "inertia-recency": "inertia-recency",
    "inertia-layers-0-2": "inertia layers=0,2", "inertia-decoupled": "inertia-decoupled",
    "inertia-decoupled-last-2": "inertia-decoupled layer_weighting=last last_k=2 refresh=3",
    "tova": "tova", "h2o": "h2o", "streaming": "streaming", "keydiff": "keydiff", "knorm": "knorm",
    "recency": "recency", "random": "random seed=5", "full": "full",
}
SAMPLED = {"temperature": 0.8, "top_p": 0.9, "seed": 3}
TEXT = ("The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. "
        "Grass is green, the sky is blue. What is the passkey? ")


@pytest.fixture(scope="module")
def models():
    """One tiny model per family, built here (not load_model's): Qwen3's QK-norm weights are drawn at random,
    as trained ones differ from 1; left at their init of 1 every key has the same norm up to rounding, and
    K-norm's utilities tie to the last bit, where rounding, not the rule, decides."""
    built = {}
    generator = torch.Generator().manual_seed(0)
    for family in FAMILIES:
        model, tokenizer = tiny_model(family)
        if family == "qwen3":
            with torch.no_grad():
                for layer in model.model.layers:
                    for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                        norm.weight.copy_(torch.rand(norm.weight.shape, generator=generator) + 0.5)
        built[family] = (model, tokenizer, tokenizer(TEXT, add_special_tokens=False)["input_ids"])
    return built


def close(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    """Both absent, or equal to float32 rounding of the attention (the two paths sum in other orders)."""
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and np.allclose(a, b, rtol=1e-4, atol=1e-6)


def first_difference(reference: list, static: list) -> str | None:
    """Where two runs' events first differ (step and field), None if nowhere: tokens, text and position sets
    exactly, utility and raw scores to rounding."""
    for ours, theirs in zip(reference, static):
        for name in ("step", "token_id", "new_token_id", "text", "scored"):
            if getattr(ours, name) != getattr(theirs, name):
                return f"step {ours.step}: {name} {getattr(ours, name)!r} != {getattr(theirs, name)!r}"
        for name in ("kept", "evicted"):
            if not np.array_equal(getattr(ours, name), getattr(theirs, name)):
                return f"step {ours.step}: {name} differ"
        for name in ("utility", "raw"):
            if not close(getattr(ours, name), getattr(theirs, name)):
                return f"step {ours.step}: {name} differ"
    if len(reference) != len(static):
        return f"{len(reference)} events != {len(static)}"
    return None


def both(model, tokenizer, prompt, setting: str, budget: int, steps: int, sampling: dict | None = None,
         compile: bool = False, **options) -> tuple[list, list]:
    """The engine's events and the static backend's, each with a fresh policy of ``setting``."""
    sampling = sampling or {}
    reference = list(decode(model, tokenizer, prompt, build_setting(setting)[1], budget=budget,
                            max_new_tokens=steps, sampler=Sampler(**sampling)))
    static = list(StaticBackend(model, build_setting(setting)[1], compile=compile).stream(
        tokenizer, prompt, budget=budget, max_new_tokens=steps, **sampling, **options))
    return reference, static


@pytest.mark.parametrize("setting", list(SETTINGS.values()), ids=list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_backend_gives_the_engines_events_greedy_and_sampled(models, family, setting):
    """Budget 20 of a 56-token prompt: step 1 frees 37 entries at once, then one per step."""
    model, tokenizer, prompt = models[family]
    for sampling, steps in ((None, 16), (SAMPLED, 10)):
        reference, static = both(model, tokenizer, prompt, setting, 20, steps, sampling)
        assert len(static) == steps and first_difference(reference, static) is None, (sampling, first_difference(
            reference, static))


@pytest.mark.transformers_api
@pytest.mark.parametrize("setting", list(SETTINGS.values()), ids=list(SETTINGS))
def test_a_budget_above_the_prompt_grows_the_cache_then_evicts_as_the_engine(models, setting):
    """Budget 66 of 56 tokens: 10 steps add a slot each without evicting, then the cache holds B + 1 slots."""
    model, tokenizer, prompt = models["qwen2"]
    assert len(prompt) == 56
    reference, static = both(model, tokenizer, prompt, setting, 66, 18)
    assert first_difference(reference, static) is None
    assert [len(e.evicted) for e in static[1:]] == ([0] * 17 if setting == "full" else [0] * 10 + [1] * 7)


@pytest.mark.transformers_api
@pytest.mark.parametrize("family, setting", [("llama", "score-free"), ("qwen3", "h2o"), ("mistral", "random")])
def test_backend_equals_the_engine_over_hundreds_of_steps_at_a_tiny_budget(models, family, setting):
    """256 steps at B = 5: every step an eviction among 6 slots, Score-Free's ulp-close entering means, H2O's
    window, Random's slot order after hundreds of moves."""
    model, tokenizer, prompt = models[family]
    reference, static = both(model, tokenizer, prompt, setting, 5, 256)
    assert len(static) == 256 and first_difference(reference, static) is None


# Prefill-time policies: cut at the prefill by the engine's own scoring passes, then decoded on static slots.
PREFILL_TIME = {"snapkv": "snapkv window=8", "kvzip": "kvzip", "expected-attention": "expected-attention"}


@pytest.mark.parametrize("setting", list(PREFILL_TIME.values()), ids=list(PREFILL_TIME))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_prefill_time_policy_cuts_the_prompt_then_decodes_on_the_slots_as_the_engine(models, family, setting):
    """Budget 20 of 56: step 0 frees 36 prompt entries (the engine's own selection), and no step after it
    evicts; every new token stays, so the cache holds B + k after step k, as the engine's does."""
    model, tokenizer, prompt = models[family]
    for sampling, steps in ((None, 16), (SAMPLED, 10)):
        reference, static = both(model, tokenizer, prompt, setting, 20, steps, sampling)
        assert len(static) == steps and first_difference(reference, static) is None, (sampling, first_difference(
            reference, static))
        assert [len(e.evicted) for e in static] == [36] + [0] * (steps - 1)
        assert [len(e.kept) for e in static] == [20 + step for step in range(steps)]


@pytest.mark.parametrize("setting", list(PREFILL_TIME.values()), ids=list(PREFILL_TIME))
def test_a_prefill_time_policy_with_a_budget_above_the_prompt_evicts_nothing_as_the_engine(models, setting):
    model, tokenizer, prompt = models["qwen2"]
    reference, static = both(model, tokenizer, prompt, setting, 66, 12)
    assert first_difference(reference, static) is None and not any(len(e.evicted) for e in static)


def test_a_prefill_time_policy_runs_on_the_static_backend_under_auto_on_a_gpu_and_on_request(models):
    model, tokenizer, prompt = models["mistral"]
    assert backend.choose(model, kvviz.make_policy("snapkv"), device="cuda") == "static"
    assert backend.choose(model, kvviz.make_policy("snapkv")) == "engine"  # a CPU: the engine
    engine_run = kvviz.run(model, tokenizer, prompt, "kvzip", budget=16, max_new_tokens=8, backend="engine")
    static_run = kvviz.run(model, tokenizer, prompt, "kvzip", budget=16, max_new_tokens=8, backend="static")
    assert static_run.text == engine_run.text
    assert first_difference(engine_run.trace.events, static_run.trace.events) is None


# Checkpointed policies: the policy object decides on the host, fed by the slots' views (interval 4: evictions
# within the run; AvoKV-E's tail and sinks take 36 entries, so B = 40).
CHECKPOINTED = {"avokv": "avokv interval=4", "avokv-decode-queries": "avokv interval=4 prompt_queries=false",
                "rkv": "rkv interval=4", "rkv-prompt-queries": "rkv interval=4 prompt_queries=true",
                "lazyeviction": "lazyeviction interval=4"}


def same_components(reference: list, static: list) -> bool:
    """The named terms of every step's decision (AvoKV-E's and R-KV's Why table), to float32 rounding."""
    for ours, theirs in zip(reference, static):
        if (ours.components is None) != (theirs.components is None):
            return False
        if ours.components is not None and (set(ours.components) != set(theirs.components) or not all(
                np.allclose(ours.components[name], theirs.components[name], rtol=1e-4, atol=1e-6, equal_nan=True)
                for name in ours.components)):
            return False
    return True


@pytest.mark.parametrize("setting", list(CHECKPOINTED.values()), ids=list(CHECKPOINTED))
@pytest.mark.parametrize("family", FAMILIES)
def test_a_checkpointed_policy_decides_on_the_host_over_the_slots_as_on_the_engine(models, family, setting):
    """Budget 40 of 56: the first checkpoint (step 1) frees 17, then every 4th step frees 3 (B + interval - 1
    held at most); tokens, keep sets, utility, raw and the named terms of each decision are the engine's."""
    model, tokenizer, prompt = models[family]
    for sampling, steps in ((None, 20), (SAMPLED, 12)):
        reference, static = both(model, tokenizer, prompt, setting, 40, steps, sampling)
        assert len(static) == steps and first_difference(reference, static) is None, (sampling, first_difference(
            reference, static))
        assert same_components(reference, static) and any(e.components for e in static[1:])
        assert [len(e.evicted) for e in static[:6]] == [0, 17, 0, 0, 3, 0]
        assert max(len(e.kept) for e in static[1:]) <= 40 + 4 - 1


def test_a_checkpointed_policy_equals_the_engine_over_hundreds_of_steps(models):
    """(Not in the oldest-transformers run: ~40 s, and the interfaces it uses are the every-step tests'.)"""
    model, tokenizer, prompt = models["qwen3"]
    reference, static = both(model, tokenizer, prompt, "rkv interval=3 window=2 observe_window=2", 12, 200)
    assert len(static) == 200 and first_difference(reference, static) is None
    assert same_components(reference, static)


@pytest.mark.parametrize("family", FAMILIES)
def test_expected_attention_at_every_step_decides_on_the_host_over_the_slots_as_on_the_engine(models, family):
    """Budget 40 of 56: the prefill cuts 16 entries, then every step frees exactly one, the entry future queries
    are expected to attend to least; budget 66 above the prompt: 10 steps grow, then one a step."""
    model, tokenizer, prompt = models[family]
    for budget, sampling, steps in ((40, None, 20), (40, SAMPLED, 12), (66, None, 16)):
        reference, static = both(model, tokenizer, prompt, "expected-attention-decode", budget, steps, sampling)
        assert len(static) == steps and first_difference(reference, static) is None, (budget, sampling)
        cut = max(0, len(prompt) - budget)
        grows = max(0, budget - len(prompt))
        assert [len(e.evicted) for e in static] == [cut] + [0] * grows + [1] * (steps - 1 - grows)
        assert all(len(e.kept) == min(budget, len(prompt) + e.step) for e in static)


def test_the_comparison_detects_expected_attention_fed_views_without_their_rope(models, monkeypatch):
    """The views' RoPE frequencies rotate each query back to its pre-RoPE form; fed the wrong ones (the
    positions' rotation off by half), the statistics and so the evictions differ."""
    from kvviz.backend import static

    model, tokenizer, prompt = models["llama"]
    init = static._PolicyOnHost.__init__
    monkeypatch.setattr(static._PolicyOnHost, "__init__", lambda self, policy, rope: init(self, policy, rope * 0.5))
    assert first_difference(*both(model, tokenizer, prompt, "expected-attention-decode", 40, 16)) is not None


def test_the_comparison_detects_a_checkpointed_policy_fed_no_view_of_one_layer(models, monkeypatch):
    from kvviz.backend import static

    model, tokenizer, prompt = models["llama"]
    observe = static._PolicyOnHost.observe
    monkeypatch.setattr(static._PolicyOnHost, "observe",
                        lambda self, view, positions: None if view.layer == 1 else observe(self, view, positions))
    reference, static_events = both(model, tokenizer, prompt, "avokv interval=4", 40, 12)
    assert first_difference(reference, static_events) is not None or not same_components(reference, static_events)


def test_events_every_k_steps_keep_every_steps_positions_and_every_kth_utility(models):
    model, tokenizer, prompt = models["llama"]
    reference, static = both(model, tokenizer, prompt, "h2o", 20, 15, events_every=4)
    assert [e.new_token_id for e in static] == [e.new_token_id for e in reference]
    assert all(np.array_equal(a.kept, b.kept) and np.array_equal(a.evicted, b.evicted)
               for a, b in zip(reference, static))
    # read at steps 0, 4, 8, 12 and the last (14), and step 1, which frees many at once and syncs anyway
    assert [e.step for e in static if e.utility is not None] == [0, 1, 4, 8, 12, 14]
    assert all(close(a.utility, b.utility) and close(a.raw, b.raw) for a, b in zip(reference, static)
               if b.utility is not None)
    with pytest.raises(ValueError, match="events_every must be at least 1"):
        next(StaticBackend(model, kvviz.make_policy("h2o")).stream(tokenizer, prompt, budget=20, events_every=0))


def test_reading_the_device_at_a_frame_rate_keeps_every_steps_event(models, monkeypatch):
    """reads_per_second: the host waits for the device in blocks sized to the rate (here at most one read every
    2 s, against a few ms a step), yet every step's event is the engine's, utility and raw included, so a
    saved trace is the same file; the first token is still read at once."""
    from kvviz.backend import static

    model, tokenizer, prompt = models["llama"]
    reads = []
    settle = static.engine.settle
    monkeypatch.setattr(static.engine, "settle", lambda device: reads.append(1) or settle(device))
    reference = list(decode(model, tokenizer, prompt, build_setting("h2o")[1], budget=20, max_new_tokens=60))
    stream = StaticBackend(model, build_setting("h2o")[1]).stream(tokenizer, prompt, budget=20, max_new_tokens=60,
                                                                   reads_per_second=0.5)
    first = next(stream)  # the prefill's token, read at once
    at_first = len(reads)
    blocked = [first, *stream]
    assert first.step == 0 and first_difference(reference, blocked) is None
    assert all(e.utility is not None for e in blocked)
    assert len(reads) - at_first < 59 / 2  # blocks, not a read per step
    with pytest.raises(ValueError, match="reads_per_second must be above 0"):
        next(StaticBackend(model, build_setting("h2o")[1]).stream(tokenizer, prompt, budget=20, reads_per_second=0))


# -- the comparison can fail -----------------------------------------------------------------------------

def test_the_comparison_detects_a_layer_whose_ema_is_skipped(models, monkeypatch):
    model, tokenizer, prompt = models["llama"]
    observe = scorers.Inertia.observe
    monkeypatch.setattr(scorers.Inertia, "observe",
                        lambda self, view, positions: None if view.layer == 1 else observe(self, view, positions))
    assert first_difference(*both(model, tokenizer, prompt, "inertia", 20, 20)) is not None


def test_the_comparison_detects_a_lazy_token_entering_at_zero_instead_of_the_mean(models, monkeypatch):
    model, tokenizer, prompt = models["llama"]
    begin = scorers.Inertia.begin
    monkeypatch.setattr(scorers.Inertia, "begin", lambda self, scoring, free, slots: begin(self, True, free, slots))
    assert first_difference(*both(model, tokenizer, prompt, "inertia-lazy", 20, 20)) is not None


def test_the_comparison_detects_random_drawn_over_the_static_slots_not_the_engines(models, monkeypatch):
    model, tokenizer, prompt = models["llama"]
    monkeypatch.setattr(scorers.Uniform, "evict", lambda self, positions, count: torch.randperm(
        positions.numel(), generator=self.generator)[:count])  # the engine's draw, read as a static slot
    assert first_difference(*both(model, tokenizer, prompt, "random", 20, 20)) is not None


def test_the_comparison_detects_kvzip_cut_without_its_reconstruction_pass(models, monkeypatch):
    from kvviz.backend import static

    model, tokenizer, prompt = models["llama"]
    monkeypatch.setattr(static, "reconstruct_once", lambda model, tokenizer, cache, prompt_ids, shared: 0.0)
    assert first_difference(*both(model, tokenizer, prompt, "kvzip", 20, 8)) is not None


def test_the_comparison_detects_ties_broken_toward_the_newer_entry(monkeypatch):
    """K-norm on a QK-normed model left at unit norm weights: every key has the same norm, every utility the
    same up to rounding.  Breaking those ties toward the newer entry (the engine: the older) shows."""
    model, tokenizer = tiny_model("qwen3")
    prompt = tokenizer(TEXT, add_special_tokens=False)["input_ids"]

    def newest_first(utility, positions, count):
        if count != 1:
            return lowest(utility, positions, count)
        ties = utility <= utility.min() + 1e-5  # within rounding of the lowest
        return torch.where(ties, positions, -1).argmax().reshape(1)

    monkeypatch.setattr(scorers, "lowest", newest_first)
    assert first_difference(*both(model, tokenizer, prompt, "knorm", 20, 12)) is not None


# -- sampling ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature, top_p", [(0.7, 1.0), (1.3, 0.8), (1e-38, 0.9), (0.0, 1.0)])
def test_device_sampling_draws_the_engine_samplers_tokens(temperature, top_p):
    """Same rule, same generator type and seed on the CPU: the same token at every draw (1e-38: logits / T
    overflow, the shifted float64 fallback)."""
    logits = torch.randn(50, 320, generator=torch.Generator().manual_seed(1)) * 4
    engine_sampler, device_sampler = Sampler(temperature, top_p, 11), DeviceSampler(temperature, top_p, 11)
    assert [engine_sampler(row) for row in logits] == [int(device_sampler(row)) for row in logits]


def test_device_sampler_refuses_what_the_engine_refuses():
    with pytest.raises(ValueError, match="top_p must be above 0 and at most 1"):
        DeviceSampler(0.5, 0.0)


# -- dispatch ----------------------------------------------------------------------------------------------

def test_auto_stays_on_the_engine_on_a_cpu_and_static_refuses_by_name(models):
    model = models["llama"][0]
    assert backend.choose(model, kvviz.make_policy("tova")) == "engine"
    assert backend.choose(model, kvviz.make_policy("tova"), "static") == "static"
    assert backend.choose(model, kvviz.make_policy("tova"), device="cuda") == "static"
    assert backend.choose(model, kvviz.make_policy("avokv"), device="cuda") == "static"
    assert backend.choose(model, kvviz.make_policy("expected-attention-decode"), device="cuda") == "static"
    gemma, _ = tiny_model("gemma")
    why = "it reproduces llama, mistral, qwen2, qwen3 decoder layers, not 'gemma'"
    assert not backend.supports(gemma, kvviz.make_policy("tova"))
    with pytest.raises(ValueError, match=f"backend='static' cannot run TOVA: {why}"):
        backend.choose(gemma, kvviz.make_policy("tova"), "static")
    with pytest.raises(ValueError, match=why):
        StaticBackend(gemma, kvviz.make_policy("tova"))
    with pytest.raises(ValueError, match="backend must be one of auto, engine, static"):
        backend.choose(model, kvviz.make_policy("tova"), "gpu")


def test_a_subclass_and_an_unsupported_family_are_refused(models):
    from dataclasses import dataclass

    from kvviz.policies.tova import TOVA

    @dataclass
    class Mine(TOVA):
        pass

    assert "not a policy it knows" in backend.refusal(models["llama"][0], Mine())
    gemma, _ = tiny_model("gemma")
    assert "not 'gemma'" in backend.refusal(gemma, kvviz.make_policy("tova"))
    assert backend.choose(gemma, kvviz.make_policy("tova"), device="cuda") == "engine"


@pytest.mark.transformers_api
def test_run_with_the_static_backend_gives_the_engines_trace(models):
    model, tokenizer, prompt = models["mistral"]
    engine_run = kvviz.run(model, tokenizer, prompt, "knorm", budget=16, max_new_tokens=10, backend="engine")
    static_run = kvviz.run(model, tokenizer, prompt, "knorm", budget=16, max_new_tokens=10, backend="static")
    assert static_run.text == engine_run.text and static_run.trace.meta() == engine_run.trace.meta()
    assert first_difference(engine_run.trace.events, static_run.trace.events) is None
    gemma, gemma_tokenizer = tiny_model("gemma")
    with pytest.raises(ValueError, match="backend='static' cannot run KNorm: .*not 'gemma'"):
        kvviz.run(gemma, gemma_tokenizer, prompt, "knorm", budget=16, backend="static")


def test_compiled_steady_step_is_one_graph_for_every_policy(models):
    """torch.compile takes the layer alone (the scorers run beside it), so one graph of the steady shape serves
    InertiaKV-Lazy's two step variants and H2O alike; the events stay the engine's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    model, tokenizer, prompt = models["llama"]
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    for setting in ("inertia-lazy", "h2o"):
        reference, static = both(model, tokenizer, prompt, setting, 20, 12, compile=True)
        assert first_difference(reference, static) is None
    assert counters["stats"]["unique_graphs"] - before == 1


@pytest.mark.parametrize("setting", ["snapkv window=8", "full"])
def test_a_run_that_never_evicts_decodes_in_one_step_shape(models, setting, monkeypatch):
    """The full cache, and a prefill-time policy after its cut, fill slots that all exist from step 1: every
    step attends over the same slots (the unwritten masked), so one compiled graph (on a GPU one captured
    step) serves the whole run, which still gives the engine's events."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from kvviz import fast

    model, tokenizer, prompt = models["qwen2"]
    shapes = []
    forward = fast.layer_forward
    monkeypatch.setattr(fast, "layer_forward", lambda layer, hidden, cos, sin, free, keys, *args, **kwargs: (
        shapes.append((keys.shape, args[3], kwargs["bias"] is not None)) or forward(layer, hidden, cos, sin, free,
                                                                                    keys, *args, **kwargs)))
    reference, static = both(model, tokenizer, prompt, setting, 20, 12)
    assert first_difference(reference, static) is None
    assert len(set(shapes)) == 1 and shapes[0][1:] == (None, True)  # all slots, masked
    monkeypatch.undo()
    torch._dynamo.reset()
    before = counters["stats"]["unique_graphs"]
    reference, static = both(model, tokenizer, prompt, setting, 20, 12, compile=True)
    assert first_difference(reference, static) is None
    assert counters["stats"]["unique_graphs"] - before == 1


# -- the full cache as a static step: the speed baseline (bench speed's static-full-cache row) -------------

def full_cache_tokens(model, tokenizer, prompt, steps: int, **options) -> list[int]:
    """Greedy tokens of the full cache on the static backend, as bench speed times it."""
    static = StaticBackend(model, kvviz.make_policy("full"), **{k: v for k, v in options.items() if k != "shared"})
    run = static.generate(tokenizer, prompt, len(prompt) + steps, steps, shared=options.get("shared"))
    assert len(run.step_seconds) == len(run.setup_steps)
    return run.token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_the_full_cache_static_step_gives_generates_tokens(models, family):
    """Prompt + new-token slots, the unwritten ones masked: greedy tokens equal plain model.generate's, with one
    value product or in blocks of 4 slots over a padded cache, from its own prefill or a shared one."""
    from kvviz.engine import prefill

    model, tokenizer, prompt = models[family]
    steps = 40
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                              min_new_tokens=steps)[0, len(prompt):].tolist()
    for options in ({}, {"value_block": 4}, {"shared": prefill(model, prompt)}):
        assert full_cache_tokens(model, tokenizer, prompt, steps, **options) == expected, options
    assert full_cache_tokens(model, tokenizer, prompt, 1) == expected[:1]


def test_the_full_cache_comparison_detects_the_unwritten_slots_left_unmasked(models, monkeypatch):
    """Without the bias the zero keys of the slots not yet written take a share of every softmax: the tokens
    part from generate's (on Qwen3 with drawn QK-norm weights, whose attention is sharp enough for a diluted
    softmax to change the argmax within 30 steps; on the flatter tiny models it takes ~70)."""
    from kvviz import fast

    model, tokenizer, prompt = models["qwen3"]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              min_new_tokens=30)[0, len(prompt):].tolist()
    assert full_cache_tokens(model, tokenizer, prompt, 30) == expected
    forward = fast.layer_forward
    monkeypatch.setattr(fast, "layer_forward", lambda *args, bias=None, **kwargs: forward(*args, **kwargs))
    assert full_cache_tokens(model, tokenizer, prompt, 30) != expected
