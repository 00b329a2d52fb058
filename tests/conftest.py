"""Shared fixtures: tiny random models (fast, no weights) and the real default model (converted once)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))

import kvviz  # noqa: E402

TEXT = ("The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. "
        "Grass is green, the sky is blue. What is the passkey? ")


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
