"""The damage-ranking sweep (AvoKV-E's Table 3 measured), its rows in the store, its figure and its table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvviz import engine, probe
from kvviz.bench import ranking, sweep
from kvviz.policies import make_policy
from kvviz.store import QUALITY_METRICS, Store
from kvviz.ui.results import ALL, PAPER_GREY, SECTIONS, Colours, _ranking_caveats, query

CONFIG = {"name": "rank-tiny", "model": "tiny-random-llama", "step": 6, "future": 3, "seed": 0,
          "tasks": [{"name": "arithmetic_reasoning", "samples": 2}],
          "policies": ["inertia", "tova", "recency", "keydiff"]}



def said(figure) -> str:
    """What a Results figure says: its title, then the caveats of the note under it, one text."""
    from kvviz.ui.results import caption_of

    return " ".join([figure.layout.title.text or "", *caption_of(figure)[1]])

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
        assert first[(name, "auroc")]["policy_params"] == policies[name].params()  # all it ran with
    meta = first[("tova", "auroc")]["meta"]
    assert (meta["step"], meta["future"], meta["aligned"]) == (6, 3, int(aligned.sum()))
    k = meta["high_damage"]
    assert k == int(probe.top_decile(result.damage[aligned]).sum()) >= 1  # the top decile of the ranked entries
    for row in stored:  # shares of the k high-damage entries: whole multiples of 1/k
        if row["metric"] in ("topk_recall", "false_safe_rate"):
            assert row["score"] * k == pytest.approx(round(row["score"] * k))
        if row["metric"] in ("auroc", "ap", "topk_recall", "false_safe_rate"):
            assert 0 <= row["score"] <= 1
    # recency's utility is the position: no two entries tie, so its largest tie is one entry of those ranked
    assert first[("recency", "auroc")]["meta"]["largest_tie"] == pytest.approx(1 / meta["aligned"])
    # where the full-cache answer ended: the first end-of-sequence among the new tokens, else null
    eos = engine.eos_ids(model, tokenizer)
    new = result.sequence[len(prompt_ids):]
    assert len(new) == 6 + 3
    assert meta["ended_at"] == next((i + 1 for i, token in enumerate(new) if token in eos), None)


def test_candidates_generated_ranks_only_what_the_model_generated(tmp_path, tiny):
    """With ``candidates = "generated"`` the probe removes only entries after the prompt: at step 6 the five
    the model generated before the one step 6 feeds.  Each one's damage is the one the whole-cache probe
    measures for it (removing one entry does not depend on which others are probed), and no ranked entry is
    the prompt's; the default run counts its prompt entries among those it ranked."""
    model, tokenizer = tiny
    config = {**CONFIG, "tasks": [{"name": "arithmetic_reasoning", "samples": 1}], "policies": ["tova", "recency"]}
    ranking.run(config, tmp_path / "all", model=model, tokenizer=tokenizer, progress=False)
    ranking.run({**config, "candidates": "generated"}, tmp_path / "gen", model=model, tokenizer=tokenizer,
                progress=False)
    sample = sweep.make_sample(config["tasks"][0], tokenizer, 0, 0, True)
    prompt_ids = engine.encode_prompt(tokenizer, sample.prompt, chat=True)
    policies = {name: make_policy(name) for name in config["policies"]}
    whole = probe.probe(model, tokenizer, prompt_ids, 6, policies=policies, future=3)
    generated = probe.probe(model, tokenizer, prompt_ids, 6, policies=policies, future=3, generated_only=True)
    assert generated.candidates.tolist() == list(range(len(prompt_ids), len(prompt_ids) + 5))
    # a damage near zero is a float32 KL of two near-equal distributions: a few float32 epsilons of noise
    # between a batched and a single probe (CI saw one eps), so the absolute slack is four of them
    eps = float(np.finfo(np.float32).eps)
    assert generated.damage == pytest.approx(whole.damage[len(prompt_ids):], rel=1e-4, abs=4 * eps)
    gen = {row["metric"]: row for row in rows(tmp_path / "gen") if row["policy"] == "tova"}
    assert gen["auroc"]["meta"]["prompt_ranked"] == gen["auroc"]["meta"]["prompt_high_damage"] == 0
    assert gen["auroc"]["meta"]["candidates"] == 5
    everything = {row["metric"]: row for row in rows(tmp_path / "all") if row["policy"] == "tova"}["auroc"]["meta"]
    _, aligned = probe.aligned_quality(whole.utilities, whole.damage)
    ranked = whole.candidates[aligned]
    assert everything["prompt_ranked"] == int((ranked < len(prompt_ids)).sum()) > 0
    assert everything["aligned"] - everything["prompt_ranked"] == int((ranked >= len(prompt_ids)).sum())
    with pytest.raises(ValueError, match="probe step 2 or later to rank generated entries"):
        probe.damage_inputs(model, tokenizer, prompt_ids, 1, generated_only=True)


