"""Scores for generated answers: RULER string match, exact match, ROUGE-L F, token F1, MATH answers."""

from __future__ import annotations

import re
import string
from collections import Counter


def normalize(text: str) -> str:
    """Lower case, no punctuation or articles, single spaces (SQuAD-style)."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def string_match(prediction: str, answers: list[str]) -> float:
    """RULER's metric: the share of gold answers that appear (case-insensitively) in the prediction."""
    if not answers:
        return 0.0
    prediction = prediction.lower()
    return sum(answer.lower() in prediction for answer in answers) / len(answers)


def whole_match(prediction: str, answers: list[str]) -> float:
    """The share of gold answers that appear in the prediction as a whole (case-insensitively): not run on into
    a longer number or word.  RULER's string match credits "647894231" for the answer 6478942; this does not."""
    if not answers:
        return 0.0
    return sum(bool(re.search(rf"(?<![0-9A-Za-z]){re.escape(answer)}(?![0-9A-Za-z])", prediction, re.IGNORECASE))
               for answer in answers) / len(answers)


def exact_match(prediction: str, answers: list[str]) -> float:
    return float(any(normalize(prediction) == normalize(answer) for answer in answers))


def _lcs(a: list[str], b: list[str]) -> int:
    previous = [0] * (len(b) + 1)
    for token in a:
        current = [0]
        for j, other in enumerate(b):
            current.append(previous[j] + 1 if token == other else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def rouge_l_f(prediction: str, answers: list[str]) -> float:
    """ROUGE-L F1 on normalised word tokens, best over the answers."""
    best = 0.0
    pred = normalize(prediction).split()
    for answer in answers:
        gold = normalize(answer).split()
        common = _lcs(pred, gold)
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def token_f1(prediction: str, answers: list[str]) -> float:
    """SQuAD token F1, best over the answers."""
    best = 0.0
    pred = normalize(prediction).split()
    for answer in answers:
        gold = normalize(answer).split()
        common = sum((Counter(pred) & Counter(gold)).values())
        if common:
            precision, recall = common / len(pred), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (nested braces allowed), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    depth = 0
    for index in range(brace, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:index]
    return None


def normalize_math(answer: str) -> str:
    """Canonical form for comparing final math answers: no spaces, $, \\left/\\right, units of text, trailing .0."""
    answer = answer.strip().strip("$").strip()
    answer = re.sub(r"\\text\{(.*?)\}", r"\1", answer)
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\ ", " ", "^\\circ", "^{\\circ}", "\\%", "%",
                  "dfrac", "tfrac"):
        answer = answer.replace(token, "frac" if token in ("dfrac", "tfrac") else "")
    answer = re.sub(r"(\d),(\d{3})", r"\1\2", answer)  # 1,000 -> 1000
    answer = re.sub(r"^(-?\d+)\.0+$", r"\1", answer)
    return answer.rstrip(".")


def math_equal(prediction: str, answers: list[str]) -> float:
    """MATH / AIME scoring: the last boxed answer (or the last number) equals a gold answer after normalising."""
    boxed = last_boxed(prediction)
    # Without a box that holds something, the last number: SmolLM2-135M-Instruct ends most answers to
    # arithmetic_reasoning with "So, the final answer is 18." and otherwise often echoes the instruction's
    # empty "\boxed{}", so boxed-only scoring would put its full cache near 0 and rank no policy.  The cost: a
    # generation cut off at max_new_tokens is scored by the number it stopped on, which may be right by
    # chance; rows record hit_max_tokens, so such rows can be told apart.
    if boxed is None or not boxed.strip():
        numbers = re.findall(r"-?\d+(?:\.\d+)?", prediction)
        boxed = numbers[-1] if numbers else ""
    return float(any(normalize_math(boxed) == normalize_math(answer) for answer in answers))


def edit_similarity(prediction: str, answers: list[str]) -> float:
    """LongBench's code metric: character-level similarity of the first non-comment line, best over answers."""
    from difflib import SequenceMatcher

    lines = [line for line in prediction.lstrip("\n").split("\n") if not line.strip().startswith(("#", "//", "`"))]
    first = lines[0] if lines else ""
    return max((SequenceMatcher(None, first, answer).ratio() for answer in answers), default=0.0)


METRICS = {"string_match": string_match, "whole_match": whole_match, "edit_similarity": edit_similarity,
           "exact_match": exact_match, "rouge_l": rouge_l_f, "token_f1": token_f1, "math": math_equal}
