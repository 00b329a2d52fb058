"""A sweep config's schema, declared once, and the checks that refuse a bad config before any model loads.

Each table of a config (the top level, a policy, a task of each kind) is a :class:`Key` per key: how to check
its value and whether it must be there.  :func:`check_table` walks any of them the same way; a refusal names
the config, the table, the key and what to change.  The run's own settings (compression, budget, sampling,
length) are checked by :mod:`kvviz.settings`, as the engine, the command line and the app check them.

The config itself stays the TOML's dict: rows and the saved ``config.toml`` are made from it unchanged.
"""

from __future__ import annotations

import inspect
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from .. import settings
from ..models import DEFAULT_MODEL, DTYPES
from ..settings import SWEEP_NAMES, SettingError
from .sweep_cells import BENCHMARKS, _describe, _lengths, policy_settings, setting_grids, task_label

Check = Callable[[Any], "str | None"]  # the rule a value breaks ("must be ..."), or None where it is fine


@dataclass(frozen=True)
class Key:
    """One key of a config table."""

    check: Check
    required: bool = False
    absent: str | None = None  # the refusal of a required key left out (default: "has no 'key'; add key = ...")


def check_table(table: dict, schema: dict[str, Key], unknown: Callable[[str], ValueError],
                absent: Callable[[str, Key], ValueError], broken: Callable[[str, str], ValueError]) -> None:
    """Refuse ``table``'s first key the schema lacks, then its first required key missing, then its first
    value its key's check refuses; the three callables make the refusal in the table's own words."""
    extra = sorted(set(table) - set(schema))
    if extra:
        raise unknown(extra[0])
    for key, spec in schema.items():
        if spec.required and key not in table:
            raise absent(key, spec)
    for key, spec in schema.items():
        if key in table and (rule := spec.check(table[key])):
            raise broken(key, rule)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# -- checks of one value -----------------------------------------------------------------------------------

def _non_empty_string(key: str, value) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return f'must be a non-empty string, e.g. {key} = "..."'
    return None


def _folder_name(value) -> str | None:
    # also the sweep's folder under results_db/ (without --out): one plain folder name
    if rule := _non_empty_string("name", value):
        return rule
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
        return (f"{value!r} must be a plain folder name (letters, digits, '.', '_', '-'; no '/' and not starting "
                'with \'.\'), as it names the sweep\'s folder, e.g. name = "sweep-2k"')
    return None


def _dtype(value) -> str | None:
    if value not in DTYPES:
        return (f"must be one of {', '.join(DTYPES)}, got {value!r} (leave it out for float32 on the CPU and "
                "bfloat16 on a GPU)")
    return None


def _backend(value) -> str | None:
    from ..backend import BACKENDS

    if value not in BACKENDS:
        return (f"must be one of {', '.join(BACKENDS)}, got {value!r} (auto: the static backend on a GPU for the "
                "policies it runs, the engine otherwise)")
    return None


def _boolean(value) -> str | None:
    return None if isinstance(value, bool) else f"must be true or false, got {value!r}"


def _setting(check: Callable, field: str, value, *, whole: bool = False) -> str | None:
    """A run setting, as :mod:`kvviz.settings` judges it; ``whole``: TOML's integer type too (3.0 is a float,
    and a row or the saved config would carry it as one)."""
    if whole and not _is_int(value):
        return f"must be a whole number, got {value!r}"
    try:
        check(value, SWEEP_NAMES[field])
    except SettingError as error:
        return error.rule
    return None


def _count(value, what: str = "") -> str | None:
    if not (_is_int(value) and value >= 1):
        return f"must be a whole number >= 1{what}, got {value!r}"
    return None


def _ratios(value) -> str | None:
    if not isinstance(value, list) or not value:
        return f"must be a list of ratios in [0, 1), e.g. compression = [0.5, 0.9]; got {value!r}"
    for rho in value:
        try:
            settings.compression(rho, "each ratio")
        except SettingError as error:
            return str(error)
    if len(set(value)) != len(value):
        return "lists a ratio twice; list each once"
    return None


