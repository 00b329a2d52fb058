"""The app's first view: the shipped comparison is the passkey example, its traces are sound, and what it
says of each policy follows from them."""

from __future__ import annotations

import json

import pytest

import kvviz
from kvviz.tasks.examples import EXAMPLES, KEYS, PASSKEY
from kvviz.ui.config import Limits
from kvviz.ui.landing import FOLDER, load_landing
from kvviz.ui.live import LIVE_COMPRESSION


@pytest.fixture(scope="module")
def landing():
    return load_landing()


def test_the_shipped_comparison_is_the_live_examples_prompt(landing):
    manifest = json.loads((FOLDER / "landing.json").read_text())
    assert landing.prompt == EXAMPLES["Passkey in a haystack"] and landing.needle == PASSKEY
    for trace in landing.traces.values():  # within what the app itself opens
        assert trace.prompt == landing.prompt and trace.compression == manifest["compression"]
        assert kvviz.Trace.load(FOLDER / manifest["traces"][trace.policy], Limits().trace_bounds()).token_ids == \
            trace.token_ids


def test_it_shows_one_policy_keeping_the_answer_and_another_losing_it(landing):
    assert PASSKEY in landing.full_answer
    right = {label: PASSKEY in landing.answer(label) for label in landing.traces}
    assert any(right.values()) and not all(right.values())
    summary = landing.summary()
    for label, ok in right.items():
        assert f"**{landing.display(label)}** kept" in summary
        assert f"`{landing.answer(label)}`: {'right' if ok else 'wrong'}" in summary


def test_the_red_columns_are_the_passkeys_tokens(landing):
    """Found independently: the character spans of the passkey in the joined token texts, mapped to tokens."""
    text, starts = "", []
    for token in landing.tokens:
        starts.append(len(text))
        text += token
    spans = [(at, at + len(PASSKEY)) for at in range(len(text)) if text.startswith(PASSKEY, at)]
    expected = sorted({i for begin, end in spans for i, start in enumerate(starts)
                       if start < end and start + len(landing.tokens[i]) > begin})
    assert len(spans) == 2 and landing.needle_positions == expected
    for label, trace in landing.traces.items():
        last = set(trace.events[-1].kept.tolist())
        assert landing.kept_at_end(label) == sum(p in last for p in expected)


def test_without_its_files_the_app_opens_on_the_live_tab(tmp_path):
    assert load_landing(tmp_path) is None


@pytest.mark.default_model
def test_the_examples_are_answered_right_by_the_full_cache(default_model):
    """An example whose full cache is wrong cannot show eviction changing an answer."""
    model, tokenizer = default_model
    passkey = kvviz.run(model, tokenizer, EXAMPLES["Passkey in a haystack"], "full", max_new_tokens=12)
    assert PASSKEY in passkey.text
    candle = kvviz.run(model, tokenizer, EXAMPLES["Four-key needle"], "full", max_new_tokens=16)
    assert str(KEYS["candle"]) in candle.text
    reasoning = kvviz.run(model, tokenizer, EXAMPLES["Short reasoning"], "full", max_new_tokens=160)
    assert "12" in reasoning.text  # 6 apples doubled
    live = kvviz.run(model, tokenizer, EXAMPLES["Passkey in a haystack"], "inertia", compression=LIVE_COMPRESSION,
                     max_new_tokens=12)  # the Live tab's default policy at its default compression
    assert PASSKEY in live.text
