"""``kvviz bench run --backend ray``: each sample's cells one Ray task, the rows written by the driver alone."""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from ..models import DEFAULT_MODEL
from . import sweep
from .sweep_cells import Cell, cells, task_label
from .sweep_config import check_lengths, validate
from .sweep_folder import RowFile, claim, finished_cells

# A Ray worker's loaded model, kept between its tasks: (model name, device, dtype) -> (model, tokenizer, meta).
_worker_models: dict[tuple, tuple] = {}


def _worker_model(config: dict) -> tuple:
    """The config's model, tokenizer and provenance in this Ray worker, loaded once per worker process."""
    key = (config.get("model", DEFAULT_MODEL), config.get("device", "cpu"), config.get("dtype"))
    if key not in _worker_models:
        _worker_models.clear()  # one model per worker: a new sweep's replaces the last
        _worker_models[key] = sweep.loaded(config)
    return _worker_models[key]


def _ray_check(config: dict, todo: list[Cell]) -> list[str]:
    """Ray task: the local runner's checks before anything decodes (:func:`check_lengths`, :func:`check_cells`)
    on a worker that holds the model; returns their notes, or raises the refusal."""
    model, tokenizer, _ = _worker_model(config)
    source = repr(config.get("name"))
    check_lengths(config, model.config.max_position_embeddings, source)
    tasks = {task_label(t): t for t in config["tasks"]}
    return sweep.check_cells(config, source, tasks, todo, model, tokenizer, int(config.get("seed", 0)),
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
    sweep._run_sample(config, tasks[label], label, sample_index, group, model, tokenizer, int(config.get("seed", 0)),
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
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, ValueError):  # the refusal as the local runner raises it
                raise error.cause from None
            raise
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
