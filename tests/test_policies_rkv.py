"""R-KV's attention pooling and redundancy: the official code's (the defaults) against kvviz's earlier head means
and mean cosine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvviz
from kvviz.policies import make_policy
from kvviz.scoring import LayerView

# Logits of one query, four query heads (two per KV head), at positions 0, 1, 2 (the candidates) and 3 (the
# window of one): keys are the unit vectors e_0 .. e_3, so a query head's logits are its query itself.
LOGITS = np.array([[2.0, 0.0, 0.0, 0.0],   # query head 0 -- KV head 0
                   [0.0, 0.0, 0.0, 0.0],   # query head 1 -- KV head 0
                   [0.0, 3.0, 0.0, 6.0],   # query head 2 -- KV head 1: most of its attention on the window
                   [0.0, 3.0, 0.0, 6.0]])  # query head 3 -- KV head 1


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def hand_made_step(pooling: str):
    """One checkpoint over the LOGITS cache with lam = 1 (importance alone), kernel 1, window 1, B = 2: one
    of the three candidates stays.  Returns (importance of positions 0..2, the kept positions)."""
    policy = make_policy("rkv", interval=1, window=1, kernel=1, observe_window=1, lam=1.0, pooling=pooling)
    keys = torch.eye(4).expand(2, 4, 4).contiguous()  # (kv heads, slots, head_dim)
    positions = torch.arange(4)
    policy.reset(3, 2, 1)
    policy.begin_step(1, torch.arange(3), 3)
    policy.observe(LayerView(0, torch.tensor(LOGITS, dtype=torch.float32), keys, torch.ones_like(keys), 1.0),
                   positions)
    drop = policy.select_evictions(1, positions, 2)
    importance = policy.components(positions)["importance"][:3].numpy()
    return importance, set(range(4)) - set(positions[drop].tolist())


def test_official_pooling_ranks_a_hand_made_cache_otherwise_than_head_means():
    """Head means: a softmax per query head over all four keys, then the mean over the four heads.  KV head 1's
    heads give the window e^6 of e^6 + e^3 + 2, so candidate 1 gets only e^3 / 425.5 = .047 from each:
    importance (.711 + .25 + 2 * .0024, .096 + .25 + 2 * .047, .096 + .25 + 2 * .0024) / 4 =
    (.2414, .1101, .0878), and position 0 stays.
    Official: per KV head the larger logit of its two query heads over the candidates alone, (2, 0, 0) and
    (0, 3, 0); softmaxes (.787, .107, .107) and (.045, .909, .045); mean (.416, .508, .076): position 1 stays."""
    # Independent expectations from the logits, by the two recipes
    head_mean = softmax(LOGITS)[:, :3].mean(0)
    official = softmax(np.stack([LOGITS[0:2, :3].max(0), LOGITS[2:4, :3].max(0)])).mean(0)
    assert head_mean == pytest.approx([0.2414, 0.1101, 0.0878], abs=1e-4)
    assert official == pytest.approx([0.4161, 0.5080, 0.0759], abs=1e-4)

    importance, kept = hand_made_step("head-mean")
    assert importance == pytest.approx(head_mean, rel=1e-5)
    assert kept == {0, 3}
    importance, kept = hand_made_step("official")
    assert importance == pytest.approx(official, rel=1e-5)
    assert kept == {1, 3}
    assert make_policy("rkv").pooling == "official"  # the default


def official_importance(queries: np.ndarray, keys: np.ndarray, window: int, kernel: int, scale: float) -> np.ndarray:
    """R-KV's ``update_kv`` importance, written out from its steps for a cache in position order whose last
    ``window`` keys are the recent window and whose queries are newer than every candidate: logits, max over
    each KV head's query group, softmax over the non-window keys, mean over queries, max-pool over ``kernel``
    neighbours per KV head; then kvviz's mean over KV heads."""
    w, heads, _ = queries.shape
    num_kv, n, _ = keys.shape
    group = heads // num_kv
    per_head = []
    for kv in range(num_kv):
        logits = np.stack([queries[:, kv * group + g] @ keys[kv].T for g in range(group)]).max(0) * scale  # (w, n)
        attention = softmax(logits[:, : n - window]).mean(0)
        half = kernel // 2
        per_head.append([attention[max(0, i - half): i + half + 1].max() for i in range(n - window)])
    return np.mean(per_head, axis=0)


