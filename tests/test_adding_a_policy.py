"""docs/policies.md's "Adding a policy", run as written: its file and registry line make a policy that the registry,
the CLI and the engine's own checks take like any other, and that keeps what its docstring says.

Also the registry's and the base class's refusals of the mistakes a new policy is likely to make.
"""

from __future__ import annotations

import json
import re
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from conftest import TEXT

import kvviz
from kvviz.policies import REGISTRY, PolicySpec, by_name, make_policy
from kvviz.policies.base import StepScorePolicy, param

POLICIES_DOC = (Path(__file__).resolve().parent.parent / "docs" / "policies.md").read_text()
NAME = "value-norm"


def readme_example() -> tuple[str, str]:
    """The section's one Python block, split into the policy's file and its registry line."""
    section = POLICIES_DOC.split("\n## Adding a policy\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    file_part, sep, entry = block.partition("\nPolicySpec(")
    assert sep, "the example ends with its registry line, PolicySpec(...)"
    return file_part, "PolicySpec(" + entry


@pytest.fixture
def registered(monkeypatch):
    """The docs' policy class, its spec registered under its name for this test only."""
    file_part, entry = readme_example()
    module = types.ModuleType("kvviz_readme_value_norm")  # a module of its own, as the file would be
    monkeypatch.setitem(sys.modules, module.__name__, module)
    exec(compile(file_part, "docs/policies.md (Adding a policy)", "exec"), module.__dict__)  # noqa: S102
    spec = eval(entry, {**module.__dict__, "PolicySpec": PolicySpec})  # noqa: S307
    assert isinstance(spec, PolicySpec) and spec.name == NAME
    monkeypatch.setitem(REGISTRY, NAME, spec)
    return spec


def hand_scores(values: list[np.ndarray], order: float) -> np.ndarray:
    """Each slot's Lp value norm, averaged over KV heads, then over layers (float64, from the cache's values)."""
    per_layer = [(np.abs(v) ** order).sum(-1) ** (1 / order) for v in values]  # (heads, n) each
    return np.mean([norms.mean(0) for norms in per_layer], axis=0)


def test_the_readme_policy_keeps_the_top_b_by_value_norm_at_every_step(tiny, tiny_prompt, registered, monkeypatch):
    """Every decode step keeps exactly the B entries with the largest head- and layer-mean L3 value norm,
    computed here by hand from the values the cache held at that step."""
    model, tokenizer = tiny
    cls = registered.cls
    seen: list[tuple[int, np.ndarray, np.ndarray]] = []  # (layer, positions, values) per observed layer
    original = cls.score

    def recording(self, view, positions):
        seen.append((view.layer, positions.numpy().copy(), view.values.detach().double().numpy().copy()))
        return original(self, view, positions)

    monkeypatch.setattr(cls, "score", recording)
    policy = make_policy(NAME, order="3")  # as the CLI passes it: converted by the registry
    assert type(policy) is cls and policy.order == 3.0
    budget, layers = 24, model.config.num_hidden_layers
    events = kvviz.run(model, tokenizer, tiny_prompt, policy, chat=False, budget=budget, max_new_tokens=10).trace.events
    assert len(seen) == layers * (len(events) - 1)  # every layer of every decode step, nothing at the prefill
    assert events[0].kept.tolist() == list(range(len(tiny_prompt)))  # decode-time: the prefill evicts nothing
    not_oldest = 0
    for k, event in enumerate(events[1:]):
        step = seen[k * layers:(k + 1) * layers]
        assert [layer for layer, _, _ in step] == list(range(layers))
        positions = step[0][1]
        assert all(np.array_equal(p, positions) for _, p, _ in step)  # one slot order for all layers
        before = set(events[k].kept.tolist()) | {len(tiny_prompt) + event.step - 1}
        assert set(positions.tolist()) == before
        scores = hand_scores([values for _, _, values in step], 3.0)
        expected = set(positions[np.argsort(-scores)[:budget]].tolist())
        assert set(event.kept.tolist()) == expected, event.step
        evicted = before - expected
        not_oldest += evicted != set(sorted(before)[:len(evicted)])
    assert not_oldest  # the rule is not recency in disguise


def test_the_readme_policy_passes_the_engine_checks_every_registered_name_gets(tiny, tiny_prompt, registered):
    from test_engine import check_policy_run

    check_policy_run(*tiny, tiny_prompt, NAME, max_new_tokens=12)


def test_the_cli_lists_and_runs_the_readme_policy(registered, capsys):
    from kvviz.cli import main

    assert main(["policies", "--json"]) == 0
    listed = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
    (order,) = listed[NAME]["parameters"]
    assert (order["name"], order["default"], order["low"], order["high"]) == ("order", 2.0, 1.0, 8.0)
    assert main(["generate", "--model", "tiny-random-llama", "--prompt", TEXT, "--no-chat", "--policy", NAME,
                 "--param", "order=1", "--budget", "8", "--max-new-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["budget"] == 8 and all(len(step["kept"]) == 8 for step in out["steps"])


def test_a_sweep_config_takes_the_readme_policy_and_its_parameter(registered):
    from kvviz.bench.sweep import policy_settings, validate

    config = {"name": "t", "model": "tiny-random-llama", "max_new_tokens": 4, "compression": [0.5],
              "tasks": [{"name": "single_needle", "length": 220, "samples": 1}],
              "policies": [{"name": NAME, "params": {"order": [1.0, 2.0]}}]}
    validate(config)
    assert [make_policy(name, **dict(params)).order for name, params in policy_settings(config)] == [1.0, 2.0]
    with pytest.raises(ValueError, match="order must be between 1.0 and 8.0"):
        validate({**config, "policies": [{"name": NAME, "params": {"order": [9.0]}}]})


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
