"""Oracle damage probe (AvoKV-E Appendix D): what does removing one cache entry cost the next tokens?

Decode step ``s`` feeds the token at position ``P = prompt_len + s - 1``: its query reads positions
``0 .. P`` and goes into every policy's utility, and an eviction decided there first affects the query at
``P + 1``.  So for each candidate entry ``i < P`` we remove it from the cache ``0 .. P`` and replay the
``future`` tokens from ``P + 1`` of the full-cache continuation teacher-forced, recording
``mean_t KL(p_full,t || p_without_i,t)`` (AvoKV-E Eq. 10: the next decode steps after the decision; the
prediction made at ``P`` itself is left out, since no decision at step ``s`` can change it and it is
driven by the very attention the utilities measure).  Candidates go through the model in
batches: the prefix cache is prefilled once, repeated over the batch, and row ``j`` of the batch hides
its candidate with the attention mask -- the same tokens a physically evicted cache would see.

:func:`ranking_quality` then asks how well a policy's utility at that step ranks the damage: AUROC and
average precision against the top-decile-damage label, top-k recall, the false-safe rate and Spearman
correlation;
:func:`aligned_quality` asks it of several policies over the entries all of them judged.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from transformers import DynamicCache

from .diagnostics import ranks, spearman
from .engine import cache_kwarg, check_policy, check_prompt, decode
from .policies import Policy
from .policies.checkpointed import CheckpointPolicy
from .policies.full import FullCache


@dataclass
class ProbeResult:
    step: int
    candidates: np.ndarray  # absolute positions probed
    damage: np.ndarray  # mean KL per candidate, same order
    seconds: float
    utilities: dict[str, np.ndarray] = field(default_factory=dict)  # policy -> utility per candidate
    # policy -> the terms of its decision at the probed step (AvoKV-E's p, N(p), N(b), ...) per candidate,
    # NaN where it judged none (its protected tail)
    terms: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    # the prompt and its full-cache continuation (step + future tokens, decoded past any end-of-sequence)
    sequence: list[int] = field(default_factory=list)

    @property
    def candidates_per_second(self) -> float:
        return len(self.candidates) / self.seconds if self.seconds else float("inf")


def _kl(full_logprobs: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_full || p), shapes (batch, future, vocab) -> (batch,)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return (full_logprobs.exp() * (full_logprobs - logprobs)).sum(-1).mean(-1)


@torch.inference_mode()
def damage(model, sequence: list[int], prefix_len: int, candidates: list[int], *, future: int = 8,
           batch: int = 16) -> np.ndarray:
    """Mean KL over the ``future`` tokens after ``prefix_len`` when each candidate is removed from the cache.

    Parameters
    ----------
    sequence : list[int]
        Prompt plus the full-cache continuation, at least ``prefix_len + future`` tokens.
    prefix_len : int
        Cache length at the probed step (``P``); the replay feeds ``sequence[P : P + future]``.
    candidates : list[int]
        Positions ``< prefix_len`` to remove, one at a time.
    """
    if len(sequence) < prefix_len + future:
        raise ValueError(f"need {prefix_len + future} tokens to replay {future} steps, have {len(sequence)}")
    device, cache_arg = model.device, cache_kwarg(model)
    prefix = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([sequence[:prefix_len]], device=device), logits_to_keep=1, **{cache_arg: prefix})
    replay = torch.tensor([sequence[prefix_len:prefix_len + future]], device=device)
    positions = torch.arange(prefix_len, prefix_len + future, device=device)[None]

    def replay_logits(hidden: list[int]) -> torch.Tensor:
        rows = max(len(hidden), 1)
        cache = DynamicCache(config=model.config)
        for layer, source in enumerate(prefix.layers):
            cache.update(source.keys.expand(rows, -1, -1, -1).contiguous(),
                         source.values.expand(rows, -1, -1, -1).contiguous(), layer)
        mask = torch.ones(rows, prefix_len + future, dtype=torch.long, device=device)
        for row, position in enumerate(hidden):
            mask[row, position] = 0
        return model(input_ids=replay.expand(rows, -1), attention_mask=mask, position_ids=positions.expand(rows, -1),
                     **{cache_arg: cache}).logits

    full = torch.log_softmax(replay_logits([]).float(), dim=-1)
    out = []
    for start in range(0, len(candidates), batch):
        chunk = candidates[start:start + batch]
        out.append(_kl(full, replay_logits(chunk)).cpu())
    return torch.cat(out).numpy() if out else np.empty(0)


def scoring_budget(policy: Policy, prompt_len: int, step: int) -> int:
    """The budget :func:`policy_utility_at` scores ``policy`` under at decode step ``step``: the cache there,
    ``P + 1`` entries, so that nothing is evicted before; one less for a checkpointed policy, which scores
    only at a checkpoint over budget."""
    prefix_len = prompt_len + step - 1
    return prefix_len if isinstance(policy, CheckpointPolicy) else prefix_len + 1


def protection_note(policies: dict[str, Policy], prompt_len: int, step: int) -> str:
    """What each policy never judges at the probe's step, by the budget it is scored under there
    (:func:`scoring_budget`): settings that follow B, as AvoKV-E's W_delay (32 below B = 768, 8 from it) or
    H2O's window, differ from a run at a tight budget; "" when none protects anything."""
    parts = []
    for name, policy in policies.items():
        budget = scoring_budget(policy, prompt_len, step)
        sinks, tail = policy.pinned(budget)
        # the newest of them is the step's own entry, never a candidate: tail - 1 probed entries
        kept = [f"the first {sinks}"] * bool(sinks) + [f"the newest {tail} (the step's own among them)"] * bool(tail)
        if kept:
            parts.append(f"{name} {' and '.join(kept)} (B = {budget})")
    if not parts:
        return ""
    return ("scored with the cache whole, so settings that follow B are those of a B that large; never judged: "
            + "; ".join(parts) + " (set one as a parameter, e.g. 'avokv delay=32', to probe another)")


