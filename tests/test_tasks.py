"""Task generators (offline, seeded) and metrics on hand-worked examples; loaders on local fixtures."""

from __future__ import annotations

import re
import sys
import types
import zipfile
from pathlib import Path

import pytest

from kvviz.engine import encode_prompt
from kvviz.tasks import TASKS, loaders, needle_grid
from kvviz.tasks.loaders import from_records, longbench, read_jsonl
from kvviz.tasks.metrics import (
    edit_similarity,
    exact_match,
    last_boxed,
    math_equal,
    rouge_l_f,
    string_match,
    token_f1,
    whole_match,
)
from kvviz.tasks.synthetic import SHORT_PROMPT_TASKS

FIXTURES = Path(__file__).parent / "fixtures"


def test_string_match_is_the_share_of_gold_values_found():
    found = string_match("The numbers are 1234567 and 7654321.", ["1234567", "7654321", "1111111"])
    assert found == pytest.approx(2 / 3)
    assert string_match("APPLE", ["apple"]) == 1.0


def test_whole_match_refuses_an_answer_run_on_into_a_longer_one():
    assert string_match(" 647894231.", ["6478942"]) == 1.0  # RULER's substring credit
    assert whole_match(" 647894231.", ["6478942"]) == 0.0
    assert whole_match(" 6478942.\n\nWhat", ["6478942"]) == 1.0
    assert whole_match("16478942", ["6478942"]) == 0.0
    assert whole_match("are 1234567, 7654321", ["1234567", "7654321", "1111111"]) == pytest.approx(2 / 3)
    assert whole_match(" Wynenmoor.", ["wynenmoor"]) == 1.0 and whole_match(" Wynenmoors", ["Wynenmoor"]) == 0.0


def test_exact_match_normalises_case_punctuation_and_articles():
    assert exact_match("The Lima.", ["lima"]) == 1.0
    assert exact_match("Lima, Peru", ["Lima"]) == 0.0


def test_rouge_l_and_token_f1_by_hand():
    # pred "sit in the park" -> [sit, in, park]; gold "eat and sit in park" -> [eat, and, sit, in, park]
    # LCS = 3 (sit in park): P = 3/3, R = 3/5 -> F = 2*1*.6/1.6 = .75
    assert rouge_l_f("sit in the park", ["eat and sit in park"]) == pytest.approx(0.75)
    # token F1 on "park sit" vs "sit in park": common 2, P = 1, R = 2/3 -> .8 (order does not matter)
    assert token_f1("park sit", ["sit in park"]) == pytest.approx(0.8)
    assert rouge_l_f("park sit", ["sit in park"]) == pytest.approx(0.4)  # LCS 1: P .5, R 1/3 -> .4


def test_math_answer_extraction_and_normalisation():
    assert last_boxed(r"so \boxed{\frac{3}{4}} and finally \boxed{\dfrac{3}{4}}") == r"\dfrac{3}{4}"
    assert math_equal(r"The answer is \boxed{\dfrac{3}{4}}.", [r"\frac{3}{4}"]) == 1.0
    assert math_equal(r"\boxed{1,234}", ["1234"]) == 1.0
    assert math_equal("so it is 12.0", ["12"]) == 1.0
    assert math_equal(r"\boxed{5}", ["6"]) == 0.0


def test_edit_similarity_skips_comment_lines():
    assert edit_similarity("# comment\nreturn x + 1\nmore", ["return x + 1"]) == 1.0


@pytest.mark.parametrize("name", sorted(set(TASKS) - set(SHORT_PROMPT_TASKS)))
def test_generators_hit_the_length_embed_the_answers_and_are_seeded(name, tiny):
    _, tokenizer = tiny
    generate = TASKS[name]
    sample = generate(tokenizer, 600, seed=3)
    length = len(encode_prompt(tokenizer, sample.prompt))
    assert 450 <= length <= 600
    for answer in sample.answers:
        assert answer in sample.prompt
    assert generate(tokenizer, 600, seed=3).prompt == sample.prompt
    assert generate(tokenizer, 600, seed=4).prompt != sample.prompt
    # RULER's metric counts the share of answers found: all, all but one, none.
    answers = sample.answers
    assert string_match(" ".join(answers).upper(), answers) == 1.0
    if len(answers) > 1:
        assert string_match(" ".join(answers[1:]), answers) == pytest.approx((len(answers) - 1) / len(answers))
    assert string_match("no digits here", answers) == 0.0


