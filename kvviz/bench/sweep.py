"""``kvviz bench run CONFIG``: a resumable, crash-safe sweep over tasks x samples x policies x budgets.

A config (TOML) names the model, the tasks (generator, prompt length, samples, options), the policies
(each with optional parameter lists to sweep) and the budgets: compressions ρ of the prompt (B = ⌊(1 − ρ)·L0⌋),
absolute budgets in tokens (which may exceed the prompt: eviction then starts once generation fills the
cache, AvoKV-E's long-reasoning regime), or both.  Each *cell* -- one sample under one policy setting at one
compression or budget -- becomes one JSON row in ``OUT/rows.jsonl``, written with a single
``write`` and ``fsync``.  On start the file is cut back to its last complete line, finished cells are
skipped, so a SIGKILL loses at most the cell in flight and never duplicates a row.

All policies of one sample share one prefill (:func:`kvviz.engine.prefill`); it records the last prompt
queries that the policies reading the prompt's queries (SnapKV, AvoKV-E's first window) use.  Decoding is greedy unless ``temperature`` > 0
(with ``top_p``): then each sample is generated ``draws`` times (AvoKV-E's protocol: T = 0.6, top-p 0.95,
several samples per problem), one row per draw, every policy's draw d seeded alike.  Rows carry
provenance: model, kvviz version and git commit (``-dirty`` where the code differs from it), torch and
transformers versions, device, seed and date.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm  # already a dependency of transformers

from ..models import DEFAULT_MODEL, DTYPES
from ..trace import model_dtype
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


def read_toml(path: str | Path, what: str = "sweep config") -> dict:
    """A config file's TOML, or a ValueError naming ``what`` and the file: unreadable, or not TOML."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as error:
        raise ValueError(f"cannot read {what} {path}: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{what} {path} is not valid TOML: {error}") from None


def load_config(path: str | Path) -> dict:
    """Read a sweep config and check all of it (:func:`validate`) before any model is loaded."""
    config = read_toml(path)
    validate(config, str(path))
    context = model_context(config.get("model", DEFAULT_MODEL))
    if context is not None:  # else run() checks once the model is loaded, still before decoding
        check_lengths(config, context, str(path))
    return config


TOP_LEVEL = ("name", "model", "device", "dtype", "chat", "max_new_tokens", "seed", "temperature", "top_p", "draws",
             "compression", "budget", "tasks", "policies")
