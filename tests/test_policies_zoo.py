"""Keep rules of the baselines and AvoKV-E against hand-computed examples (worked out in comments)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_policies_inertia import drive

from kvviz.policies import REGISTRY, make_policy
from kvviz.policies.avokv import eviction_risk, max_cosine_to_others
from kvviz.policies.checkpointed import percentile_rank, window_attention
from kvviz.scoring import LayerView, PrefillView

# -------------------------------------------------------------------------------------------- AvoKV-E


def test_percentile_rank_and_the_diagnostics_ranks_are_scipys_average_ranks():
    from scipy.stats import rankdata

    from kvviz.diagnostics import ranks

    values = torch.tensor([3.0, 1.0, 3.0, 2.0, 1.0, 1.0, 5.0])  # ties of two and of three
    expected = rankdata(values.numpy(), method="average")
    assert ranks(values.numpy()).tolist() == pytest.approx(expected.tolist())
    got = percentile_rank(values)
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx(((expected - 1) / 6).tolist())
    assert percentile_rank(torch.tensor([4.0])).tolist() == [0.0]


def test_avokv_ranks_its_sinks_among_the_candidates_as_its_docstring_says():
    """Table 5's four candidates with one sink (position 0, "I"): it is kept (+inf) but still ranked, so the
    others' S are those of the worked example below, not of percentile ranks over the three of them."""
    p = torch.tensor([0.04, 0.81, 0.02, 0.05])
    r = torch.tensor([0.55, 0.41, 0.55, 0.92])
    b = torch.tensor([0.55, 0.62, 2.10, 1.20])
    policy = make_policy("avokv", sinks=1)
    score = policy.risk({"p": p, "r": r, "b": b}, torch.tensor([0, 1, 2, 3]))
    assert score[0] == float("inf")
    assert [round(s, 2) for s in score[1:].tolist()] == [0.12, -0.40, -0.80]
    without_sink = eviction_risk(p[1:], r[1:], b[1:], 0.1, 0.9, 0.05)  # the reading not taken
    assert not torch.allclose(score[1:], without_sink)
    import kvviz.policies.avokv

    assert "they count in every percentile" in " ".join(kvviz.policies.avokv.__doc__.split())


def test_checkpointed_hooks_and_helpers_document_their_shapes():
    from kvviz.policies.avokv import AvoKVE
    from kvviz.policies.base import StepMean, grown
    from kvviz.policies.checkpointed import CheckpointPolicy, QueryWindowPolicy
    from kvviz.policies.lazyeviction import LazyEviction, recurrence_score
    from kvviz.policies.rkv import RKV

    documented = [percentile_rank, eviction_risk, StepMean.add, grown, QueryWindowPolicy.layer_features,
                  CheckpointPolicy.risk, AvoKVE.layer_features, AvoKVE.risk, RKV.layer_features, RKV.risk,
                  recurrence_score, LazyEviction.risk]
    for function in documented:
        doc = function.__doc__ or ""
        assert any(f"``({size},)``" in doc for size in "cnm"), function.__qualname__
    state = torch.tensor([1.0, 2.0])
    assert grown(state, 1) is state
    assert grown(state, 2, fill=-1.0).tolist() == [1.0, 2.0, -1.0, -1.0]  # (max(2 m, position + 1),)
    assert grown(state, 6).shape == (7,)


def test_avokv_worked_example_appendix_a_table_5():
    # Raw features of the four candidates ("I", "cook", "dinner", "myself").
    p = torch.tensor([0.04, 0.81, 0.02, 0.05])
    r = torch.tensor([0.55, 0.41, 0.55, 0.92])
    b = torch.tensor([0.55, 0.62, 2.10, 1.20])
    # Percentile ranks: N(p) = (1/3, 1, 0, 2/3); N(r) = (1/2, 0, 1/2, 1) (tie averaged); N(b) = (0, 1/3, 1, 2/3).
    assert percentile_rank(p).tolist() == pytest.approx([1 / 3, 1, 0, 2 / 3])
    assert percentile_rank(r).tolist() == pytest.approx([0.5, 0, 0.5, 1])
    assert percentile_rank(b).tolist() == pytest.approx([0, 1 / 3, 1, 2 / 3])
    score = eviction_risk(p, r, b, 0.1, 0.9, 0.05)
    assert [round(s, 2) for s in score.tolist()] == [-0.42, 0.12, -0.40, -0.80]
    keep = set((torch.topk(score, 2).indices + 1).tolist())  # two free slots; entries numbered from 1
    assert keep == {2, 3}
    routing = eviction_risk(p, r, b, 0.1, 0.9, 0.0)  # lambda_b = 0
    assert [round(s, 2) for s in routing.tolist()] == [-0.42, 0.10, -0.45, -0.83]
    assert set((torch.topk(routing, 2).indices + 1).tolist()) == {2, 1}


@pytest.mark.parametrize("lambda_b, kept_candidates", [(0.05, [2, 3]), (0.0, [1, 2])])
def test_avokv_decides_table_5s_checkpoint_through_its_own_path(lambda_b, kept_candidates):
    """The worked example through the policy itself (observe, then select_evictions), not only its score:
    four eligible candidates with Table 5's raw features, two newer entries in the delay buffer P, B = 4. P is
    kept whatever it scores, and of C the two that Table 5 keeps: {2, 3} with the payload term, {2, 1} without."""
    p = torch.tensor([0.04, 0.81, 0.02, 0.05])
    r = torch.tensor([0.55, 0.41, 0.55, 0.92])
    b = torch.tensor([0.55, 0.62, 2.10, 1.20])
    policy = make_policy("avokv", interval=1, delay=2, observe_window=2, sinks=0, lambda_b=lambda_b)
    policy.layer_features = lambda view, positions, queries, query_positions: {"p": p, "r": r, "b": b}
    policy.reset(5, 4, 1)  # a 5-token prompt, B = 4, one layer
    policy.begin_step(1, torch.arange(5), 5)
    positions = torch.arange(6)  # the prompt and the token just decoded: C = positions 0-3, P = {4, 5}
    policy.observe(LayerView(0, torch.zeros(1, 2), torch.randn(1, 6, 2), torch.randn(1, 6, 2), 1.0), positions)
    assert policy.candidates.tolist() == [0, 1, 2, 3]
    evicted = positions[policy.select_evictions(1, positions, 4)].tolist()
    assert sorted(set(range(6)) - set(evicted)) == sorted([c - 1 for c in kept_candidates] + [4, 5])


def test_avokv_raw_scores_ablation_skips_normalisation():
    p, r, b = torch.tensor([0.2, 0.4]), torch.tensor([0.5, 0.1]), torch.tensor([1.0, 3.0])
    # 0.1*0.2 - 0.9*0.5 + 0.05*1 = -0.38 ;  0.1*0.4 - 0.9*0.1 + 0.05*3 = 0.10
    assert eviction_risk(p, r, b, 0.1, 0.9, 0.05, normalise=False).tolist() == pytest.approx([-0.38, 0.10])


