"""The damage-ranking sweep (AvoKV-E's Table 3 measured), its rows in the store, its figure and its table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvviz import engine, probe
from kvviz.bench import ranking, sweep
from kvviz.policies import make_policy
from kvviz.store import Store
from kvviz.ui.results import ALL, SECTIONS, query

CONFIG = {"name": "rank-tiny", "model": "tiny-random-llama", "step": 6, "future": 3, "seed": 0,
          "tasks": [{"name": "arithmetic_reasoning", "samples": 2}],
          "policies": ["inertia", "tova", "recency", "keydiff"]}


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "rows.jsonl").read_text().splitlines()]


def write_rows(folder: Path, lines: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_a_ranking_sweep_stores_each_traces_ranking_quality_and_resumes(tmp_path, tiny):
    model, tokenizer = tiny
    assert ranking.run(CONFIG, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 2 * 4 * 5
    stored = rows(tmp_path)
    assert len({row["cell"] for row in stored}) == 40
    assert {row["metric"] for row in stored} == {"auroc", "ap", "topk_recall", "false_safe_rate", "spearman"}
    assert ranking.status(CONFIG, tmp_path) == {"arithmetic_reasoning": (2, 2)}
    assert ranking.run(CONFIG, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 0  # nothing left

    # Trace 0's rows are what the probe measures of that sample's prompt, at the configured step and future
    sample = sweep.make_sample(CONFIG["tasks"][0], tokenizer, 0, 0, True)
    prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=True)
    policies = {name: make_policy(name) for name in CONFIG["policies"]}
    result = probe.probe(model, tokenizer, prompt_ids, 6, policies=policies, future=3)
    quality, aligned = probe.aligned_quality(result.utilities, result.damage)
    first = {(row["policy"], row["metric"]): row for row in stored if row["sample"] == 0}
    for name in CONFIG["policies"]:
        assert first[(name, "auroc")]["score"] == pytest.approx(quality[name]["auroc"])
        assert first[(name, "topk_recall")]["score"] == pytest.approx(quality[name]["topk_recall"])
    meta = first[("tova", "auroc")]["meta"]
    assert (meta["step"], meta["future"], meta["aligned"]) == (6, 3, int(aligned.sum()))
    k = meta["high_damage"]
    assert k == int(probe.top_decile(result.damage[aligned]).sum()) >= 1  # the top decile of the ranked entries
    for row in stored:  # shares of the k high-damage entries: whole multiples of 1/k
        if row["metric"] in ("topk_recall", "false_safe_rate"):
            assert row["score"] * k == pytest.approx(round(row["score"] * k))
        if row["metric"] in ("auroc", "ap", "topk_recall", "false_safe_rate"):
            assert 0 <= row["score"] <= 1


def test_an_undefined_metric_is_stored_as_null_not_nan(tmp_path, tiny, monkeypatch):
    """Spearman of a constant utility has no order to correlate (NaN): the store refuses a non-finite number
    and would report the row, so the sweep writes null, which the store's means leave out."""
    model, tokenizer = tiny
    measured = probe.aligned_quality

    def constant_recency(utilities, damage_values):
        quality, aligned = measured(utilities, damage_values)
        quality["recency"]["spearman"] = float("nan")
        return quality, aligned

    monkeypatch.setattr(probe, "aligned_quality", constant_recency)
    config = {**CONFIG, "tasks": [{"name": "arithmetic_reasoning", "samples": 1}], "policies": ["tova", "recency"]}
    ranking.run(config, tmp_path / "r", model=model, tokenizer=tokenizer, progress=False)
    spearman = {row["policy"]: row["score"] for row in rows(tmp_path / "r") if row["metric"] == "spearman"}
    assert spearman["recency"] is None and -1 <= spearman["tova"] <= 1
    store = Store(tmp_path)
    assert store.problems == []
    assert set(store.damage_ranking().query("metric == 'spearman'").policy) == {"tova"}


