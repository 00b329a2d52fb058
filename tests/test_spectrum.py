"""The scorer spectrum (InertiaKV §5.1) against references computed without kvviz's capture: an eager-attention
copy of the model for attention itself, separate engine runs for the utilities, scipy for the statistics."""

from __future__ import annotations

import copy
import json
from itertools import combinations

import numpy as np
import pytest
import torch
from scipy import stats

import kvviz
from kvviz.cli import main
from kvviz.policies.scorers import SCORERS
from kvviz.spectrum import spectrum

STEPS = 4


@pytest.fixture(scope="module")
def measured(tiny, tiny_prompt):
    model, _ = tiny
    return spectrum(model, tiny_prompt, steps=STEPS, layer=1, compression=0.9)


@pytest.fixture(scope="module")
def eager_attention(tiny, tiny_prompt, measured):
    """Each layer's head-mean attention row of each step's query, from an eager copy of the model run over
    the prompt and the fed tokens at once: ``rows[step - 1][layer]`` over positions ``0 .. P``."""
    model, _ = tiny
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    sequence = torch.tensor([tiny_prompt + measured.tokens])
    with torch.inference_mode():
        attentions = eager(input_ids=sequence, output_attentions=True).attentions
    rows = []
    for step in measured.steps:
        position = len(tiny_prompt) + step - 1
        rows.append([layer[0, :, position, :position + 1].float().mean(0).numpy() for layer in attentions])
    return rows


def test_the_fed_tokens_are_the_full_caches_greedy_continuation(tiny, tiny_prompt, measured):
    model, tokenizer = tiny
    reference = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=STEPS, chat=False).token_ids
    assert measured.tokens == reference
    assert measured.cache_sizes == [len(tiny_prompt) + step for step in range(1, STEPS + 1)]


def test_the_layer_level_matches_eager_attention(measured, eager_attention):
    """Attention against itself is 1; entropy weighting multiplies a layer's attention by one positive number,
    so its ranking is attention's; recency's Spearman is that of position against the eager attention row."""
    layer = measured.layer
    for index, rows in enumerate(eager_attention):
        attention = rows[layer]
        expected_recency = stats.spearmanr(np.arange(attention.size), attention).statistic
        assert measured.layer_spearman["recency"][index] == pytest.approx(expected_recency, abs=1e-6)
        assert measured.layer_spearman["attention"][index] == pytest.approx(1.0)
        assert measured.layer_jaccard["attention"][index] == 1.0
        assert measured.layer_spearman["entropy"][index] == pytest.approx(1.0)
        assert measured.layer_jaccard["entropy"][index] == 1.0


def test_the_layer_profile_matches_eager_attention_at_every_layer(measured, eager_attention):
    """At each layer, recency's Spearman is position against that layer's eager attention row (mean over the
    steps); at the compared layer the profile is the per-layer level's own mean."""
    profile = measured.layer_profile()
    assert set(profile) == set(SCORERS) and all(values.shape == (3,) for values in profile.values())
    for layer in (1, 2):  # layer 0 of the tiny model attends uniformly: its ranks are rounding
        expected = np.mean([stats.spearmanr(np.arange(rows[layer].size), rows[layer]).statistic
                            for rows in eager_attention])
        assert profile["recency"][layer] == pytest.approx(expected, abs=1e-6)
        assert profile["attention"][layer] == pytest.approx(1.0)
    for name in SCORERS:
        assert profile[name][measured.layer] == pytest.approx(np.mean(measured.layer_spearman[name]))


