"""A sweep's grid: each policy setting at its compressions and budgets, each task's samples, and the
:class:`Cell` -- one sample under one setting at one cut of the cache -- that becomes one row."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from dataclasses import dataclass

from ..tasks import loaders


@dataclass(frozen=True)
class Cell:
    """One sample under one policy setting, at a compression ρ of its prompt or at an absolute ``budget`` in
    tokens (then ``compression`` is None).  The full cache runs once per sample: at the sweep's first
    compression, or at neither where the sweep gives only budgets."""

    task: str
    sample: int
    policy: str
    params: tuple  # sorted (name, value) pairs
    compression: float | None
    budget: int | None = None
    draw: int = 0  # which sampled generation of this sample (0 .. draws - 1; always 0 when greedy)

    @property
    def key(self) -> str:
        # A compression cell keeps the key the shipped sweeps were written with, so that resuming them skips
        # every stored row; a budget cell ends in {"budget": B}, which no compression (a number) can equal;
        # a later draw adds {"draw": d}, so that draw 0 and greedy cells keep their keys too.
        cut = {"budget": self.budget} if self.budget is not None else self.compression
        return json.dumps([self.task, self.sample, self.policy, list(self.params), cut,
                           *([{"draw": self.draw}] if self.draw else [])])

    @property
    def cut(self) -> str:
        """How this cell cuts the cache, for progress lines: ``full``, ``rho=0.5`` or ``B=64``."""
        if self.policy == "full":
            return "full"
        return f"B={self.budget}" if self.budget is not None else f"rho={self.compression:g}"


def setting_grids(config: dict) -> dict[tuple, tuple[list, list]]:
    """Each policy setting's (compressions, absolute budgets): a policy table that gives ``compression`` or
    ``budget`` runs at exactly the lists it gives (one it leaves out: none), else the sweep's."""
    out = {}
    for entry in config["policies"]:
        own = isinstance(entry, dict) and ("compression" in entry or "budget" in entry)
        grid = entry if own else config
        for setting in policy_settings({"policies": [entry]}):
            out[setting] = (list(grid.get("compression", [])), list(grid.get("budget", [])))
    return out


def policy_settings(config: dict) -> list[tuple[str, tuple]]:
    """Expand ``policies``: a name, or {name, params = {p = [values...]}} into every parameter combination."""
    out = []
    for entry in config["policies"]:
        if isinstance(entry, str):
            out.append((entry, ()))
            continue
        grid = {k: v if isinstance(v, list) else [v] for k, v in entry.get("params", {}).items()}
        names = sorted(grid)
        for values in itertools.product(*(grid[n] for n in names)):
            out.append((entry["name"], tuple(zip(names, values))))
    return out


# Public benchmarks (kvviz.tasks.loaders): { name = "longbench", task = "hotpotqa", samples = 50 }, read from
# the hub, or from a local JSONL of the same records with path = "...".  ``truncate`` = N keeps the first and
# last N/2 prompt tokens (LongBench's middle truncation) so that long records fit the model.
BENCHMARKS = tuple(loaders.HUB)


_loaded: dict[tuple, list] = {}


def task_label(task: dict) -> str:
    """What rows call a task: its ``label``, else ``name`` (``name/task`` for a benchmark subtask)."""
    if "label" in task:
        return task["label"]
    return f"{task['name']}/{task['task']}" if task.get("task") else task["name"]


def sample_count(task: dict) -> int:
    """A needle grid has one sample per (length, depth); other tasks say how many they want."""
    if task["name"] == "needle_grid":
        return len(task["lengths"]) * len(task["depths"])
    return task["samples"]


def benchmark_samples(task: dict) -> list:
    """The first ``samples`` records of a public benchmark as samples (loaded once per process)."""
    key = (task["name"], task.get("task", ""), task.get("path"), task.get("split", "test"), task.get("max_length"))
    if key not in _loaded:
        if task.get("path"):
            records = loaders.read_jsonl(task["path"])
            _loaded[key] = loaders.from_records(task["name"], records, task.get("task", ""))
        else:
            _loaded[key] = loaders.load(task["name"], task.get("task", ""), task.get("split", "test"),
                                        limit=task["samples"], max_length=task.get("max_length"))
    samples = _loaded[key]
    if len(samples) < task["samples"]:
        raise ValueError(f"{task_label(task)} has {len(samples)} records; the config asks for {task['samples']}")
    return samples


def truncate_middle(tokenizer, text: str, tokens: int) -> str:
    """Keep the first and last ``tokens // 2`` tokens of ``text`` (the middle goes), as LongBench does."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= tokens:
        return text
    half = tokens // 2
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:],
                                                                                     skip_special_tokens=True)


def make_sample(task: dict, tokenizer, index: int, seed: int, chat: bool = True):
    """Sample ``index`` of ``task``; a generated prompt is fitted to its length as the sweep encodes it
    (with the chat template or, ``chat`` False, without).  A generator with an ``index`` argument gets the
    sample's index (to stratify, e.g., needle depth across samples)."""
    import inspect

    from ..tasks import TASKS, needle_grid

    if task["name"] == "needle_grid":  # sample i is the i-th (length, depth) of the grid, same haystack seed
        length, depth = list(itertools.product(task["lengths"], task["depths"]))[index]
        return needle_grid(tokenizer, [length], [depth], seed=seed, haystack=task.get("haystack", "prose"),
                           chat=chat)[0]
    if task["name"] in BENCHMARKS:
        sample = benchmark_samples(task)[index]
        if task.get("truncate"):
            sample = dataclasses.replace(sample, prompt=truncate_middle(tokenizer, sample.prompt, task["truncate"]))
        return sample
    if task["name"] not in TASKS:
        raise ValueError(f"unknown task {task['name']!r}; "
                         f"choose one of {', '.join([*TASKS, 'needle_grid', *BENCHMARKS])}")
    options = {k: v for k, v in task.items() if k not in ("name", "label", "length", "samples")}
    if "index" in inspect.signature(TASKS[task["name"]]).parameters:  # one that stratifies by sample (needle depth)
        options["index"] = index
    return TASKS[task["name"]](tokenizer, task.get("length"), _sample_seed(seed, task_label(task), index), **options,
                               chat=chat)


def _sample_seed(seed: int, task: str, index: int) -> int:
    return int(hashlib.sha256(f"{seed}/{task}/{index}".encode()).hexdigest()[:8], 16)


def cells(config: dict) -> list[Cell]:
    """Every cell of the sweep, sample by sample (its draws together, sharing its prefill): each policy setting
    at its compressions, then its budgets."""
    grids = setting_grids(config)
    out = []
    for task in config["tasks"]:
        label = task_label(task)
        for sample in range(sample_count(task)):
            for draw in range(config.get("draws", 1)):
                for (policy, params), (rhos, budgets) in grids.items():
                    if policy == "full":  # one run, which neither a compression nor a budget changes
                        out.append(Cell(label, sample, policy, params, float(rhos[0]) if rhos else None, draw=draw))
                        continue
                    out += [Cell(label, sample, policy, params, float(rho), draw=draw) for rho in rhos]
                    out += [Cell(label, sample, policy, params, None, tokens, draw=draw) for tokens in budgets]
    return out


def _describe(setting: tuple) -> str:
    name, params = setting
    return name + (" " + ", ".join(f"{k} = {v!r}" for k, v in params) if params else "")


def _lengths(task: dict) -> list[int]:
    """The prompt lengths a task asks for, where the config says them (benchmarks: only the record knows)."""
    if task["name"] == "needle_grid":
        return list(task["lengths"])
    return [task["length"]] if "length" in task else []