def policy_utility_at(model, tokenizer, prompt_ids: list[int], policy: Policy,
                      step: int) -> tuple[np.ndarray | None, dict[str, np.ndarray]]:
    """A policy's utility for positions ``0 .. P-1`` at decode step ``step`` of the full-cache run, and the
    terms of its decision there (``{}`` for a policy that records none), each of length ``P``.

    The budget leaves the cache whole up to that step.  Checkpointed policies (R-KV, AvoKV-E, LazyEviction)
    only score at a checkpoint, so one is placed at ``step`` with a budget one below the cache size there:
    the scores are read before anything it evicts could matter.
    """
    prefix_len = len(prompt_ids) + step - 1
    budget = scoring_budget(policy, len(prompt_ids), step)
    if isinstance(policy, CheckpointPolicy):
        policy = replace(policy, interval=step)
    terms = {}
    for event in decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=step + 1,
                        ignore_eos=True):
        if event.step == step and event.components:  # aligned with event.present = 0 .. P (the new entry last)
            terms = {name: values[:prefix_len] for name, values in event.components.items()}
    utility = policy.utility(torch.arange(prefix_len))
    if utility is None:
        return None, terms
    # What the policy never evicts at this budget it never judges, whatever score it keeps for it: H2O ranks
    # its recent window by accumulated attention, which would count among its calls (+inf: not judged, as
    # the checkpointed policies mark their tails).  The step's own entry, at prefix_len, is the newest.
    utility = utility.float().numpy().copy()
    sinks, tail = policy.pinned(budget)
    utility[:sinks] = np.inf
    if tail:
        utility[max(prefix_len + 1 - tail, 0):] = np.inf
    return utility, terms


