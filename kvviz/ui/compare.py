"""The Compare tab: 2-4 policies decoded side by side on one shared prefill, a retention panel each, then
the followed prompt tokens' fates, the stability table and the on-demand analyses (:mod:`.analyses`).
:func:`layout` makes the tab's components (:class:`CompareTab`), :func:`wire` their events; the handlers
return their outputs by component."""

from __future__ import annotations

import functools
import logging
import re
import tempfile
import time
import zipfile
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from .. import engine
from ..tasks.examples import EXAMPLES
from .analyses import AnalysesPanel
from .checks import (
    _models,
    build_policies,
    check_sampling,
    check_settings,
    compare_settings,
    refused,
    release_memory,
    unexpected,
    validate,
)
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
from .compare_views import (
    compare_diagnostics,
    compare_fates,
    compare_panels,
    compared_labels,
    divergence_markdown,
    ended_note,
    followed_prompt_tokens,
    jaccard_figure,
)
from .config import Limits
from .controls import RunSettings, policy_choices
from .figures import RunView
from .pacing import FramePacer, Pacers
from .presets import (
    COMPARE_EXAMPLE,
    COMPARE_NEW_TOKENS,
    COMPARISONS,
    POLICIES_FULL,
    make_preset_handler,
    policies_edited,
    policies_full_note,
    preset_note_after_edit,
    preset_regime,
    repeats_note,
)
from .tickets import stopped_run_failed, ticketed
from .waiting import events_with_progress

log = logging.getLogger(__name__)

NOT_COMPARED = "*Not compared: "  # how the refusal note begins, where the comparison would have been
PREVIOUS = "previous comparison"  # how a refusal marks what the last comparison left on the page
FATES_LABEL = "Fate per policy"
STABILITY_LABEL = ("Stability, a column per policy (InertiaKV App. I; means over steps, k = B): top-B churn of raw "
                   "scores and of utility (the keep turnover wherever the cache holds B, for any policy), their "
                   "Jaccard, raw top-B evicted, and the rank stabilities: Spearman of consecutive recomputations' raw "
                   "scores, and of their utilities, over the entries both scored (the ranking inertia); n/a "
                   "where a policy records no such score or has not rescored (a checkpointed one that reached a "
                   "single checkpoint; churn and turnover: where it evicted at no step after its first); a "
                   "checkpointed policy's raw churn is its every-step attention, where it records one "
                   "(LazyEviction), not its decisions; last, the share of the keep set "
                   "after the first step that evicted still kept at the end (InertiaKV §3.1 saw all of it kept)")
PANELS = 4  # the most policies a comparison shows


@dataclass
class CompareTab:
    tab: gr.Tab
    prompt: gr.Textbox
    prompt_size: gr.Markdown
    model: gr.Dropdown
    preset: gr.Dropdown
    preset_note: gr.Markdown
    policies: gr.Dropdown
    policies_full: gr.Markdown  # why a fifth policy will not go in
    settings: RunSettings
    buttons: RunButtons
    texts: list[gr.Textbox]  # a panel per policy, PANELS of them
    figs: list[gr.Plot]
    divergence: gr.Markdown  # the comparison's note: its sizes, where the texts diverge; also "loading …"
    jaccard: gr.Plot
    download: gr.File
    follow: gr.Textbox
    fates_note: gr.Markdown
    fates: gr.Dataframe
    diagnostics: gr.Dataframe
    analyses: AnalysesPanel
    policies_seen: gr.State  # the Policies box as policies_edited last saw it
    state: gr.State  # the compared runs' views, set as the comparison ends
    ran: gr.State  # the inputs it ran on, with its note
    regime: gr.State  # what an AvoKV-E preset set (preset_regime)

    @property
    def inputs(self) -> list:
        """The comparison's inputs, in the order of /compare's arguments."""
        return [self.model, self.prompt, self.policies, *self.settings.inputs]

    @property
    def outputs(self) -> list:
        """What a comparison shows, in the order of /compare's results."""
        return [*self.texts, *self.figs, self.divergence, self.jaccard, self.download, self.state, self.ran]

    @property
    def marked(self) -> list:
        """What a refused click or an edit of the inputs marks as made from other inputs."""
        return [self.divergence, *self.texts, self.fates, self.diagnostics]


