"""What the Live and Compare tabs share: a run's progress (:class:`Progress`), its Run and Stop buttons
(:func:`stoppable_run`), the downloads' folder, the notes of a result made from earlier inputs, and the
prompt's token count."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd

from .. import diagnostics, engine
from ..policies import Policy
from ..policies.checkpointed import CheckpointPolicy
from ..trace import Trace, model_dtype
from .checks import Request, _models, check_prompt_text
from .config import Limits
from .figures import RunView
from .tickets import button_ticket, request_stop, retire

log = logging.getLogger(__name__)

# Where the Live tab's traces and the Compare tab's zips are written, one folder a run, the newest kept.
DOWNLOADS = Path(tempfile.mkdtemp(prefix="kvviz-downloads-"))
KEEP_DOWNLOADS = 32
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


def raw_steps(trace: Trace) -> str:
    """How many decode steps recorded a raw score: the steps the raw rows average over."""
    steps = trace.decode_steps
    return f"{sum(event.raw is not None for event in steps)} of {len(steps)}"


RAW_STEPS = "decode steps with a raw score"


def diagnostic_rows(trace: Trace) -> dict[str, str]:
    """The diagnostics as the tables show them (n/a where NaN), then the steps the raw rows average over."""
    return {**{name.replace("_", " "): "n/a" if np.isnan(value) else f"{value:.4f}"
               for name, value in diagnostics.summary(trace).items()}, RAW_STEPS: raw_steps(trace)}


PREFILL = "*prefill of the {}-token prompt…*"  # the status until a run's first tokens
LOADING = "*loading "  # how loading_note begins: Stop looks for it (stopped_while_loading)


def loading_note(model_name) -> str | None:
    """The status while a click's check loads ``model_name`` (its first run: tens of seconds for a real
    model), or None when it is loaded (or not one of ours: the check refuses it)."""
    return f"{LOADING}{model_name}…*" if isinstance(model_name, str) and model_name not in _models else None


def download_folder() -> Path:
    """A new folder for one run's download.  Only the newest KEEP_DOWNLOADS are kept: a long-running server
    would otherwise fill its disk (Gradio serves its own copy, expired by the Blocks' delete_cache)."""
    folders = sorted(DOWNLOADS.iterdir(), key=lambda path: path.stat().st_mtime)
    for old in folders[:max(0, len(folders) - KEEP_DOWNLOADS + 1)]:
        shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(dir=DOWNLOADS))


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


def earlier_inputs(changed: list[str], since: str, again: str) -> str:
    """The mark over a result whose inputs have changed since it was made (the Live tab's run, the Compare
    tab's comparison, probe and spectrum): which changed, and what makes one of the current inputs."""
    return f"**Earlier inputs: the {', '.join(changed)} changed since this {since}; {again} for the current ones.**"


def changed_inputs(then: dict, now: dict) -> list[str]:
    """The names of :func:`compared_inputs` that differ (one that applies on one side only, such as the budget
    after a switch from ρ, is named by the switch: "cache size by", "temperature")."""
    return [name for name in now if name in then and then[name] != now[name]]


def column_widths(*first: float, others: int) -> list[str]:
    """Widths of a table with ``first`` columns (percent) and then ``others`` columns (one per compared
    policy, or per term) that share the rest: left to the browser, a 1000-px window showed the first policy's
    column and hid the others past the table's edge (scrolled sideways; Gradio 6 ignores ``pinned_columns``,
    so the columns that say which row it is went out of view too)."""
    rest = (100 - sum(first)) / others
    return [f"{width:g}%" for width in first] + [f"{rest:.4g}%"] * others


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


class Staleness:
    """Marks an on-demand analysis (the probe, the spectrum) whose inputs have changed since it ran.

    The probe and the spectrum read the Compare tab's model, prompt and policies but run on their own button;
    after a new prompt or a new Compare their last result would otherwise sit under the new runs as if it were
    theirs.  :meth:`remember` keeps the inputs a result was made from (and its note); :meth:`mark` compares
    them with the current ones and, where any differ, names them in the note and on each output's label.
    """

    def __init__(self, what: str, fields: list[str], note: gr.Markdown, labels: dict[gr.components.Component, str]):
        self.what, self.fields, self.note, self.labels = what, fields, note, labels

    @property
    def outputs(self) -> list:
        return [self.note, *self.labels]

    @staticmethod
    def _key(value):
        return tuple(value) if isinstance(value, list) else value

    def remember(self, *values) -> dict:
        *inputs, note = values
        return {"inputs": [self._key(v) for v in inputs], "note": note}

    def mark(self, state: dict | None, *inputs) -> dict:
        if not state:  # nothing run yet: nothing to mark
            return gr.skip()
        changed = [field for field, then, now in zip(self.fields, state["inputs"], inputs) if then != self._key(now)]
        if not changed:
            return {self.note: state["note"],
                    **{output: gr.update(label=label) for output, label in self.labels.items()}}
        mark = earlier_inputs(changed, f"{self.what} ran", "run it again")
        return {self.note: f"{mark} {state['note']}",
                **{output: gr.update(label=f"{label} (earlier inputs)") for output, label in self.labels.items()}}


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


