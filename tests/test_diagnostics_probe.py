"""Diagnostics on hand-made traces and the damage probe against one-at-a-time and physical eviction."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import kvviz
from kvviz import diagnostics as dx
from kvviz.cache import SlotCache
from kvviz.probe import (
    aligned_quality,
    auroc,
    average_precision,
    check_fits,
    damage,
    keep_order,
    probe,
    ranking_quality,
)
from kvviz.trace import StepEvent, Trace


def event(step, kept, evicted, raw=None, utility=None):
    kept, evicted = np.array(kept), np.array(evicted, dtype=np.int64)
    return StepEvent(step, 0, 0, "", kept, evicted, None if utility is None else np.array(utility, np.float32),
                     None if raw is None else np.array(raw, np.float32))


def hand_trace():
    # Budget 2.  Step 1: present [0, 1, 2], raw [.5, .1, .4] -> raw top-2 {0, 2}; it evicts 2, keeping
    #   {0, 1} with utility [.6, .3] -> utility top-2 {0, 1}.
    # Step 2: present [0, 1, 3], raw [.1, .6, .3] -> raw top-2 {1, 3}; it evicts 0, keeping {1, 3}.
    events = [event(0, [0, 1], []),
              event(1, [0, 1], [2], raw=[0.5, 0.1, 0.4], utility=[0.6, 0.3]),
              event(2, [1, 3], [0], raw=[0.1, 0.6, 0.3], utility=[0.5, 0.2])]
    return Trace([7, 8], 2, "test", events=events)


def test_churn_jaccard_and_evicted_rate_on_a_hand_trace():
    trace = hand_trace()
    # Raw churn at step 2: top sets {0, 2} -> {1, 3}: nothing shared, churn 1.
    assert dx.raw_churn(trace) == [(2, 1.0)]
    # Utility churn: {0, 1} -> {1, 3}: Jaccard 1/3 (one shared of three), churn 2/3.
    assert dx.utility_churn(trace) == [(2, pytest.approx(2 / 3))]
    # Raw/utility Jaccard: step 1 {0,2} vs {0,1} = 1/3; step 2 {1,3} vs {1,3} = 1.
    assert dx.raw_utility_jaccard(trace) == [(1, pytest.approx(1 / 3)), (2, 1.0)]
    # Raw-top evicted: step 1 evicts 2, which is in the raw top-2 -> 1/2; step 2 evicts 0, not in {1, 3} -> 0.
    assert dx.raw_top_evicted_rate(trace) == [(1, 0.5), (2, 0.0)]
    summary = dx.summary(trace)
    assert summary["raw_top_evicted_rate"] == pytest.approx(0.25)
    assert summary["raw_utility_jaccard"] == pytest.approx(2 / 3)


def test_keep_turnover_and_rank_stability_on_a_hand_trace():
    # Budget 4.  Step 1: present 0-4, raw descending with position; evicts 4, utilities [.9, .8, .7, .6].
    # Step 2: present [0, 1, 2, 3, 5], raw ascending; evicts 3, keeping [0, 1, 2, 5] with [.6, .8, .7, .9];
    #   position 6 arrives at step 3 with +inf utility (not judged yet) beside the same four.
    events = [event(0, [0, 1, 2, 3], []),
              event(1, [0, 1, 2, 3], [4], raw=[.5, .4, .3, .2, .1], utility=[.9, .8, .7, .6]),
              event(2, [0, 1, 2, 5], [3], raw=[.1, .2, .3, .4, .5], utility=[.6, .8, .7, .9]),
              event(3, [0, 1, 2, 5, 6], [], utility=[.6, .8, .7, .9, np.inf])]
    trace = Trace([7, 8, 9, 10], 4, "test", events=events)
    # Keep sets {0,1,2,3} -> {0,1,2,5}: 3 shared of 5 -> churn 2/5; step 3 evicts nothing, it only adds 6:
    # no turnover to count (growth is not replacement).
    assert dx.keep_turnover(trace) == [(2, pytest.approx(2 / 5))]
    # Raw over the positions present at both steps 1 and 2, {0, 1, 2, 3}: [.5, .4, .3, .2] then
    # [.1, .2, .3, .4], exactly reversed -> Spearman -1.  Step 3 scored nothing.
    assert dx.raw_rank_stability(trace) == [(2, pytest.approx(-1.0))]
    # Utilities over {0, 1, 2}, kept at both: ranks [3, 2, 1] then [1, 3, 2]; d = [2, -1, -1], sum d^2 = 6,
    # rho = 1 - 6 * 6 / (3 * 8) = -0.5.  Step 3 leaves {0, 1, 2, 5} as they were (the new +inf entry aside):
    # no new ranking, so no pair (it would read as a perfectly stable one).
    assert dx.utility_rank_stability(trace) == [(2, pytest.approx(-0.5))]
    summary = dx.summary(trace)
    assert summary["keep_turnover"] == pytest.approx(0.4)
    assert summary["utility_rank_stability"] == pytest.approx(-0.5)
    # Utility top-4: {0,1,2,3} -> {0,1,2,5} at step 2, churn 2/5.  Step 3 evicts nothing: its top-4 {6,5,1,2}
    # (6 unjudged at +inf pushes 0 out) decided nothing, so it is no churn (counted, another 2/5).
    assert dx.utility_churn(trace) == [(2, pytest.approx(0.4))]
    # Fewer than three common positions: no correlation, and the mean skips it.
    assert np.isnan(dx.utility_rank_stability(hand_trace())[0][1])
    assert np.isnan(dx.summary(hand_trace())["utility_rank_stability"])


def test_first_keep_set_retained_on_a_hand_trace():
    """The share of the first evicting step's keep set still kept: step 1 keeps {0, 1} (evicting 2), step 2
    evicts 0 -> 1/2; a step that evicts the newcomer only keeps it whole (InertiaKV §3.1's 79 steps)."""
    assert dx.first_keep_set_retained(hand_trace()) == [(1, 1.0), (2, 0.5)]
    assert dx.summary(hand_trace())["first_keep_set_retained"] == 0.5  # at the end, not a mean over steps
    # Budget 2 from a 3-token prompt; steps 2 and 3 evict the entry each brought in: the set stays {0, 1}.
    events = [event(0, [0, 1, 2], []), event(1, [0, 1], [2]), event(2, [0, 1], [3]), event(3, [0, 1], [4])]
    assert dx.first_keep_set_retained(Trace([7, 8, 9], 2, "test", events=events)) == [(1, 1.0), (2, 1.0), (3, 1.0)]
    # The long-generation regime: the first eviction comes at step 2, once generation has filled B = 3.
    events = [event(0, [0, 1], []), event(1, [0, 1, 2], []), event(2, [0, 2, 3], [1]), event(3, [2, 3, 4], [0])]
    assert dx.first_keep_set_retained(Trace([7, 8], 3, "test", events=events)) == [(2, 1.0), (3, pytest.approx(2 / 3))]
    full = Trace([7, 8], 2, "full", events=[event(0, [0, 1], []), event(1, [0, 1, 2], [])])
    assert dx.first_keep_set_retained(full) == [] and np.isnan(dx.summary(full)["first_keep_set_retained"])
    # One checkpoint, then growth: the set is whole by construction, not by a test, and the summary is n/a
    once = Trace([7, 8, 9], 2, "test", events=[event(0, [0, 1, 2], []), event(1, [0, 1], [2]),
                                               event(2, [0, 1, 3], []), event(3, [0, 1, 3, 4], [])])
    assert dx.first_keep_set_retained(once) == [(1, 1.0), (2, 1.0), (3, 1.0)]
    assert np.isnan(dx.summary(once)["first_keep_set_retained"])
    held = [event(0, [0, 1, 2], []), event(1, [0, 1], [2]), event(2, [0, 1], [3])]
    assert dx.summary(Trace([7, 8, 9], 2, "test", events=held))["first_keep_set_retained"] == 1.0  # tested, held


def test_token_history_on_a_hand_trace():
    history = dx.token_history(hand_trace().events, [0, 2, 3]).set_index(["step", "position"])
    # Step 0: only the prompt {0, 1}; 2 and 3 do not exist yet, and nothing was scored.
    assert history.loc[(0, 0), ["present", "kept", "evicted"]].tolist() == [True, True, False]
    assert not history.loc[(0, 2), "present"] and not history.loc[(0, 3), "present"]
    assert np.isnan(history.loc[(0, 0), "raw_rank"]) and np.isnan(history.loc[(0, 0), "utility_rank"])
    # Step 1: raw [.5, .1, .4] over {0, 1, 2}: 0 ranks 1st, 2 ranks 2nd; utility [.6, .3] over {0, 1}: 0 is 1st.
    assert history.loc[(1, 0), ["raw", "raw_rank", "utility", "utility_rank"]].tolist() == pytest.approx(
        [0.5, 1, 0.6, 1])
    assert history.loc[(1, 2), ["present", "kept", "evicted", "raw_rank"]].tolist() == [True, False, True, 2]
    assert np.isnan(history.loc[(1, 2), "utility"])  # evicted: no utility is recorded for it
    # Step 2: raw [.1, .6, .3] over {0, 1, 3}: 0 is last (3rd) and evicted; 3 is 2nd by raw and by utility.
    assert history.loc[(2, 0), ["evicted", "raw_rank"]].tolist() == [True, 3]
    assert history.loc[(2, 3), ["kept", "raw_rank", "utility_rank", "cached"]].tolist() == [True, 2, 2, 3]
    assert not history.loc[(2, 2), "present"]  # gone after its eviction
    # Position 0 is inside the raw top-2 at step 1 and outside at step 2: one crossing; 2 and 3 are ranked
    # on one step only, so they cannot cross.
    crossings = dx.boundary_crossings(history.reset_index(), 2)
    assert crossings == {0: 1, 2: 0, 3: 0}
    assert dx.boundary_crossings(history.reset_index(), 2, "utility_rank") == {0: 0, 2: 0, 3: 0}


def test_descending_rank_shares_ties_and_ranks_infinity_first():
    # 9 first; the two 5s share ranks 2 and 3 -> 2.5; +inf above everything; NaN has no rank.
    assert dx.descending_rank(np.array([5, 5, 9]), np.array([5, 9])).tolist() == [2.5, 1.0]
    assert dx.descending_rank(np.array([np.inf, 1.0, 2.0]), np.array([np.inf, 1.0])).tolist() == [1.0, 3.0]
    assert np.isnan(dx.descending_rank(np.array([1.0, 2.0]), np.array([np.nan]))).all()


def test_protected_entries_do_not_push_judged_ones_down_between_checkpoints():
    """A checkpointed policy's kept entries: judged 0, 1 (utilities .2, .7), then new tokens with +inf (not
    judged yet).  Position 0 stays 2nd among the judged at every step, however many +inf entries arrive;
    the +inf entries themselves have no rank."""
    events = [event(1, [0, 1, 2], [], utility=[0.2, 0.7, np.inf]),
              event(2, [0, 1, 2, 3], [], utility=[0.2, 0.7, np.inf, np.inf]),
              event(3, [0, 1, 2, 3, 4], [], utility=[0.2, 0.7, np.inf, np.inf, np.inf])]
    history = dx.token_history(events, [0, 3])
    assert history[history.position == 0].utility_rank.tolist() == [2, 2, 2]
    assert history[history.position == 3].utility_rank.isna().all()


def test_raw_crossings_are_counted_between_the_steps_that_scored():
    """Lazy refresh scores steps 1, 5, 9: a token inside the raw top-2 at 1, outside at 5, inside at 9
    crossed twice, although no two scored steps are consecutive."""
    rows = [(step, 7, rank) for step, rank in ((1, 1.0), (2, np.nan), (5, 3.0), (6, np.nan), (9, 2.0))]
    history = pd.DataFrame(rows, columns=["step", "position", "raw_rank"])
    assert dx.boundary_crossings(history, 2) == {7: 2}


def test_spearman_and_topk_jaccard():
    # Ranks of a: [1, 2, 3, 4]; of b: [2, 1, 4, 3] -> d^2 = 1+1+1+1 = 4; rho = 1 - 6*4/(4*15) = 0.6.
    assert dx.spearman(np.array([1, 2, 3, 4]), np.array([20, 10, 40, 30])) == pytest.approx(0.6)
    assert dx.spearman(np.array([1, 2, 3]), np.array([3, 2, 1])) == pytest.approx(-1.0)
    # Ties averaged: a ranks [1.5, 1.5, 3]; b ranks [1, 2, 3] -> Pearson of centred ranks
    # [-.5, -.5, 1] . [-1, 0, 1] = 1.5 over sqrt(1.5 * 2) -> 0.866.
    assert dx.spearman(np.array([5, 5, 9]), np.array([1, 2, 3])) == pytest.approx(0.8660254)
    # Top-2 of a: indices {2, 3}; of b: {2, 0}: Jaccard 1/3.
    assert dx.topk_jaccard(np.array([0.1, 0.2, 0.9, 0.8]), np.array([0.7, 0.1, 0.9, 0.3]), 2) == pytest.approx(1 / 3)


def test_mean_pairwise_jaccard_of_retention_sets():
    a = Trace([0], 2, "a", events=[event(0, [0], []), event(1, [0, 1], [])])
    b = Trace([0], 2, "b", events=[event(0, [0], []), event(1, [1, 2], [])])
    c = Trace([0], 2, "c", events=[event(0, [0], []), event(1, [0, 1], [])])
    # Step 1 pairs: a-b {0,1} vs {1,2} = 1/3; a-c = 1; b-c = 1/3 -> mean 5/9.
    assert dx.mean_pairwise_jaccard([a, b, c]) == pytest.approx(5 / 9)


def test_diagnostics_run_on_a_real_trace(tiny, tiny_prompt):
    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=20, max_new_tokens=12).trace
    values = dx.summary(trace)
    assert all(-1.0 <= v <= 1.0 for v in values.values())
    # InertiaKV keeps exactly its top-B utilities, so with k = B the utility churn is the churn of the keep
    # sets themselves: 2/21 when the new token displaces one of 20 entries, 0 when it is itself evicted.
    steps = trace.decode_steps
    expected = [(b.step, 1 - len(set(a.kept.tolist()) & set(b.kept.tolist()))
                 / len(set(a.kept.tolist()) | set(b.kept.tolist()))) for a, b in zip(steps, steps[1:])]
    measured = dx.utility_churn(trace)
    assert [step for step, _ in measured] == [step for step, _ in expected]
    assert [v for _, v in measured] == pytest.approx([v for _, v in expected])
    assert {round(v, 6) for _, v in expected} <= {0.0, round(2 / 21, 6)} and any(v for _, v in expected)
    assert dx.keep_turnover(trace) == measured
    full = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=6).trace
    assert dx.keep_turnover(full) == [] and np.isnan(dx.summary(full)["keep_turnover"])  # it only grows
    lazy = kvviz.run(model, tokenizer, tiny_prompt, "inertia-lazy", budget=20, max_new_tokens=12).trace
    assert len(dx.raw_churn(lazy)) == 0  # no two consecutive scored steps with r = 4
    # Between refreshes Lazy's utilities do not move: its rankings are paired refresh to refresh, the scored
    # steps after the first (1, 5, 9 with r = 4), for utilities and raw scores alike.
    scored = [e.step for e in lazy.decode_steps if e.scored]
    assert scored == [1, 5, 9]
    assert [step for step, _ in dx.utility_rank_stability(lazy)] == [5, 9]
    assert [step for step, _ in dx.raw_rank_stability(lazy)] == [5, 9]
    assert all(value < 1.0 for _, value in dx.utility_rank_stability(lazy))
    # Score-Free ranks by its first scores for the whole run: never a new ranking to pair.
    frozen = kvviz.run(model, tokenizer, tiny_prompt, "score-free", budget=20, max_new_tokens=12).trace
    assert dx.utility_rank_stability(frozen) == [] and np.isnan(dx.summary(frozen)["utility_rank_stability"])
    # A policy that rescores every step is paired at every step after the first.
    assert [step for step, _ in dx.utility_rank_stability(trace)] == [e.step for e in steps[1:]]
    # AvoKV-E, R-KV and LazyEviction rescore at their checkpoints only: paired checkpoint to checkpoint.
    for name in ("avokv", "rkv", "lazyeviction"):
        checkpointed = kvviz.run(model, tokenizer, tiny_prompt, name, budget=60, max_new_tokens=30, interval=8).trace
        decisions = [e.step for e in checkpointed.decode_steps if e.components]
        assert decisions == [1, 8, 16, 24]
        assert [step for step, _ in dx.utility_rank_stability(checkpointed)] == decisions[1:]
        # Churn only into a checkpoint (the steps that evict), each from the step before it.
        assert [step for step, _ in dx.utility_churn(checkpointed)] == decisions[1:]
        # One checkpoint in a short run: nothing to pair, n/a (not 2/(B+1) from its new entries at +inf).
        short = kvviz.run(model, tokenizer, tiny_prompt, name, budget=60, max_new_tokens=10, interval=16).trace
        assert [e.step for e in short.decode_steps if e.evicted.size] == [1]
        assert dx.utility_churn(short) == [] and np.isnan(dx.summary(short)["utility_churn"])