def layout(limits: Limits) -> CompareTab:
    with gr.Tab("Compare") as tab:
        with gr.Row():
            with gr.Column(scale=1):
                prompt = gr.Textbox(label="Prompt", lines=6, value=EXAMPLES[COMPARE_EXAMPLE])
                prompt_size = gr.Markdown()
                model = gr.Dropdown(list(limits.models), value=limits.models[0], label="Model")
                preset = gr.Dropdown(list(COMPARISONS), value=list(COMPARISONS)[0],
                                     label="Comparisons from the papers")
                preset_note = gr.Markdown()
                # Typed entries are settings: one policy at two parameter values, side by side.
                policies = gr.Dropdown(policy_choices(), value=COMPARISONS[preset.value], multiselect=True,
                                       allow_custom_value=True, max_choices=PANELS,
                                       label="Policies (2 to 4): pick, or type a setting such as "
                                             "'inertia alpha=0.5' and press Enter")
                policies_full = gr.Markdown(POLICIES_FULL, visible=len(COMPARISONS[preset.value]) >= PANELS)
                settings = RunSettings.layout(limits, 0.75, COMPARE_NEW_TOKENS)
                run, stop = RunButtons.layout("Compare", "compare")
            with gr.Column(scale=3, min_width=VIEWS_MIN_WIDTH, elem_id="compare-views"):
                views = _views_layout()
                analyses = AnalysesPanel.layout()
        buttons = RunButtons.around(run, stop)
    return CompareTab(tab, prompt, prompt_size, model, preset, preset_note, policies, policies_full, settings,
                      buttons, **views, analyses=analyses, policies_seen=gr.State(None), state=gr.State(None),
                      ran=gr.State(None), regime=gr.State(None))


def _views_layout() -> dict:
    with gr.Row():
        texts = [gr.Textbox(label=f"policy {i + 1}", lines=6, visible=i < 3) for i in range(PANELS)]
    with gr.Row():
        # no tag: it sat over the panel's own title
        figs = [gr.Plot(label="Retention", show_label=False, visible=i < 3) for i in range(PANELS)]
    divergence = gr.Markdown()
    jaccard = gr.Plot(label="Keep-set Jaccard")
    download = gr.File(label="This comparison's traces (a zip of one parquet trace per policy; each opens in the "
                       "Live tab)", visible=False, interactive=False)
    follow = gr.Textbox(label="Follow prompt tokens", elem_id="compare-follow",
                        placeholder="text to find (e.g. 9074615) or positions (#12, #40-45); "
                        "empty: the prompt tokens the policies disagree on")
    fates_note = gr.Markdown()
    # wrap: four long settings as headers otherwise ran the last column off the panel
    fates = gr.Dataframe(label=FATES_LABEL, visible=False, interactive=False, max_height=360, wrap=True)
    diagnostics = gr.Dataframe(label=STABILITY_LABEL, visible=False, interactive=False, wrap=True)
    return dict(texts=texts, figs=figs, divergence=divergence, jaccard=jaccard, download=download, follow=follow,
                fates_note=fates_note, fates=fates, diagnostics=diagnostics)


def wire(app: gr.Blocks, tab: CompareTab, limits: Limits) -> None:
    tab.settings.wire()
    preset_chosen = _wire_policies(tab, limits)
    checks = CompareChecks(limits, tab)
    pacers = Pacers(limits.figures_per_second / 4)  # four panels a refresh
    handler = make_compare_handler(limits, tab, pacers)

    def compare_run(request: gr.Request, *inputs):
        yield from handler(*inputs, session=request.session_hash if request else "")

    def drawn(request: gr.Request) -> None:
        pacers.acknowledge(request.session_hash if request else "", "compare")

    tab.figs[0].change(drawn, None, None, api_name=False, queue=False, show_progress="hidden")
    checked, compare = stoppable_run(
        limits, tab.buttons, checks.check, compare_run, tab.inputs, tab.outputs, "compare",
        status=tab.divergence, announce=(checks.announce, [*tab.inputs, tab.state], [tab.divergence, *tab.texts,
                                                                                      *tab.figs]))
    # the prompt's token count, as in the Live tab (B is a share of it)
    counter, count_inputs = make_prompt_counter(limits), [tab.model, tab.prompt, tab.settings.chat]
    for trigger in (tab.prompt.change, tab.model.change, tab.settings.chat.change):
        trigger(counter, count_inputs, tab.prompt_size, api_name=False, trigger_mode="always_last")
    for loaded in (app.load, tab.tab.select, checked.success, checked.failure):
        loaded(counter, count_inputs, tab.prompt_size, api_name=False, show_progress="hidden")
    _wire_regime(tab, preset_chosen)
    _wire_marks(tab, checks, checked, compare)
    tab.analyses.wire(limits, tab.model, tab.prompt, tab.policies, tab.settings.chat, checked)


