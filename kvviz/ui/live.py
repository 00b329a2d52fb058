"""The Live tab: one policy streamed, its views updated as it decodes, then scrubbed step by step; saved
traces opened (:mod:`.traces`).  :func:`layout` makes the tab's components (:class:`LiveTab`), :func:`wire`
their events; the handlers return their outputs by component."""

from __future__ import annotations

import functools
import logging
import math
import time
from contextlib import closing
from dataclasses import dataclass

import gradio as gr

from ..policies import REGISTRY, setting_label
from ..tasks.examples import EXAMPLES
from ..trace import sampling_note
from .checks import PARAM_NAMES, policy_from_inputs, refused, release_memory, unexpected, used_parameters, validate
from .common import (
    PREFILL,
    VIEWS_MIN_WIDTH,
    Progress,
    RunButtons,
    changed_inputs,
    compared_inputs,
    download_folder,
    earlier_inputs,
    loading_note,
    make_prompt_counter,
    stoppable_run,
    token_texts,
)
from .config import Limits
from .controls import PolicyControls, RunSettings, policy_choices
from .figures import RunView
from .live_views import finished_outputs, followed_views, history_view, scrub, stats_markdown, step_views
from .pacing import FramePacer, Pacers
from .tickets import stopped_run_failed, ticketed
from .traces import TRACES_AT_ONCE, TraceReuse, check_trace, make_open_handler
from .waiting import events_with_progress
from .widgets import TypedSlider

log = logging.getLogger(__name__)
# The Live tab's start: its default policy (InertiaKV) answers the passkey example right at this compression
# on the default model (at 0.5 it lost it under every policy tried: assets/landing.py)
LIVE_COMPRESSION = 0.3


@dataclass
class LiveTab:
    tab: gr.Tab
    prompt: gr.Textbox
    prompt_size: gr.Markdown  # the prompt's token count; the check's progress and "loading …" show here
    example: gr.Dropdown
    model: gr.Dropdown
    controls: PolicyControls
    settings: RunSettings
    buttons: RunButtons
    saved: gr.File  # a trace to open
    reuse: gr.Button
    text: gr.Textbox
    stats: gr.Markdown
    retention: gr.Plot
    ranks: gr.Plot
    step_slider: TypedSlider
    detail: gr.Plot
    terms_note: gr.Markdown
    terms: gr.Dataframe
    follow: gr.Textbox
    history: gr.Plot
    fate: gr.HTML
    timeline: gr.Plot
    download: gr.File
    diag: gr.Markdown
    view_state: gr.State  # the RunView on show
    checked_inputs: gr.State  # the inputs of the click that passed its check (run_inputs)
    ran: gr.State  # the inputs the views' run ran on and its stats line: earlier_run_note marks them

    @property
    def inputs(self) -> list:
        """The run's inputs, in the order of /live's arguments."""
        return [self.model, self.prompt, self.controls.policy, *self.settings.inputs, *self.controls.widgets.values()]

    @property
    def outputs(self) -> list:
        """What a run or an opened trace shows, in the order of /live's and /open_trace's results."""
        return [self.text, self.stats, self.retention, self.ranks, self.timeline, self.fate, self.step_slider,
                self.download, self.diag, self.view_state, self.detail]

    @property
    def step_outputs(self) -> list:
        """What :func:`.live_views.step_views` shows after a scrub, a run or an opened trace."""
        return [self.history, self.terms_note, self.terms, self.retention]


def layout(limits: Limits) -> LiveTab:
    with gr.Tab("Live") as tab:
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(label="Prompt", lines=8, value=EXAMPLES["Passkey in a haystack"])
                prompt_size = gr.Markdown()
                example = gr.Dropdown(list(EXAMPLES), label="Examples", value="Passkey in a haystack")
                model = gr.Dropdown(list(limits.models), value=limits.models[0], label="Model")
                controls = PolicyControls.layout(policy_choices())
                settings = RunSettings.layout(limits, LIVE_COMPRESSION, 64)
                run, stop = RunButtons.layout("Run", "live")
                with gr.Accordion("Open a saved trace", open=False):
                    # Any file: the check says what to open instead of another type (Gradio's refusal is a bare "Error")
                    saved = gr.File(label="Trace (parquet): this tab's download or `kvviz generate --trace`",
                                    type="filepath", elem_id="live-open")
                    reuse = gr.Button("Use its settings (model, prompt, policy, cache size, sampling)",
                                      visible=False, size="sm", elem_id="live-reuse")
            # below ~1000 px the settings go above the views, which keep the page's width (beside, unreadable)
            with gr.Column(scale=2, min_width=VIEWS_MIN_WIDTH, elem_id="live-views"):
                views = _views_layout()
        buttons = RunButtons.around(run, stop)
    return LiveTab(tab, prompt, prompt_size, example, model, controls, settings, buttons, saved, reuse, **views,
                   view_state=gr.State(None), checked_inputs=gr.State(None), ran=gr.State(None))


