"""The Live tab's views of a run: its stats line and diagnostics, and what scrubbing to a step and Follow
show (heatmaps, step detail, fates, the last decision's terms, the followed tokens' history).  The handlers
take the tab's components (:class:`.live.LiveTab`) and return their outputs by component."""

from __future__ import annotations

import math
from pathlib import Path

import gradio as gr
import numpy as np
import plotly.graph_objects as go

from .. import diagnostics
from ..trace import Trace, checkpoint_note, time_split
from .common import diagnostic_rows, fitted_column_widths
from .figures import RunView


def stats_markdown(view: RunView, elapsed: float | None) -> str:
    events = view.events
    last = events[-1]
    steps = events[1:]
    forward, score, evict = time_split(events).values()
    decode_time = forward + score + evict
    rate = len(steps) / decode_time if decode_time else 0.0
    share = (lambda x: f"{x / decode_time:.0%}") if decode_time else (lambda x: "-")
    tokens = view.total - view.prompt_len
    # Some policies evict only at checkpoints (AvoKV-E, R-KV, LazyEviction) or at prefill (SnapKV): say why the
    # cache is over B.
    over = ""
    if last.cache_size > view.budget:
        # Decode-time policies never evict at the prefill: one that did, and not since, is prefill-time
        prefill_only = events[0].evicted.size > 0 and not any(e.evicted.size for e in steps)
        over = (" (over B: no decode step ran, and eviction starts at the first, or at a checkpoint)"
                if last.step == 0
                else " (over B: this policy evicts at the prefill only; each generated token adds an entry)"
                if prefill_only
                else " (over B: this policy does not evict at every step)")
    speed = f"{rate:.1f} tok/s" if steps else "– (no decode step)"
    evicted = sum(event.evicted.size for event in events)  # the whole run's: the line is not the scrubbed step's
    # The per-step plot's time row starts at step 1 (the prefill would flatten it): its time is said here
    first = events[0]
    prefill = f"**prefill** {first.t_forward + first.t_score + first.t_evict:.2f} s · " if first.t_forward else ""
    # Allocated, not live: a checkpointed policy holds room for every entry it may take before its next eviction.
    return (f"**tokens** {last.step + 1} / {tokens} · **prompt** {view.prompt_len} tokens · **budget** "
            f"{view.budget} · **cache** {last.cache_size} entries{over}, {last.cache_bytes / 2**20:.2f} MiB "
            f"allocated · **evicted** {evicted} in all, {last.evicted.size} at step {last.step} · "
            f"{prefill}**decode** {speed}"
            f" · **time** forward {share(forward)} / scoring {share(score)} / eviction {share(evict)}"
            + (f" · {elapsed:.1f} s" if elapsed is not None else ""))


def diagnostics_markdown(trace: Trace) -> str:
    values = diagnostic_rows(trace)
    rows = "\n".join(f"| {name} | {value} |" for name, value in values.items())
    missing = "n/a" in values.values()  # the n/a key only where a row reads n/a
    # What the values are goes above the table: in the header it took the narrow column's width and wrapped
    # "value" into "valu / e"
    return ("Means over the run's steps (k = the budget B), but the first keep set's share retained, at the run's "
            "end:\n\n| diagnostic | value |\n|---|---:|\n" + rows +
            "\n\n" + DIAGNOSTICS_NOTE + (f"\n\n*{diagnostics.NOT_AVAILABLE}*" if missing else ""))


# Why two policies' utility churn can match while their rankings do not (README, "How it works").
DIAGNOSTICS_NOTE = ("*Where the cache holds B, the top-B by utility is the keep set itself, so utility churn is "
                    "the keep turnover, 2/(B+1) a step when a new entry displaces an old one, for any policy; "
                    "both count only steps that evicted (AvoKV-E, R-KV, LazyEviction: into each checkpoint from "
                    "the step before it). "
                    "The rank stabilities measure how much each recomputation reorders the ranking: the Spearman "
                    "correlation of consecutive recomputations' raw scores, and of their utilities, over the "
                    "entries both scored (each policy on its own keep set; a step that changes no utility, as "
                    "between Lazy refreshes or AvoKV-E checkpoints, is no recomputation). "
                    "The raw rows average over the steps with a raw score, counted in the last row: Lazy's "
                    "refreshes, Score-Free's first step alone; policies whose counts differ are measured over "
                    "different parts of the run.*")


def scrubbed_step(view: RunView, step) -> int:
    """The scrubber's value as a step of this run: a value typed past an end reaches here as typed (the
    browser sets the box to the end only when it loses focus), and is read as that end."""
    try:
        number = int(float(step or 0))
    except (TypeError, ValueError, OverflowError):
        number = view.steps - 1
    return min(max(number, 0), view.steps - 1)


def scrub_note(view: RunView, typed, step: int) -> str | None:
    """Why the scrubber shows ``step`` for the value ``typed`` in its box (past an end, not whole, not a
    number), or None where it needs no word (the step itself, or the box emptied: step 0)."""
    if typed is None or str(typed).strip() == "":
        return None
    last = view.steps - 1
    try:
        number = float(typed)
    except (TypeError, ValueError):
        number = math.nan
    if math.isnan(number):
        return f"Scrub to step: {typed!r} is not a step; showing the last, {step}"
    if not 0 <= number <= last:
        return f"Scrub to step goes from 0 to {last}: {number:g} was set to {step}"
    if number != step:
        return f"Scrub to step takes whole steps: {number:g} shows step {step}"
    return None