@pytest.mark.parametrize("name", sorted(set(TASKS) - set(SHORT_PROMPT_TASKS)) + ["needle_grid"])
@pytest.mark.parametrize("chat", [True, False])
def test_a_length_below_the_prompt_without_filler_is_refused_with_the_least_that_fits(name, chat, tiny):
    """The least length the refusal names is the boundary: that length gives a prompt within it (the task's
    text and no filler), one token less is refused; nothing longer than asked for is ever returned."""
    import re

    _, tokenizer = tiny

    def generate(length):
        if name == "needle_grid":
            return needle_grid(tokenizer, [length], [0.5], seed=3, chat=chat)[0]
        return TASKS[name](tokenizer, length, seed=3, chat=chat)

    with pytest.raises(ValueError, match="takes with no filler at all") as refusal:
        generate(20)
    least = int(re.search(r"set the length to (\d+) or more", str(refusal.value)).group(1))
    assert ("with the chat template" if chat else "without the chat template") in str(refusal.value)
    assert len(encode_prompt(tokenizer, generate(least).prompt, chat=chat)) == least
    with pytest.raises(ValueError, match=f"set the length to {least} or more"):
        generate(least - 1)


def test_multi_key_has_distractors_and_prose_haystack_varies(tiny):
    _, tokenizer = tiny
    sample = TASKS["multi_key_needle"](tokenizer, 800, seed=1, haystack="prose")
    assert len(sample.meta["distractors"]) == 3 and all(d in sample.prompt for d in sample.meta["distractors"])
    sentences = [s for s in sample.prompt.split(". ") if s]
    assert len(set(sentences)) > len(sentences) // 2  # procedurally varied, not one repeated sentence


def test_needle_grid_covers_lengths_and_depths(tiny):
    _, tokenizer = tiny
    grid = needle_grid(tokenizer, [300, 600], [0.0, 0.5, 1.0])
    assert [(s.meta["length"], s.meta["depth"]) for s in grid] == [(length, d) for length in (300, 600)
                                                                   for d in (0.0, 0.5, 1.0)]
    first, last = grid[0].prompt, grid[2].prompt
    assert first.index("San Francisco is eat") < last.index("San Francisco is eat")
    assert all(s.metric == "rouge_l" for s in grid)


def test_loaders_on_local_fixtures():
    hotpot = from_records("longbench", read_jsonl(FIXTURES / "longbench_hotpotqa.jsonl"), task="hotpotqa")
    assert len(hotpot) == 2 and hotpot[0].metric == "token_f1" and "Question: Whose company" in hotpot[0].prompt
    # "gustave eiffels company" (the apostrophe goes) vs "gustave eiffel": 1 common of 3 and 2 -> F = .4
    assert token_f1("Gustave Eiffel's company", hotpot[0].answers) == pytest.approx(0.4)
    v2 = from_records("longbench_v2", read_jsonl(FIXTURES / "longbench_v2.jsonl"))
    assert v2[0].answers == ["(B)"] and "(C) 20%" in v2[0].prompt
    assert string_match("The correct answer is (B).", v2[0].answers) == 1.0
    math = from_records("math500", read_jsonl(FIXTURES / "math500.jsonl"))
    assert math[0].metric == "math" and r"\boxed{}" in math[0].prompt
    assert math_equal(r"\boxed{\dfrac{3}{4}}", math[0].answers) == 1.0
    with pytest.raises(ValueError, match="unknown"):
        from_records("nope", [])


