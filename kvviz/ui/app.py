"""The Gradio app: Live (stream one policy), Compare (2-4 policies on one shared prefill), Results.

Handlers consume the engine's step events and nothing else.  Every input is validated before any model
work starts and a bad one is refused with what to change (:mod:`.checks`); anything else that goes wrong
reaches the user as a one-line message too (its traceback goes to the server log only).  A run that
fails drops its state; one that is stopped (:mod:`.tickets`) ends between two steps and is shown and saved
as far as it got; the server keeps serving.  The Results tab is :mod:`.results`, the figures :mod:`.figures`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import shutil
import tempfile
import textwrap
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd
import plotly.graph_objects as go

from .. import diagnostics, engine
from ..models import load_tokenizer
from ..policies import REGISTRY, Policy, build_setting, setting_label, shown_value
from ..policies.checkpointed import CheckpointPolicy
from ..store import Store
from ..tasks.examples import EXAMPLES
from ..quote import excerpt, kind
from ..trace import Trace, budget_note, checkpoint_note, model_dtype, run_note, sampling_note, time_split
from .analyses import (MAX_PROBE_SAMPLE, make_probe_check, make_probe_handler, make_spectrum_check,
                       make_spectrum_handler)
from .checks import (MAX_TEMPERATURE, PARAM_NAMES, PARAMETERS, Request, _models, build_policies, check_prompt_text,
                     check_sampling, check_settings, compare_settings, distinct_settings, get_tokenizer,
                     policy_from_inputs,
                     refused, refusing, release_memory, unexpected, unused_parameters, used_parameters, validate)
from .config import Limits
from .landing import Landing, load_landing
from .figures import LEGEND_LINE, MAX_FOLLOWED, NEVER, RunView, step_dtick, step_range
from .results import build_results_tab
from .tickets import button_ticket, request_stop, retire, stopped_run_failed, ticketed
from .widgets import TypedSlider

log = logging.getLogger(__name__)
# The text at most 30 times a second: every token at CPU speeds, several a time on a GPU or a tiny model,
# whose hundreds of updates a second (each re-rendering the growing text) otherwise saturate the page.
TEXT_EVERY_S = 1 / 30
# The comparisons the papers make, ready to run (editable once chosen): settings as the Policies box takes them,
# the reference first (the divergence and Jaccard lines are against it).  AvoKV-E and R-KV check every 16 tokens
# instead of 128, so that the tab's 48 new tokens see several checkpoints (and AvoKV-E's delay matters).
COMPARISONS = {
    "InertiaKV against TOVA (one step of attention) and StreamingLLM (sinks and a window)": ["inertia", "tova",
                                                                                             "streaming"],
    "InertiaKV against lightweight baselines of its Table 4": ["inertia", "tova", "snapkv", "keydiff"],
    "EMA against single-step and cumulative aggregation (InertiaKV §3.1, App. G)": ["inertia", "single-step",
                                                                                     "cumulative"],
    "EMA strength α = 0.8, 0, 0.3, 0.95 (InertiaKV Table 5)": ["inertia", "single-step", "inertia alpha=0.3",
                                                                "inertia alpha=0.95"],
    "Full refresh, Lazy (r = 4) and Score-Free (InertiaKV §3.2)": ["inertia", "inertia-lazy", "score-free"],
    "Scorers under the EMA (InertiaKV §5.1)": ["inertia", "inertia-vnorm", "inertia-entropy", "inertia-knorm"],
    "AvoKV-E without payload, delay or rank normalisation (AvoKV-E Table 4)": [
        "avokv interval=16", "avokv interval=16 lambda_b=0", "avokv interval=16 delay=8",
        "avokv interval=16 normalise=false"],
    # AvoKV-E first: every keep set's Jaccard against the full cache's is only B / (L0 + t), whatever kept it
    "AvoKV-E against R-KV and LazyEviction, its redundancy- and recurrence-based baselines, and the full cache "
    "(AvoKV-E §5)": ["avokv interval=16", "rkv interval=16", "lazyeviction interval=16", "full"],
}

# The presets of AvoKV-E's variants run in its regime, long generation under an active-KV budget that the
# reasoning trace fills (§5.1: sampled at T = 0.6, top-p 0.95).  Chosen, they set B = L0 + REASONING_HEADROOM,
# so that eviction starts once the trace has filled it, REASONING_NEW_TOKENS new tokens (several checkpoints
# after that at interval 16) and the paper's sampling; over an example prompt, the reasoning one.  Left at
# compression 0.75, their first checkpoint cut the prompt, a regime the paper never runs.
REASONING_PRESETS = [name for name in COMPARISONS if name.startswith("AvoKV-E")]
REASONING_HEADROOM, REASONING_NEW_TOKENS = 32, 160
REASONING_SAMPLING = {"temperature": 0.6, "top_p": 0.95}
# The Live tab's start: its default policy (InertiaKV) answers the passkey example right at this compression
# on the default model (at 0.5 it lost it under every policy tried: assets/landing.py)
LIVE_COMPRESSION = 0.3
# The Compare tab's own start, which the other presets (InertiaKV's prompt-compression regime) go back to
# where an AvoKV-E preset had changed it
COMPARE_EXAMPLE, COMPARE_NEW_TOKENS = "Four-key needle", 48


# Where the Live tab's traces and the Compare tab's zips are written, one folder a run, the newest kept.
DOWNLOADS = Path(tempfile.mkdtemp(prefix="kvviz-downloads-"))
KEEP_DOWNLOADS = 32


# ----------------------------------------------------------------------------------------- validation


VIEWS_MIN_WIDTH = 560  # px: a tab's views (text, heatmaps, tables) go below its settings in a narrower page
CLOSE_TOASTS = ("() => document.querySelectorAll('button.toast-close.error, button.toast-close.warning')"
                ".forEach(b => b.click())")


def checkpoint_interval(policy: Policy) -> int | None:
    """A checkpointed policy's interval (AvoKV-E, R-KV, LazyEviction), None for one that decides every step."""
    return policy.interval if isinstance(policy, CheckpointPolicy) else None


def terms_key(policy: Policy | None) -> str:
    """What a checkpointed policy's decision terms are and how they combine (its :meth:`terms_key`), else ""."""
    return policy.terms_key() if isinstance(policy, CheckpointPolicy) else ""


@dataclass
class Progress:
    """A run (the Live tab's) or comparison (the Compare tab's) as far as it has got: its views and texts and
    what their traces record.  Stop ends it between two steps, and it is then shown and saved as far as it got."""

    prompt_ids: list[int]
    budget: int
    max_new_tokens: int
    model_name: str
    dtype: str
    sampling: dict
    settings: dict[str, tuple[str, dict]]  # label -> (registry name, parameters)
    views: dict[str, RunView]
    texts: dict[str, str]
    ends: set[int]  # end-of-sequence ids: a policy that produced one had finished before Stop came
    compression: float | None = None  # the Request's
    prompt: str = ""  # the Request's
    chat: bool = True
    started: float = field(default_factory=time.perf_counter)

    @classmethod
    def start(cls, request: Request, model_name: str, policies: dict[str, Policy], tokens: list[str]) -> "Progress":
        views = {label: RunView(len(request.prompt_ids), request.max_new_tokens, request.budget, tokens,
                                policy.pinned(request.budget), checkpoint_interval(policy), terms_key(policy))
                 for label, policy in policies.items()}
        settings = {label: (label.split()[0], policy.params()) for label, policy in policies.items()}
        return cls(request.prompt_ids, request.budget, request.max_new_tokens, model_name, model_dtype(request.model),
                   request.sampling, settings, views, {label: "" for label in policies},
                   engine.eos_ids(request.model, request.tokenizer), request.compression, request.prompt,
                   request.chat)

    def add(self, label: str, event) -> None:
        self.views[label].add(event, event.text)
        self.texts[label] += event.text
        if event.new_token_id in self.ends:
            self.views[label].ended = event.step

    def trace(self, label: str) -> Trace:
        name, params = self.settings[label]
        # called once the run is over: a policy that is over and did not finish was stopped
        return Trace(self.prompt_ids, self.budget, name, params, self.model_name, self.views[label].events,
                     self.sampling, self.dtype, self.max_new_tokens, stopped=not self.finished(label),
                     compression=self.compression, prompt=self.prompt, chat=self.chat)

    def finished(self, label: str) -> bool:
        events = self.views[label].events
        return bool(events) and (events[-1].new_token_id in self.ends or len(events) == self.max_new_tokens)

    def running(self) -> list[str]:
        return [label for label in self.views if not self.finished(label)]

    def level(self) -> bool:
        """Whether the policies still decoding have all made the same steps, at least one: where a stopped
        comparison ends (its interleaved steps otherwise leave one policy a step ahead)."""
        steps = {self.views[label].steps for label in self.running()}
        return len(steps) <= 1 and 0 not in steps


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


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
            f"allocated · **evicted** {evicted} in all, {last.evicted.size} at step {last.step} · {prefill}**decode** {speed}"
            f" · **time** forward {share(forward)} / scoring {share(score)} / eviction {share(evict)}"
            + (f" · {elapsed:.1f} s" if elapsed is not None else ""))


def raw_steps(trace: Trace) -> str:
    """How many decode steps recorded a raw score: the steps the raw rows average over."""
    steps = trace.decode_steps
    return f"{sum(event.raw is not None for event in steps)} of {len(steps)}"


RAW_STEPS = "decode steps with a raw score"


def diagnostic_rows(trace: Trace) -> dict[str, str]:
    """The diagnostics as the tables show them (n/a where NaN), then the steps the raw rows average over."""
    return {**{name.replace("_", " "): "n/a" if np.isnan(value) else f"{value:.4f}"
               for name, value in diagnostics.summary(trace).items()}, RAW_STEPS: raw_steps(trace)}


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


# ----------------------------------------------------------------------------------------- handlers

# Each button first runs a check with no outputs: a refusal raised there is only the toast, while one raised
# by the run itself also marks every output panel "Error".  The runs check again (the API calls them alone).
# validate() checks the settings before it loads a model, so only a request that passes them loads one.

def make_live_check(limits: Limits):
    def check_live(model_name, prompt, policy_name, budget_mode, compression, budget, max_new_tokens, chat,
                   temperature, top_p, seed, *param_values):
        try:
            policy = policy_from_inputs(policy_name, dict(zip(PARAM_NAMES, param_values)))
            validate(limits, model_name, prompt, budget_mode, compression, budget, max_new_tokens, chat, [policy],
                     temperature, top_p, seed, backend=limits.backend)
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:  # e.g. a model that fails to load: logged, and named in one line
            raise unexpected("checking the run", error) from None

    return check_live


def repeats_note(entries) -> str:
    """What :func:`policy_settings` dropped as a repeat, for the page (markdown): a chip that stays in the box
    but gets no panel would otherwise pass for a lost policy.  Empty when nothing repeats (or the entries are
    not a list of settings, which the check refuses)."""
    try:
        if isinstance(entries, str):
            entries = [entries]
        _, repeats = distinct_settings(entries or [])
    except (TypeError, ValueError):
        return ""
    parts = []
    for entry, first, label in repeats:
        entry, first = entry.strip(), first.strip()
        if entry == first:
            parts.append(f"`{entry}` is given twice")
        elif first == label:
            # a label with no changes is the registry entry itself, at its defaults
            parts.append(f"`{entry}` is `{label}`" + ("" if " " in label else " (its defaults)"))
        else:
            parts.append(f"`{entry}` and `{first}` are one setting, `{label}`")
    return f"*Run once: {'; '.join(parts)}.*" if parts else ""


def policies_edited(preset: str, entries, seen=None) -> tuple:
    """The Policies box edited by hand: a typed entry the registry refuses is said at once, in a toast, not
    at the next Compare (the newest entry only: it is appended last, and the older ones were said when they
    came); and the preset box empties once the list is no longer that preset's, which it went on naming.

    ``seen`` is the list this last ran on: the page sends the box's change twice for one entry (as it is added
    and as the box loses focus), which said the refusal twice.  Returns the preset box and the new ``seen``."""
    entries = list(entries or [])
    if entries == seen:
        return gr.skip(), gr.skip()
    if entries:
        try:
            build_setting(entries[-1])
        except ValueError as error:
            gr.Warning(f"{error} (in the Policies box: change or remove it)")
    return (gr.update(value=None) if COMPARISONS.get(preset) != entries else gr.skip()), entries


# The box takes no fifth chip and ignores a fifth typed entry without a word (Gradio's max_choices): a line
# under it says so once it is full.  (Not its label: updating the box from its own change event makes the page
# send the change again.)
POLICIES_FULL = "*Four chosen, the most a comparison shows: remove one (its ×) to pick or type another.*"


