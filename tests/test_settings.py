"""kvviz.settings: what a run may be asked for, decided in one place.  The boundaries are hand-computed; the
last tests check that the command line, a sweep config and the app refuse the same bad value in the same
words, so that no front end keeps a check of its own."""

import dataclasses
import math

import pytest

from kvviz import settings
from kvviz.settings import APP_NAMES, CLI_NAMES, Bounds, SettingError, Settings


@pytest.mark.parametrize("value", [0, 0.0, 0.5, 0.99, 1 - 1e-12])
def test_a_compression_in_zero_to_one_is_accepted(value):
    assert settings.compression(value) == float(value)


@pytest.mark.parametrize("value, shown", [(1, "1"), (1.0, "1.0"), (-0.1, "-0.1"), (math.nan, "nan"),
                                          (math.inf, "inf"), ("0.5", "'0.5'"), (True, "True"), (None, "None")])
def test_a_compression_outside_zero_to_one_is_refused_saying_the_range(value, shown):
    with pytest.raises(SettingError, match=rf"^compression must be in \[0, 1\), got {shown}$") as refusal:
        settings.compression(value)
    assert refusal.value.field == "compression" and refusal.value.rule == f"must be in [0, 1), got {shown}"


@pytest.mark.parametrize("value, message", [(0, "must be at least 1, got 0"), (-3, "must be at least 1, got -3"),
                                            (12.5, "must be a whole number, got 12.5"),
                                            (math.nan, "must be a whole number, got nan"),
                                            (True, "must be a whole number, got True")])
def test_a_budget_is_a_whole_number_of_at_least_one_token(value, message):
    assert settings.budget(1) == 1 and settings.budget(12.0) == 12  # 12.0 is twelve tokens
    with pytest.raises(SettingError, match=f"^budget {message}$"):
        settings.budget(value)


@pytest.mark.parametrize("value", [0.0, 1.0, 1.5, 1e-30, 0.5])
def test_a_temperature_of_zero_or_more_is_accepted(value):
    assert settings.temperature(value) == value


@pytest.mark.parametrize("value, shown", [(-0.1, "-0.1"), (math.nan, "nan"), (math.inf, "inf"), ("hot", "'hot'")])
def test_a_negative_or_not_finite_temperature_is_refused(value, shown):
    with pytest.raises(SettingError, match=rf"^temperature must be a number >= 0 \(0: greedy\), got {shown}$"):
        settings.temperature(value)


def test_a_deployment_bound_on_temperature_is_told_as_a_range():
    assert settings.temperature(2.0, most=2.0) == 2.0
    for value in (2.5, -1.0, math.nan):
        with pytest.raises(SettingError, match=r"must be between 0 \(greedy\) and 2, got"):
            settings.temperature(value, most=2.0)


@pytest.mark.parametrize("value, ok", [(1e-9, True), (0.5, True), (1, True), (1.0, True), (0, False), (0.0, False),
                                       (-0.5, False), (1.0000001, False), (math.nan, False), (None, False)])
def test_top_p_is_above_zero_and_at_most_one(value, ok):
    if ok:
        assert settings.top_p(value) == float(value)
        return
    with pytest.raises(SettingError, match=r"^top_p must be above 0 and at most 1, got "):
        settings.top_p(value)


def test_seed_and_max_new_tokens():
    assert settings.seed(-4) == -4 and settings.seed(7.0) == 7  # torch takes any whole seed
    with pytest.raises(SettingError, match=r"^seed must be between 0 and 10, got 11$"):
        settings.seed(11, most=10)
    with pytest.raises(SettingError, match=r"^seed must be a whole number, got 0.5$"):
        settings.seed(0.5)
    assert settings.max_new_tokens(1) == 1
    with pytest.raises(SettingError, match=r"^max_new_tokens must be at least 1, got 0$"):
        settings.max_new_tokens(0)
    with pytest.raises(SettingError, match=r"^max new tokens must be between 1 and 30, got 31$"):
        settings.max_new_tokens(31, "max new tokens", most=30)


@pytest.mark.parametrize("prompt_len, kwargs, expected", [
    (100, dict(compression=0.9), 10),  # (1 - 0.9) * 100 = 9.999999999999998 floors to 10, not 9
    (57, dict(compression=0.5), 28), (6, dict(compression=0.83), 1), (10, dict(budget=3), 3),
    (10, dict(budget=300), 300),  # a budget over the prompt: eviction starts once generation fills it
    (10, {}, 10), (30, dict(compression=0), 30)])
def test_the_budget_a_prompt_gets(prompt_len, kwargs, expected):
    assert settings.resolve_budget(prompt_len, **kwargs) == expected
    assert Settings(**kwargs).budget_for(prompt_len) == expected


def test_a_compression_that_leaves_no_cache_names_one_that_does():
    # floor(0.1 * 6) = 0; the largest two-place ratio that leaves one entry of 6: 0.83 (0.17 * 6 = 1.02)
    assert settings.largest_compression(6, 1) == 0.83 and settings.largest_compression(5, 9) is None
    with pytest.raises(ValueError, match="^compression 0.9 leaves no cache for a 6-token prompt; lower it to 0.83"):
        settings.resolve_budget(6, compression=0.9)


