"""How far each scorer's ranking sits from attention (InertiaKV §5.1), and how much layers disagree (App. H).

InertiaKV §5.1 places its scorer ablations on a correlation spectrum: at one layer (15 in the paper), the
Spearman correlation of each scorer's per-token score with last-query attention, and the Jaccard of their
top-B sets at a 10% budget.  A scorer reaches eviction through the EMA over layers and steps, so we report
both levels, at each of the first ``steps`` decode steps of one full-cache greedy run:

* ``layer``: the scorer at the chosen layer against head-mean attention at that layer (and, for the
  Spearman, at every layer: :meth:`Spectrum.layer_profile`);
* ``utility``: the utility of ``InertiaKV(scorer=...)`` against that of ``InertiaKV`` (attention), all fed
  the same layer views in one pass, nothing evicted, so that every utility ranks the same entries.

Appendix H's selector reads a "cross-layer Jaccard disagreement"; the paper gives no formula, so here it is
the Jaccard of the top-B attention sets of every pair of layers at the same step (mean and spread over the
pairs), with the top-B churn of the chosen layer between consecutive steps beside it.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from itertools import combinations

import numpy as np
import torch
from transformers import DynamicCache

from . import scoring
from .diagnostics import jaccard, spearman, top_k, topk_jaccard
from .engine import cache_kwarg, check_prompt, resolve_budget
from .policies.inertia import InertiaKV
from .policies.scorers import SCORERS, attention_score


@dataclass
class Spectrum:
    """Per-step agreement of every scorer with attention, plus cross-layer agreement of attention itself.

    ``layer_spearman[scorer]`` etc. hold one value per decode step (steps ``1 .. len(steps)``);
    ``cross_layer`` holds, per step, the Jaccard of each pair of layers' top-B attention sets.
    """

    layer: int
    num_layers: int
    compression: float
    steps: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the token each step fed (the full cache's greedy choice)
    cache_sizes: list[int] = field(default_factory=list)  # entries ranked at each step (the whole cache)
    budgets: list[int] = field(default_factory=list)  # B of the top-B sets at each step
    layer_spearman: dict[str, list[float]] = field(default_factory=dict)
    layer_jaccard: dict[str, list[float]] = field(default_factory=dict)
    utility_spearman: dict[str, list[float]] = field(default_factory=dict)
    utility_jaccard: dict[str, list[float]] = field(default_factory=dict)
    cross_layer: list[np.ndarray] = field(default_factory=list)
    # scorer -> per step, its Spearman with attention at every layer, (num_layers,) (NaN: a layer without
    # attention over the cache, or constant attention)
    by_layer: dict[str, list[np.ndarray]] = field(default_factory=dict)
    layer_churn: list[float] = field(default_factory=list)  # the chosen layer's top-B churn from the previous step

    def table(self) -> list[dict]:
        """One row per scorer: its mean Spearman and top-B Jaccard against attention, at both levels."""
        mean = lambda values: float(np.nanmean(values)) if values and not np.all(np.isnan(values)) else float("nan")
        return [{"scorer": name, "layer_spearman": mean(self.layer_spearman[name]),
                 "layer_jaccard": mean(self.layer_jaccard[name]),
                 "utility_spearman": mean(self.utility_spearman[name]),
                 "utility_jaccard": mean(self.utility_jaccard[name])} for name in SCORERS]

    def layer_profile(self) -> dict[str, np.ndarray]:
        """Each scorer's Spearman with attention at every layer, mean over the steps, ``(num_layers,)``."""
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a layer NaN at every step stays NaN
            return {name: np.nanmean(np.stack(rows), axis=0) for name, rows in self.by_layer.items()}

    def cross_layer_summary(self) -> dict[str, float]:
        """Mean over steps of the pairwise cross-layer Jaccard's mean and standard deviation; mean churn."""
        means = [float(pairs.mean()) for pairs in self.cross_layer if pairs.size]
        spreads = [float(pairs.std()) for pairs in self.cross_layer if pairs.size]
        churn = [value for value in self.layer_churn if not np.isnan(value)]
        nan = float("nan")
        return {"cross_layer_jaccard": float(np.mean(means)) if means else nan,
                "cross_layer_jaccard_std": float(np.mean(spreads)) if spreads else nan,
                "layer_churn": float(np.mean(churn)) if churn else nan}


def top_b(size: int, compression: float) -> int:
    """``B = max(1, floor((1 - compression) * size))``: the engine's budget (:func:`kvviz.engine.resolve_budget`)
    for ``size`` entries, but 1 where that leaves none (a run would be refused; a top-1 set still compares)."""
    try:
        return resolve_budget(size, compression=compression)
    except ValueError:
        if not 0.0 <= compression < 1.0:
            raise
        return 1