def test_official_pooling_equals_the_official_recipe_on_a_random_gqa_layer():
    """Two KV heads of a group of three, four buffered queries, twelve keys of which the last four are the
    window, max-pooling over 3: the policy's importance equals the recipe written out in numpy."""
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 12, 8, generator=generator)
    queries = torch.randn(4, 6, 8, generator=generator)
    policy = make_policy("rkv", interval=1, window=4, kernel=3, observe_window=4)
    policy.candidates = torch.arange(8)
    features = policy.layer_features(LayerView(0, queries[-1], keys, torch.ones_like(keys), 0.35), torch.arange(12),
                                     queries, torch.arange(8, 12))
    expected = official_importance(queries.double().numpy(), keys.double().numpy(), 4, 3, 0.35)
    assert features["importance"].numpy() == pytest.approx(expected, rel=1e-5)


def test_a_buffered_query_older_than_every_candidate_adds_nothing():
    """Prompt queries can be older than the candidates left after an eviction: such a query sees none of
    them and drops out of the mean instead of making it NaN."""
    generator = torch.Generator().manual_seed(2)
    keys = torch.randn(1, 5, 4, generator=generator)
    queries = torch.randn(2, 2, 4, generator=generator)
    positions = torch.tensor([10, 11, 12, 13, 14])
    policy = make_policy("rkv", interval=1, window=1, kernel=1, observe_window=2)
    policy.candidates = torch.arange(4)
    features = policy.layer_features(LayerView(0, queries[-1], keys, torch.ones_like(keys), 0.5), positions,
                                     queries, torch.tensor([3, 14]))
    alone = policy.layer_features(LayerView(0, queries[-1], keys, torch.ones_like(keys), 0.5), positions,
                                  queries[1:], torch.tensor([14]))
    assert torch.isfinite(features["importance"]).all()
    torch.testing.assert_close(features["importance"], alone["importance"])


# ------------------------------------------------------------------------------------------- redundancy

def redundancy_step(redundancy: str, keys: torch.Tensor):
    """One checkpoint with lam = 0 (redundancy alone), window 1, B = 2 over ``keys`` at positions 0..3: one of
    the three candidates stays.  Returns (redundancy of positions 0..2, the kept positions)."""
    policy = make_policy("rkv", interval=1, window=1, kernel=1, observe_window=1, lam=0.0, redundancy=redundancy)
    positions = torch.arange(4)
    policy.reset(3, 2, 1)
    policy.begin_step(1, torch.arange(3), 3)
    policy.observe(LayerView(0, torch.ones(1, 2), keys, torch.ones_like(keys), 1.0), positions)
    drop = policy.select_evictions(1, positions, 2)
    return policy.components(positions)["redundancy"][:3].numpy(), set(range(4)) - set(positions[drop].tolist())


def test_official_redundancy_spares_the_newest_of_three_equal_keys_by_hand():
    """Keys e0, e0, e0 at positions 0-2 (the candidates) and e1 at 3 (the window), one KV head.  Cosines: 1
    among the first three, 0 elsewhere, 0 on the diagonal.  Each row zeroes its newest similar key: row 0 and
    row 1 position 2, row 2 position 1 (row 3 has none and zeroes position 0, already 0).  Column means over
    the four rows: (2/4, 1/4, 0, 0); softmax (.3342, .2603, .2027, .2027): position 2, the newest copy, is the
    least redundant and stays.  The mean cosine among the candidates is 1 for each: a three-way tie."""
    keys = torch.tensor([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])[None]
    means = np.array([0.5, 0.25, 0.0, 0.0])
    expected = np.exp(means) / np.exp(means).sum()
    assert expected[:3] == pytest.approx([0.3342, 0.2603, 0.2027], abs=1e-4)
    redundancy, kept = redundancy_step("official", keys)
    assert redundancy == pytest.approx(expected[:3], rel=1e-5)
    assert kept == {2, 3}
    redundancy, _ = redundancy_step("mean-cosine", keys)
    assert redundancy == pytest.approx([1 / 3] * 3, rel=1e-5)
    assert make_policy("rkv").redundancy == "official"  # the default


