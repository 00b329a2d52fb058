"""Paired comparisons: the statistics (kvviz.stats), the store's pairing, `kvviz results --vs` and the figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvviz import cli
from kvviz.stats import paired_delta, paired_table
from kvviz.store import Store
from kvviz.ui import results


def said(figure) -> str:
    """What a Results figure says: its title, then the caveats of the note under it, one text."""
    from kvviz.ui.results import caption_of

    return " ".join([figure.layout.title.text or "", *caption_of(figure)[1]])

def test_paired_delta_counts_and_sign_test_by_hand():
    result = paired_delta([np.array([1.0, 0.0, 0.0, -1.0, 1.0])])
    assert result.delta == pytest.approx(0.2)
    assert (result.pairs, result.wins, result.ties, result.losses) == (5, 2, 2, 1)
    # 2 wins against 1 loss: P(X <= 1 or X >= 2 | n = 3) = 1
    assert result.p_sign == pytest.approx(1.0)
    assert result.low <= result.delta <= result.high and result.low < 0 < result.high


def test_identical_differences_have_a_point_interval_and_an_exact_sign_test():
    result = paired_delta([np.ones(10)])
    assert (result.delta, result.low, result.high) == (1.0, 1.0, 1.0)
    assert result.p_sign == pytest.approx(2 * 0.5 ** 10)  # all ten samples won
    zeros = paired_delta([np.zeros(7)])
    assert (zeros.delta, zeros.low, zeros.high, zeros.ties, zeros.p_sign) == (0.0, 0.0, 0.0, 7, 1.0)


def test_strata_weigh_equally_and_are_resampled_apart():
    # One task all wins (4 samples), one all ties (8): the benchmark's mean over its tasks moves by 0.5 (the
    # pooled mean would be 1/3), and resampling within each task can never give anything else.
    result = paired_delta([np.ones(4), np.zeros(8)])
    assert result.delta == pytest.approx(0.5)
    assert (result.low, result.high) == (pytest.approx(0.5), pytest.approx(0.5))
    assert (result.wins, result.ties, result.losses) == (4, 8, 0)
    # the interval cannot move, but four wins are not evidence of a difference: 2 * 0.5^4 = 0.125
    assert result.p_sign == pytest.approx(0.125) and not result.significant


def test_the_sign_test_not_the_interval_says_whether_policies_differ():
    three_losses = paired_delta([np.array([-1.0] * 3 + [0.0] * 17)])
    assert three_losses.high <= 0 and three_losses.p_sign == pytest.approx(0.25) and not three_losses.significant
    six_wins = paired_delta([np.array([1.0] * 6 + [0.0] * 14)])
    assert six_wins.p_sign == pytest.approx(2 / 64) and six_wins.significant


def test_interval_matches_the_normal_approximation_on_a_large_sample():
    differences = np.random.default_rng(1).normal(0.3, 1.0, 400)
    result = paired_delta([differences])
    half_width = 1.96 * differences.std(ddof=1) / math.sqrt(len(differences))
    assert result.low == pytest.approx(differences.mean() - half_width, abs=0.02)
    assert result.high == pytest.approx(differences.mean() + half_width, abs=0.02)
    assert paired_delta([differences]) == result  # seeded: the same table every time


def test_a_stratum_of_one_sample_has_no_interval_and_no_pairs_is_refused():
    result = paired_delta([np.array([1.0, 0.0]), np.array([1.0])])
    assert math.isnan(result.low) and math.isnan(result.high) and result.delta == pytest.approx(0.75)
    single = paired_delta([np.array([-1.0])])
    assert math.isnan(single.low) and math.isnan(single.high) and not single.significant
    with pytest.raises(ValueError, match="no paired samples"):
        paired_delta([np.array([])])


def paired_store(tmp_path: Path) -> Store:
    """Two tasks of one suite, 3 samples each; inertia-lazy loses sample 2 of single_needle at 0.9."""
    base = {"source": "measured", "model": "m", "params": {}, "meta": {}, "metric": "string_match", "seed": 0,
            "prompt_len": 100, "max_new_tokens": 24, "chat": True}
    rows = []
    for task in ("single_needle", "multi_key_needle"):
        for sample in range(3):
            cell = {**base, "task": task, "sample": sample}
            rows.append({**cell, "policy": "full", "compression": 0.5, "score": 1.0})
            for rho in (0.5, 0.9):
                rows.append({**cell, "policy": "inertia", "compression": rho, "score": 1.0 if rho == 0.5 else 0.5})
                lost = task == "single_needle" and sample == 2 and rho == 0.9
                rows.append({**cell, "policy": "inertia-lazy", "compression": rho,
                             "score": 0.0 if lost else (1.0 if rho == 0.5 else 0.5)})
    unpaired = {**base, "task": "single_needle", "policy": "inertia-lazy", "compression": 0.9, "score": 1.0}
    rows += [
        {**unpaired, "sample": 7},                                  # no reference row for this sample
        {**unpaired, "sample": 0, "seed": 1},                       # another prompt
        {**unpaired, "sample": 0, "max_new_tokens": 64},            # another experiment
        {**unpaired, "sample": 0, "params": {"refresh": 8}},        # not at its defaults
        {**unpaired, "sample": 0, "source": "paper"},               # no samples in a paper
    ]
    folder = tmp_path / "sweep"
    folder.mkdir(parents=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Store(tmp_path)


def test_store_pairs_same_sample_same_compression_and_full_with_every_compression(tmp_path):
    store = paired_store(tmp_path)
    lazy = store.paired_scores("inertia", policies=["inertia-lazy"])
    assert len(lazy) == 12  # 2 tasks x 3 samples x 2 compressions, none of the unpaired rows
    assert set(lazy.suite) == {"RULER"}
    lost = lazy[(lazy.task == "single_needle") & (lazy["sample"] == 2) & (lazy.compression == 0.9)]
    assert (lost.score.item(), lost.reference_score.item()) == (0.0, 0.5)
    assert "full" not in set(store.paired_scores("inertia").policy)  # no compression to pair at
    against_full = store.paired_scores("full")
    assert set(against_full.policy) == {"inertia", "inertia-lazy"} and set(against_full.reference_score) == {1.0}
    assert len(against_full[against_full.policy == "inertia"]) == 12  # full pairs with both compressions


def test_paired_table_per_task_and_over_the_suites_tasks(tmp_path):
    table = paired_table(paired_store(tmp_path).paired_scores("inertia", policies=["inertia-lazy"]))
    row = table[(table.task == "single_needle") & (table.compression == 0.9)].iloc[0]
    assert (row.delta, row.wins, row.ties, row.losses) == (pytest.approx(-0.5 / 3), 0, 2, 1)
    assert (row.score, row.reference) == (pytest.approx(1 / 3), pytest.approx(0.5))
    suite = table[(table.task == "RULER: mean of 2 tasks") & (table.compression == 0.9)].iloc[0]
    assert suite.delta == pytest.approx((-0.5 / 3 + 0.0) / 2) and suite.pairs == 6
    assert suite.tasks == "multi_key_needle, single_needle" and row.tasks == "single_needle"
    at_half = table[table.compression == 0.5]
    assert (at_half.delta == 0).all() and (at_half.low == 0).all() and (at_half.high == 0).all()


def test_results_command_prints_paired_differences(tmp_path, capsys):
    paired_store(tmp_path)
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia", "--task", "single_needle"]) == 0
    out = capsys.readouterr().out
    assert "single_needle · m · vs inertia" in out
    lazy = next(line for line in out.splitlines() if line.startswith("inertia-lazy"))
    assert "+0.000 [+0.000, +0.000] 0/3/0" in lazy and "-0.167 [" in lazy and "0/2/1" in lazy
    assert "*" not in lazy  # one loss in three
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia"]) == 0
    assert "\nRULER: mean of 2 tasks (multi_key_needle, single_needle) · m · vs inertia\n" in capsys.readouterr().out
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia", "--csv"]) == 0
    assert capsys.readouterr().out.startswith("model,task,policy,compression,absolute_budget,score,reference,delta")


def test_the_reference_can_be_one_setting_of_a_policy(tmp_path, capsys):
    """inertia at α = 0.5 scores 0 on single_needle's three samples at 0.9: against it, inertia's defaults
    (0.5 there) are +0.5 on each and inertia-lazy's +0.5, +0.5 and 0 (it loses sample 2); the setting is not
    paired with itself."""
    paired_store(tmp_path)
    base = {"source": "measured", "model": "m", "meta": {}, "metric": "string_match", "seed": 0, "prompt_len": 100,
            "max_new_tokens": 24, "chat": True, "task": "single_needle", "policy": "inertia",
            "params": {"alpha": 0.5}, "compression": 0.9, "score": 0.0}
    (tmp_path / "alpha").mkdir()
    (tmp_path / "alpha" / "rows.jsonl").write_text("".join(json.dumps({**base, "sample": sample}) + "\n"
                                                           for sample in range(3)))
    store = Store(tmp_path)
    pairs = store.paired_scores("inertia alpha=0.5")
    differences = {policy: sorted(part.score - part.reference_score) for policy, part in pairs.groupby("policy")}
    assert differences == {"inertia": [0.5] * 3, "inertia-lazy": [0.0, 0.5, 0.5]}
    assert set(pairs.task) == {"single_needle"} and set(pairs.compression) == {0.9}
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia alpha=0.5"]) == 0
    out = capsys.readouterr().out
    assert "single_needle · m · vs inertia alpha=0.5" in out
    assert "+0.333 [" in next(line for line in out.splitlines() if line.startswith("inertia-lazy"))
    # a setting no row has is no reference
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia alpha=0.7"]) == 2
    assert "no measured quality rows of that policy" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--vs", "tova"], "no measured quality rows of that policy"),
    (["--vs", "inertia", "--source", "paper"], "drop --source paper"),
    (["--vs", "inertia", "--paper", "RULER"], "give one of them"),
])
def test_results_command_refuses_a_bad_reference(tmp_path, capsys, argv, message):
    paired_store(tmp_path)
    assert cli.main(["results", "--root", str(tmp_path), *argv]) == 2
    assert message in capsys.readouterr().err


def test_results_tab_draws_each_policys_interval_around_zero(tmp_path):
    store = paired_store(tmp_path)
    out = results.query(store, results.ALL, results.ALL, [], "measured", reference="inertia")
    index = 3 * results.SECTIONS.index("Paired differences")
    figure, table = out[index], out[index + 1]
    assert "to inertia" in said(figure)
    titles = {a.text for a in figure.layout.annotations}
    assert {"single_needle", "multi_key_needle", "RULER: mean of 2 tasks"} <= titles
    # which two: Measured vs paper averages only the tasks whose full cache passes, this every task that pairs
    assert "RULER: mean of 2 tasks: multi_key_needle, single_needle (a difference needs no full cache" \
        in said(figure)
    lazy = [t for t in figure.data if t.name == "inertia-lazy"]
    assert len(lazy) == 3 and sum(t.showlegend for t in lazy) == 1  # one legend entry across the panels
    # each panel's line is one task's row of the table: Δ, and the interval as bars above and below it
    expected = paired_table(store.paired_scores("inertia", policies=["inertia-lazy"]))
    wanted = sorted(tuple(np.round(np.concatenate([part.delta, part.high - part.delta, part.delta - part.low]), 6))
                    for _, part in expected.sort_values("compression").groupby("task"))
    drawn = sorted(tuple(np.round(np.concatenate([t.y, t.error_y.array, t.error_y.arrayminus]), 6)) for t in lazy)
    assert drawn == wanted and any(value != 0 for line in drawn for value in line)
    assert len(table) == len(results.paired(store, "inertia", None, None, None))
    # the reference falls back to inertia when the one asked for was not measured; papers have no samples
    fallback = results.query(store, results.ALL, results.ALL, [], "measured", reference="tova")[index]
    assert "to inertia" in said(fallback)
    paper = results.query(store, results.ALL, results.ALL, [], "paper", reference="inertia")
    assert paper[index + 1].empty


def test_the_full_cache_filed_under_two_sweeps_pairs_once(tmp_path):
    """Each sweep files its full-cache run under its own first ρ; it is one generation, counted once."""
    base = {"source": "measured", "model": "m", "task": "single_needle", "params": {}, "metric": "string_match",
            "seed": 0, "prompt_len": 100, "max_new_tokens": 24, "chat": True}
    a = [{**base, "sweep": "a", "sample": i, "policy": "full", "compression": 0.5, "score": 1.0} for i in range(5)]
    a += [{**base, "sweep": "a", "sample": i, "policy": "inertia", "compression": 0.9, "score": float(i > 2)}
          for i in range(5)]
    b = [{**base, "sweep": "b", "sample": i, "policy": "full", "compression": 0.9, "score": 1.0} for i in range(5)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = Store(tmp_path)
    pairs = store.paired_scores("full")
    assert len(pairs) == 5 and sorted(pairs["sample"]) == [0, 1, 2, 3, 4]
    row = paired_table(pairs).iloc[0]
    assert (row.wins, row.ties, row.losses) == (0, 2, 3)
    full = store.quality_vs_compression(policies=["full"])
    assert full.samples.tolist() == [5]


def test_budget_cells_pair_at_their_own_budget(tmp_path, capsys):
    base = {"source": "measured", "model": "m", "task": "arithmetic_reasoning", "params": {}, "metric": "math",
            "seed": 0, "prompt_len": 70, "max_new_tokens": 256, "chat": True, "compression": None}
    rows = []
    for i in range(4):
        rows.append({**base, "sample": i, "policy": "full", "score": 1.0})
        for budget, lazy_score in ((64, 0.0), (128, 1.0)):
            rows.append({**base, "sample": i, "policy": "inertia", "absolute_budget": budget, "budget": budget,
                         "score": 1.0})
            rows.append({**base, "sample": i, "policy": "inertia-lazy", "absolute_budget": budget, "budget": budget,
                         "score": lazy_score})
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = Store(tmp_path)
    table = paired_table(store.paired_scores("inertia", policies=["inertia-lazy"]))
    assert table.set_index("absolute_budget").delta.to_dict() == {64.0: -1.0, 128.0: 0.0}
    assert table.pairs.tolist() == [4, 4] and table.compression.isna().all()
    assert len(store.paired_scores("full", policies=["inertia"])) == 8  # each budget against the one full run
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia"]) == 0
    header = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("KV budget"))
    assert header.split()[2:] == ["B=64", "B=128"]
    out = results.query(store, results.ALL, results.ALL, [], "measured", reference="inertia")
    figure = out[3 * results.SECTIONS.index("Paired differences")]
    assert sorted(figure.data[0].x) == pytest.approx([64, 128])  # on the budget axis (one policy: no nudge)
    assert figure.layout.xaxis.title.text == "KV budget (tokens)"


def test_parameter_settings_pair_with_the_reference_at_its_defaults(tmp_path, capsys):
    base = {"source": "measured", "model": "m", "task": "single_needle", "metric": "string_match", "seed": 0,
            "prompt_len": 100, "max_new_tokens": 24, "chat": True, "compression": 0.9}
    rows = []
    for i in range(6):
        rows.append({**base, "sample": i, "policy": "inertia", "params": {}, "score": 0.0})
        rows.append({**base, "sample": i, "policy": "inertia", "params": {"alpha": 0.95}, "score": 1.0})
        rows.append({**base, "sample": i, "policy": "inertia", "params": {"alpha": 0.8}, "score": 0.0})  # default
        rows.append({**base, "sample": i, "policy": "tova", "params": {}, "score": float(i < 3)})
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    store = Store(tmp_path)
    assert set(store.paired_scores("inertia").policy) == {"tova"}  # defaults only
    table = paired_table(store.paired_scores("inertia", settings=True)).set_index("policy")
    assert set(table.index) == {"tova", "inertia alpha=0.95"}  # alpha = 0.8 is the default: the reference itself
    assert (table.loc["inertia alpha=0.95", "wins"], table.loc["inertia alpha=0.95", "p_sign"]) == (6, 2 / 64)
    assert cli.main(["results", "--root", str(tmp_path), "--vs", "inertia", "--settings"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("inertia alpha=0.95"))
    assert "+1.000 [+1.000, +1.000] 6/0/0 *" in line
    assert cli.main(["results", "--root", str(tmp_path), "--settings"]) == 0  # the plain table lists them too
    rows = {line.split()[0] + (" " + line.split()[1] if line.split()[1].startswith("alpha") else ""): line.split()
            for line in capsys.readouterr().out.splitlines() if line.startswith(("inertia", "tova"))}
    # alpha=0.8 spells the defaults: one experiment
    assert rows["inertia alpha=0.95"][2:4] == ["1.000", "(6)"] and rows["inertia"][1:3] == ["0.000", "(6)"]
    assert rows["tova"][1:3] == ["0.500", "(6)"]


def test_the_smallest_detectable_difference_by_hand():
    from kvviz.stats import detectable_difference

    # 6 discordant pairs: the two-sided exact test rejects only at 0 or 6 wins (p = 2 / 64), so the power is
    # q ** 6 and reaches 0.8 at q = 0.8 ** (1 / 6); the mean difference is then (2q - 1) * 6 / 100
    q = 0.8 ** (1 / 6)
    assert detectable_difference(100, 6) == pytest.approx((2 * q - 1) * 6 / 100, rel=1e-6)
    # 5 discordant pairs cannot reach p < 0.05 even all one way (2 / 32): nothing is detectable
    assert math.isnan(detectable_difference(100, 5)) and math.isnan(detectable_difference(100, 0))
    # more pairs at the same disagreement detect less; half-point differences halve it
    assert detectable_difference(200, 12) < detectable_difference(100, 6)
    assert detectable_difference(100, 6, magnitude=3.0) == pytest.approx(detectable_difference(100, 6) / 2)
    # and paired_delta reports it: ten samples all won by 1 out of 10
    assert paired_delta([np.ones(10)]).detectable == pytest.approx(detectable_difference(10, 10))