BENCHMARK_KEYS = ("name", "label", "task", "samples", "path", "split", "truncate", "max_length")
NEEDLE_GRID_KEYS = ("name", "label", "lengths", "depths", "haystack")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def validate(config: dict, source: str = "the sweep config") -> None:
    """Check every key of a sweep config; a problem is a ValueError naming ``source``, the table, the key and
    what to change, so that a bad config fails before a model loads rather than as a traceback mid-sweep."""
    from ..policies import REGISTRY, setting_label

    def refuse(where: str, message: str) -> ValueError:
        return ValueError(f"sweep config {source}: {where}: {message}")

    unknown = sorted(set(config) - set(TOP_LEVEL))
    if unknown:
        raise refuse(f"key {unknown[0]!r}", f"not a sweep setting; the keys are {', '.join(TOP_LEVEL)}")
    for required in ("name", "tasks", "policies"):
        if required not in config:
            raise ValueError(f"sweep config {source} has no {required!r}")
    if "compression" not in config and "budget" not in config:
        raise ValueError(f"sweep config {source} has neither 'compression' nor 'budget'; add compression = "
                         "[0.5, 0.9] (ratios of the prompt) or budget = [128, 256] (tokens), or both")
    for key in ("name", "model", "device"):
        if key in config and (not isinstance(config[key], str) or not config[key].strip()):
            raise refuse(f"key {key!r}", f'must be a non-empty string, e.g. {key} = "..."')
    # The name is also the sweep's folder under results_db/ (without --out): one plain folder name.
    if isinstance(config["name"], str) and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", config["name"]):
        raise refuse("key 'name'", f"{config['name']!r} must be a plain folder name (letters, digits, '.', '_', "
                                   "'-'; no '/' and not starting with '.'), as it names the sweep's folder, e.g. "
                                   'name = "sweep-2k"')
    if "dtype" in config and config["dtype"] not in DTYPES:
        raise refuse("key 'dtype'", f"must be one of {', '.join(DTYPES)}, got {config['dtype']!r} (leave it out "
                     "for float32 on the CPU and bfloat16 on a GPU)")
    if "chat" in config and not isinstance(config["chat"], bool):
        raise refuse("key 'chat'", f"must be true or false, got {config['chat']!r}")
    if "seed" in config and not _is_int(config["seed"]):
        raise refuse("key 'seed'", f"must be a whole number, got {config['seed']!r}")
    if "max_new_tokens" in config and not (_is_int(config["max_new_tokens"]) and config["max_new_tokens"] >= 1):
        raise refuse("key 'max_new_tokens'", f"must be a whole number >= 1, got {config['max_new_tokens']!r}")
    temperature = config.get("temperature", 0.0)
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature >= 0):
        raise refuse("key 'temperature'", f"must be a number >= 0 (0: greedy), got {temperature!r}")
    top_p = config.get("top_p", 1.0)
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise refuse("key 'top_p'", f"must be a number in (0, 1], got {top_p!r}")
    if top_p != 1 and temperature == 0:
        raise refuse("key 'top_p'", "only applies when sampling: set temperature > 0 (e.g. 0.6), or drop top_p")
    draws = config.get("draws", 1)
    if not (_is_int(draws) and draws >= 1):
        raise refuse("key 'draws'", f"must be a whole number >= 1 (generations per sample), got {draws!r}")
    if draws > 1 and temperature == 0:
        raise refuse("key 'draws'", f"{draws} greedy generations would all be the same: set temperature > 0 "
                                    "(e.g. 0.6) to sample them, or drop draws")

    def check_compressions(compression, where: str) -> None:
        if not isinstance(compression, list) or not compression:
            raise refuse(where, f"must be a list of ratios in [0, 1), e.g. compression = [0.5, 0.9]; got {compression!r}")
        for rho in compression:
            if not _is_number(rho) or not 0.0 <= rho < 1.0:
                raise refuse(where, f"{rho!r} is not a ratio in [0, 1) (1 would leave no cache)")
        if len(set(compression)) != len(compression):
            raise refuse(where, "lists a ratio twice; list each once")

    def check_budgets(budget, where: str) -> None:
        if not isinstance(budget, list) or not budget:
            raise refuse(where, "must be a list of absolute budgets in tokens, e.g. budget = [128, 256]; "
                                f"got {budget!r}")
        for tokens in budget:
            if not (_is_int(tokens) and tokens >= 1):
                raise refuse(where, f"{tokens!r} is not a budget in tokens: write a whole number >= 1, without a point")
        if len(set(budget)) != len(budget):
            raise refuse(where, "lists a budget twice; list each once")

    if "compression" in config:
        check_compressions(config["compression"], "key 'compression'")
    if "budget" in config:
        check_budgets(config["budget"], "key 'budget'")

    tasks = config["tasks"]
    if not isinstance(tasks, list) or not tasks or not all(isinstance(t, dict) for t in tasks):
        raise refuse("key 'tasks'", 'must be a list of tables, e.g. tasks = [{ name = "single_needle", '
                                    'length = 2000, samples = 20 }]')
    labels: dict[str, int] = {}
    for index, task in enumerate(tasks):
        _validate_task(task, f"tasks[{index}]", refuse)
        label = task_label(task)
        if label in labels:
            raise refuse(f"tasks[{index}]", f"has the same label {label!r} as tasks[{labels[label]}]; "
                                            'give one of them label = "..."')
        labels[label] = index

    policies = config["policies"]
    if not isinstance(policies, list) or not policies:
        raise refuse("key 'policies'", 'must be a list of names or tables, e.g. policies = ["full", '
                                       '{ name = "inertia", params = { alpha = [0.5, 0.8] } }]')
    seen: dict[str, tuple[int, tuple]] = {}  # setting label -> (its policies index, its typed setting)
    for index, entry in enumerate(policies):
        where = f"policies[{index}]"
        if isinstance(entry, dict):
            if not isinstance(entry.get("name"), str):
                raise refuse(where, 'has no name; write { name = "inertia", params = { ... } }')
            where = f"policies[{index}] ({entry['name']})"
            extra = sorted(set(entry) - {"name", "params", "compression", "budget"})
            if extra:
                raise refuse(where, f"unknown key {extra[0]!r}; a policy table has name, params and compression "
                                    "or budget")
            if "compression" in entry:
                check_compressions(entry["compression"], f"{where} compression")
            if "budget" in entry:
                check_budgets(entry["budget"], f"{where} budget")
            params = entry.get("params", {})
            if not isinstance(params, dict):
                raise refuse(where, f"params must be a table, e.g. params = {{ alpha = [0.5, 0.8] }}; got {params!r}")
            for key, value in params.items():
                values = value if isinstance(value, list) else [value]
                if not values or not all(isinstance(v, (str, int, float, bool)) for v in values):
                    raise refuse(where, f"params {key} must be a value or a non-empty list of values, got {value!r}")
        elif not isinstance(entry, str):
            raise refuse(where, f"must be a policy name or a table with name and params, got {entry!r}")
        name = entry["name"] if isinstance(entry, dict) else entry
        if name not in REGISTRY:
            raise refuse(where, f"unknown policy {name!r}; choose one of {', '.join(REGISTRY)} (see kvviz policies)")
        defaults = {p["name"]: p["default"] for p in REGISTRY[name].parameters()}
        for setting in policy_settings({"policies": [entry]}):
            # Keyed by what the store calls the setting, so that two spellings of one (inertia alpha = 0 and
            # single-step) do not run it twice.
            label = setting_label(_check_policy(setting, defaults, where, refuse))
            if label in seen:
                index_before, setting_before = seen[label]
                if setting_before == setting:
                    raise refuse(where, f"repeats the setting of policies[{index_before}] ({_describe(setting)}); "
                                        "list each setting once")
                raise refuse(where, f"repeats the setting of policies[{index_before}] spelt another way: "
                                    f"{_describe(setting)} and {_describe(setting_before)} are both {label}; "
                                    "list each setting once")
            seen[label] = index, setting

    grids = setting_grids(config)
    # a compression that leaves no cache even at the full length
    if any(name != "full" for _, (name, _) in seen.values()):
        for index, task in enumerate(tasks):
            for length in _lengths(task):
                for rho in sorted({rho for (name, _), (rhos, _) in grids.items() if name != "full" for rho in rhos}):
                    if math.floor((1.0 - rho) * length + 1e-9) < 1:
                        raise refuse(f"tasks[{index}] ({task_label(task)})",
                                     f"compression {rho} leaves no cache for a {length}-token prompt; "
                                     "lower the compression or raise the length")
    infeasible = unrunnable_cells(config, grids)
    if infeasible:
        raise _refused_cells(source, "", infeasible, "raise the task's length")


def unrunnable_cells(config: dict, grids: dict[tuple, tuple[list, list]]) -> list[tuple[str, str]]:
    """Each (policy setting, task length, compression or budget) whose budget the policy refuses (e.g.
    SnapKV's window, AvoKV-E's protected tail), judged at the task's nominal length, so that the sweep does
    not stop there hours in; as (``"compression"`` or ``"budget"``, what is wrong) pairs.

    A task without a nominal length (a benchmark, whose lengths only its records know; a reasoning prompt,
    as short as its problem) has its compression cells judged per sample at run time, and its budget cells
    here at a 1-token prompt: the rules that depend on the budget alone (AvoKV-E's tail and sinks, R-KV's
    window, StreamingLLM's sinks) fail now, those that depend on the prompt's length (SnapKV's window) at
    run time."""
    problems = []
    for (name, params), (rhos, budgets) in grids.items():
        if name == "full":
            continue
        for task in config["tasks"]:
            lengths = _lengths(task)
            for length, rho, tokens in [*((length, rho, None) for length in lengths for rho in rhos),
                                        *((length, None, tokens) for length in lengths or [1] for tokens in budgets)]:
                budget, error = _budget_refusal(name, params, length, rho, budget=tokens)
                if error:
                    problems.append(("compression" if tokens is None else "budget",
                                     f"{_describe((name, params))} at {_cut_words(rho, tokens)} on {task_label(task)}"
                                     + (f" ({length} tokens, budget {budget})" if lengths else "") + f": {error}"))
    return problems


def _cut_words(compression: float | None, budget: int | None) -> str:
    return f"budget {budget}" if budget is not None else f"compression {compression}"