def test_key_and_value_scorers_match_a_recomputation_from_the_eager_cache(tiny, tiny_prompt, measured):
    """vnorm, knorm and keydiff at the compared layer, recomputed from the eager model's own attention rows
    and its cache's post-RoPE keys and values (query head h reads KV head h // group), then ranked by scipy."""
    from transformers import DynamicCache

    from kvviz.engine import cache_kwarg

    model, _ = tiny
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        attentions = eager(input_ids=torch.tensor([tiny_prompt + measured.tokens]), output_attentions=True,
                           use_cache=True, **{cache_kwarg(model): cache}).attentions
    layer = measured.layer
    keys, values = (tensor[0].float() for tensor in (cache.layers[layer].keys, cache.layers[layer].values))
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    kv_of = torch.arange(heads) // (heads // kv_heads)
    for index, step in enumerate(measured.steps):
        n = len(tiny_prompt) + step
        attention = attentions[layer][0, :, n - 1, :n].float()  # (heads, n)
        value_norms = values[:, :n].norm(dim=-1)[kv_of]
        key_norms = keys[:, :n].norm(dim=-1)
        unit = torch.nn.functional.normalize(keys[:, :n], dim=-1)
        anchor = torch.nn.functional.normalize(unit.mean(1, keepdim=True), dim=-1)
        expected = {"vnorm": (attention * value_norms / value_norms.mean(-1, keepdim=True)).mean(0),
                    "knorm": -(key_norms / key_norms.mean(-1, keepdim=True)).mean(0),
                    "keydiff": -(unit * anchor).sum(-1).mean(0)}
        for name, score in expected.items():
            rho = stats.spearmanr(score.numpy(), attention.mean(0).numpy()).statistic
            assert measured.layer_spearman[name][index] == pytest.approx(rho, abs=1e-4), name


def test_cross_layer_agreement_matches_eager_attention(measured, eager_attention):
    """Per step: the Jaccard of every pair of layers' top-B sets, B = floor(0.1 n), from the eager rows.  The
    tiny model's first layer attends uniformly, so its top-B is decided by ties (broken in rounding); only
    pairs of layers with a clear gap at the boundary are compared."""
    checked = 0
    for index, rows in enumerate(eager_attention):
        keep = max(1, int(0.1 * rows[0].size))
        clear = [np.sort(row)[::-1][keep - 1] - np.sort(row)[::-1][keep] > 1e-5 for row in rows]
        tops = [set(np.argsort(-row, kind="stable")[:keep].tolist()) for row in rows]
        for pair, (a, b) in enumerate(combinations(range(len(rows)), 2)):
            if clear[a] and clear[b]:
                expected = len(tops[a] & tops[b]) / len(tops[a] | tops[b])
                assert measured.cross_layer[index][pair] == pytest.approx(expected)
                checked += 1
    assert checked >= STEPS
    first, second = (set(np.argsort(-rows[measured.layer])[:max(1, int(0.1 * rows[0].size))].tolist())
                     for rows in eager_attention[:2])
    assert np.isnan(measured.layer_churn[0])
    assert measured.layer_churn[1] == pytest.approx(1 - len(first & second) / len(first | second))


@pytest.mark.parametrize("scorer", ["keydiff", "vnorm", "recency"])
def test_the_utility_level_matches_separate_engine_runs(tiny, tiny_prompt, measured, scorer):
    """One pass feeding every InertiaKV variant the same views gives each the utility of its own engine run
    (a budget that never evicts), so Spearman and top-B Jaccard against InertiaKV's agree."""
    model, tokenizer = tiny

    def utilities(name):
        events = kvviz.run(model, tokenizer, tiny_prompt, name, budget=10_000, max_new_tokens=STEPS + 1,
                           chat=False).trace.events
        return {event.step: event.utility[np.argsort(event.kept)] for event in events[1:STEPS + 1]}

    own, attention = utilities(f"inertia-{scorer}"), utilities("inertia")
    for index, step in enumerate(measured.steps):
        expected = stats.spearmanr(own[step], attention[step]).statistic
        assert measured.utility_spearman[scorer][index] == pytest.approx(expected, abs=1e-6)
        keep = max(1, int(0.1 * own[step].size))
        tops = [set(np.argsort(-values, kind="stable")[:keep].tolist()) for values in (own[step], attention[step])]
        assert measured.utility_jaccard[scorer][index] == pytest.approx(len(tops[0] & tops[1]) / len(tops[0] | tops[1]))