def test_max_cosine_to_others():
    keys = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]])
    # (1,0) and (2,0) are parallel -> 1; (0,1) is orthogonal to all -> 0; (-1,0) best matches (0,1) -> 0.
    assert max_cosine_to_others(keys).tolist() == [[1.0, 1.0, 0.0, 0.0]]


def test_window_attention_is_causal():
    # Two buffered queries at positions 5 and 6, zero vectors -> uniform over the keys each may see.
    view = LayerView(0, torch.zeros(1, 2), torch.randn(1, 4, 2), torch.randn(1, 4, 2), 1.0)
    key_positions = torch.tensor([0, 3, 6, 5])
    attn = window_attention(torch.zeros(2, 1, 2), torch.tensor([5, 6]), view, key_positions)
    assert attn[0, 0].tolist() == pytest.approx([1 / 3, 1 / 3, 0.0, 1 / 3])  # position 6 is in its future
    assert attn[0, 1].tolist() == pytest.approx([0.25, 0.25, 0.25, 0.25])


def avokv_view(query):
    """Seven cached entries (positions 0..6) of one head.  Keys: 0,1 point along x; 2,3 along y; 4 along -x.
    Value norms: 1 except entry 2 (norm 4)."""
    keys = torch.tensor([[[1.0, 0], [1, 0], [0, 1], [0, 2], [-1, 0], [1, 1], [1, -1]]])
    values = torch.tensor([[[1.0, 0], [0, 1], [4, 0], [1, 0], [0, 1], [1, 0], [0, 1]]])
    return LayerView(0, query, keys, values, 1.0)


def run_avokv_step(policy):
    policy.reset(6, 4, 1)  # prompt 0..5, budget 4, one layer
    assert policy.wants_scores(1)
    policy.begin_step(1, torch.arange(6), 6)
    positions = torch.arange(7)
    policy.observe(avokv_view(torch.zeros(1, 2)), positions)
    drop = policy.select_evictions(1, positions, 4)
    return set(range(7)) - set(positions[drop].tolist())


def test_avokv_keep_rule_on_a_hand_made_cache():
    # delay 2 protects P = {5, 6}; candidates C = {0..4}; entry 0 is a sink (S = +inf); B - |P| = 2 slots.
    # Zero query -> uniform attention: N(p) = 0.5 for all.  Max cosine within C: 0,1 -> 1; 2,3 -> 1; 4 -> 0,
    # so N(r) = 0.625 for 0..3 and 0 for 4.  Payload b = (1,1,4,1,1)/median 1: N(b) = .375, .375, 1, .375, .375.
    # S = .05 - .9 N(r) + .05 N(b): 1 -> -.494, 2 -> -.4625, 3 -> -.494, 4 -> +.069.  Keep 0 (sink) and 4.
    policy = make_policy("avokv", interval=1, delay=2, observe_window=2, sinks=1)
    assert run_avokv_step(policy) == {0, 4, 5, 6}
    # The terms it decided from, per entry present (0..6); the protected tail {5, 6} was not judged.
    terms = {name: values.tolist() for name, values in policy.components(torch.arange(7)).items()}
    assert set(terms) == {"p", "r", "b", "N(p)", "N(r)", "N(b)", "S"}
    nan = float("nan")
    assert terms["N(p)"] == pytest.approx([0.5] * 5 + [nan] * 2, nan_ok=True)
    assert terms["N(r)"] == pytest.approx([0.625] * 4 + [0, nan, nan], nan_ok=True)
    assert terms["N(b)"] == pytest.approx([0.375, 0.375, 1, 0.375, 0.375, nan, nan], nan_ok=True)
    assert terms["b"] == pytest.approx([1, 1, 4, 1, 1, nan, nan], nan_ok=True)
    assert terms["S"] == pytest.approx([float("inf"), -0.49375, -0.4625, -0.49375, 0.06875, nan, nan], nan_ok=True)
    # With lambda_r = 0 the payload decides: 2 has the largest value norm.
    policy = make_policy("avokv", interval=1, delay=2, observe_window=2, sinks=1, lambda_r=0.0)
    assert run_avokv_step(policy) == {0, 2, 5, 6}


def test_avokv_evicts_only_at_checkpoints():
    # Budget 3, prompt 2, interval 4: the cache grows 3, 4, 5, 6 and is cut back to 3 at step 4 (a checkpoint);
    # it never exceeds B + interval - 1 = 6.
    policy = make_policy("avokv", interval=4, delay=1, observe_window=1, sinks=0)
    policy.reset(2, 3, 1)
    cached, sizes = list(range(2)), []
    for step in range(1, 9):
        new = 1 + step
        policy.begin_step(step, torch.tensor(cached), new)
        cached.append(new)
        positions = torch.tensor(cached)
        n = len(cached)
        view = LayerView(0, torch.zeros(1, 2), torch.randn(1, n, 2), torch.randn(1, n, 2), 1.0)
        policy.observe(view, positions)
        drop = set(positions[policy.select_evictions(step, positions, 3)].tolist())
        cached = [p for p in cached if p not in drop]
        sizes.append(len(cached))
    assert sizes == [3, 4, 5, 3, 4, 5, 6, 3]
    assert max(sizes) <= policy.cache_bound(3, 8) == 6


@pytest.mark.parametrize("shared, prompt_queries", [(False, True), (True, True), (False, False), (True, False)])
def test_avokvs_first_checkpoint_on_an_over_budget_prompt_reads_the_last_w_obs_queries(tiny, tiny_prompt, shared,
                                                                                        prompt_queries):
    """O_t (Eq. 2) is the last W_obs query positions: at a checkpoint on step 1 that is the prompt's last 7
    queries and the step's own.  Read pressure p must be the eager model's attention from exactly those 8
    rows, mean over heads and rows, then over layers, for every candidate (entries <= P - W_delay); the same
    through a shared prefill (decode_many, as sweeps and Compare run it).  With ``prompt_queries=False`` (decode
    queries only) it is the step's own query alone."""
    import copy

    from kvviz.engine import decode, decode_many

    model, tokenizer = tiny
    policy = make_policy("avokv", interval=16, prompt_queries=prompt_queries)
    if shared:
        event = next(e for who, e in decode_many(model, tokenizer, tiny_prompt,
                                                 {"avokv": policy, "tova": make_policy("tova")}, budget=40,
                                                 max_new_tokens=2) if who == "avokv" and e.step == 1)
    else:
        event = [e for e in decode(model, tokenizer, tiny_prompt, policy, budget=40, max_new_tokens=2)
                 if e.step == 1][0]
    prompt_len = len(tiny_prompt)
    assert prompt_len > 40 + 15  # over B + interval - 1: a checkpoint at step 1
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = eager(input_ids=torch.tensor([tiny_prompt + [event.token_id]]), output_attentions=True).attentions
    rows = slice(prompt_len - 7, prompt_len + 1)  # prompt positions P-7 .. P-1, then the step's query at P
    candidates = np.arange(prompt_len + 1 - 32)  # W_delay = 32 below B = 768
    expected = np.mean([layer[0, :, rows, :].float().mean((0, 1)).numpy()[candidates] for layer in attentions], axis=0)
    present = event.present.tolist()
    measured = event.components["p"][[present.index(c) for c in candidates]]
    # one query alone (the decode one) is another read pressure: the test tells the two apart
    alone = np.mean([layer[0, :, prompt_len, :].float().mean(0).numpy()[candidates] for layer in attentions], axis=0)
    assert not np.allclose(expected, alone, rtol=1e-3)
    np.testing.assert_allclose(measured, expected if prompt_queries else alone, rtol=1e-4, atol=1e-7)


