"""The Gradio app: Start here (:mod:`.landing`), Live (stream one policy, :mod:`.live`), Compare (2-4 policies
on one shared prefill, :mod:`.compare`), Results (:mod:`.results`), and the /generate API (:mod:`.api`).

Handlers consume the engine's step events and nothing else.  Every input is validated before any model
work starts and a bad one is refused with what to change (:mod:`.checks`); anything else that goes wrong
reaches the user as a one-line message too (its traceback goes to the server log only).  A run that
fails drops its state; one that is stopped (:mod:`.tickets`) ends between two steps and is shown and saved
as far as it got; the server keeps serving.  Each tab's module makes its components (``layout``) and then
their events (``wire``); handlers return their outputs as ``{component: value}``, so that adding an output
shifts no other.
"""

from __future__ import annotations

import gradio as gr

from ..store import Store
from . import compare, landing, live
from .api import make_generate_api
from .config import Limits
from .results import build_results_tab

# A chosen name longer than its box (the Compare tab's presets beside the views) ran under the box's arrow,
# cut mid-word: it ends in an ellipsis before the arrow instead, and the open list shows it whole.  A style
# in the page rather than launch(css=...), so that every way the app is launched gets it.
APP_CSS = ".secondary-wrap input { text-overflow: ellipsis; padding-right: 24px !important; }"


def build_app(limits: Limits | None = None, store: Store | None = None, warm: bool = False) -> gr.Blocks:
    """The whole app; ``warm`` (the served app) draws the Results tab's default figures as it is built."""
    limits = limits or Limits.from_env()
    # Gradio's copies of the downloads expire after two hours, checked hourly (else they pile up for good).
    with gr.Blocks(title="kvviz", delete_cache=(3600, 7200)) as app:
        # the style travels with the heading: an element of its own took a row's gap of the page
        gr.Markdown("# kvviz\nWatch what a KV-cache eviction policy keeps and drops while the model decodes."
                    f"<style>{APP_CSS}</style>", sanitize_html=False)
        shipped = landing.load_landing()
        if shipped is not None:  # the first thing a visitor sees: eviction changing an answer, no model loaded
            with gr.Tab("Start here", elem_id="start-here"):
                landing.layout(shipped)
        live_tab = live.layout(limits)
        live.wire(app, live_tab, limits)
        compare_tab = compare.layout(limits)
        compare.wire(app, compare_tab, limits)
        with gr.Tab("Results") as results_tab:
            build_results_tab(results_tab, store, warm=warm)
        gr.api(make_generate_api(limits), api_name="generate", concurrency_limit=limits.runs_per_model,
               concurrency_id="model")
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