def _views_layout() -> dict:
    text = gr.Textbox(label="Generated text", lines=5)
    stats = gr.Markdown()
    # no label chip: it lay over the titles hung from the top, which name each plot anyway
    retention = gr.Plot(label="Retention", show_label=False)
    ranks = gr.Plot(label="Utility rank", show_label=False)
    step_slider = TypedSlider(0, 1, value=0, step=1, label="Scrub to step", visible=False)
    detail = gr.Plot(label="Step detail", show_label=False)  # its title, hung from the top, names it
    with gr.Accordion("Why: the terms of the last eviction decision (AvoKV-E, R-KV, LazyEviction)", open=False):
        terms_note = gr.Markdown()
        # wrapped within the panel (decision_views sets the widths): scrolled sideways, a row lost its entry
        terms = gr.Dataframe(label="Terms per judged entry", visible=False, interactive=False, max_height=360,
                             wrap=True)
    follow = gr.Textbox(label="Follow tokens", elem_id="live-follow",
                        placeholder="text to find (e.g. 7342519) or positions (#12, #40-45); "
                        "empty: the entries at the eviction boundary at the scrubbed step")
    history = gr.Plot(label="Token history", show_label=False)  # its title names it
    fate = gr.HTML(label="Tokens by fate")
    timeline = gr.Plot(label="Per step")
    # stacked: side by side, a 1000-px window squeezed the file's name and broke the table's numbers
    download = gr.File(label="Trace (parquet)", visible=False)
    diag = gr.Markdown()
    return dict(text=text, stats=stats, retention=retention, ranks=ranks, step_slider=step_slider, detail=detail,
                terms_note=terms_note, terms=terms, follow=follow, history=history, fate=fate, timeline=timeline,
                download=download, diag=diag)


def wire(app: gr.Blocks, tab: LiveTab, limits: Limits) -> None:
    tab.settings.wire()
    pacers = Pacers(limits.figures_per_second)
    handler = make_live_handler(limits, tab, pacers)

    def live_run(request: gr.Request, *inputs):
        yield from handler(*inputs, session=request.session_hash if request else "")

    def drawn(request: gr.Request) -> None:
        pacers.acknowledge(request.session_hash if request else "", "live")

    # The page says when it has drawn a retention frame; the run sends the next one only then (FramePacer).
    tab.retention.change(drawn, None, None, api_name=False, queue=False, show_progress="hidden")
    # Its progress shows under the prompt (the first run's check loads the model); after a refusal the prompt's
    # token count replaces it there, and the last run's views stay.  The API is /generate; /live drives the widgets.
    checked, live = stoppable_run(limits, tab.buttons, make_live_check(limits), live_run,
                                  tab.inputs, tab.outputs, "live", status=tab.prompt_size,
                                  announce=(lambda name: loading_note(name) or gr.skip(), tab.model, tab.prompt_size))
    opened = _wire_traces(tab, limits)
    _wire_scrub(tab, checked, shown=(live, opened))
    tab.controls.wire(tab.model)
    _wire_prompt(app, tab, limits, loaded=(checked.success, checked.failure, opened.then))
    _wire_marks(tab, checked, live, opened)
    app.load(tab.controls.show, [tab.controls.policy, tab.model], [tab.controls.description,
                                                                   *tab.controls.widgets.values()], api_name=False)


def _wire_traces(tab: LiveTab, limits: Limits):
    """Opening a saved trace, and using its settings; returns the event that shows it."""
    # Traces open in a queue of their own: opening one loads at most a tokenizer, so it neither waits
    # for a run nor holds one up.
    tab.saved.upload(lambda: gr.update(visible=False), None, tab.reuse, api_name=False, queue=False)
    trace_checked = tab.saved.upload(lambda path: check_trace(path, limits), tab.saved, None, api_name=False,
                                     concurrency_limit=TRACES_AT_ONCE, concurrency_id="trace")
    # a refused file leaves the box: shown there, it read as the trace open in the views
    trace_checked.failure(lambda: None, None, tab.saved, api_name=False, queue=False)
    opened = trace_checked.success(make_open_handler(limits, tab), tab.saved, tab.outputs,
                                   concurrency_limit=TRACES_AT_ONCE, concurrency_id="trace",
                                   api_name="open_trace", api_visibility="undocumented")
    opened.success(lambda: gr.update(visible=True), None, tab.reuse, api_name=False, queue=False)
    tab.saved.clear(lambda: gr.update(visible=False), None, tab.reuse, api_name=False, queue=False)
    reuse = TraceReuse(limits, tab)
    tab.reuse.click(reuse.check, tab.saved, None, api_name=False).success(
        reuse.settings, tab.saved, reuse.outputs, api_name=False, concurrency_limit=TRACES_AT_ONCE,
        concurrency_id="trace")
    return opened