def _budgets(value) -> str | None:
    if not isinstance(value, list) or not value:
        return f"must be a list of absolute budgets in tokens, e.g. budget = [128, 256]; got {value!r}"
    for tokens in value:
        if not _is_int(tokens):  # TOML's 64.0 is a float, which the rows would store as one
            return f"{tokens!r} is not a budget in tokens: write a whole number >= 1, without a point"
        try:
            settings.budget(tokens, "each budget")
        except SettingError as error:
            return str(error)
    if len(set(value)) != len(value):
        return "lists a budget twice; list each once"
    return None


# -- the tables --------------------------------------------------------------------------------------------

SWEEP: dict[str, Key] = {
    "name": Key(_folder_name, required=True),
    "model": Key(partial(_non_empty_string, "model")),
    "device": Key(partial(_non_empty_string, "device")),
    "dtype": Key(_dtype),
    "backend": Key(_backend),
    "chat": Key(_boolean),
    "max_new_tokens": Key(partial(_setting, settings.max_new_tokens, "max_new_tokens", whole=True)),
    "seed": Key(partial(_setting, settings.seed, "seed", whole=True)),
    "temperature": Key(partial(_setting, settings.temperature, "temperature")),
    "top_p": Key(partial(_setting, settings.top_p, "top_p")),
    "draws": Key(partial(_count, what=" (generations per sample)")),
    "compression": Key(_ratios),
    "budget": Key(_budgets),
    "tasks": Key(lambda value: None if isinstance(value, list) and value and all(isinstance(t, dict) for t in value)
                 else 'must be a list of tables, e.g. tasks = [{ name = "single_needle", length = 2000, '
                      'samples = 20 }]', required=True),
    "policies": Key(lambda value: None if isinstance(value, list) and value else
                    'must be a list of names or tables, e.g. policies = ["full", { name = "inertia", params = '
                    '{ alpha = [0.5, 0.8] } }]', required=True),
}
TOP_LEVEL = tuple(SWEEP)


def _params(value) -> str | None:
    if not isinstance(value, dict):
        return f"params must be a table, e.g. params = {{ alpha = [0.5, 0.8] }}; got {value!r}"
    for key, given in value.items():
        values = given if isinstance(given, list) else [given]
        if not values or not all(isinstance(v, (str, int, float, bool)) for v in values):
            return f"params {key} must be a value or a non-empty list of values, got {given!r}"
    return None


def _prefixed(key: str, check: Check) -> Check:
    """``check`` whose rule is told after the key (a table's refusal names the table, not the key)."""
    return lambda value: (rule := check(value)) and f"{key} {rule}"


POLICY: dict[str, Key] = {
    "name": Key(lambda value: None, required=True),
    "params": Key(_params),
    "compression": Key(_ratios),
    "budget": Key(_budgets),
}


def _label(value) -> str | None:
    return None if isinstance(value, str) and value.strip() else f"label must be a non-empty string, got {value!r}"


def _haystack(value) -> str | None:
    from ..tasks.synthetic import HAYSTACKS

    return None if value in HAYSTACKS else f"haystack must be one of {', '.join(HAYSTACKS)}, got {value!r}"


def _number_list(key: str, example: str, kind: str, valid: Callable) -> Key:
    def check(values) -> str | None:
        if not isinstance(values, list) or not values:
            return f"{key} must be a non-empty list, e.g. {key} = {example}; got {values!r}"
        bad = [v for v in values if not valid(v)]
        return f"{key} must hold {kind}, got {bad[0]!r}" if bad else None

    return Key(check, required=True, absent=check(None))


NEEDLE_GRID: dict[str, Key] = {
    "name": Key(lambda value: None), "label": Key(_label),
    "lengths": _number_list("lengths", "[1000, 2000]", "whole numbers >= 1", lambda v: _is_int(v) and v >= 1),
    "depths": _number_list("depths", "[0.0, 0.5, 1.0]", "numbers in [0, 1]", lambda v: _is_number(v) and 0 <= v <= 1),
    "haystack": Key(_haystack),
}
NEEDLE_GRID_KEYS = tuple(NEEDLE_GRID)