def test_the_store_keeps_a_traces_metrics_apart_and_averages_each_over_traces(tmp_path):
    """Rows of one trace and policy differ only in their metric: keyed without it, the store would have
    averaged AUROC with AP into one row.  A metric undefined in one trace counts in neither mean nor count.
    The quality figures never see these rows, and a quality sweep of the same task generated with other
    settings is not reported as mixed with them."""
    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "params": {}, "compression": None,
            "prompt_len": 40, "max_new_tokens": 14, "chat": True, "temperature": 0.0, "top_p": 1.0}
    scores = {"auroc": (0.6, 0.8), "ap": (0.2, 0.3), "spearman": (0.5, None)}
    write_rows(tmp_path / "r", [{**base, "sample": sample, "policy": "tova", "metric": metric, "score": values[sample],
                                 "meta": {"aligned": 30 + sample, "step": 8}}
                                for metric, values in scores.items() for sample in (0, 1)])
    write_rows(tmp_path / "q", [{**base, "sweep": "q", "sample": 0, "policy": "tova", "metric": "math",
                                 "score": 1.0, "max_new_tokens": 256, "compression": 0.5}])
    store = Store(tmp_path)
    assert store.problems == []
    table = store.damage_ranking().set_index("metric")
    assert table.loc["auroc", "score"] == pytest.approx(0.7)
    assert table.loc["auroc", "stderr"] == pytest.approx(np.std([0.6, 0.8], ddof=1) / np.sqrt(2))
    assert table.loc["ap", "score"] == pytest.approx(0.25)
    assert (table.loc["spearman", "score"], table.loc["spearman", "traces"]) == (0.5, 1)
    assert table.loc["auroc", "candidates"] == 61 and table.loc["auroc", "step"] == "8"
    quality = store.quality_vs_compression()
    assert quality.policy.tolist() == ["tova"] and quality.score.tolist() == [1.0]  # the math row alone


@pytest.mark.parametrize("change, message", [
    ({"policies": ["full", "tova"]}, "policies (full): keeps no per-entry utility, so it ranks nothing"),
    ({"policies": ["tova"]}, "list at least two policies"),
    ({"policies": [{"name": "tova", "compression": [0.5]}, "h2o"]}, "drop compression and budget"),
    ({"policies": [{"name": "inertia", "params": {"alpha": 0.0}}, "single-step"]}, "spelt another way"),
    ({"step": 0}, "key 'step': must be a whole number >= 1, got 0"),
    ({"sample": 1}, "key 'sample': must be a whole number >= 2"),
    ({"compression": [0.5]}, "key 'compression': not a ranking setting"),
    ({"tasks": [{"name": "bogus", "samples": 1}]}, "ranking config 'x': tasks[0] (bogus): unknown task"),
])
def test_a_bad_ranking_config_is_refused_with_what_to_change(change, message):
    with pytest.raises(ValueError) as error:
        ranking.validate({**CONFIG, **change}, "'x'")
    assert message in str(error.value) and str(error.value).startswith("ranking config 'x'")


def ranking_store(tmp_path: Path) -> Store:
    """Measured tova and inertia over two traces (inertia ranks better), a hidden setting of inertia, and the
    paper's avokv and 'attention only' rows."""
    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "compression": None, "prompt_len": 40,
            "meta": {"aligned": 30, "step": 8}}
    auroc = {("tova", ()): (0.6, 0.7), ("inertia", ()): (0.8, 0.9), ("inertia", (("alpha", 0.5),)): (0.5, 0.5)}
    write_rows(tmp_path / "r", [{**base, "sample": sample, "policy": name, "params": dict(params), "metric": metric,
                                 "score": values[sample] if metric == "auroc" else 0.3}
                                for (name, params), values in auroc.items() for sample in (0, 1)
                                for metric in ranking.METRICS])
    write_rows(tmp_path / "paper", [{"source": "paper", "sweep": "paper", "paper": "AvoKV-E", "model": "R1",
                                     "task": "AIME24", "policy": name, "params": {}, "metric": metric,
                                     "score": score if metric == "auroc" else 0.4, "notes": "pooled"}
                                    for name, score in (("avokv", 0.9), ("attention only", 0.89))
                                    for metric in ranking.METRICS])
    return Store(tmp_path)