def _budget_refusal(name: str, params: tuple, prompt_len: int, compression: float | None,
                    num_layers: int = 0, budget: int | None = None) -> tuple[int, str | None]:
    """The budget a cell gets (from ``compression`` of the prompt, or the absolute ``budget``), and the
    policy's reason to refuse it (None: it runs); ``num_layers`` is 0 while no model is known."""
    from ..engine import resolve_budget
    from ..policies import make_policy

    budget = resolve_budget(prompt_len, compression=compression, budget=budget)
    try:
        make_policy(name, **dict(params)).reset(prompt_len, budget, num_layers)
    except ValueError as error:
        return budget, str(error)
    return budget, None


def _refused_cells(source: str, where: str, problems: list[tuple[str, str]], longer: str) -> ValueError:
    """One error listing the cells that cannot run (the first six), with what to change in the config;
    ``problems`` are (``"compression"`` or ``"budget"``, line) pairs."""
    lines = [line for _, line in problems]
    kinds = sorted({kind for kind, _ in problems})
    shown = "; ".join(lines[:6]) + (f"; and {len(lines) - 6} more" if len(lines) > 6 else "")
    examples = {"compression": 'give it its own compressions (e.g. { name = "snapkv", compression = [0.5, 0.75] })',
                "budget": 'give it its own budgets (e.g. { name = "avokv", budget = [64, 128] })'}
    return ValueError(f"sweep config {source}: {len(lines)} policy × task × {' or '.join(kinds)} cell(s) cannot "
                      f"run{where}: {shown}. In the config: change such a policy's params, or, where its budget is "
                      f"too small, {' or '.join(examples[kind] for kind in kinds)}"
                      # a longer prompt gives a compression more room, never an absolute budget
                      + (f" or {longer}" if "compression" in kinds else ""))


def _describe(setting: tuple) -> str:
    name, params = setting
    return name + (" " + ", ".join(f"{k} = {v!r}" for k, v in params) if params else "")


def _check_policy(setting: tuple, defaults: dict, where: str, refuse):
    """Build the policy once with these params, so a bad value fails here and not mid-sweep; returns it."""
    from ..policies import make_policy

    name, params = setting
    for key, value in params:
        # TOML has typed numbers: a number written as text would be stored as text in the rows' params.
        if key in defaults and _is_number(defaults[key]) and not _is_number(value):
            raise refuse(where, f"params {key} = {value!r} must be a number (no quotes)")
        if key in defaults and _is_int(defaults[key]) and not _is_int(value):
            raise refuse(where, f"params {key} = {value!r} must be a whole number, written without a point")
        if key in defaults and isinstance(defaults[key], bool) and not isinstance(value, bool):
            raise refuse(where, f"params {key} = {value!r} must be true or false")
    try:
        return make_policy(name, **dict(params))
    except (ValueError, TypeError) as error:
        raise refuse(where, f"params {dict(params)} are refused ({error}); change them") from None


def _lengths(task: dict) -> list[int]:
    """The prompt lengths a task asks for, where the config says them (benchmarks: only the record knows)."""
    if task["name"] == "needle_grid":
        return list(task["lengths"])
    return [task["length"]] if "length" in task else []


def _validate_task(task: dict, where: str, refuse) -> None:
    from ..tasks import TASKS
    from ..tasks.loaders import LONGBENCH_METRICS, RULER_LENGTHS, RULER_SUBTASKS
    from ..tasks.synthetic import HAYSTACKS, SHORT_PROMPT_TASKS

    name = task.get("name")
    choices = ", ".join([*TASKS, "needle_grid", *BENCHMARKS])
    if not isinstance(name, str):
        raise refuse(where, f'has no name; write {{ name = "single_needle", length = 2000, samples = 20 }} '
                            f"(tasks: {choices})")
    where = f"{where} ({name})"
    if name not in TASKS and name != "needle_grid" and name not in BENCHMARKS:
        raise refuse(where, f"unknown task {name!r}; choose one of {choices}")
    if "label" in task and (not isinstance(task["label"], str) or not task["label"].strip()):
        raise refuse(where, f"label must be a non-empty string, got {task['label']!r}")

    def count(key: str, required: bool = True) -> None:
        if key not in task:
            if required:
                raise refuse(where, f"has no {key!r}; add {key} = N (a whole number >= 1)")
            return
        if not (_is_int(task[key]) and task[key] >= 1):
            raise refuse(where, f"{key} must be a whole number >= 1, got {task[key]!r}")

    def haystack() -> None:
        if "haystack" in task and task["haystack"] not in HAYSTACKS:
            raise refuse(where, f"haystack must be one of {', '.join(HAYSTACKS)}, got {task['haystack']!r}")

    if name == "needle_grid":
        extra = sorted(set(task) - set(NEEDLE_GRID_KEYS))
        if extra:
            raise refuse(where, f"unknown key {extra[0]!r}; a needle grid takes {', '.join(NEEDLE_GRID_KEYS)}")
        for key, example, valid in (("lengths", "[1000, 2000]", lambda v: _is_int(v) and v >= 1),
                                    ("depths", "[0.0, 0.5, 1.0]", lambda v: _is_number(v) and 0 <= v <= 1)):
            values = task.get(key)
            if not isinstance(values, list) or not values:
                raise refuse(where, f"{key} must be a non-empty list, e.g. {key} = {example}; got {values!r}")
            bad = [v for v in values if not valid(v)]
            if bad:
                kind = "whole numbers >= 1" if key == "lengths" else "numbers in [0, 1]"
                raise refuse(where, f"{key} must hold {kind}, got {bad[0]!r}")
        haystack()
        return
    if name in BENCHMARKS:
        extra = sorted(set(task) - set(BENCHMARK_KEYS))
        if extra:
            raise refuse(where, f"unknown key {extra[0]!r}; a benchmark task takes {', '.join(BENCHMARK_KEYS)}")
        count("samples")
        count("truncate", required=False)
        for key in ("task", "path", "split"):
            if key in task and not isinstance(task[key], str):
                raise refuse(where, f"{key} must be a string, got {task[key]!r}")
        if "max_length" in task and name != "ruler":
            raise refuse(where, "max_length picks one of RULER's sequence lengths; for other benchmarks use "
                                "truncate = N")
        if name == "ruler" and "max_length" in task and task["max_length"] not in RULER_LENGTHS:
            raise refuse(where, f"max_length must be one of RULER's lengths, {', '.join(map(str, RULER_LENGTHS))}; "
                                f"got {task['max_length']!r}")
        if name == "ruler" and "task" in task and task["task"] not in RULER_SUBTASKS:
            raise refuse(where, f"task must be a RULER subtask, one of {', '.join(RULER_SUBTASKS)}; "
                                f"got {task['task']!r}")
        if name == "longbench" and task.get("task") not in LONGBENCH_METRICS:
            raise refuse(where, f"task must be a LongBench task, one of {', '.join(sorted(LONGBENCH_METRICS))}; "
                                f"got {task.get('task')!r}")
        if "path" in task and not Path(task["path"]).is_file():
            raise refuse(where, f"path {task['path']!r} is not a file; give the local JSONL of records, "
                                "or leave path out to read the hub")
        return
    count("length", required=name not in SHORT_PROMPT_TASKS)  # there, an optional upper bound
    count("samples")
    # The generator's own keyword arguments (after tokenizer, length and seed) are the task's options.
    options = _task_options(name)
    for key, value in task.items():
        if key in ("name", "label", "length", "samples"):
            continue
        if key == "chat":
            raise refuse(where, "chat is the sweep's setting, not a task's: set chat = false at the top of the "
                                "config (it fits every prompt to its length and encodes it the same way)")
        if key not in options:
            raise refuse(where, f"unknown key {key!r}; {name} takes name, label, length, samples"
                                + "".join(f", {option}" for option in options))
        default = options[key].default
        if isinstance(default, bool) and not isinstance(value, bool):
            raise refuse(where, f"{key} must be true or false, got {value!r}")
        if _is_int(default) and not (_is_int(value) and value >= 1):
            raise refuse(where, f"{key} must be a whole number >= 1, got {value!r}")
        if key == "depth" and not (_is_number(value) and 0 <= value <= 1):
            raise refuse(where, f"depth must be a number in [0, 1], got {value!r}")
    haystack()