def check_fits(model, prompt_ids: list[int], step: int, future: int, step_name: str = "step",
               future_name: str | None = None, doing: str = "probing ") -> None:
    """Refuse a probe whose ``step + future`` decoded tokens pass the model's context, saying what to change.

    Parameters
    ----------
    step_name, future_name : str
        What the caller calls the step and the future (``"--step"``, ``"--future"``) in the message.
        ``future_name=None``: the caller's future is fixed, so only the step or the prompt can change.
    doing : str
        What the message says is being done (``kvviz scorers`` compares steps, it does not probe: ``""``).
    """
    limit = model.config.max_position_embeddings
    room = limit - len(prompt_ids)  # decoded tokens the context still holds after this prompt
    if len(prompt_ids) + step + future > limit:
        if room - future >= 1:  # some earlier step fits with this future
            fix = f"choose {step_name} {room - future} or less, or a shorter prompt"
        elif future_name is not None and room >= 2:  # even step 1 does not fit: the future must shrink
            at = step if step < room else 1  # keep the step asked for where a future of 1 or more still fits
            fix = (f"lower {future_name} to {room - at} or less" + (f" (with {step_name} 1)" if at != step else "")
                   + ", or use a shorter prompt")
        else:  # not even step 1 and one future token fit
            fix = "use a shorter prompt"
        raise ValueError(f"{doing}{step_name} {step} decodes {step + future} tokens after this "
                         f"{len(prompt_ids)}-token prompt, beyond the model's context of {limit}; {fix}")
    check_prompt(model, prompt_ids, step + future)


def damage_inputs(model, tokenizer, prompt_ids: list[int], step: int, *, future: int = 8, sample: int | None = None,
                  seed: int = 0, generated_only: bool = False) -> tuple[list[int], int, np.ndarray]:
    """What :func:`damage` is given for the probe at decode step ``step``: the sequence (prompt plus its
    full-cache continuation), the cache length it replays after, and the candidate positions.

    Step ``step`` feeds position ``P = prompt_len + step - 1``; the cache the decision is made on holds
    ``0 .. P`` (``P + 1`` entries), the candidates are drawn from ``0 .. P - 1`` (from ``prompt_len .. P - 1``,
    the entries the model generated, with ``generated_only``; ``sample`` of them, seeded, or all with
    ``sample=None``) and the replay starts at ``P + 1``.  ``kvviz probe``, the app and ``kvviz bench probe``
    all go through here, so that the benchmark times the very computation the probe runs.
    """
    prefix_len = len(prompt_ids) + step - 1  # P: the position step `step` feeds
    first = len(prompt_ids) if generated_only else 0
    if prefix_len - first < 1:
        raise ValueError(f"at step {step} the model has generated no entry before the one the step feeds: "
                         "probe step 2 or later to rank generated entries")
    # Tokens up to P + future: prompt_len + step + future in all.
    full = list(decode(model, tokenizer, prompt_ids, FullCache(), max_new_tokens=step + future, ignore_eos=True))
    sequence = list(prompt_ids) + [e.new_token_id for e in full]
    candidates = np.arange(first, prefix_len)
    if sample is not None and sample < candidates.size:
        candidates = np.sort(np.random.default_rng(seed).choice(candidates, size=sample, replace=False))
    return sequence, prefix_len + 1, candidates


