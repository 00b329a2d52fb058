"""Public long-context and reasoning benchmarks, from the hub when it is reachable, or from a local JSONL.

Each loader turns records (rows of the hub dataset, or a local JSONL file with the same fields) into
:class:`~kvviz.tasks.synthetic.Sample` s with the benchmark's usual metric.  Tests use small hand-written
local fixtures; nothing here touches the network unless :func:`load` is called.  No dataset's code is ever run
(no ``trust_remote_code``): LongBench, whose hub repository is a loading script, is read from the JSONL files
of the ``data.zip`` that repository ships, the others through ``datasets`` from their data files.

Prompts are kvviz's, not the benchmarks' official ones: LongBench in particular gets one generic template for
every task (see :func:`longbench`), so its scores rank policies against each other and are not comparable
with the numbers LongBench papers report.  Reading a local file names the file and line of a record that is
not JSON or lacks a field the benchmark needs.
"""

from __future__ import annotations

import io
import json
import zipfile
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
# RULER's 13 subtasks as the hub dataset (kvpress's simonjegou/ruler) names them in each record's ``task``, and
# the sequence lengths (prompt and answer, in tokens) it may hold, each a folder of its own on the hub.
RULER_SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
                  "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2")
RULER_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
# THUDM/LongBench is a loading script around this archive of one JSONL file per task (data/<task>.jsonl): the
# archive is fetched as a plain file and read here, so that no code from the hub runs.
LONGBENCH_ARCHIVE = "data.zip"


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
        prompt = (f"{r['context']}\n\nWhat is the correct answer to this question: {r['question']}\n"
                  f"Choices:\n{choices}\n"
                  "Answer with the letter of the correct choice, as in: The correct answer is (A).")
        samples.append(Sample("longbench_v2", prompt, [f"({r['answer']})"], "string_match",
                              {"id": r.get("_id", ""), "difficulty": r.get("difficulty", "")}))
    return samples


def ruler(records: Iterable[dict], task: str = "") -> list[Sample]:
    """RULER records as samples, labelled ``ruler/<subtask>``; with ``task``, only that subtask's records (the
    hub's test split holds every subtask of a length, one after another)."""
    return [Sample(f"ruler/{r.get('task', 'unknown')}", r["context"] + "\n" + r.get("question", ""),
                   list(r["answer"]) if isinstance(r["answer"], list) else [r["answer"]], "string_match",
                   {"length": r.get("max_length")}) for r in checked(records, "ruler")
            if not task or r.get("task") == task]


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
        return ruler(records, task)
    if kind in ("math500", "aime25"):
        return math_problems(records, kind)
    raise ValueError(f"unknown benchmark {kind!r}; choose one of {', '.join(HUB)}")


def _records(lines: Iterable[str], name: str) -> list[Record]:
    """One :class:`Record` per non-blank line, named ``"<name> line <n>"``; ``ValueError`` at the first line
    that is not a JSON object."""
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{name} line {number}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{where}: a record must be a JSON object {{...}}, got {line.strip()[:40]}")
        record = Record(value)
        record.where = where
        records.append(record)
    return records


def read_jsonl(path: str | Path) -> list[Record]:
    """One :class:`Record` per non-blank line of a JSONL file; ``ValueError`` naming the file and line of
    the first line that is not a JSON object (the loaders then name missing fields the same way)."""
    try:
        with open(path, encoding="utf-8") as handle:
            return _records(handle, str(path))
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text; save it as UTF-8") from None


def longbench_url() -> str:
    return f"https://huggingface.co/datasets/{HUB['longbench']}/resolve/main/{LONGBENCH_ARCHIVE}"


def _local_route(task: str) -> str:
    """What to do instead of a download that failed: the same records from a local file."""
    return (f"download {longbench_url()}, unzip it and give the task's file to the sweep as "
            f'{{ name = "longbench", task = "{task}", path = "data/{task}.jsonl" }}')


def read_longbench_archive(archive: str | Path, task: str) -> list[Record]:
    """The records of one LongBench task from the repository's ``data.zip`` (``data/<task>.jsonl``)."""
    member = f"data/{task}.jsonl"
    try:
        with zipfile.ZipFile(archive) as bundle:
            names = set(bundle.namelist())
            if member not in names:
                tasks = sorted(n[len("data/"):-len(".jsonl")] for n in names
                               if n.startswith("data/") and n.endswith(".jsonl"))
                raise ValueError(f"{archive} has no {member}; it holds {', '.join(tasks) or 'no task files'}")
            with bundle.open(member) as raw:
                return _records(io.TextIOWrapper(raw, encoding="utf-8"), f"{Path(archive).name}:{member}")
    except (OSError, zipfile.BadZipFile) as error:
        raise ValueError(f"cannot read {archive} as a zip archive ({error}); {_local_route(task)}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{archive}:{member} is not UTF-8 text; {_local_route(task)}") from None


def longbench_from_hub(task: str, split: str = "test") -> list[Record]:
    """One LongBench task's records from the hub: its ``data.zip`` fetched as a file (cached by
    ``huggingface_hub``), never the repository's loading script."""
    if task not in LONGBENCH_METRICS:
        raise ValueError(f"unknown LongBench task {task!r}; known: {', '.join(sorted(LONGBENCH_METRICS))}")
    if split != "test":
        raise ValueError(f"LongBench has only a test split, not {split!r}")
    from huggingface_hub import hf_hub_download  # a dependency of transformers

    try:
        archive = hf_hub_download(HUB["longbench"], LONGBENCH_ARCHIVE, repo_type="dataset")
    except Exception as error:  # noqa: BLE001 - offline, not cached, refused: each ends in the same advice
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"cannot download {longbench_url()} ({reason}); {_local_route(task)}") from None
    return read_longbench_archive(archive, task)


def load(kind: str, task: str = "", split: str = "test", limit: int | None = None,
         max_length: int | None = None) -> list[Sample]:
    """``kind`` from the hub: LongBench's archive through ``huggingface_hub``, the others with ``datasets``
    (needs network and ``pip install datasets``).  No dataset's code runs: never ``trust_remote_code``.

    For RULER, ``max_length`` picks the hub's folder of that sequence length (e.g. 16384) and ``task`` one
    subtask, whose first ``limit`` records are taken."""
    if kind not in HUB:
        raise ValueError(f"unknown benchmark {kind!r}; choose one of {', '.join(HUB)}")
    if kind == "longbench":
        records = longbench_from_hub(task, split)
        return from_records(kind, records[:limit] if limit else records, task)
    try:
        import datasets
    except ImportError:
        raise ValueError("loading public benchmarks needs the datasets library: pip install datasets") from None
    if kind == "ruler" and max_length:
        rows = datasets.load_dataset(HUB[kind], data_dir=str(max_length), split=split)
    else:
        rows = datasets.load_dataset(HUB[kind], split="train" if kind in ("longbench_v2", "aime25") else split)
    if kind == "ruler" and task:
        rows = rows.filter(lambda record: record.get("task") == task)
    records = rows.select(range(min(limit, len(rows)))) if limit else rows
    return from_records(kind, records, task)