def test_token_history_of_a_real_run_agrees_with_its_events(tiny, tiny_prompt):
    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=20, max_new_tokens=12).trace
    positions = sorted({int(trace.decode_steps[-1].evicted[0]), int(trace.events[-1].kept[0]), 3})
    history = dx.token_history(trace.events, positions)
    assert len(history) == len(trace.events) * len(positions)
    for event in trace.events:
        rows = history[history.step == event.step].set_index("position")
        for position in positions:
            row = rows.loc[position]
            assert row.present == (position in event.present) and row.kept == (position in event.kept)
            if row.kept and event.utility is not None:  # ascending ranks turned around: 1 = highest
                index = event.kept.tolist().index(position)
                assert row.utility_rank == event.kept.size + 1 - dx.ranks(event.utility)[index]
                assert event.step == 0 or row.utility_rank <= trace.budget  # it keeps exactly its top B
            if row.present and event.raw is not None:
                index = event.present.tolist().index(position)
                assert row.raw_rank == event.present.size + 1 - dx.ranks(event.raw)[index]
    # An evicted position is present once more at its eviction step and never again.
    for position in positions:
        rows = history[history.position == position]
        if rows.evicted.any():
            step = int(rows[rows.evicted].step.iloc[0])
            assert not rows[rows.step > step].present.any()