def _count_key(key: str, required: bool = True) -> Key:
    return Key(_prefixed(key, _count), required=required, absent=f"has no {key!r}; add {key} = N (a whole number >= 1)")


def _string_key(key: str) -> Key:
    return Key(lambda value: None if isinstance(value, str) else f"{key} must be a string, got {value!r}")


def _benchmark_schema(name: str) -> dict[str, Key]:
    """A public benchmark's task table (kvviz.tasks.loaders): its records, from the hub or a local file."""
    from ..tasks.loaders import LONGBENCH_METRICS, RULER_LENGTHS, RULER_SUBTASKS

    def subtask(value) -> str | None:
        if name == "ruler" and value not in RULER_SUBTASKS:
            return f"task must be a RULER subtask, one of {', '.join(RULER_SUBTASKS)}; got {value!r}"
        if name == "longbench" and value not in LONGBENCH_METRICS:
            return f"task must be a LongBench task, one of {', '.join(sorted(LONGBENCH_METRICS))}; got {value!r}"
        return _string_key("task").check(value)

    def max_length(value) -> str | None:
        if name != "ruler":
            return "max_length picks one of RULER's sequence lengths; for other benchmarks use truncate = N"
        if value not in RULER_LENGTHS:
            return f"max_length must be one of RULER's lengths, {', '.join(map(str, RULER_LENGTHS))}; got {value!r}"
        return None

    def path(value) -> str | None:
        if rule := _string_key("path").check(value):
            return rule
        if not Path(value).is_file():
            return f"path {value!r} is not a file; give the local JSONL of records, or leave path out to read the hub"
        return None

    return {"name": Key(lambda value: None), "label": Key(_label),
            "task": Key(subtask, required=name == "longbench", absent=subtask(None)),
            "samples": _count_key("samples"), "path": Key(path), "split": _string_key("split"),
            "truncate": _count_key("truncate", required=False), "max_length": Key(max_length)}


BENCHMARK_KEYS = ("name", "label", "task", "samples", "path", "split", "truncate", "max_length")


def _task_options(name: str) -> dict:
    """A generator's own keyword arguments (after tokenizer, length and seed): the task's options in a config.
    ``chat`` is the sweep's (the prompt is fitted as the sweep encodes it) and ``index`` the sample's (the sweep
    passes it), so neither is one."""
    from ..tasks import TASKS

    options = dict(list(inspect.signature(TASKS[name]).parameters.items())[3:])
    options.pop("chat")
    options.pop("index", None)
    return options


def _option(key: str, default) -> Key:
    """A generator option's key, checked as its default's type."""
    def check(value) -> str | None:
        if isinstance(default, bool) and not isinstance(value, bool):
            return f"{key} must be true or false, got {value!r}"
        if _is_int(default) and not (_is_int(value) and value >= 1):
            return f"{key} must be a whole number >= 1, got {value!r}"
        if key == "depth" and not (_is_number(value) and 0 <= value <= 1):
            return f"depth must be a number in [0, 1], got {value!r}"
        if key == "haystack":
            return _haystack(value)
        return None

    return Key(check)


def _generator_schema(name: str) -> dict[str, Key]:
    """A generated task's table: its length (an optional upper bound for the short-prompt tasks), samples, and
    the generator's own options."""
    from ..tasks.synthetic import SHORT_PROMPT_TASKS

    return {"name": Key(lambda value: None), "label": Key(_label),
            "length": _count_key("length", required=name not in SHORT_PROMPT_TASKS), "samples": _count_key("samples"),
            **{key: _option(key, option.default) for key, option in _task_options(name).items()}}


def task_schema(name: str) -> tuple[dict[str, Key], str]:
    """The schema of a task named ``name``, and how its unknown-key refusal lists the keys it takes."""
    if name == "needle_grid":
        return NEEDLE_GRID, f"a needle grid takes {', '.join(NEEDLE_GRID)}"
    if name in BENCHMARKS:
        return _benchmark_schema(name), f"a benchmark task takes {', '.join(BENCHMARK_KEYS)}"
    schema = _generator_schema(name)
    return schema, f"{name} takes " + ", ".join(schema)