class _Capture:
    """Score sink for one decode step: every layer's head-mean attention, every scorer at ``layer``, and every
    layer view handed on to the InertiaKV utilities (one per scorer)."""

    prefill_window = 0

    def __init__(self, layer: int, policies: dict[str, InertiaKV]):
        self.layer, self.policies = layer, policies
        self.attention: dict[int, np.ndarray] = {}
        self.scores: dict[str, np.ndarray] = {}
        self.spearman_by_layer: dict[str, dict[int, float]] = {name: {} for name in SCORERS}  # scorer -> layer -> rho

    def wants_layer(self, layer: int) -> bool:
        return True

    def on_layer(self, view: scoring.LayerView) -> None:
        positions = torch.arange(view.keys.shape[1])  # a full cache: slot = position
        attention = self.attention[view.layer] = attention_score(view, positions).float().cpu().numpy()
        scores = {name: scorer(view, positions).float().cpu().numpy() for name, scorer in SCORERS.items()}
        for name, score in scores.items():
            self.spearman_by_layer[name][view.layer] = spearman(score, attention)
        if view.layer == self.layer:
            self.scores = scores
        for policy in self.policies.values():
            policy.observe(view, positions)

    def on_prefill_layer(self, view) -> None:  # never called: prefill_window is 0
        pass


def check_layer(model, layer: int | None) -> int:
    """The layer of the per-layer comparison (None: the middle one); ValueError outside the model."""
    num_layers = model.config.num_hidden_layers
    layer = num_layers // 2 if layer is None else layer
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer must be between 0 and {num_layers - 1} for this model, got {layer}")
    return layer


@torch.inference_mode()
def spectrum(model, prompt_ids: list[int], *, steps: int = 8, layer: int | None = None,
             compression: float = 0.9, alpha: float = 0.8) -> Spectrum:
    """Decode ``steps`` greedy tokens with the full cache and compare every scorer with attention at each.

    Parameters
    ----------
    prompt_ids : list[int]
        The prompt's tokens.
    steps : int
        Decode steps measured (step ``k`` is the query of the ``k``-th generated token, cache ``prompt + k``).
    layer : int, optional
        The layer of the per-layer comparison; default the middle one (15 of SmolLM2-135M's 30).
    compression : float
        Top-B sets use ``B = max(1, floor((1 - compression) * n))`` of the ``n`` cached entries (0.9: the
        paper's 10% budget; :func:`top_b`).
    alpha : float
        The EMA coefficient of the InertiaKV utilities.
    """
    layer = check_layer(model, layer)
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    if not 0.0 <= compression < 1.0:
        raise ValueError(f"compression must be in [0, 1), got {compression}")
    check_prompt(model, prompt_ids, steps + 1)
    with scoring.installed(model):  # the caller's model gets its attention implementation back
        return _measure(model, prompt_ids, steps, layer, compression, alpha)


def _measure(model, prompt_ids: list[int], steps: int, layer: int, compression: float, alpha: float) -> Spectrum:
    num_layers = model.config.num_hidden_layers
    prompt_len, device, cache_arg = len(prompt_ids), model.device, cache_kwarg(model)
    policies = {name: InertiaKV(alpha=alpha, scorer=name) for name in SCORERS}
    for policy in policies.values():
        policy.reset(prompt_len, prompt_len + steps, num_layers)
    result = Spectrum(layer, num_layers, compression)
    for level in ("layer_spearman", "layer_jaccard", "utility_spearman", "utility_jaccard", "by_layer"):
        setattr(result, level, {name: [] for name in SCORERS})

    cache = DynamicCache(config=model.config)
    logits = model(input_ids=torch.tensor([prompt_ids], device=device), logits_to_keep=1,
                   **{cache_arg: cache}).logits[0, -1]
    previous_top: set[int] | None = None
    for step in range(1, steps + 1):
        token, position = int(logits.argmax()), prompt_len + step - 1
        for policy in policies.values():
            policy.begin_step(step, torch.arange(position), position)
        capture = _Capture(layer, policies)
        with scoring.scoring(capture):
            logits = model(input_ids=torch.tensor([[token]], device=device),
                           position_ids=torch.tensor([[position]], device=device), **{cache_arg: cache}).logits[0, -1]
        if layer not in capture.attention:
            raise ValueError(f"layer {layer} has no attention over the cache in this model; choose another --layer")
        size = position + 1
        budget = top_b(size, compression)
        everything = torch.arange(size)
        attention, utility = capture.attention[layer], policies["attention"].utility(everything).numpy()
        for name in SCORERS:
            score, own = capture.scores[name], policies[name].utility(everything).numpy()
            result.layer_spearman[name].append(spearman(score, attention))
            result.layer_jaccard[name].append(topk_jaccard(score, attention, budget))
            result.utility_spearman[name].append(spearman(own, utility))
            result.utility_jaccard[name].append(topk_jaccard(own, utility, budget))
        index, scored = np.arange(size), sorted(capture.attention)  # layers without attention hand in nothing
        tops = [top_k(index, capture.attention[i], budget) for i in scored]
        result.cross_layer.append(np.array([jaccard(a, b) for a, b in combinations(tops, 2)]))
        current = tops[scored.index(layer)]
        # the previous step's set lacks the new entry; churn compares the sets as they are, as
        # diagnostics.raw_churn does for traces
        result.layer_churn.append(float("nan") if previous_top is None else 1.0 - jaccard(previous_top, current))
        previous_top = current
        for name in SCORERS:
            result.by_layer[name].append(np.array([capture.spearman_by_layer[name].get(i, np.nan)
                                                   for i in range(num_layers)]))
        result.steps.append(step)
        result.tokens.append(token)
        result.cache_sizes.append(size)
        result.budgets.append(budget)
    return result