def test_auroc_and_average_precision_by_hand():
    scores, labels = np.array([0.9, 0.8, 0.3, 0.1]), np.array([1, 0, 1, 0])
    # Positive/negative pairs won: (.9>.8), (.9>.1), (.3>.1); lost: (.3<.8) -> 3/4.
    assert auroc(scores, labels) == pytest.approx(0.75)
    # Ranked: hit, miss, hit, miss -> precisions at hits 1/1 and 2/3 -> AP = 5/6.
    assert average_precision(scores, labels) == pytest.approx(5 / 6)
    quality = ranking_quality(np.array([4.0, 3, 2, 1, 0, -1, -2, -3, -4, -5]),
                              np.array([9.0, 1, 1, 1, 1, 1, 1, 1, 1, 1]))
    assert quality["auroc"] == 1.0 and quality["topk_recall"] == 1.0 and quality["false_safe_rate"] == 0.0
    # Twenty entries, k = 2 high-damage (#0 and #1).  This utility ranks #0 first and #1 last: top-k recall
    # 1/2 (its two highest are #0 and #2), false-safe 1/2 (its two lowest, the first it would evict: #19, #1).
    damage_values = np.array([9.0, 8] + [1.0] * 18)
    utility = np.array([20.0, -1] + [19.0 - i for i in range(18)])
    quality = ranking_quality(utility, damage_values)
    assert quality["topk_recall"] == 0.5 and quality["false_safe_rate"] == 0.5
    assert ranking_quality(-damage_values, damage_values)["false_safe_rate"] == 1.0  # evicts the damaging first