def probe(model, tokenizer, prompt_ids: list[int], step: int, *, policies: dict[str, Policy] | None = None,
          sample: int | None = None, seed: int = 0, future: int = 8, batch: int = 16,
          generated_only: bool = False) -> ProbeResult:
    """Run the damage probe at decode step ``step`` (>= 1) and collect each policy's utility there (over the
    generated entries only, with ``generated_only``: :func:`damage_inputs`)."""
    if step < 1:
        raise ValueError(f"the probe step must be >= 1 (a decode step), got {step}")
    if sample is not None and sample < 1:
        raise ValueError(f"sample must be >= 1 entries (None probes them all), got {sample}")
    for policy in (policies or {}).values():  # refused now, not after the probe's own decoding
        check_policy(model, tokenizer, prompt_ids, policy)
    sequence, cache_len, candidates = damage_inputs(model, tokenizer, prompt_ids, step, future=future, sample=sample,
                                                    seed=seed, generated_only=generated_only)
    start = time.perf_counter()
    harm = damage(model, sequence, cache_len, candidates.tolist(), future=future, batch=batch)
    seconds = time.perf_counter() - start
    result = ProbeResult(step, candidates, harm, seconds, sequence=sequence)
    for name, policy in (policies or {}).items():
        try:
            utility, terms = policy_utility_at(model, tokenizer, prompt_ids, policy, step)
        except ValueError as error:  # e.g. a protected tail longer than the cache at this step
            raise ValueError(f"{name} cannot be scored at step {step} of a {len(prompt_ids)}-token prompt ({error}); "
                             f"probe a later step or a longer prompt, or leave {name} out") from None
        if utility is not None:
            result.utilities[name] = utility[candidates]
        if terms:
            result.terms[name] = {term: values[candidates] for term, values in terms.items()}
    return result


# ------------------------------------------------------------------------------------------ ranking quality

def auroc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Probability that a random positive outscores a random negative (ties count half)."""
    labels = np.asarray(labels, dtype=bool)
    positives, negatives = labels.sum(), (~labels).sum()
    if positives == 0 or negatives == 0:
        return float("nan")
    rank_sum = ranks(scores)[labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


EXACT_P_WORK = 5e7  # table cells the exact null may fill (n x k x rank-sum range); beyond it, the normal approximation


def auroc_p(scores: np.ndarray, labels: np.ndarray) -> float:
    """Two-sided p-value of the AUROC against chance (0.5): the Mann-Whitney test of the positives' scores
    against the negatives', exact and conditional on ties.

    With the few high-damage entries a probe labels (the top decile: 5 of 50, or 1 of 6), even an AUROC of 1
    or 0.2 can be chance: with one positive among six entries, ranking it first has p = 2/6.  Ties matter as
    much: a policy that scores 40 of 41 entries 0 and one of its 4 positives 1 has an AUROC of 0.625 from the
    ties' half credit, and the normal approximation calls that significant (p = 0.003) where the exact null,
    over every way to place the positives among these tied midranks, gives 4/41.  So the null is counted exactly
    -- the number of k-subsets of the n midranks with each rank sum -- whenever that table stays under
    :data:`EXACT_P_WORK` cells; larger samples (hundreds of entries) fall back to the tie-corrected normal
    approximation, which is accurate there.  NaN without positives or negatives.
    """
    from scipy import stats

    labels = np.asarray(labels, dtype=bool)
    scores = np.asarray(scores, dtype=np.float64)
    n, k = labels.size, int(labels.sum())
    if k in (0, n):
        return float("nan")
    doubled = np.rint(2 * stats.rankdata(scores)).astype(np.int64)  # midranks are halves: doubled, integers
    if k > n - k:  # the negatives' rank sum is the total minus the positives': the same test, smaller table
        labels, k = ~labels, n - k
    top = int(np.sort(doubled)[-k:].sum())
    if n * k * top > EXACT_P_WORK:
        return float(stats.mannwhitneyu(scores[labels], scores[~labels], alternative="two-sided").pvalue)
    # ways[j, s]: subsets of j of the ranks seen so far whose doubled ranks sum to s (floats: C(n, k) overflows)
    ways = np.zeros((k + 1, top + 1))
    ways[0, 0] = 1.0
    for rank in doubled:
        ways[1:, rank:] += ways[:-1, :top + 1 - rank].copy()
    null = ways[k] / ways[k].sum()
    centre = k * (n + 1)  # the doubled rank sum's mean under the null
    distance = abs(int(doubled[labels].sum()) - centre)
    return float(min(1.0, null[np.abs(np.arange(top + 1) - centre) >= distance].sum()))


def largest_tie(scores: np.ndarray) -> float:
    """Share of the entries that hold the most common score: near 1, the ranking is mostly a tie-break."""
    _, counts = np.unique(np.asarray(scores, dtype=np.float64), return_counts=True)
    return float(counts.max() / counts.sum()) if counts.size else float("nan")


MOSTLY_TIED = 0.8  # a ranking whose most common score holds this share of the entries is named as mostly ties


def tied_rankings(utilities: dict[str, np.ndarray], aligned: np.ndarray | None) -> dict[str, float]:
    """The policies whose utility over the ranked entries (``aligned``; all where None) is mostly one tied
    score (LazyEviction before entries recur: all 0), with that score's share: their AUROC comes largely
    from ties' half credit, which the reader should know (the p-value already counts the ties)."""
    shares = {name: largest_tie(utility if aligned is None else utility[aligned])
              for name, utility in utilities.items()}
    return {name: share for name, share in shares.items() if share >= MOSTLY_TIED}