def ranking_figure(store: Store, *args, **kwargs):
    index = 3 * SECTIONS.index("Damage ranking (AvoKV-E Table 3)")
    out = query(store, *args, **kwargs)
    return out[index], out[index + 1]


def test_the_ranking_figure_draws_a_panel_per_metric_measured_and_paper_side_by_side(tmp_path):
    store = ranking_store(tmp_path)
    figure, table = ranking_figure(store, ALL, ALL, [], "measured")
    assert [note.text for note in figure.layout.annotations] == [
        "AUROC", "average precision", "top-k recall", "false-safe rate (lower is better)", "Spearman"]
    auroc = figure.data[0]
    # measured first, each source by AUROC; the paper's scorers named with the paper and hatched
    assert list(auroc.y) == ["inertia", "tova", "AvoKV-E: avokv", "AvoKV-E: attention only"]
    assert list(auroc.x) == pytest.approx([0.85, 0.65, 0.9, 0.89])
    assert list(auroc.error_x.array) == pytest.approx([0.05, 0.05, 0, 0])
    assert list(auroc.marker.pattern.shape) == ["", "", "/", "/"]
    assert list(figure.layout.yaxis.categoryarray) == list(auroc.y)[::-1]  # top to bottom as listed
    assert {shape.x0 for shape in figure.layout.shapes} == {0.5, 0.1, 0.0}  # a random ranking's values
    title = figure.layout.title.text
    assert "1 other setting hidden (inertia alpha=0.5)" in title and "mean over 2 traces" in title
    assert set(table.policy) == {"inertia", "tova", "avokv", "attention only"}
    # model, task and source leave it alone (the paper's reference is why it exists); policies apply to both
    assert list(ranking_figure(store, "R1", "AIME24", [], "paper")[0].data[0].y) == list(auroc.y)
    assert list(ranking_figure(store, ALL, ALL, ["tova", "avokv"], ALL)[0].data[0].y) == ["tova", "AvoKV-E: avokv"]
    shown = ranking_figure(store, ALL, ALL, [], "measured", settings=True)[0]
    assert "inertia alpha=0.5" in shown.data[0].y and "hidden" not in shown.layout.title.text
    # the sweeps filter measured rows only
    assert list(ranking_figure(store, ALL, ALL, [], ALL, sweeps=["paper"])[0].data[0].y) == [
        "AvoKV-E: avokv", "AvoKV-E: attention only"]


def test_results_prints_the_ranking_table_and_points_to_it(tmp_path, capsys):
    from kvviz.cli import main

    ranking_store(tmp_path)
    assert main(["results", "--root", str(tmp_path), "--task", "AIME24"]) == 2
    assert "add --ranking to print them" in capsys.readouterr().err
    assert main(["results", "--root", str(tmp_path), "--ranking"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    measured = lines.index(next(line for line in lines if line.startswith("t · m · measured")))
    assert lines[measured + 3].split()[:3] == ["inertia", "0.850", "±"]  # by AUROC, then tova
    assert lines[measured + 4].split()[:3] == ["tova", "0.650", "±"]
    assert "AIME24 · R1 · paper · damage ranking (AvoKV-E" in out


def test_results_pairs_ranking_metrics_trace_by_trace(tmp_path, capsys):
    """tova's AUROC is 0.2 under inertia's in each of the two traces: Δ −0.2 with a degenerate interval, 0 wins,
    2 losses, which two traces cannot make significant (sign test p = 0.5); the other metrics tie."""
    from kvviz.cli import main

    store = ranking_store(tmp_path)
    pairs = store.ranking_pairs("inertia", policies=["tova"])
    assert len(pairs) == 2 * 5 and set(pairs.task) == {f"t: {metric}" for metric in ranking.METRICS}
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia", "--policies", "tova"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tova"))
    assert row.split("  ")[0:1] == ["tova"]
    assert "-0.200 [-0.200, -0.200] 0/0/2" in row and "*" not in row
    assert row.count("+0.000 [+0.000, +0.000] 0/2/0") == 4
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia", "--source", "paper"]) == 2
    assert "the papers print pooled figures" in capsys.readouterr().err