def test_ranking_metrics_break_ties_as_the_policies_evict():
    """Ten entries in position order, the newest (#9) the most damaging (k = 1), every utility tied.  A policy
    evicts the oldest of a tie first (policies.base.lowest), so it keeps #9 longest: top-k recall 1, false-safe
    0, AP 1.  Broken by array order instead, #0 would be 'kept' first: recall 0 and false-safe 1."""
    from kvviz.policies.base import lowest

    tied, damage_values = np.zeros(10), np.arange(10.0)
    quality = ranking_quality(tied, damage_values)
    assert (quality["topk_recall"], quality["false_safe_rate"], quality["average_precision"]) == (1.0, 0.0, 1.0)
    assert quality["auroc"] == 0.5  # AUROC gives the tie half credit, whatever the order
    evicted_first = lowest(torch.zeros(10), torch.arange(10), 9)
    assert sorted(evicted_first.tolist()) == list(range(9))  # all but the newest
    # Ties broken within a score only: entries #0 and #1 share the top score, #1 (newer) comes first
    assert keep_order(np.array([5.0, 5, 1, 3])).tolist() == [1, 0, 3, 2]


def test_auroc_p_value_against_chance_by_hand():
    """Exact Mann-Whitney, two-sided.  One positive among six, ranked first: U = 5 of 5; under chance U is
    uniform on 0..5, so P(U = 5) = 1/6 and p = 2/6.  Two positives among five, both first: one of the
    C(5, 2) = 10 equally likely placements, p = 2/10.  A perfect ranking of that few is no evidence."""
    from kvviz.probe import auroc_p

    assert auroc_p(np.array([10.0, 1, 2, 3, 4, 5]), np.array([1, 0, 0, 0, 0, 0])) == pytest.approx(1 / 3)
    assert auroc_p(np.array([10.0, 9, 1, 2, 3]), np.array([1, 1, 0, 0, 0])) == pytest.approx(0.2)
    assert auroc_p(np.array([-10.0, -9, 1, 2, 3]), np.array([1, 1, 0, 0, 0])) == pytest.approx(0.2)  # inverted
    rng = np.random.default_rng(0)  # fifty positives ranked clearly low among 500: no chance result
    scores = np.concatenate([rng.normal(-1, 1, 50), rng.normal(0, 1, 450)])
    assert auroc_p(scores, np.arange(500) < 50) < 1e-6
    assert np.isnan(auroc_p(np.arange(5.0), np.zeros(5)))
    quality = ranking_quality(np.arange(50.0), np.arange(50.0))  # perfect, k = 5 of 50: not chance
    assert quality["auroc"] == 1.0 and quality["auroc_p"] < 1e-5