def _task_options(name: str) -> dict:
    """A generator's own keyword arguments (after tokenizer, length and seed): the task's options in a config.
    ``chat`` is the sweep's (the prompt is fitted as the sweep encodes it) and ``index`` the sample's (the sweep
    passes it), so neither is one."""
    import inspect

    from ..tasks import TASKS

    options = dict(list(inspect.signature(TASKS[name]).parameters.items())[3:])
    options.pop("chat")
    options.pop("index", None)
    return options


def model_context(name: str) -> int | None:
    """The model's context length where its config.json is already on this machine (a local directory, the
    converted default model, a hub id in the Hugging Face cache); None where only loading the model tells."""
    from transformers import AutoConfig

    from ..models import DEFAULT_HUB_ID, TINY_PREFIX, cache_dir

    if name.startswith(TINY_PREFIX):
        return None
    sources = [cache_dir() / "models" / DEFAULT_MODEL, DEFAULT_HUB_ID] if name in (DEFAULT_MODEL, DEFAULT_HUB_ID) \
        else [name]
    for source in sources:
        try:
            config = AutoConfig.from_pretrained(source, local_files_only=True)
        except Exception:  # noqa: BLE001 -- not readable without loading or the network: judged after loading
            continue
        return getattr(config, "max_position_embeddings", None)
    return None


def check_lengths(config: dict, context: int, source: str) -> None:
    """Refuse a task whose prompt length plus ``max_new_tokens`` exceeds the model's context: the model
    would run past the positions it was trained for (synthetic prompts are at most their length)."""
    max_new = int(config.get("max_new_tokens", 32))
    for index, task in enumerate(config["tasks"]):
        if task.get("max_length", 0) > context:  # RULER's length holds the prompt and the answer
            raise ValueError(f"sweep config {source}: tasks[{index}] ({task_label(task)}): RULER's max_length "
                             f"{task['max_length']} exceeds the context of {config.get('model', DEFAULT_MODEL)} "
                             f"({context} tokens); pick a shorter length")
        for length in _lengths(task):
            if length + max_new > context:
                key = "lengths" if task["name"] == "needle_grid" else "length"
                raise ValueError(
                    f"sweep config {source}: tasks[{index}] ({task_label(task)}): {key} {length} + max_new_tokens "
                    f"{max_new} exceeds the context of {config.get('model', DEFAULT_MODEL)} ({context} tokens); "
                    f"lower {key} to at most {context - max_new}")


def check_shard(index: int, shards: int) -> None:
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if not 0 <= index < shards:
        raise ValueError(f"--shard {index} is not one of {shards} shard(s); use --shard 0 to {shards - 1}")


