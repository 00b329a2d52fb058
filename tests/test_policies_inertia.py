"""The InertiaKV family's keep rules against hand-computed state (worked out in the comments)."""

from __future__ import annotations

import pytest
import torch

from kvviz.policies import make_policy
from kvviz.policies.base import lowest
from kvviz.policies.scorers import entropy_score, vnorm_score
from kvviz.scoring import LayerView


def view(layer: int, attn, values=None) -> LayerView:
    """A layer view whose attention is given directly, shape (heads, n)."""
    attn = torch.tensor(attn, dtype=torch.float32)
    heads, n = attn.shape
    if values is None:
        values = torch.ones(1, n, 1)
    kv_heads = values.shape[0]
    return LayerView(layer, torch.zeros(heads, 1), torch.zeros(kv_heads, n, 1), values, 1.0, _attn=attn)


def drive(policy, prompt_len: int, budget: int, steps: list[list]) -> tuple[list[set], list[bool]]:
    """Run the engine's call sequence by hand; ``steps[k-1]`` holds step k's per-layer attention rows
    (over the cached positions in ascending order, newest last).  Returns the kept set after each step."""
    policy.reset(prompt_len, budget)
    positions = list(range(prompt_len))
    kept_sets, scored = [], []
    for step, layers in enumerate(steps, start=1):
        new = prompt_len + step - 1
        wants = policy.wants_scores(step)
        scored.append(wants)
        policy.begin_step(step, torch.tensor(positions), new)
        positions.append(new)
        pos = torch.tensor(positions)
        if wants:
            for layer, attn in enumerate(layers):
                if policy.wants_layer(layer):
                    policy.observe(view(layer, attn), pos)
        drop = policy.select_evictions(step, pos, budget)
        dropped = set(pos[drop].tolist())
        positions = [p for p in positions if p not in dropped]
        kept_sets.append(set(positions))
    return kept_sets, scored


def test_inertia_layer_sequential_ema():
    # alpha = 0.5, two layers, two heads whose mean is the row written in the comment.
    # Step 1, positions [0, 1, 2] (2 is new, enters at 0):
    #   layer 0 mean s = [0.2, 0.3, 0.5]: m = 0.5*0 + 0.5*s = [0.10, 0.15, 0.25]
    #   layer 1 mean s = [0.6, 0.1, 0.3]: m = 0.5*m + 0.5*s = [0.35, 0.125, 0.275] -> evict 1
    # Step 2, positions [0, 2, 3] (3 enters at 0):
    #   layer 0 s = [0.1, 0.5, 0.4]: m = [0.225, 0.3875, 0.2]
    #   layer 1 s = [0.2, 0.2, 0.6]: m = [0.2125, 0.29375, 0.4] -> evict 0
    policy = make_policy("inertia", alpha=0.5)
    steps = [
        [[[0.3, 0.3, 0.4], [0.1, 0.3, 0.6]], [[0.7, 0.0, 0.3], [0.5, 0.2, 0.3]]],
        [[[0.1, 0.5, 0.4], [0.1, 0.5, 0.4]], [[0.2, 0.2, 0.6], [0.2, 0.2, 0.6]]],
    ]
    kept, scored = drive(policy, 2, 2, steps)
    assert kept == [{0, 2}, {2, 3}]
    assert scored == [True, True]
    assert policy.utility(torch.tensor([2, 3])).tolist() == pytest.approx([0.29375, 0.4])


def test_inertia_lazy_refresh_uses_stale_utility_and_mean_entry():
    # alpha = 0.5, r = 2, one layer, prompt [0, 1, 2], budget 3.
    # Step 1 (scores): 3 enters at 0; s = [.1, .2, .3, .4] -> m = [.05, .1, .15, .2]; evict 0.
    # Step 2 (no scores): 4 enters at mean(.1, .15, .2) = .15; evict 1 (.1).
    # Step 3 (scores): 5 enters at 0; s over [2,3,4,5] = [.4, .1, .3, .2]
    #   -> m = [.275, .15, .225, .1]; evict 5.
    policy = make_policy("inertia-lazy", alpha=0.5, refresh=2)
    steps = [[[[0.1, 0.2, 0.3, 0.4]]], [[[0.9, 0.0, 0.0, 0.1]]], [[[0.4, 0.1, 0.3, 0.2]]]]
    kept, scored = drive(policy, 3, 3, steps)
    assert scored == [True, False, True]
    assert kept == [{1, 2, 3}, {2, 3, 4}, {2, 3, 4}]
    assert policy.utility(torch.tensor([2, 3, 4])).tolist() == pytest.approx([0.275, 0.15, 0.225])