@pytest.mark.parametrize("lines, message", [
    (['{"foo": 1}'], r"junk.jsonl line 1: missing fields 'context', 'input', 'answers' "
                     r"\(LongBench records need context, input, answers\)"),
    (['{"context": "c", "input": "q", "answers": ["a"]}', "", '{"context": "c", "answers": ["a"]}'],
     "junk.jsonl line 3: missing field 'input' "),  # blank lines still count
    (['{"context": "c", "input": "q", "answers": ["a"]}', "not json"],
     r"junk.jsonl line 2: not valid JSON \(Expecting value at column 1\)"),
    (['["context", "input"]'], "junk.jsonl line 1: a record must be a JSON object"),
    (['{"context": "c", "input": "q", "answers": "Paris"}'], "junk.jsonl line 1: field 'answers' must be a list"),
])
def test_a_malformed_local_benchmark_file_names_file_line_and_field(lines, message, tmp_path):
    junk = tmp_path / "junk.jsonl"
    junk.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=message):
        from_records("longbench", read_jsonl(junk), task="hotpotqa")


def test_records_from_elsewhere_are_named_by_index_and_other_benchmarks_are_checked():
    with pytest.raises(ValueError, match=r"record 2: missing field 'answer' \(MATH-500 records need problem, answer\)"):
        from_records("math500", [{"problem": "1+1", "answer": "2"}, {"problem": "2+2"}])
    with pytest.raises(ValueError, match="record 1: missing fields 'choice_C', 'choice_D'"):
        from_records("longbench_v2", [{"context": "", "question": "", "choice_A": "", "choice_B": "", "answer": "A"}])
    with pytest.raises(ValueError, match="cannot read .*nowhere.jsonl"):
        read_jsonl("/nonexistent/nowhere.jsonl")


def test_longbench_prompts_are_documented_as_one_generic_template():
    """Scores on these prompts must not be read as LongBench's: the docstring and docs/sweeps.md say so."""
    readme = (Path(__file__).resolve().parent.parent / "docs" / "sweeps.md").read_text()
    assert "generic prompt template" in longbench.__doc__ and "not LongBench's per-task templates" in longbench.__doc__
    assert "not comparable with the numbers LongBench papers report" in " ".join(readme.split())
    sample = longbench([{"context": "C", "input": "Q", "answers": ["A"]}], "hotpotqa")[0]
    assert sample.prompt == "C\n\nQuestion: Q\nAnswer:"


class FakeRows(list):
    """What ``datasets.load_dataset`` returns, as far as :func:`loaders.load` uses it."""

    def select(self, indices):
        return FakeRows(self[i] for i in indices)


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """The hub, offline: ``datasets.load_dataset`` and ``huggingface_hub.hf_hub_download`` record how they were
    called and answer from the fixtures (LongBench's data.zip holds the hotpotqa fixture)."""
    calls = []
    records = {"longbench_v2": read_jsonl(FIXTURES / "longbench_v2.jsonl"),
               "ruler": [{"context": "The key is 42.", "question": "What is the key?", "answer": ["42"]}],
               "math500": read_jsonl(FIXTURES / "math500.jsonl"), "aime25": read_jsonl(FIXTURES / "math500.jsonl")}
    by_repo = {loaders.HUB[kind]: rows for kind, rows in records.items()}

    def load_dataset(*args, **kwargs):
        calls.append(("load_dataset", args, kwargs))
        assert "trust_remote_code" not in kwargs, f"{args[0]} asked to run the dataset's code"
        return FakeRows(by_repo[args[0]])

    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as bundle:
        bundle.write(FIXTURES / "longbench_hotpotqa.jsonl", "data/hotpotqa.jsonl")

    def hf_hub_download(*args, **kwargs):
        calls.append(("hf_hub_download", args, kwargs))
        return str(archive)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    monkeypatch.setattr("huggingface_hub.hf_hub_download", hf_hub_download)
    return calls


def test_no_benchmark_is_loaded_with_remote_code(hub):
    """Every benchmark loads from data files: nothing asks the hub for code (``trust_remote_code``)."""
    for kind in loaders.HUB:
        assert loaders.load(kind, task="hotpotqa" if kind == "longbench" else "", limit=1)
    assert {call[0] for call in hub} == {"load_dataset", "hf_hub_download"}
    assert all("trust_remote_code" not in kwargs for _, _, kwargs in hub)
    # LongBench is its repository's data.zip, a plain file, never the loading script beside it
    assert [call for call in hub if call[0] == "hf_hub_download"] == [
        ("hf_hub_download", ("THUDM/LongBench", "data.zip"), {"repo_type": "dataset"})]