def check_store(config: dict, out_dir: str | Path) -> None:
    """Refuse to add rows to a folder whose rows came from a different config: a resumed sweep would then
    mix two experiments under one name (and the CLI would overwrite the config that made the old rows).

    A config that only raises tasks' ``samples`` is the same experiment grown (:func:`grown`): it resumes."""
    out_dir = Path(out_dir)
    saved = out_dir / "config.toml"
    if not saved.exists() or not any(p.stat().st_size for p in out_dir.glob("rows*.jsonl")):
        return
    try:
        previous = tomllib.loads(saved.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{saved} is not valid TOML ({error}); restore it, or pass --out with a new folder") \
            from None
    if previous != config and not grown(previous, config):
        changed = sorted(key for key in previous.keys() | config.keys() if previous.get(key) != config.get(key))
        raise ValueError(f"{out_dir} holds rows of a different config ({saved} differs in {', '.join(changed)}); "
                         f"pass --out with a new folder, or resume with {saved}")


# Held shared by every process writing a sweep's rows (the shards, a Ray driver) for as long as it runs, so that
# none can put another config in that folder meanwhile; the last to finish removes it.
RUNNING_LOCK = ".sweep.lock"


@contextmanager
def claim(out_dir: str | Path, config: dict, config_text: bytes | None = None) -> Iterator[None]:
    """Hold ``out_dir`` for a run of ``config`` while the ``with`` lasts; with ``config_text``, save it there
    as ``config.toml`` first.

    The checks (:func:`check_store`, :func:`check_params_as_run`), the saving and the claim are one step under
    the folder's lock: two runs started together with different configs cannot both pass, and a config that
    is neither the saved one nor that one grown is refused while another run holds the folder, even before it
    has written a row."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # only for the steps below: a waiting run waits for seconds at most
        check_store(config, out_dir)
        check_params_as_run(config, out_dir)
        saved = out_dir / "config.toml"
        if config_text is not None and not (saved.exists() and saved.read_bytes() == config_text):
            try:
                previous = tomllib.loads(saved.read_text())
            except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):  # none, or none a run could have saved
                previous = None
            if previous is not None and previous != config and not grown(previous, config) \
                    and _held(out_dir / RUNNING_LOCK):
                raise ValueError(f"another sweep is running in {out_dir} with the config saved there ({saved}); "
                                 "let it finish or stop it, or pass --out with a new folder")
            saved.write_bytes(config_text)
        running = os.open(out_dir / RUNNING_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(running, fcntl.LOCK_SH)  # never waits: exclusive locks on it are only probes made under ours
    finally:
        os.close(folder)  # releases the folder's lock
    try:
        yield
    finally:
        _release(out_dir, running)


def _release(out_dir: Path, running: int) -> None:
    """Let go of a claim, and remove the lock file if no other run holds it, under the folder's lock (which
    every open of that file is made under, so no run can be holding a removed file's lock)."""
    try:
        folder = os.open(out_dir, os.O_RDONLY)
    except OSError:  # the folder itself is gone
        os.close(running)
        return
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        os.close(running)
        if not _held(out_dir / RUNNING_LOCK):
            (out_dir / RUNNING_LOCK).unlink(missing_ok=True)
    finally:
        os.close(folder)


def _held(path: Path) -> bool:
    """Whether any process holds ``path``'s lock (this one included, through another open of it)."""
    try:
        probe = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(probe)


def check_params_as_run(config: dict, out_dir: str | Path) -> None:
    """Refuse to resume a folder whose rows ran one of ``config``'s settings with other parameters than the code
    builds from it now: a registry default changed in between, and the new rows would join the old ones as one
    setting.  Each row records every parameter its policy ran with (``policy_params``); of rows from before they
    did only the parameters added to their policy since are checked (a row without R-KV's ``pooling`` ran
    ``"head-mean"``, :attr:`kvviz.policies.base.Policy.added_parameters`), and so are those a row's
    ``policy_params`` lack.  A folder that already holds every cell of ``config`` is not refused: rerunning it
    writes nothing, so nothing can join the old rows (``make sweeps`` over finished sweeps stays a no-op)."""
    from ..policies import get_spec, make_policy

    if {cell.key for cell in cells(config)} <= finished_cells(out_dir):
        return

    # As a row stores them: JSON numbers, lists for tuples
    now = {(name, json.dumps(dict(params), sort_keys=True)): json.loads(json.dumps(make_policy(name, **dict(params))
                                                                                   .params()))
           for name, params in policy_settings(config)}
    for shard in sorted(Path(out_dir).glob("rows*.jsonl")):
        for row in stored_rows(shard):
            ran, params = row.get("policy_params"), row.get("params")
            if not isinstance(params, dict):
                continue
            built = now.get((row.get("policy"), json.dumps(params, sort_keys=True)))
            if built is None:
                continue
            added = get_spec(row["policy"]).cls.added_parameters
            if isinstance(ran, dict):
                ran = {**{key: value for key, value in added.items() if key not in ran}, **ran}
            else:  # written before rows recorded every parameter: what they lack of those added since is known
                ran = {key: value for key, value in added.items() if key not in params}
                built = {key: built[key] for key in ran}
            if ran != built:
                changed = ", ".join(f"{key} = {ran.get(key)!r} then, {built.get(key)!r} now"
                                    for key in sorted(ran.keys() | built.keys()) if ran.get(key) != built.get(key))
                spelled = _describe((row["policy"], tuple(sorted(params.items()))))
                raise ValueError(
                    f"{shard} holds rows of {spelled} run with other parameters than the code gives it now "
                    f"({changed}: a default changed since, at commit {row.get('git_commit') or 'unknown'}); "
                    "resuming would file both under one setting.  Pass --out with a new folder, or spell the old "
                    "values out in the config's params to rerun under them")


def grown(previous: dict, config: dict) -> bool:
    """``config`` is ``previous`` with more samples of some of its tasks and nothing else changed.

    Sample ``i`` of a task is the same whatever the count (its prompt and seeds come from ``i``; a benchmark's
    are its first records), so the rows of ``previous`` are rows of ``config``, and a sweep is extended by
    raising ``samples`` and running it again.  Fewer samples is not growth: the rows past the new count
    would be stored under a config that does not ask for them.
    """
    if previous.keys() != config.keys() or any(previous[key] != config[key] for key in previous if key != "tasks"):
        return False
    old, new = previous.get("tasks"), config.get("tasks")
    if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return False
    return all(isinstance(before, dict) and isinstance(after, dict) and before.keys() == after.keys()
               and all(before[key] == after[key] for key in before if key != "samples")
               and isinstance(before.get("samples"), int) and isinstance(after.get("samples"), int)
               and after["samples"] >= before["samples"] for before, after in zip(old, new))


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
        raise ValueError(f"unknown task {task['name']!r}; choose one of {', '.join([*TASKS, 'needle_grid', *BENCHMARKS])}")
    options = {k: v for k, v in task.items() if k not in ("name", "label", "length", "samples")}
    if "index" in inspect.signature(TASKS[task["name"]]).parameters:  # one that stratifies by sample (needle depth)
        options["index"] = index
    return TASKS[task["name"]](tokenizer, task.get("length"), _sample_seed(seed, task_label(task), index), **options,
                               chat=chat)


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


class RowFile:
    """Append-only JSONL whose every row is one complete, fsynced line, written by one process at a time.

    Use it as a context manager: the file is locked (``flock``) from opening until the ``with`` ends or the
    process dies, so that the same shard started twice is refused instead of running every cell again, and
    the repair of a torn last line cannot cut rows that another writer has just appended."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._created = not path.exists()  # removed again if no row comes: a run with nothing left adds no file
        self._lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ValueError(f"{path} is being written by another process (the same sweep and shard running "
                             "already); let it finish or stop it, then rerun to resume") from None
        try:
            self.done = stored_cells(path)  # read first: a bad line stops before any change
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1  # drop a torn last line left by a kill mid-write
            if keep != len(data):
                with open(path, "r+b") as handle:
                    handle.truncate(keep)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RowFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            if self._created and self.path.stat().st_size == 0:
                self.path.unlink()
            os.close(self._lock)  # releases the flock
            self._lock = None

    def append(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):  # os.write may write part of it (a full disk, a signal)
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, start)  # no part-row for the next one to be glued onto
                raise
        finally:
            os.close(fd)
        self.done.add(row["cell"])


def stored_cells(path: Path) -> set[str]:
    """Cell keys of the complete lines of one rows file (:func:`stored_rows`)."""
    return {row["cell"] for row in stored_rows(path)}


def stored_rows(path: Path) -> list[dict]:
    """The rows of the complete lines of one rows file; a torn last line (no newline yet: a kill mid-write,
    or another shard writing now) is not a row.  A complete line that is not a row is an error naming it."""
    data = path.read_bytes()
    rows = []
    for number, line in enumerate(data[:data.rfind(b"\n") + 1].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"{path} line {number} is not a JSON row ({error}); repair or delete that line") \
                from None
        if not isinstance(row, dict) or not isinstance(row.get("cell"), str):
            raise ValueError(f"{path} line {number} has no \"cell\" key, so it is not a sweep row; "
                             "repair or delete that line")
        rows.append(row)
    return rows


def finished_cells(out_dir: str | Path, skip: Path | None = None) -> set[str]:
    """Keys of the cells that any complete line of any shard in ``out_dir`` holds (``skip``: one shard left out)."""
    done = set()
    for shard in Path(out_dir).glob("rows*.jsonl"):
        if shard != skip:
            done |= stored_cells(shard)
    return done


def status(config: dict, out_dir: str | Path, by_cut: bool = False) -> dict:
    """Finished and total cells per task label of ``config`` in ``out_dir`` (every shard counted); with
    ``by_cut``, per (task label, :attr:`Cell.cut`): ``full``, each ``rho=...`` and each ``B=...``."""
    done = finished_cells(out_dir)
    counts: dict = {}
    for cell in cells(config):
        entry = counts.setdefault((cell.task, cell.cut) if by_cut else cell.task, [0, 0])
        entry[0] += cell.key in done
        entry[1] += 1
    return {key: (finished, total) for key, (finished, total) in counts.items()}


# The folder holding the package and its pyproject.toml: what a row's git_commit describes.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def git_commit(root: Path = PROJECT_ROOT, code: tuple[str, ...] = ("kvviz", "pyproject.toml")) -> str:
    """HEAD's short hash, with ``-dirty`` when a tracked file of ``code`` differs from it (staged or not), so
    that a row is not filed under a commit whose code did not make it; "" outside a git checkout.

    Only the code counts: results_db/, which a running sweep is writing itself, and untracked files do not.
    """
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=root, timeout=5).stdout.strip()
        if not commit:
            return ""
        # As `git describe --dirty` judges (contents, so a file only touched is unchanged), but without
        # optional locks: a sweep starting must not hold the index's lock while someone commits.
        changed = subprocess.run(["git", "--no-optional-locks", "status", "--porcelain", "--untracked-files=no",
                                  "--", *code], capture_output=True, text=True, cwd=root, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return commit + ("-dirty" if changed else "")


def provenance(model_name: str, device: str, seed: int, dtype: str = "") -> dict:
    import transformers

    from .. import __version__

    return {"model": model_name, "kvviz_version": __version__, "git_commit": git_commit(), "torch": torch.__version__,
            "transformers": transformers.__version__, "device": device, "dtype": dtype, "seed": seed,
            "machine": platform.node(), "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def loaded(config: dict, model=None, tokenizer=None) -> tuple:
    """The config's model and tokenizer (loaded unless given) and the provenance its rows record."""
    from ..models import load_model

    model_name = config.get("model", DEFAULT_MODEL)
    device = config.get("device", "cpu")
    if model is None:
        model, tokenizer = load_model(model_name, device=device, dtype=config.get("dtype"))
    return model, tokenizer, provenance(model_name, device, int(config.get("seed", 0)), model_dtype(model))


def _sample_seed(seed: int, task: str, index: int) -> int:
    return int(hashlib.sha256(f"{seed}/{task}/{index}".encode()).hexdigest()[:8], 16)


def run(config: dict, out_dir: str | Path, *, model=None, tokenizer=None, shard: tuple[int, int] = (0, 1),
        progress: bool = True, config_text: bytes | None = None) -> int:
    """Run every unfinished cell of ``config`` whose sample falls in shard ``index`` of ``shards`` (samples are
    dealt round-robin); return the rows written.  ``config_text``: the config file's text, saved in
    ``out_dir`` (:func:`claim`)."""
    out_dir = Path(out_dir)
    index, shards = shard
    source = repr(config.get("name"))  # messages read "sweep config 'name': ..."
    validate(config, source)
    check_shard(index, shards)
    with claim(out_dir, config, config_text), \
            RowFile(out_dir / (f"rows-{index}.jsonl" if shards > 1 else "rows.jsonl")) as rows:
        return _run_shard(config, out_dir, rows, index, shards, model, tokenizer, source, progress)


def _run_shard(config: dict, out_dir: Path, rows: RowFile, index: int, shards: int, model, tokenizer,
               source: str, progress: bool) -> int:
    # cells another sharding already finished are not rerun
    done = rows.done | finished_cells(out_dir, skip=rows.path)
    # Shard by sample, not by cell, so that each sample's prompt is prefilled by one shard only.
    grid = cells(config)
    samples = list(dict.fromkeys((c.task, c.sample) for c in grid))
    mine = set(samples[index::shards])
    todo = [c for c in grid if (c.task, c.sample) in mine and c.key not in done]
    if not todo:
        return 0
    model, tokenizer, meta = loaded(config, model, tokenizer)
    check_lengths(config, model.config.max_position_embeddings, source)
    seed = int(config.get("seed", 0))
    tasks = {task_label(t): t for t in config["tasks"]}
    max_new = int(config.get("max_new_tokens", 32))
    for note in check_cells(config, source, tasks, todo, model, tokenizer, seed, max_new):
        print(f"warning: {note}", file=sys.stderr)  # before the progress bar, on a line of its own
    written = 0
    bar = tqdm(total=len(todo), desc=config["name"], unit="cell", disable=not progress, file=sys.stderr)
    try:
        for (label, sample_index), group in itertools.groupby(todo, key=lambda c: (c.task, c.sample)):
            written += _run_sample(config, tasks[label], label, sample_index, list(group), model, tokenizer,
                                   seed, max_new, meta, rows, bar)
    finally:  # ends the progress line, so that an error is printed on a line of its own
        bar.close()
    return written


def check_cells(config: dict, source: str, tasks: dict, todo: list[Cell], model, tokenizer, seed: int,
                max_new: int) -> list[str]:
    """Before anything decodes: every sample's real prompt fits the model, and every cell's policy accepts
    its real budget on this model (validate() judged nominal lengths without a model; a chat template, a
    tokenizer or a benchmark record makes them differ).  All refusals are listed, one line per policy
    setting, task and compression or budget, with how many samples it hits.

    Returns notes that refuse nothing: each absolute budget that no cell of ``todo`` ever fills, so that its
    cells run as the full cache (a fair reference point, but not a cut of the cache)."""
    from .. import engine
    from ..policies import make_policy

    refused: dict[tuple, list] = {}
    longest = 0  # the longest prompt of these cells' samples
    for (label, sample_index), group in itertools.groupby(todo, key=lambda c: (c.task, c.sample)):
        try:  # e.g. a reasoning prompt over its task's length
            sample = make_sample(tasks[label], tokenizer, sample_index, seed, config.get("chat", True))
        except ValueError as error:
            raise ValueError(f"sweep config {source}: {label} sample {sample_index}: {error}") from None
        prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=config.get("chat", True))
        longest = max(longest, len(prompt_ids))
        try:  # a row past the model's context would be stored as if it were valid
            engine.check_prompt(model, prompt_ids, max_new)
        except ValueError as error:
            raise ValueError(f"sweep config {source}: {label} sample {sample_index}: {error} (in the config: lower "
                             "this task's length, set truncate = N, or lower max_new_tokens)") from None
        for cell in group:
            if cell.policy == "full":
                continue
            budget, error = _budget_refusal(cell.policy, cell.params, len(prompt_ids), cell.compression,
                                            model.config.num_hidden_layers, budget=cell.budget)
            if not error:  # what the policy needs of this model and prompt (Expected Attention's RoPE, KVzip's pass)
                policy = make_policy(cell.policy, **dict(cell.params))
                try:
                    engine.check_policy(model, tokenizer, prompt_ids, policy)
                except ValueError as refusal:
                    error = str(refusal)
                error = error or _no_checkpoint(policy, len(prompt_ids), budget, max_new)
            if error:
                refused.setdefault((cell.policy, cell.params, label, cell.compression, cell.budget), []).append(
                    f"sample {sample_index}: {len(prompt_ids)} tokens, budget {budget}: {error}")
    if refused:
        problems = [("compression" if tokens is None else "budget",
                     f"{_describe((policy, params))} at {_cut_words(rho, tokens)} on {label} ({len(errors)} "
                     f"sample(s), first {errors[0]})")
                    for (policy, params, label, rho, tokens), errors in refused.items()]
        raise _refused_cells(source, " on this model", problems, "longer prompts")
    # The cache holds the prompt and every new token but the last (which is never fed back): at most this.
    largest = longest + max_new - 1
    return [f"sweep config {source}: budget {tokens} is more than any cache here holds (at most {largest} entries: "
            f"the longest prompt, {longest} tokens, + max_new_tokens {max_new} - 1), so its cells run as the full "
            "cache" for tokens in sorted({cell.budget for cell in todo if cell.budget is not None}) if tokens > largest]