def test_auroc_p_counts_ties_exactly():
    """A ranking that is almost all one tied score.  41 entries, 40 scored 0 and one scored 1; four
    positives, the lone 1 among them: AUROC = (37 + 3 x 37 / 2) / (4 x 37) = 0.625 from half credit alone; under
    chance the four positives are any 4 of 41 and the statistic takes two values: the set holds the 1 (rank
    sum 41 + 3 x 20.5) or not (4 x 20.5).  Only the first is as far from the mean 4 x 21, so p = P(the 1 is
    among the four) = 4/41 -- not the 0.003 the normal approximation gives."""
    from kvviz.probe import auroc_p, largest_tie

    scores = np.zeros(41)
    scores[7] = 1.0
    labels = np.isin(np.arange(41), [1, 2, 3, 7])
    assert auroc_p(scores, labels) == pytest.approx(4 / 41)
    assert auroc_p(-scores, labels) == pytest.approx(4 / 41)  # two-sided
    # One positive of four scored 1 against three tied 0s (midrank 2): it is the 1 with probability 1/4
    assert auroc_p(np.array([1.0, 0, 0, 0]), np.array([1, 0, 0, 0])) == pytest.approx(1 / 4)
    assert auroc_p(np.zeros(6), np.arange(6) < 2) == pytest.approx(1.0)  # all tied: no evidence at all
    assert largest_tie(scores) == pytest.approx(40 / 41) and largest_tie(np.arange(4.0)) == 0.25


def test_aligned_quality_ranks_every_policy_on_the_entries_all_of_them_judged():
    # Eleven entries; the last is a protected tail entry one policy never judged (+inf) and the most damaging.
    damage_values = np.array([1.0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 50])
    protecting = np.append(-damage_values[:10], np.inf)  # judges the other ten exactly backwards
    faithful = damage_values.copy()
    quality, aligned = aligned_quality({"protecting": protecting, "faithful": faithful}, damage_values)
    assert aligned.tolist() == [True] * 10 + [False]
    # Over the first ten the top decile is the entry of damage 10: "faithful" ranks it first, "protecting" last
    # (AP: the one hit at rank 10 -> precision 1/10).
    assert quality["faithful"]["auroc"] == 1.0 and quality["faithful"]["topk_recall"] == 1.0
    assert quality["protecting"]["auroc"] == 0.0 and quality["protecting"]["topk_recall"] == 0.0
    assert quality["protecting"]["average_precision"] == pytest.approx(0.1)
    # Unaligned, the protected entry it never judged would earn it half the top-k recall (labels: 10 and 50).
    assert ranking_quality(protecting, damage_values)["topk_recall"] == 0.5
    with pytest.raises(ValueError, match="judged by every policy"):
        aligned_quality({"a": np.array([np.inf, 1.0]), "b": np.array([1.0, np.inf])}, np.array([1.0, 2.0]))
    # -inf is a judgement (evict first), NaN is none
    _, aligned = aligned_quality({"a": np.array([-np.inf, np.nan, 1.0, 2.0])}, np.array([1.0, 2.0, 3.0, 4.0]))
    assert aligned.tolist() == [True, False, True, True]


@pytest.mark.transformers_api
def test_batched_probe_equals_one_at_a_time_and_physical_eviction(tiny, tiny_prompt):
    model, tokenizer = tiny
    step, future = 3, 4
    full = kvviz.run(model, tokenizer, tiny_prompt, "full", max_new_tokens=step + future)
    sequence = tiny_prompt + full.token_ids
    prefix_len = len(tiny_prompt) + step - 1
    candidates = [0, 5, 17, prefix_len - 1]
    batched = damage(model, sequence, prefix_len, candidates, future=future, batch=3)
    single = damage(model, sequence, prefix_len, candidates, future=future, batch=1)
    np.testing.assert_allclose(batched, single, rtol=1e-4, atol=1e-7)
    assert (batched >= 0).all() and batched.max() > 0

    # Independent route: physically evict the entry from a SlotCache and replay token by token.
    def replay(removed):
        cache = SlotCache(model.config.num_hidden_layers)
        logits = []
        with torch.inference_mode():
            model(input_ids=torch.tensor([sequence[:prefix_len]]), **{kvviz.engine.cache_kwarg(model): cache})
            if removed is not None:
                cache.evict(torch.tensor([removed]))
            for offset in range(future):
                out = model(input_ids=torch.tensor([[sequence[prefix_len + offset]]]),
                            position_ids=torch.tensor([[prefix_len + offset]]),
                            **{kvviz.engine.cache_kwarg(model): cache})
                logits.append(torch.log_softmax(out.logits[0, -1].float(), -1))
        return torch.stack(logits)

    reference = replay(None)
    for candidate, value in zip(candidates, batched):
        ablated = replay(candidate)
        kl = (reference.exp() * (reference - ablated)).sum(-1).mean()
        assert float(kl) == pytest.approx(float(value), rel=1e-3, abs=1e-6)


