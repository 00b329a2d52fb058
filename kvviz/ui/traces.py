"""The Live tab's saved traces: opening one (its download, or ``kvviz generate --trace``) shows it as if its
run had just ended, and "Use its settings" sets the tab's controls to rerun it.  Handlers take the tab's
components (:class:`.live.LiveTab`) and return their outputs by component."""

from __future__ import annotations

import logging
from pathlib import Path

import gradio as gr

from .. import engine
from ..policies import REGISTRY
from ..trace import Trace, budget_note, run_note
from .checks import MAX_TEMPERATURE, PARAM_NAMES, get_tokenizer, refused, refusing, release_memory, unexpected
from .common import checkpoint_interval, terms_key, token_texts
from .config import Limits
from .controls import describe, parameter_updates
from .figures import RunView
from .live_views import finished_outputs, stats_markdown

log = logging.getLogger(__name__)

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


def opened_length(trace: Trace, limits: Limits) -> int:
    """The new tokens an opened trace's views are sized for: what it asked for, as when its run ended (blank
    rows for what it did not generate), but never past what it generated plus this app's own limit -- a
    file's max_new_tokens is only a number in its metadata, and 10**9 would size every view in gigabytes.
    0 (a trace saved before it was recorded) reads as ending where it ended."""
    ran = len(trace.events)
    return max(ran, min(trace.max_new_tokens, ran + limits.max_new_tokens))


def make_open_handler(limits: Limits, tab):
    """Show a saved trace (the Live tab's download, or ``kvviz generate --trace``) as if its run had just ended."""

    def open_trace(path):
        if not path:
            return gr.skip()
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
            return finished_outputs(tab, view, trace, text, origin + stats_markdown(view, None), None)
        except Exception as error:
            raise unexpected(f"showing {Path(path).name}", error) from None

    return open_trace


class TraceReuse:
    """Set the Live controls to an opened trace's run, so that Run reruns it, or a variant once one is changed."""

    def __init__(self, limits: Limits, tab):
        self.limits, self.tab = limits, tab

    def check(self, path) -> None:
        """Its refusal before :meth:`settings`, with no outputs: raised there, every Live control it sets would
        show a bare "Error" over it.  The trace read is left for it, as check_trace does."""
        with refusing("using the trace's settings"):
            trace = load_trace(path, self.limits)
            self.refusal(trace, Path(path).name)
            _checked_trace.clear()
            _checked_trace[path] = trace

    def settings(self, path) -> dict:
        with refusing("using the trace's settings"):  # what to change, or one line: never a bare "Error"
            return self.settings_of(_checked_trace.pop(path, None) or load_trace(path, self.limits), Path(path).name)

    @property
    def outputs(self) -> list:
        tab = self.tab
        return [tab.model, tab.prompt, tab.settings.chat, tab.controls.policy, tab.settings.mode,
                tab.settings.compression, tab.settings.budget, tab.settings.max_new, tab.settings.temperature,
                tab.settings.top_p, tab.settings.seed, tab.controls.description, *tab.controls.widgets.values()]

    def refusal(self, trace: Trace, name: str) -> None:
        if trace.model not in self.limits.models:
            raise ValueError(f"{name} ran on {trace.model or 'a model it does not name'}, which is not served "
                             f"here; start the app with `kvviz serve --models {trace.model or 'MODEL'}` to rerun it")
        if trace.policy not in REGISTRY:
            raise ValueError(f"{name} ran policy {trace.policy!r}, which this version does not have; "
                             f"choose one of {', '.join(REGISTRY)}")

    def settings_of(self, trace: Trace, name: str) -> dict:
        self.refusal(trace, name)
        prompt, chat = self.prompt_of(trace, name)
        asked = trace.max_new_tokens or len(trace.events)  # 0: saved before it was recorded
        if asked > self.limits.max_new_tokens:
            gr.Warning(f"{name} asked for {asked} new tokens; {self.limits.max_new_tokens} is the most allowed here")
        by_ratio = trace.compression is not None
        sampling = trace.sampling or {"temperature": 0.0, "top_p": 0.95, "seed": 0}  # greedy: the widgets' start
        temperature = sampling["temperature"]
        if temperature > MAX_TEMPERATURE:  # run from the library; set as it is, Run would refuse it
            gr.Warning(f"{name} sampled at temperature {temperature:g}; {MAX_TEMPERATURE:g} is the most allowed here, "
                       "and the rerun is set to that")
            temperature = MAX_TEMPERATURE
        tab, settings = self.tab, self.tab.settings
        return {tab.model: trace.model, tab.prompt: prompt, settings.chat: bool(chat),
                tab.controls.policy: trace.policy,
                settings.mode: "compression" if by_ratio else "budget",
                settings.compression: gr.update(value=trace.compression, visible=True) if by_ratio
                else gr.update(visible=False),
                settings.budget: gr.update(value=trace.budget, visible=not by_ratio),
                settings.max_new: min(asked, self.limits.max_new_tokens), settings.temperature: temperature,
                settings.top_p: sampling["top_p"], settings.seed: sampling["seed"],
                tab.controls.description: describe(trace.policy, trace.model,
                                                   *[trace.params.get(key) for key in PARAM_NAMES]),
                **tab.controls.by_widget(parameter_updates(REGISTRY[trace.policy], trace.params))}

    @staticmethod
    def prompt_of(trace: Trace, name: str) -> tuple[str, bool]:
        """The trace's prompt and chat template; recorded as token ids only, their text, template included."""
        if trace.prompt:
            return trace.prompt, trace.chat
        tokenizer = get_tokenizer(trace.model)
        prompt = tokenizer.decode(trace.prompt_ids, skip_special_tokens=False)
        if engine.encode_prompt(tokenizer, prompt, chat=False) != trace.prompt_ids:
            gr.Warning(f"{name} records its prompt as token ids only, and their text does not tokenise back "
                       "to the same ids: a rerun reads a slightly different prompt")
        return prompt, False