def _no_checkpoint(policy, prompt_len: int, budget: int, max_new: int) -> str | None:
    """Why a checkpointed policy's cell (AvoKV-E, R-KV, LazyEviction) would decode nothing from a cache it cut
    -- its first checkpoint at or past the last decode step, so the row would be the full cache's under the
    policy's name -- or None.  A budget that no cache of the cell reaches is the warning's case instead."""
    from ..policies.checkpointed import CheckpointPolicy

    last = max_new - 1  # the last token is generated, never fed back
    if not isinstance(policy, CheckpointPolicy) or budget >= prompt_len + last:
        return None
    if (first := policy.late_first_checkpoint(prompt_len, budget, max_new)) is None:
        return None
    return (f"its first checkpoint would be at step {first}, {'after' if first > last else 'at'} the last decode step "
            f"({last}), so nothing would be decoded from a cache it cut and the row would be the full cache's: raise "
            f"max_new_tokens to at least {first + 2}, or lower its interval")


def _run_sample(config: dict, task: dict, label: str, sample_index: int, group: list[Cell], model, tokenizer,
                seed: int, max_new: int, meta: dict, rows: RowFile, bar) -> int:
    """Every cell of one sample from one shared prefill; returns the rows written."""
    from .. import engine
    from ..policies import make_policy
    from ..tasks import METRICS
    from ..trace import time_split

    # check_cells() judged this sample's prompt and every cell's budget; the prompt is built again rather
    # than kept from there, so that a long sweep does not hold every prompt in memory at once.
    written = 0
    sample = make_sample(task, tokenizer, sample_index, seed, config.get("chat", True))
    prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=config.get("chat", True))
    policies = [make_policy(cell.policy, **dict(cell.params)) for cell in group]
    budgets = [None if cell.policy == "full" else
               engine.resolve_budget(len(prompt_ids), compression=cell.compression, budget=cell.budget)
               for cell in group]
    # One prefill per sample, also for policies that read prompt queries: it records them (up to
    # engine.SHARED_QUERIES_BYTES; past it, Expected Attention, which reads them all, prefills on its own).
    shared = engine.prefill(model, prompt_ids, window=engine.shared_window(policies, model, len(prompt_ids)))
    eos = engine.eos_ids(model, tokenizer)  # the ids decode() stops at
    temperature, top_p = float(config.get("temperature", 0.0)), float(config.get("top_p", 1.0))
    for cell, policy, budget in zip(group, policies, budgets):
        # Every policy's draw d of a sample gets the same random stream (common random numbers): where two
        # policies' distributions agree they sample the same tokens, so a paired difference is the policies'.
        sampler = engine.Sampler(temperature, top_p, seed=_sample_seed(seed, f"{label}/draw{cell.draw}", sample_index))
        t0 = time.perf_counter()
        events = list(engine.decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=max_new,
                                    shared=shared, sampler=sampler))
        elapsed = time.perf_counter() - t0
        steps = events[1:]
        decode_seconds = sum(time_split(events).values())
        prediction = tokenizer.decode([e.new_token_id for e in events], skip_special_tokens=True)
        # One event per generated token; decode() stops after an EOS or at max_new tokens.  A generation whose
        # last token is EOS ended by itself, even when that token is the max_new-th.
        hit_max_tokens = len(events) == max_new and events[-1].new_token_id not in eos
        rows.append({
            "cell": cell.key, "source": "measured", "sweep": config["name"], "task": label,
            "sample": sample_index, "policy": cell.policy, "params": dict(cell.params),
            "policy_params": policy.params(),
            "compression": cell.compression, "absolute_budget": cell.budget, "prompt_len": len(prompt_ids),
            "max_new_tokens": max_new, "temperature": temperature, "top_p": top_p, "draw": cell.draw,
            "chat": config.get("chat", True), "new_tokens": len(events), "hit_max_tokens": hit_max_tokens,
            "budget": budget if budget is not None else len(prompt_ids) + max_new,
            "max_cache": max(e.cache_size for e in events),
            # what decoding held (the prefill's full prompt left out): the active-KV size a compression cell
            # really ran at
            "max_decode_cache": max((e.cache_size for e in steps), default=None), "metric": sample.metric,
            "score": METRICS[sample.metric](prediction, sample.answers), "prediction": prediction,
            "answers": sample.answers, "meta": sample.meta, "prefill_ms": 1e3 * shared.seconds,
            "decode_tok_s": len(steps) / decode_seconds if decode_seconds else None,
            "seconds": elapsed, **meta,
        })
        written += 1
        bar.set_postfix_str(f"{label}#{sample_index}{f'/{cell.draw}' if cell.draw else ''} {cell.policy} {cell.cut}")
        bar.update()
    return written