def policies_full_note(entries) -> dict:
    """The line under the Policies box: shown once it holds four ``entries``, why a fifth will not go in."""
    full = len(entries or []) >= 4
    return gr.update(value=POLICIES_FULL if full else "", visible=full)


NOT_COMPARED = "*Not compared: "  # how the refusal note begins, where the comparison would have been
PREVIOUS = "previous comparison"  # how a refusal marks what the last comparison left on the page
FATES_LABEL = "Fate per policy"
PROBE_LABEL = "Ranking quality (AUROC / AP vs top-decile damage)"
BLINDSPOT_LABEL = "Attention-only blindspot (AvoKV-E Fig. 1a)"
SPECTRUM_LABEL, SPECTRUM_LAYERS_LABEL, SPECTRUM_TABLE_LABEL = "Scorer spectrum", "By layer", "Mean over steps"
STABILITY_LABEL = ("Stability, a column per policy (InertiaKV App. I; means over steps, k = B): top-B churn of raw scores "
                   "and of utility (the keep turnover wherever the cache holds B, for any policy), their Jaccard, "
                   "raw top-B evicted, and the rank stabilities: Spearman of consecutive recomputations' raw "
                   "scores, and of their utilities, over the entries both scored (the ranking inertia); n/a "
                   "where a policy records no such score or has not rescored (a checkpointed one that reached a "
                   "single checkpoint; churn and turnover: where it evicted at no step after its first); a "
                   "checkpointed policy's raw churn is its every-step attention, where it records one "
                   "(LazyEviction), not its decisions; last, the share of the keep set "
                   "after the first step that evicted still kept at the end (InertiaKV §3.1 saw all of it kept)")


def make_compare_check(limits: Limits):
    def problem(model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
                temperature=0.0, top_p=1.0, seed=0, load: bool = True) -> str | None:
        """What is wrong with these inputs, if anything; ``load=False`` checks no further than the settings
        unless the model is loaded already."""
        try:
            settings = compare_settings(names)
            if load or model_name in _models:
                validate(limits, model_name, prompt, budget_mode, compression, budget, max_new_tokens, chat,
                         list(build_policies(settings).values()), temperature, top_p, seed)
            else:
                check_settings(limits, model_name, prompt, budget_mode, max_new_tokens)
                check_sampling(temperature, top_p, seed)
        except ValueError as error:
            return str(error)
        return None

    def check_compare(*inputs):
        try:
            reason = problem(*inputs)
        except Exception as error:
            raise unexpected("checking the comparison", error) from None
        if reason:
            raise refused(reason)

    def refusal_note(*inputs):
        """In the page, where the comparison would have been: the toast's reason, which outlives the toast.

        Also runs when Stop cancels the check: then it neither loads a model nor writes a thing.
        """
        try:
            reason = problem(*inputs, load=False)
        except Exception:  # noqa: BLE001 -- the check reported it
            reason = None
        return f"{NOT_COMPARED}{reason}.*" if reason else gr.skip()

    def edited(*values):
        """An edit of the inputs, by hand or by a preset, with the last comparison (``views``, the inputs it
        ran on and its note: ``ran``) and the note on the page.

        After a refused click the reason follows the inputs as they are now (:meth:`refused_marks`, while they
        would still be refused).  Otherwise the comparison on the page is marked where the inputs it ran on
        have changed (:func:`changed_inputs`): the note names them and each panel and table says "earlier
        inputs", so that it is not read as these inputs' result (Follow searches that run, too); the inputs
        it ran on, set back, take the marks off."""
        *inputs, ran, views, note = values
        skip = (gr.skip(),) * 7
        refused_note = isinstance(note, str) and note.startswith(NOT_COMPARED)
        try:
            reason = problem(*inputs, load=False) if refused_note else None
        except Exception:  # noqa: BLE001 -- the next click's check reports it
            return skip
        if reason:
            return refused_marks(*inputs, views)
        if not views or not ran or ran.get("inputs") is None:  # none has ended (or one is running)
            return ("" if refused_note else gr.skip(), *skip[1:])
        changed = changed_inputs(ran["inputs"], compared_inputs(*inputs))
        mark = earlier_inputs(changed, "comparison ran", "compare again") + "\n\n" if changed else ""
        suffix = " · earlier inputs" if changed else ""
        texts = [gr.update(label=label + suffix) for label in compared_labels(views)]
        tables = [gr.update(label=label + (" (earlier inputs)" if changed else "")) for label in (FATES_LABEL,
                                                                                                 STABILITY_LABEL)]
        return mark + ran["note"], *texts, *[gr.skip()] * (4 - len(texts)), *tables

    def announce(*inputs_and_state):
        """At the click, while the check loads the model (its first comparison): say so where the
        comparison will be, after any repeats' note, and, with no earlier comparison on the page, label one
        panel per chosen policy.  Nothing when the model is loaded or the inputs will be refused."""
        *inputs, state = inputs_and_state
        skip = (gr.skip(),) * 9
        try:
            loading = loading_note(inputs[0])
            if loading is None or problem(*inputs, load=False):
                return skip
            labels = list(compare_settings(inputs[2]))
        except Exception:  # noqa: BLE001 -- the check reports it
            return skip
        note = f"{repeats_note(inputs[2])}\n\n{loading}".lstrip()
        # Panels that hold an earlier comparison keep its labels until this one passes its check.
        return note, *(starting_panels(labels) if state is None else skip[:8])

    def refused_marks(*inputs_and_state):
        """A refused click: :func:`refusal_note`, and the previous comparison's panels and tables, which stay
        as the Live tab's last run does, each marked as the previous comparison's, so that they are not
        taken for these inputs' results (its next comparison relabels them).  With no comparison yet, the
        panels the click labelled go back to their placeholders."""
        *inputs, state = inputs_and_state
        note = refusal_note(*inputs)
        if not isinstance(note, str):  # Stop cancelled the check: nothing was refused
            return (gr.skip(),) * 7
        labels = list(state or [])
        texts = [gr.update(label=f"{compared_labels(state)[i]} · {PREVIOUS}") if i < len(labels) else
                 gr.update(label=f"policy {i + 1}") if not labels else gr.skip() for i in range(4)]
        if labels:  # its sizes and divergence lines too, which the refusal's note takes the place of
            note += (f"\n\n*Shown: the {PREVIOUS} ({', '.join(labels)}), not these inputs' results.*\n\n"
                     + divergence_markdown(labels, state))
        # first: the stability table's label runs to three lines
        tables = [gr.update(label=f"{PREVIOUS.capitalize()}: {label}") if labels else gr.skip()
                  for label in (FATES_LABEL, STABILITY_LABEL)]
        return note, *texts, *tables

    check_compare.refusal_note, check_compare.edited = refusal_note, edited
    check_compare.refused_marks = refused_marks
    check_compare.announce = announce
    return check_compare


# Traces opened at once, in their own queue (each held within the run limits' size while it opens)
TRACES_AT_ONCE = 2

# The trace a check just read (an upload's, a "Use its settings" click's), for the handler that follows it, so
# a large file is read once.  One slot: another check may take it first, and the handler then reads the file.
_checked_trace: dict[str, Trace] = {}


def load_trace(path, limits: Limits) -> Trace:
    """An opened trace, read within what a run here could make; a refused file's memory is handed back."""
    try:
        return Trace.load(path, limits.trace_bounds())
    except ValueError:
        release_memory()
        raise


def check_trace(path, limits: Limits) -> None:
    if path:
        try:
            _checked_trace.clear()
            _checked_trace[path] = load_trace(path, limits)
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("opening the trace", error) from None


def make_live_handler(limits: Limits):
    def live_run(*inputs):
        *inputs, ticket_id, tickets = inputs  # the run's inputs, the ticket id its click made, the session's
        yield from ticketed(ticket_id, tickets, 12, lambda ticket, made: live_steps(ticket, made, *inputs))

    def live_steps(ticket, made, model_name, prompt, policy_name, budget_mode, compression, budget, max_new_tokens,
                   chat, temperature, top_p, seed, *param_values):
        if made:  # an API call's first run in its session: from now on /stop_live reaches it
            yield (*[gr.skip()] * 11, made)
        try:
            policy = policy_from_inputs(policy_name, dict(zip(PARAM_NAMES, param_values)))
            request = validate(limits, model_name, prompt, budget_mode, compression, budget, max_new_tokens, chat,
                               [policy], temperature, top_p, seed, backend=limits.backend)
            policy = policy_from_inputs(policy_name, dict(zip(PARAM_NAMES, param_values)))  # fresh state
            run = Progress.start(request, model_name, {policy_name: policy},
                                 token_texts(request.tokenizer, request.prompt_ids))
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("starting the run", error) from None
        view = run.views[policy_name]
        # The stats name the setting that ran, and how it picked its tokens: the widgets may describe another
        # by the time one reads them
        ran = f"**run** `{setting_label(policy)}`{sampling_note(request.sampling)} · "
        last_figure, last_secondary, last_fate, last_text = 0.0, 0.0, 0.0, 0.0
        figure_every = 1 / limits.figures_per_second if limits.figures_per_second else math.inf
        # Clear what the previous run left (scrubber, detail, download, diagnostics) before streaming, and
        # say what runs until the first token.
        yield ("", ran + PREFILL.format(len(request.prompt_ids)), None, None, None, "", gr.update(visible=False),
               gr.update(value=None, visible=False), "", None, None, gr.skip())
        try:
            for event in request.events(policy, limits.backend):
                run.add(policy_name, event)
                if ticket.is_set():
                    break
                now = time.perf_counter()
                if now - last_figure >= figure_every:
                    last_figure = last_text = now
                    # The retention heatmap animates at the full rate; the rank heatmap, the per-step plot and
                    # the token view every half second or second: each redraw costs the browser more than
                    # the server, and a fast model otherwise saturates the page.
                    fate = rank = timeline = gr.skip()
                    if now - last_secondary >= 5 * figure_every:
                        last_secondary, rank, timeline = now, view.rank_figure(), view.timeline_figure()
                    if now - last_fate >= 10 * figure_every:
                        last_fate, fate = now, view.fate_html()
                    yield (run.texts[policy_name], ran + stats_markdown(view, now - run.started), view.retention_figure(),
                           rank, timeline, fate, *[gr.skip()] * 6)
                elif now - last_text >= TEXT_EVERY_S:
                    last_text = now
                    yield (run.texts[policy_name], *[gr.skip()] * 11)
            yield (*live_result(run, stopped=ticket.is_set(), ran=ran), gr.skip())
        except Exception as error:  # the run failed: say so, keep serving
            if ticket.is_set():
                stopped_run_failed("the stopped run", error)
                return
            raise unexpected("generation", error) from None
        finally:
            release_memory()

    return live_run


def live_result(run: Progress, stopped: bool = False, ran: str = "") -> tuple:
    """The Live tab once its run has ended or been stopped: every view, the scrubber and the trace's download
    (the views come whether or not the trace could be written); ``ran`` starts the stats (what ran)."""
    (label, view), = run.views.items()
    trace = run.trace(label)
    try:
        path = download_folder() / f"trace-{label}.parquet"
        trace.save(path)
    except Exception:  # noqa: BLE001 -- logged; a full disk costs the download only
        log.exception("saving the run's trace")
        path = None
    note = "**stopped** · " if stopped and not run.finished(label) else ""
    return finished_outputs(view, trace, run.texts[label],
                            ran + note + stats_markdown(view, time.perf_counter() - run.started), path)


def finished_outputs(view: RunView, trace: Trace, text: str, stats: str, path: Path | None) -> tuple:
    """The Live tab once a run is over (or a saved one is opened): every view, the scrubber, the download."""
    last_step = view.steps - 1
    note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over B with nothing evicted
    stats += f"  \n*{note}*" if note else ""
    return (text, stats, view.retention_figure(), view.rank_figure(), view.timeline_figure(), view.fate_html(),
            # a run that decoded no step (one new token) has nothing to scrub
            gr.update(maximum=max(last_step, 1), value=last_step, visible=last_step > 0, interactive=True),
            gr.update(value=str(path), visible=True) if path else gr.update(value=None, visible=False),
            diagnostics_markdown(trace), view, view.step_detail_figure(last_step))


NOT_RUN = "*Not run: the last click was refused (or stopped before it ran); below, the previous run.*  \n"


def mark_previous_run(view: RunView | None, stats: str):
    """A Live click that did not run: its last run's views stay (as a refused comparison's do), and its
    stats line says they are that run's, not these inputs'.  The next run or opened trace rewrites it."""
    if view is None or not isinstance(stats, str):
        return gr.skip()
    return NOT_RUN + stats.removeprefix(NOT_RUN)


