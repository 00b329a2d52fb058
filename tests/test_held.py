"""Pairs at equal cache held, and quality against needle depth (kvviz/held.py), on hand-made rows."""

from __future__ import annotations

import json
import math

import pytest

from kvviz.held import depth_bins, held_pairs, held_table, quality_vs_depth
from kvviz.store import Store

BASE = {"source": "measured", "model": "m", "params": {}, "metric": "whole_match", "seed": 0, "prompt_len": 2000,
        "max_new_tokens": 10, "chat": False, "task": "prose_needle"}


def write(tmp_path, rows):
    folder = tmp_path / "sweep"
    folder.mkdir(parents=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps({**BASE, **r}) + "\n" for r in rows))
    return Store(tmp_path)


def held_store(tmp_path, **extra):
    """4 samples.  TOVA holds 199 at 0.9.  SnapKV holds 208 at 0.9 (B + 9 new tokens) and 199 at 0.905; it
    wins sample 0 at 0.905 and loses samples 1 and 2 at 0.9.  ``extra``: fields every row gets."""
    rows = []
    for sample in range(4):
        meta = {"depth": 0.1 + 0.25 * sample}
        rows.append({"sample": sample, "meta": meta, "policy": "full", "compression": 0.9, "score": 1.0,
                     "max_decode_cache": 2009})
        rows.append({"sample": sample, "meta": meta, "policy": "tova", "compression": 0.9, "score": float(sample != 0),
                     "max_decode_cache": 199})
        rows.append({"sample": sample, "meta": meta, "policy": "snapkv", "compression": 0.9,
                     "score": float(sample not in (1, 2)), "max_decode_cache": 208})
        rows.append({"sample": sample, "meta": meta, "policy": "snapkv", "compression": 0.905, "score": 1.0,
                     "max_decode_cache": 199 + (sample == 3)})
        # held far less (stopped at once, 7% under TOVA's 199): no partner within 5%
        rows.append({"sample": sample, "meta": meta, "policy": "streaming", "compression": 0.91, "score": 1.0,
                     "max_decode_cache": 185})
    return write(tmp_path, [{**row, **extra} for row in rows])


def test_cells_pair_only_at_equal_cache_held(tmp_path):
    pairs = held_pairs(held_store(tmp_path), "tova")
    # SnapKV at 0.9 holds 208, 9 over any TOVA cell: unpaired.  At 0.905 every sample pairs (sample 3 one over).
    # StreamingLLM's 185 is 14 (7%) under: unpaired too.
    assert set(pairs.policy) == {"snapkv"} and set(pairs.compression) == {0.905}
    assert list(pairs["sample"]) == [0, 1, 2, 3] and set(pairs.reference_compression) == {0.9}
    assert list(pairs.held) == [199, 199, 199, 200]
    # with no tolerance, sample 3 (200 vs 199) drops out; with 10% slack StreamingLLM pairs
    assert list(held_pairs(Store(tmp_path), "tova", tolerance=0)["sample"]) == [0, 1, 2]
    assert set(held_pairs(Store(tmp_path), "tova", slack=0.1).policy) == {"snapkv", "streaming"}


def test_the_held_table_has_the_paired_difference_and_what_each_side_held(tmp_path):
    row = held_table(held_store(tmp_path), "tova").iloc[0]
    # SnapKV 1, 1, 1, 1 against TOVA 0, 1, 1, 1: one win, three ties
    assert (row.policy, row.compression, row.wins, row.ties, row.losses) == ("snapkv", 0.905, 1, 3, 0)
    assert row.delta == pytest.approx(0.25) and row.p_sign == pytest.approx(1.0)
    assert row.held == pytest.approx(199.25) and row.reference_held == 199 and row.reference_compression == "0.9"
    assert math.isnan(row.detectable)  # one discordant pair can never reach p < 0.05


def test_depth_strata_and_their_means(tmp_path):
    import pandas as pd

    assert list(depth_bins(pd.Series([0.0, 0.09, 0.1, 0.55, 0.999, 1.0]))) == [0, 0, 1, 5, 9, 9]
    table = quality_vs_depth(held_store(tmp_path), policies=["tova", "full"], bins=4)
    tova = table[table.policy == "tova"]
    # depths 0.1, 0.35, 0.6, 0.85: one sample per quarter; TOVA loses the first
    assert list(tova.depth_bin) == [0, 1, 2, 3] and list(tova.score) == [0.0, 1.0, 1.0, 1.0]
    assert list(tova.depth) == [0.125, 0.375, 0.625, 0.875] and set(tova.samples) == {1}
    full = table[table.policy == "full"]
    assert full.compression.isna().all() and list(full.score) == [1.0] * 4


