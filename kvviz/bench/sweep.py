"""``kvviz bench run CONFIG``: a resumable, crash-safe sweep over tasks x samples x policies x budgets.

A config (TOML) names the model, the tasks (generator, prompt length, samples, options), the policies
(each with optional parameter lists to sweep) and the compressions.  Each *cell* -- one sample under one
policy setting at one compression -- becomes one JSON row in ``OUT/rows.jsonl``, written with a single
``write`` and ``fsync``.  On start the file is cut back to its last complete line, finished cells are
skipped, so a SIGKILL loses at most the cell in flight and never duplicates a row.

All policies of one sample share one prefill (:func:`kvviz.engine.prefill`); it records the last prompt
queries that prefill-time policies (SnapKV) score with.  Rows carry provenance: model, kvviz version and git commit, torch and
transformers versions, device, seed and date.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm  # already a dependency of transformers

from ..tasks import loaders


@dataclass(frozen=True)
class Cell:
    task: str
    sample: int
    policy: str
    params: tuple  # sorted (name, value) pairs
    compression: float

    @property
    def key(self) -> str:
        return json.dumps([self.task, self.sample, self.policy, list(self.params), self.compression])


def load_config(path: str | Path) -> dict:
    with open(path, "rb") as handle:
        config = tomllib.load(handle)
    for required in ("name", "tasks", "policies", "compression"):
        if required not in config:
            raise ValueError(f"sweep config {path} has no {required!r}")
    return config


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
    key = (task["name"], task.get("task", ""), task.get("path"), task.get("split", "test"))
    if key not in _loaded:
        if task.get("path"):
            records = loaders.read_jsonl(task["path"])
            _loaded[key] = loaders.from_records(task["name"], records, task.get("task", ""))
        else:
            _loaded[key] = loaders.load(task["name"], task.get("task", ""), task.get("split", "test"),
                                        limit=task["samples"])
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


def make_sample(task: dict, tokenizer, index: int, seed: int):
    from ..tasks import TASKS, needle_grid

    if task["name"] == "needle_grid":  # sample i is the i-th (length, depth) of the grid, same haystack seed
        length, depth = list(itertools.product(task["lengths"], task["depths"]))[index]
        return needle_grid(tokenizer, [length], [depth], seed=seed, haystack=task.get("haystack", "prose"))[0]
    if task["name"] in BENCHMARKS:
        sample = benchmark_samples(task)[index]
        if task.get("truncate"):
            sample = dataclasses.replace(sample, prompt=truncate_middle(tokenizer, sample.prompt, task["truncate"]))
        return sample
    if task["name"] not in TASKS:
        raise ValueError(f"unknown task {task['name']!r}; choose one of {', '.join([*TASKS, 'needle_grid', *BENCHMARKS])}")
    options = {k: v for k, v in task.items() if k not in ("name", "label", "length", "samples")}
    return TASKS[task["name"]](tokenizer, task["length"], _sample_seed(seed, task_label(task), index), **options)


def cells(config: dict) -> list[Cell]:
    settings = policy_settings(config)
    out = []
    for task in config["tasks"]:
        for sample in range(sample_count(task)):
            for (policy, params), compression in itertools.product(settings, config["compression"]):
                if policy == "full" and compression != config["compression"][0]:
                    continue  # the full cache does not depend on the compression: run it once
                out.append(Cell(task_label(task), sample, policy, params,
                                float(compression)))
    return out


class RowFile:
    """Append-only JSONL whose every row is one complete, fsynced line."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1  # drop a torn last line left by a kill mid-write
            if keep != len(data):
                with open(path, "r+b") as handle:
                    handle.truncate(keep)
        self.done = {json.loads(line)["cell"] for line in path.read_text().splitlines() if line.strip()} \
            if path.exists() else set()

    def append(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.done.add(row["cell"])


def finished_cells(out_dir: str | Path, skip: Path | None = None) -> set[str]:
    """Keys of the cells that any complete line of any shard in ``out_dir`` holds (``skip``: one shard left out)."""
    done = set()
    for shard in Path(out_dir).glob("rows*.jsonl"):
        if shard != skip:
            done |= {json.loads(line)["cell"] for line in shard.read_text().splitlines() if line.endswith("}")}
    return done


def status(config: dict, out_dir: str | Path) -> dict[str, tuple[int, int]]:
    """Finished and total cells per task label of ``config`` in ``out_dir`` (every shard counted)."""
    done = finished_cells(out_dir)
    counts: dict[str, list[int]] = {}
    for cell in cells(config):
        entry = counts.setdefault(cell.task, [0, 0])
        entry[0] += cell.key in done
        entry[1] += 1
    return {task: (finished, total) for task, (finished, total) in counts.items()}


def provenance(model_name: str, device: str, seed: int) -> dict:
    import transformers

    from .. import __version__

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {"model": model_name, "kvviz_version": __version__, "git_commit": commit, "torch": torch.__version__,
            "transformers": transformers.__version__, "device": device, "seed": seed,
            "machine": platform.node(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def _sample_seed(seed: int, task: str, index: int) -> int:
    return int(hashlib.sha256(f"{seed}/{task}/{index}".encode()).hexdigest()[:8], 16)


def run(config: dict, out_dir: str | Path, *, model=None, tokenizer=None, shard: tuple[int, int] = (0, 1),
        progress: bool = True) -> int:
    """Run every unfinished cell of ``config`` whose sample falls in shard ``index`` of ``shards`` (samples are
    dealt round-robin); return the rows written."""
    from .. import engine
    from ..models import load_model
    from ..policies import make_policy
    from ..tasks import METRICS

    out_dir = Path(out_dir)
    index, shards = shard
    rows = RowFile(out_dir / (f"rows-{index}.jsonl" if shards > 1 else "rows.jsonl"))
    # cells another sharding already finished are not rerun
    done = rows.done | finished_cells(out_dir, skip=rows.path)
    # Shard by sample, not by cell, so that each sample's prompt is prefilled by one shard only.
    grid = cells(config)
    samples = list(dict.fromkeys((c.task, c.sample) for c in grid))
    mine = set(samples[index::shards])
    todo = [c for c in grid if (c.task, c.sample) in mine and c.key not in done]
    if not todo:
        return 0
    model_name = config.get("model", "SmolLM2-135M-Instruct")
    device = config.get("device", "cpu")
    if model is None:
        model, tokenizer = load_model(model_name, device=device)
    seed = int(config.get("seed", 0))
    meta = provenance(model_name, device, seed)
    tasks = {task_label(t): t for t in config["tasks"]}
    max_new = int(config.get("max_new_tokens", 32))
    written = 0
    bar = tqdm(total=len(todo), desc=config["name"], unit="cell", disable=not progress, file=sys.stderr)

    for (label, sample_index), group in itertools.groupby(todo, key=lambda c: (c.task, c.sample)):
        group = list(group)
        sample = make_sample(tasks[label], tokenizer, sample_index, seed)
        prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=config.get("chat", True))
        policies = [make_policy(cell.policy, **dict(cell.params)) for cell in group]
        # One prefill per sample, also for prefill-time policies: it records the queries they score with.
        shared = engine.prefill(model, prompt_ids, window=max(p.prefill_window for p in policies))
        for cell, policy in zip(group, policies):
            budget = None if cell.policy == "full" else engine.resolve_budget(len(prompt_ids), compression=cell.compression)
            t0 = time.perf_counter()
            events = list(engine.decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=max_new,
                                        shared=shared))
            elapsed = time.perf_counter() - t0
            steps = events[1:]
            decode_seconds = sum(e.t_forward + e.t_score + e.t_evict for e in steps)
            prediction = tokenizer.decode([e.new_token_id for e in events], skip_special_tokens=True)
            rows.append({
                "cell": cell.key, "source": "measured", "sweep": config["name"], "task": label,
                "sample": sample_index, "policy": cell.policy, "params": dict(cell.params),
                "compression": cell.compression, "prompt_len": len(prompt_ids),
                "budget": budget if budget is not None else len(prompt_ids) + max_new,
                "max_cache": max(e.cache_size for e in events), "metric": sample.metric,
                "score": METRICS[sample.metric](prediction, sample.answers), "prediction": prediction,
                "answers": sample.answers, "meta": sample.meta, "prefill_ms": 1e3 * shared.seconds,
                "decode_tok_s": len(steps) / decode_seconds if decode_seconds else None,
                "seconds": elapsed, **meta,
            })
            written += 1
            bar.set_postfix_str(f"{label}#{sample_index} {cell.policy} rho={cell.compression}")
            bar.update()
    bar.close()
    return written


def run_ray(config: dict, out_dir: str | Path, shards: int, address: str | None = None) -> int:
    """Run the shards as Ray tasks (a local Ray by default, or the cluster at ``address``); each writes its
    own ``rows-<i>.jsonl`` that the store unions.  Returns the rows written."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    else:  # keep a local Ray on loopback
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, ignore_reinit_error=True,
                 log_to_driver=False, num_cpus=shards)

    @ray.remote
    def shard_task(shard_config: dict, folder: str, index: int, count: int) -> int:
        torch.set_num_threads(1)  # one core per task
        return run(shard_config, folder, shard=(index, count), progress=False)

    try:
        return sum(ray.get([shard_task.remote(config, str(out_dir), i, shards) for i in range(shards)]))
    finally:
        if not address:
            ray.shutdown()