def opened_length(trace: Trace, limits: Limits) -> int:
    """The new tokens an opened trace's views are sized for: what it asked for, as when its run ended (blank
    rows for what it did not generate), but never past what it generated plus this app's own limit -- a
    file's max_new_tokens is only a number in its metadata, and 10**9 would size every view in gigabytes.
    0 (a trace saved before it was recorded) reads as ending where it ended."""
    ran = len(trace.events)
    return max(ran, min(trace.max_new_tokens, ran + limits.max_new_tokens))


def make_open_handler(limits: Limits):
    """Show a saved trace (the Live tab's download, or ``kvviz generate --trace``) as if its run had just ended."""

    def open_trace(path):
        if not path:
            return (gr.skip(),) * 11
        try:
            trace = _checked_trace.pop(path, None) or load_trace(path, limits)  # an API call comes unchecked
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("opening the trace", error) from None
        try:
            tokens = None
            if trace.model in limits.models:  # the prompt's own token texts; other models' tokens show as ids
                tokens = token_texts(get_tokenizer(trace.model), trace.prompt_ids)
            spec = REGISTRY.get(trace.policy)
            policy = spec.build(**trace.params) if spec else None
            pinned, interval = (policy.pinned(trace.budget), checkpoint_interval(policy)) if policy else ((0, 0), None)
        except Exception:  # a model that fails to load, parameters this version refuses: the trace still shows
            log.warning("opening a trace of %s / %s: token texts or pinned bands left out", trace.model,
                        trace.policy, exc_info=True)
            tokens, pinned, interval, policy = None, (0, 0), None, None
        try:  # Trace.load checked what the views rely on; anything it missed is still one line, not "Error"
            view = RunView(trace.prompt_len, opened_length(trace, limits), trace.budget,
                           tokens or [f"⟨{i}⟩" for i in trace.prompt_ids], pinned, interval, terms_key(policy))
            for event in trace.events:
                view.add(event, event.text)
            params = ", ".join(f"{key}={value}" for key, value in trace.params.items())
            origin = (f"**opened** {Path(path).name}: `{trace.policy}`" + (f" ({params})" if params else "")
                      + run_note(trace) + f" · {budget_note(trace)}"
                      + ("" if tokens else " (prompt tokens shown as ids: that model is not loaded here)") + "  \n"
                      + ("**stopped** · " if trace.stopped else ""))
            text = "".join(event.text for event in trace.events)
            return finished_outputs(view, trace, text, origin + stats_markdown(view, None), None)
        except Exception as error:
            raise unexpected(f"showing {Path(path).name}", error) from None

    return open_trace


def make_reuse_handler(limits: Limits):
    """Set the Live controls to an opened trace's run, so that Run reruns it, or a variant once one is changed."""

    def check_reuse(path):
        """Its refusal before the handler, with no outputs: raised by the handler itself, every Live control it
        sets would show a bare "Error" over it.  The trace read is left for the handler, as check_trace does."""
        with refusing("using the trace's settings"):
            trace = load_trace(path, limits)
            refusal(trace, Path(path).name)
            _checked_trace.clear()
            _checked_trace[path] = trace

    def reuse_settings(path):
        with refusing("using the trace's settings"):  # what to change, or one line: never a bare "Error"
            return settings_of(_checked_trace.pop(path, None) or load_trace(path, limits), Path(path).name)

    def refusal(trace: Trace, name: str) -> None:
        if trace.model not in limits.models:
            raise ValueError(f"{name} ran on {trace.model or 'a model it does not name'}, which is not served "
                             f"here; start the app with `kvviz serve --models {trace.model or 'MODEL'}` to rerun it")
        if trace.policy not in REGISTRY:
            raise ValueError(f"{name} ran policy {trace.policy!r}, which this version does not have; "
                             f"choose one of {', '.join(REGISTRY)}")

    def settings_of(trace: Trace, name: str) -> tuple:
        refusal(trace, name)
        spec = REGISTRY[trace.policy]
        prompt, chat = trace.prompt, trace.chat
        if not prompt:  # recorded as token ids only: their text, with any chat template already in it
            tokenizer = get_tokenizer(trace.model)
            prompt, chat = tokenizer.decode(trace.prompt_ids, skip_special_tokens=False), False
            if engine.encode_prompt(tokenizer, prompt, chat=False) != trace.prompt_ids:
                gr.Warning(f"{name} records its prompt as token ids only, and their text does not tokenise back "
                           "to the same ids: a rerun reads a slightly different prompt")
        asked = trace.max_new_tokens or len(trace.events)  # 0: saved before it was recorded
        if asked > limits.max_new_tokens:
            gr.Warning(f"{name} asked for {asked} new tokens; {limits.max_new_tokens} is the most allowed here")
        widgets = _parameter_updates(spec, trace.params)
        by_ratio = trace.compression is not None
        sampling = trace.sampling or {"temperature": 0.0, "top_p": 0.95, "seed": 0}  # greedy: the widgets' start
        temperature = sampling["temperature"]
        if temperature > MAX_TEMPERATURE:  # run from the library; set as it is, Run would refuse it
            gr.Warning(f"{name} sampled at temperature {temperature:g}; {MAX_TEMPERATURE:g} is the most allowed here, "
                       "and the rerun is set to that")
            temperature = MAX_TEMPERATURE
        return (trace.model, prompt, bool(chat), trace.policy, "compression" if by_ratio else "budget",
                gr.update(value=trace.compression, visible=True) if by_ratio else gr.update(visible=False),
                gr.update(value=trace.budget, visible=not by_ratio),
                min(asked, limits.max_new_tokens), temperature, sampling["top_p"], sampling["seed"],
                _describe(trace.policy, trace.model, *[trace.params.get(key) for key in PARAM_NAMES]), *widgets)

    reuse_settings.check = check_reuse
    return reuse_settings


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


def scrub(view: RunView | None, step, follow: str = ""):
    """The views of one step: heatmaps (the tokens typed in Follow marked on the retention), step detail,
    prompt fates and the last decision's terms, and the scrubber set to that step where it was typed as
    another value (3.5, or past an end), so that the box says which step is shown.  The token history is not
    among them: it follows in a second event, which reads the Follow field as it is then (a field typed while
    this ran would otherwise be overwritten by a history of what it held before)."""
    if view is None or not view.events:
        return (gr.skip(),) * 8
    typed, step = step, scrubbed_step(view, step)
    try:
        as_shown = float(typed) == step
    except (TypeError, ValueError):
        as_shown = False
    if not as_shown and (note := scrub_note(view, typed, step)):
        gr.Warning(note)  # the box then reads the step shown; without a word, 2.5 became 2 unexplained
    return (view.retention_figure(step, typed_positions(view, follow, step)), view.rank_figure(step),
            view.timeline_figure(step),
            view.step_detail_figure(step), view.fate_html(step, prompt_only=False), *decision_views(view, step),
            gr.skip() if as_shown else gr.update(value=step))


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


def followed_views(view: RunView | None, follow: str, step) -> tuple:
    """What Follow changes: the token history, and the retention heatmap with the typed tokens marked (at the
    scrubbed step)."""
    if view is None or not view.events:
        return gr.skip(), gr.skip()
    step = scrubbed_step(view, step)
    history, marked = _history_and_marks(view, follow, step)
    return history, view.retention_figure(step, marked)


def step_views(view: RunView | None, follow: str, step) -> tuple:
    """What follows the scrubbed step besides the heatmaps: the token history, the last decision's terms,
    and the retention heatmap again where Follow has tokens typed to mark on it."""
    if view is None or not view.events:
        return None, "", gr.update(value=None, visible=False), gr.skip()
    step = scrubbed_step(view, step)
    history, marked = _history_and_marks(view, follow, step)
    return history, *decision_views(view, step), view.retention_figure(step, marked) if marked else gr.skip()


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
        frame[name] = frame[name].map(lambda value: "+inf" if value == np.inf else float(f"{value:.{digits}g}"))
    frame = frame.rename(columns={"position": "#"})
    return caption, gr.update(value=frame, visible=True, column_widths=fitted_column_widths(frame))


def fit_columns(frame: pd.DataFrame | None):
    """A table's change handler: its columns at :func:`fitted_column_widths` of what it now shows ('Spearman'
    and 'false-safe' broke mid-word in the probe's 600-px panel)."""
    return gr.update(column_widths=fitted_column_widths(frame)) if frame is not None and frame.shape[1] else gr.skip()


def fitted_column_widths(frame: pd.DataFrame) -> list[str]:
    """Widths (px) that hold each column's longest word, in its header or cells, unbroken: a cell wraps
    between its words ('kept (sink)'), a number does not wrap at all.  Where the panel is narrower than their
    sum the table scrolls sideways; given as percentages, numbers broke mid-digit instead."""
    def longest(column) -> int:
        return max(len(word) for text in (column, *frame[column]) for word in str(text).split() or [""])
    return [f"{9 * longest(column) + 16}px" for column in frame.columns]  # 16: the cell's padding


def make_compare_handler(limits: Limits):
    def compare_run(model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
                    temperature=0.0, top_p=1.0, seed=0, ticket_id="", tickets=None):
        yield from ticketed(ticket_id, tickets, 14, lambda ticket, made: compare_steps(
            ticket, made, model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
            temperature, top_p, seed))

    def compare_steps(ticket, made, model_name, prompt, names, budget_mode, compression, budget, max_new_tokens,
                      chat, temperature, top_p, seed):
        if made:  # as in the Live tab: /stop_compare reaches it from now on
            yield (*[gr.skip()] * 13, made)
        try:
            settings = compare_settings(names)
            repeated = repeats_note(names)  # shown above the divergence lines for the whole run
            request = validate(limits, model_name, prompt, budget_mode, compression, budget, max_new_tokens, chat,
                               list(build_policies(settings).values()), temperature, top_p, seed)
            # what the page marks "earlier inputs" against once they change: kept here, not read from the page
            # after the run, where a later click's comparison may already stand
            ran_inputs = compared_inputs(model_name, prompt, names, budget_mode, compression, budget,
                                         max_new_tokens, chat, temperature, top_p, seed)
            policies = build_policies(settings)  # fresh state
            names = list(settings)
            run = Progress.start(request, model_name, policies, token_texts(request.tokenizer, request.prompt_ids))
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("starting the comparison", error) from None
        last_figure = last_text = 0.0
        # Four panels a refresh: a quarter of the Live tab's rate.
        figure_every = 4 / limits.figures_per_second if limits.figures_per_second else math.inf
        # One empty panel per chosen policy, labelled, and what runs before the first token; the last
        # comparison's figures, download and state go now, not when this one ends.
        yield (*starting_panels(names), f"{repeated}\n\n{PREFILL.format(len(request.prompt_ids))}".lstrip(), None,
               gr.update(value=None, visible=False), None, None, gr.skip())
        try:
            # Sampled, every policy draws the same random stream: where their next-token distributions agree
            # they pick the same token, so the first divergence is still the eviction's doing.
            for name, event in engine.decode_many(request.model, request.tokenizer, request.prompt_ids, policies,
                                                  budget=request.budget, max_new_tokens=request.max_new_tokens,
                                                  sampler_args=request.sampling):
                run.add(name, event)
                if ticket.is_set() and run.level():  # every policy still decoding has made this step
                    break
                now = time.perf_counter()
                refresh = now - last_figure >= figure_every
                if not refresh and now - last_text < TEXT_EVERY_S:
                    continue  # each policy's event would otherwise be an update of its own
                if refresh:
                    last_figure = now
                last_text = now
                yield (*_compare_outputs(names, run.texts, run.views, figures=refresh, final=False, note=repeated),
                       gr.skip(), gr.skip())
            result = comparison_result(run, stopped=ticket.is_set(), note=repeated)
            yield (*result, {"inputs": ran_inputs, "note": result[8]}, gr.skip())
        except Exception as error:
            if ticket.is_set():
                stopped_run_failed("the stopped comparison", error)
                return
            raise unexpected("the comparison", error) from None
        finally:
            release_memory()

    return compare_run


PREFILL = "*prefill of the {}-token prompt…*"  # the status until a run's first tokens


LOADING = "*loading "  # how loading_note begins: Stop looks for it (stopped_while_loading)


def loading_note(model_name) -> str | None:
    """The status while a click's check loads ``model_name`` (its first run: tens of seconds for a real
    model), or None when it is loaded (or not one of ours: the check refuses it)."""
    return f"{LOADING}{model_name}…*" if isinstance(model_name, str) and model_name not in _models else None


def starting_panels(labels) -> list:
    """The Compare tab's text and figure panels as a comparison of ``labels`` starts: one empty, labelled
    panel each, the rest hidden."""
    texts = [gr.update(value="", label=labels[i], visible=True) if i < len(labels) else gr.update(value="", visible=False)
             for i in range(4)]
    return [*texts, *(gr.update(value=None, visible=i < len(labels)) for i in range(4))]