def test_score_free_freezes_after_first_step_and_breaks_ties_oldest_first():
    # alpha = 0.5, prompt [0, 1, 2], budget 3 (binary fractions, so the tie is exact in float32).
    # Step 1: s = [1/8, 2/8, 3/8, 4/8] -> m = [1/16, 2/16, 3/16, 4/16]; evict 0.
    # Step 2: 4 enters at mean(2/16, 3/16, 4/16) = 3/16; evict 1 (2/16).
    # Step 3: 5 enters at mean(3/16, 4/16, 3/16) = 0.208; lowest 3/16 is shared by 2 and 4: the older, 2, goes.
    policy = make_policy("score-free", alpha=0.5)
    steps = [[[[0.125, 0.25, 0.375, 0.5]]], [[[1.0, 0.0, 0.0, 0.0]]], [[[1.0, 0.0, 0.0, 0.0]]]]
    kept, scored = drive(policy, 3, 3, steps)
    assert scored == [True, False, False]
    assert kept == [{1, 2, 3}, {2, 3, 4}, {3, 4, 5}]


def test_single_step_is_last_layer_of_current_step():
    # alpha = 0: m = last layer's scores.  Step 1: layer 1 s = [.6, .1, .3] -> evict 1.
    # Step 2: layer 1 s over [0, 2, 3] = [.5, .1, .4] -> evict 2 (layer 0 would have said otherwise).
    policy = make_policy("single-step")
    steps = [
        [[[0.2, 0.3, 0.5]], [[0.6, 0.1, 0.3]]],
        [[[0.1, 0.8, 0.1]], [[0.5, 0.1, 0.4]]],
    ]
    kept, _ = drive(policy, 2, 2, steps)
    assert kept == [{0, 2}, {0, 3}]


def test_cumulative_accumulates_every_layer_and_step():
    # m += s for each layer.  Step 1: [.2,.3,.5] + [.6,.1,.3] = [.8, .4, .8]; evict 1.
    # Step 2 over [0, 2, 3] (3 enters at 0): + [.1,.5,.4] + [.2,.2,.6] -> [1.1, 1.5, 1.0]; evict 3.
    policy = make_policy("cumulative")
    steps = [
        [[[0.2, 0.3, 0.5]], [[0.6, 0.1, 0.3]]],
        [[[0.1, 0.5, 0.4]], [[0.2, 0.2, 0.6]]],
    ]
    kept, _ = drive(policy, 2, 2, steps)
    assert kept == [{0, 2}, {0, 2}]
    assert policy.utility(torch.tensor([0, 2])).tolist() == pytest.approx([1.1, 1.5])


def test_eligible_layers_restrict_updates():
    # Only layer 1 is eligible: with alpha = 0.5, m = 0.5 * [.6, .1, .3] -> evict 1.
    policy = make_policy("inertia", alpha=0.5, layers="1")
    kept, _ = drive(policy, 2, 2, [[[[0.0, 0.0, 1.0]], [[0.6, 0.1, 0.3]]]])
    assert kept == [{0, 2}]
    assert policy.utility(torch.tensor([0, 2])).tolist() == pytest.approx([0.3, 0.15])


def test_full_never_evicts():
    kept, scored = drive(make_policy("full"), 2, 1, [[[[0.5, 0.2, 0.3]]]] * 3)
    assert kept == [{0, 1, 2}, {0, 1, 2, 3}, {0, 1, 2, 3, 4}]
    assert scored == [False] * 3


def test_vnorm_weights_heads_by_normalised_value_norm():
    # One KV head shared by two query heads; value norms [1, 3] normalise to [0.5, 1.5].
    # Heads [.5, .5] and [.2, .8] become [.25, .75] and [.1, 1.2]; head mean [.175, .975].
    values = torch.tensor([[[1.0, 0.0], [0.0, 3.0]]])
    score = vnorm_score(view(0, [[0.5, 0.5], [0.2, 0.8]], values), torch.tensor([0, 1]))
    assert score.tolist() == pytest.approx([0.175, 0.975])


