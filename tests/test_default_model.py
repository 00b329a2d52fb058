"""The real default model (SmolLM2-135M-Instruct): exactness against generate and eviction end to end."""

from __future__ import annotations

import pytest
import torch
from test_engine import masked_reference

import kvviz

pytestmark = pytest.mark.default_model

PROMPT = ("Here is a list of facts. The passkey is 7342519. The capital of Peru is Lima. Cats sleep a lot. "
          "Water boils at 100 degrees Celsius at sea level. What is the passkey? Answer briefly.")


def test_full_equals_generate_on_default_model(default_model):
    model, tokenizer = default_model
    ids = kvviz.encode_prompt(tokenizer, PROMPT)
    result = kvviz.run(model, tokenizer, ids, "full", max_new_tokens=32)
    expected = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False)[0, len(ids):].tolist()
    assert result.token_ids == expected


@pytest.mark.parametrize("policy", ["inertia", "inertia-lazy"])
def test_eviction_on_default_model_matches_masked_reference(default_model, policy):
    model, tokenizer = default_model
    ids = kvviz.encode_prompt(tokenizer, PROMPT)
    result = kvviz.run(model, tokenizer, ids, policy, compression=0.5, max_new_tokens=24)
    assert all(e.cache_size <= result.trace.budget for e in result.trace.decode_steps)
    assert result.token_ids == masked_reference(model, ids, result.trace)


def test_default_model_is_smollm2(default_model):
    model, tokenizer = default_model
    config = model.config
    assert (config.model_type, config.num_hidden_layers, config.num_attention_heads,
            config.num_key_value_heads, config.hidden_size) == ("llama", 30, 9, 3, 576)
    assert "Paris" in kvviz.run(model, tokenizer, "What is the capital of France?", "full", max_new_tokens=12).text


@pytest.mark.parametrize("name", sorted(kvviz.REGISTRY))
def test_every_policy_runs_from_the_cli_on_the_default_model(name, capsys, default_model, monkeypatch):
    import json

    from kvviz.cli import main
    from kvviz.model_names import DEFAULT_MODEL

    # The model the CLI names by default, loaded once (its loading is test_default_model_is_smollm2's): a fresh
    # load per policy was a third of this test's time.
    monkeypatch.setattr(kvviz.models, "load_model", lambda model, **kwargs: default_model if model == DEFAULT_MODEL
                        else pytest.fail(f"the CLI loaded {model!r}, not the default model"))

    budget = 48
    assert main(["generate", "--prompt", PROMPT * 2, "--policy", name, "--budget", str(budget),
                 "--max-new-tokens", "10", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    policy = kvviz.make_policy(name)
    assert out["budget"] == (None if name == "full" else budget) and len(out["token_ids"]) >= 1  # full holds none
    for step in out["steps"]:
        bound = policy.cache_bound(budget, step["step"])
        assert bound is None or len(step["kept"]) <= bound


def test_static_path_equals_the_engine_on_the_default_model(default_model):
    from kvviz.fast import StaticInertia

    model, tokenizer = default_model
    ids = kvviz.encode_prompt(tokenizer, PROMPT * 3)
    reference = kvviz.run(model, tokenizer, ids, "inertia", compression=0.9, max_new_tokens=16)
    static = StaticInertia(model).generate(tokenizer, ids, reference.trace.budget, 16, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