def placeholder_panels(entries, state) -> tuple:
    """Before any comparison, one empty panel per chosen setting, labelled with it (the page starts with
    three, which a four-policy preset left at three); once one has run, its panels stay until the next, and
    entries the run's check would refuse leave the panels as they are."""
    if state is not None:
        return (gr.skip(),) * 8
    try:
        labels = list(compare_settings(entries))
    except Exception:  # noqa: BLE001 -- the run's check says what is wrong with the entries
        return (gr.skip(),) * 8
    return tuple(starting_panels(labels))


def comparison_result(run: Progress, stopped: bool = False, note: str = "") -> tuple:
    """The Compare tab once its comparison has ended or been stopped: every panel, the divergence and
    Jaccard lines (after ``note``, :func:`repeats_note`'s) and the zip of its traces (shown whether or not
    that zip could be written)."""
    running = run.running()
    stop_note = (f"**stopped** after {run.views[running[0]].steps} of {run.max_new_tokens} tokens (runs that had "
                 "ended are whole)\n\n" if stopped and running else "")
    try:
        download = gr.update(value=str(save_comparison(run)), visible=True)
    except Exception:  # noqa: BLE001 -- logged; the figures, fates and diagnostics still come
        log.exception("saving the comparison's traces")
        download = gr.skip()
    outputs = list(_compare_outputs(list(run.views), run.texts, run.views, figures=True, final=True,
                                    download=download, note=note))
    outputs[8] = stop_note + outputs[8]  # the divergence lines
    return tuple(outputs)


def download_folder() -> Path:
    """A new folder for one run's download.  Only the newest KEEP_DOWNLOADS are kept: a long-running server
    would otherwise fill its disk (Gradio serves its own copy, expired by the Blocks' delete_cache)."""
    folders = sorted(DOWNLOADS.iterdir(), key=lambda path: path.stat().st_mtime)
    for old in folders[:max(0, len(folders) - KEEP_DOWNLOADS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=DOWNLOADS))


def save_comparison(run: Progress) -> Path:
    """Every compared run as its own trace (the Live tab's format, so each opens there), zipped in order;
    each file is named by its label and records the registry name and parameters that label stands for."""
    archive = download_folder() / "comparison.zip"
    with zipfile.ZipFile(archive, "w") as bundle, tempfile.TemporaryDirectory() as staging:
        for index, label in enumerate(run.views, start=1):
            # The index keeps names unique; 80 characters keep a long layer list under the file system's limit.
            path = Path(staging) / f"{index}-{re.sub(r'[^A-Za-z0-9.=_-]+', '_', label)[:80]}.parquet"
            run.trace(label).save(path)
            bundle.write(path, path.name)
    return archive


PANEL_TITLE_CHARS = 20  # what a quarter-width panel's title holds on a line


PROMPT_END_GAP = 14  # pixels between a Compare panel's title and its plot, where "prompt end" is written


def panel_title(name: str, view: RunView, followed: list[int] | None = None) -> list[str]:
    """The lines of a Compare panel's title: the setting's label, then the key in small print."""
    # Narrow columns: the policy's name, and the key in small print below it (not the Live tab's
    # long title, which ran past the panel's edge).
    key = "dark kept · pale evicted" + (" · green protected" if any(view.pinned) else "")
    key += " · red followed" if followed else ""
    key += f" · ended at step {view.ended}" if view.ended is not None else ""
    # A setting's label wrapped at its spaces: cut at the panel's edge, the part that tells two
    # settings apart ("... lambda_b=0", "... normalise=false") was the part lost.  The key in small print
    # holds about twice the characters, and wraps at its dots (four panels cut it at "· r").
    lines = textwrap.wrap(name, PANEL_TITLE_CHARS) or [name]
    keys = [""]
    for item in key.split(" · "):
        joined = f"{keys[-1]} · {item}" if keys[-1] else item
        keys[-1:] = [joined] if len(joined) <= 2 * PANEL_TITLE_CHARS or not keys[-1] else [keys[-1], item]
    return lines + [f"<span style='font-size:10px'>{line}</span>" for line in keys]


def compare_panel(name: str, view: RunView, followed: list[int] | None = None, title_lines: int = 0) -> go.Figure:
    """One policy's retention panel in the Compare tab, with the ``followed`` prompt positions drawn on a
    copy (the streaming figure that ``view`` reuses stays unmarked).  ``title_lines``: the most title lines
    of the panels shown beside it, so that every panel's plot starts at the same height (a label that
    wraps made one panel taller, its axes out of line with the others')."""
    figure = view.retention_figure(followed=followed)
    figure.update_traces(showscale=False, selector=dict(type="heatmap"))  # a narrow panel: its title is the key
    lines = panel_title(name, view, followed)
    rows = max(len(lines), title_lines) - 1
    # The title hangs from the top, with a gap above the plot for the "prompt end" label, which the key's
    # last line overlapped in a narrow panel
    height = 320 + 20 * rows + PROMPT_END_GAP
    figure.update_layout(title=dict(text="<br>".join(lines), yref="container", yanchor="top", y=1 - 18 / height,
                                    pad_t=0),
                         height=height, margin=dict(l=40, r=10, t=40 + 20 * rows + PROMPT_END_GAP, b=35,
                                                    autoexpand=True),
                         xaxis_title="position", yaxis_title="step")
    return figure


def compare_panels(views: dict[str, RunView], followed: list[int] | None = None) -> list[go.Figure]:
    """Every compared policy's panel (:func:`compare_panel`), their plots at one height and on the same
    position and step ranges: a run that ended early (end of sequence) drew its fewer steps over the panel's
    full height, and its cells read as larger than its neighbours'."""
    lines = max(len(panel_title(name, view, followed)) for name, view in views.items())
    panels = [compare_panel(name, view, followed, lines) for name, view in views.items()]
    cells = [next(trace for trace in panel.data if trace.type == "heatmap") for panel in panels]
    positions = max(len(cell.z[0]) * cell.dx if len(cell.z) else 0 for cell in cells)  # a binned cell spans dx
    steps = max(len(cell.z) * cell.dy for cell in cells)
    for panel in panels:
        panel.update_xaxes(range=[-0.5, positions - 0.5])
        panel.update_yaxes(range=step_range(steps)[::-1], autorange=False, dtick=step_dtick(steps))  # step 0 on top
    return panels


def ended_note(view: RunView) -> str:
    """``" · ended at step 12 (end of sequence)"`` for a run that produced its end of sequence, else ""."""
    return "" if view.ended is None else f" · ended at step {view.ended} (end of sequence)"


def compared_labels(views: dict[str, RunView]) -> list[str]:
    """The compared runs' panel labels: each setting, and where its run produced its end of sequence."""
    return [name + ended_note(view) for name, view in views.items()]


def compared_inputs(model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
                    temperature=0.0, top_p=1.0, seed=0) -> dict:
    """The Compare tab's inputs by the names the page gives them, those that decide what a comparison runs:
    the budget only when the cache is sized by it (ρ otherwise), top-p and the seed only when it samples."""
    inputs = {"model": model_name, "prompt": prompt, "policies": list(names or []), "cache size by": budget_mode,
              "max new tokens": max_new_tokens, "chat template": bool(chat), "temperature": temperature}
    if budget_mode == "budget":
        inputs["budget"] = budget
    else:
        inputs["compression ρ"] = compression
    try:
        sampled = float(temperature) > 0
    except (TypeError, ValueError):  # the check refuses it
        sampled = True
    if sampled:
        inputs["top-p"], inputs["seed"] = top_p, seed
    return inputs


def run_inputs(model_name, prompt, policy, budget_mode, compression, budget, max_new_tokens, chat, temperature=0.0,
               top_p=1.0, seed=0, *parameters) -> dict:
    """The Live tab's inputs by name, those that decide what a run runs (:func:`compared_inputs`'s, one policy
    and the parameters it uses; not the hidden widgets of other policies, which keep what picking those set)."""
    inputs = compared_inputs(model_name, prompt, [policy], budget_mode, compression, budget, max_new_tokens, chat,
                             temperature, top_p, seed)
    values = dict(zip(PARAM_NAMES, parameters))
    if isinstance(policy, str) and policy in REGISTRY:  # an unknown one: the check refuses it
        values = used_parameters(REGISTRY[policy], values)
    return {("policy" if name == "policies" else name): (policy if name == "policies" else value)
            for name, value in inputs.items()} | {"policy parameters": values}


def earlier_inputs(changed: list[str], since: str, again: str) -> str:
    """The mark over a result whose inputs have changed since it was made (the Live tab's run, the Compare
    tab's comparison, probe and spectrum): which changed, and what makes one of the current inputs."""
    return f"**Earlier inputs: the {', '.join(changed)} changed since this {since}; {again} for the current ones.**"


def earlier_run_note(ran: dict | None, view, stats, *inputs):
    """The Live tab's stats once its inputs change after a run (``ran``: the inputs it ran on and its stats):
    the inputs that changed named above them, as the Compare tab marks its comparison, so that the views are
    not read as these inputs' run; set back, the stats as they were.  A refused click's note says it already."""
    if not ran or view is None or not isinstance(stats, str) or stats.startswith(NOT_RUN):
        return gr.skip()
    changed = changed_inputs(ran["inputs"], run_inputs(*inputs))
    if "policy" in changed:  # another policy has other parameters: the policy says it
        changed = [name for name in changed if name != "policy parameters"]
    return (earlier_inputs(changed, "run", "run again") + "  \n" if changed else "") + ran["note"]


def changed_inputs(then: dict, now: dict) -> list[str]:
    """The names of :func:`compared_inputs` that differ (one that applies on one side only, such as the budget
    after a switch from ρ, is named by the switch: "cache size by", "temperature")."""
    return [name for name in now if name in then and then[name] != now[name]]


def _compare_outputs(names, texts, views, figures: bool, final: bool, download=None, note: str = ""):
    slots = 4
    out = []
    for i in range(slots):
        out.append(gr.update(value=texts[names[i]], label=names[i] + ended_note(views[names[i]]), visible=True)
                   if i < len(names)
                   else gr.update(value="", visible=False))
    panels = compare_panels({name: views[name] for name in names}) if figures and names else []
    for i in range(slots):
        if i < len(names) and figures:
            out.append(gr.update(value=panels[i], visible=True))
        else:
            out.append(gr.skip() if i < len(names) else gr.update(visible=False))
    if figures or final:
        out.append(f"{note}\n\n{divergence_markdown(names, views)}" if note else divergence_markdown(names, views))
        out.append(jaccard_figure(names, views))
    else:
        out += [gr.skip(), gr.skip()]
    out.append(download if download is not None else gr.skip())
    out.append(views if final else gr.skip())
    return tuple(out)


def divergence_markdown(names, views) -> str:
    """The comparison's sizes (L0, B and what each policy's cache reached while decoding, over B where it
    checkpoints or evicted at the prefill only), then where each policy's text first left the first's."""
    tokens = {n: [e.new_token_id for e in views[n].events] for n in names}
    reference = names[0]
    first_view = views[reference]
    held = ", ".join(f"{name} {max(e.cache_size for e in views[name].events[1:])}" for name in names
                     if len(views[name].events) > 1)
    lines = [f"**prompt** {first_view.prompt_len} tokens · **budget** B = {first_view.budget}"
             + (f" · **largest cache while decoding**: {held}" if held else "")]
    for name in names[1:]:
        a, b = tokens[reference], tokens[name]
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        lines.append(f"- **{name}** vs **{reference}**: " + (
            f"first different token at step {first}" if first is not None else
            f"identical for the {count} token{'s' * (count != 1)} both produced"
            if (count := min(len(a), len(b))) else "no token from both yet"))
    # A run that ended early has no later steps to compare: its panel is shorter, its fates end there
    lines += [f"- **{name}** ended at step {views[name].ended}: it produced its end of sequence"
              for name in names if views[name].ended is not None]
    return "\n".join(lines)


def jaccard_figure(names, views) -> go.Figure:
    fig = go.Figure()
    reference = names[0]
    for name in names[1:]:
        pairs = diagnostics.keep_set_jaccard_over_time(
            Trace([], 0, reference, events=views[reference].events), Trace([], 0, name, events=views[name].events))
        fig.add_scatter(x=[s for s, _ in pairs], y=[j for _, j in pairs], name=f"{name} vs {reference}")
    steps = max(view.steps for view in views.values())
    # the legend under the plot, a pair a line: beside it, four long settings' pairs left the plot 60 px wide
    pairs = len(names) - 1
    fig.update_layout(title="Jaccard of the keep sets over time", xaxis_title="decode step", yaxis_title="Jaccard",
                      xaxis_dtick=step_dtick(steps), yaxis_range=[0, 1.02], height=300 + LEGEND_LINE * pairs,
                      margin=dict(l=50, r=20, t=40, b=80 + LEGEND_LINE * pairs), showlegend=True,
                      legend=dict(orientation="v", yanchor="top", y=-0.3, x=0))
    if steps <= 10:  # the steps there are: a comparison stopped at the prefill autoranged to steps -1 to 1
        fig.update_xaxes(range=step_range(steps))
    return fig