def test_entropy_weights_layer_by_normalised_entropy():
    # Head entropies / ln 2: [.5, .5] -> 1, [1, 0] -> 0; mean 0.5.  Head-mean attention [.75, .25] -> [.375, .125].
    score = entropy_score(view(0, [[0.5, 0.5], [1.0, 0.0]]), torch.tensor([0, 1]))
    assert score.tolist() == pytest.approx([0.375, 0.125])
    # One entry has no entropy to normalise (log 1 = 0): its attention, 1, as it is.
    assert entropy_score(view(0, [[1.0], [1.0]]), torch.tensor([0])).tolist() == [1.0]


def test_every_scorer_lives_in_scorers_and_gives_one_score_per_entry_as_documented():
    """One module holds the scorers InertiaKV, KeyDiff and K-norm share; each returns ``(n,)`` for a view
    over n entries with grouped heads (4 query, 2 KV heads here), as its docstring says."""
    from kvviz.policies.keydiff import KeyDiff
    from kvviz.policies.knorm import KNorm
    from kvviz.policies.scorers import SCORERS

    torch.manual_seed(0)
    n = 5
    keys, values = torch.randn(2, n, 8), torch.randn(2, n, 8)
    layer_view = LayerView(0, torch.randn(4, 8), keys, values, 8 ** -0.5)
    positions = torch.tensor([0, 3, 4, 7, 9])
    for name, scorer in SCORERS.items():
        assert scorer.__module__ == "kvviz.policies.scorers", name
        assert "``(n,)``" in scorer.__doc__, name  # the shared signature is in the module docstring
        assert scorer(layer_view, positions).shape == (n,), name
    # the policies score with the very same functions
    assert torch.equal(KeyDiff().score(layer_view, positions), SCORERS["keydiff"](layer_view, positions))
    assert torch.equal(KNorm().score(layer_view, positions), SCORERS["knorm"](layer_view, positions))
    assert SCORERS["recency"](layer_view, positions).tolist() == pytest.approx([0.1, 0.4, 0.5, 0.8, 1.0])
    # Key scores are per KV head, then averaged: norms (1, 3) and (2, 2) over their means 2 and 2 give
    # -(.5, 1.5) and -(1, 1), mean -(.75, 1.25); unit keys (1,0),(0,1) and (1,0),(1,0) have mean directions
    # (1,1)/sqrt 2 and (1,0): cosines (.7071, .7071) and (1, 1), mean -(.8536, .8536).
    keys = torch.tensor([[[1.0, 0.0], [0.0, 3.0]], [[2.0, 0.0], [2.0, 0.0]]])
    grouped = LayerView(0, torch.zeros(4, 2), keys, torch.ones_like(keys), 1.0)
    assert SCORERS["knorm"](grouped, torch.tensor([0, 1])).tolist() == pytest.approx([-0.75, -1.25])
    assert SCORERS["keydiff"](grouped, torch.tensor([0, 1])).tolist() == pytest.approx([-0.85355, -0.85355], abs=1e-5)


def test_lowest_ties_go_oldest_first():
    utility = torch.tensor([0.2, 0.1, 0.1, 0.3, 0.1])
    positions = torch.tensor([7, 9, 3, 1, 5])  # slot order is not position order
    # The three 0.1s sit at positions 9, 3, 5: oldest first -> 3 (slot 2), 5 (slot 4), then 9 (slot 1).
    assert lowest(utility, positions, 1).tolist() == [2]
    assert lowest(utility, positions, 2).tolist() == [2, 4]
    assert lowest(utility, positions, 4).tolist() == [2, 4, 1, 0]


@pytest.mark.parametrize("bad", [dict(alpha=1.5), dict(alpha=-0.1), dict(refresh=-1), dict(scorer="nope")])
def test_invalid_parameters_are_refused(bad):
    with pytest.raises(ValueError):
        make_policy("inertia", **bad)


def test_layers_name_a_set_of_layers_one_way():
    assert make_policy("inertia", layers=" 5,0,5").layers == "0,5"
    assert make_policy("inertia", layers="0,5")._eligible == {0, 5}
    for bad in ("0_5", "0,\u0665", "-1", "1,", "x"):  # int() reads the first two as 5 and 0,5
        with pytest.raises(ValueError, match="comma-separated layer indices"):
            make_policy("inertia", layers=bad)


def test_unknown_policy_and_parameter_say_what_exists():
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("nope")
    with pytest.raises(ValueError, match="takes"):
        make_policy("full", alpha=0.5)
