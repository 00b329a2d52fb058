"""RULER-style synthetic tasks at a chosen prompt length, and arithmetic reasoning, generated offline from a seed.

Every generator takes a tokenizer (to hit the target length in that model's tokens), a target length and
a seed, and returns a :class:`Sample`.  :func:`arithmetic_reasoning` is the exception: its prompt is as short
as its problem (the output is what grows), so its target length is only an optional upper bound.  Haystacks
are either a repeated noise paragraph or procedurally generated prose (:func:`prose_sentences`): a seeded
grammar over small word lists, no corpus copied.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

_SUBJECTS = ["The old sailor", "A quiet librarian", "The committee", "My neighbour", "The young painter",
             "A travelling merchant", "The village baker", "Our guide", "The night guard", "A curious child"]
_VERBS = ["walked past", "wrote about", "argued over", "repaired", "photographed", "remembered", "painted",
          "sold", "measured", "described"]
_ADJECTIVES = ["narrow", "forgotten", "crowded", "silver", "windy", "ancient", "bright", "muddy", "quiet", "tall"]
_OBJECTS = ["bridge", "harbour", "market", "lighthouse", "orchard", "railway", "chapel", "garden", "mill", "square"]
_TAILS = ["before the rain began", "on a cold morning", "for the third time", "without saying a word",
          "while the bells rang", "after a long journey", "near the end of summer", "with great care"]
_KEYS = ["apple", "river", "candle", "mirror", "falcon", "meadow", "copper", "lantern", "violet", "harvest",
         "pebble", "thunder", "saddle", "orbit", "willow", "cinder", "marble", "compass", "ember", "quartz"]
_WORDS = ["table", "cloud", "stone", "paper", "window", "basket", "ribbon", "engine", "pillow", "ladder", "button",
          "carpet", "needle", "rocket", "jacket", "wallet", "bottle", "pencil", "hammer", "blanket", "kettle",
          "tunnel", "saucer", "barrel", "helmet", "anchor", "cactus", "dagger", "fossil", "goblet"]


@dataclass
class Sample:
    """One prompt with its gold answers and how to score them."""

    task: str
    prompt: str
    answers: list[str]
    metric: str
    meta: dict = field(default_factory=dict)


def prose_sentences(rng: random.Random):
    """An endless stream of varied, grammatical filler sentences."""
    while True:
        yield (f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} the {rng.choice(_ADJECTIVES)} "
               f"{rng.choice(_OBJECTS)} {rng.choice(_TAILS)}.")


def noise_sentences(rng: random.Random):
    while True:
        yield NOISE


HAYSTACKS = {"noise": noise_sentences, "prose": prose_sentences}


def _number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def fit(tokenizer, target_tokens: int, build: Callable[[list[str]], str], filler, chat: bool = True) -> str:
    """The longest ``build(filler[:n])`` whose token count stays within ``target_tokens``.

    Refuses (ValueError) a target below ``build([])``, the prompt with no filler at all, rather than return
    a prompt longer than asked for.
    """
    from ..engine import encode_prompt

    bare = len(encode_prompt(tokenizer, build([]), chat=chat))
    if bare > target_tokens:
        raise ValueError(f"a length of {target_tokens} tokens is below the {bare} this prompt takes with no filler "
                         f"at all ({'with' if chat else 'without'} the chat template); "
                         f"set the length to {bare} or more")
    sentences: list[str] = []
    low, high = 0, 8
    while True:  # grow until too long, then bisect
        while len(sentences) < high:
            sentences.append(next(filler))
        if len(encode_prompt(tokenizer, build(sentences[:high]), chat=chat)) > target_tokens:
            break
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        if len(encode_prompt(tokenizer, build(sentences[:middle]), chat=chat)) > target_tokens:
            high = middle
        else:
            low = middle
    return build(sentences[:low])


def _insert(filler: list[str], items: list[str], depths: list[float]) -> str:
    text = list(filler)
    for item, depth in sorted(zip(items, depths), key=lambda pair: -pair[1]):
        text.insert(round(depth * len(text)), item)
    return " ".join(text)


def single_needle(tokenizer, target_tokens: int, seed: int, haystack: str = "noise", depth: float | None = None,
                  chat: bool = True) -> Sample:
    """A 7-digit number for one key hidden in the haystack; asked back."""
    rng = random.Random(seed)
    key, value = rng.choice(_KEYS), _number(rng)
    depth = rng.random() if depth is None else depth
    needle = f"One of the special magic numbers for {key} is: {value}."
    question = f"What is the special magic number for {key} mentioned in the provided text?"

    def build(filler):
        return ("Some special magic numbers are hidden within the following text. Memorize them.\n"
                f"{_insert(filler, [needle], [depth])}\n{question}")

    prompt = fit(tokenizer, target_tokens, build, HAYSTACKS[haystack](rng), chat)
    return Sample("single_needle", prompt, [value], "string_match", {"key": key, "depth": depth, "haystack": haystack})


def multi_key_needle(tokenizer, target_tokens: int, seed: int, keys: int = 4, haystack: str = "noise",
                     chat: bool = True) -> Sample:
    """``keys`` keys with their own numbers (the others are distractors); one is asked."""
    rng = random.Random(seed)
    names = rng.sample(_KEYS, keys)
    values = [_number(rng) for _ in names]
    asked = rng.randrange(keys)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(names, values)]
    depths = [rng.random() for _ in names]
    question = f"What is the special magic number for {names[asked]} mentioned in the provided text?"

    def build(filler):
        return ("Some special magic numbers are hidden within the following text. Memorize them.\n"
                f"{_insert(filler, needles, depths)}\n{question}")

    prompt = fit(tokenizer, target_tokens, build, HAYSTACKS[haystack](rng), chat)
    return Sample("multi_key_needle", prompt, [values[asked]], "string_match",
                  {"keys": names, "asked": names[asked],
                   "distractors": [v for i, v in enumerate(values) if i != asked]})


def multi_value(tokenizer, target_tokens: int, seed: int, values: int = 4, haystack: str = "noise",
                chat: bool = True) -> Sample:
    """One key with ``values`` numbers scattered in the haystack; all are asked."""
    rng = random.Random(seed)
    key = rng.choice(_KEYS)
    numbers = [_number(rng) for _ in range(values)]
    needles = [f"One of the special magic numbers for {key} is: {v}." for v in numbers]
    depths = [rng.random() for _ in numbers]
    question = f"What are all the special magic numbers for {key} mentioned in the provided text?"

    def build(filler):
        return ("Some special magic numbers are hidden within the following text. Memorize them.\n"
                f"{_insert(filler, needles, depths)}\n{question}")

    prompt = fit(tokenizer, target_tokens, build, HAYSTACKS[haystack](rng), chat)
    return Sample("multi_value", prompt, numbers, "string_match", {"key": key})


def multi_query(tokenizer, target_tokens: int, seed: int, keys: int = 4, queries: int = 2, haystack: str = "noise",
                chat: bool = True) -> Sample:
    """``keys`` keys with numbers; ``queries`` of them are asked at once."""
    rng = random.Random(seed)
    names = rng.sample(_KEYS, keys)
    values = [_number(rng) for _ in names]
    asked = rng.sample(range(keys), queries)
    needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(names, values)]
    depths = [rng.random() for _ in names]
    question = ("What are the special magic numbers for " + ", ".join(names[i] for i in asked)
                + " mentioned in the provided text?")

    def build(filler):
        return ("Some special magic numbers are hidden within the following text. Memorize them.\n"
                f"{_insert(filler, needles, depths)}\n{question}")

    prompt = fit(tokenizer, target_tokens, build, HAYSTACKS[haystack](rng), chat)
    return Sample("multi_query", prompt, [values[i] for i in asked], "string_match",
                  {"asked": [names[i] for i in asked]})


def variable_tracking(tokenizer, target_tokens: int, seed: int, chain: int = 4, haystack: str = "noise",
                      chat: bool = True) -> Sample:
    """``VAR A = 12345`` then ``VAR B = VAR A`` ... scattered in order; which variables hold the value?"""
    rng = random.Random(seed)
    names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(chain)]
    value = str(rng.randint(10_000, 99_999))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, chain)]
    depths = sorted(rng.random() for _ in statements)  # in order, so the chain can be followed
    question = f"Find all variables that are assigned the value {value} in the text above."

    def build(filler):
        return ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
                f"{_insert(filler, statements, depths)}\n{question}")

    prompt = fit(tokenizer, target_tokens, build, HAYSTACKS[haystack](rng), chat)
    return Sample("variable_tracking", prompt, names, "string_match", {"value": value})


def common_words(tokenizer, target_tokens: int, seed: int, top: int = 10, chat: bool = True) -> Sample:
    """A numbered list of words where ``top`` words repeat more often than all others; name them."""
    rng = random.Random(seed)
    frequent = rng.sample(_WORDS, top)
    rare = [w for w in _WORDS if w not in frequent]
    question = f"What are the {top} most common words in the above list?"

    def stream():
        counter = 0
        while True:
            counter += 1
            yield frequent[counter % top] if counter % 3 else rng.choice(rare)

    words = stream()

    def build(filler):
        listing = " ".join(f"{i + 1}. {w}" for i, w in enumerate(filler))
        return f"Below is a numbered list of words. Memorize the ones that appear most often.\n{listing}\n{question}"

    prompt = fit(tokenizer, target_tokens, build, words, chat)
    return Sample("common_words", prompt, frequent, "string_match", {})


_PEOPLE = ["Mia", "Noah", "Ava", "Liam", "Zoe", "Omar", "Lena", "Ravi", "Tess", "Hugo"]
_ITEMS = ["apples", "marbles", "stickers", "coins", "pencils", "stamps", "shells", "cards", "beads", "books"]
_COLOURS = ["red", "green", "blue", "yellow", "white", "black", "orange", "purple"]
# The reasoning prompt of MATH-500 and AIME-25 (loaders.math_problems), so that answers are extracted alike.
REASONING_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def apply_operation(count: int, operation: str, operand: int) -> int:
    """One step of an :func:`arithmetic_reasoning` problem: ``count`` after ``operation`` by ``operand``."""
    if operation == "add":
        return count + operand
    if operation == "subtract":
        return count - operand
    if operation == "multiply":
        return count * operand
    if operation == "divide":
        return count // operand
    raise ValueError(f"unknown operation {operation!r}; the operations are add, subtract, multiply, divide")


def arithmetic_reasoning(tokenizer, target_tokens: int | None, seed: int, steps: int = 1,
                         chat: bool = True) -> Sample:
    """A word problem of ``steps`` arithmetic operations with one integer answer.

    The long-output reasoning regime of AvoKV-E (MATH-500, AIME-25) offline: a short prompt asking for
    step-by-step reasoning and a ``\\boxed{}`` answer, scored with ``math``.  The first operation adds two
    groups of items ("3 red apples and 5 green apples ... in total?"); each further one gets more, gives some
    away, multiplies or splits the count, keeping it a whole number from 0 to 200 (a subtraction leaves at
    least 1, a division is exact).  Even ``steps = 1`` is at the edge of SmolLM2-135M-Instruct: its full cache
    solved 3 of 17 in a probe and 0 of 16 in ``configs/reasoning-budget.toml``, in 68-176 tokens
    (docs/findings.md); larger models want more steps.

    The prompt is as short as the problem; ``target_tokens`` is only an upper bound (None: none), and a
    prompt over it is refused rather than cut or padded.  ``meta`` holds the groups and the further
    operations, from which the answer can be recomputed.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    rng = random.Random(seed)
    person, item = rng.choice(_PEOPLE), rng.choice(_ITEMS)
    colours = rng.sample(_COLOURS, 2)
    groups = [rng.randint(2, 9), rng.randint(2, 9)]
    count = sum(groups)
    sentences = [f"{person} has {groups[0]} {colours[0]} {item} and {groups[1]} {colours[1]} {item}."]
    operations = []
    for _ in range(steps - 1):
        divisors = [k for k in (2, 3) if count % k == 0]
        factors = [k for k in (2, 3) if count * k <= 200]
        operation = rng.choice(["add"] + ["subtract"] * (count > 1) + ["multiply"] * bool(factors)
                               + ["divide"] * bool(divisors))
        if operation == "add":
            operand = rng.randint(2, 9)
            sentences.append(f"Then {person} gets {operand} more {item}.")
        elif operation == "subtract":
            operand = rng.randint(1, min(count - 1, 9))
            sentences.append(f"Then {person} gives away {operand} {item}.")
        elif operation == "multiply":
            operand = rng.choice(factors)
            sentences.append(f"Then {person} gets enough {item} to have {operand} times as many as before.")
        else:
            operand = rng.choice(divisors)
            sentences.append(f"Then {person} splits the {item} into {operand} equal groups and keeps one group.")
        operations.append([operation, operand])
        count = apply_operation(count, operation, operand)
    question = f"How many {item} does {person} have " + ("in total?" if steps == 1 else "now?")
    prompt = " ".join([*sentences, question]) + REASONING_SUFFIX
    if target_tokens is not None:
        from ..engine import encode_prompt

        length = len(encode_prompt(tokenizer, prompt, chat=chat))
        if length > target_tokens:
            raise ValueError(f"an arithmetic_reasoning prompt of {steps} step{'s' * (steps != 1)} takes {length} "
                             f"tokens, over the length {target_tokens}; "
                             "raise the length (or leave it out) or lower steps")
    return Sample("arithmetic_reasoning", prompt, [str(count)], "math",
                  {"person": person, "item": item, "groups": groups, "operations": operations, "steps": steps})


TASKS = {
    "single_needle": single_needle,
    "multi_key_needle": multi_key_needle,
    "multi_value": multi_value,
    "multi_query": multi_query,
    "variable_tracking": variable_tracking,
    "common_words": common_words,
    "arithmetic_reasoning": arithmetic_reasoning,
}
# Tasks whose prompt is as short as its problem (the output is what grows): their length is an optional upper
# bound, not a target to fill.
SHORT_PROMPT_TASKS = ("arithmetic_reasoning",)

NIAH_NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."


def needle_grid(tokenizer, lengths: list[int], depths: list[float], seed: int = 0, haystack: str = "prose",
                chat: bool = True) -> list[Sample]:
    """The needle-in-a-haystack grid (context length x needle depth), scored with ROUGE-L F."""
    samples = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(seed)
            question = "What is the best thing to do in San Francisco? Answer in one sentence."

            def build(filler, depth=depth, question=question):
                return f"{_insert(filler, [NIAH_NEEDLE], [depth])}\n{question}"

            prompt = fit(tokenizer, length, build, HAYSTACKS[haystack](rng), chat)
            samples.append(Sample("needle_grid", prompt, [NIAH_NEEDLE], "rouge_l", {"length": length, "depth": depth}))
    return samples