# -- the whole config --------------------------------------------------------------------------------------

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


def validate(config: dict, source: str = "the sweep config") -> None:
    """Check every key of a sweep config; a problem is a ValueError naming ``source``, the table, the key and
    what to change, so that a bad config fails before a model loads rather than as a traceback mid-sweep."""
    def refuse(where: str, message: str) -> ValueError:
        return ValueError(f"sweep config {source}: {where}: {message}")

    check_table(config, SWEEP,
                unknown=lambda key: refuse(f"key {key!r}", f"not a sweep setting; the keys are {', '.join(TOP_LEVEL)}"),
                absent=lambda key, _: ValueError(f"sweep config {source} has no {key!r}"),
                broken=lambda key, rule: refuse(f"key {key!r}", rule))
    if "compression" not in config and "budget" not in config:
        raise ValueError(f"sweep config {source} has neither 'compression' nor 'budget'; add compression = "
                         "[0.5, 0.9] (ratios of the prompt) or budget = [128, 256] (tokens), or both")
    _check_sampling(config, refuse)
    _check_tasks(config["tasks"], refuse)
    seen = _check_policies(config["policies"], refuse)
    _check_feasible(config, seen, source, refuse)


def _check_sampling(config: dict, refuse) -> None:
    """What sampling means only together: top_p and draws apply only when sampling."""
    temperature, top_p, draws = config.get("temperature", 0.0), config.get("top_p", 1.0), config.get("draws", 1)
    if top_p != 1 and temperature == 0:
        raise refuse("key 'top_p'", "only applies when sampling: set temperature > 0 (e.g. 0.6), or drop top_p")
    if draws > 1 and temperature == 0:
        raise refuse("key 'draws'", f"{draws} greedy generations would all be the same: set temperature > 0 "
                                    "(e.g. 0.6) to sample them, or drop draws")


def _check_tasks(tasks: list[dict], refuse) -> None:
    from ..tasks import TASKS

    labels: dict[str, int] = {}
    choices = ", ".join([*TASKS, "needle_grid", *BENCHMARKS])
    for index, task in enumerate(tasks):
        name = task.get("name")
        if not isinstance(name, str):
            raise refuse(f"tasks[{index}]", f'has no name; write {{ name = "single_needle", length = 2000, '
                                            f'samples = 20 }} (tasks: {choices})')
        where = f"tasks[{index}] ({name})"
        if name not in TASKS and name != "needle_grid" and name not in BENCHMARKS:
            raise refuse(where, f"unknown task {name!r}; choose one of {choices}")
        if "chat" in task and name in TASKS:
            raise refuse(where, "chat is the sweep's setting, not a task's: set chat = false at the top of the "
                                "config (it fits every prompt to its length and encodes it the same way)")
        schema, takes = task_schema(name)
        check_table(task, schema,
                    unknown=lambda key, where=where, takes=takes: refuse(where, f"unknown key {key!r}; {takes}"),
                    absent=lambda key, spec, where=where: refuse(where, spec.absent or f"has no {key!r}"),
                    broken=lambda key, rule, where=where: refuse(where, rule))
        label = task_label(task)
        if label in labels:
            raise refuse(f"tasks[{index}]", f"has the same label {label!r} as tasks[{labels[label]}]; "
                                            'give one of them label = "..."')
        labels[label] = index


def _check_policies(policies: list, refuse) -> dict[str, tuple[int, tuple]]:
    """Each policy entry against :data:`POLICY` and the registry; returns each setting's label -> (its entry's
    index, the setting), refusing a setting listed twice however it is spelt."""
    from ..policies import REGISTRY, setting_label

    seen: dict[str, tuple[int, tuple]] = {}
    for index, entry in enumerate(policies):
        where = f"policies[{index}]"
        if isinstance(entry, dict):
            if not isinstance(entry.get("name"), str):
                raise refuse(where, 'has no name; write { name = "inertia", params = { ... } }')
            where = f"policies[{index}] ({entry['name']})"
            check_table(entry, POLICY,
                        unknown=lambda key, where=where: refuse(where, f"unknown key {key!r}; a policy table has "
                                                                       "name, params and compression or budget"),
                        absent=lambda key, _, where=where: refuse(where, f"has no {key!r}"),
                        # a policy's own grid is named as a key of it ("policies[0] (snapkv) compression: ...")
                        broken=lambda key, rule, where=where: refuse(where if key == "params" else f"{where} {key}",
                                                                     rule))
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
    return seen


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


