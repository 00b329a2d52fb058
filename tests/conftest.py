"""Shared fixtures: tiny random models (fast, no weights) and the real default model (converted once)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (`make test` runs one worker per core) each worker takes one thread: two one-thread
# processes do more on two cores than two two-thread ones fighting over them.
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else min(2, torch.get_num_threads()))

import kvviz  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. "
        "Grass is green, the sky is blue. What is the passkey? ")


# Files whose tests share one server, browser or cluster (a module fixture): one xdist worker runs each whole,
# so that it starts once.  Every other test goes wherever a worker is free.
SHARED_PER_FILE = {"test_app.py", "test_browser.py", "test_landing.py", "test_load_test.py", "test_sweep_ray.py"}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can see that the test it served failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SHARED_PER_FILE:
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


@pytest.fixture(scope="session")
def tiny():
    return kvviz.load_model("tiny-random-llama")


@pytest.fixture(scope="session")
def tiny_prompt(tiny):
    _, tokenizer = tiny
    return tokenizer(TEXT * 2, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def default_model():
    return kvviz.load_model()