def test_the_depth_figure_draws_at_most_eight_policies_and_says_what_it_left_out(tmp_path):
    from kvviz.ui.results import Colours, _depth_figure, caption_of

    names = ["full", "inertia", "tova", "h2o", "snapkv", "streaming", "knorm", "keydiff", "random", "cumulative"]
    rows = [{"sample": sample, "meta": {"depth": sample / 10 + 0.05}, "policy": name,
             "compression": 0.9, "score": float(name == "full" or sample >= 5), "max_decode_cache": 199}
            for sample in range(10) for name in names]
    rows += [{"sample": 0, "meta": {"depth": 0.05}, "policy": "tova", "compression": 0.75, "score": 1.0,
              "max_decode_cache": 500}]
    store = write(tmp_path, rows)
    frame = quality_vs_depth(store)
    figure = _depth_figure(frame, Colours(names))
    drawn = {trace.name for trace in figure.data}
    assert len(drawn) == 8 and {"full", "inertia"} <= drawn and "cumulative" not in drawn
    head = figure.layout.title.text.split("<br>")[0]
    title = " ".join(caption_of(figure)[1])  # the caveats: in the note under the figure
    assert head.startswith("Quality vs needle depth at ρ = 0.9") and "ρ = 0.75" not in head
    assert "2 more policies (cumulative, random)" in title and "other compressions (0.75)" in title, title
    # each line is one point per tenth: TOVA 0 over the first half, 1 over the second
    tova = next(trace for trace in figure.data if trace.name == "tova")
    assert list(tova.x) == pytest.approx([0.05 + i / 10 for i in range(10)]) and list(tova.y) == [0.0] * 5 + [1.0] * 5
    # chosen policies are all drawn
    assert len({t.name for t in _depth_figure(frame, Colours(names), chosen=True).data}) == 10


def test_a_task_whose_full_cache_scores_under_the_floor_is_not_ranked(tmp_path):
    from kvviz.held import full_cache_ranking
    from kvviz.store import NOT_RANKED

    rows = [{"task": task, "sample": sample, "policy": "full", "compression": 0.9, "score": score,
             "max_decode_cache": 2009}
            for task, scores in (("easy", [1, 1, 1, 1, 0]), ("hard", [1, 1, 1, 0, 0]))
            for sample, score in enumerate(scores)]
    table = full_cache_ranking(write(tmp_path, rows)).set_index("task")
    # 4/5 = 0.8 reaches the floor; 3/5 does not
    assert table.loc["easy", "full_score"] == pytest.approx(0.8) and table.loc["easy", "status"] == "ranked"
    assert table.loc["hard", "status"] == NOT_RANKED and not table.loc["hard", "ranked"]
    assert table.loc["hard", "samples"] == 5


def test_the_depth_figure_marks_a_task_its_full_cache_fails(tmp_path):
    from kvviz.store import NOT_RANKED
    from kvviz.ui.results import Colours, _depth_figure, caption_of

    rows = [{"task": task, "sample": sample, "meta": {"depth": sample / 5 + 0.1}, "policy": policy,
             "compression": 0.9, "score": float(task == "easy" or sample < 3), "max_decode_cache": 199}
            for task in ("easy", "hard") for sample in range(5) for policy in ("full", "tova")]
    figure = _depth_figure(quality_vs_depth(write(tmp_path, rows)), Colours(["full", "tova"]))
    title = " ".join(caption_of(figure)[1])
    # hard: the full cache scores 3 of 5 = 0.6 < 0.8; easy: 1.0
    assert f"{NOT_RANKED} (full cache under 0.8): hard (0.60)" in title and "easy (" not in title


def test_the_results_tab_pairs_at_equal_cache_held_by_default(tmp_path):
    """SnapKV holds more than TOVA at ρ = 0.9: the Paired section leaves that unfair cell out by default, pairs
    SnapKV at 0.905 with TOVA at 0.9 instead, and says both; the nominal pairing still shows the 0.9 cell."""
    from kvviz.ui.results import PAIRINGS, SECTIONS, caption_of, query

    store = held_store(tmp_path, decode_tok_s=10.0)
    at = 3 * SECTIONS.index("Paired differences")
    figure, table = query(store, "(all)", "(all)", [], "measured", reference="tova")[at:at + 2]
    assert list(zip(table.policy, table.compression)) == [("snapkv", 0.905)]
    assert table.paired_at.iloc[0] == "equal cache held (tova at ρ=0.9)"
    assert (table.wins.iloc[0], table.ties.iloc[0], table.losses.iloc[0]) == (1, 3, 0)
    notes = " ".join(caption_of(figure)[1])
    assert "paired at equal cache held (each policy given no more than tova held): snapkv ρ=0.905" in notes
    assert "held more than tova at the same cut, with no cell at equal memory" in notes and "snapkv ρ=0.9" in notes
    nominal = query(store, "(all)", "(all)", [], "measured", reference="tova", pairing=PAIRINGS[1])[at + 1]
    assert list(zip(nominal.policy, nominal.compression)) == [("snapkv", 0.9)]
    assert (nominal.wins.iloc[0], nominal.losses.iloc[0]) == (1, 2)  # wins sample 0, loses 1 and 2