def test_no_source_file_trusts_remote_code():
    root = Path(__file__).resolve().parent.parent
    trusting = re.compile(r"trust_remote_code\W{0,4}(True|1\b)")
    sources = [root / "app.py", *sorted((root / "kvviz").rglob("*.py")), *sorted((root / "benchmarks").rglob("*.py"))]
    offenders = [f"{path.relative_to(root)}:{number}" for path in sources
                 for number, line in enumerate(path.read_text().splitlines(), start=1) if trusting.search(line)]
    assert offenders == []


def test_longbench_from_the_hub_reads_the_same_records_as_the_local_route(hub):
    local = from_records("longbench", read_jsonl(FIXTURES / "longbench_hotpotqa.jsonl"), task="hotpotqa")
    assert loaders.load("longbench", "hotpotqa") == local
    assert loaders.load("longbench", "hotpotqa", limit=1) == local[:1]


def test_longbench_that_cannot_be_fetched_or_read_says_what_to_do_instead(hub, monkeypatch, tmp_path):
    def offline(*args, **kwargs):
        raise OSError("We have no connection")

    with pytest.raises(ValueError, match="unknown LongBench task 'nope'"):
        loaders.load("longbench", "nope")
    with pytest.raises(ValueError, match="only a test split"):
        loaders.load("longbench", "hotpotqa", split="train")
    with pytest.raises(ValueError, match=r"data.zip has no data/qasper.jsonl; it holds hotpotqa"):
        loaders.load("longbench", "qasper")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", offline)
    with pytest.raises(ValueError) as refused:
        loaders.load("longbench", "hotpotqa")
    assert str(refused.value) == (
        "cannot download https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip (We have no "
        "connection); download https://huggingface.co/datasets/THUDM/LongBench/resolve/main/data.zip, unzip it "
        'and give the task\'s file to the sweep as { name = "longbench", task = "hotpotqa", path = '
        '"data/hotpotqa.jsonl" }')
    broken = tmp_path / "broken.zip"
    broken.write_text("not a zip")
    monkeypatch.setattr("huggingface_hub.hf_hub_download", lambda *args, **kwargs: str(broken))
    with pytest.raises(ValueError, match=r"cannot read .*broken.zip as a zip archive .*; download https://"):
        loaders.load("longbench", "hotpotqa")


