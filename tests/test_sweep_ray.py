"""``kvviz bench run --backend ray``: each sample's cells a Ray task on a local cluster of several workers, the
rows written once by the driver, a killed worker's sample rerun, and a stopped sweep resumed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvviz.bench import sweep

ray = pytest.importorskip("ray")

CONFIG = {"name": "ray-tiny", "model": "tiny-random-llama", "max_new_tokens": 5, "seed": 3, "compression": [0.5],
          "tasks": [{"name": "single_needle", "length": 220, "samples": 2},
                    {"name": "multi_key_needle", "length": 260, "samples": 1, "keys": 2}],
          "policies": ["full", "streaming", "tova"]}


@pytest.fixture(scope="module")
def local_cluster():
    """A local Ray of three worker slots, shared by this module's tests (run_ray leaves it running)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ray.init(num_cpus=3, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def stored(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob("rows*.jsonl")) for line in path.read_text().splitlines()]


def test_a_killed_worker_reruns_its_sample_and_every_cell_lands_once(local_cluster, tmp_path):
    """The worker that takes sample 1 of single_needle first dies (os._exit, once: a marker file says it
    happened); Ray reruns that task on a new worker.  Every cell of the sweep has exactly one row, and the
    rows equal the local runner's (same tokens: the tiny model is seeded)."""
    marker = tmp_path / "killed-once"

    def die_once(label: str, sample_index: int) -> None:
        if (label, sample_index) == ("single_needle", 1) and not marker.exists():
            marker.write_text("died")
            os._exit(1)

    folder = tmp_path / "ray"
    written = sweep.run_ray(CONFIG, folder, progress=False, before_sample=die_once)
    assert marker.read_text() == "died"  # the worker did die mid-sweep
    rows = stored(folder)
    expected = {cell.key for cell in sweep.cells(CONFIG)}
    assert written == len(rows) == len(expected) == 3 * 3  # 3 samples x (full + 2 policies at one ratio)
    assert sorted(row["cell"] for row in rows) == sorted(expected)  # each cell once, none missing
    assert [p.name for p in folder.glob("rows*.jsonl")] == ["rows.jsonl"]  # written by the driver alone

    local = tmp_path / "local"
    sweep.run(CONFIG, local, progress=False)
    by_cell = {row["cell"]: row for row in stored(local)}
    for row in rows:
        reference = by_cell[row["cell"]]
        assert (row["prediction"], row["score"], row["prompt_len"], row["budget"], row["policy_params"]) == \
            (reference["prediction"], reference["score"], reference["prompt_len"], reference["budget"],
             reference["policy_params"]), row["cell"]


def test_a_stopped_sweep_resumes_on_ray_with_the_missing_cells_only(local_cluster, tmp_path):
    """Rows of part of the sweep already stored (here by the local runner, as a stopped driver leaves them):
    the Ray run adds only the missing cells, and a run with nothing left adds nothing."""
    folder = tmp_path / "sweep"
    sweep.run(CONFIG, folder, progress=False)
    rows = stored(folder)
    kept = [row for row in rows if not (row["task"] == "multi_key_needle" or row["policy"] == "tova")]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in kept))
    assert sweep.run_ray(CONFIG, folder, progress=False) == len(rows) - len(kept)
    assert sorted(row["cell"] for row in stored(folder)) == sorted(row["cell"] for row in rows)
    assert sweep.run_ray(CONFIG, folder, progress=False) == 0


def test_a_cuda_config_on_a_cluster_without_gpus_is_refused_before_any_task(local_cluster, tmp_path):
    with pytest.raises(ValueError, match=r"device 'cuda' needs GPUs, and the Ray cluster has none"):
        sweep.run_ray({**CONFIG, "device": "cuda"}, tmp_path / "gpu", progress=False)
    assert not list((tmp_path / "gpu").glob("rows*.jsonl"))