def _wire_policies(tab: CompareTab, limits: Limits):
    """The presets box and the Policies box; returns the event of a preset chosen."""
    settings = tab.settings
    preset_chosen = tab.preset.input(
        make_preset_handler(limits, tab), [tab.preset, tab.model, tab.prompt, settings.chat, settings.mode,
                                           settings.max_new, settings.temperature, settings.top_p],
        [tab.policies, tab.prompt, settings.mode, settings.budget, settings.max_new, settings.temperature,
         settings.top_p, tab.preset_note], api_name=False)
    tab.policies.change(policies_edited, [tab.preset, tab.policies, tab.policies_seen], [tab.preset, tab.policies_seen],
                        api_name=False, show_progress="hidden")
    tab.policies.change(policies_full_note, tab.policies, tab.policies_full, api_name=False, queue=False,
                        show_progress="hidden")
    tab.policies.change(functools.partial(placeholder_panels, tab), [tab.policies, tab.state], [*tab.texts, *tab.figs],
                        api_name=False, show_progress="hidden")
    return preset_chosen


def _wire_regime(tab: CompareTab, preset_chosen) -> None:
    """An AvoKV-E preset's note follows the inputs it set as they are edited by hand (not by the preset)."""
    settings = tab.settings
    regime_inputs = [tab.model, tab.prompt, settings.chat, settings.mode, settings.budget, settings.max_new,
                     settings.temperature, settings.top_p]
    preset_chosen.then(preset_regime, [tab.preset_note, *regime_inputs], tab.regime, api_name=False, queue=False)
    for component in regime_inputs:
        component.input(preset_note_after_edit, [tab.regime, *regime_inputs], tab.preset_note, api_name=False,
                        queue=False, show_progress="hidden", trigger_mode="always_last")


def _wire_marks(tab: CompareTab, checks: "CompareChecks", checked, compare) -> None:
    """What a refusal or an edit marks as made from other inputs, and the tables that follow a comparison."""
    checked.failure(checks.refused_marks, [*tab.inputs, tab.state], tab.marked, api_name=False)
    edited_io = dict(fn=checks.edited, inputs=[*tab.inputs, tab.ran, tab.state, tab.divergence], outputs=tab.marked,
                     api_name=False, show_progress="hidden", queue=False)
    for component in tab.inputs:
        component.change(trigger_mode="always_last", **edited_io)
    # and at its end, for the edits made while it ran (against the views and inputs on the page then,
    # which a later click's comparison may have replaced: each comes with its own)
    compare.success(**edited_io)
    # A refusal's marks go too (the text panels' go with the run's first update).
    checked.success(lambda: {tab.fates_note: compare_fates(None, "")[0],
                             tab.fates: gr.update(value=None, visible=False, label=FATES_LABEL)},
                    None, [tab.fates_note, tab.fates], api_name=False, queue=False)
    checked.success(lambda: gr.update(value=None, visible=False, label=STABILITY_LABEL), None, tab.diagnostics,
                    api_name=False, queue=False)
    follow = dict(fn=functools.partial(compare_follow, tab), inputs=[tab.state, tab.follow],
                  outputs=[tab.fates_note, tab.fates, *tab.figs], api_name=False)
    compare.then(**follow)
    compare.then(compare_diagnostics, tab.state, tab.diagnostics, api_name=False)
    tab.follow.change(**follow, trigger_mode="always_last")