@dataclass
class RunButtons:
    """A tab's Run and Stop, and the hidden fields :func:`stoppable_run` goes by."""

    run: gr.Button
    stop: gr.Button
    tickets: gr.State  # the session's tickets (:mod:`.tickets`)
    ticket_id: gr.Textbox  # the click's ticket, sent with its run; "" from an API call
    cancel: gr.Number  # Stop changes it when no run decodes: its change cancels the run waiting in the queue

    @staticmethod
    def layout(label: str, prefix: str) -> tuple[gr.Button, gr.Button]:
        """The two buttons, side by side; :meth:`around` them once the tab's columns are closed."""
        with gr.Row():
            return (gr.Button(label, variant="primary", elem_id=f"{prefix}-run"),
                    gr.Button("Stop", elem_id=f"{prefix}-stop"))

    @classmethod
    def around(cls, run: gr.Button, stop: gr.Button) -> "RunButtons":
        """The buttons with their hidden fields, made outside the settings column (hidden, a form there kept its
        gap)."""
        return cls(run, stop, gr.State(None), gr.Textbox("", visible=False), gr.Number(0, visible=False))


def stoppable_run(limits: Limits, buttons: RunButtons, check, handler, inputs: list, outputs: list, name: str,
                  status, announce=None) -> tuple:
    """A Run button and its Stop (the Live tab's, the Compare tab's): the events ``/{name}`` and ``/stop_{name}``.

    The click first takes a ticket, the run's stop switch (a click while the session's run is pending ends
    there), then checks the inputs, then runs in the models' concurrency group.  The run goes by its click's
    ticket (``buttons.ticket_id``), is ``always_last`` (a click after Stop waits for the stopped run to show
    itself, where Gradio's default would drop it), and a failed check or run retires the click's ticket.
    Stop, unqueued so that a full queue cannot hold it up, sets the session's tickets: a decoding run ends
    before its next step and shows what ran; one being checked or waiting in the queue is cancelled (through
    ``buttons.cancel``'s change, never a decoding one).  The check's progress shows on ``status`` (a
    Markdown); ``announce`` (function, inputs, outputs), unqueued, says there what the click waits for (a
    model's first load) before the check starts.  Returns the check's and the run's events."""
    tickets, ticket_id = buttons.tickets, buttons.ticket_id
    # A refusal's toast stays until closed (refused()); the next click closes it, so that it never sits over
    # a run that then goes ahead, and any warning about the inputs, which the check says again where it holds.
    buttons.run.click(None, None, None, js=CLOSE_TOASTS, queue=False, api_name=False)
    taken = buttons.run.click(button_ticket, tickets, [tickets, ticket_id], queue=False, api_name=False)
    if announce:
        taken.success(*announce, api_name=False, queue=False, show_progress="hidden")
    # Checks run side by side (concurrency_limit=None): one session's first load of a model must not hold up
    # every other session's check; the runs themselves share the "model" group's limit.
    checked = taken.success(check, inputs, None, api_name=False, show_progress_on=status, concurrency_limit=None)
    checked.failure(retire, tickets, None, queue=False, api_name=False)
    running = checked.success(handler, [*inputs, ticket_id, tickets], [*outputs, tickets],
                              concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name=name,
                              trigger_mode="always_last", api_visibility="undocumented")
    running.failure(retire, tickets, None, queue=False, api_name=False)
    buttons.stop.click(request_stop, tickets, buttons.cancel, queue=False, api_name=f"stop_{name}",
                       api_visibility="undocumented", cancels=[checked])
    buttons.cancel.change(None, cancels=[running])
    if announce:  # the line saying what the click waited for would otherwise stay
        buttons.cancel.change(stopped_while_loading, status, status, api_name=False, queue=False,
                              show_progress="hidden")
    return checked, running


def stopped_while_loading(note):
    """Stop before the run started, while ``note`` (a Markdown status) says that a model loads: that line
    gives way to saying the run was stopped (the load may still finish in the background, for the next
    click).  Any other note is left as it is."""
    if not isinstance(note, str) or LOADING not in note:
        return gr.skip()
    kept = [line for line in note.split("\n") if not line.startswith(LOADING)]
    return "\n".join([*kept, "*Stopped before the run started.*"]).strip()