def test_avokv_delay_rule_follows_the_budget():
    policy = make_policy("avokv")
    assert policy.protected(1024) == 8 and policy.protected(768) == 8
    assert policy.protected(767) == 32 and policy.protected(512) == 32 and policy.protected(100) == 32
    assert make_policy("avokv", delay=8).protected(100) == 8  # the W_delay = W_obs ablation
    with pytest.raises(ValueError, match="protects"):
        make_policy("avokv").reset(500, 30, 1)
    with pytest.raises(ValueError, match="protects"):  # a short prompt does not help: decoding outgrows B
        make_policy("avokv").reset(14, 30, 1)
    with pytest.raises(ValueError, match="observe_window"):  # W_delay = 8 at B >= 768 < W_obs = 16
        make_policy("avokv", observe_window=16).reset(2000, 1000, 1)
    make_policy("avokv", observe_window=16).reset(2000, 700, 1)  # W_delay = 32 there: allowed


def test_avokv_payload_is_normalised_by_the_true_median():
    """Four candidates with value norms 1, 2, 3, 4: Eq. 7's median is 2.5 (not torch.median's 2), so
    b = (0.4, 0.8, 1.2, 1.6)."""
    policy = make_policy("avokv", interval=1, delay=1, observe_window=1, sinks=0)
    policy.reset(4, 3, 1)
    policy.begin_step(1, torch.arange(4), 4)
    values = torch.tensor([[[1.0, 0], [0, 2], [3, 0], [0, 4], [1, 0]]])
    keys = torch.tensor([[[1.0, 0], [0, 1], [1, 1], [1, -1], [-1, 0]]])
    policy.observe(LayerView(0, torch.zeros(1, 2), keys, values, 1.0), torch.arange(5))
    torch.testing.assert_close(policy.features["b"], torch.tensor([0.4, 0.8, 1.2, 1.6]))


# -------------------------------------------------------------------------------------------- R-KV


def test_rkv_keep_rule_on_a_hand_made_cache():
    # window 2 protects {5, 6}; candidates {0..4}; kernel 1 (no pooling); zero query -> equal importance, 1/5
    # (the softmax runs over the five candidates alone; 1/7 over all seven keys with pooling="head-mean").
    # Mean cosine to the other candidates: 0 -> (1 + 0 + 0 - 1)/4 = 0, 1 -> 0, 2 -> .25, 3 -> .25, 4 -> -.5;
    # softmax -> redundancy highest for 2, 3, then 0, 1, lowest for 4.  score = .1/5 - .9 * redundancy.
    # Keep B - |P| = 2: 4, then one of the tied 0/1 (the older, 0, is evicted first).  (The mean cosine among
    # the candidates; R-KV's own redundancy, the default, is checked by hand in tests/test_policies_rkv.py.)
    policy = make_policy("rkv", interval=1, window=2, kernel=1, observe_window=2, redundancy="mean-cosine")
    policy.reset(6, 4, 1)
    policy.begin_step(1, torch.arange(6), 6)
    positions = torch.arange(7)
    policy.observe(avokv_view(torch.zeros(1, 2)), positions)
    drop = policy.select_evictions(1, positions, 4)
    assert set(range(7)) - set(positions[drop].tolist()) == {1, 4, 5, 6}
    terms = {name: np.array(values.tolist()) for name, values in policy.components(positions).items()}
    assert set(terms) == {"importance", "redundancy", "score"}
    assert np.isnan(terms["score"][5:]).all() and terms["importance"][:5] == pytest.approx([1 / 5] * 5)
    assert terms["score"][:5] == pytest.approx(0.1 * terms["importance"][:5] - 0.9 * terms["redundancy"][:5])
    assert terms["redundancy"][2] == terms["redundancy"][3] > terms["redundancy"][0] > terms["redundancy"][4]
    # the softmax of the mean cosines (0, 0, .25, .25, -.5) itself
    expected = np.exp([0, 0, 0.25, 0.25, -0.5]) / np.exp([0, 0, 0.25, 0.25, -0.5]).sum()
    assert terms["redundancy"][:5] == pytest.approx(expected.tolist())
    assert terms["redundancy"][:5] == pytest.approx([0.1933, 0.1933, 0.2481, 0.2481, 0.1172], abs=1e-4)


def test_rkv_max_pools_importance_over_neighbouring_positions_not_slots():
    """Five candidates at positions 0..4 held in shuffled slots, the newest (5) protected by window 1.  One
    query [1, 0] at scale 1 against keys [log w, 0] gives attention w / sum(w) over the candidates: w = (.1, .5,
    .2, .05, .15) for positions 0..4 (1 for position 5, in the window, which takes no share), so a = w.
    Max-pooled over 3 neighbouring positions (the ends padded by nothing): (.5, .5, .5, .2, .15).  Pooled over
    the slots' order (positions 3, 0, 4, 1, 2) it would be (.15, .5, .5, .1, .5) by position."""
    weights = {0: 0.1, 1: 0.5, 2: 0.2, 3: 0.05, 4: 0.15, 5: 1.0}
    slots = torch.tensor([3, 0, 4, 1, 2, 5])  # slot -> position; the newest last, as a new token is written
    keys = torch.tensor([[[float(np.log(weights[p])), 0.0] for p in slots.tolist()]])
    policy = make_policy("rkv", interval=1, window=1, kernel=3, observe_window=1)
    policy.reset(5, 4, 1)
    policy.begin_step(1, slots[:5], 5)
    policy.observe(LayerView(0, torch.tensor([[1.0, 0.0]]), keys, torch.ones_like(keys), 1.0), slots)
    policy.select_evictions(1, slots, 4)
    importance = policy.components(slots)["importance"]
    by_position = {p: float(v) for p, v in zip(slots.tolist(), importance.tolist())}
    assert [by_position[p] for p in range(5)] == pytest.approx([0.5, 0.5, 0.5, 0.2, 0.15])
    assert np.isnan(by_position[5])  # protected: never judged


