"""Damage-ranking sweep: AvoKV-E's oracle ranking table (its Table 3) measured on our own traces.

For each sample of a task the model decodes greedily with the full cache; at decode step ``step`` the damage
probe (:mod:`kvviz.probe`) removes each candidate entry in turn and replays the next ``future`` tokens, and
every policy's utility at that step is read from its own run up to there.  Per trace (sample) it then asks how
well each utility ranks that trace's damage, over the entries every policy judged (:func:`probe.aligned_quality`,
the high-damage label the top decile *within the trace*, as AvoKV-E's Appendix D labels): AUROC, average
precision, top-k recall, false-safe rate and Spearman.  Each (trace, policy, metric) is one row of the results
store (``metric`` = ``auroc``, ``ap``, ``topk_recall``, ``false_safe_rate``, ``spearman``, as the paper rows
name them), so the Results tab draws the mean over traces with its standard error next to the paper's numbers.

The paper prints one figure over 5,440 candidates from 30 DeepSeek-R1 AIME-2024 traces; here a trace is one
probe step of a short generation of a small model, so compare which policy ranks better, not the levels.

A config (the keys; ``configs/ranking-arithmetic.toml`` is the shipped one)::

    name = "my-ranking"  # its folder under results_db/
    model = "SmolLM2-135M-Instruct"
    chat = true
    seed = 0
    step = 64            # the decode step probed in each trace
    future = 8           # tokens replayed after it (W_fut of AvoKV-E's Appendix D; Table 3 gives none)
    sample = 64          # optional: a seeded sample of the candidates (default: every entry before the step)
    candidates = "generated"  # optional: rank only the entries the model generated (default "all": the
                              # prompt's too, which a short prompt's chat template can outnumber)
    tasks = [{ name = "arithmetic_reasoning", samples = 20 }]
    policies = ["inertia", "tova", "rkv", "avokv", { name = "avokv", params = { lambda_b = 0.0 } }]

A row's ``meta`` also says where the full-cache answer ended (``ended_at``, new tokens; null past step +
future: a trace that ends sooner replays tokens after its answer), how many of the ranked and of the
high-damage entries are the prompt's (``prompt_ranked``, ``prompt_high_damage``) and the share of the ranked
entries that the policy's largest tie holds (``largest_tie``: AP, top-k recall and the false-safe rate break
ties as the policies do, the oldest evicted first; AUROC gives them half credit).

Run (resumable, one trace at a time) with ``kvviz bench ranking configs/ranking-arithmetic.toml``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from ..models import DEFAULT_MODEL
from ..policies.snapkv import SnapKV
from . import sweep

# What the sweep validator is given as the budget: past any cache, so that it judges no policy's budget rule.
NO_BUDGET = 2**31 - 1
KEYS = ("name", "model", "device", "dtype", "chat", "seed", "step", "future", "sample", "candidates", "batch", "tasks",
        "policies")
POOLS = ("all", "generated")  # the candidates key: every entry before the probed step, or the generated ones
# The row's metric name (as the paper rows spell it) -> the key of probe.ranking_quality's result.
METRICS = {"auroc": "auroc", "ap": "average_precision", "topk_recall": "topk_recall",
           "false_safe_rate": "false_safe_rate", "spearman": "spearman"}


def load_config(path: str | Path) -> dict:
    """Read a ranking config and check all of it (:func:`validate`) before any model is loaded."""
    config = sweep.read_toml(path, "ranking config")
    validate(config, str(path))
    context = sweep.model_context(config.get("model", DEFAULT_MODEL))
    if context is not None:  # else the probe checks each prompt once the model is loaded
        check_lengths(config, context, str(path))
    return config


def validate(config: dict, source: str = "the ranking config") -> None:
    """Check every key; a problem is a ValueError naming ``source``, the key and what to change."""
    _check_keys(config, source)
    _check_policy_entries(config, source)
    # The rest as a sweep reads it (name, model, chat, seed, the tasks, each policy's name and params, a
    # setting listed twice), at a budget no cache reaches: the probe scores with the cache whole, so no
    # policy's own budget rule (a protected tail longer than B) can refuse a cell here.
    try:
        sweep.validate({**{k: v for k, v in config.items() if k in sweep.TOP_LEVEL}, "budget": [NO_BUDGET]}, source)
    except ValueError as error:  # in a ranking config's words: a policy table here has no cut of the cache
        raise ValueError(str(error).replace("sweep config", "ranking config", 1)
                         .replace("has name, params and compression or budget", "has name and params")) from None
    _check_settings(config, source)


def _refuse(source: str, where: str, message: str) -> ValueError:
    return ValueError(f"ranking config {source}: {where}: {message}")


def _check_keys(config: dict, source: str) -> None:
    """The top-level keys: none unknown, the required ones present, the numbers and the candidate pool."""
    unknown = sorted(set(config) - set(KEYS))
    if unknown:
        raise _refuse(source, f"key {unknown[0]!r}", f"not a ranking setting; the keys are {', '.join(KEYS)}")
    for required in ("name", "tasks", "policies", "step"):
        if required not in config:
            raise ValueError(f"ranking config {source} has no {required!r}")
    for key, least in (("step", 1), ("future", 1), ("sample", 2), ("batch", 1)):
        if key in config and not (sweep._is_int(config[key]) and config[key] >= least):
            raise _refuse(source, f"key {key!r}", f"must be a whole number >= {least}, got {config[key]!r}")
    if config.get("candidates", "all") not in POOLS:
        raise _refuse(source, "key 'candidates'",
                      f"must be {' or '.join(map(repr, POOLS))}, got {config['candidates']!r}")
    if config.get("candidates") == "generated" and int(config["step"]) < 2:
        raise _refuse(source, "key 'step'", "with candidates = \"generated\" the step must be >= 2: at step 1 "
                                            "the model has generated no entry to rank")


def _check_policy_entries(config: dict, source: str) -> None:
    """``policies`` is a list whose tables cut no cache (a probe scores it whole)."""
    if not isinstance(config["policies"], list):
        raise _refuse(source, "key 'policies'", 'must be a list, e.g. policies = ["inertia", "avokv"]')
    for index, entry in enumerate(config["policies"]):
        if isinstance(entry, dict) and ("compression" in entry or "budget" in entry):
            raise _refuse(source, f"policies[{index}]", "a probe scores the whole cache, at no compression or "
                                                        "budget: drop compression and budget")


def _check_settings(config: dict, source: str) -> None:
    """At least two policy settings, each keeping a per-entry utility that a probe can read."""
    from ..policies import make_policy
    from ..policies.base import Policy

    settings = sweep.policy_settings(config)
    if len(settings) < 2:
        raise _refuse(source, "key 'policies'", "give at least two settings to rank against each other, e.g. "
                                                'policies = ["inertia", "avokv"]')
    for name, params in settings:
        policy = make_policy(name, **dict(params))
        if type(policy).utility is Policy.utility:  # full, streaming, random
            raise _refuse(source, f"policies ({name})", "keeps no per-entry utility, so it ranks nothing; leave it out")
        if isinstance(policy, SnapKV):  # it scores only when it compresses the prompt, which a probe never does
            raise _refuse(source, f"policies ({name})", "scores entries only when it compresses the prompt at "
                                                        "prefill, and a probe keeps the cache whole; leave it out")


def check_lengths(config: dict, context: int, source: str) -> None:
    """Refuse a task whose prompt length plus ``step + future`` decoded tokens exceeds the model's context,
    as a sweep refuses one past its ``max_new_tokens`` (before the model loads, where its config says)."""
    decoded = int(config["step"]) + int(config.get("future", 8))
    try:
        sweep.check_lengths({**config, "max_new_tokens": decoded}, context, source)
    except ValueError as error:
        raise ValueError(str(error).replace("sweep config", "ranking config", 1)
                         .replace("max_new_tokens", "step + future")) from None


def cell_key(task: str, sample: int, setting: tuple, metric: str) -> str:
    """One row's key: never a sweep cell's, whose fifth element is a compression or a budget, not a metric."""
    name, params = setting
    return json.dumps([task, sample, name, [list(pair) for pair in params], metric])


def traces(config: dict) -> list[tuple[dict, str, int]]:
    """Every (task, label, sample) of the config, in order."""
    return [(task, sweep.task_label(task), sample) for task in config["tasks"]
            for sample in range(sweep.sample_count(task))]


def status(config: dict, out_dir: str | Path) -> dict[str, tuple[int, int]]:
    """Finished and total traces per task label in ``out_dir`` (a trace is finished when all its rows are)."""
    done = sweep.finished_cells(out_dir)
    settings = sweep.policy_settings(config)
    counts: dict[str, list[int]] = {}
    for _, label, sample in traces(config):
        entry = counts.setdefault(label, [0, 0])
        entry[0] += all(cell_key(label, sample, s, m) in done for s in settings for m in METRICS)
        entry[1] += 1
    return {label: (finished, total) for label, (finished, total) in counts.items()}


def run(config: dict, out_dir: str | Path, *, model=None, tokenizer=None, progress: bool = True,
        config_text: bytes | None = None) -> int:
    """Probe every unfinished trace of ``config`` and write its rows to ``out_dir/rows.jsonl``; returns the
    rows written.  A trace's rows are written together once it is probed, so a stopped run loses at most the
    trace in progress, and a rerun continues with it.  ``config_text``: the config file's text, saved in
    ``out_dir`` (:func:`kvviz.bench.sweep.claim`)."""
    out_dir = Path(out_dir)
    source = repr(config.get("name"))
    validate(config, source)
    with sweep.claim(out_dir, config, config_text), sweep.RowFile(out_dir / "rows.jsonl") as rows:
        return _run_traces(config, rows, model, tokenizer, progress)


def _run_traces(config: dict, rows: sweep.RowFile, model, tokenizer, progress: bool) -> int:
    settings = sweep.policy_settings(config)
    todo = [(task, label, sample) for task, label, sample in traces(config)
            if not all(cell_key(label, sample, s, m) in rows.done for s in settings for m in METRICS)]
    if not todo:
        return 0
    model, tokenizer, meta = sweep.loaded(config, model, tokenizer)
    seed = int(config.get("seed", 0))
    written = 0
    bar = tqdm(total=len(todo), desc=config["name"], unit="trace", disable=not progress, file=sys.stderr)
    try:
        for task, label, sample in todo:
            written += _probe_trace(config, task, label, sample, settings, model, tokenizer, seed, meta, rows,
                                    warn=written == 0)
            bar.set_postfix_str(f"{label}#{sample}")
            bar.update()
    finally:
        bar.close()
    return written


def _probe_trace(config: dict, task: dict, label: str, sample_index: int, settings: list[tuple], model, tokenizer,
                 seed: int, meta: dict, rows: sweep.RowFile, warn: bool = False) -> int:
    """Probe one trace and append its (policy, metric) rows that are not stored yet; returns how many."""
    from .. import engine, probe
    from ..policies import make_policy, setting_label

    chat = config.get("chat", True)
    step, future = int(config["step"]), int(config.get("future", 8))
    sample = sweep.make_sample(task, tokenizer, sample_index, seed, chat)
    prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=chat)
    where = f"ranking config {config['name']!r}: {label} sample {sample_index}"
    try:
        probe.check_fits(model, prompt_ids, step, future, step_name="step", future_name="future")
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    built = [make_policy(name, **dict(params)) for name, params in settings]
    names = [setting_label(policy) for policy in built]  # as the store and the Compare tab name them
    policies = dict(zip(names, built))
    if warn:  # what the policies never judge at this step: said once, as `kvviz probe` says it
        note = probe.protection_note(policies, len(prompt_ids), step)
        if note:
            print(f"note: {note}", file=sys.stderr)
    start = time.perf_counter()
    result, quality, aligned = _probed(config, model, tokenizer, prompt_ids, names, policies, label, sample_index,
                                       seed, where)
    seconds = time.perf_counter() - start
    traced = {"step": step, "future": future, **_trace_counts(result, aligned, prompt_ids, model, tokenizer)}
    # AP, top-k recall and the false-safe rate break ties as the policies do, AUROC gives them half credit:
    # how much of each ranking one tied score is says how far to trust the first three
    ties = {name: probe.largest_tie(result.utilities[name][aligned]) for name in names}
    written = 0
    for setting, name in zip(settings, names):
        for metric, key in METRICS.items():
            cell = cell_key(label, sample_index, setting, metric)
            if cell in rows.done:
                continue
            value = quality[name][key]
            rows.append({
                "cell": cell, "source": "measured", "sweep": config["name"], "task": label, "sample": sample_index,
                "policy": setting[0], "params": dict(setting[1]), "policy_params": policies[name].params(),
                "compression": None, "absolute_budget": None,
                "prompt_len": len(prompt_ids), "max_new_tokens": step + future, "chat": chat,
                "temperature": 0.0, "top_p": 1.0, "metric": metric,
                # undefined (a utility constant over the entries: Spearman has no order to correlate) is
                # stored as null, which the store's means leave out, never as NaN, which it refuses
                "score": None if value != value else value,
                "meta": {**traced, "largest_tie": ties[name],
                         **({"auroc_p": quality[name]["auroc_p"]} if metric == "auroc" else {})},
                "seconds": seconds, **meta,
            })
            written += 1
    return written


def _probed(config: dict, model, tokenizer, prompt_ids: list[int], names: list[str], policies: dict, label: str,
            sample_index: int, seed: int, where: str) -> tuple:
    """The probe of one trace at the config's step, and each policy's ranking quality against its damage:
    ``(result, quality, aligned)`` as :func:`kvviz.probe.aligned_quality` gives them."""
    from .. import probe

    step, future = int(config["step"]), int(config.get("future", 8))
    result = probe.probe(model, tokenizer, prompt_ids, step, policies=policies, sample=config.get("sample"),
                         seed=sweep._sample_seed(seed, f"{label}/candidates", sample_index), future=future,
                         batch=int(config.get("batch", 16)), generated_only=config.get("candidates") == "generated")
    unscored = [name for name in names if name not in result.utilities]
    if unscored:  # a policy whose utility exists only after some event this probe never reached
        raise ValueError(f"{where}: {', '.join(unscored)} had no utility at step {step}; leave "
                         f"{'it' if len(unscored) == 1 else 'them'} out")
    try:
        quality, aligned = probe.aligned_quality(result.utilities, result.damage)
    except ValueError as error:
        raise ValueError(f"{where}: {error}") from None
    return result, quality, aligned


def _trace_counts(result, aligned, prompt_ids: list[int], model, tokenizer) -> dict:
    """What one trace's rows say of it beside their score: the entries ranked, aligned and high-damage, and
    where the full-cache answer ended."""
    from .. import engine, probe

    high = probe.top_decile(result.damage[aligned])
    # A short prompt's entries (most of them the chat template's, the same in every trace) can outnumber the
    # generated ones: how many of each count says what a ranking was mostly asked to tell apart
    from_prompt = result.candidates[aligned] < len(prompt_ids)
    # Where the full-cache answer ended (new tokens up to its end-of-sequence; null: not within step + future):
    # the probe decodes past it, so a trace that ends before step + future replays tokens after its answer
    eos = engine.eos_ids(model, tokenizer)
    generated = result.sequence[len(prompt_ids):]
    ended = next((index + 1 for index, token in enumerate(generated) if token in eos), None)
    return {"candidates": len(result.candidates), "aligned": int(aligned.sum()), "high_damage": int(high.sum()),
            "ended_at": ended, "prompt_ranked": int(from_prompt.sum()),
            "prompt_high_damage": int((from_prompt & high).sum())}
