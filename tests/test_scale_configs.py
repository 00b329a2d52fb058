"""The scale recipe's configs (configs/scale/) pass the runner's checks and ask for what the recipe says."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvviz.bench import sweep
from kvviz.tasks.loaders import RULER_SUBTASKS

SCALE = Path(__file__).resolve().parent.parent / "configs" / "scale"
LONG_CONTEXT = {"llama8b-16k": 16384, "llama8b-32k": 32768, "llama8b-64k": 65536, "qwen7b-16k": 16384,
                "qwen7b-32k": 32768}


def test_every_scale_config_is_one_of_the_recipe():
    assert sorted(path.stem for path in SCALE.glob("*.toml")) == sorted([*LONG_CONTEXT, "reasoning-r1-qwen1.5b"])


@pytest.mark.parametrize("stem, length", sorted(LONG_CONTEXT.items()))
def test_long_context_configs_load_and_cover_rulers_subtasks_and_longbench(stem, length):
    config = sweep.load_config(SCALE / f"{stem}.toml")  # every check of the runner, before any model
    assert (config["device"], config["dtype"]) == ("cuda", "bfloat16")
    assert config["model"] == ("meta-llama/Llama-3.1-8B-Instruct" if stem.startswith("llama")
                               else "Qwen/Qwen2.5-7B-Instruct")
    ruler = [task for task in config["tasks"] if task["name"] == "ruler"]
    assert sorted(task["task"] for task in ruler) == sorted(RULER_SUBTASKS) and len(RULER_SUBTASKS) == 13
    assert {task["max_length"] for task in ruler} == {length}
    longbench = [task for task in config["tasks"] if task["name"] == "longbench"]
    assert len(longbench) == 8 and all(task["truncate"] <= length for task in longbench)
    # every label names its length, so that two lengths' rows are never one task in the store
    assert all(sweep.task_label(task).endswith(f"/{length // 1024}k") for task in config["tasks"])
    # 21 tasks x 25 samples x (the full cache + 7 policies x 2 compressions)
    assert len(sweep.cells(config)) == 21 * 25 * (1 + 7 * 2)


def test_the_reasoning_config_is_avokv_es_regime():
    config = sweep.load_config(SCALE / "reasoning-r1-qwen1.5b.toml")
    assert config["model"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert (config["device"], config["dtype"], config["draws"]) == ("cuda", "bfloat16", 4)
    assert (config["temperature"], config["top_p"], config["max_new_tokens"]) == (0.6, 0.95, 32768)
    assert config["budget"] == [128, 256, 512, 1024] and "compression" not in config
    assert {task["name"]: task["samples"] for task in config["tasks"]} == {"math500": 500, "aime25": 30}
    assert len(sweep.cells(config)) == 530 * 4 * (1 + 4 * 4)


def test_a_ruler_task_refuses_a_length_or_subtask_the_hub_set_does_not_have():
    base = {"name": "r", "compression": [0.5], "policies": ["full"]}
    with pytest.raises(ValueError, match="max_length must be one of RULER's lengths"):
        sweep.validate({**base, "tasks": [{"name": "ruler", "task": "vt", "max_length": 20000, "samples": 1}]})
    with pytest.raises(ValueError, match="task must be a RULER subtask"):
        sweep.validate({**base, "tasks": [{"name": "ruler", "task": "niah_single", "samples": 1}]})
    with pytest.raises(ValueError, match="max_length picks one of RULER's sequence lengths"):
        sweep.validate({**base, "tasks": [{"name": "longbench", "task": "qasper", "max_length": 16384,
                                          "samples": 1}]})
    with pytest.raises(ValueError, match="RULER's max_length 65536 exceeds the context of m"):
        sweep.check_lengths({**base, "model": "m", "tasks": [{"name": "ruler", "max_length": 65536, "samples": 1}]},
                            32768, "s")


def test_the_ruler_loader_keeps_the_asked_subtask():
    from kvviz.tasks.loaders import from_records

    records = [{"context": "a", "answer": ["1"], "task": "vt"}, {"context": "b", "answer": ["2"], "task": "cwe"},
               {"context": "c", "answer": ["3"], "task": "vt"}]
    assert [s.prompt.split("\n")[0] for s in from_records("ruler", records, "vt")] == ["a", "c"]
    assert len(from_records("ruler", records)) == 3