# -------------------------------------------------------------------------------------------- LazyEviction


def test_lazyeviction_tracks_recurrence_and_keeps_what_is_due_back():
    """Prompt 0..3, written at the prefill (TS = 3), B = 4, window 1, a checkpoint every 3 tokens; an entry is
    active at attention >= 1/n.
    Step 1 (t = 4, n = 5, 1/n = .2): 0 and 2 active -> MRI = 4 - 3 = 1 each, TS = 4.
    Step 2 (t = 5, n = 6, 1/n = .167): 0, 1, 5 active -> MRI(0) = max(1, 5 - 4) = 1, MRI(1) = 5 - 3 = 2; 5,
    read as it is written, stays 0; TS = 5.  Step 3 (t = 6, 1/n = .143): 3 and 6 active -> MRI(3) = 6 - 3 = 3.
    Checkpoint at step 3 (t = 6), 6 protected, keep 3 of candidates 0..5:
      0: idle 1, MRI 1 -> 2 sig(-1)   + 2 sig(-2) = 0.5379 + 0.2384 = 0.7763
      1: idle 1, MRI 2 -> 2 sig(-1/2) + 2 sig(-3) = 0.7551 + 0.0949 = 0.8499
      2: idle 2, MRI 1 -> 2 sig(-2)   + 2 sig(-2) = 0.2384 + 0.2384 = 0.4768
      3: idle 0, MRI 3 -> 1           + 2 sig(-4) = 1.0360
      4, 5: never read since written (MRI 0), idle 2 and 1 -> 0
    so {0, 1, 3} stay with 6: entry 2 recurred as often as 0 but has been idle twice its MRI; TOVA, by step
    3's attention alone, would keep 3 and three of the entries tied at 0.1."""
    policy = make_policy("lazyeviction", interval=3, window=1)
    steps = [[[[0.5, 0.1, 0.3, 0.05, 0.05]]],  # step k: one layer of one head over positions 0 .. 3 + k
             [[[0.3, 0.2, 0.1, 0.1, 0.1, 0.2]]],
             [[[0.1, 0.1, 0.1, 0.3, 0.1, 0.1, 0.2]]]]
    kept, _ = drive(policy, 4, 4, steps)
    assert kept == [{0, 1, 2, 3, 4}, {0, 1, 2, 3, 4, 5}, {0, 1, 3, 6}]
    assert policy.mri[:7].tolist() == [1, 2, 1, 3, 0, 0, 0]
    assert policy.last_active[:7].tolist() == [5, 5, 4, 6, 4, 5, 6]
    positions = torch.arange(7)
    terms = {name: np.array(values.tolist()) for name, values in policy.components(positions).items()}
    assert set(terms) == {"idle", "MRI", "H1", "H2", "score"} and np.isnan(terms["score"][6])
    assert terms["idle"][:6].tolist() == [1, 1, 2, 0, 2, 1] and terms["MRI"][:6].tolist() == [1, 2, 1, 3, 0, 0]
    assert terms["score"][:6] == pytest.approx([0.77629, 0.84993, 0.47681, 1.03597, 0.0, 0.0], abs=1e-5)
    assert terms["H1"][:6] + terms["H2"][:6] == pytest.approx(terms["score"][:6])


def test_lazyevictions_threshold_is_relative_to_the_uniform_share():
    # One step over five entries, 1/n = .2: at threshold 1 the 0.2 entries are active; at 2 only the 0.5 one.
    # The prompt (0..3) was written at the prefill, position 3: a first read at t = 4 is a gap of 1.
    row = [[[[0.5, 0.2, 0.2, 0.05, 0.05]]]]
    for threshold, active in ((1.0, [0, 1, 2]), (2.0, [0])):
        policy = make_policy("lazyeviction", threshold=threshold, window=1)
        drive(policy, 4, 8, row)
        assert [p for p in range(4) if policy.last_active[p] == 4] == active
        assert policy.mri[:4].tolist() == [1 if p in active else 0 for p in range(4)]


def test_lazyeviction_has_no_query_window_and_says_what_to_lower():
    with pytest.raises(ValueError, match="has no parameter.s. observe_window; it takes: interval, threshold, window"):
        make_policy("lazyeviction", observe_window=4)
    assert make_policy("lazyeviction").prefill_window == 0  # no prompt queries recorded at prefill
    assert make_policy("lazyeviction").pinned(100) == (0, 8)
    with pytest.raises(ValueError, match="budget 8 must exceed the 8 entries LazyEviction .* lower window"):
        make_policy("lazyeviction").reset(20, 8)
    # at delay 0 (the paper's rule, 32 below 768) the advice names the delay that shrinks the tail
    with pytest.raises(ValueError, match="must exceed the 36 entries AvoKV-E .* \\(or lower sinks to 3 or fewer, "
                                         "or the tail \\(delay between 8 and 31; 0 is the paper's rule, "
                                         "32 at this budget\\)\\)$"):
        make_policy("avokv").reset(20, 36)
    # each piece of advice, taken at its limit, makes the budget do; where none can (B = 1), none is offered
    make_policy("avokv", sinks=3).reset(20, 36)
    make_policy("avokv", delay=31).reset(20, 36)
    with pytest.raises(ValueError, match="raise the budget above 20 \\(or lower sinks to 1 or fewer and the tail "
                                         "\\(delay 8\\)\\)$"):
        make_policy("avokv", delay=16).reset(20, 10)
    make_policy("avokv", delay=8, sinks=1).reset(20, 10)
    with pytest.raises(ValueError, match="raise the budget above 12 \\(or lower sinks to 0 and the tail \\(delay and "
                                         "observe_window 4 or less\\)\\)$"):  # under W_obs: it must come down too
        make_policy("avokv", delay=8).reset(20, 5)
    make_policy("avokv", delay=4, observe_window=4, sinks=0).reset(20, 5)
    with pytest.raises(ValueError, match="raise the budget above 36$"):
        make_policy("avokv").reset(20, 1)
    with pytest.raises(ValueError, match="\\(or lower sinks to 3 or fewer\\)$"):  # the tail is at its floor, W_obs
        make_policy("avokv", delay=8).reset(20, 12)
    with pytest.raises(ValueError, match="\\(or lower sinks to 3 or fewer and the tail \\(delay 8\\)\\)$"):
        make_policy("avokv", delay=16).reset(20, 12)
    make_policy("avokv", delay=8, sinks=3).reset(20, 12)


# -------------------------------------------------------------------------------------------- checkpoints

