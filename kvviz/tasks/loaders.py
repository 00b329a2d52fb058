"""Public long-context and reasoning benchmarks, through the ``datasets`` library when the hub is reachable.

Each loader turns records (rows of the hub dataset, or a local JSONL file with the same fields) into
:class:`~kvviz.tasks.synthetic.Sample` s with the benchmark's usual metric.  Tests use small hand-written
local fixtures; nothing here touches the network unless :func:`load` is called.

Prompts are kvviz's, not the benchmarks' official ones: LongBench in particular gets one generic template for
every task (see :func:`longbench`), so its scores rank policies against each other and are not comparable
with the numbers LongBench papers report.  Reading a local file names the file and line of a record that is
not JSON or lacks a field the benchmark needs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .synthetic import REASONING_SUFFIX, Sample

# LongBench task -> metric (LongBench's own grouping: QA F1, summarisation ROUGE, classification, code).
LONGBENCH_METRICS = {
    **dict.fromkeys(["narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"],
                    "token_f1"),
    **dict.fromkeys(["gov_report", "qmsum", "multi_news", "samsum"], "rouge_l"),
    **dict.fromkeys(["trec", "passage_retrieval_en", "passage_count"], "string_match"),
    **dict.fromkeys(["lcc", "repobench-p"], "edit_similarity"),
}
HUB = {
    "longbench": "THUDM/LongBench",
    "longbench_v2": "THUDM/LongBench-v2",
    "ruler": "simonjegou/ruler",
    "math500": "HuggingFaceH4/MATH-500",
    "aime25": "yentinglin/aime_2025",
}


# The fields each benchmark's records must have (others are optional), checked before any is used.
REQUIRED = {
    "longbench": ("context", "input", "answers"),
    "longbench_v2": ("context", "question", "choice_A", "choice_B", "choice_C", "choice_D", "answer"),
    "ruler": ("context", "answer"),
    "math500": ("problem", "answer"),
    "aime25": ("problem", "answer"),
}
# Fields that hold a list of reference answers: a bare string would be split into letters by list().
LIST_FIELDS = {"longbench": ("answers",)}
NAMES = {"longbench": "LongBench", "longbench_v2": "LongBench-v2", "ruler": "RULER", "math500": "MATH-500",
         "aime25": "AIME-25"}


class Record(dict):
    """A record read from a file, remembering where (``"junk.jsonl line 3"``) for error messages."""

    where = ""


def checked(records: Iterable[dict], kind: str) -> list[dict]:
    """``records`` as a list, or ``ValueError`` naming the first record that lacks a required field.

    A record from :func:`read_jsonl` is named by file and line, any other by its index (``record 3``).
    """
    required = REQUIRED[kind]
    out = []
    for index, record in enumerate(records, start=1):
        where = getattr(record, "where", "") or f"record {index}"
        missing = [name for name in required if name not in record]
        if missing:
            fields = ", ".join(repr(name) for name in missing)
            raise ValueError(f"{where}: missing field{'s' if len(missing) > 1 else ''} {fields} "
                             f"({NAMES[kind]} records need {', '.join(required)})")
        for name in LIST_FIELDS.get(kind, ()):
            if isinstance(record[name], str):
                raise ValueError(f"{where}: field {name!r} must be a list of answers, got the string "
                                 f"{record[name][:40]!r}; write [{record[name][:40]!r}]")
        out.append(record)
    return out


def longbench(records: Iterable[dict], task: str) -> list[Sample]:
    r"""LongBench records as samples, with one generic prompt template for every task.

    The prompt is ``f"{context}\n\nQuestion: {input}\nAnswer:"``, not LongBench's per-task templates
    (instructions, few-shot formats, answer-length hints), so scores from these samples compare policies
    with each other, not with the numbers in LongBench papers.
    """
    metric = LONGBENCH_METRICS.get(task)
    if metric is None:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(sorted(LONGBENCH_METRICS))}")
    return [Sample(f"longbench/{task}", f"{r['context']}\n\nQuestion: {r['input']}\nAnswer:", list(r["answers"]),
                   metric, {"id": r.get("_id", "")}) for r in checked(records, "longbench")]


def longbench_v2(records: Iterable[dict]) -> list[Sample]:
    samples = []
    for r in checked(records, "longbench_v2"):
        choices = "\n".join(f"({letter}) {r[f'choice_{letter}']}" for letter in "ABCD")
        prompt = (f"{r['context']}\n\nWhat is the correct answer to this question: {r['question']}\nChoices:\n{choices}\n"
                  "Answer with the letter of the correct choice, as in: The correct answer is (A).")
        samples.append(Sample("longbench_v2", prompt, [f"({r['answer']})"], "string_match",
                              {"id": r.get("_id", ""), "difficulty": r.get("difficulty", "")}))
    return samples


def ruler(records: Iterable[dict]) -> list[Sample]:
    return [Sample(f"ruler/{r.get('task', 'unknown')}", r["context"] + "\n" + r.get("question", ""),
                   list(r["answer"]) if isinstance(r["answer"], list) else [r["answer"]], "string_match",
                   {"length": r.get("max_length")}) for r in checked(records, "ruler")]


def math_problems(records: Iterable[dict], name: str) -> list[Sample]:
    return [Sample(name, r["problem"] + REASONING_SUFFIX, [str(r["answer"])], "math",
                   {"id": r.get("unique_id", r.get("id", ""))})
            for r in checked(records, name)]


def from_records(kind: str, records: Iterable[dict], task: str = "") -> list[Sample]:
    if kind == "longbench":
        return longbench(records, task)
    if kind == "longbench_v2":
        return longbench_v2(records)
    if kind == "ruler":
        return ruler(records)
    if kind in ("math500", "aime25"):
        return math_problems(records, kind)
    raise ValueError(f"unknown benchmark {kind!r}; choose one of {', '.join(HUB)}")


def read_jsonl(path: str | Path) -> list[Record]:
    """One :class:`Record` per non-blank line of a JSONL file; ``ValueError`` naming the file and line of
    the first line that is not a JSON object (the loaders then name missing fields the same way)."""
    records = []
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                where = f"{path} line {number}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
                if not isinstance(value, dict):
                    raise ValueError(f"{where}: a record must be a JSON object {{...}}, got {line.strip()[:40]}")
                record = Record(value)
                record.where = where
                records.append(record)
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; save it as UTF-8") from None
    return records


def load(kind: str, task: str = "", split: str = "test", limit: int | None = None) -> list[Sample]:
    """Download ``kind`` from the hub with ``datasets`` (needs network and ``pip install datasets``)."""
    try:
        import datasets
    except ImportError:
        raise ValueError("loading public benchmarks needs the datasets library: pip install datasets") from None
    if kind not in HUB:
        raise ValueError(f"unknown benchmark {kind!r}; choose one of {', '.join(HUB)}")
    args = (HUB[kind], task) if kind == "longbench" else (HUB[kind],)
    # THUDM/LongBench is a loading script (run only with trust_remote_code, and only by datasets < 4)
    extra = {"trust_remote_code": True} if kind == "longbench" else {}
    rows = datasets.load_dataset(*args, split="train" if kind in ("longbench_v2", "aime25") else split, **extra)
    records = rows.select(range(min(limit, len(rows)))) if limit else rows
    return from_records(kind, records, task)
