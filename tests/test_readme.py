"""The README's examples and docs/library.md's, run as written on the default model: each shows eviction at a
meaningful budget."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

import kvviz

pytestmark = pytest.mark.default_model

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
LIBRARY = (ROOT / "docs" / "library.md").read_text()


def library_blocks() -> list[str]:
    """The Python code blocks of the README's Library section, then those of docs/library.md, in order."""
    section = README.split("\n## Library\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section + LIBRARY, flags=re.S)


def test_the_first_cli_and_library_examples_keep_a_meaningful_budget(default_model):
    """Not the degenerate showcase of compression 0.9 on a 36-token prompt (3 tokens kept)."""
    _, tokenizer = default_model
    cli = re.search(r'kvviz generate --prompt "([^"]+)" --policy \S+ --compression ([\d.]+)', README)
    library = library_blocks()[0]
    run = re.search(r'prompt = "([^"]+)"\nresult = kvviz\.run\(.*compression=([\d.]+)\)\s+# budget (\d+) of (\d+)',
                    library)
    for prompt, compression in (cli.groups(), run.groups()[:2]):
        prompt_len = len(kvviz.encode_prompt(tokenizer, prompt))
        budget = kvviz.resolve_budget(prompt_len, compression=float(compression))
        assert budget >= 16 and budget < prompt_len
    prompt_len = len(kvviz.encode_prompt(tokenizer, run.group(1)))
    assert (int(run.group(3)), int(run.group(4))) == (kvviz.resolve_budget(prompt_len, compression=0.5), prompt_len)
    assert ".kept.tolist()" in library  # positions printed as a list, not a numpy repr


def test_the_attach_example_evicts_as_printed(default_model):
    """The ``model.generate`` example, verbatim: the model answers and the cache holds exactly the budget.

    Fed the raw prompt (no chat template), SmolLM2 answered with end-of-sequence at once and the example
    printed the whole uncompressed prompt as the kept set.
    """
    model, tokenizer = default_model
    code = library_blocks()[1]
    scope = {"kvviz": kvviz, "model": model, "tokenizer": tokenizer}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(code, scope)  # noqa: S102 -- the docs' own example
    cache, ids, out = scope["cache"], scope["ids"], scope["out"]
    kept = cache.events[-1].kept
    assert cache.budget < ids.shape[1] and kept.size == cache.budget
    assert out.shape[1] - ids.shape[1] > 1  # more than an immediate end-of-sequence
    answer, budget_line = printed.getvalue().splitlines()
    expected_answer = re.search(r"skip_special_tokens=True\)\)\s+# (.+)", code).group(1)
    assert answer == expected_answer
    assert budget_line.split(" ", 1)[0] == str(cache.budget) == re.search(r"# (\d+), and the", code).group(1)