@pytest.mark.parametrize("name", ["avokv", "rkv", "lazyeviction"])
@pytest.mark.parametrize("over, first", [
    (3, 5),     # the prompt 3 over B: the cache would pass B + 7 at step 5, before the scheduled step 8
    (20, 1),    # 20 over (>= interval): cut at step 1
    (0, 8),     # the prompt fills B exactly: over from step 1, first checkpoint at step 8
    (-5, 8),    # B 5 above the prompt: over from step 6, so step 8
    (-12, 16),  # over from step 13: step 8 passes under B, step 16
])
def test_a_checkpointed_policy_first_evicts_where_first_checkpoint_says(tiny, tiny_prompt, name, over, first):
    """first_checkpoint is begin_step's schedule worked out ahead: the engine's run first evicts there."""
    from kvviz.engine import decode

    model, tokenizer = tiny
    budget = len(tiny_prompt) - over
    policy = make_policy(name, interval=8)
    assert policy.first_checkpoint(len(tiny_prompt), budget) == first
    events = list(decode(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=first + 2,
                         ignore_eos=True))
    assert [e.step for e in events if e.evicted.size] == [first]
    # first + 2 new tokens decode step first + 1 from the cut cache; first + 1 would end at the cut (late)
    assert policy.late_first_checkpoint(len(tiny_prompt), budget, first + 2) is None
    assert policy.late_first_checkpoint(len(tiny_prompt), budget, first + 1) == first
    assert policy.late_first_checkpoint(len(tiny_prompt), budget, first) == first


def test_a_checkpointed_run_that_ends_before_its_first_checkpoint_says_why_its_cache_is_over_budget(tiny, tiny_prompt):
    from dataclasses import replace

    from kvviz.engine import decode
    from kvviz.trace import Trace, checkpoint_note

    model, tokenizer = tiny
    budget = len(tiny_prompt) - 2  # over B from step 1; the cache passes B + 15 at step 14

    def trace(name, steps, budget=budget, **params):
        policy = make_policy(name, **params)
        events = list(decode(model, tokenizer, tiny_prompt, policy, budget=budget, max_new_tokens=steps,
                             ignore_eos=True))
        return Trace(tiny_prompt, budget, name, policy.params(), "tiny-random-llama", events, max_new_tokens=steps)

    short = trace("avokv", 8, interval=16)
    # steps 0 .. 7: the prompt and tokens 1 .. 7 cached, nothing evicted
    assert short.events[-1].cache_size == len(tiny_prompt) + 7 > budget
    assert not any(e.evicted.size for e in short.events)
    assert checkpoint_note(short) == ("no checkpoint reached: avokv evicts every 16 generated tokens, first at step 14 "
                                      "here, and this run ended at step 7; the cache was not cut")
    stopped = replace(short, stopped=True)
    assert checkpoint_note(stopped).endswith("this run was stopped at step 7; the cache was not cut")
    assert checkpoint_note(trace("rkv", 8, interval=16)).startswith("no checkpoint reached: rkv evicts every 16 ")
    # A run that reached its first checkpoint (and is over B again after it) says nothing; nor does one whose
    # cache stayed within B, nor a policy that is not checkpointed.
    reached = trace("avokv", 20, interval=16)
    assert reached.events[-1].cache_size > budget and checkpoint_note(reached) == ""
    assert checkpoint_note(trace("avokv", 8, budget=len(tiny_prompt) + 8, interval=16)) == ""
    assert checkpoint_note(trace("full", 8)) == ""


# -------------------------------------------------------------------------------------------- per-step rules


def test_tova_keeps_top_current_attention_layer_mean():
    # Step 1 over [0, 1, 2]: layer mean of [.2,.3,.5] and [.6,.1,.3] = [.4, .2, .4] -> evict 1.
    # Step 2 over [0, 2, 3]: mean of [.1,.5,.4] and [.5,.1,.4] = [.3, .3, .4] -> tie 0/2, evict the older, 0.
    steps = [[[[0.2, 0.3, 0.5]], [[0.6, 0.1, 0.3]]], [[[0.1, 0.5, 0.4]], [[0.5, 0.1, 0.4]]]]
    kept, _ = drive(make_policy("tova"), 2, 2, steps)
    assert kept == [{0, 2}, {2, 3}]


def test_h2o_accumulates_and_protects_the_recent_window():
    # Budget 4, recent 0.5 -> the 2 newest positions are always kept.  Prompt [0, 1, 2, 3].
    # Step 1 over [0..4]: acc = [.1, .4, .1, .2, .2]; candidates (<= 4 - 2 = 2): 0, 1, 2 -> evict 0 (tie with 2, older).
    # Step 2 over [1, 2, 3, 4, 5]: acc += [.0, .3, .0, .0, .7] -> 1: .4, 2: .4, 3: .2; candidates <= 3:
    #   1, 2, 3 -> evict 3 (.2), although it is newer than 1 and 2.
    steps = [[[[0.1, 0.4, 0.1, 0.2, 0.2]]], [[[0.0, 0.3, 0.0, 0.0, 0.7]]]]
    kept, _ = drive(make_policy("h2o"), 4, 4, steps)
    assert kept == [{1, 2, 3, 4}, {1, 2, 4, 5}]


@pytest.mark.parametrize("recent, kept", [(0.0, {0, 1, 2, 4}), (0.5, {0, 1, 3, 4}), (1.0, {1, 2, 3, 4})])
def test_h2os_recent_share_sets_which_entries_are_candidates(recent, kept):
    """Prompt 0..3, B = 4, one step over 0..4 with attention (.3, .3, .2, .1, .1): one entry goes.
    recent 0: every entry is a candidate; 3 and 4 tie at .1 and the older, 3, goes.  recent .5: the newest
    2 are kept, candidates 0..2, the lowest is 2.  recent 1: the newest 4 are kept; only 0 is a candidate."""
    assert drive(make_policy("h2o", recent=recent), 4, 4, [[[[0.3, 0.3, 0.2, 0.1, 0.1]]]])[0] == [kept]


def test_h2os_recent_window_rounds_down_on_an_odd_budget():
    """B = 5, recent .5: the window is int(2.5) = 2 entries, so candidates are 0..3 and 3 (.05) goes; a window
    rounded up to 3 would leave 0..2 and evict 2 (.2)."""
    kept, _ = drive(make_policy("h2o"), 5, 5, [[[[0.3, 0.25, 0.2, 0.05, 0.1, 0.1]]]])
    assert kept == [{0, 1, 2, 4, 5}]
    assert make_policy("h2o").pinned(5) == (0, 2)


def test_streaming_keeps_sinks_and_recent():
    kept, scored = drive(make_policy("streaming", sinks=2), 6, 4, [[[[0.0] * 7]]] * 3)
    # B = 4: sinks {0, 1} + the 2 newest.
    assert kept == [{0, 1, 5, 6}, {0, 1, 6, 7}, {0, 1, 7, 8}]
    assert scored == [False] * 3