# A Ray worker's loaded model, kept between its tasks: (model name, device, dtype) -> (model, tokenizer, meta).
_worker_models: dict[tuple, tuple] = {}


def _worker_model(config: dict) -> tuple:
    """The config's model, tokenizer and provenance in this Ray worker, loaded once per worker process."""
    key = (config.get("model", DEFAULT_MODEL), config.get("device", "cpu"), config.get("dtype"))
    if key not in _worker_models:
        _worker_models.clear()  # one model per worker: a new sweep's replaces the last
        _worker_models[key] = loaded(config)
    return _worker_models[key]


def _ray_check(config: dict, todo: list[Cell]) -> list[str]:
    """Ray task: the local runner's checks before anything decodes (:func:`check_lengths`, :func:`check_cells`)
    on a worker that holds the model; returns their notes, or raises the refusal."""
    model, tokenizer, _ = _worker_model(config)
    source = repr(config.get("name"))
    check_lengths(config, model.config.max_position_embeddings, source)
    tasks = {task_label(t): t for t in config["tasks"]}
    return check_cells(config, source, tasks, todo, model, tokenizer, int(config.get("seed", 0)),
                       int(config.get("max_new_tokens", 32)))


def _ray_sample(config: dict, group: list[Cell], before=None) -> list[dict]:
    """Ray task: every cell of ``group`` (one sample's) from one shared prefill, as :func:`run` decodes them;
    returns the rows instead of writing them, so that a retried task cannot write a row twice.  ``before``
    is called with the sample's (task label, index) first (a hook for fault injection in tests)."""
    label, sample_index = group[0].task, group[0].sample
    if before is not None:
        before(label, sample_index)
    if config.get("device", "cpu").startswith("cpu"):
        torch.set_num_threads(1)  # one core per task
    model, tokenizer, meta = _worker_model(config)
    tasks = {task_label(t): t for t in config["tasks"]}
    rows: list[dict] = []
    _run_sample(config, tasks[label], label, sample_index, group, model, tokenizer, int(config.get("seed", 0)),
                int(config.get("max_new_tokens", 32)), meta, rows, tqdm(disable=True))
    return rows