def recompute(meta: dict) -> int:
    """The answer of an arithmetic_reasoning problem from its meta, without the generator's own code."""
    count = sum(meta["groups"])
    for operation, operand in meta["operations"]:
        count = {"add": count + operand, "subtract": count - operand, "multiply": count * operand,
                 "divide": count // operand}[operation]
    return count


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_arithmetic_reasoning_is_seeded_and_its_answer_follows_from_its_meta(steps, tiny):
    _, tokenizer = tiny
    generate = TASKS["arithmetic_reasoning"]
    samples = [generate(tokenizer, None, seed, steps=steps) for seed in range(30)]
    assert [generate(tokenizer, None, seed, steps=steps).prompt for seed in range(30)] == [s.prompt for s in samples]
    assert len({s.prompt for s in samples}) > 25  # seeds differ
    for sample in samples:
        assert sample.metric == "math" and len(sample.meta["operations"]) == steps - 1
        assert sample.answers == [str(recompute(sample.meta))]
        # every intermediate count stays a whole number in 1..200 (a division is exact)
        count = sum(sample.meta["groups"])
        for operation, operand in sample.meta["operations"]:
            assert operation != "divide" or count % operand == 0
            count = recompute({"groups": [count], "operations": [[operation, operand]]})
            assert 1 <= count <= 200
        # the problem states its numbers; the prompt asks for reasoning and a boxed answer
        assert all(str(n) in sample.prompt for n in sample.meta["groups"])
        assert sample.prompt.endswith("put your final answer within \\boxed{}.")
    used = {operation for s in samples for operation, _ in s.meta["operations"]}
    assert used == (set() if steps == 1 else {"add", "subtract", "multiply", "divide"})


def test_arithmetic_reasoning_length_is_an_upper_bound_and_steps_are_checked(tiny):
    _, tokenizer = tiny
    generate = TASKS["arithmetic_reasoning"]
    sample = generate(tokenizer, None, 3)
    length = len(encode_prompt(tokenizer, sample.prompt))
    assert generate(tokenizer, length, 3).prompt == sample.prompt  # a bound, not a target: nothing is padded
    with pytest.raises(ValueError, match=rf"takes {length} tokens, over the length {length - 1}; raise the length"):
        generate(tokenizer, length - 1, 3)
    with pytest.raises(ValueError, match="steps must be at least 1"):
        generate(tokenizer, None, 3, steps=0)


def test_math_metric_scores_arithmetic_answers(tiny):
    _, tokenizer = tiny
    sample = TASKS["arithmetic_reasoning"](tokenizer, None, 7, steps=3)
    right, wrong = sample.answers[0], str(int(sample.answers[0]) + 1)
    assert math_equal(f"3 + 4 = 7, so the answer is \\boxed{{{right}}}.", sample.answers) == 1.0
    assert math_equal(f"\\boxed{{{wrong}}}", sample.answers) == 0.0
    # a box wins over a later number; without one (or with the instruction's empty box) the last number counts
    assert math_equal(f"\\boxed{{{wrong}}} since {right} is wrong", sample.answers) == 0.0
    assert math_equal(f"So, the final answer is {right}.", sample.answers) == 1.0
    echoed = f"So, the final answer is {right}. The final answer is within \\boxed{{}}."
    assert math_equal(echoed, sample.answers) == 1.0
    assert math_equal(f"So, the final answer is {wrong}.", sample.answers) == 0.0
    assert math_equal("no number at all", sample.answers) == 0.0


def test_the_benchmarks_read_the_apps_example_prompts_without_loading_the_ui():
    """The rank-stability benchmark runs on the Live tab's examples: it imported them from the app, and so
    loaded Gradio and Plotly to read four strings."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    # a fresh interpreter for what reading them loads; the app (seconds to import) is compared in this one
    code = "import sys; sys.path.insert(0, 'benchmarks'); import rank_stability; print('gradio' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.stdout.split() == ["False"], proc.stderr
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        import rank_stability
    finally:
        sys.path.remove(str(root / "benchmarks"))
    from kvviz.tasks.examples import EXAMPLES

    assert rank_stability.EXAMPLES is EXAMPLES  # the app still offers the same ones


# --- prose tasks (issue 43): essay-like haystacks, stratified depth, a generated document ---------------------

PROSE_TASKS = ("prose_needle", "prose_multi_value", "document_qa")


def _sentences(text: str) -> list[str]:
    """The prompt's sentences: split after a full stop or question mark and the space or break after it."""
    return [s.strip() for s in re.split(r"(?<=[.?])\s+", text) if s.strip()]


@pytest.mark.parametrize("name", PROSE_TASKS)
@pytest.mark.parametrize("length", [1000, 2000, 4000])
def test_prose_tasks_hit_their_length_in_tokens(name, length, tiny):
    _, tokenizer = tiny
    sample = TASKS[name](tokenizer, length, seed=7, index=4, chat=False)
    tokens = len(encode_prompt(tokenizer, sample.prompt, chat=False))
    # never over the target, and short of it by less than one more sentence (at most ~90 of this tokenizer's)
    assert length - 100 <= tokens <= length


@pytest.mark.parametrize("name", PROSE_TASKS)
def test_prose_depths_are_stratified_over_samples_and_recorded(name, tiny):
    _, tokenizer = tiny
    samples = [TASKS[name](tokenizer, 700, seed=100 + i, index=i, chat=False) for i in range(20)]
    # sample i lies in stratum i % 10, [b/10, (b+1)/10): two samples per stratum over 20
    assert [s.meta["depth_bin"] for s in samples] == [i % 10 for i in range(20)]
    for sample in samples:
        bin_ = sample.meta["depth_bin"]
        assert bin_ / 10 <= sample.meta["depth"] < (bin_ + 1) / 10
    # without an index there is no stratum, and the depth is still recorded
    free = TASKS[name](tokenizer, 700, seed=3, chat=False)
    assert free.meta["depth_bin"] is None and 0 <= free.meta["depth"] < 1


def test_the_needle_sits_at_its_recorded_depth(tiny):
    """The share of haystack sentences before the needle is the recorded depth, to one sentence."""
    _, tokenizer = tiny
    for index in (0, 5, 9):
        sample = TASKS["prose_needle"](tokenizer, 1500, seed=11, index=index, chat=False)
        body = sample.prompt.split("\n\n", 1)[1].rsplit("\n\nQuestion:", 1)[0]
        sentences = _sentences(body)
        at = sentences.index(sample.meta["needle"])
        assert abs(at - sample.meta["depth"] * (len(sentences) - 1)) <= 1


@pytest.mark.parametrize("name", PROSE_TASKS)
def test_prose_answers_appear_exactly_once(name, tiny):
    _, tokenizer = tiny
    for index in range(6):
        sample = TASKS[name](tokenizer, 1200, seed=50 + index, index=index, chat=False)
        for answer in sample.answers:
            assert sample.prompt.count(answer) == 1, (index, answer)
        assert sample.metric == "whole_match"
        assert whole_match(" ".join(sample.answers) + ".", sample.answers) == 1.0


def test_document_qa_asks_one_resident_among_distractors(tiny):
    _, tokenizer = tiny
    sample = TASKS["document_qa"](tokenizer, 1200, seed=2, index=3, people=4, chat=False)
    assert len(sample.meta["distractors"]) == 3
    assert all(sample.prompt.count(d) == 1 for d in sample.meta["distractors"])
    assert sample.meta["fact"] in sample.prompt and sample.answers[0] in sample.meta["fact"]
    # the asked person: once in their fact, once in the question, once in the answer's opening
    assert sample.prompt.count(sample.meta["person"]) == 3
    assert sample.prompt.rstrip().endswith(sample.meta["person"] + " rode to market was called") or \
        not sample.prompt.rstrip().endswith("?")  # the prompt ends on the answer's opening, not on the question


@pytest.mark.parametrize("style", ["essay", "history", "nature", "mixed"])
def test_prose_haystacks_never_repeat_a_sentence_and_vary_its_shape(style, tiny):
    """Against the noise haystack (one paragraph over and over) and prose_sentences (one grammar: every
    sentence 'subject verb the adjective object tail.'): every sentence distinct, no opening dominant, and
    sentences of many lengths."""
    import random as random_

    from kvviz.tasks.prose import prose

    stream = prose(random_.Random(5), style)
    sentences = [next(stream).strip() for _ in range(300)]  # about 4k tokens of text
    assert len(set(sentences)) == len(sentences)
    openings = [" ".join(s.split()[:3]) for s in sentences]
    assert max(openings.count(o) for o in set(openings)) / len(sentences) <= 0.2
    assert len({len(s.split()) for s in sentences}) >= 10
    # the old single grammar fails the last check: its sentences are all 8 to 11 words
    from kvviz.tasks.synthetic import prose_sentences

    old = prose_sentences(random_.Random(5))
    assert len({len(next(old).split()) for _ in range(300)}) < 10


def test_prose_styles_rotate_over_samples_and_are_seeded(tiny):
    _, tokenizer = tiny
    styles = [TASKS["prose_needle"](tokenizer, 500, seed=9, index=i, chat=False).meta["style"] for i in range(3)]
    assert styles == ["essay", "history", "nature"]
    one = TASKS["prose_needle"](tokenizer, 800, seed=9, index=2, chat=False)
    assert TASKS["prose_needle"](tokenizer, 800, seed=9, index=2, chat=False).prompt == one.prompt
    assert TASKS["prose_needle"](tokenizer, 800, seed=10, index=2, chat=False).prompt != one.prompt


def test_the_sweep_passes_the_sample_index_to_a_stratified_task(tiny, tmp_path):
    from kvviz.bench.sweep import make_sample, validate

    _, tokenizer = tiny
    task = {"name": "prose_needle", "length": 600, "samples": 12}
    assert [make_sample(task, tokenizer, i, seed=0, chat=False).meta["depth_bin"] for i in (0, 3, 11)] == [0, 3, 1]
    config = {"name": "x", "compression": [0.5], "policies": ["full"], "tasks": [{**task, "index": 3}]}
    with pytest.raises(ValueError, match="unknown key 'index'"):  # the sweep's to pass, not the config's
        validate(config)