def test_probe_reports_rankings_for_policies_with_utilities(tiny, tiny_prompt):
    model, tokenizer = tiny
    policies = {n: kvviz.make_policy(n) for n in ("inertia", "avokv", "streaming")}
    result = probe(model, tokenizer, tiny_prompt, 4, policies=policies, sample=24, seed=1, future=4)
    assert len(result.candidates) == 24 == len(set(result.candidates.tolist()))
    assert set(result.utilities) == {"inertia", "avokv"}  # streaming has no per-entry utility
    assert all(np.isfinite(u).sum() > 0 for u in result.utilities.values())
    with pytest.raises(ValueError):
        probe(model, tokenizer, tiny_prompt, 0)


def test_probe_utilities_are_the_policys_own_at_that_step(tiny, tiny_prompt):
    """InertiaKV's utility in the probe equals the ``utility`` its step-``s`` event reports in an ordinary run
    whose budget never binds (the probe's full-cache trajectory)."""
    model, tokenizer = tiny
    step = 5
    result = probe(model, tokenizer, tiny_prompt, step, policies={"inertia": kvviz.make_policy("inertia")},
                   sample=12, seed=3, future=2)
    run = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=len(tiny_prompt) + 20, max_new_tokens=step + 1)
    event = run.trace.events[step]
    assert event.step == step
    by_position = dict(zip(event.kept.tolist(), event.utility.tolist()))
    expected = [by_position[p] for p in result.candidates.tolist()]
    np.testing.assert_allclose(result.utilities["inertia"], expected, rtol=1e-6)
    assert np.ptp(expected) > 0  # distinct utilities: the comparison can tell positions apart


def test_probe_measures_damage_after_the_step_its_utilities_saw(tiny, tiny_prompt):
    """Step s feeds position P = L + s - 1 and the utilities include that query; an eviction there first
    affects the query at P + 1.  So the label replays from P + 1 over the cache 0 .. P, on the continuation
    that plain ``model.generate`` produces."""
    model, tokenizer = tiny
    step, future = 4, 3
    result = probe(model, tokenizer, tiny_prompt, step, sample=10, seed=2, future=future)
    generated = model.generate(torch.tensor([tiny_prompt]), max_new_tokens=step + future, do_sample=False,
                               min_new_tokens=step + future)[0].tolist()
    position = len(tiny_prompt) + step - 1
    expected = damage(model, generated, position + 1, result.candidates.tolist(), future=future)
    np.testing.assert_allclose(result.damage, expected, rtol=1e-4, atol=1e-7)
    too_early = damage(model, generated, position, result.candidates.tolist(), future=future)
    assert not np.allclose(result.damage, too_early)  # the two alignments are distinguishable


def test_check_fits_says_what_can_change_when_no_step_fits():
    """A 100-token context and a 90-token prompt leave 10 decoded tokens: step + future <= 10."""
    from types import SimpleNamespace

    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=100))
    prompt = list(range(90))
    with pytest.raises(ValueError, match="choose --step 2 or less"):  # a step fits with this future
        check_fits(model, prompt, 5, 8, step_name="--step", future_name="--future")
    with pytest.raises(ValueError, match="lower --future to 5 or less, or use a shorter prompt"):
        check_fits(model, prompt, 5, 50, step_name="--step", future_name="--future")  # keeps the step asked for
    with pytest.raises(ValueError, match="lower --future to 9 or less .with --step 1., or use a shorter prompt"):
        check_fits(model, prompt, 12, 50, step_name="--step", future_name="--future")
    with pytest.raises(ValueError, match="; use a shorter prompt$"):  # a fixed future (the app's 8): prompt only
        check_fits(model, list(range(95)), 1, 8)
    with pytest.raises(ValueError, match="; use a shorter prompt$"):  # not even step 1 and one future token
        check_fits(model, list(range(99)), 1, 1, step_name="--step", future_name="--future")


# ---------------------------------------------------------------- AvoKV-E Fig. 1: blindspot and read lags