def test_a_stopped_ranking_sweep_reruns_only_what_it_lacks(tmp_path, tiny):
    """A kill between a trace's rows leaves some of them: the rerun probes that trace again and writes only
    the rows it lacks, under the same keys."""
    model, tokenizer = tiny
    config = {**CONFIG, "tasks": [{"name": "arithmetic_reasoning", "samples": 1}], "policies": ["tova", "recency"]}
    assert ranking.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 10
    lines = (tmp_path / "rows.jsonl").read_text().splitlines()
    (tmp_path / "rows.jsonl").write_text("".join(line + "\n" for line in lines[:7]))
    assert ranking.status(config, tmp_path) == {"arithmetic_reasoning": (0, 1)}
    assert ranking.run(config, tmp_path, model=model, tokenizer=tokenizer, progress=False) == 3
    again = rows(tmp_path)
    assert len(again) == 10 == len({row["cell"] for row in again})
    assert [row["score"] for row in again] == pytest.approx([json.loads(line)["score"] for line in lines])


def test_kvviz_bench_ranking_writes_its_folder_and_refuses_another_configs(tmp_path, capsys, monkeypatch):
    """The command: the config beside the rows, --status counting traces, and refusals before a model loads
    (a file as --out, a folder holding another config's rows)."""
    from kvviz import models
    from kvviz.cli import main

    path = tmp_path / "rank.toml"
    path.write_text('name = "rank-cli"\nmodel = "tiny-random-llama"\nstep = 4\nfuture = 2\n'
                    'tasks = [{ name = "arithmetic_reasoning", samples = 1 }]\npolicies = ["tova", "recency"]\n')
    out = tmp_path / "out"
    assert main(["bench", "ranking", str(path), "--out", str(out)]) == 0
    assert (out / "config.toml").read_bytes() == path.read_bytes() and len(rows(out)) == 10
    assert main(["bench", "ranking", str(path), "--out", str(out), "--status"]) == 0
    assert "rank-cli arithmetic_reasoning: 1 of 1 traces" in capsys.readouterr().out

    def loaded(*args, **kwargs):
        raise AssertionError("a model loaded before the refusal")

    monkeypatch.setattr(models, "load_model", loaded)
    (tmp_path / "file").write_text("")
    assert main(["bench", "ranking", str(path), "--out", str(tmp_path / "file")]) == 2
    assert "is a file; a sweep writes a folder" in capsys.readouterr().err
    path.write_text(path.read_text().replace("step = 4", "step = 5"))
    assert main(["bench", "ranking", str(path), "--out", str(out)]) == 2
    assert "holds rows of a different config" in capsys.readouterr().err and "step" in path.read_text()


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
    averaged AUROC with AP into one row.  A metric undefined in one trace counts in neither mean nor count,
    nor in the entries ranked; the quality figures never see these rows."""
    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "params": {}, "compression": None,
            "prompt_len": 40, "max_new_tokens": 14, "chat": True, "temperature": 0.0, "top_p": 1.0}
    scores = {"auroc": (0.6, 0.8), "ap": (0.2, 0.3), "spearman": (0.5, None)}
    write_rows(tmp_path / "r", [{**base, "sample": sample, "policy": "tova", "metric": metric, "score": values[sample],
                                 "meta": {"aligned": 30 + sample, "step": 8, "future": 6, "ended_at": 10 + 5 * sample}}
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
    assert table.loc["auroc", "candidates"] == 61 and table.loc["spearman", "candidates"] == 30
    assert table.loc["auroc", "step"] == "8"
    assert table.loc["auroc", "past_end"] == 1  # sample 0 ended at 10, before its replay's 8 + 6
    assert table.loc["auroc", "ended_by_step"] == 0  # after the probed step 8
    quality = store.quality_vs_compression()
    assert quality.policy.tolist() == ["tova"] and quality.score.tolist() == [1.0]  # the math row alone


def test_where_an_answer_ended_is_counted_against_the_probes_replay(tmp_path):
    """Step 8, future 6: the replay feeds new tokens 9..14.  An answer ending at token 14 feeds its end in the
    replay, whose last prediction then follows the answer (counted); one ending at 8 or before ends at or
    before the probed step (counted twice); at 15 or never (null), the replay is all answer."""
    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "params": {}, "compression": None,
            "prompt_len": 40, "max_new_tokens": 14, "chat": True, "temperature": 0.0, "top_p": 1.0,
            "policy": "tova", "metric": "auroc", "score": 0.5}
    ends = [14, 8, 3, 15, None]
    write_rows(tmp_path / "r", [{**base, "sample": sample, "meta": {"aligned": 30, "step": 8, "future": 6,
                                                                      "ended_at": end, "prompt_ranked": 20}}
                                for sample, end in enumerate(ends)])
    table = Store(tmp_path).damage_ranking()
    row = table.iloc[0]
    assert (row.past_end, row.ended_by_step, row.traces) == (3, 2, 5)
    assert (row.prompt_ranked, row.candidates) == (100, 150)
    assert _ranking_caveats(table) == [
        "in 3 trace(s) (2 at or before the probed step) the full-cache answer ended within or before the probe's "
        "replay", "prompt entries among those ranked: 67% (the rest were generated)"]
    # a trace of a sweep that recorded no prompt count leaves the share unknown, not understated
    write_rows(tmp_path / "r2", [{**base, "sweep": "r2", "sample": 0, "meta": {"aligned": 30, "step": 8,
                                                                               "future": 6, "ended_at": 9}},
                                 {**base, "sweep": "r2", "sample": 1, "meta": {"aligned": 30, "step": 8, "future": 6,
                                                                               "prompt_ranked": 20}}])
    table = Store(tmp_path).damage_ranking()
    assert pd.isna(table.set_index("sweep").loc["r2", "prompt_ranked"])
    assert _ranking_caveats(table) == [
        "in 3 trace(s) of r (2 at or before the probed step); 1 trace(s) of r2 the full-cache answer ended within "
        "or before the probe's replay", "prompt entries among those ranked: 67% in r (the rest were generated)"]


def test_results_ranking_prints_rows_without_entry_counts_and_without_auroc(tmp_path, capsys):
    """Rows written without meta.aligned print '?' entries ranked, not a pandas error; a policy with no AUROC
    row (undefined in every trace) is listed after those ranked by AUROC, not dropped."""
    from kvviz.cli import main

    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "params": {}, "compression": None,
            "prompt_len": 40, "sample": 0, "meta": {"step": 8}}
    write_rows(tmp_path / "r", [{**base, "policy": "tova", "metric": "auroc", "score": 0.6},
                                {**base, "policy": "tova", "metric": "ap", "score": 0.2},
                                {**base, "policy": "recency", "metric": "ap", "score": 0.3}])
    assert main(["results", "--root", str(tmp_path), "--ranking"]) == 0
    lines = capsys.readouterr().out.splitlines()
    body = [line.split() for line in lines if line.startswith(("tova", "recency"))]
    assert [line[0] for line in body] == ["tova", "recency"]
    assert body[0][-2:] == ["1", "?"] and body[1][1] == "NaN" and body[1][2] == "0.300"


def test_two_ranking_sweeps_of_one_sample_stay_two_experiments(tmp_path):
    """The same samples probed by two sweeps (another step, or another set of policies whose aligned entries
    differ): before, the store kept one sweep's row of a shared policy, or averaged both into one mean of
    twice the traces.  Each sweep keeps its own rows, means and pairs."""
    base = {"source": "measured", "model": "m", "task": "t", "params": {}, "compression": None, "prompt_len": 40,
            "chat": True, "temperature": 0.0, "top_p": 1.0, "max_new_tokens": 14, "metric": "auroc"}
    auroc = {"ra": {"tova": (0.9, 0.9), "inertia": (0.5, 0.5)}, "rb": {"tova": (0.7, 0.7), "recency": (0.8, 0.8)}}
    for sweep_name, scores in auroc.items():
        write_rows(tmp_path / sweep_name, [{**base, "sweep": sweep_name, "sample": sample, "policy": policy,
                                            "score": values[sample], "meta": {"aligned": 30, "step": 8}}
                                           for policy, values in scores.items() for sample in (0, 1)])
    store = Store(tmp_path)
    table = store.damage_ranking()
    tova = table[table.policy == "tova"].set_index("sweep")
    assert tova.score.to_dict() == pytest.approx({"ra": 0.9, "rb": 0.7}) and tova.traces.tolist() == [2, 2]
    assert store.damage_ranking(sweeps=["rb"]).set_index("policy").score.to_dict() == pytest.approx(
        {"tova": 0.7, "recency": 0.8})
    pairs = store.ranking_pairs("tova")  # each sweep's policy against that sweep's tova only
    assert sorted(zip(pairs.policy, (pairs.score - pairs.reference_score).round(6))) == [
        ("inertia", -0.4), ("inertia", -0.4), ("recency", 0.1), ("recency", 0.1)]
    figure, _ = ranking_figure(store, ALL, ALL, [], "measured")
    # each sweep's bars together, by AUROC within it (sorted by AUROC alone, the sweeps would interleave)
    assert list(figure.data[0].y) == ["tova · ra", "inertia · ra", "recency · rb", "tova · rb"]


@pytest.mark.parametrize("change, message", [
    ({"policies": ["full", "tova"]}, "policies (full): keeps no per-entry utility, so it ranks nothing"),
    ({"policies": ["tova"]}, "give at least two settings to rank"),
    ({"policies": ["snapkv", "tova"]}, "policies (snapkv): scores entries only when it compresses the prompt"),
    ({"policies": [{"name": "tova", "compression": [0.5]}, "h2o"]}, "drop compression and budget"),
    ({"policies": [{"name": "tova", "foo": 1}, "h2o"]}, "unknown key 'foo'; a policy table has name and params"),
    ({"policies": [{"name": "inertia", "params": {"alpha": 0.0}}, "single-step"]}, "spelt another way"),
    ({"step": 0}, "key 'step': must be a whole number >= 1, got 0"),
    ({"sample": 1}, "key 'sample': must be a whole number >= 2"),
    ({"compression": [0.5]}, "key 'compression': not a ranking setting"),
    ({"tasks": [{"name": "bogus", "samples": 1}]}, "ranking config 'x': tasks[0] (bogus): unknown task"),
    ({"candidates": "prompt"}, "key 'candidates': must be 'all' or 'generated', got 'prompt'"),
    ({"candidates": "generated", "step": 1}, "key 'step': with candidates = \"generated\" the step must be >= 2"),
])
def test_a_bad_ranking_config_is_refused_with_what_to_change(change, message):
    with pytest.raises(ValueError) as error:
        ranking.validate({**CONFIG, **change}, "'x'")
    assert message in str(error.value) and str(error.value).startswith("ranking config 'x'")


def test_a_ranking_config_is_judged_at_the_probes_cache_not_a_sweeps_budget():
    """Read as a sweep at ρ = 0, a 100-token needle with AvoKV-E's delay at 120 was refused (B = 100 under its
    protected 124), with advice to give the policy compressions, which a ranking config refuses; the probe
    scores with the whole cache.  One entry of two settings is two settings.  Prompt plus step plus future
    past the model's context is refused before a model loads."""
    needle = {**CONFIG, "tasks": [{"name": "single_needle", "length": 100, "samples": 1}]}
    ranking.validate({**needle, "policies": [{"name": "avokv", "params": {"delay": 120}}, "tova"]})
    ranking.validate({**CONFIG, "policies": [{"name": "inertia", "params": {"alpha": [0.5, 0.8]}}]})
    ranking.check_lengths(needle, 109, "'x'")  # 100 + step 6 + future 3
    with pytest.raises(ValueError, match=r"^ranking config 'x': tasks\[0\] \(single_needle\): length 100 \+ "
                                         r"step \+ future 9 exceeds the context .* lower length to at most 99$"):
        ranking.check_lengths(needle, 108, "'x'")