def compare_diagnostics(views: dict[str, RunView] | None):
    """InertiaKV Appendix I's stability diagnostics side by side, a column per compared policy: raw and utility
    top-B churn, keep turnover, raw/utility Jaccard, the share of each step's raw top-B that it evicted and
    the raw and utility rank stabilities (means over steps, k = the budget; n/a where a policy records no raw
    score or no utility), as the Live tab lists them: a row per diagnostic, a column per policy, and a last
    row counting the steps the raw rows average over."""
    if not views:
        return gr.update(value=None, visible=False)
    columns = {}
    for name, view in views.items():
        # the diagnostics read the budget and the decode events only; the prompt's ids are not kept here
        trace = Trace([0] * view.prompt_len, view.budget, name, events=view.events)
        values = diagnostic_rows(trace)
        columns.setdefault("diagnostic", list(values))
        columns[name] = list(values.values())
    # a column per policy (at most four), a row per diagnostic: the eight diagnostics as columns scrolled sideways
    return gr.update(value=pd.DataFrame(columns), visible=True, column_widths=column_widths(36, others=len(columns) - 1))


def column_widths(*first: float, others: int) -> list[str]:
    """Widths of a table with ``first`` columns (percent) and then ``others`` columns (one per compared
    policy, or per term) that share the rest: left to the browser, a 1000-px window showed the first policy's
    column and hid the others past the table's edge (scrolled sideways; Gradio 6 ignores ``pinned_columns``,
    so the columns that say which row it is went out of view too)."""
    rest = (100 - sum(first)) / others
    return [f"{width:g}%" for width in first] + [f"{rest:.4g}%"] * others


def followed_prompt_tokens(views: dict[str, RunView], query: str) -> tuple[list[int], str]:
    """The prompt positions a comparison follows, and how they were found: those ``query`` names, or with
    nothing typed those some policies keep to the end and others evict (the first MAX_FOLLOWED)."""
    names = list(views)
    first = views[names[0]]
    if (query or "").strip():
        return first.follow(query, first.steps - 1, prompt_only=True)
    cached = np.array([views[name].left[:first.prompt_len] == NEVER for name in names])  # kept to the end
    disputed = np.flatnonzero(cached.any(0) & ~cached.all(0)).tolist()
    note = (f"{len(disputed)} prompt tokens some policies keep to the end and others evict"
            + (f" (the first {MAX_FOLLOWED})" if len(disputed) > MAX_FOLLOWED else "")
            if disputed else "the policies keep the same prompt tokens to the end")
    return disputed[:MAX_FOLLOWED], note


def compare_fates(views: dict[str, RunView] | None, query: str, followed: tuple | None = None) -> tuple:
    """For each followed prompt token, what each compared policy did with it: kept to the end, or the step
    that evicted it.  With nothing typed: the prompt tokens the policies disagree on at the end.
    ``followed``: :func:`followed_prompt_tokens` of ``query``, where the caller has it already."""
    if not views:
        # also while one runs (its state is set as it ends)
        return "*The fates show once a comparison has ended: follow the prompt tokens that matter (e.g. the " \
            "needle).*", \
            gr.update(value=None, visible=False)
    positions, note = followed or followed_prompt_tokens(views, query)
    if not positions:
        return f"*{note}*", gr.update(value=None, visible=False)
    names = list(views)
    first = views[names[0]]
    fates = {name: [views[name].evicted_at(p) for p in positions] for name in names}
    # Runs that diverge end at different steps: each column says how far its "kept" reaches.
    # "#", as positions are typed (#12): a word header broke mid-word in a column as wide as its values
    frame = pd.DataFrame({"#": positions, "token": [first.token_cell(p) for p in positions],
                          **{f"{name} (to step {views[name].steps - 1})":
                             ["kept" if step is None else f"evicted at step {step}" for step in steps]
                             for name, steps in fates.items()}})
    kept_counts = ", ".join(f"**{name}** {sum(step is None for step in steps)}" for name, steps in fates.items())
    marked = " Marked in red on the retention panels." if (query or "").strip() else ""
    ends = {name: views[name].steps - 1 for name in names}
    # A run that ended early (its end-of-sequence, as sampling often draws) had fewer steps in which to evict
    horizon = min(ends.values())  # where every run was still going: the counts that compare like with like
    uneven = ("" if len(set(ends.values())) == 1 else " The runs ended at different steps ("
              + ", ".join(f"{name} {end}" for name, end in ends.items())
              + "): each policy's count here, and its stability column, cover its own run only. Still kept at "
              f"step {horizon}, where the shortest ended: "
              + ", ".join(f"**{name}** {sum(step is None or step > horizon for step in steps)}"
                          for name, steps in fates.items()) + ".")
    return f"Followed: {note}. Kept to the end, of {len(positions)}: {kept_counts}.{marked}{uneven}", \
        gr.update(value=frame, visible=True, column_widths=column_widths(9, 21, others=len(names)))


def compare_follow(views: dict[str, RunView] | None, query: str) -> tuple:
    """The fates table (:func:`compare_fates`) and the four retention panels with the same tokens marked;
    the panels are left alone while no comparison has ended (one decoding draws them)."""
    if not views:
        return (*compare_fates(views, query), *[gr.skip()] * 4)
    followed = followed_prompt_tokens(views, query)
    # Only what was typed: the disputed tokens listed when nothing is are mostly the chat template's, in a
    # clump at the start that hid the panels' left edge.
    marked = followed[0] if (query or "").strip() else []
    panels = [gr.update(value=panel) for panel in compare_panels(views, marked)]
    return (*compare_fates(views, query, followed), *panels, *[gr.skip()] * (4 - len(panels)))


class Staleness:
    """Marks an on-demand analysis (the probe, the spectrum) whose inputs have changed since it ran.

    The probe and the spectrum read the Compare tab's model, prompt and policies but run on their own button;
    after a new prompt or a new Compare their last result would otherwise sit under the new runs as if it were
    theirs.  :meth:`remember` keeps the inputs a result was made from (and its note); :meth:`mark` compares
    them with the current ones and, where any differ, names them in the note and on each output's label.
    """

    def __init__(self, what: str, fields: list[str], labels: list[str]):
        self.what, self.fields, self.labels = what, fields, labels

    @staticmethod
    def _key(value):
        return tuple(value) if isinstance(value, list) else value

    def remember(self, *values) -> dict:
        *inputs, note = values
        return {"inputs": [self._key(v) for v in inputs], "note": note}

    def mark(self, state: dict | None, *inputs) -> tuple:
        if not state:  # nothing run yet: nothing to mark
            return (gr.update(),) * (1 + len(self.labels))
        changed = [field for field, then, now in zip(self.fields, state["inputs"], inputs) if then != self._key(now)]
        if not changed:
            return (state["note"], *(gr.update(label=label) for label in self.labels))
        mark = earlier_inputs(changed, f"{self.what} ran", "run it again")
        return (f"{mark} {state['note']}", *(gr.update(label=f"{label} (earlier inputs)") for label in self.labels))