def keep_order(utility: np.ndarray) -> np.ndarray:
    """Indices from the entry a policy keeps longest to the one it evicts first: highest utility first, and
    within a tie the newest (later index) first, as :func:`kvviz.policies.base.lowest` evicts the oldest of a
    tie first.  The entries are in position order."""
    utility = np.asarray(utility, dtype=np.float64)
    return np.lexsort((-np.arange(utility.size), -utility))


def average_precision(scores: np.ndarray, labels: np.ndarray) -> float:
    """Mean of the precision at each positive, ranking in :func:`keep_order` (scores in position order)."""
    labels = np.asarray(labels, dtype=bool)
    if not labels.any():
        return float("nan")
    hits = labels[keep_order(scores)]
    precision = np.cumsum(hits) / np.arange(1, hits.size + 1)
    return float(precision[hits].mean())


def top_decile(damage_values: np.ndarray) -> np.ndarray:
    """Label: damage at or above the 90th percentile."""
    return damage_values >= np.quantile(damage_values, 0.9)


def aligned_quality(utilities: dict[str, np.ndarray], damage_values: np.ndarray) -> tuple[dict[str, dict], np.ndarray]:
    """Ranking quality of several policies over the same entries: those every one of them judged.

    A checkpointed policy (AvoKV-E, R-KV, LazyEviction) never judges its protected tail and gives it utility
    +inf; ranked as is, those recent entries -- often the most damaging -- would count as its correct calls
    and the policies would be scored on different questions.  As AvoKV-E's Table 3 aligns candidates, each policy
    is ranked on the entries that every one of them judged (utility neither +inf nor NaN), the top-decile
    label taken there.

    Returns
    -------
    (quality, aligned)
        ``quality``: policy -> :func:`ranking_quality` on the aligned entries; ``aligned``: ``(n,)`` bool
        mask over the candidates, True for those ranked.
    """
    aligned = np.ones(len(damage_values), dtype=bool)
    for utility in utilities.values():
        aligned &= ~(np.isposinf(utility) | np.isnan(utility))  # +inf: never judged (NaN: no value); -inf is a call
    if aligned.sum() < 2:
        raise ValueError(f"only {int(aligned.sum())} probed entries were judged by every policy compared; "
                         "probe a later step or more entries, or leave out the policy that judges fewest")
    return {name: ranking_quality(utility[aligned], damage_values[aligned])
            for name, utility in utilities.items()}, aligned