class CompareChecks:
    """The Compare click's check, and what the page says of the inputs around it: at the click, what it waits
    for (:meth:`announce`); refused, the reason and the previous comparison marked as such
    (:meth:`refused_marks`); edited, the reason as the inputs change, or the comparison on the page marked as
    made from earlier inputs (:meth:`edited`)."""

    def __init__(self, limits: Limits, tab: CompareTab):
        self.limits, self.tab = limits, tab

    def problem(self, model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
                temperature=0.0, top_p=1.0, seed=0, load: bool = True) -> str | None:
        """What is wrong with these inputs, if anything; ``load=False`` checks no further than the settings
        unless the model is loaded already."""
        try:
            settings = compare_settings(names)
            if load or model_name in _models:
                validate(self.limits, model_name, prompt, budget_mode, compression, budget, max_new_tokens, chat,
                         list(build_policies(settings).values()), temperature, top_p, seed)
            else:
                check_settings(self.limits, model_name, prompt, budget_mode, max_new_tokens)
                check_sampling(temperature, top_p, seed)
        except ValueError as error:
            return str(error)
        return None

    def check(self, *inputs) -> None:
        try:
            reason = self.problem(*inputs)
        except Exception as error:
            raise unexpected("checking the comparison", error) from None
        if reason:
            raise refused(reason)

    def refusal_note(self, *inputs):
        """In the page, where the comparison would have been: the toast's reason, which outlives the toast.

        Also runs when Stop cancels the check: then it neither loads a model nor writes a thing.
        """
        try:
            reason = self.problem(*inputs, load=False)
        except Exception:  # noqa: BLE001 -- the check reported it
            reason = None
        return f"{NOT_COMPARED}{reason}.*" if reason else gr.skip()

    def edited(self, *values) -> dict:
        """An edit of the inputs, by hand or by a preset, with the last comparison (``views``, the inputs it
        ran on and its note: ``ran``) and the note on the page.

        After a refused click the reason follows the inputs as they are now (:meth:`refused_marks`, while they
        would still be refused).  Otherwise the comparison on the page is marked where the inputs it ran on
        have changed (:func:`changed_inputs`): the note names them and each panel and table says "earlier
        inputs", so that it is not read as these inputs' result (Follow searches that run, too); the inputs
        it ran on, set back, take the marks off."""
        *inputs, ran, views, note = values
        tab = self.tab
        refused_note = isinstance(note, str) and note.startswith(NOT_COMPARED)
        try:
            reason = self.problem(*inputs, load=False) if refused_note else None
        except Exception:  # noqa: BLE001 -- the next click's check reports it
            return gr.skip()
        if reason:
            return self.refused_marks(*inputs, views)
        if not views or not ran or ran.get("inputs") is None:  # none has ended (or one is running)
            return {tab.divergence: ""} if refused_note else gr.skip()
        changed = changed_inputs(ran["inputs"], compared_inputs(*inputs))
        mark = earlier_inputs(changed, "comparison ran", "compare again") + "\n\n" if changed else ""
        suffix = " · earlier inputs" if changed else ""
        texts = {text: gr.update(label=label + suffix) for text, label in zip(tab.texts, compared_labels(views))}
        tables = {table: gr.update(label=label + (" (earlier inputs)" if changed else ""))
                  for table, label in ((tab.fates, FATES_LABEL), (tab.diagnostics, STABILITY_LABEL))}
        return {tab.divergence: mark + ran["note"], **texts, **tables}

    def announce(self, *inputs_and_state) -> dict:
        """At the click, while the check loads the model (its first comparison): say so where the
        comparison will be, after any repeats' note, and, with no earlier comparison on the page, label one
        panel per chosen policy.  Nothing when the model is loaded or the inputs will be refused."""
        *inputs, state = inputs_and_state
        try:
            loading = loading_note(inputs[0])
            if loading is None or self.problem(*inputs, load=False):
                return gr.skip()
            labels = list(compare_settings(inputs[2]))
        except Exception:  # noqa: BLE001 -- the check reports it
            return gr.skip()
        note = {self.tab.divergence: f"{repeats_note(inputs[2])}\n\n{loading}".lstrip()}
        # Panels that hold an earlier comparison keep its labels until this one passes its check.
        return note | starting_panels(self.tab, labels) if state is None else note

    def refused_marks(self, *inputs_and_state) -> dict:
        """A refused click: :meth:`refusal_note`, and the previous comparison's panels and tables, which stay
        as the Live tab's last run does, each marked as the previous comparison's, so that they are not
        taken for these inputs' results (its next comparison relabels them).  With no comparison yet, the
        panels the click labelled go back to their placeholders."""
        *inputs, state = inputs_and_state
        tab = self.tab
        note = self.refusal_note(*inputs)
        if not isinstance(note, str):  # Stop cancelled the check: nothing was refused
            return gr.skip()
        if not state:
            return {tab.divergence: note,
                    **{text: gr.update(label=f"policy {i + 1}") for i, text in enumerate(tab.texts)}}
        labels = list(state)
        # its sizes and divergence lines too, which the refusal's note takes the place of
        note += (f"\n\n*Shown: the {PREVIOUS} ({', '.join(labels)}), not these inputs' results.*\n\n"
                 + divergence_markdown(labels, state))
        texts = {text: gr.update(label=f"{label} · {PREVIOUS}")
                 for text, label in zip(tab.texts, compared_labels(state))}
        tables = {table: gr.update(label=f"{PREVIOUS.capitalize()}: {label}")
                  for table, label in ((tab.fates, FATES_LABEL), (tab.diagnostics, STABILITY_LABEL))}
        return {tab.divergence: note, **texts, **tables}