def typed_positions(view: RunView, follow: str, step: int) -> list[int]:
    """The positions typed in Follow, which the retention heatmap marks; none while it is empty (the entries
    at the eviction boundary that the token history then follows change with every step scrubbed)."""
    return view.follow(follow, step)[0] if (follow or "").strip() else []


def scrub(tab, view: RunView | None, step, follow: str = "") -> dict:
    """The views of one step: heatmaps (the tokens typed in Follow marked on the retention), step detail,
    prompt fates and the last decision's terms, and the scrubber set to that step where it was typed as
    another value (3.5, or past an end), so that the box says which step is shown.  The token history is not
    among them: it follows in a second event, which reads the Follow field as it is then (a field typed while
    this ran would otherwise be overwritten by a history of what it held before)."""
    if view is None or not view.events:
        return gr.skip()
    typed, step = step, scrubbed_step(view, step)
    try:
        as_shown = float(typed) == step
    except (TypeError, ValueError):
        as_shown = False
    if not as_shown and (note := scrub_note(view, typed, step)):
        gr.Warning(note)  # the box then reads the step shown; without a word, 2.5 became 2 unexplained
    terms_note, terms = decision_views(view, step)
    return {tab.retention: view.retention_figure(step, typed_positions(view, follow, step)),
            tab.ranks: view.rank_figure(step), tab.timeline: view.timeline_figure(step),
            tab.detail: view.step_detail_figure(step), tab.fate: view.fate_html(step, prompt_only=False),
            tab.terms_note: terms_note, tab.terms: terms,
            tab.step_slider: gr.skip() if as_shown else gr.update(value=step)}


def history_view(view: RunView | None, follow: str, step) -> go.Figure | None:
    """The followed tokens' ranks over the run (the entries at the eviction boundary when none is typed)."""
    if view is None or not view.events:
        return None
    step = scrubbed_step(view, step)
    return view.history_figure(*view.follow(follow, step), marker_step=step)


def _history_and_marks(view: RunView, follow: str, step: int) -> tuple[go.Figure, list[int]]:
    """The token history at the scrubbed ``step`` and the positions to mark on the retention heatmap (those
    typed; none while Follow is empty), from one search of the tokens."""
    positions, note = view.follow(follow, step)
    return view.history_figure(positions, note, marker_step=step), positions if (follow or "").strip() else []


def followed_views(tab, view: RunView | None, follow: str, step) -> dict:
    """What Follow changes: the token history, and the retention heatmap with the typed tokens marked (at the
    scrubbed step)."""
    if view is None or not view.events:
        return gr.skip()
    step = scrubbed_step(view, step)
    history, marked = _history_and_marks(view, follow, step)
    return {tab.history: history, tab.retention: view.retention_figure(step, marked)}


def step_views(tab, view: RunView | None, follow: str, step) -> dict:
    """What follows the scrubbed step besides the heatmaps: the token history, the last decision's terms,
    and the retention heatmap again where Follow has tokens typed to mark on it."""
    if view is None or not view.events:
        return {tab.history: None, tab.terms_note: "", tab.terms: gr.update(value=None, visible=False)}
    step = scrubbed_step(view, step)
    history, marked = _history_and_marks(view, follow, step)
    terms_note, terms = decision_views(view, step)
    return {tab.history: history, tab.terms_note: terms_note, tab.terms: terms,
            tab.retention: view.retention_figure(step, marked) if marked else gr.skip()}


def decision_views(view: RunView, step) -> tuple:
    """The caption and the table of the last eviction decision's terms (AvoKV-E, R-KV, LazyEviction) at
    ``step``: the entry (``#`` its position), its score to four significant digits (the cut can fall between
    close ones), its fate, then the terms to three (attention probabilities are often below 1e-4, so no fixed
    decimals); each column as wide as its content: AvoKV-E's ten fit the panel of a 1280-px window (Gradio 6
    ignores ``pinned_columns``: scrolled sideways, a row's terms lose their entry)."""
    frame, caption = view.terms_frame(scrubbed_step(view, step))
    if frame is None:
        return caption, gr.update(visible=False)
    score = frame.columns[2]
    for name in frame.select_dtypes("number").columns.drop("position"):
        digits = 4 if name == score else 3
        # A sink's +inf would reach the browser as an empty cell (JSON has no infinity): say it.
        frame[name] = frame[name].map(
            lambda value, digits=digits: "+inf" if value == np.inf else float(f"{value:.{digits}g}"))
    frame = frame.rename(columns={"position": "#"})
    return caption, gr.update(value=frame, visible=True, column_widths=fitted_column_widths(frame))
def finished_outputs(tab, view: RunView, trace: Trace, text: str, stats: str, path: Path | None) -> dict:
    """The Live tab once a run is over (or a saved one is opened): every view, the scrubber, the download."""
    last_step = view.steps - 1
    note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over B with nothing evicted
    stats += f"  \n*{note}*" if note else ""
    return {tab.text: text, tab.stats: stats, tab.retention: view.retention_figure(), tab.ranks: view.rank_figure(),
            tab.timeline: view.timeline_figure(), tab.fate: view.fate_html(),
            # a run that decoded no step (one new token) has nothing to scrub
            tab.step_slider: gr.update(maximum=max(last_step, 1), value=last_step, visible=last_step > 0,
                                       interactive=True),
            tab.download: gr.update(value=str(path), visible=True) if path else gr.update(value=None, visible=False),
            tab.diag: diagnostics_markdown(trace), tab.view_state: view, tab.detail: view.step_detail_figure(last_step)}