def ranking_quality(utility: np.ndarray, damage_values: np.ndarray) -> dict[str, float]:
    """How well a utility (higher = keep) ranks the probe's damage: AUROC (with its p-value against chance,
    :func:`auroc_p`) and average precision against the top-decile label, top-k recall (the share of
    the k high-damage entries among the k highest utilities), the false-safe rate and Spearman.

    AvoKV-E's Table 3 reports a false-safe rate, "damaging entries assigned to the apparently safe-to-evict
    region", without a formula.  Here it is the mirror of top-k recall: the share of high-damage entries
    among the k lowest utilities, the first k a policy would evict (a random ranking: about 0.1).  AP, top-k
    recall and the false-safe rate break ties as the policies do (:func:`keep_order`; the entries in position
    order); AUROC and Spearman give ties half credit and average ranks.
    """
    labels = top_decile(damage_values)
    k = int(labels.sum())
    order = keep_order(utility)
    return {
        "auroc": auroc(utility, labels),
        "auroc_p": auroc_p(utility, labels),
        "average_precision": average_precision(utility, labels),
        "topk_recall": float(labels[order[:k]].sum() / k) if k else float("nan"),
        "false_safe_rate": float(labels[order[len(order) - k:]].sum() / k) if k else float("nan"),
        "spearman": spearman(utility, damage_values),
    }


# ------------------------------------------------------------------------------ the attention-only blindspot

EDGE = 1e-9

@dataclass(frozen=True)
class Blindspot:
    """AvoKV-E Figure 1(a): how often removing an entry is high-damage, by its read-pressure and payload ranks.

    ``grid_entries[j, i]`` counts the candidates whose payload rank N(b) falls in bin ``j`` and read-pressure
    rank N(p) in bin ``i`` (``bins`` equal bins of [0, 1]; N(p) bins are closed on the right and N(b) bins on
    the left, so that with 5 bins the corner cell is exactly the paper's N(p) <= 0.2, N(b) >= 0.8);
    ``grid_high`` those of them that are high-damage (top decile of the judged entries of their own probe).
    The test compares that corner, the blindspot (rarely read, large value), with every other candidate:
    ``high_damage_in`` of ``entries_in`` against ``high_damage_out`` of ``entries_out``, the Wilson 95%
    interval of the blindspot's rate, its enrichment over the rest (inf when nothing else is high-damage, NaN
    with an empty cell), and the one-sided Fisher exact p that the blindspot is the more damaging.
    """

    grid_entries: np.ndarray
    grid_high: np.ndarray
    entries_in: int
    high_damage_in: int
    entries_out: int
    high_damage_out: int
    wilson: tuple[float, float]
    enrichment: float
    fisher_p: float

    @property
    def rate_in(self) -> float:
        return self.high_damage_in / self.entries_in if self.entries_in else float("nan")

    @property
    def rate_out(self) -> float:
        return self.high_damage_out / self.entries_out if self.entries_out else float("nan")

    def summary(self) -> str:
        """One line: the blindspot's high-damage count, its interval, the rest's rate and the test."""
        if not self.entries_in:
            return (f"no entry in the blindspot (N(p) <= 0.2, N(b) >= 0.8) among {self.entries_out}: "
                    "probe every entry (no sampling) or a longer prompt")
        low, high = self.wilson
        enrichment = "∞" if self.enrichment == float("inf") else f"{self.enrichment:.2f}×"
        return (f"N(p) <= 0.2, N(b) >= 0.8: {self.high_damage_in}/{self.entries_in} high-damage ({self.rate_in:.0%}, "
                f"Wilson 95% {low:.0%}–{high:.0%}) vs {self.high_damage_out}/{self.entries_out} ({self.rate_out:.1%}) "
                f"elsewhere: enrichment {enrichment}, one-sided Fisher p = {self.fisher_p:.3g}")