def test_recency_keeps_the_newest():
    kept, _ = drive(make_policy("recency"), 4, 3, [[[[0.0] * 5]]] * 2)
    assert kept == [{2, 3, 4}, {3, 4, 5}]


def test_random_is_seeded_and_respects_budget():
    def kept_sets(seed):
        return drive(make_policy("random", seed=seed), 20, 10, [[[[0.0]]]] * 5)[0]

    assert kept_sets(1) == kept_sets(1)
    assert kept_sets(1) != kept_sets(2)
    assert all(len(k) == 10 for k in kept_sets(3))


def test_random_evicts_every_entry_equally_often():
    """Prompt 0..9, B = 8: step 1 over 11 entries evicts 3, each with probability 3/11.  Over 3,000 seeds each
    entry's count is Binomial(3000, 3/11) (mean 818, sd 24): within 100 of the mean in every entry, about four
    standard deviations; an oldest-first or newest-first bias would put some at 0 or 3,000."""
    counts = np.zeros(11)
    for seed in range(3000):
        kept = drive(make_policy("random", seed=seed), 10, 8, [[[[0.0]]]])[0][0]
        counts[list(set(range(11)) - kept)] += 1
    assert counts.sum() == 9000
    assert np.abs(counts - 3000 * 3 / 11).max() < 100


def key_view(keys):
    keys = torch.tensor(keys, dtype=torch.float32)[None]
    return LayerView(0, torch.zeros(1, 2), keys, torch.ones_like(keys), 1.0)


def run_key_policy(name, keys, budget):
    policy = make_policy(name)
    n = len(keys)
    policy.reset(n - 1, budget, 1)
    policy.begin_step(1, torch.arange(n - 1), n - 1)
    positions = torch.arange(n)
    policy.observe(key_view(keys), positions)
    return set(range(n)) - set(positions[policy.select_evictions(1, positions, budget)].tolist())


def test_keydiff_keeps_distinctive_keys():
    # Keys (1,0), (0,1), (1,0), (2,0): mean unit key (3,1)/4 -> direction (.949, .316).
    # cos = .949 for 0, 2, 3 and .316 for 1; -cos keeps 1 best; three-way tie: evict the oldest (0) for B = 3.
    assert run_key_policy("keydiff", [[1, 0], [0, 1], [1, 0], [2, 0]], 3) == {1, 2, 3}


def test_knorm_keeps_low_norm_keys():
    # Norms 1, 2, 3, .5: the norm-3 key (position 2) goes first, then the norm-2 key.
    assert run_key_policy("knorm", [[1, 0], [0, 2], [3, 0], [0.5, 0]], 3) == {0, 1, 3}
    assert run_key_policy("knorm", [[1, 0], [0, 2], [3, 0], [0.5, 0]], 2) == {0, 3}


def test_snapkv_votes_with_the_prompt_window_then_never_evicts():
    # Prompt of 6 tokens; window 2 (positions 4, 5), kernel 1.  One head, keys along x with sizes
    # [3, 0, 1, 2, 0, 0]; queries (1, 0).  Query at 4 sees keys 0..4: softmax of [3, 0, 1, 2, 0];
    # query at 5 sees 0..5.  The votes are the mean of the two rows (numpy reference below).
    keys = torch.tensor([[[3.0, 0], [0, 0], [1, 0], [2, 0], [0, 0], [0, 0]]])
    queries = torch.tensor([[[1.0, 0], [1, 0]]])
    view = PrefillView(0, queries, keys, torch.ones_like(keys), 1.0)
    row4 = np.exp([3, 0, 1, 2, 0]) / np.exp([3, 0, 1, 2, 0]).sum()
    row5 = np.exp([3, 0, 1, 2, 0, 0]) / np.exp([3, 0, 1, 2, 0, 0]).sum()
    votes = (np.append(row4, 0) + row5) / 2
    assert view.attn.mean((0, 1)).tolist() == pytest.approx(votes.tolist(), rel=1e-5)
    policy = make_policy("snapkv", window=2, kernel=1)
    assert policy.prefill_window == 2
    policy.reset(6, 4, 1)
    positions = torch.arange(6)
    policy.observe_prefill(view, positions)
    drop = policy.select_evictions(0, positions, 4)
    # Window {4, 5} stays; of 0..3 the two best voted are 0 (key 3) and 3 (key 2).
    assert set(range(6)) - set(positions[drop].tolist()) == {0, 3, 4, 5}
    assert policy.select_evictions(1, torch.arange(7), 4).numel() == 0  # decoding: nothing evicted
    assert policy.cache_bound(4, 3) == 7


def test_snapkv_pools_only_the_positions_before_the_window():
    """Same prompt and votes as above, kernel 3: pooled_i = (v_(i-1) + v_i + v_(i+1)) / 3 over positions
    0..3 with zeros beyond them (the window's votes do not leak into position 3)."""
    keys = torch.tensor([[[3.0, 0], [0, 0], [1, 0], [2, 0], [0, 0], [0, 0]]])
    view = PrefillView(0, torch.tensor([[[1.0, 0], [1, 0]]]), keys, torch.ones_like(keys), 1.0)
    row4 = np.exp([3, 0, 1, 2, 0]) / np.exp([3, 0, 1, 2, 0]).sum()
    row5 = np.exp([3, 0, 1, 2, 0, 0]) / np.exp([3, 0, 1, 2, 0, 0]).sum()
    v = (np.append(row4, 0) + row5) / 2
    pooled = [(v[0] + v[1]) / 3, (v[0] + v[1] + v[2]) / 3, (v[1] + v[2] + v[3]) / 3, (v[2] + v[3]) / 3]
    policy = make_policy("snapkv", window=2, kernel=3)
    policy.reset(6, 3, 1)
    policy.observe_prefill(view, torch.arange(6))
    drop = policy.select_evictions(0, torch.arange(6), 3)
    assert policy.utility(torch.arange(4)).tolist() == pytest.approx(pooled, rel=1e-5)
    # Only one of 0..3 stays: position 1 (.243), whose neighbours carry it past position 0 (.215).
    assert set(range(6)) - set(drop.tolist()) == {1, 4, 5}


def test_reused_checkpointed_policy_reports_no_utility_before_its_next_checkpoint():
    policy = make_policy("rkv", interval=1, observe_window=1, window=1, kernel=1)
    keys = torch.tensor([[[1.0, 0], [0, 1], [1, 1], [2, 0]]])
    positions = torch.arange(4)
    policy.reset(3, 2, 1)
    policy.begin_step(1, torch.arange(3), 3)  # 4 entries over a budget of 2: a checkpoint
    policy.observe(LayerView(0, torch.tensor([[1.0, 0]]), keys, torch.ones_like(keys), 1.0), positions)
    assert policy.select_evictions(1, positions, 2).numel() == 2
    assert torch.isfinite(policy.utility(torch.arange(3))).all()  # the three candidates were scored
    policy.reset(3, 2, 1)
    assert policy.utility(positions) is None