def wilson(k: int, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    centre, half = (k + z * z / 2) / (n + z * z), z * np.sqrt(k * (n - k) / n + z * z / 4) / (n + z * z)
    return centre - half, centre + half


def test_blindspot_counts_the_cell_and_tests_it_by_hand():
    from kvviz.probe import blindspot

    # 20 candidates; the two with the largest damage (the top decile) are the two in the blindspot
    read = np.array([0.1, 0.15] + [0.5] * 18)
    payload = np.array([0.9, 0.85] + [0.9] * 6 + [0.1] * 12)
    harm = np.array([5.0, 4.0] + list(np.linspace(0, 1, 18)))
    spot = blindspot([(read, payload, harm)])
    assert (spot.entries_in, spot.high_damage_in, spot.entries_out, spot.high_damage_out) == (2, 2, 18, 0)
    assert spot.fisher_p == pytest.approx(1 / 190)  # both high-damage entries land in the 2-entry cell: 1 / C(20, 2)
    assert spot.wilson == pytest.approx(wilson(2, 2))
    assert spot.grid_entries[4, 0] == 2 and spot.grid_high[4, 0] == 2  # N(b) in [0.8, 1], N(p) in [0, 0.2)
    assert spot.grid_entries[4, 2] == 6 and spot.grid_entries[0, 2] == 12 and spot.grid_entries.sum() == 20


def test_blindspot_thresholds_each_probe_apart_and_leaves_out_the_unjudged():
    from kvviz.probe import blindspot

    read, payload = np.linspace(0, 1, 10), np.linspace(1, 0, 10)  # entries 0 and 1 are in the blindspot
    quiet = np.arange(10.0)[::-1] * 1e-3        # its own top decile: entry 0
    loud = np.arange(10.0) * 1e3                # its own top decile: entry 9
    spot = blindspot([(read, payload, quiet), (read, payload, loud)])
    # pooled by value, the loud probe's entries 8 and 9 would take both labels and none would be in the
    # blindspot; thresholded per probe, each probe has one, the quiet one's inside
    assert (spot.high_damage_in, spot.entries_in, spot.high_damage_out, spot.entries_out) == (1, 4, 1, 16)
    unjudged = np.where(np.arange(10) < 5, np.nan, read)
    assert blindspot([(unjudged, payload, loud)]).grid_entries.sum() == 5
    with pytest.raises(ValueError, match="no candidate has both ranks"):
        blindspot([(np.full(10, np.nan), payload, loud)])


def test_a_rank_on_the_edge_falls_in_the_blindspot_in_the_grid_and_the_test_alike():
    from kvviz.probe import blindspot

    ranks_ = np.arange(11) / 10  # 0, 0.1, ..., 1: 0.2 and 0.8 are on the edges
    read, payload = ranks_, ranks_[::-1]  # read 0.2 goes with payload 0.8
    spot = blindspot([(read, payload, np.arange(11.0))])
    assert spot.entries_in == 3 == spot.grid_entries[4, 0]  # read 0, 0.1, 0.2 with payload 1, 0.9, 0.8
    assert spot.grid_entries.sum() == 11


def test_blindspot_summary_reads_when_the_cell_is_empty_or_alone_in_its_damage():
    from kvviz.probe import blindspot

    read, payload = np.array([0.1, 0.5, 0.5, 0.5]), np.array([0.9, 0.5, 0.5, 0.5])
    alone = blindspot([(read, payload, np.array([9.0, 0.0, 0.0, 0.0]))])
    assert alone.enrichment == float("inf") and "enrichment ∞" in alone.summary()
    empty = blindspot([(np.full(4, 0.5), payload, np.arange(4.0))])
    assert empty.entries_in == 0 and empty.summary().startswith("no entry in the blindspot")


def test_probe_records_avokvs_ranks_at_the_step_and_none_for_its_protected_tail(tiny, tiny_prompt):
    model, tokenizer = tiny
    step = 4
    result = probe(model, tokenizer, tiny_prompt, step, policies={"avokv": kvviz.make_policy("avokv")}, future=2)
    terms = result.terms["avokv"]
    prefix = len(tiny_prompt) + step - 1  # the cache holds 0 .. prefix at the step; candidates 0 .. prefix - 1
    assert result.candidates.tolist() == list(range(prefix))
    judged = np.isfinite(terms["N(p)"])
    tail = 32  # W_delay below a 768-token budget; the newest entry (the step's own token) is one of them
    assert judged.tolist() == [True] * (prefix + 1 - tail) + [False] * (tail - 1)
    # N(p) is the percentile rank of p among the judged, ties averaged
    p = terms["p"][judged]
    expected = (dx.ranks(p) - 1) / (p.size - 1)
    np.testing.assert_allclose(terms["N(p)"][judged], expected, atol=1e-6)
    assert set(terms) >= {"p", "r", "b", "N(p)", "N(r)", "N(b)", "S"}


def test_probe_leaves_h2os_recent_window_unjudged(tiny, tiny_prompt):
    """H2O never evicts its newest recent * B entries but keeps an accumulated score for them: ranked, they
    counted among its calls.  At the probe's budget B = P + step (the cache at the step, whole) the newest
    int(0.5 B) are +inf, the step's own entry among them, so int(0.5 B) - 1 of the candidates."""
    from kvviz.probe import aligned_quality

    model, tokenizer = tiny
    step = 3
    result = probe(model, tokenizer, tiny_prompt, step, policies={"h2o": kvviz.make_policy("h2o"),
                                                                  "tova": kvviz.make_policy("tova")}, future=2)
    budget = len(tiny_prompt) + step
    window = int(0.5 * budget)
    utility = result.utilities["h2o"]
    assert np.isposinf(utility).tolist() == [False] * (len(utility) - window + 1) + [True] * (window - 1)
    _, aligned = aligned_quality(result.utilities, result.damage)
    assert aligned.sum() == len(utility) - window + 1


def lag_events(columns: dict[int, list[float]], prompt_len: int, steps: int) -> list[StepEvent]:
    """Steps 1..steps keeping everything; the query of step k sits at position prompt_len + k - 1, and the
    j-th query after position p (j = 1, 2, ...) gives it the attention columns[p][j - 1], 0.01 elsewhere."""
    events = [event(0, list(range(prompt_len)), [])]
    for k in range(1, steps + 1):
        present = list(range(prompt_len + k))
        raw = []
        for position in present:
            after = (prompt_len + k - 1) - position - 1  # index of this query among those after the position
            column = columns.get(position, [])
            raw.append(column[after] if 0 <= after < len(column) else 0.01)
        events.append(event(k, present, [], raw=raw))
    return events


def test_read_lags_find_the_first_strong_read_by_hand():
    prompt_len, horizon = 2, 4
    columns = {2: [0.1, 0.5, 0.45, 0.9],   # peak 0.9 at lag 4; 0.85 * 0.9 = 0.765: first strong read at lag 4
               3: [0.8, 0.1, 0.1, 0.1],    # read at once
               4: [0.0, 0.0, 0.0, 0.0, 0.5]}  # its peak comes after the horizon: censored
    events = lag_events(columns, prompt_len, steps=9)
    lags = dx.read_lags(events, prompt_len, horizon=horizon, observe=2)
    by_position = dict(zip(lags.positions.tolist(), lags.lag.tolist()))
    assert by_position[2] == 4 and by_position[3] == 1 and by_position[4] == float("inf")
    # generated positions 2 .. 10; those after 6 lack four later queries
    assert lags.positions.tolist() == [2, 3, 4, 5, 6] and lags.dropped == 4
    # early read: mean of the first two queries; 3 (0.45) > 2 (0.3) > the 0.01 columns (5, 6) > 4 (0.0)
    early = dict(zip(lags.positions.tolist(), lags.early_rank.tolist()))
    assert early[3] == 1.0 and early[2] == 0.75 and early[4] == 0.0 and early[5] == early[6] == 0.375
    assert lags.read_by(1) == pytest.approx(3 / 5)  # 3, and 5 and 6 whose flat 0.01 is their own peak


def test_read_lag_split_and_its_test_see_the_well_read_read_sooner():
    prompt_len = 1
    columns = {p: ([0.9] if p % 2 else [0.0] * 6 + [0.5]) for p in range(1, 41)}  # odd: read at once; even: late
    lags = dx.read_lags(lag_events(columns, prompt_len, steps=48), prompt_len, horizon=8, observe=2)
    split = dx.read_lag_split(lags, at=(1, 8))
    assert split["high"]["read_by"][1] == 1.0 and split["low"]["read_by"][8] == 1.0
    assert split["low"]["read_by"][1] == 0.0 and split["low"]["never"] == 0.0
    assert split["ks_p"] < 1e-6


def test_read_lags_refuse_a_run_that_did_not_score_every_step_or_evicted():
    events = lag_events({}, 2, steps=5)
    events[3].raw = None
    with pytest.raises(ValueError, match="scores every step"):
        dx.read_lags(events, 2)
    events = lag_events({}, 2, steps=5)
    events[2].evicted = np.array([0])
    with pytest.raises(ValueError, match="evicted entries .first at step 2"):
        dx.read_lags(events, 2)
    assert dx.scores_attention("tova", {}) and dx.scores_attention("inertia", {"scorer": "attention"})
    assert not dx.scores_attention("inertia", {"scorer": "vnorm"}) and not dx.scores_attention("knorm", {})


def test_which_policies_record_attention_comes_from_the_policy_not_a_list_of_names(monkeypatch):
    """The registry's attention-scored entries (their raw score is the layer-mean last-query attention), a
    preset's scorer counted (inertia-vnorm is not one); a name added to the registry answers by its class,
    with no list of names in the diagnostics to edit."""
    from kvviz.policies import REGISTRY, PolicySpec
    from kvviz.policies.tova import TOVA

    assert [name for name in REGISTRY if dx.scores_attention(name, {})] == [
        "inertia", "inertia-lazy", "score-free", "single-step", "cumulative", "inertia-decoupled", "lazyeviction",
        "tova", "h2o"]
    assert not dx.scores_attention("nonexistent", {}) and not dx.scores_attention("tova", {"no_such": 1})
    monkeypatch.setitem(REGISTRY, "my-tova", PolicySpec("my-tova", TOVA, "My TOVA", "baseline", "TOVA again.", ""))
    assert dx.scores_attention("my-tova", {})


def test_top_k_diagnostics_are_na_where_the_cache_never_held_more_than_k(tiny, tiny_prompt, tmp_path, capsys):
    """README's read-lag run sets a budget of 100000 so that nothing is evicted: every step's raw top-k was the
    whole cache, and the summary read raw/utility Jaccard 1.0 and a raw churn that was only growth.  Those are
    n/a, the rank stabilities (Spearman over every entry) stay, and `kvviz trace` says why n/a."""
    from kvviz.cli import main

    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, tiny_prompt, "inertia", budget=100_000, max_new_tokens=6).trace
    values = dx.summary(trace)
    for name in ("raw_churn", "utility_churn", "keep_turnover", "raw_utility_jaccard", "raw_top_evicted_rate",
                 "first_keep_set_retained"):
        assert np.isnan(values[name]), name
    assert np.isfinite(values["raw_rank_stability"]) and np.isfinite(values["utility_rank_stability"])
    # at k below the cache the same run has them: one fewer than the prompt
    assert np.isfinite(dx.summary(trace, k=len(tiny_prompt) - 1)["raw_churn"])
    trace.save(tmp_path / "whole.parquet")
    assert main(["trace", str(tmp_path / "whole.parquet")]) == 0
    out = capsys.readouterr().out
    assert "raw utility jaccard     n/a" in out and "or the cache never held more than k entries" in out