def make_generate_api(limits: Limits):
    def generate(prompt: str, policy: str = "inertia", compression: float = 0.9, max_new_tokens: int = 64,
                 chat: bool = True, model: str = "", params: str = "{}", budget: int = 0, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> Iterator[dict]:
        """Stream one generation as JSON: per step the text so far and the kept and evicted positions.

        ``budget`` > 0 sizes the cache in tokens instead of ``compression`` (it may exceed the prompt: eviction
        then starts once generation fills it).  ``temperature`` > 0 samples (with ``top_p`` and ``seed``).
        """
        try:
            # the JSON text the signature asks for; an object sent as itself means the same
            if not isinstance(params, (dict, str)) and params is not None:
                raise ValueError(f"params must be a JSON object of policy parameters, got {kind(params)} "
                                 f"({excerpt(params)})")
            values = params if isinstance(params, dict) else json.loads(params or "{}")
            if not isinstance(values, dict):
                raise ValueError("params must be a JSON object of policy parameters")
            policy_obj = policy_from_inputs(policy, values, strict=True)
            by_budget = budget not in (None, 0)
            request = validate(limits, model or limits.models[0], prompt, "budget" if by_budget else "compression",
                               compression, budget, max_new_tokens, chat, [policy_obj], temperature, top_p, seed,
                               backend=limits.backend)
            policy_obj = policy_from_inputs(policy, values, strict=True)  # fresh state
        except json.JSONDecodeError as error:
            raise refused(f"params is not valid JSON ({error}); send an object such as "
                          '{"alpha": 0.9}') from None
        except RecursionError:  # JSON nested thousands deep: no policy parameter is
            raise refused('params is nested too deeply; send a flat object such as {"alpha": 0.9}') from None
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("starting the run", error) from None
        text = ""
        try:
            for event in request.events(policy_obj, limits.backend):
                text += event.text
                yield {"step": event.step, "text": text, "token_id": event.new_token_id, "budget": request.budget,
                       "prompt_len": len(request.prompt_ids), "kept": event.kept.tolist(),
                       "evicted": event.evicted.tolist()}
        except Exception as error:
            raise unexpected("generation", error) from None
        finally:
            release_memory()

    return generate


# ----------------------------------------------------------------------------------------- layout

def past_end_note(label: str, low: float, high: float):
    """A slider's release handler: a value typed past an end, or a box left empty, is set to that end (the
    lowest, for an empty box) by the browser, and a run then goes ahead with it; say so."""
    def note(value) -> None:
        if value is None:
            gr.Warning(f"{label} was left empty: it was set to {low:g}, its lowest; type the value you want")
        elif isinstance(value, (int, float)) and not low <= value <= high:
            gr.Warning(f"{label} goes from {low:g} to {high:g}: {value:g} was set to {min(max(value, low), high):g}")
    return note


def parameter_past_end_note(name: str):
    """The release handler of a policy parameter's shared slider, whose range is the chosen policy's."""
    def note(policy_name: str, value) -> None:
        spec = REGISTRY.get(policy_name)
        own = {p["name"]: p for p in spec.parameters()} if spec else {}
        if name in own and own[name].get("low") is not None:
            past_end_note(f"{spec.name}'s {name}", own[name]["low"], own[name]["high"])(value)
    return note


def _parameter_widget(p: dict):
    label = f"{p['name']}: {p.get('help', '')}"
    if p.get("choices"):
        return gr.Dropdown(list(p["choices"]), value=p["default"], label=label, visible=False)
    if isinstance(p["default"], bool):
        return gr.Checkbox(value=p["default"], label=label, visible=False)
    if p.get("low") is not None:
        step = 1 if isinstance(p["default"], int) else 0.01
        return TypedSlider(p["low"], p["high"], value=p["default"], step=step, label=label, visible=False)
    return gr.Textbox(value=str(p["default"]), label=label, visible=False)


def pick_example(choice: gr.SelectData) -> str:
    """The prompt of the example just picked (also the one already shown, after its text was edited)."""
    return EXAMPLES.get(choice.value, gr.skip())


def make_preset_handler(limits: Limits):
    def preset_chosen(name: str, model_name: str, prompt: str, chat: bool, mode: str = "compression",
                      new_tokens=None, temperature=None, top_p=None) -> tuple:
        """A comparison from the papers chosen: its policies and, for AvoKV-E's, the settings of its regime
        (:data:`REASONING_PRESETS`), with a line saying what was set; the others undo what an AvoKV-E preset
        set (each value still as it left it) and leave the user's own.  Returns the Policies box, the prompt,
        the cache-size mode, B, max new tokens, temperature, top-p and the line."""
        if name not in COMPARISONS:
            return (gr.skip(),) * 8
        if name not in REASONING_PRESETS:
            return compression_regime(name, prompt, mode, new_tokens, temperature, top_p)
        if prompt in EXAMPLES.values():  # an example, not the user's own text: the reasoning one
            prompt = EXAMPLES["Short reasoning"]
        try:
            loaded = _models.get(model_name)
            tokenizer = loaded[1] if loaded else load_tokenizer(model_name)
            prompt_len = len(engine.encode_prompt(tokenizer, prompt, chat=bool(chat)))
        except Exception as error:  # noqa: BLE001 -- the policies are still set; the rest is said to be left
            log.warning("sizing the %s preset for %s", name, model_name, exc_info=True)
            return COMPARISONS[name], *(gr.skip(),) * 6, (
                f"*Could not count the prompt's tokens ({type(error).__name__}), so the cache was left as it was: "
                "AvoKV-E's regime is a budget above the prompt.*")
        budget, new_tokens = prompt_len + REASONING_HEADROOM, min(REASONING_NEW_TOKENS, limits.max_new_tokens)
        note = (f"{REGIME_SET}: budget B = {budget} ({prompt_len}-token prompt + {REASONING_HEADROOM}), "
                f"so eviction starts once generation fills it; {new_tokens} new tokens; sampled at temperature "
                f"{REASONING_SAMPLING['temperature']}, top-p {REASONING_SAMPLING['top_p']}, as the paper does.*")
        return (COMPARISONS[name], prompt, "budget", budget, new_tokens, REASONING_SAMPLING["temperature"],
                REASONING_SAMPLING["top_p"], note)

    def compression_regime(name: str, prompt: str, mode: str, new_tokens, temperature, top_p) -> tuple:
        sampled = (temperature, top_p) == tuple(REASONING_SAMPLING.values())
        prompt_back = prompt == EXAMPLES["Short reasoning"]
        tokens_back = new_tokens == min(REASONING_NEW_TOKENS, limits.max_new_tokens)
        undone = {"the cache sized by compression ρ": mode != "compression",
                  f"the {COMPARE_EXAMPLE.lower()} prompt": prompt_back,
                  f"{COMPARE_NEW_TOKENS} new tokens": tokens_back, "greedy decoding": sampled}
        said = [what for what, back in undone.items() if back]
        note = f"*Back to the prompt-compression regime InertiaKV runs: {', '.join(said)}, as the tab starts.*" \
            if said else ""
        return (COMPARISONS[name], EXAMPLES[COMPARE_EXAMPLE] if prompt_back else gr.skip(), "compression",
                gr.skip(), COMPARE_NEW_TOKENS if tokens_back else gr.skip(), 0.0 if sampled else gr.skip(),
                gr.skip(), note)

    return preset_chosen


REGIME_SET = "*Set to AvoKV-E's regime"  # how an AvoKV-E preset's note begins


def preset_regime(note, model_name, prompt, chat, mode, budget, new_tokens, temperature, top_p) -> dict | None:
    """What an AvoKV-E preset just set (the inputs after it, and its note), for :func:`preset_note_after_edit`;
    None after any other preset, which sets no regime to keep."""
    if not isinstance(note, str) or not note.startswith(REGIME_SET):
        return None
    return {"note": note, "set": [model_name, prompt, bool(chat), mode, budget, new_tokens, temperature, top_p]}


def preset_note_after_edit(regime: dict | None, model_name, prompt, chat, mode, budget, new_tokens, temperature,
                           top_p):
    """An input changed by hand after an AvoKV-E preset set its regime (``regime``: :func:`preset_regime`): its
    note says what no longer holds, against what the preset set, and how to get it back; with every input
    back as the preset left it, the preset's own note.  Nothing after any other preset."""
    if not regime:
        return gr.skip()
    set_model, set_prompt, set_chat, _, set_budget, set_tokens, set_temperature, set_top_p = regime["set"]
    changed = []
    if (model_name, prompt, bool(chat)) != (set_model, set_prompt, set_chat):
        # a longer prompt over B is the regime the preset left
        changed.append("the prompt's tokens (its text, the model or the chat template), which B was sized to: "
                       "keep B above them (counted under the prompt)")
    if mode != "budget":
        changed.append("the cache is sized by ρ, a share of the prompt, not by a budget above it")
    elif budget != set_budget:
        changed.append(f"B = {budget} (the preset's {set_budget})")
    if new_tokens != set_tokens:
        changed.append(f"{new_tokens} new tokens (the preset's {set_tokens})")
    if (temperature, top_p) != (set_temperature, set_top_p):
        changed.append(f"temperature {temperature}, top-p {top_p} (the paper's {set_temperature}, {set_top_p})")
    if not changed:
        return regime["note"]
    return (f"*Changed by hand since the AvoKV-E preset set its regime: {'; '.join(changed)}. Choose the preset "
            "again to set it back.*")


def make_prompt_counter(limits: Limits):
    def count_tokens(model_name: str, prompt: str, chat: bool) -> str:
        """The prompt's length in the model's tokens, before Run (once the model is loaded: no load here)."""
        if not isinstance(prompt, str) or not prompt.strip():
            return "*empty prompt*"
        loaded = _models.get(model_name or "")
        if loaded is None:
            return f"*the token count shows once {model_name} is loaded (at its first run)*"
        try:
            check_prompt_text(prompt)
            tokens = len(engine.encode_prompt(loaded[1], prompt, chat=bool(chat)))
        except ValueError as error:
            return f"*{error}*"
        except Exception:  # noqa: BLE001 -- a count is a hint: Run's check says what is wrong with the prompt
            log.warning("counting the prompt's tokens failed", exc_info=True)
            return "*the token count failed; Run checks the prompt*"
        over = f": over the limit of {limits.max_prompt_tokens}, shorten it" if tokens > limits.max_prompt_tokens \
            else f" (limit {limits.max_prompt_tokens})"
        return f"*{tokens} tokens{over}*"

    return count_tokens


def _show_parameters(policy_name: str, model_name: str | None = None):
    spec = REGISTRY.get(policy_name)
    return [_describe(policy_name, model_name)] + \
        (_parameter_updates(spec) if spec else [gr.update(visible=False)] * len(PARAM_NAMES))


def _parameter_updates(spec, values: dict | None = None) -> list:
    """Every shared parameter widget set for ``spec``: its own shown at ``values`` (its defaults where absent),
    less those the values leave unused, and the others hidden."""
    values = values or {}
    own = {p["name"]: p for p in spec.parameters()}
    unused = unused_parameters(spec, values) or {}
    return [_parameter_update(own[name], visible=name not in unused, value=values.get(name, own[name]["default"]))
            if name in own else gr.update(visible=False) for name in PARAM_NAMES]


def _show_parameters_in_use(policy_name: str, *param_values):
    """Hide the parameters that the chosen settings leave unused (cumulative's alpha, a decoupled EMA's last_k
    under the mean of all layers) and show again those that are used.  Values stay as they are: a run leaves
    out the hidden ones (policy_from_inputs), and one shown again holds what it held (single-step's alpha
    0 after aggregation sum and back to ema)."""
    spec = REGISTRY.get(policy_name)
    unused = unused_parameters(spec, dict(zip(PARAM_NAMES, param_values))) if spec else None
    if unused is None:
        return [gr.skip()] * len(PARAM_NAMES)
    own = {p["name"] for p in spec.parameters()}
    return [gr.update(visible=name not in unused) if name in own else gr.skip() for name in PARAM_NAMES]


def _describe(policy_name: str, model_name: str | None = None, *param_values) -> str:
    """The policy's description, with the previous-step weight its current parameters give on the loaded model.

    Parameters that make it another registry entry (InertiaKV with aggregation sum is cumulative, with alpha 0
    single-step) describe that entry, named as the Compare tab would name the setting."""
    spec = REGISTRY.get(policy_name)
    if spec is None:
        return ""
    try:
        policy = policy_from_inputs(policy_name, dict(zip(PARAM_NAMES, param_values))) if param_values \
            else spec.build()
    except ValueError:
        policy = None  # a value being typed; Run reports it
    label = setting_label(policy) if policy is not None else policy_name
    named = REGISTRY.get(label.split()[0], spec)
    description = (f"These settings are **{label}**: " if named is not spec else "") + \
        f"**{named.display}**" + (f" ({named.family})" if named.family != named.display else "") + \
        f". {named.description}" + (f" *{named.paper}*." if named.paper else "")
    if policy is not None:  # the entry's text describes its own values: say which of them these settings change
        params = policy.params()
        changed = [f"`{p['name']}` = **{shown_value(params[p['name']])}**, not {shown_value(p['default'])} "
                   f"({p.get('help', '')})" for p in named.parameters() if params[p["name"]] != p["default"]]
        if changed:
            description += " Changed here: " + "; ".join(changed) + "."
    loaded = _models.get(model_name or "")
    if loaded and policy is not None:  # how much memory across steps this rule keeps on the model in use
        weight = policy.previous_step_weight(loaded[0].config.num_hidden_layers)
        if weight is not None:
            description += f" Previous-step weight on {model_name} with these parameters: **{weight:.3g}**."
    return description


def _parameter_update(p: dict, visible: bool = True, value=None):
    """Show a shared widget with this policy's help text, range and ``value`` (its default where None), or
    set it so, hidden."""
    update = {"visible": visible, "value": p["default"] if value is None else value,
              "label": f"{p['name']}: {p.get('help', '')}"}
    if p.get("choices"):
        update["choices"] = list(p["choices"])
    elif p.get("low") is not None and not isinstance(p["default"], bool):
        update.update(minimum=p["low"], maximum=p["high"])
    return gr.update(**update)


def sampling_label(temperature, top_p) -> str:
    """The Sampling accordion's title: greedy at temperature 0, else the temperature and top-p."""
    try:
        temperature, top_p = float(temperature), float(top_p)
    except (TypeError, ValueError):  # a value being typed: the run's check will say what is wrong
        return "Sampling"
    return ("Sampling (temperature 0: greedy)" if temperature == 0 else
            f"Sampling (temperature {temperature:g}, top-p {top_p:g})")


def _run_settings(limits: Limits, compression: float, max_new_tokens: int):
    """Cache size (by compression or absolute budget), max new tokens and chat template, wired together."""
    mode = gr.Radio(["compression", "budget"], value="compression", label="Cache size by")
    rho = TypedSlider(0.0, 0.99, value=compression, step=0.01, label="Compression ρ: B = ⌊(1−ρ)·L0⌋")
    # precision None: a fraction typed reaches whole_number, which refuses it (precision 0 rounded it silently)
    budget = gr.Number(value=256, label="Budget B (tokens)", visible=False)
    max_new = TypedSlider(1, limits.max_new_tokens, value=min(max_new_tokens, limits.max_new_tokens), step=1,
                          label="Max new tokens")
    chat = gr.Checkbox(value=True, label="Chat template")
    with gr.Accordion(sampling_label(0.0, 0.95), open=False) as sampling:
        temperature = TypedSlider(0.0, MAX_TEMPERATURE, value=0.0, step=0.05,
                                  label="Temperature (AvoKV-E samples at 0.6)")
        top_p = TypedSlider(0.05, 1.0, value=0.95, step=0.01, label="Top-p")
        seed = gr.Number(value=0, label="Seed (the same random stream for every policy)")
    # The closed accordion's title says how the run will decode, however the values were set (a preset sets them)
    for control in (temperature, top_p):
        control.change(lambda t, p: gr.update(label=sampling_label(t, p)), [temperature, top_p], sampling,
                       api_name=False, queue=False, show_progress="hidden")
    for slider, label in ((rho, "Compression ρ"), (max_new, "Max new tokens"), (temperature, "Temperature"),
                          (top_p, "Top-p")):
        # queued: an unqueued event cannot show a toast
        slider.release(past_end_note(label, slider.minimum, slider.maximum), slider, None, api_name=False,
                       show_progress="hidden")
    mode.change(lambda value: (gr.update(visible=value == "compression"), gr.update(visible=value == "budget")),
                mode, [rho, budget], api_name=False)
    return mode, rho, budget, max_new, chat, temperature, top_p, seed


def stoppable_run(limits: Limits, run_button, stop_button, check, handler, inputs: list, outputs: list, name: str,
                  progress_on, announce=None) -> tuple:
    """A Run button and its Stop (the Live tab's, the Compare tab's): the events ``/{name}`` and ``/stop_{name}``.

    The click first takes a ticket, the run's stop switch (a click while the session's run is pending ends
    there), then checks the inputs, then runs in the models' concurrency group.  The run goes by its click's
    ticket (sent in a hidden field), is ``always_last`` (a click after Stop waits for the stopped run to show
    itself, where Gradio's default would drop it), and a failed check or run retires the click's ticket.
    Stop, unqueued so that a full queue cannot hold it up, sets the session's tickets: a decoding run ends
    before its next step and shows what ran; one being checked or waiting in the queue is cancelled (through
    a hidden field's change, never a decoding one).  ``announce`` (function, inputs, outputs), unqueued, says
    what the click waits for (a model's first load) before the check starts.  Returns the check's and the
    run's events."""
    tickets, ticket_id = gr.State(None), gr.Textbox("", visible=False)  # "": an API call
    # A refusal's toast stays until closed (refused()); the next click closes it, so that it never sits over
    # a run that then goes ahead, and any warning about the inputs, which the check says again where it holds
    # (else a refused typed setting showed twice, as the warning it got when typed and as the refusal).
    run_button.click(None, None, None, js=CLOSE_TOASTS, queue=False, api_name=False)
    taken = run_button.click(button_ticket, tickets, [tickets, ticket_id], queue=False, api_name=False)
    if announce:
        taken.success(*announce, api_name=False, queue=False, show_progress="hidden")
    # Checks run side by side (concurrency_limit=None): one session's first load of a model must not hold up
    # every other session's check; the runs themselves share the "model" group's limit.
    checked = taken.success(check, inputs, None, api_name=False, show_progress_on=progress_on, concurrency_limit=None)
    checked.failure(retire, tickets, None, queue=False, api_name=False)
    running = checked.success(handler, [*inputs, ticket_id, tickets], [*outputs, tickets],
                              concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name=name,
                              trigger_mode="always_last", api_visibility="undocumented")
    running.failure(retire, tickets, None, queue=False, api_name=False)
    cancel = gr.Number(0, visible=False)
    stop_button.click(request_stop, tickets, cancel, queue=False, api_name=f"stop_{name}",
                      api_visibility="undocumented", cancels=[checked])
    cancel.change(None, cancels=[running])
    if announce:  # the line saying what the click waited for would otherwise stay
        outputs = announce[2]
        note = outputs[0] if isinstance(outputs, (list, tuple)) else outputs
        cancel.change(stopped_while_loading, note, note, api_name=False, queue=False, show_progress="hidden")
    return checked, running


def stopped_while_loading(note):
    """Stop before the run started, while ``note`` (a Markdown status) says that a model loads: that line
    gives way to saying the run was stopped (the load may still finish in the background, for the next
    click).  Any other note is left as it is."""
    if not isinstance(note, str) or LOADING not in note:
        return gr.skip()
    kept = [line for line in note.split("\n") if not line.startswith(LOADING)]
    return "\n".join([*kept, "*Stopped before the run started.*"]).strip()


# A chosen name longer than its box (the Compare tab's presets beside the views) ran under the box's arrow,
# cut mid-word: it ends in an ellipsis before the arrow instead, and the open list shows it whole.  A style
# in the page rather than launch(css=...), so that every way the app is launched gets it.
APP_CSS = ".secondary-wrap input { text-overflow: ellipsis; padding-right: 24px !important; }"


def build_landing(landing: Landing) -> None:
    """The Start-here tab: the shipped comparison's sentence, and each policy's answer over its heatmap with
    the needle's columns in red."""
    gr.Markdown(landing.summary(), elem_id="landing-summary")
    panels = compare_panels(landing.views, followed=landing.needle_positions)
    with gr.Row():
        for (label, trace), panel in zip(landing.traces.items(), panels):
            with gr.Column(min_width=300):
                gr.Textbox(landing.answer(label), label=f"{landing.display(label)} answered", interactive=False,
                           elem_classes=["landing-answer"])
                gr.Plot(panel, show_label=False)
    gr.Markdown("Run it yourself: the Live tab starts on this prompt with InertiaKV, and the Compare tab runs "
                "any policies side by side.")


def build_app(limits: Limits | None = None, store: Store | None = None, warm: bool = False) -> gr.Blocks:
    """The whole app; ``warm`` (the served app) draws the Results tab's default figures as it is built."""
    limits = limits or Limits.from_env()
    policy_choices = [(f"{s.display} ({s.name})", s.name) for s in REGISTRY.values()]
    # Gradio's copies of the downloads expire after two hours, checked hourly (else they pile up for good).
    with gr.Blocks(title="kvviz", delete_cache=(3600, 7200)) as app:
        # the style travels with the heading: an element of its own took a row's gap of the page
        gr.Markdown("# kvviz\nWatch what a KV-cache eviction policy keeps and drops while the model decodes."
                    f"<style>{APP_CSS}</style>", sanitize_html=False)
        landing = load_landing()
        if landing is not None:  # the first thing a visitor sees: eviction changing an answer, no model loaded
            with gr.Tab("Start here", elem_id="start-here"):
                build_landing(landing)
        with gr.Tab("Live") as live_tab:
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(label="Prompt", lines=8, value=EXAMPLES["Passkey in a haystack"])
                    prompt_size = gr.Markdown()
                    example = gr.Dropdown(list(EXAMPLES), label="Examples", value="Passkey in a haystack")
                    model = gr.Dropdown(list(limits.models), value=limits.models[0], label="Model")
                    policy = gr.Dropdown(policy_choices, value="inertia", label="Policy")
                    description = gr.Markdown()
                    with gr.Accordion("Policy parameters", open=False):
                        widgets = [_parameter_widget(PARAMETERS[name]) for name in PARAM_NAMES]
                    budget_mode, compression, budget, max_new, chat, temperature, top_p, seed = \
                        _run_settings(limits, LIVE_COMPRESSION, 64)
                    with gr.Row():
                        run = gr.Button("Run", variant="primary", elem_id="live-run")
                        stop = gr.Button("Stop", elem_id="live-stop")
                    with gr.Accordion("Open a saved trace", open=False):
                        # Any file: Gradio's own refusal of another type (a dropped comparison.zip) was a toast
                        # gone in seconds and a bare "Error" in the box; the check says what to open instead.
                        saved = gr.File(label="Trace (parquet): this tab's download or `kvviz generate --trace`",
                                        type="filepath", elem_id="live-open")
                        reuse = gr.Button("Use its settings (model, prompt, policy, cache size, sampling)",
                                          visible=False, size="sm", elem_id="live-reuse")
                # below ~1000 px the settings go above the views, which keep the page's width: beside them the
                # views had ~370 px, the heatmaps unreadable and the tables' numbers broken mid-digit
                with gr.Column(scale=2, min_width=VIEWS_MIN_WIDTH, elem_id="live-views"):
                    text = gr.Textbox(label="Generated text", lines=5)
                    stats = gr.Markdown()
                    # no label chip: it lay over the titles hung from the top, which name each plot anyway
                    retention = gr.Plot(label="Retention", show_label=False)
                    ranks = gr.Plot(label="Utility rank", show_label=False)
                    step_slider = TypedSlider(0, 1, value=0, step=1, label="Scrub to step", visible=False)
                    detail = gr.Plot(label="Step detail", show_label=False)  # its title, hung from the top, names it
                    with gr.Accordion("Why: the terms of the last eviction decision (AvoKV-E, R-KV, LazyEviction)",
                                      open=False):
                        terms_note = gr.Markdown()
                        # wrapped within the panel (decision_views sets the widths): scrolled sideways, the
                        # terms lost the position and fate of their row
                        terms = gr.Dataframe(label="Terms per judged entry", visible=False, interactive=False,
                                             max_height=360, wrap=True)
                    follow = gr.Textbox(label="Follow tokens", elem_id="live-follow",
                                        placeholder="text to find (e.g. 7342519) or positions (#12, #40-45); "
                                        "empty: the entries at the eviction boundary at the scrubbed step")
                    history = gr.Plot(label="Token history", show_label=False)  # its title names it
                    fate = gr.HTML(label="Tokens by fate")
                    timeline = gr.Plot(label="Per step")
                    # stacked: side by side, a 1000-px window squeezed the file's name to ".p" and broke the table's
                    # numbers over two lines
                    download = gr.File(label="Trace (parquet)", visible=False)
                    diag = gr.Markdown()
            view_state = gr.State(None)
            inputs = [model, prompt, policy, budget_mode, compression, budget, max_new, chat, temperature, top_p, seed,
                      *widgets]
            live_outputs = [text, stats, retention, ranks, timeline, fate, step_slider, download, diag, view_state,
                            detail]
            # Its progress shows under the prompt (the first run's check loads the model, which takes a while);
            # after a refusal the prompt's token count replaces it there, and the last run's views stay.
            # The API is /generate; /live drives the widgets.
            checked, live = stoppable_run(limits, run, stop, make_live_check(limits), make_live_handler(limits),
                                          inputs, live_outputs, "live", progress_on=prompt_size,
                                          announce=(lambda name: loading_note(name) or gr.skip(), model, prompt_size))
            # Traces open in a queue of their own: opening one loads at most a tokenizer, so it neither waits
            # for a run nor holds one up.
            saved.upload(lambda: gr.update(visible=False), None, reuse, api_name=False, queue=False)
            trace_checked = saved.upload(lambda path: check_trace(path, limits), saved, None, api_name=False,
                                         concurrency_limit=TRACES_AT_ONCE, concurrency_id="trace")
            # a refused file leaves the box: shown there, it read as the trace open in the views
            trace_checked.failure(lambda: None, None, saved, api_name=False, queue=False)
            opened = trace_checked.success(make_open_handler(limits), saved, live_outputs,
                                           concurrency_limit=TRACES_AT_ONCE, concurrency_id="trace",
                                           api_name="open_trace", api_visibility="undocumented")
            opened.success(lambda: gr.update(visible=True), None, reuse, api_name=False, queue=False)
            saved.clear(lambda: gr.update(visible=False), None, reuse, api_name=False, queue=False)
            reuse_settings = make_reuse_handler(limits)
            reuse.click(reuse_settings.check, saved, None, api_name=False).success(
                reuse_settings, saved, [model, prompt, chat, policy, budget_mode, compression, budget, max_new,
                                        temperature, top_p, seed, description, *widgets],
                api_name=False, concurrency_limit=TRACES_AT_ONCE, concurrency_id="trace")
            # input: dragging, clicking the track or typing a step (release alone missed the typed ones)
            after = [history, terms_note, terms, retention]
            step_slider.input(scrub, [view_state, step_slider, follow],
                              [retention, ranks, timeline, detail, fate, terms_note, terms, step_slider],
                              api_name=False, trigger_mode="always_last").then(
                history_view, [view_state, follow, step_slider], history, api_name=False)
            follow.change(followed_views, [view_state, follow, step_slider], [history, retention], api_name=False,
                          trigger_mode="always_last")
            # The last run's views would otherwise stay up, beside the new run, until it ends.
            checked.success(lambda: step_views(None, "", 0), None, after, api_name=False, queue=False)
            for shown in (live, opened):
                shown.then(step_views, [view_state, follow, step_slider], after, api_name=False)
            # input, not change: a trace's settings set the policy and its parameters together (the change
            # event would then reset the parameters to the policy's defaults)
            policy.input(_show_parameters, [policy, model], [description, *widgets], api_name=False)
            for widget in widgets:  # e.g. alpha changes the previous-step weight the description states
                describe = {"fn": _describe, "inputs": [policy, model, *widgets], "outputs": description,
                            "api_name": False}
                if isinstance(widget, (gr.Dropdown, gr.Checkbox)):  # e.g. aggregation=sum leaves alpha unused
                    widget.input(_show_parameters_in_use, [policy, *widgets], widgets, api_name=False,
                                 trigger_mode="always_last").then(**describe)
                else:
                    widget.input(**describe, trigger_mode="always_last")
            for name, widget in zip(PARAM_NAMES, widgets):
                if isinstance(widget, TypedSlider):
                    widget.release(parameter_past_end_note(name), [policy, widget], None, api_name=False,
                                   show_progress="hidden")
            model.change(_describe, [policy, model, *widgets], description, api_name=False)
            # select, not change: picking the example shown again restores its text, and the box emptied below
            # (the prompt no longer that example's) leaves the prompt alone
            example.select(pick_example, None, prompt, api_name=False)
            prompt.change(lambda text, name: gr.skip() if EXAMPLES.get(name) == text else None, [prompt, example],
                          example, api_name=False, queue=False, show_progress="hidden")
            counter, count_inputs = make_prompt_counter(limits), [model, prompt, chat]
            for trigger in (prompt.change, model.change, chat.change):
                trigger(counter, count_inputs, prompt_size, api_name=False, trigger_mode="always_last")
            app.load(counter, count_inputs, prompt_size, api_name=False)
            # Another tab's run may have loaded the model since: coming back, the count can show
            live_tab.select(counter, count_inputs, prompt_size, api_name=False, show_progress="hidden")
            # The first run's check (or an opened trace) loads the model: the count can show.  After a refusal
            # too (.then does not follow a failed event), so that it sits beside the toast's reason.
            for loaded in (checked.success, checked.failure, opened.then):
                loaded(counter, count_inputs, prompt_size, api_name=False)
            checked.failure(mark_previous_run, [view_state, stats], stats, api_name=False, queue=False)
            # The views of the last run stay when the inputs change: marked as the earlier inputs' (an opened
            # trace's run was made from no inputs here)
            checked_inputs, ran = gr.State(None), gr.State(None)
            checked.success(run_inputs, inputs, checked_inputs, api_name=False, queue=False)
            marks = dict(fn=earlier_run_note, inputs=[ran, view_state, stats, *inputs], outputs=stats, api_name=False,
                         queue=False, show_progress="hidden")
            live.success(lambda inputs, note: {"inputs": inputs, "note": note}, [checked_inputs, stats], ran,
                         api_name=False, queue=False).then(**marks)
            opened.then(lambda: None, None, ran, api_name=False, queue=False)
            for component in inputs:
                component.change(trigger_mode="always_last", **marks)
            app.load(_show_parameters, [policy, model], [description, *widgets], api_name=False)

        with gr.Tab("Compare") as compare_tab:
            with gr.Row():
                with gr.Column(scale=1):
                    c_prompt = gr.Textbox(label="Prompt", lines=6, value=EXAMPLES[COMPARE_EXAMPLE])
                    c_prompt_size = gr.Markdown()
                    c_model = gr.Dropdown(list(limits.models), value=limits.models[0], label="Model")
                    c_preset = gr.Dropdown(list(COMPARISONS), value=list(COMPARISONS)[0],
                                           label="Comparisons from the papers")
                    c_preset_note = gr.Markdown()
                    # Typed entries are settings: one policy at two parameter values, side by side.
                    c_policies = gr.Dropdown([c for c in policy_choices], value=COMPARISONS[c_preset.value],
                                             multiselect=True, allow_custom_value=True, max_choices=4,
                                             label="Policies (2 to 4): pick, or type a setting such as "
                                                   "'inertia alpha=0.5' and press Enter")
                    c_policies_full = gr.Markdown(POLICIES_FULL, visible=len(COMPARISONS[c_preset.value]) >= 4)
                    c_mode, c_compression, c_budget, c_max_new, c_chat, c_temperature, c_top_p, c_seed = \
                        _run_settings(limits, 0.75, COMPARE_NEW_TOKENS)
                    with gr.Row():
                        c_run = gr.Button("Compare", variant="primary", elem_id="compare-run")
                        c_stop = gr.Button("Stop", elem_id="compare-stop")
                with gr.Column(scale=3, min_width=VIEWS_MIN_WIDTH, elem_id="compare-views"):
                    with gr.Row():
                        c_texts = [gr.Textbox(label=f"policy {i + 1}", lines=6, visible=i < 3) for i in range(4)]
                    with gr.Row():
                        # no tag: it sat over the panel's own title
                        c_figs = [gr.Plot(label="Retention", show_label=False, visible=i < 3) for i in range(4)]
                    c_divergence = gr.Markdown()
                    c_jaccard = gr.Plot(label="Keep-set Jaccard")
                    c_download = gr.File(label="This comparison's traces (a zip of one parquet trace per policy; "
                                         "each opens in the Live tab)", visible=False, interactive=False)
                    c_follow = gr.Textbox(label="Follow prompt tokens", elem_id="compare-follow",
                                          placeholder="text to find (e.g. 9074615) or positions (#12, #40-45); "
                                          "empty: the prompt tokens the policies disagree on")
                    c_fates_note = gr.Markdown()
                    # wrap: four long settings as headers otherwise ran the last column off the panel
                    c_fates = gr.Dataframe(label=FATES_LABEL, visible=False, interactive=False, max_height=360,
                                           wrap=True)
                    c_diagnostics = gr.Dataframe(label=STABILITY_LABEL, visible=False, interactive=False, wrap=True)
                    with gr.Accordion("Oracle damage probe", open=False):
                        gr.Markdown("Removes one cache entry at a time at the chosen step, replays the next 8 tokens "
                                    "of the full-cache continuation, and ranks each policy's utility against the damage. "
                                    "Below: AvoKV-E's blindspot test, the share of high-damage entries (top decile) "
                                    "by AvoKV-E's read-pressure and payload ranks at that step; the outlined cell holds "
                                    "the rarely read entries with large values that attention alone would evict.")
                        with gr.Row():
                            p_step = gr.Number(value=8, label="Step")
                            p_sample = gr.Number(value=128, label=f"Entries sampled (1-{MAX_PROBE_SAMPLE})")
                            p_run = gr.Button("Run probe")
                        p_table = gr.Dataframe(label=PROBE_LABEL, interactive=False, wrap=True)
                        p_note = gr.Markdown()
                        # AvoKV-E Fig. 1(a): is removing a rarely read entry with a large value damaging?
                        p_blindspot = gr.Plot(label=BLINDSPOT_LABEL, visible=False)
                    with gr.Accordion("Scorer spectrum (InertiaKV §5.1)", open=False):
                        gr.Markdown("How far each scorer's ranking of the cache sits from last-query attention: "
                                    "Spearman and top-B Jaccard (B = 10% of the cache) at one layer, and through "
                                    "InertiaKV's EMA over layers, on the full-cache greedy run of this prompt. "
                                    "Scorers close to attention (value-norm, entropy weighting) keep quality in the "
                                    "paper; those far from it (key norm, recency) fail on retrieval.")
                        with gr.Row():
                            s_steps = gr.Number(value=8, label="Steps")
                            # a Textbox: a Number widget cannot stay empty in the browser (it shows and sends 0)
                            s_layer = gr.Textbox(value="", label="Layer (empty: the middle one)", placeholder="middle")
                            s_run = gr.Button("Run spectrum")
                        s_figure = gr.Plot(label=SPECTRUM_LABEL)
                        s_layers = gr.Plot(label=SPECTRUM_LAYERS_LABEL)
                        s_table = gr.Dataframe(label=SPECTRUM_TABLE_LABEL, interactive=False, wrap=True)
                        s_note = gr.Markdown()
            preset_chosen = c_preset.input(
                make_preset_handler(limits), [c_preset, c_model, c_prompt, c_chat, c_mode, c_max_new, c_temperature,
                                              c_top_p],
                [c_policies, c_prompt, c_mode, c_budget, c_max_new, c_temperature, c_top_p, c_preset_note],
                api_name=False)
            c_policies_seen = gr.State(None)
            c_policies.change(policies_edited, [c_preset, c_policies, c_policies_seen], [c_preset, c_policies_seen],
                              api_name=False, show_progress="hidden")
            c_policies.change(policies_full_note, c_policies, c_policies_full, api_name=False, queue=False,
                              show_progress="hidden")
            # the compared runs' views; the inputs they ran on, with their note (set by the run's last update)
            c_state, c_ran = gr.State(None), gr.State(None)
            c_policies.change(placeholder_panels, [c_policies, c_state], [*c_texts, *c_figs], api_name=False,
                              show_progress="hidden")
            c_inputs = [c_model, c_prompt, c_policies, c_mode, c_compression, c_budget, c_max_new, c_chat,
                        c_temperature, c_top_p, c_seed]
            compare_check = make_compare_check(limits)
            c_checked, compare = stoppable_run(
                limits, c_run, c_stop, compare_check, make_compare_handler(limits), c_inputs,
                [*c_texts, *c_figs, c_divergence, c_jaccard, c_download, c_state, c_ran], "compare",
                progress_on=c_divergence,
                announce=(compare_check.announce, [*c_inputs, c_state], [c_divergence, *c_texts, *c_figs]))
            # the prompt's token count, as in the Live tab (B is a share of it)
            c_count_inputs = [c_model, c_prompt, c_chat]
            for trigger in (c_prompt.change, c_model.change, c_chat.change):
                trigger(counter, c_count_inputs, c_prompt_size, api_name=False, trigger_mode="always_last")
            for loaded in (app.load, compare_tab.select, c_checked.success, c_checked.failure):
                loaded(counter, c_count_inputs, c_prompt_size, api_name=False, show_progress="hidden")
            # An AvoKV-E preset's note follows the inputs it set as they are edited by hand (not by the preset)
            c_regime = gr.State(None)
            regime_inputs = [c_model, c_prompt, c_chat, c_mode, c_budget, c_max_new, c_temperature, c_top_p]
            preset_chosen.then(preset_regime, [c_preset_note, *regime_inputs], c_regime, api_name=False, queue=False)
            for component in regime_inputs:
                component.input(preset_note_after_edit, [c_regime, *regime_inputs], c_preset_note, api_name=False,
                                queue=False, show_progress="hidden", trigger_mode="always_last")
            c_checked.failure(compare_check.refused_marks, [*c_inputs, c_state],
                              [c_divergence, *c_texts, c_fates, c_diagnostics], api_name=False)
            edited_io = dict(fn=compare_check.edited, inputs=[*c_inputs, c_ran, c_state, c_divergence],
                             outputs=[c_divergence, *c_texts, c_fates, c_diagnostics], api_name=False,
                             show_progress="hidden", queue=False)
            for component in c_inputs:
                component.change(trigger_mode="always_last", **edited_io)
            # and at its end, for the edits made while it ran (against the views and inputs on the page then,
            # which a later click's comparison may have replaced: each comes with its own)
            compare.success(**edited_io)
            # A refusal's marks go too (the text panels' go with the run's first update).
            c_checked.success(lambda: (compare_fates(None, "")[0], gr.update(value=None, visible=False,
                                                                             label=FATES_LABEL)),
                              None, [c_fates_note, c_fates], api_name=False, queue=False)
            c_checked.success(lambda: gr.update(value=None, visible=False, label=STABILITY_LABEL), None,
                              c_diagnostics, api_name=False, queue=False)
            compare.then(compare_follow, [c_state, c_follow], [c_fates_note, c_fates, *c_figs], api_name=False)
            compare.then(compare_diagnostics, c_state, c_diagnostics, api_name=False)
            c_follow.change(compare_follow, [c_state, c_follow], [c_fates_note, c_fates, *c_figs], api_name=False,
                            trigger_mode="always_last")
            p_state, s_state = gr.State(None), gr.State(None)  # the inputs each last ran on, and its note
            probe_staleness = Staleness("probe", ["model", "prompt", "policies", "chat template", "step",
                                                  "entries sampled"], [PROBE_LABEL, BLINDSPOT_LABEL])
            spectrum_staleness = Staleness("spectrum", ["model", "prompt", "chat template", "steps", "layer"],
                                           [SPECTRUM_LABEL, SPECTRUM_LAYERS_LABEL, SPECTRUM_TABLE_LABEL])
            # Each is checked first (no outputs), so that a refusal leaves the last result unmarked.
            probe_inputs = [c_model, c_prompt, c_policies, c_chat, p_step, p_sample]
            p_run.click(make_probe_check(limits), probe_inputs, None, api_name=False, concurrency_limit=None).success(
                make_probe_handler(limits), probe_inputs, [p_table, p_note, p_blindspot],
                concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name="probe"
            ).success(probe_staleness.remember, [*probe_inputs, p_note], p_state, api_name=False, queue=False)

            spectrum_inputs = [c_model, c_prompt, c_chat, s_steps, s_layer]
            s_run.click(make_spectrum_check(limits), spectrum_inputs, None, api_name=False,
                        concurrency_limit=None).success(
                make_spectrum_handler(limits), spectrum_inputs, [s_table, s_note, s_figure, s_layers],
                concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name="spectrum"
            ).success(spectrum_staleness.remember, [*spectrum_inputs, s_note], s_state, api_name=False, queue=False)
            # a new prompt, policy list or Compare leaves the last probe and spectrum in place, marked
            for staleness, state, inputs, outputs in (
                    (probe_staleness, p_state, probe_inputs, [p_note, p_table, p_blindspot]),
                    (spectrum_staleness, s_state, spectrum_inputs, [s_note, s_figure, s_layers, s_table])):
                for trigger in (c_checked.success, *(component.change for component in inputs)):
                    trigger(staleness.mark, [state, *inputs], outputs, api_name=False, queue=False,
                            trigger_mode="always_last", show_progress="hidden")

            # each column as wide as its longest word, set as a result arrives (the API's result stays a table)
            for table in (p_table, s_table):
                table.change(fit_columns, table, table, api_name=False, queue=False, show_progress="hidden")

        with gr.Tab("Results"):
            build_results_tab(app, store, warm=warm)

        gr.api(make_generate_api(limits), api_name="generate", concurrency_limit=limits.runs_per_model, concurrency_id="model")
    return app


def check_served_models(limits: Limits) -> None:
    """Refuse, before the server comes up, a model it could never load (:func:`kvviz.models.check_available`:
    a hub id neither cached nor known to the hub); raises ValueError naming the setting to change."""
    from ..models import check_available

    for name in limits.models:
        try:
            check_available(name)
        except ValueError as error:
            raise ValueError(f"the models (KVVIZ_DEFAULT_MODEL, KVVIZ_MODELS, kvviz serve --models): {error}") \
                from None


def launch(limits: Limits | None = None, **kwargs):
    limits = limits or Limits.from_env()
    check_served_models(limits)
    app = build_app(limits, warm=True)
    app.queue(default_concurrency_limit=limits.runs_per_model, max_size=limits.queue_size)
    # Uploads are saved traces: a 64k-token prompt with 256 steps is ~13 MB; refuse what no trace needs.
    kwargs.setdefault("max_file_size", "100mb")
    return app.launch(server_name=limits.host, server_port=limits.port, show_error=False, **kwargs)