def official_redundancy_recipe(keys: np.ndarray, window: int) -> np.ndarray:
    """R-KV's ``cal_similarity`` then ``[:, :-window]``, written out row by row for keys in position order:
    per KV head, cosines with a zero diagonal; each row's newest key past 0.5 zeroed (index 0 if none);
    column means, softmax over every key, the candidates' entries; then kvviz's mean over KV heads."""
    num_kv, n, _ = keys.shape
    rows = []
    for head in keys:
        unit = head / (np.linalg.norm(head, axis=-1, keepdims=True) + 1e-8)
        cosine = unit @ unit.T
        np.fill_diagonal(cosine, 0.0)
        for i in range(n):
            similar = [j for j in range(n) if cosine[i, j] > 0.5]
            cosine[i, max(similar, default=0)] = 0.0
        rows.append(softmax(cosine.mean(0))[: n - window])
    return np.mean(rows, axis=0)


def test_official_redundancy_equals_the_official_recipe_with_slots_out_of_position_order():
    """Two KV heads, ten keys drawn near three directions (so that many pairs pass 0.5), the window of three the
    newest, stored in shuffled slots: the policy's redundancy, read back in position order, is the recipe's."""
    generator = torch.Generator().manual_seed(4)
    directions = torch.randn(2, 3, 6, generator=generator)
    ordered = directions[:, torch.arange(10) % 3] + 0.6 * torch.randn(2, 10, 6, generator=generator)
    slots = torch.randperm(10, generator=generator)  # slot s holds position slots[s]
    keys = torch.empty_like(ordered)
    keys[:, torch.arange(10)] = ordered[:, slots]
    policy = make_policy("rkv", interval=1, window=3, kernel=1, observe_window=1)
    candidates = torch.nonzero(slots < 7).flatten()  # the slots of positions 0..6
    policy.candidates = candidates
    features = policy.layer_features(LayerView(0, torch.ones(2, 6), keys, torch.ones_like(keys), 0.5), slots,
                                     torch.ones(1, 2, 6), torch.tensor([10]))
    by_position = np.empty(7)
    by_position[slots[candidates].numpy()] = features["redundancy"].numpy()
    expected = official_redundancy_recipe(ordered.double().numpy(), 3)
    assert by_position == pytest.approx(expected, rel=1e-5)
    assert (np.abs(ordered.double().numpy() @ ordered.double().numpy().transpose(0, 2, 1)) > 0).all()


# Today's R-KV (before the pooling parameter), recorded from commit 1749f42: the features of a seeded layer...
HEAD_MEAN_FEATURES = {
    "importance": [0.091999, 0.128713, 0.128713, 0.137069, 0.137069, 0.137069, 0.099201, 0.076097, 0.074941,
                   0.072478],
    "redundancy": [0.111064, 0.085182, 0.113735, 0.093807, 0.114648, 0.109252, 0.099765, 0.102295, 0.078726,
                   0.091527]}
# ... and a run of tiny-random-llama (interval 4, window 4, kernel 3, observe window 4, B = 40, 24 new tokens):
# its tokens and the positions each checkpoint evicted (the first, 72 of the prompt's 111, as a count and sum).
HEAD_MEAN_TOKENS = [0, 117, 181, 104, 110, 310, 298, 200, 138, 293, 239, 270, 54, 50, 84, 121, 11, 302, 313, 68,
                    121, 11, 85, 312]