def test_reused_snapkv_forgets_the_last_runs_scores():
    """A second run whose prompt fits the budget evicts nothing and scores nothing: its utility must be
    None, not the first run's pooled votes."""
    keys = torch.tensor([[[3.0, 0], [0, 0], [1, 0], [2, 0], [0, 0], [0, 0]]])
    view = PrefillView(0, torch.tensor([[[1.0, 0], [1, 0]]]), keys, torch.ones_like(keys), 1.0)
    policy = make_policy("snapkv", window=2, kernel=1)
    policy.reset(6, 4, 1)
    policy.observe_prefill(view, torch.arange(6))
    assert policy.select_evictions(0, torch.arange(6), 4).numel() == 2
    assert policy.utility(torch.arange(4)) is not None  # the first run did score
    policy.reset(6, 6, 1)  # budget = prompt: nothing to select
    policy.observe_prefill(view, torch.arange(6))
    assert policy.select_evictions(0, torch.arange(6), 6).numel() == 0
    assert policy.utility(torch.arange(6)) is None


def test_decoupled_inertia_averages_layers_then_one_ema():
    # alpha = .5.  Step 1 over [0, 1, 2]: layer mean of [.2,.3,.5] and [.6,.1,.3] = [.4, .2, .4], each entry's
    #   first observation -> m = s = [.4, .2, .4]; evict 1.  (InertiaKV's layer-sequential rule: [.35, .125, .275].)
    # Step 2 over [0, 2, 3]: layer mean of [.1,.5,.4] and [.3,.3,.4] = [.2, .4, .4]
    #   -> m[0] = .5 * .4 + .5 * .2 = .3, m[2] = .4, m[3] = .4 (first seen); evict 0.  Started at 0, the new
    #   entry 3 would have read .5 * .4 = .2 and gone instead, for a score as high as any.
    policy = make_policy("inertia-decoupled", alpha=0.5)
    kept, _ = drive(policy, 2, 2, [[[[0.2, 0.3, 0.5]], [[0.6, 0.1, 0.3]]],
                                   [[[0.1, 0.5, 0.4]], [[0.3, 0.3, 0.4]]]])
    assert kept == [{0, 2}, {2, 3}]
    assert policy.utility(torch.tensor([2, 3])).tolist() == pytest.approx([0.4, 0.4])


def test_decoupled_inertia_starts_an_entry_that_came_between_refreshes_at_its_first_score():
    """alpha .5, refresh 2 (scoring steps 1 and 3), prompt 0..2, B = 3, one layer.
    Step 1 over 0..3: s = (.1, .2, .3, .4), all first seen -> m = s; evict 0.
    Step 2 (no scoring): 4 enters at the mean of the cached m, (.2 + .3 + .4) / 3 = .3; m over 1..4 is
    (.2, .3, .4, .3) -> evict 1.
    Step 3 over 2..5: s = (.4, .4, .05, .15).  2, 3: EMA, .5 * .3 + .5 * .4 = .35 and .4.  4 was never scored:
    m = s = .05, and 5 likewise .15 -> evict 4.  Had 4's EMA run on from its entry value, m = .175 and 5
    would go instead."""
    policy = make_policy("inertia-decoupled", alpha=0.5, refresh=2)
    steps = [[[[0.1, 0.2, 0.3, 0.4]]], [[[0.0] * 4]], [[[0.4, 0.4, 0.05, 0.15]]]]
    kept, scored = drive(policy, 3, 3, steps)
    assert scored == [True, False, True]
    assert kept == [{1, 2, 3}, {2, 3, 4}, {2, 3, 5}]
    assert policy.utility(torch.tensor([2, 3, 5])).tolist() == pytest.approx([0.35, 0.4, 0.15])


def test_decoupled_last_k_layers():
    policy = make_policy("inertia-decoupled", layer_weighting="last", last_k=2)
    policy.reset(4, 4, 5)
    assert [policy.wants_layer(layer) for layer in range(5)] == [False, False, False, True, True]


def test_previous_step_weight_says_how_much_memory_each_rule_keeps():
    assert make_policy("inertia").previous_step_weight(30) == pytest.approx(0.8 ** 30)
    assert make_policy("inertia", layers="0,1").previous_step_weight(30) == pytest.approx(0.64)
    assert make_policy("inertia-decoupled").previous_step_weight(30) == 0.8
    assert make_policy("cumulative").previous_step_weight(30) == 1.0
    assert make_policy("single-step").previous_step_weight(30) == 0.0
    # Score-Free scores at step 1 only: there is no previous step to weigh, whatever alpha says
    assert make_policy("score-free").previous_step_weight(30) is None
    assert make_policy("inertia-decoupled", refresh=0).previous_step_weight(30) is None


def test_registry_describes_every_policy():
    for spec in REGISTRY.values():
        assert spec.display and spec.family and spec.description
        for parameter in spec.parameters():
            assert {"name", "type", "default"} <= set(parameter)
    for scorer in ("vnorm", "entropy", "keydiff", "knorm", "recency"):
        assert make_policy(f"inertia-{scorer}").scorer == scorer


def test_pinned_entries_reported_for_the_heatmap():
    assert make_policy("streaming").pinned(100) == (4, 0)
    assert make_policy("avokv").pinned(100) == (4, 32) and make_policy("avokv").pinned(1000) == (4, 8)
    assert make_policy("rkv").pinned(100) == (0, 8)
    assert make_policy("h2o").pinned(100) == (0, 50)
    assert make_policy("inertia").pinned(100) == (0, 0)


def test_parameters_are_converted_and_checked_by_the_registry():
    """The CLI's strings, the UI's floats and a config's numbers all go through the same rules."""
    policy = make_policy("avokv", interval="64", lambda_b="0.5", normalise="off", sinks=2.0)
    assert (policy.interval, policy.lambda_b, policy.normalise, policy.sinks) == (64, 0.5, False, 2)
    assert type(policy.interval) is int and type(policy.lambda_b) is float
    assert make_policy("inertia", layers=3).layers == "3"
    for params, message in [({"alpha": "abc"}, "alpha must be a number"),
                            ({"alpha": float("nan")}, "finite"),
                            ({"alpha": 1.01}, "between 0.0 and 1.0"),
                            ({"refresh": 2.5}, "whole number"),
                            ({"refresh": True}, "a number"),
                            ({"refresh": 65}, "between 0 and 64"),
                            ({"scorer": "magic"}, "one of attention"),
                            ({"layers": [1, 2]}, "text"),
                            ({"layers": "1,x"}, "comma-separated")]:
        with pytest.raises(ValueError, match=message):
            make_policy("inertia", **params)
    with pytest.raises(ValueError, match="true or false"):
        make_policy("avokv", normalise="maybe")