def _wire_scrub(tab: LiveTab, checked, shown) -> None:
    """The scrubber and Follow, and the views that follow the scrubbed step once a run or trace is ``shown``."""
    scrubbed = [tab.view_state, tab.step_slider, tab.follow]
    # input: dragging, clicking the track or typing a step (release alone missed the typed ones)
    tab.step_slider.input(functools.partial(scrub, tab), scrubbed,
                          [tab.retention, tab.ranks, tab.timeline, tab.detail, tab.fate, tab.terms_note, tab.terms,
                           tab.step_slider], api_name=False, trigger_mode="always_last").then(
        history_view, [tab.view_state, tab.follow, tab.step_slider], tab.history, api_name=False)
    tab.follow.change(functools.partial(followed_views, tab), [tab.view_state, tab.follow, tab.step_slider],
                      [tab.history, tab.retention], api_name=False, trigger_mode="always_last")
    # The last run's views would otherwise stay up, beside the new run, until it ends.
    checked.success(lambda: step_views(tab, None, "", 0), None, tab.step_outputs, api_name=False, queue=False)
    for event in shown:
        event.then(functools.partial(step_views, tab), [tab.view_state, tab.follow, tab.step_slider],
                   tab.step_outputs, api_name=False)


def _wire_prompt(app: gr.Blocks, tab: LiveTab, limits: Limits, loaded) -> None:
    """The examples box and the prompt's token count (shown once the model has ``loaded``)."""
    # select, not change: picking the example shown again restores its text, and the box emptied below
    # (the prompt no longer that example's) leaves the prompt alone
    tab.example.select(pick_example, None, tab.prompt, api_name=False)
    tab.prompt.change(lambda text, name: gr.skip() if EXAMPLES.get(name) == text else None, [tab.prompt, tab.example],
                      tab.example, api_name=False, queue=False, show_progress="hidden")
    counter, count_inputs = make_prompt_counter(limits), [tab.model, tab.prompt, tab.settings.chat]
    for trigger in (tab.prompt.change, tab.model.change, tab.settings.chat.change):
        trigger(counter, count_inputs, tab.prompt_size, api_name=False, trigger_mode="always_last")
    app.load(counter, count_inputs, tab.prompt_size, api_name=False)
    # Another tab's run may have loaded the model since: coming back, the count can show
    tab.tab.select(counter, count_inputs, tab.prompt_size, api_name=False, show_progress="hidden")
    # .then does not follow a failed event: after a refusal too, so that the count sits beside its reason
    for event in loaded:
        event(counter, count_inputs, tab.prompt_size, api_name=False)


def _wire_marks(tab: LiveTab, checked, live, opened) -> None:
    """The views of the last run stay when a click is refused or the inputs change: marked as the earlier
    inputs' (an opened trace's run was made from no inputs here)."""
    checked.failure(mark_previous_run, [tab.view_state, tab.stats], tab.stats, api_name=False, queue=False)
    checked.success(run_inputs, tab.inputs, tab.checked_inputs, api_name=False, queue=False)
    marks = dict(fn=earlier_run_note, inputs=[tab.ran, tab.view_state, tab.stats, *tab.inputs], outputs=tab.stats,
                 api_name=False, queue=False, show_progress="hidden")
    live.success(lambda inputs, note: {"inputs": inputs, "note": note}, [tab.checked_inputs, tab.stats], tab.ran,
                 api_name=False, queue=False).then(**marks)
    opened.then(lambda: None, None, tab.ran, api_name=False, queue=False)
    for component in tab.inputs:
        component.change(trigger_mode="always_last", **marks)



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


