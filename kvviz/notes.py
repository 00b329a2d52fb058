"""The sentences that say what a run or a table of results means: shared by the command line and the app,
so that both say it in the same words, and kept out of the data layers (the trace, the store) they describe.

Each takes what those layers hold -- a :class:`kvviz.trace.Trace`, a frame of :class:`kvviz.store.Store` rows --
and returns text; none reads a file or a model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pandas loads only where a table is described: a trace's notes need none
    import pandas as pd


def run_note(trace) -> str:
    """The model, its dtype and the sampling of a trace, for a caption (``" on M in bfloat16, sampled ..."``)."""
    return (f" on {trace.model or 'an unnamed model'}" + (f" in {trace.dtype}" if trace.dtype else "")
            + sampling_note(trace.sampling))


def budget_note(trace) -> str:
    """How the trace's cache was sized: ``"budget B = 127 (compression ρ = 0.9)"``, the budget alone where it
    was given in tokens (or the trace predates recording ρ), and no budget for the full cache, whose B is
    only the prompt's length."""
    if trace.policy == "full":
        return "no eviction (full cache)"
    return f"budget B = {trace.budget}" + ("" if trace.compression is None else
                                             f" (compression ρ = {trace.compression:g})")


def checkpoint_note(trace) -> str:
    """Why a checkpointed policy's (AvoKV-E's, R-KV's, LazyEviction's) cache ended over budget with nothing
    evicted, or "": those evict only at a checkpoint, and a run that ended before its first one kept every
    entry."""
    from .policies import REGISTRY
    from .policies.checkpointed import CheckpointPolicy

    spec = REGISTRY.get(trace.policy)
    if spec is None or not issubclass(spec.cls, CheckpointPolicy) or not trace.events:
        return ""
    last = trace.events[-1]
    if last.cache_size <= trace.budget or any(event.evicted.size for event in trace.events):
        return ""
    try:
        policy = spec.build(**trace.params)
    except ValueError:  # parameters this version refuses: the schedule is unknown
        return ""
    first = policy.first_checkpoint(trace.prompt_len, trace.budget)
    if last.step >= first:  # not this schedule's run (nothing evicted at a checkpoint): say nothing rather than guess
        return ""
    ended = "was stopped" if trace.stopped else "ended"
    return (f"no checkpoint reached: {trace.policy} evicts every {policy.interval} generated tokens, first at step "
            f"{first} here, and this run {ended} at step {last.step}; the cache was not cut")


def sampling_note(sampling: dict) -> str:
    """How a run picked its tokens, for a caption (``", sampled at temperature 0.6, ..."``): empty when greedy."""
    if not sampling:
        return ""
    return f", sampled at temperature {sampling['temperature']:g}, top-p {sampling['top_p']:g}, seed {sampling['seed']}"



# The design behind a checkpointed or prefill-time policy's larger cache; no-break spaces keep "interval - 1" whole.
HELD_OVER_WHY = (" (by design where a policy evicts only at checkpoints, up to B + interval\u00a0-\u00a01, "
                 "or only at the prefill, growing by the tokens generated)")


def held_over_note(frame: pd.DataFrame) -> str:
    """One line naming each policy's cells in ``frame`` (:meth:`Store.speed_vs_quality` rows) that held over
    HELD_OVER times the budget, grouped per policy (``"avokv B=80: 184, B=112: 184; snapkv ρ=0.9: 219 of
    B=199"``); empty where none did."""
    import pandas as pd

    from .store import HELD_OVER, held_over_budget

    over = held_over_budget(frame)
    if over.empty:
        return ""
    several = len(frame.groupby(["model", "task"])) > 1

    def held(row) -> str:
        if not pd.isna(row.absolute_budget):
            return f"B={int(row.absolute_budget)}: {row.decode_cache:.0f}"
        return f"ρ={row.compression:g}: {row.decode_cache:.0f} of B={row.budget:.0f}"

    cells = "; ".join(f"{policy} " + ", ".join(held(row) for row in part.itertuples())
                      for policy, part in over.groupby("policy", sort=True))
    return (f"held over {HELD_OVER:g}x the budget (mean largest cache while decoding, entries"
            + (", on the task that held the most" if several else "") + f"): {cells}{HELD_OVER_WHY}")



def suite_notes(frame: pd.DataFrame, left_out: pd.DataFrame, suite: str) -> list[str]:
    """What :meth:`Store.paper_comparison`'s ``frame`` averages: per model, the measured tasks, and those
    :meth:`Store.left_out_of_suite` names (``left_out``), with why; the paper side as printed."""
    from .store import FULL_CACHE_FLOOR

    measured = frame[frame.origin == "measured"]
    notes = [f"measured {model}: mean over {tasks}" for model, tasks in
             measured.groupby("model").task_names.agg(lambda names: max(names, key=len)).items()]
    for model, part in left_out.groupby("model"):
        below = [f"{row.task} (full cache {row.full_score:.3f})" for row in part.itertuples()
                 if row.reason != "no full-cache row"]
        missing = [row.task for row in part.itertuples() if row.reason == "no full-cache row"]
        if below:
            notes.append(f"measured {model}: left out {', '.join(below)}: under {FULL_CACHE_FLOOR:g} with the "
                         "full cache, a policy's score there is mostly noise")
        if missing:
            notes.append(f"measured {model}: left out {', '.join(missing)}: no full-cache row to be relative to")
    if (frame.origin != "measured").any():
        notes.append("paper: the aggregate as printed" + (", the mean over RULER's 13 subtasks, on which the papers' "
                                                          "full caches score well" if suite == "RULER" else ""))
    return notes