def _check_feasible(config: dict, seen: dict, source: str, refuse) -> None:
    """Every cell's budget at the tasks' nominal lengths: a compression that leaves no cache, or a budget a
    policy refuses, fails here and not hours into the sweep."""
    grids = setting_grids(config)
    if any(name != "full" for _, (name, _) in seen.values()):
        rhos = sorted({rho for (name, _), (ratios, _) in grids.items() if name != "full" for rho in ratios})
        for index, task in enumerate(config["tasks"]):
            for length in _lengths(task):
                for rho in rhos:
                    if settings.compressed(length, rho) < 1:
                        raise refuse(f"tasks[{index}] ({task_label(task)})",
                                     f"compression {rho} leaves no cache for a {length}-token prompt; "
                                     "lower the compression or raise the length")
    infeasible = unrunnable_cells(config, grids)
    if infeasible:
        raise refused_cells(source, "", infeasible, "raise the task's length")


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
                budget, error = budget_refusal(name, params, length, rho, budget=tokens)
                if error:
                    problems.append(("compression" if tokens is None else "budget",
                                     f"{_describe((name, params))} at {cut_words(rho, tokens)} on {task_label(task)}"
                                     + (f" ({length} tokens, budget {budget})" if lengths else "") + f": {error}"))
    return problems


def cut_words(compression: float | None, budget: int | None) -> str:
    return f"budget {budget}" if budget is not None else f"compression {compression}"


def budget_refusal(name: str, params: tuple, prompt_len: int, compression: float | None,
                   num_layers: int = 0, budget: int | None = None) -> tuple[int, str | None]:
    """The budget a cell gets (from ``compression`` of the prompt, or the absolute ``budget``), and the
    policy's reason to refuse it (None: it runs); ``num_layers`` is 0 while no model is known."""
    from ..policies import make_policy

    budget = settings.resolve_budget(prompt_len, compression=compression, budget=budget)
    try:
        make_policy(name, **dict(params)).reset(prompt_len, budget, num_layers)
    except ValueError as error:
        return budget, str(error)
    return budget, None


def refused_cells(source: str, where: str, problems: list[tuple[str, str]], longer: str) -> ValueError:
    """One error listing the cells that cannot run (the first six), with what to change in the config;
    ``problems`` are (``"compression"`` or ``"budget"``, line) pairs."""
    lines = [line for _, line in problems]
    kinds = sorted({kind for kind, _ in problems})
    shown_lines = "; ".join(lines[:6]) + (f"; and {len(lines) - 6} more" if len(lines) > 6 else "")
    examples = {"compression": 'give it its own compressions (e.g. { name = "snapkv", compression = [0.5, 0.75] })',
                "budget": 'give it its own budgets (e.g. { name = "avokv", budget = [64, 128] })'}
    return ValueError(f"sweep config {source}: {len(lines)} policy × task × {' or '.join(kinds)} cell(s) cannot "
                      f"run{where}: {shown_lines}. In the config: change such a policy's params, or, where its budget "
                      f"is too small, {' or '.join(examples[kind] for kind in kinds)}"
                      # a longer prompt gives a compression more room, never an absolute budget
                      + (f" or {longer}" if "compression" in kinds else ""))


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


__all__ = ["BENCHMARK_KEYS", "Key", "NEEDLE_GRID_KEYS", "SWEEP", "TOP_LEVEL", "check_lengths", "check_table",
           "load_config", "model_context", "read_toml", "task_schema", "unrunnable_cells", "validate"]