def blindspot(probes: list[tuple[np.ndarray, np.ndarray, np.ndarray]], bins: int = 5) -> Blindspot:
    """Pool probes into AvoKV-E's blindspot test (Appendix D).

    Parameters
    ----------
    probes : list of (read_rank, payload_rank, damage), each of shape (n,)
        Per probe, each candidate's percentile ranks N(p) and N(b) in [0, 1] (NaN: not judged, e.g. in the
        protected tail, and left out) and its oracle damage.  High damage is the top decile *within* each
        probe, as the paper thresholds within each trace, since damage scales differ between contexts.
    """
    from scipy import stats

    reads, payloads, labels = [], [], []
    for read_rank, payload_rank, damage_values in probes:
        judged = np.isfinite(read_rank) & np.isfinite(payload_rank)
        if judged.sum() < 2:
            continue
        reads.append(read_rank[judged])
        payloads.append(payload_rank[judged])
        labels.append(top_decile(damage_values[judged]))
    if not reads:
        raise ValueError("no candidate has both ranks: probe a step where the policy judges entries (after its "
                         "protected tail), or a longer prompt")
    read, payload, label = np.concatenate(reads), np.concatenate(payloads), np.concatenate(labels)
    # Ranks are ratios (k / (n - 1)): the slack keeps one that is exactly on an edge (0.2) in its cell.
    col = np.clip(np.ceil(read * bins - EDGE).astype(int) - 1, 0, bins - 1)
    row = np.clip(np.floor(payload * bins + EDGE).astype(int), 0, bins - 1)
    grid_entries = np.zeros((bins, bins), dtype=int)
    grid_high = np.zeros((bins, bins), dtype=int)
    np.add.at(grid_entries, (row, col), 1)
    np.add.at(grid_high, (row, col), label.astype(int))
    inside = (row == bins - 1) & (col == 0)
    n_in, k_in = int(inside.sum()), int(label[inside].sum())
    n_out, k_out = int((~inside).sum()), int(label[~inside].sum())
    wilson = tuple(float(v) for v in stats.binomtest(k_in, n_in).proportion_ci(method="wilson")) if n_in \
        else (float("nan"), float("nan"))
    rate_out = k_out / n_out if n_out else float("nan")
    enrichment = float("nan") if not n_in or not n_out else (k_in / n_in) / rate_out if k_out else \
        (float("inf") if k_in else float("nan"))
    fisher_p = float(stats.fisher_exact([[k_in, n_in - k_in], [k_out, n_out - k_out]], alternative="greater").pvalue) \
        if n_in and n_out else float("nan")
    return Blindspot(grid_entries, grid_high, n_in, k_in, n_out, k_out, wilson, enrichment, fisher_p)


def blindspot_at(model, tokenizer, prompt_ids: list[int], result: ProbeResult) -> tuple[Blindspot | None, str]:
    """The blindspot test on one probe, from AvoKV-E's ranks at the probed step (its own, when AvoKV-E was among
    the probe's policies; else computed here), and a note on what it covers; ``(None, why)`` where AvoKV-E
    judges no probed entry (a cache within its protected tail and sinks, or only tail entries sampled)."""
    from .policies import make_policy

    terms = result.terms.get("avokv")
    if terms is None:
        try:
            _, terms = policy_utility_at(model, tokenizer, prompt_ids, make_policy("avokv"), result.step)
        except ValueError as error:
            return None, f"AvoKV-E judges nothing at step {result.step} ({error}); probe a later step"
        terms = {name: values[result.candidates] for name, values in terms.items()}
    if "N(p)" not in terms:
        return None, f"AvoKV-E recorded no ranks at step {result.step}"
    # Its sinks are ranked (they count in every percentile rank) but never evicted (S = +inf): like the paper's
    # candidate pool, the test leaves them out, where their large damage filled the high-read column.
    evictable = np.where(np.isposinf(terms["S"]), np.nan, terms["N(p)"])
    try:
        spot = blindspot([(evictable, terms["N(b)"], result.damage)])
    except ValueError as error:
        return None, str(error)
    return spot, (f"{spot.entries_in + spot.entries_out} entries ranked by AvoKV-E (neither its sinks nor its "
                  "protected tail, which it never evicts); high damage = the top decile of those")
