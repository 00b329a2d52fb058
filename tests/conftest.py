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


# Module fixtures that start or build something slow (a server, a browser, a Ray cluster, the shipped store's
# figures): the tests that use one run on one xdist worker, so that it is made once.  Every other test goes
# wherever a worker is free.
SHARED_FIXTURES = {"client", "app_url", "shared_page", "load_test", "local_cluster", "shipped_query"}


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the test item, so a fixture can see that the test it served failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


# First: xdist's own hook reads the marker to group the tests, so it must be on them before that runs.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SHARED_FIXTURES & set(item.fixturenames):
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



SHIPPED_FIGURES: dict = {}  # kept by the worker process: xdist interleaves modules, which resets module fixtures


@pytest.fixture
def shipped_query():
    """:func:`kvviz.ui.results.query` of the shipped store, all models, under ``source`` and the other filters
    given, each combination built once per worker (10-15 s each on a 2-core machine; tests only read it)."""
    from kvviz.store import Store
    from kvviz.ui.results import query

    def drawn(source: str, task: str = "(all)", settings: bool = False, every: bool = False) -> tuple:
        key = (source, task, settings, every)
        if key not in SHIPPED_FIGURES:
            SHIPPED_FIGURES[key] = query(Store(), "(all)", task, [], source, settings=settings, every=every)
        return SHIPPED_FIGURES[key]

    return drawn