def make_live_handler(limits: Limits, tab: LiveTab, pacers: Pacers | None = None):
    """The Run button's handler: the run streamed into the tab's views, by its click's ticket; ``session``
    names the browser session whose page acknowledges frames to ``pacers``."""
    pacers = Pacers(limits.figures_per_second) if pacers is None else pacers

    def live_run(*inputs, session: str = ""):
        *inputs, ticket_id, tickets = inputs  # the run's inputs, the ticket id its click made, the session's
        pacer = pacers.start(session, "live")
        try:
            yield from ticketed(ticket_id, tickets, lambda ticket, made: live_steps(ticket, made, pacer, *inputs))
        finally:
            pacers.finish(session, "live", pacer)

    def live_steps(ticket, made, pacer, model_name, prompt, policy_name, budget_mode, compression, budget,
                   max_new_tokens, chat, temperature, top_p, seed, *param_values):
        if made:  # an API call's first run in its session: from now on /stop_live reaches it
            yield {tab.buttons.tickets: made}
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
        # The stats name the setting that ran, and how it picked its tokens: the widgets may describe another
        # by the time one reads them
        ran = f"**run** `{setting_label(policy)}`{sampling_note(request.sampling)} · "
        # Clear what the previous run left (scrubber, detail, download, diagnostics) before streaming, and
        # say what runs until the first token.
        yield {tab.text: "", tab.stats: ran + PREFILL.format(len(request.prompt_ids)), tab.retention: None,
               tab.ranks: None, tab.timeline: None, tab.fate: "", tab.step_slider: gr.update(visible=False),
               tab.download: gr.update(value=None, visible=False), tab.diag: "", tab.view_state: None,
               tab.detail: None}
        try:
            # closed on Stop or an error, so that a prefill under way stops at its next layer
            with closing(events_with_progress(request.events(policy, limits), request.model,
                                              len(request.prompt_ids))) as events:
                yield from streamed(tab, run, events, ticket, ran, pacer)
            yield live_result(tab, run, stopped=ticket.is_set(), ran=ran)
        except Exception as error:  # the run failed: say so, keep serving
            if ticket.is_set():
                stopped_run_failed("the stopped run", error)
                return
            raise unexpected("generation", error) from None
        finally:
            release_memory()

    return live_run


def streamed(tab: LiveTab, run: Progress, events, ticket, ran: str, pacer: FramePacer):
    """The run's updates as it decodes, until it ends or ``ticket`` is stopped: the prefill's progress until
    the first token, the text when ``pacer.text_due``, the retention heatmap when ``pacer`` says the page
    has drawn the last one, the other views a fifth and a tenth as often (each redraw costs the browser more
    than the server, and a fast model otherwise saturates the page)."""
    (label, view), = run.views.items()
    last_secondary, last_fate, last_text = 0.0, 0.0, 0.0
    figure_every = 1 / pacer.max_per_second if pacer.max_per_second else math.inf
    for event in events:
        if isinstance(event, str):  # the prefill's progress, before the first event
            if ticket.is_set():
                break
            yield {tab.stats: ran + event}
            continue
        run.add(label, event)
        if ticket.is_set():
            break
        now = time.perf_counter()
        if pacer.due(now):
            pacer.send(now)
            last_text = now
            update = {tab.text: run.texts[label], tab.stats: ran + stats_markdown(view, now - run.started),
                      tab.retention: view.retention_figure()}
            if now - last_secondary >= 5 * figure_every:
                last_secondary = now
                update |= {tab.ranks: view.rank_figure(), tab.timeline: view.timeline_figure()}
            if now - last_fate >= 10 * figure_every:
                last_fate, update[tab.fate] = now, view.fate_html()
            yield update
        elif pacer.text_due(last_text, now):
            last_text = now
            yield {tab.text: run.texts[label]}


def live_result(tab: LiveTab, run: Progress, stopped: bool = False, ran: str = "") -> dict:
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
    return finished_outputs(tab, view, trace, run.texts[label],
                            ran + note + stats_markdown(view, time.perf_counter() - run.started), path)


NOT_RUN = "*Not run: the last click was refused (or stopped before it ran); below, the previous run.*  \n"


def mark_previous_run(view: RunView | None, stats: str):
    """A Live click that did not run: its last run's views stay (as a refused comparison's do), and its
    stats line says they are that run's, not these inputs'.  The next run or opened trace rewrites it."""
    if view is None or not isinstance(stats, str):
        return gr.skip()
    return NOT_RUN + stats.removeprefix(NOT_RUN)


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


def pick_example(choice: gr.SelectData) -> str:
    """The prompt of the example just picked (also the one already shown, after its text was edited)."""
    return EXAMPLES.get(choice.value, gr.skip())