def make_compare_handler(limits: Limits, tab: CompareTab, pacers: Pacers | None = None):
    """The Compare button's handler: the comparison streamed into the tab's panels, by its click's ticket;
    ``session`` names the browser session whose page acknowledges drawn panels to ``pacers``."""
    pacers = Pacers(limits.figures_per_second / 4) if pacers is None else pacers

    def compare_run(model_name, prompt, names, budget_mode, compression, budget, max_new_tokens, chat,
                    temperature=0.0, top_p=1.0, seed=0, ticket_id="", tickets=None, *, session: str = ""):
        pacer = pacers.start(session, "compare")
        try:
            yield from ticketed(ticket_id, tickets, lambda ticket, made: compare_steps(
                ticket, made, pacer, model_name, prompt, names, budget_mode, compression, budget, max_new_tokens,
                chat, temperature, top_p, seed))
        finally:
            pacers.finish(session, "compare", pacer)

    def compare_steps(ticket, made, pacer, model_name, prompt, names, budget_mode, compression, budget,
                      max_new_tokens, chat, temperature, top_p, seed):
        if made:  # as in the Live tab: /stop_compare reaches it from now on
            yield {tab.buttons.tickets: made}
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
        # One empty panel per chosen policy, labelled, and what runs before the first token; the last
        # comparison's figures, download and state go now, not when this one ends.
        yield {**starting_panels(tab, names),
               tab.divergence: f"{repeated}\n\n{PREFILL.format(len(request.prompt_ids))}".lstrip(), tab.jaccard: None,
               tab.download: gr.update(value=None, visible=False), tab.state: None, tab.ran: None}
        try:
            # Sampled, every policy draws the same random stream: where their next-token distributions agree
            # they pick the same token, so the first divergence is still the eviction's doing.
            events = engine.decode_many(request.model, request.tokenizer, request.prompt_ids, policies,
                                        budget=request.budget, max_new_tokens=request.max_new_tokens,
                                        sampler_args=request.sampling)
            # closed on Stop or an error, so that the shared prefill under way stops at its next layer
            with closing(events_with_progress(events, request.model, len(request.prompt_ids))) as events:
                yield from streamed(tab, run, events, ticket, repeated, pacer)
            result = comparison_result(tab, run, stopped=ticket.is_set(), note=repeated)
            yield result | {tab.ran: {"inputs": ran_inputs, "note": result[tab.divergence]}}
        except Exception as error:
            if ticket.is_set():
                stopped_run_failed("the stopped comparison", error)
                return
            raise unexpected("the comparison", error) from None
        finally:
            release_memory()

    return compare_run


