"""``kvviz bench run CONFIG``: a resumable, crash-safe sweep over tasks x samples x policies x budgets.

A config (TOML) names the model, the tasks (generator, prompt length, samples, options), the policies
(each with optional parameter lists to sweep) and the budgets: compressions ρ of the prompt (B = ⌊(1 − ρ)·L0⌋),
absolute budgets in tokens (which may exceed the prompt: eviction then starts once generation fills the
cache, AvoKV-E's long-reasoning regime), or both.  Each *cell* -- one sample under one policy setting at one
compression or budget -- becomes one JSON row in ``OUT/rows.jsonl``, written with a single
``write`` and ``fsync``.  On start the file is cut back to its last complete line, finished cells are
skipped, so a SIGKILL loses at most the cell in flight and never duplicates a row.

All policies of one sample share one prefill (:func:`kvviz.engine.prefill`); it records the last prompt
queries that the policies reading the prompt's queries (SnapKV, AvoKV-E's first window) use.  Decoding is
greedy unless ``temperature`` > 0 (with ``top_p``): then each sample is generated ``draws`` times (AvoKV-E's
protocol: T = 0.6, top-p 0.95, several samples per problem), one row per draw, every policy's draw d seeded
alike.  Rows carry
provenance: model, kvviz version and git commit (``-dirty`` where the code differs from it), torch and
transformers versions, device, seed and date.
"""

from __future__ import annotations

import itertools
import os  # noqa: F401 -- sweep.os: the rows' writes, patched by the tests of a full disk
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm import tqdm  # already a dependency of transformers

from .. import backend as backends
from ..models import DEFAULT_MODEL
from ..trace import model_dtype

# The grid, the config's schema and the folder live in their own modules; their names are this module's too,
# where the command line, the ranking sweeps and the tests have always found them.
from .sweep_cells import (  # noqa: F401
    BENCHMARKS,
    Cell,
    _describe,
    _sample_seed,
    benchmark_samples,
    cells,
    make_sample,
    policy_settings,
    sample_count,
    setting_grids,
    task_label,
    truncate_middle,
)
from .sweep_config import (  # noqa: F401
    BENCHMARK_KEYS,
    NEEDLE_GRID_KEYS,
    SWEEP,
    TOP_LEVEL,
    _is_int,
    _is_number,
    budget_refusal,
    check_lengths,
    cut_words,
    load_config,
    model_context,
    read_toml,
    refused_cells,
    unrunnable_cells,
    validate,
)
from .sweep_folder import (  # noqa: F401
    RUNNING_LOCK,
    RowFile,
    check_params_as_run,
    check_shard,
    check_store,
    claim,
    finished_cells,
    grown,
    status,
    stored_cells,
    stored_rows,
)

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


def _generate(ran_on: str, model, tokenizer, prompt_ids: list[int], policy, budget: int | None, max_new: int,
              shared, sampler) -> list:
    """One cell's step events, on the static backend or the engine (``ran_on``), from the sample's shared
    prefill; the static backend draws the same seed stream on the device."""
    from .. import engine

    if ran_on == "static":
        return list(backends.stream(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=max_new,
                                    temperature=sampler.temperature, top_p=sampler.top_p, seed=sampler.seed,
                                    shared=shared))
    return list(engine.decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=max_new,
                              shared=shared, sampler=sampler))


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

    if config.get("backend") == "static":  # refused before anything decodes, not at the policy's first cell
        for name, params in sorted({(cell.policy, cell.params) for cell in todo}):
            try:
                backends.choose(model, make_policy(name, **dict(params)), "static")
            except ValueError as error:
                raise ValueError(f"sweep config {source}: {error}") from None
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
            budget, error = budget_refusal(cell.policy, cell.params, len(prompt_ids), cell.compression,
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
                     f"{_describe((policy, params))} at {cut_words(rho, tokens)} on {label} ({len(errors)} "
                     f"sample(s), first {errors[0]})")
                    for (policy, params, label, rho, tokens), errors in refused.items()]
        raise refused_cells(source, " on this model", problems, "longer prompts")
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
        ran_on = backends.choose(model, policy, config.get("backend", "auto"))
        events = _generate(ran_on, model, tokenizer, prompt_ids, policy, budget, max_new, shared, sampler)
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
            "seconds": elapsed, "backend": ran_on, **meta,
        })
        written += 1
        bar.set_postfix_str(f"{label}#{sample_index}{f'/{cell.draw}' if cell.draw else ''} {cell.policy} {cell.cut}")
        bar.update()
    return written


def run_ray(config: dict, out_dir, **kwargs) -> int:
    """:func:`kvviz.bench.sweep_ray.run_ray`, imported when called: that module imports this one (and a Ray
    worker imports it first, so a module-level import here would be circular there)."""
    from .sweep_ray import run_ray as run_on_ray

    return run_on_ray(config, out_dir, **kwargs)