def test_a_setting_is_a_name_and_parameters_labelled_by_what_it_changes():
    from kvviz.policies import build_setting

    label, policy = build_setting("  inertia-lazy   refresh=8 alpha=0.5 ")
    assert label == "inertia alpha=0.5 refresh=8"  # two changes from either name: the registry's first, its order
    assert (type(policy).__name__, policy.alpha, policy.refresh) == ("InertiaKV", 0.5, 8)
    assert build_setting("inertia-lazy refresh=4")[0] == "inertia-lazy"  # its preset: no change
    assert build_setting("inertia alpha=0.80")[0] == "inertia"  # the default, however written
    assert build_setting("avokv normalise=off interval=16")[0] == "avokv interval=16 normalise=false"
    assert build_setting("avokv lambda_b=0.0")[0] == "avokv lambda_b=0"  # as one types it
    assert build_setting("inertia alpha=0.1234567")[0] != build_setting("inertia alpha=0.1234568")[0]
    assert build_setting("inertia layers=0,2")[1].layers == "0,2"
    # A bad value names the entry as typed: beside 'inertia' in a comparison, 'policy inertia' alone is ambiguous
    with pytest.raises(ValueError, match=r"^in 'inertia alpha=2': policy 'inertia': alpha must be between"):
        build_setting(" inertia alpha=2 ")
    # One label per distinct policy, whichever name states it: the name needing the fewest changes.
    for text, label in [("inertia-lazy refresh=1", "inertia"), ("single-step alpha=0.8", "inertia"),
                        ("cumulative aggregation=ema", "inertia"), ("inertia-vnorm scorer=attention", "inertia"),
                        ("score-free refresh=4", "inertia-lazy"), ("inertia alpha=0", "single-step"),
                        ("inertia alpha=-0", "single-step"),
                        ("expected-attention decode=true", "expected-attention-decode"),
                        ("single-step alpha=0.5", "inertia alpha=0.5"),  # a tie: the registry's first name
                        ("inertia-decoupled", "inertia-decoupled")]:  # another class: never plain inertia
        assert build_setting(text)[0] == label, text
    # Every pair of names of one class, each set to the other's preset: one policy, so one label.
    from kvviz.policies import REGISTRY

    for first in REGISTRY.values():
        for second in REGISTRY.values():
            if first.cls is second.cls:
                shared = {p["name"]: p["default"] for p in second.parameters()}
                typed = " ".join([first.name, *(f"{key}={value}" for key, value in shared.items()
                                                 if not isinstance(value, bool))])
                bools = {key: value for key, value in shared.items() if isinstance(value, bool)}
                typed += "".join(f" {key}={str(value).lower()}" for key, value in bools.items())
                assert build_setting(typed)[0] == build_setting(second.name)[0], (first.name, second.name)
    for text, message in [("", "entry is empty"), ("inertia alpha", "key=value"), ("inertia =3", "key=value"),
                          ("inertia alpha=0.5 alpha=0.6", "sets alpha twice"), ("nope", "unknown policy 'nope'"),
                          ("inertia alpha=1.5", "between 0.0 and 1.0"), ("tova window=3", "has no parameter")]:
        with pytest.raises(ValueError, match=message):
            build_setting(text)


@pytest.mark.parametrize("name, setting, unused, other", [
    ("cumulative", {}, "alpha", 0.3),  # a sum never decays
    ("inertia-decoupled", {}, "last_k", 2),  # the mean of every layer
    ("inertia-decoupled", {"layer_weighting": "last", "last_k": 2}, "layers", "0"),  # the last k, whatever layers says
    ("expected-attention", {"vnorm": False, "decode": True}, "epsilon", 0.5),  # added only before the value norm
])
def test_a_parameter_a_setting_leaves_unused_changes_nothing_and_is_refused(tiny, tiny_prompt, name, setting, unused,
                                                                           other):
    """What ``unused()`` claims holds on a real run: the same keep sets and tokens with the parameter changed
    (built past the registry).  The registry refuses the change, since it would only rename the run."""
    import kvviz
    from kvviz.policies import build_setting

    model, tokenizer = tiny
    policy = make_policy(name, **setting)
    assert unused in policy.unused()
    changed = type(policy)(**{**policy.params(), unused: other})
    runs = [kvviz.run(model, tokenizer, tiny_prompt, p, compression=0.7, max_new_tokens=12).trace.events
            for p in (policy, changed)]
    assert [(e.kept.tolist(), e.new_token_id) for e in runs[0]] == [(e.kept.tolist(), e.new_token_id) for e in runs[1]]
    assert sum(e.evicted.size for e in runs[0]) > 0
    with pytest.raises(ValueError, match=f"{unused} does nothing when"):
        make_policy(name, **setting, **{unused: other})
    default = getattr(type(policy)(), unused)  # the field's default passes, and is what the policy records
    assert make_policy(name, **setting, **{unused: default}).params() == policy.params()
    assert getattr(policy, unused) == default
    typed = " ".join([name, *(f"{key}={str(value).lower()}" for key, value in setting.items()), f"{unused}={other}"])
    with pytest.raises(ValueError, match="leave it out"):
        build_setting(typed)


def test_a_preset_value_left_unused_goes_back_to_the_default_so_one_run_has_one_name():
    from kvviz.policies import build_setting

    label, policy = build_setting("single-step aggregation=sum")  # alpha 0 from single-step's preset: unused
    assert label == "cumulative" and policy.alpha == 0.8
    assert build_setting("single-step aggregation=sum alpha=0.8")[0] == "cumulative"
    with pytest.raises(ValueError, match=r"leave it out \(or at 0.8\)"):
        build_setting("single-step aggregation=sum alpha=0")


def test_every_setting_s_unused_parameters_are_its_own():
    for spec in REGISTRY.values():
        names = {p["name"] for p in spec.parameters()}
        assert set(spec.build().unused()) <= names, spec.name
    assert make_policy("inertia").unused() == {} and make_policy("inertia-decoupled", layer_weighting="last",
                                                                 last_k=4).unused().keys() == {"layers"}


def test_each_parameter_a_registry_description_names_is_one_of_the_policys_with_that_default():
    """A description states a parameter as `name` (default): the user changes that parameter and the text
    still holds (StreamingLLM said "4 attention-sink tokens" after sinks was set to 64)."""
    import re

    from kvviz.policies import REGISTRY

    named = 0
    for spec in REGISTRY.values():
        params = {p["name"]: p["default"] for p in spec.parameters()}
        for name, default in re.findall(r"`(\w+)` \(([^)]+)\)", spec.description):
            assert name in params, f"{spec.name}'s description names {name}, which it does not have"
            assert str(params[name]) == default, f"{spec.name}: {name} defaults to {params[name]}, not {default}"
            named += 1
    assert named >= 6
    assert re.search(r"^\d", REGISTRY["streaming"].description) is None  # the sinks are named, not counted