def test_the_table_averages_the_steps(measured):
    rows = {row["scorer"]: row for row in measured.table()}
    assert set(rows) == set(SCORERS)
    assert rows["knorm"]["layer_spearman"] == pytest.approx(np.mean(measured.layer_spearman["knorm"]))
    assert rows["attention"]["utility_jaccard"] == 1.0


def test_top_b_is_the_floor_of_the_share_even_where_floating_point_falls_short(tiny, tiny_prompt):
    """0.1 * 120 is 11.999... in floating point; B must be 12 (and 12 at 121, 122; 60 at rho 0.5)."""
    from kvviz.spectrum import top_b

    result = spectrum(tiny[0], (tiny_prompt * 2)[:119], steps=3, compression=0.9)
    assert result.cache_sizes == [120, 121, 122] and result.budgets == [12, 12, 12]
    assert [top_b(120, 0.5), top_b(5, 0.9), top_b(130, 0.9)] == [60, 1, 13]


def test_top_b_is_the_engines_budget_or_one():
    from kvviz.engine import resolve_budget
    from kvviz.spectrum import top_b

    for size in (1, 7, 99, 120, 1000):
        for compression in (0.0, 0.3, 0.5, 0.9, 0.99):
            expected = max(1, int((1 - compression) * size + 1e-9))
            assert top_b(size, compression) == expected
            if expected > 1 or (1 - compression) * size >= 1:
                assert top_b(size, compression) == resolve_budget(size, compression=compression)
    with pytest.raises(ValueError, match="compression must be in"):
        top_b(10, 1.0)


def test_the_callers_model_gets_its_attention_back():
    from kvviz.models import tiny_model

    model, tokenizer = tiny_model("llama")
    prompt = tokenizer("The quick brown fox jumps over the lazy dog. " * 3, add_special_tokens=False)["input_ids"]
    spectrum(model, prompt, steps=2, layer=1)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(module, "kvviz_rope") for module in model.modules())


@pytest.mark.parametrize("kwargs, message", [(dict(layer=3), "layer must be between 0 and 2"),
                                             (dict(steps=0), "steps must be at least 1"),
                                             (dict(compression=1.0), "compression must be in")])
def test_bad_settings_are_refused(tiny, tiny_prompt, kwargs, message):
    with pytest.raises(ValueError, match=message):
        spectrum(tiny[0], tiny_prompt, **kwargs)


def test_the_cli_prints_the_spectrum_as_json_and_refuses_bad_input(capsys):
    prompt = "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it."
    assert main(["scorers", "--model", "tiny-random-llama", "--prompt", prompt, "--no-chat", "--steps", "3",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layer"] == 1 and out["num_layers"] == 3 and out["steps"] == [1, 2, 3]
    assert [row["scorer"] for row in out["scorers"]] == list(SCORERS)
    assert out["scorers"][0]["layer_spearman"] == pytest.approx(1.0)
    assert 0.0 <= out["cross_layer_jaccard"] <= 1.0
    assert set(out["by_layer"]) == set(SCORERS) and all(len(values) == 3 for values in out["by_layer"].values())
    assert out["by_layer"]["attention"][1] == pytest.approx(1.0)
    assert main(["scorers", "--model", "tiny-random-llama", "--prompt", prompt, "--layer", "9"]) == 2
    assert "layer must be between 0 and 2" in capsys.readouterr().err


@pytest.mark.parametrize("family", [f for f in kvviz.models.SUPPORTED_TYPES if f != "llama"])
def test_the_invariants_hold_on_every_supported_family(family):
    """The spectrum runs on every family and gives every layer a value; attention against itself and entropy
    weighting (a positive rescaling within a layer) rank exactly like attention there.  Whether the captured
    attention is each family's own (Granite's scale, fused QKV, experts) is test_engine's eager comparison."""
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    prompt_ids = tokenizer("The quick brown fox jumps over the lazy dog. The passkey is 71432. " * 3,
                           add_special_tokens=False)["input_ids"]
    profile = spectrum(model, prompt_ids, steps=2).layer_profile()
    np.testing.assert_allclose(profile["attention"], 1.0)
    np.testing.assert_allclose(profile["entropy"], 1.0)