HEAD_MEAN_FIRST_EVICTION = (72, 3956)
HEAD_MEAN_LATER_EVICTIONS = [[11, 74, 106], [88, 109, 110, 111], [36, 62, 69, 99], [18, 25, 107, 108],
                             [84, 113, 114, 115]]


def test_head_mean_pooling_reproduces_the_earlier_features():
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 12, 4, generator=generator)
    queries = torch.randn(3, 4, 4, generator=generator)
    policy = make_policy("rkv", interval=1, window=2, kernel=3, observe_window=3, pooling="head-mean",
                         redundancy="mean-cosine")
    policy.candidates = torch.arange(10)
    features = policy.layer_features(LayerView(0, queries[-1], keys, torch.ones_like(keys), 0.5), torch.arange(12),
                                     queries, torch.tensor([9, 10, 11]))
    for name, values in HEAD_MEAN_FEATURES.items():
        assert features[name].tolist() == pytest.approx(values, abs=2e-6), name


def test_head_mean_pooling_reproduces_an_earlier_run(tiny, tiny_prompt):
    model, tokenizer = tiny
    settings = dict(interval=4, window=4, kernel=3, observe_window=4)
    old = kvviz.run(model, tokenizer, tiny_prompt, make_policy("rkv", pooling="head-mean", redundancy="mean-cosine",
                                                               **settings), budget=40, max_new_tokens=24)
    evictions = [sorted(event.evicted.tolist()) for event in old.trace.events if event.evicted.size]
    assert old.token_ids == HEAD_MEAN_TOKENS
    assert (len(evictions[0]), sum(evictions[0])) == HEAD_MEAN_FIRST_EVICTION
    assert evictions[1:] == HEAD_MEAN_LATER_EVICTIONS
    new = kvviz.run(model, tokenizer, tiny_prompt, make_policy("rkv", **settings), budget=40, max_new_tokens=24)
    assert [sorted(e.evicted.tolist()) for e in new.trace.events if e.evicted.size] != evictions  # it decides otherwise


# ---------------------------------------------------------------- rows stored before the pooling parameter


def rkv_row(**fields) -> dict:
    return {"source": "measured", "model": "m", "task": "t", "policy": "rkv", "metric": "math", "score": 1.0,
            "sample": 0, "seed": 0, "compression": None, "absolute_budget": 64, "budget": 64, "prompt_len": 50,
            "max_new_tokens": 64, "chat": True, "temperature": 0.0, "top_p": 1.0, "dtype": "float32",
            "cell": json.dumps(["t", fields.get("sample", 0), "rkv", fields.get("params", {}), {"budget": 64}]),
            **fields}


def test_the_store_reads_rows_from_before_the_pooling_parameter_as_head_mean(tmp_path):
    """A measured R-KV row without ``pooling`` ran the head means: its setting says so, whether it records no
    ``policy_params`` (before 2026-12-04) or records them without the parameter.  A row that ran the default
    today is at its defaults, and a paper's R-KV row is the paper's method, left as it is."""
    from kvviz.store import Store

    folder = tmp_path / "old"
    folder.mkdir()
    stored = [rkv_row(sample=0, params={}),
              rkv_row(sample=1, params={"interval": 16}),
              rkv_row(sample=2, params={}, policy_params={"interval": 128, "observe_window": 8,
                                                          "prompt_queries": False, "lam": 0.1, "window": 8,
                                                          "kernel": 7}),
              rkv_row(sample=3, params={}, policy_params=make_policy("rkv").params()),
              rkv_row(sample=4, params={"pooling": "head-mean"}),
              rkv_row(sample=5, params={}, policy_params={name: value for name, value in
                                                          make_policy("rkv").params().items() if name != "redundancy"}),
              {"source": "paper", "paper": "p", "table": "1", "model": "m", "task": "t", "policy": "rkv", "params": {},
               "metric": "accuracy", "score": 50.0}]
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in stored))
    store = Store(tmp_path)
    assert store.problems == []
    settings = dict(store.con.execute(
        "SELECT coalesce(sample, -1), setting FROM results WHERE policy = 'rkv' ORDER BY 1").fetchall())
    old = '"pooling": "head-mean", "redundancy": "mean-cosine"'
    assert settings == {-1: "{}", 0: f"{{{old}}}", 1: f'{{"interval": 16, {old}}}', 2: f"{{{old}}}", 3: "{}",
                        4: f"{{{old}}}", 5: '{"redundancy": "mean-cosine"}'}


