"""Mistakes a new policy is likely to make, refused with what to change rather than run silently."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvviz
from kvviz.policies import REGISTRY, PolicySpec, by_name
from kvviz.policies.base import StepScorePolicy, param


# ------------------------------------------------------------------- mistakes refused, not run silently


@dataclass
class OneNumber(StepScorePolicy):
    def score(self, view, positions):
        return view.values.float().norm(dim=-1).mean()  # forgot dim=0: one number for the whole layer


def test_a_score_that_is_not_one_per_slot_is_refused_with_its_shape(tiny, tiny_prompt):
    """A scalar broadcast over the cache tied every entry, and the rule silently became recency."""
    model, tokenizer = tiny
    with pytest.raises(ValueError, match=r"OneNumber.score must return one score per cached slot, shape \(\d+,\); "
                                         r"it returned \(\)"):
        kvviz.run(model, tokenizer, tiny_prompt, OneNumber(), chat=False, budget=24, max_new_tokens=3)


def test_the_registry_refuses_a_class_without_its_own_dataclass_a_spaced_name_and_a_name_twice():
    class Undecorated(StepScorePolicy):  # its param() is a class attribute holding a Field, not a parameter
        order: float = param(2.0)

    with pytest.raises(TypeError, match="decorate Undecorated with @dataclass"):
        PolicySpec("undecorated", Undecorated, "U", "test", "d")
    with pytest.raises(TypeError, match="not a subclass of kvviz.policies.Policy"):
        PolicySpec("plain", dict, "P", "test", "d")
    with pytest.raises(ValueError, match="must be one word"):
        PolicySpec("value norm", OneNumber, "V", "test", "d")  # "value norm" would read as "value" + a parameter
    knorm = PolicySpec("knorm", OneNumber, "K", "test", "d")
    with pytest.raises(ValueError, match="two registry entries are named 'knorm'"):
        by_name([*REGISTRY.values(), knorm])  # a dict would have replaced the built-in knorm without a word
    assert list(by_name(list(REGISTRY.values()))) == list(REGISTRY)
