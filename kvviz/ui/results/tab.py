"""The Results tab's layout and wiring: the filters, a closed accordion per section (the first open), and
each filter combination drawn once, in a thread of its own."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import gradio as gr
import pandas as pd
import plotly.graph_objects as go

from ...store import FULL_CACHE_FLOOR, QUALITY_METRICS, Store
from ..checks import refused
from .colours import Colours
from .compose import ALL, OPEN, SECTIONS, SETTINGS_BOX, default_reference, sections
from .layout import _empty, note_markdown
from .lines import SHOW_ALL, SHOWN_MOST
from .pairing import PAIRINGS

log = logging.getLogger(__name__)

FILTERS_CACHED = 64  # filter combinations whose figures the tab keeps (under 1 MB each on the shipped store)
PER_SECTION = 4  # outputs of each section: its figure, the note under it, its table and its CSV
# What a closed section shows while the open ones are already drawn for new filters: no figure, table or
# download of the earlier filters under the new ones
PENDING = (_empty(go.Figure(layout=dict(height=160, margin=dict(t=20, b=20))),
                  "drawing for the new filters: a few seconds"), "",
           pd.DataFrame({"table": ["drawing for the new filters"]}), gr.update(value=None))


class Drawing:
    """One filter combination's sections, drawn in a thread of its own and read by every request for it.

    The thread, not a request, draws: a request that goes away (a filter changed again, a closed page)
    leaves no half-drawn combination behind, and requests for it while it is drawn wait for the same
    figures.  ``parts`` maps a section's index in ``SECTIONS`` to its (figure, table, CSV update), as
    ``keep(index, section)`` returns them; ``opened`` is set once the ``OPEN`` sections are drawn, ``done``
    once all are (both also when drawing failed, with ``error`` set).
    """

    def __init__(self, sections, keep):
        self.parts: dict[int, tuple] = {}
        self.error: Exception | None = None
        self.opened, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._draw, args=(sections, keep), name="results-draw", daemon=True).start()

    def _draw(self, sections, keep) -> None:
        opened = {SECTIONS.index(title) for title in OPEN}
        try:
            for index, section in sections:
                self.parts[index] = keep(index, section)
                if opened <= self.parts.keys():
                    self.opened.set()
        except Exception as error:  # logged here, with its traceback; raised to each request for it as one line
            log.exception("drawing the results failed")
            self.error = error
        finally:
            self.opened.set()
            self.done.set()

    def outputs(self, pending: tuple | None = None) -> tuple:
        """Every output in the tab's order: a drawn section's (an update dict anew each time: Gradio may
        consume it), and ``pending`` for one not drawn yet."""
        return tuple(dict(item) if isinstance(item, dict) else item
                     for index in range(len(SECTIONS)) for item in self.parts.get(index, pending))


# A reader of the papers takes a near-zero row for a broken implementation: say where it comes from
QUALITY_NOTE = ("Measured rows are SmolLM2-135M on short synthetic tasks, not the papers' 8B models. "
                "A row can be low by design rather than by fault: AvoKV-E near 0 on single_needle and "
                "multi_key_needle, whose answers are numbers, comes from its first checkpoint compressing "
                "an over-budget prompt, where key redundancy (weight 0.9) drops a number's mutually "
                "similar digit tokens (`benchmarks/avokv_needle_digits.py`); needle_grid's needle is a "
                "sentence of words, which it keeps as well as the others do. The paper applies it to "
                "generated reasoning, where the prompt fits the budget. "
                "`docs/findings.md` discusses each such row.")


# What a section says above its figure: what its rows are and which filters apply
INTROS = {
    "Quality vs compression": QUALITY_NOTE,
    "Measured vs paper": (
        "Paper rows are each benchmark's printed aggregate; measured rows are the tasks that stand in for it here "
        "(e.g. the RULER-style generators): their mean score divided by the full cache's mean score on the same "
        f"tasks, leaving out any task where the full cache itself scores under {FULL_CACHE_FLOOR:g}; the note "
        "under the figure names them. Models differ: compare shapes, not levels. The policy filter applies; "
        "model, task and source do not. A paper row's samples are the printed cells it averages."),
    "Paired differences": (
        "Each policy's score minus the reference's on the same samples (same prompt and generation settings), so "
        "that the task's own noise cancels: the mean difference, its 95% paired-bootstrap interval and wins / "
        "ties / losses with an exact sign test in the table. By default a policy that holds more cache than the "
        "reference at one nominal cut is paired at equal cache held instead (`kvviz/held.py`). Measured rows "
        "only."),
    "InertiaKV settings vs its defaults": (
        "Does InertiaKV's α or its lazy refresh change anything? Each setting that was run (α, refresh interval, "
        "score-free, layer weighting) against InertiaKV at its defaults on the same samples: interval, sign test "
        "(McNemar's on 0/1 scores) and the smallest difference the run could detect, in the table. A new sweep "
        "of these settings shows here as it lands in `results_db/`."),
    "Quality vs decode speed": (
        "Decode speed as each cell recorded it on the machine it ran on: compare speeds within one run, or "
        "measure them together with `kvviz bench speed --policies ...`."),
    "Damage ranking (AvoKV-E Table 3)": (
        "How well each policy's utility at one decode step ranks what removing each entry would cost, against the "
        "damage probe (`kvviz probe`). The policy filter applies, and the sweeps to measured rows; model, task "
        "and source do not. `kvviz results --ranking --vs inertia` pairs the policies trace by trace."),
}


def build_results_tab(tab: gr.Tab, store: Store | None = None, warm: bool = False) -> None:
    """Lay out ``tab``'s content inside it; figures render when the tab is first opened and on every filter
    change, each filter combination once (and with ``warm`` the defaults at once, in the background).

    Not at the page's load: the figures are megabytes a visitor who never opens the tab would download, and a
    page holding them answered every click elsewhere about 60% slower (software-rendered Chromium, 2 cores)."""
    store = store or Store()
    if store.problems:
        gr.Markdown("**Some results could not be read:**\n" + "\n".join(f"- {p}" for p in store.problems))
    if not store.shards:
        gr.Markdown("No sweep results are stored yet (`results_db/` is empty). "
                    "Run `kvviz bench run CONFIG` to add some.")
        return
    filters, outputs = _filters(store), []
    measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
    for title in SECTIONS:
        with gr.Accordion(title, open=title in OPEN):
            if title in INTROS:
                gr.Markdown(INTROS[title])
            if title == "Measured vs paper":
                suites = store.comparable_suites() or ["RULER"]
                filters["suite"] = gr.Dropdown(suites, value=suites[0], label="Benchmark")
            if title == "Paired differences":
                filters["reference"] = gr.Dropdown(measured, value=default_reference(measured),
                                                   label="Reference policy")
                filters["pairing"] = gr.Radio(list(PAIRINGS), value=PAIRINGS[0], label="Pair samples")
            # The accordion names the figure: a label tag (Gradio's default, "Plot") covered its title's start
            outputs += [gr.Plot(label=title, show_label=False), gr.Markdown(),
                        gr.Dataframe(interactive=False, max_height=300), gr.DownloadButton("Download CSV")]
    _wire(tab, store, [filters[name] for name in FILTER_ORDER], outputs, warm)


# The order sections() takes the filters in
FILTER_ORDER = ("model", "task", "policies", "source", "suite", "reference", "settings", "sweeps", "every", "pairing")


def _filters(store: Store) -> dict:
    """The filters above the sections, by name (the sections add the benchmark, reference and pairing)."""
    with gr.Row():
        model = gr.Dropdown([ALL, *store.options("model")], value=ALL, label="Model")
        task = gr.Dropdown([ALL, *store.options("task")], value=ALL, label="Task")
        measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
        ranked = store.options("policy", source="measured")
        # names only a paper reports, or only a damage-ranking sweep ranked, are marked as such
        policies = gr.Dropdown([name if name in measured else (f"{name} (damage ranking only)", name)
                                if name in ranked else (f"{name} (paper only)", name)
                                for name in store.options("policy")], value=[], multiselect=True,
                               label="Policies (none = all)")
        # measured first: paper scores are on each benchmark's own scale (0-100, 0-1, %), ours are 0-1
        source = gr.Radio([ALL, "measured", "paper"], value="measured", label="Source")
    # A row of its own: a fifth column beside the four above, its long label wrapped a word a line at 1000 px
    with gr.Row():
        settings = gr.Checkbox(False, label=f"{SETTINGS_BOX} (α and refresh sweeps, intervals, "
                                            "ablations): each its own policy, e.g. 'avokv interval=16', paired "
                                            "against the reference at its defaults")
    with gr.Row():
        every = gr.Checkbox(False, label=f"{SHOW_ALL}: with none chosen, each figure draws at most {SHOWN_MOST} "
                                         "(the full cache, InertiaKV and the headline baselines first)")
    with gr.Row():
        # One run's cells (docs/findings.md says where and when each ran): its speeds compare
        sweeps = gr.Dropdown(store.options("sweep"), value=[], multiselect=True,
                             label="Sweeps (none = all; a cell run by two sweeps counts in either)")
    return dict(model=model, task=task, policies=policies, source=source, settings=settings, sweeps=sweeps,
                every=every)


def _wire(tab: gr.Tab, store: Store, filters: list, outputs: list, warm: bool) -> None:
    """Draw each filter combination once, in a thread of its own, and send the open sections first; opening
    the tab again sends nothing the page already shows."""
    colours = Colours.of(store)
    # The store does not change while the app runs, so each filter combination is drawn once (3-8 s of this
    # 2-core machine's time); a page opening the tab asks for the defaults first, drawn as the app starts.
    drawings: OrderedDict[tuple, Drawing] = OrderedDict()  # the last FILTERS_CACHED combinations, newest last
    guard = threading.Lock()

    def kept(index: int, section: tuple) -> tuple:
        # kept as the JSON Gradio sends (a Plot passes its own PlotData through), not turned into it per request
        figure, table, csv = section
        plot = outputs[PER_SECTION * index]
        return plot.postprocess(figure), note_markdown(figure), table, csv

    def drawing_for(key: tuple) -> Drawing:
        with guard:
            drawing = drawings.get(key)
            if drawing is None or drawing.error is not None:  # a failed drawing is tried again
                drawing = drawings[key] = Drawing(sections(store, *_arguments(key, colours)), kept)
                if len(drawings) > FILTERS_CACHED:
                    drawings.popitem(last=False)
            drawings.move_to_end(key)
            return drawing

    def handler(*values):
        key = _key(*values)
        drawing = drawing_for(key)
        drawing.opened.wait()
        if not drawing.done.is_set():  # the open sections now; the others say they are being drawn
            yield (*drawing.outputs(pending=PENDING), None)
        drawing.done.wait()
        if drawing.error is not None:  # a line the user can read: with show_error off, a bare "Error" otherwise
            error = drawing.error
            raise refused(f"drawing the results failed: {type(error).__name__}: {error}; change a filter or "
                          "reload the page to draw them again")
        # every section, the open ones again: the last update is what an API client gets
        yield (*drawing.outputs(), key)

    def opened(shown, *values):
        if shown == _key(*values):  # opened again, its filters unchanged: the page has these figures
            yield (gr.skip(),) * (len(outputs) + 1)
            return
        yield from handler(*values)

    if warm:  # what the tab's first opening asks for, drawn before anyone asks
        drawing_for(_key(*(widget.value for widget in filters)))

    shown = gr.State(None)  # the filters whose figures this page shows
    tab.select(opened, [shown, *filters], [*outputs, shown], api_name=False, trigger_mode="always_last")
    # always_last: a filter changed while the figures for the last one are drawn is queued, not dropped
    # (Gradio's default, "once", ignored it, and the figures kept showing the earlier filters)
    gr.on([widget.change for widget in filters], handler, filters, [*outputs, shown], api_name="results",
          api_visibility="undocumented", trigger_mode="always_last")


def _key(model, task, policies, source, suite, reference, settings, sweeps=None, every=False,
         pairing=PAIRINGS[0]) -> tuple:
    """One filter combination, hashable: what the drawings are kept by."""
    return (model, task, tuple(policies or ()), source, suite, reference, bool(settings), tuple(sweeps or ()),
            bool(every), pairing)


def _arguments(key: tuple, colours: Colours) -> list:
    """A key's filters as :func:`sections` takes them, in order after the store."""
    model, task, policies, source, suite, reference, settings, sweeps, every, pairing = key
    return [model, task, list(policies), source, suite, colours, reference, settings, list(sweeps), every, pairing]