def test_settings_are_frozen_checked_when_made_and_record_their_sampling():
    asked = Settings(compression=0.5, temperature=0.6, top_p=0.95, seed=3, max_new_tokens=8)
    assert asked.sampling == {"temperature": 0.6, "top_p": 0.95, "seed": 3} and not asked.greedy
    assert Settings(top_p=0.5, seed=9).sampling == {}  # greedy: top_p and seed change nothing
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.budget = 3
    with pytest.raises(ValueError, match="give either a compression ratio or an absolute budget, not both"):
        Settings(compression=0.5, budget=10)
    with pytest.raises(SettingError, match=r"^--top-p must be above 0 and at most 1, got 0.0$"):
        Settings(temperature=1.0, top_p=0.0, names=CLI_NAMES)
    with pytest.raises(SettingError, match=r"^temperature must be between 0 \(greedy\) and 2, got 3.0$"):
        Settings(temperature=3.0, names=APP_NAMES, bounds=Bounds(temperature=2.0))
    assert Settings(budget=12.0).budget == 12  # the checked value replaces the given one
    assert Settings(budget=5, names=CLI_NAMES) == Settings(budget=5)  # names and bounds are not the value


def test_a_trace_records_the_settings_it_ran_under():
    import numpy as np

    from kvviz.trace import StepEvent, Trace

    asked = Settings(compression=0.5, temperature=0.7, top_p=0.9, seed=5, max_new_tokens=4)
    event = StepEvent(0, -1, 7, "x", np.arange(2), np.array([], dtype=np.int64))
    trace = Trace.from_run(asked, [1, 2, 3, 4], 2, "tova", {}, [event], model="m", dtype="float32", prompt="p",
                           chat=True)
    assert (trace.sampling, trace.max_new_tokens, trace.compression, trace.budget) == (asked.sampling, 4, 0.5, 2)
    trace.check()


# -- one place decides: every front end refuses the same value in the same words ----------------------------

SWEEP = {"name": "one-place", "model": "tiny-random-llama", "compression": [0.5],
         "tasks": [{"name": "single_needle", "length": 200, "samples": 1}], "policies": ["full", "recency"]}


def _cli_refusal(capsys, *options) -> str:
    from kvviz.cli import main

    assert main(["generate", "--model", "tiny-random-llama", "--prompt", "hi", *options]) == 2
    return capsys.readouterr().err.removeprefix("kvviz: error: ").strip()


def _sweep_refusal(**changes) -> str:
    from kvviz.bench.sweep import validate

    with pytest.raises(ValueError) as refusal:
        validate({**SWEEP, **changes}, "'one-place'")
    return str(refusal.value).removeprefix("sweep config 'one-place': ")


def _app_refusal(monkeypatch, budget_mode="compression", compression=0.5, budget=20, temperature=0.0,
                 top_p=1.0) -> str:
    from kvviz import make_policy
    from kvviz.ui import checks
    from kvviz.ui.config import Limits

    def no_load(*args):
        raise AssertionError("the model was loaded before a check that needs none")

    monkeypatch.setattr(checks, "get_model", no_load)
    limits = Limits(models=("not-loaded",), max_prompt_tokens=400, max_new_tokens=16)
    with pytest.raises(ValueError) as refusal:
        checks.validate(limits, "not-loaded", "a prompt", budget_mode, compression, budget, 8, False,
                        [make_policy("tova")], temperature, top_p, 0)
    return str(refusal.value)


def test_a_compression_of_one_is_refused_alike_everywhere(capsys, monkeypatch):
    rule = "must be in [0, 1), got 1.0"
    assert _cli_refusal(capsys, "--compression", "1.0") == f"--compression {rule}"
    assert _sweep_refusal(compression=[0.5, 1.0]) == f"key 'compression': each ratio {rule}"
    assert _app_refusal(monkeypatch, compression=1.0) == f"compression {rule}"
    with pytest.raises(ValueError, match=rf"^compression {rule.replace('[', '.').replace(')', '.')}$"):
        __import__("kvviz").resolve_budget(10, compression=1.0)


def test_a_top_p_of_zero_is_refused_alike_everywhere(capsys, monkeypatch):
    rule = "must be above 0 and at most 1, got 0.0"
    assert _cli_refusal(capsys, "--temperature", "0.5", "--top-p", "0") == f"--top-p {rule}"
    assert _sweep_refusal(temperature=0.5, top_p=0.0) == f"key 'top_p': {rule}"
    assert _app_refusal(monkeypatch, temperature=0.5, top_p=0.0) == f"top-p {rule}"
    from kvviz.engine import Sampler

    with pytest.raises(ValueError, match=f"^top_p {rule}$"):
        Sampler(0.5, 0.0)


def test_a_budget_of_zero_is_refused_alike_everywhere(capsys, monkeypatch):
    rule = "must be at least 1, got 0"
    assert _cli_refusal(capsys, "--budget", "0") == f"--budget {rule}"
    assert _sweep_refusal(budget=[0]) == f"key 'budget': each budget {rule}"
    assert _app_refusal(monkeypatch, budget_mode="budget", budget=0) == f"the budget {rule}"


def test_a_negative_temperature_is_refused_alike_by_the_library_the_cli_and_a_sweep(capsys):
    rule = "must be a number >= 0 (0: greedy), got -0.5"
    assert _cli_refusal(capsys, "--temperature", "-0.5") == f"--temperature {rule}"
    assert _sweep_refusal(temperature=-0.5) == f"key 'temperature': {rule}"
    with pytest.raises(ValueError) as refusal:
        Settings(temperature=-0.5)
    assert str(refusal.value) == f"temperature {rule}"