def streamed(tab: CompareTab, run: Progress, events, ticket, note: str, pacer: FramePacer):
    """The comparison's updates as it decodes, until it ends or ``ticket`` is stopped (where every policy still
    decoding has made the same steps): the shared prefill's progress until the first token, the texts when
    ``pacer.text_due``, the panels when ``pacer`` says the page drew the last ones (at most a quarter of the
    Live tab's figure rate: four panels a refresh)."""
    names = list(run.views)
    last_text = 0.0
    for item in events:
        if isinstance(item, str):  # the prefill's progress, before the first event
            if ticket.is_set():
                break
            yield {tab.divergence: f"{note}\n\n{item}".lstrip()}
            continue
        name, event = item
        run.add(name, event)
        if ticket.is_set() and run.level():
            break
        now = time.perf_counter()
        refresh = pacer.due(now)
        if not refresh and not pacer.text_due(last_text, now):
            continue  # each policy's event would otherwise be an update of its own
        if refresh:
            pacer.send(now)
        last_text = now
        yield compare_outputs(tab, names, run.texts, run.views, figures=refresh, final=False, note=note)


def starting_panels(tab: CompareTab, labels) -> dict:
    """The Compare tab's text and figure panels as a comparison of ``labels`` starts: one empty, labelled
    panel each, the rest hidden."""
    texts = {text: gr.update(value="", label=labels[i], visible=True) if i < len(labels)
             else gr.update(value="", visible=False) for i, text in enumerate(tab.texts)}
    return texts | {fig: gr.update(value=None, visible=i < len(labels)) for i, fig in enumerate(tab.figs)}


def placeholder_panels(tab: CompareTab, entries, state) -> dict:
    """Before any comparison, one empty panel per chosen setting, labelled with it (the page starts with
    three, which a four-policy preset left at three); once one has run, its panels stay until the next, and
    entries the run's check would refuse leave the panels as they are."""
    if state is not None:
        return gr.skip()
    try:
        labels = list(compare_settings(entries))
    except Exception:  # noqa: BLE001 -- the run's check says what is wrong with the entries
        return gr.skip()
    return starting_panels(tab, labels)


def comparison_result(tab: CompareTab, run: Progress, stopped: bool = False, note: str = "") -> dict:
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
        download = None  # left as it is: the last comparison's went as this one started
    outputs = compare_outputs(tab, list(run.views), run.texts, run.views, figures=True, final=True,
                              download=download, note=note)
    outputs[tab.divergence] = stop_note + outputs[tab.divergence]
    return outputs


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


def compare_outputs(tab: CompareTab, names, texts, views, figures: bool, final: bool, download=None,
                    note: str = "") -> dict:
    """A comparison's panels as it streams (``figures``: with the retention panels, else the texts alone) or
    once ``final``: with the divergence lines (after ``note``), the Jaccard plot, its ``download`` and state."""
    outputs = {text: gr.update(value=texts[names[i]], label=names[i] + ended_note(views[names[i]]), visible=True)
               if i < len(names) else gr.update(value="", visible=False) for i, text in enumerate(tab.texts)}
    panels = compare_panels({name: views[name] for name in names}) if figures and names else []
    for i, fig in enumerate(tab.figs):
        if i < len(names) and figures:
            outputs[fig] = gr.update(value=panels[i], visible=True)
        elif i >= len(names):
            outputs[fig] = gr.update(visible=False)
    if figures or final:
        outputs[tab.divergence] = (f"{note}\n\n{divergence_markdown(names, views)}" if note
                                   else divergence_markdown(names, views))
        outputs[tab.jaccard] = jaccard_figure(names, views)
    if download is not None:
        outputs[tab.download] = download
    if final:
        outputs[tab.state] = views
    return outputs


def compare_follow(tab: CompareTab, views: dict[str, RunView] | None, query: str) -> dict:
    """The fates table (:func:`compare_fates`) and the retention panels with the same tokens marked; the
    panels are left alone while no comparison has ended (one decoding draws them)."""
    if not views:
        note, table = compare_fates(views, query)
        return {tab.fates_note: note, tab.fates: table}
    followed = followed_prompt_tokens(views, query)
    # Only what was typed: the disputed tokens listed when nothing is are mostly the chat template's, in a
    # clump at the start that hid the panels' left edge.
    marked = followed[0] if (query or "").strip() else []
    note, table = compare_fates(views, query, followed)
    return {tab.fates_note: note, tab.fates: table,
            **{fig: gr.update(value=panel) for fig, panel in zip(tab.figs, compare_panels(views, marked))}}
