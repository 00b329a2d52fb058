"""Public long-context and reasoning benchmarks, through the ``datasets`` library when the hub is reachable.

Each loader turns records (rows of the hub dataset, or a local JSONL file with the same fields) into
:class:`~kvviz.tasks.synthetic.Sample` s with the benchmark's usual metric.  Tests use small hand-written
local fixtures; nothing here touches the network unless :func:`load` is called.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from .synthetic import Sample

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


def longbench(records: Iterable[dict], task: str) -> list[Sample]:
    metric = LONGBENCH_METRICS.get(task)
    if metric is None:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(sorted(LONGBENCH_METRICS))}")
    return [Sample(f"longbench/{task}", f"{r['context']}\n\nQuestion: {r['input']}\nAnswer:", list(r["answers"]),
                   metric, {"id": r.get("_id", "")}) for r in records]


def longbench_v2(records: Iterable[dict]) -> list[Sample]:
    samples = []
    for r in records:
        choices = "\n".join(f"({letter}) {r[f'choice_{letter}']}" for letter in "ABCD")
        prompt = (f"{r['context']}\n\nWhat is the correct answer to this question: {r['question']}\nChoices:\n{choices}\n"
                  "Answer with the letter of the correct choice, as in: The correct answer is (A).")
        samples.append(Sample("longbench_v2", prompt, [f"({r['answer']})"], "string_match",
                              {"id": r.get("_id", ""), "difficulty": r.get("difficulty", "")}))
    return samples


def ruler(records: Iterable[dict]) -> list[Sample]:
    return [Sample(f"ruler/{r.get('task', 'unknown')}", r["context"] + "\n" + r.get("question", ""),
                   list(r["answer"]) if isinstance(r["answer"], list) else [r["answer"]], "string_match",
                   {"length": r.get("max_length")}) for r in records]


def math_problems(records: Iterable[dict], name: str) -> list[Sample]:
    suffix = "\nPlease reason step by step, and put your final answer within \\boxed{}."
    return [Sample(name, r["problem"] + suffix, [str(r["answer"])], "math", {"id": r.get("unique_id", r.get("id", ""))})
            for r in records]


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


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path) as handle:
        return [json.loads(line) for line in handle if line.strip()]


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