def run_ray(config: dict, out_dir: str | Path, *, address: str | None = None, progress: bool = True,
            config_text: bytes | None = None, max_retries: int = 3, before_sample=None) -> int:
    """Run every unfinished cell of ``config`` over a Ray cluster; return the rows written.

    Each sample's unfinished cells are one Ray task (one shared prefill, as :func:`run` decodes them), with
    one GPU where the config's device is ``cuda`` and one CPU core otherwise.  A task returns its rows and
    the driver alone writes them, to ``out_dir/rows.jsonl`` as tasks finish, each cell once: a task whose
    worker died is rerun by Ray (up to ``max_retries`` times) and only its returned rows count, and a driver
    stopped mid-sweep resumes like the local runner, skipping every cell already in any ``rows*.jsonl``.

    Parameters
    ----------
    config : dict
        A sweep config, checked as :func:`run` checks it.
    out_dir : str or Path
        The sweep's folder (claimed as :func:`run` claims it).
    address : str, optional
        An existing Ray cluster; without one, a Ray started here on loopback (or the one this process has
        already initialised, left running).
    progress : bool
        Show a progress bar over cells.
    config_text : bytes, optional
        The config file's text, saved in ``out_dir`` (:func:`claim`).
    max_retries : int
        How many times Ray reruns a task whose worker died.
    before_sample : callable, optional
        Called in the worker with (task label, sample index) before the sample's cells.

    Returns
    -------
    int
        The rows this run added.
    """
    out_dir = Path(out_dir)
    source = repr(config.get("name"))
    validate(config, source)
    with claim(out_dir, config, config_text), RowFile(out_dir / "rows.jsonl") as rows:
        return _run_ray(config, out_dir, rows, source, address, progress, max_retries, before_sample)


def _run_ray(config: dict, out_dir: Path, rows: RowFile, source: str, address: str | None, progress: bool,
             max_retries: int, before_sample) -> int:
    import ray

    done = rows.done | finished_cells(out_dir, skip=rows.path)
    todo = [cell for cell in cells(config) if cell.key not in done]
    if not todo:
        return 0
    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if address:
            ray.init(address=address, log_to_driver=False)
        else:  # a local Ray on loopback
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    try:
        gpu = str(config.get("device", "cpu")).startswith("cuda")
        if gpu and ray.cluster_resources().get("GPU", 0) < 1:
            raise ValueError(f"sweep config {source}: device {config.get('device')!r} needs GPUs, and the Ray "
                             "cluster has none; start its workers on GPU machines, or run on device = \"cpu\"")
        # A GPU task would otherwise get a fresh worker process (and reload the model) each time
        options = {"num_gpus": 1, "num_cpus": 1, "max_calls": 0} if gpu else {"num_cpus": 1}
        check = ray.remote(max_retries=max_retries, **options)(_ray_check)
        try:
            notes = ray.get(check.remote(config, todo))
        except ray.exceptions.RayTaskError as error:  # the refusal as the local runner raises it
            raise error.cause if isinstance(error.cause, ValueError) else error
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        sample_task = ray.remote(max_retries=max_retries, **options)(_ray_sample)
        pending = {}
        for _, group in itertools.groupby(todo, key=lambda cell: (cell.task, cell.sample)):
            group = list(group)
            pending[sample_task.remote(config, group, before_sample)] = {cell.key for cell in group}
        written = 0
        bar = tqdm(total=len(todo), desc=config["name"], unit="cell", disable=not progress, file=sys.stderr)
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                asked = pending.pop(ready[0])
                for row in ray.get(ready[0]):
                    if row["cell"] in asked and row["cell"] not in rows.done:
                        rows.append(row)
                        written += 1
                        bar.update()
        finally:
            bar.close()
        return written
    finally:
        if started:
            ray.shutdown()
