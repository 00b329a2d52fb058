"""The static decode path keeps exactly the reference engine's semantics (tokens and keep sets)."""

from __future__ import annotations

import pytest

import kvviz
from kvviz.fast import StaticInertia


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("refresh", [1, 4, 0])  # InertiaKV, InertiaKV-Lazy, Score-Free
def test_static_path_equals_the_reference_engine(family, refresh, tiny_prompt):
    model, tokenizer = kvviz.load_model(f"tiny-random-{family}")
    reference = kvviz.run(model, tokenizer, tiny_prompt, kvviz.make_policy("inertia", refresh=refresh),
                          budget=20, max_new_tokens=30)
    static = StaticInertia(model, refresh=refresh).generate(tokenizer, tiny_prompt, 20, 30, record_kept=True)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]


def test_static_path_with_another_alpha_differs_from_the_default(tiny, tiny_prompt):
    model, tokenizer = tiny
    default = StaticInertia(model).generate(tokenizer, tiny_prompt, 20, 20, record_kept=True)
    other = StaticInertia(model, alpha=0.0).generate(tokenizer, tiny_prompt, 20, 20, record_kept=True)
    reference = kvviz.run(model, tokenizer, tiny_prompt, "single-step", budget=20, max_new_tokens=20)
    assert other.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
    assert other.kept != default.kept  # the comparison above can tell rules apart


def test_static_path_without_scoring_is_a_sliding_window(tiny, tiny_prompt):
    model, tokenizer = tiny
    static = StaticInertia(model, scoring=False).generate(tokenizer, tiny_prompt, 20, 20, record_kept=True)
    reference = kvviz.run(model, tokenizer, tiny_prompt, "recency", budget=20, max_new_tokens=20)
    assert static.token_ids == reference.token_ids
    assert static.kept == [e.kept.tolist() for e in reference.trace.decode_steps]