def ranking_store(tmp_path: Path, tova_false_safe: float = 0.3) -> Store:
    """Measured tova and inertia over two traces (inertia ranks better), a hidden setting of inertia, and the
    paper's avokv and 'attention only' rows; every other metric 0.3 (tova's false-safe rate: as given)."""
    base = {"source": "measured", "sweep": "r", "model": "m", "task": "t", "compression": None, "prompt_len": 40,
            "meta": {"aligned": 30, "step": 8}}
    auroc = {("tova", ()): (0.6, 0.7), ("inertia", ()): (0.8, 0.9), ("inertia", (("alpha", 0.5),)): (0.5, 0.5)}
    write_rows(tmp_path / "r", [{**base, "sample": sample, "policy": name, "params": dict(params), "metric": metric,
                                 "score": values[sample] if metric == "auroc" else
                                 tova_false_safe if (name, metric) == ("tova", "false_safe_rate") else 0.3}
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
    assert list(auroc.error_x.array)[:2] == pytest.approx([0.05, 0.05])
    assert list(auroc.error_x.array)[2:] == [None, None]  # a printed figure has no error bar, not a zero one
    assert list(auroc.marker.pattern.shape) == ["", "", "/", "/"]
    # a paper's scorer that is one of our policies has its colour; one that is none is grey
    colours = Colours.of(store)
    assert list(auroc.marker.color) == [colours("inertia"), colours("tova"), colours("avokv"), PAPER_GREY]
    # the hover: a measured mean with its spread and counts; a printed figure with its provenance, no counts
    assert "0.850 ± 0.050" in auroc.hovertext[0] and "2 trace(s), 60 entries ranked" in auroc.hovertext[0]
    assert "0.900 (printed)<br>pooled" in auroc.hovertext[2] and "trace" not in auroc.hovertext[2]
    assert list(figure.layout.yaxis.categoryarray) == list(auroc.y)[::-1]  # top to bottom as listed
    assert {shape.x0 for shape in figure.layout.shapes} == {0.5, 0.1, 0.0}  # a random ranking's values
    title = said(figure)
    assert "1 other setting hidden (inertia alpha=0.5)" in title and "mean over 2 traces" in title
    assert set(table.policy) == {"inertia", "tova", "avokv", "attention only"}
    # model, task and source leave it alone (the paper's reference is why it exists); policies apply to both
    assert list(ranking_figure(store, "R1", "AIME24", [], "paper")[0].data[0].y) == list(auroc.y)
    assert list(ranking_figure(store, ALL, ALL, ["tova", "avokv"], ALL)[0].data[0].y) == ["tova", "AvoKV-E: avokv"]
    shown = ranking_figure(store, ALL, ALL, [], "measured", settings=True)[0]
    assert "inertia alpha=0.5" in shown.data[0].y and "hidden" not in said(shown)
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
    assert len(pairs) == 2 * 5 and set(pairs.task) == {f"t · r: {metric}" for metric in ranking.METRICS}
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia", "--policies", "tova"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("tova"))
    assert "-0.200 [-0.200, -0.200] 0/0/2" in row and "*" not in row
    assert row.count("+0.000 [+0.000, +0.000] 0/2/0") == 4
    # a higher false-safe rate is the worse ranking: tova's 0.5 against inertia's 0.3 is a reduction of −0.2
    # and two losses, not two wins
    root = tmp_path / "worse"
    ranking_store(root, tova_false_safe=0.5)
    assert main(["results", "--root", str(root), "--ranking", "--vs", "inertia", "--policies", "tova"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("metric"))
    row = next(line for line in out.splitlines() if line.startswith("tova"))
    assert header.split()[1:] == ["AUROC", "AP", "top-k", "rec", "false-safe", "↓", "Spearman"]
    assert row.count("-0.200 [-0.200, -0.200] 0/0/2") == 2  # AUROC, and the false-safe rate's reduction
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia", "--source", "paper"]) == 2
    assert "the papers print one figure over all their traces" in capsys.readouterr().err


def test_the_reference_can_be_one_setting_of_a_policy(tmp_path, capsys):
    """--vs 'inertia alpha=0.5' pairs against that setting (AUROC 0.5 in both traces), not inertia's defaults:
    tova's 0.6 and 0.7 are +0.1 and +0.2 over it, inertia's 0.8 and 0.9 +0.3 and +0.4; the setting itself is
    not paired with itself.  A name that is no stored setting pairs with nothing and says so."""
    from kvviz.cli import main

    store = ranking_store(tmp_path)
    assert store.setting_of("inertia") == ("inertia", "{}")
    policy, setting = store.setting_of("inertia alpha=0.5")
    assert policy == "inertia" and json.loads(setting) == {"alpha": 0.5}
    assert store.setting_of("inertia alpha=0.7") == ("inertia alpha=0.7", "{}")
    for settings in (False, True):  # the reference's rows are read whether or not other settings are shown
        pairs = store.ranking_pairs("inertia alpha=0.5", settings=settings)
        auroc = pairs[pairs.metric == "auroc"]
        assert sorted(zip(auroc.policy, (auroc.score - auroc.reference_score).round(6))) == [
            ("inertia", 0.3), ("inertia", 0.4), ("tova", 0.1), ("tova", 0.2)]
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia alpha=0.5"]) == 0
    out = capsys.readouterr().out
    assert "vs inertia alpha=0.5 (2 traces)" in out
    assert "+0.150 [+0.100, +0.200] 2/0/0" in next(line for line in out.splitlines() if line.startswith("tova"))
    assert main(["results", "--root", str(tmp_path), "--ranking", "--vs", "inertia alpha=0.7"]) == 2
    assert "no measured damage-ranking traces pair with it" in capsys.readouterr().err


def test_a_policy_only_ranked_is_no_quality_reference_and_is_marked_so(tmp_path, capsys):
    """recency ran only in the ranking sweep: the quality --vs and the tab's reference box leave it out (pairing
    against it finds no samples), --vs says to add --ranking, and the Policies box marks it."""
    from kvviz.cli import main

    store = ranking_store(tmp_path)
    write_rows(tmp_path / "q", [{"source": "measured", "sweep": "q", "model": "m", "task": "q", "policy": policy,
                                 "params": {}, "compression": 0.5, "metric": "string_match", "score": 1.0,
                                 "sample": 0} for policy in ("full", "tova")])
    store = Store(tmp_path)
    assert store.options("policy", source="measured", metrics=QUALITY_METRICS) == ["full", "tova"]
    assert "inertia" in store.options("policy", source="measured")
    assert main(["results", "--root", str(tmp_path), "--vs", "inertia"]) == 2
    assert "(only damage-ranking rows: add --ranking); measured: full, tova" in capsys.readouterr().err
    import gradio as gr

    from kvviz.ui.results import build_results_tab

    with gr.Blocks() as app, gr.Tab("Results") as results_tab:
        build_results_tab(results_tab, store)
    boxes = {block.label: block for block in app.blocks.values() if isinstance(block, gr.Dropdown)}
    assert ("inertia (damage ranking only)", "inertia") in boxes["Policies (none = all)"].choices
    assert ("attention only (paper only)", "attention only") in boxes["Policies (none = all)"].choices
    assert [value for _, value in boxes["Reference policy"].choices] == ["full", "tova"]


def test_the_ranking_tables_in_results_db_readme_are_the_shipped_rows_means():
    """docs/findings.md prints each shipped ranking sweep's means: every cell must be what the store
    computes from the rows (rounded to 3 places), and every setting the sweep ranked must have its line."""
    import re

    text = (Path(__file__).parents[1] / "docs" / "findings.md").read_text()
    store = Store()
    for sweep_name in ("ranking-arithmetic", "ranking-arithmetic-generated"):
        section = text.split(f"**`{sweep_name}/`")[1]
        lines = section[section.index("| policy |"):].splitlines()
        header = [cell.strip() for cell in lines[0].strip("|").split("|")]
        table = {}
        for line in lines[2:]:
            if not line.startswith("|"):
                break
            cells = [cell.strip() for cell in line.strip("|").split("|")]
            table[re.search(r"`([^`]+)`", cells[0]).group(1)] = [float(cell.replace("−", "-")) for cell in cells[1:]]
        means = store.damage_ranking(source="measured", settings=True, sweeps=[sweep_name])
        assert header[1:] == ["AUROC", "AP", "top-k recall", "false-safe", "Spearman"]
        assert set(table) == set(means.policy)
        for name, values in table.items():
            measured = means[means.policy == name].set_index("metric").score
            expected = [measured[metric] for metric in ("auroc", "ap", "topk_recall", "false_safe_rate", "spearman")]
            assert values == pytest.approx(expected, abs=5e-4 + 1e-9), name