def test_resuming_a_folder_of_rows_from_before_the_pooling_parameter_is_refused(tmp_path):
    """Rows without ``pooling`` ran the head means: resuming them under today's default would file the new
    rows, official pooling, under the old rows' cells; spelling the old pooling out names other cells."""
    from kvviz.bench import sweep

    (tmp_path / "rows.jsonl").write_text(json.dumps(rkv_row(params={}, git_commit="1749f42")) + "\n")
    tasks = {"budget": [64], "tasks": [{"name": "arithmetic_reasoning", "samples": 1}]}  # cells still to run
    config = {"policies": ["full", "rkv"], **tasks}
    with pytest.raises(ValueError, match=r"holds rows of rkv run with other parameters than the code gives it now "
                                         r"\(pooling = 'head-mean' then, 'official' now, redundancy = 'mean-cosine' "
                                         r"then, 'official' now: a default changed since, at commit 1749f42\)"):
        sweep.check_params_as_run(config, tmp_path)
    old = {"pooling": "head-mean", "redundancy": "mean-cosine"}
    assert sweep.check_params_as_run({"policies": [{"name": "rkv", "params": old}], **tasks}, tmp_path) is None
    # a row that records every parameter but the pooling ran the head means too
    recorded = {"interval": 128, "observe_window": 8, "prompt_queries": False, "lam": 0.1, "window": 8, "kernel": 7}
    (tmp_path / "rows.jsonl").write_text(json.dumps(rkv_row(params={}, policy_params=recorded)) + "\n")
    with pytest.raises(ValueError, match=r"pooling = 'head-mean' then, 'official' now"):
        sweep.check_params_as_run(config, tmp_path)
    # rows of official pooling from before the redundancy parameter (2026-12-07/08) ran the mean cosine
    (tmp_path / "rows.jsonl").write_text(json.dumps(rkv_row(params={}, policy_params={**recorded, "pooling":
                                                                                       "official"})) + "\n")
    with pytest.raises(ValueError, match=r"\(redundancy = 'mean-cosine' then, 'official' now"):
        sweep.check_params_as_run(config, tmp_path)
    (tmp_path / "rows.jsonl").write_text(json.dumps(rkv_row(params={}, policy_params={
        **recorded, "pooling": "official", "redundancy": "official"})) + "\n")
    assert sweep.check_params_as_run(config, tmp_path) is None


def test_rerunning_a_finished_folder_of_head_mean_rows_writes_nothing_and_is_not_refused(tmp_path):
    """Every cell of the config is stored: a rerun adds no row, so nothing of today's pooling can join the old
    rows, and the shipped sweeps' folders rerun as a no-op."""
    from kvviz.bench import sweep

    config = {"name": "done", "budget": [64], "policies": ["rkv"],
              "tasks": [{"name": "arithmetic_reasoning", "samples": 1}]}
    (cell,) = sweep.cells(config)
    (tmp_path / "rows.jsonl").write_text(json.dumps({**rkv_row(params={}), "cell": cell.key}) + "\n")
    assert sweep.check_params_as_run(config, tmp_path) is None
    grown = {**config, "tasks": [{"name": "arithmetic_reasoning", "samples": 2}]}  # a cell to run: refused
    with pytest.raises(ValueError, match=r"pooling = 'head-mean' then, 'official' now"):
        sweep.check_params_as_run(grown, tmp_path)

