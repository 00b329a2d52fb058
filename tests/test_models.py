"""Which models kvviz accepts, and what each policy or path refuses on the families it cannot serve exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import kvviz
from kvviz.fast import StaticInertia
from kvviz.models import ModelNotFound, check_supported, tiny_model
from kvviz.scoring import rope_frequencies


def test_every_family_loads_by_its_tiny_name_with_the_capture_installed():
    for family in kvviz.models.SUPPORTED_TYPES:
        model, _ = kvviz.load_model(f"tiny-random-{family}")
        assert model.config.model_type == family
        assert model.config._attn_implementation == kvviz.scoring.ATTN_IMPLEMENTATION
    moe, _ = kvviz.load_model("tiny-random-qwen3_moe")
    assert type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"  # experts, not a dense MLP


def test_an_unsupported_family_is_refused_with_the_families_that_are():
    with pytest.raises(ModelNotFound, match="'gpt2' model; kvviz supports the model types llama, qwen2.*gemma"):
        check_supported(AutoConfig.for_model("gpt2"), "gpt2")
    with pytest.raises(ModelNotFound, match="no tiny model for 'gpt2'"):
        kvviz.load_model("tiny-random-gpt2")


def test_models_with_sliding_window_layers_are_refused():
    with pytest.raises(ModelNotFound, match="sliding-window attention \\(64\\)"):
        check_supported(AutoConfig.for_model("mistral", sliding_window=64), "m")
    # A window longer than the model's context passes the first rule; the layer types still say sliding.
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=1 << 20, max_window_layers=1,
                                  num_hidden_layers=3)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(ModelNotFound, match="sliding_attention layers"):
        check_supported(config, "q")
    check_supported(AutoConfig.for_model("qwen2", use_sliding_window=False, num_hidden_layers=3), "q")


@pytest.mark.parametrize("overrides, family", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "llama"),
    (dict(partial_rotary_factor=0.5), "phi3"),  # Phi-4-mini's layout: RoPE over part of each head
])
def test_expected_attention_refuses_rope_it_cannot_rotate_back(overrides, family, tiny_prompt):
    model, tokenizer = tiny_model(family, **overrides)
    kvviz.scoring.install(model)
    assert rope_frequencies(model) is None
    kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=40, max_new_tokens=3)  # the rest still runs
    with pytest.raises(ValueError, match="fixed frequencies.*choose another policy"):
        kvviz.run(model, tokenizer, tiny_prompt, "expected-attention", budget=40, max_new_tokens=3)


def test_fixed_frequency_rope_is_described_on_every_family():
    for family in kvviz.models.SUPPORTED_TYPES:
        model, _ = kvviz.load_model(f"tiny-random-{family}")
        rope = rope_frequencies(model)
        assert rope is not None and 2 * rope.numel() == model.config.head_dim
        theta = model.config.rope_parameters["rope_theta"]  # 1e6 for Mixtral, 1e4 for the others
        torch.testing.assert_close(rope[1] / rope[0], torch.tensor(theta ** (-2 / model.config.head_dim)))


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3", "gemma"])
def test_the_static_path_refuses_layouts_its_step_does_not_reproduce(family):
    model, _ = kvviz.load_model(f"tiny-random-{family}")
    with pytest.raises(ValueError, match=f"not '{family}': decode this model with the engine"):
        StaticInertia(model)
