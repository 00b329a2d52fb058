"""The app end to end through gradio_client (tiny random model), its figures, and the Space packaging."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd
import pytest
from servers import free_port, serve

import kvviz
from kvviz.ui.config import Limits
from kvviz.ui.figures import EMPTY, FOLLOW_COLORS, STEP_MARKER_COLOR, RunView

ROOT = Path(__file__).resolve().parent.parent
TINY = "tiny-random-llama"
PROMPT = "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. " * 3


@functools.cache
def tabs():
    """The Live and Compare tabs' components, which the handlers return their outputs by."""
    from kvviz.ui import compare, live

    with gr.Blocks():
        return live.layout(Limits(models=(TINY,))), compare.layout(Limits(models=(TINY,)))


def live_tab():
    return tabs()[0]


def compare_tab():
    return tabs()[1]


def outputs_of(update: dict, components: list) -> list:
    """A handler's update (``{component: value}``, or one skip of them all) as a list in ``components``' order,
    each left out one a skip."""
    if update == gr.skip():
        return [gr.skip()] * len(components)
    return [update.get(component, gr.skip()) for component in components]


def positional(handler, components: list):
    """``handler`` with its update read back in ``components``' order (:func:`outputs_of`)."""
    return lambda *args, **kwargs: outputs_of(handler(*args, **kwargs), components)


@pytest.fixture(scope="module")
def client():
    from gradio_client import Client

    from kvviz.ui.app import build_app

    # max_new_tokens leaves room for a run long enough to be cancelled half-way.
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=3000, queue_size=8,
                    host="127.0.0.1", port=free_port())
    app = build_app(limits)
    app.queue(default_concurrency_limit=1, max_size=limits.queue_size)
    url = serve(app, limits.port)
    try:
        yield Client(url, verbose=False)
    finally:
        app.close()


def test_generate_endpoint_streams_what_the_cli_keeps(client, capsys):
    from kvviz.cli import main

    job = client.submit(PROMPT, "inertia", 0.5, 12, False, TINY, "{}", api_name="/generate")
    updates = list(job)
    assert len(updates) >= 2  # streamed, not one final answer
    final = job.outputs()[-1]
    assert main(["generate", "--model", TINY, "--prompt", PROMPT, "--no-chat", "--policy", "inertia",
                 "--compression", "0.5", "--max-new-tokens", "12", "--json"]) == 0
    cli = json.loads(capsys.readouterr().out)
    assert final["budget"] == cli["budget"] and final["prompt_len"] == cli["prompt_len"]
    assert [u["kept"] for u in job.outputs()][1:] == [step["kept"] for step in cli["steps"]]
    assert final["text"] == cli["text"]


@pytest.mark.parametrize(
    "args, message",
    [
        (("", "inertia", 0.5, 8, False, TINY, "{}"), "prompt is empty"),
        ((PROMPT, "inertia", 1.5, 8, False, TINY, "{}"), "compression"),
        ((PROMPT, "inertia", 0.5, 8, False, "some/other-model", "{}"), "not available"),
        ((PROMPT * 20, "inertia", 0.5, 8, False, TINY, "{}"), "limit"),
        ((PROMPT, "inertia", 0.5, 8, False, TINY, '{"alpha": 3}'), "alpha"),
        ((PROMPT, "avokv", 0.9, 8, False, TINY, "{}"), "protects"),  # budget under the protected tail
        ((PROMPT, "nope", 0.5, 8, False, TINY, "{}"), "unknown policy"),
        ((PROMPT, "inertia", 0.5, 99999, False, TINY, "{}"), "max new tokens"),
        # Inputs that once escaped as TypeError/OverflowError (an opaque "upstream error" for the client):
        ((PROMPT, "inertia", 0.5, 8, False, TINY, '{"alpha": [1]}'), "alpha must be a number"),
        ((PROMPT, "inertia", 0.5, 8, False, TINY, '{"refresh": Infinity}'), "refresh must be a finite number"),
        ((PROMPT, "inertia", None, 8, False, TINY, "{}"), "compression must be a number"),
        ((PROMPT, "inertia", 0.5, None, False, TINY, "{}"), "max new tokens is empty; type a whole number"),
        ((PROMPT, "inertia", 0.5, 8, False, TINY, '{"layers": "99"}'), "beyond this model"),
        # Silently ignored or misread before:
        ((PROMPT, "inertia", 0.5, 8, False, TINY, '{"alpah": 0.1}'), "no parameter"),
        ((PROMPT, "avokv", 0.5, 8, False, TINY, '{"normalise": "maybe"}'), "true or false"),
        ((PROMPT, "inertia", 0.5, 8, False, TINY, "[1]"), "JSON object"),
        ((PROMPT, "inertia", 0.5, 8, False, TINY, "{alpha: 1"), "not valid JSON"),
        # a TypeError from deep inside before: a list where the policy's name goes
        ((PROMPT, ["inertia"], 0.5, 8, False, TINY, "{}"), "unknown policy"),
    ],
)
def test_bad_input_gets_a_message_and_the_server_keeps_serving(client, args, message):
    with pytest.raises(Exception, match=message):
        client.predict(*args, api_name="/generate")
    assert client.predict(PROMPT, "full", 0.0, 3, False, TINY, "{}", api_name="/generate")["step"] == 2


def test_generate_takes_params_as_an_object_too(client):
    """Its signature says a JSON string; an object sent as itself (a TypeError from json.loads before) means
    the same, and is checked the same."""
    assert client.predict(PROMPT, "inertia", 0.5, 3, False, TINY, {"alpha": 0.5}, api_name="/generate")["step"] == 2
    with pytest.raises(Exception, match="no parameter"):
        client.predict(PROMPT, "inertia", 0.5, 3, False, TINY, {"alpah": 0.5}, api_name="/generate")


def test_parameter_widgets_take_the_selected_policys_meaning():
    """Widgets are shared by parameter name; SnapKV's window (>= 1, prompt queries that vote) is not R-KV's
    (>= 0, recent entries kept), and the strings a JSON client sends are read as what they say."""
    from kvviz.ui.checks import policy_from_inputs
    from kvviz.ui.controls import shown_parameters

    updates = shown_parameters("snapkv")
    assert updates["window"]["visible"] and updates["window"]["minimum"] == 1
    assert "vote" in updates["window"]["label"] and "pooling" in updates["kernel"]["label"]
    rkv = shown_parameters("rkv")
    assert rkv["window"]["minimum"] == 0 and "recent" in rkv["window"]["label"]
    assert not updates["alpha"]["visible"]
    assert policy_from_inputs("avokv", {"normalise": "false"}, strict=True).normalise is False
    assert policy_from_inputs("inertia", {"refresh": 4.0, "sinks": 3}).refresh == 4  # other policies' widgets ignored


def test_parameters_a_setting_leaves_unused_are_hidden_and_keep_their_values(tiny):
    """Cumulative's alpha is not offered; choosing aggregation=sum for InertiaKV hides alpha, and the run leaves
    it out (it is not refused for a value it would ignore); choosing ema shows it again holding what it held,
    so that single-step stays single-step (alpha 0) after sum and back."""
    from kvviz.policies import REGISTRY
    from kvviz.ui.checks import PARAM_NAMES, _models, policy_from_inputs
    from kvviz.ui.controls import describe, parameters_in_use, shown_parameters

    shown = shown_parameters("cumulative")
    assert not shown["alpha"]["visible"] and shown["refresh"]["visible"]
    assert shown_parameters("inertia")["alpha"]["visible"]
    widgets = {name: None for name in PARAM_NAMES} | {"alpha": 0.3, "aggregation": "sum", "refresh": 2, "window": 5}
    after = parameters_in_use("inertia", *widgets.values())
    assert after["alpha"] == {"__type__": "update", "visible": False}  # its value stays
    assert after["refresh"] == {"__type__": "update", "visible": True}
    assert after["window"] == {"__type__": "update"}  # not inertia's: left alone
    summed = policy_from_inputs("inertia", widgets)  # alpha 0.3, hidden, is left out: the registry's cumulative
    assert (summed.aggregation, summed.alpha, summed.refresh) == ("sum", 0.8, 2)
    with pytest.raises(ValueError, match="alpha does nothing"):  # the API's JSON says what it sends
        policy_from_inputs("inertia", {"alpha": 0.3, "aggregation": "sum"}, strict=True)
    again = parameters_in_use("inertia", *(widgets | {"aggregation": "ema"}).values())
    assert again["alpha"] == {"__type__": "update", "visible": True}
    single = widgets | {"alpha": 0.0, "refresh": 1}  # single-step's widgets after sum and back to ema
    assert policy_from_inputs("single-step", single | {"aggregation": "ema"}).alpha == 0.0
    assert policy_from_inputs("single-step", single).alpha == 0.8  # under sum: cumulative's run
    _models[TINY] = tiny  # the description states the previous-step weight of what would run
    assert "with these parameters: **1**." in describe("single-step", TINY, *single.values())
    # ... and describes what it now is, not the entry picked
    assert describe("single-step", TINY, *single.values()).startswith(
        "These settings are **cumulative**: **Cumulative** (InertiaKV ablation). m <- m + s")
    assert describe("single-step", TINY, *(single | {"aggregation": "ema"}).values()).startswith("**Single-step**")
    assert describe("inertia", TINY, *(single | {"aggregation": "ema", "alpha": 0.5}).values()).startswith(
        "**InertiaKV**. Layer-sequential EMA")  # alpha 0.5 is still InertiaKV; its family is its name, said once
    assert "with these parameters: **0**." in describe("single-step", TINY, *(single | {"aggregation": "ema"}).values())
    # a changed value that is no other entry is named beside the entry's text, which describes the entry's value
    assert "Changed here" not in describe("single-step", TINY, *(single | {"aggregation": "ema"}).values())
    halfway = describe("inertia", TINY, *(single | {"aggregation": "ema", "alpha": 0.5}).values())
    assert "Changed here: `alpha` = **0.5**, not 0.8 (EMA coefficient" in halfway
    assert "`refresh`" not in halfway  # refresh 1 is InertiaKV's own
    expected = widgets | {p["name"]: p["default"] for p in REGISTRY["expected-attention"].parameters()}
    assert "Changed here: `vnorm` = **false**, not true (multiply the expected attention by the value norm)." in \
        describe("expected-attention", TINY, *(expected | {"vnorm": False}).values())
    decoupled = parameters_in_use("inertia-decoupled",
                                  *(widgets | {"aggregation": "ema", "layer_weighting": "last"}).values())
    assert decoupled["last_k"]["visible"] and not decoupled["layers"]["visible"]


def live_caches() -> int:
    """Evicting caches alive in this process (a run that let go of its own leaves none)."""
    import gc

    from kvviz.engine import EvictingCache

    gc.collect()
    return sum(type(o) is EvictingCache for o in gc.get_objects())


def test_a_run_cancelled_half_way_stops_frees_its_cache_and_the_server_keeps_serving(client):
    import time

    before = live_caches()
    job = client.submit(PROMPT, "inertia", 0.5, 3000, False, TINY, "{}", api_name="/generate")
    deadline = time.monotonic() + 60
    while len(job.outputs()) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(job.outputs()) >= 3  # streaming has started
    job.cancel()
    time.sleep(1.0)
    stopped_at = len(job.outputs())
    time.sleep(1.0)
    assert len(job.outputs()) == stopped_at < 3000  # nothing more arrives
    while live_caches() > before and time.monotonic() < deadline:  # the server thread lets go of it
        time.sleep(0.1)
    assert live_caches() == before
    assert client.predict(PROMPT, "tova", 0.5, 4, False, TINY, "{}", api_name="/generate")["step"] == 3


def outputs_after(job, count: int) -> None:
    import time

    deadline = time.monotonic() + 60
    while len(job.outputs()) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(job.outputs()) >= count  # streaming has started


def finished(job) -> tuple:
    import time

    deadline = time.monotonic() + 60
    while not job.done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert job.done()
    return job.outputs()[-1]


def test_stop_ends_the_run_and_shows_and_saves_it_as_the_first_steps_of_the_whole_run(client, tiny):
    """Stop ends the run between two steps, and its last update shows what ran as a finished run's views:
    the scrubber, the diagnostics and a trace whose steps are the first steps of the same run left to go on."""
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    job = client.submit(TINY, PROMPT, "inertia", "budget", 0.5, 24, 3000, False, *GREEDY, *widgets, "",
                        api_name="/live")
    outputs_after(job, 5)
    client.predict(api_name="/stop_live")
    text, stats, retention, ranks, timeline, fate, slider, trace_file, diag, detail = finished(job)
    trace = kvviz.Trace.load(trace_file["value"])
    steps = len(trace.events)
    assert 4 <= steps < 3000
    model, tokenizer = tiny
    whole = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=24, max_new_tokens=steps + 5).trace
    assert [e.kept.tolist() for e in trace.events] == [e.kept.tolist() for e in whole.events[:steps]]
    assert text == "".join(e.text for e in whole.events[:steps])
    # the stats name what ran: the widgets may show another setting by the time one reads them
    assert stats.startswith("**run** `inertia` · **stopped** · ") and f"**tokens** {steps} / 3000" in stats
    assert slider["visible"] and slider["maximum"] == steps - 1 and "raw utility jaccard" in diag
    assert trace.stopped and trace.max_new_tokens == 3000
    # Opened again, it reads as the stopped run it was, out of the 3000 tokens asked for.
    from gradio_client import handle_file
    opened = client.predict(handle_file(trace_file["value"]), api_name="/open_trace")
    assert opened[1].split("\n", 1)[1].startswith(f"**stopped** · **tokens** {steps} / 3000")
    client.predict(api_name="/stop_live")  # nothing running: nothing happens, and the next run goes to its end
    again = client.predict(TINY, PROMPT, "inertia", "budget", 0.5, 24, 6, False, *GREEDY, *widgets, "",
                           api_name="/live")
    assert again[1].startswith("**run** `inertia` · **tokens**")
    assert kvviz.Trace.load(again[7]["value"]).events[-1].step == 5


def test_stop_cuts_a_comparison_to_the_steps_every_policy_made_and_zips_them(client, tiny):
    import zipfile

    job = client.submit(TINY, PROMPT, ["inertia", "tova"], "budget", 0.5, 20, 3000, False, *GREEDY, "",
                        api_name="/compare")
    outputs_after(job, 6)
    client.predict(api_name="/stop_compare")
    result = finished(job)
    texts, divergence, download = result[:2], result[8], result[10]
    with zipfile.ZipFile(download["value"]) as bundle, tempfile.TemporaryDirectory() as folder:
        assert bundle.namelist() == ["1-inertia.parquet", "2-tova.parquet"]
        bundle.extractall(folder)
        traces = [kvviz.Trace.load(Path(folder) / name) for name in bundle.namelist()]
    steps = len(traces[0].events)
    assert 2 <= steps < 3000 and len(traces[1].events) == steps  # the one a step ahead was cut back
    assert divergence.startswith(f"**stopped** after {steps} of 3000 tokens (runs that had ended are whole)")
    model, tokenizer = tiny
    for trace, text, name in zip(traces, texts, ("inertia", "tova")):
        whole = kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=20, max_new_tokens=steps + 5).trace
        assert [e.kept.tolist() for e in trace.events] == [e.kept.tolist() for e in whole.events[:steps]]
        assert text["value"] == "".join(e.text for e in whole.events[:steps])


def test_a_run_stopped_before_it_starts_leaves_the_views_and_each_run_goes_by_its_own_click(tiny):
    """Each click gets a ticket of its own, unless the session's run is pending (checked, queued or decoding)
    and not stopped: that click does nothing.  Stop sets every ticket the session holds, so a run stopped
    while it waits in the queue (or is checked) leaves every view as it is when its turn comes (and when none
    decodes, Stop also cancels what waits); a ticket starts one run at most; a refused check or run frees the
    next click; an API call (no id) goes by a ticket of its own."""
    import gradio as gr

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.compare import make_compare_handler
    from kvviz.ui.live import make_live_handler
    from kvviz.ui.tickets import button_ticket, request_stop, retire, run_ticket

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    tickets, running = button_ticket(None)
    with pytest.raises(gr.Error):  # a second click while the first run is pending: ended before its check
        button_ticket(tickets)
    assert run_ticket(running, tickets)[0].id == running and run_ticket(running, tickets) == (None, None)  # once
    with pytest.raises(gr.Error):  # ... and while it decodes
        button_ticket(tickets)
    assert request_stop(tickets) == gr.skip()  # a run decodes: it ends by itself, showing what it ran
    same, later = button_ticket(tickets)  # the next click, after Stop, while the stopped run shows itself
    assert same is tickets and later != running
    assert request_stop(tickets) == gr.skip()  # Stop again: the stopped run is still showing itself
    defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
    live = make_live_handler(limits, live_tab())
    assert list(live(TINY, PROMPT, "inertia", "compression", 0.5, 0, 10, False, *GREEDY, *defaults, later,
                     tickets)) == [gr.skip()]  # every output skipped
    _tickets_of(tickets)[running].done = True  # the stopped run has shown itself
    _, compared = button_ticket(tickets)
    cancel = request_stop(tickets)  # none decodes: the hidden field changes, cancelling what waits in the queue
    assert isinstance(cancel, float) and request_stop(tickets) != cancel
    assert list(make_compare_handler(limits, compare_tab())(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0,
                                                            6, False, *GREEDY, ticket_id=compared,
                                                            tickets=tickets)) == [gr.skip()]

    _, refused = button_ticket(tickets)
    retire(tickets)  # its check refused (or a full queue refused the check or the run)
    assert run_ticket(refused, tickets) == (None, None)  # its run will not start by it
    _, full_queue = button_ticket(tickets)  # not taken for a second click of the refused run
    retire(tickets)
    _, bad_budget = button_ticket(tickets)
    with pytest.raises(gr.Error, match="budget"):  # refused as it starts (the API skips the check)
        next(live(TINY, PROMPT, "inertia", "budget", 0.5, -3, 10, False, *GREEDY, *defaults, bad_budget, tickets))
    assert run_ticket(full_queue, tickets) == (None, None)
    _, fresh = button_ticket(tickets)  # a refused run is over: the next click runs
    *_, last = live(TINY, PROMPT, "inertia", "compression", 0.5, 0, 10, False, *GREEDY, *defaults, fresh, tickets)
    tab = live_tab()
    # ran to the end; the session keeps its tickets
    assert last[tab.view_state].steps == 10 and tab.buttons.tickets not in last
    assert kvviz.Trace.load(last[tab.download]["value"]).compression == 0.5  # the trace says how B was set
    button_ticket(tickets)  # and after it, the next
    with pytest.raises(TypeError, match="ticket id"):
        next(live(TINY, PROMPT, "inertia", "compression", 0.5, 0, 10, False, *GREEDY, *defaults[:-1], None))
    own, made = run_ticket("", None)  # an API call's first run makes the session's holder
    again, none_made = run_ticket("", made)  # API calls of one session may run side by side
    assert made is not None and none_made is None and again is not own and not own.is_set()
    request_stop(made)  # /stop_live
    assert own.is_set() and again.is_set()


def _tickets_of(tickets) -> dict:
    return {ticket.id: ticket for ticket in tickets._held}


def test_a_stopped_run_that_fails_to_show_itself_warns_and_ends_as_a_run_does(tiny, monkeypatch):
    """An error after Stop (its last step, or building what it ran) ends the run without an error -- a
    warning says what failed -- so that the run a click made after Stop is not dropped by the browser (which
    re-sends a deferred run only after one that ended normally); the ticket is over either way."""
    import gradio as gr

    from kvviz.ui import compare, live
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.compare import make_compare_handler
    from kvviz.ui.live import make_live_handler
    from kvviz.ui.tickets import button_ticket

    def broken(*args, **kwargs):
        raise OSError("no space left on device")

    monkeypatch.setattr(live, "live_result", broken)
    monkeypatch.setattr(compare, "comparison_result", broken)
    warnings = []
    monkeypatch.setattr(gr, "Warning", lambda message, **kwargs: warnings.append(message))
    _models[TINY] = tiny
    # Long enough to be decoding after four updates (the text updates at most 30 times a second)
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=120)
    defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
    for name, run_of in (("run", lambda ticket_id, tickets: make_live_handler(limits, live_tab())(
            TINY, PROMPT, "inertia", "compression", 0.5, 0, 120, False, *GREEDY, *defaults, ticket_id, tickets)),
                         ("comparison", lambda ticket_id, tickets: make_compare_handler(limits, compare_tab())(
            TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 120, False, *GREEDY, ticket_id=ticket_id,
            tickets=tickets))):
        tickets, ticket_id = button_ticket(None)
        outputs = run_of(ticket_id, tickets)
        for _ in range(4):
            next(outputs)
        tickets.stop()
        list(outputs)  # the step in flight, then the end: no exception (the views stay as they streamed)
        assert warnings.pop() == f"the stopped {name} could not show what it ran: OSError: no space left on device"
        button_ticket(tickets)  # its ticket is over: the next click gets one
        with pytest.raises(gr.Error, match="no space left"):  # not stopped: the failure is the run's error
            list(run_of(*reversed(button_ticket(None))))


def test_memory_is_freed_after_stop(client):
    """A stopped run lets go of its cache like a finished one."""
    import time

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    before = live_caches()
    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    job = client.submit(TINY, PROMPT, "inertia", "budget", 0.5, 24, 3000, False, *GREEDY, *widgets, "",
                        api_name="/live")
    outputs_after(job, 5)
    client.predict(api_name="/stop_live")
    finished(job)
    deadline = time.monotonic() + 30
    while live_caches() > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_caches() == before


def test_a_stopped_comparison_ends_where_every_policy_still_decoding_made_the_same_steps(tiny):
    """Level: the policies still decoding (not at max new tokens, not after an end-of-sequence) have all made
    the same number of steps, at least one; a run that had ended may have made more or fewer."""
    from kvviz.ui.checks import Request
    from kvviz.ui.common import Progress

    model, tokenizer = tiny
    policies = {name: kvviz.make_policy(name) for name in ("inertia", "tova", "streaming")}
    prompt_ids = kvviz.encode_prompt(tokenizer, PROMPT, chat=False)
    run = Progress.start(Request(model, tokenizer, prompt_ids, 20, 10), TINY, policies,
                         [tokenizer.decode([i]) for i in prompt_ids])
    traces = {name: kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=20, max_new_tokens=10).trace
              for name in policies}
    assert not run.level()  # no step yet
    for name, steps in (("inertia", 10), ("tova", 7), ("streaming", 6)):
        for event in traces[name].events[:steps]:
            run.add(name, event)
    assert [run.finished(name) for name in policies] == [True, False, False]
    assert run.running() == ["tova", "streaming"] and not run.level()  # tova is a step ahead
    run.add("streaming", traces["streaming"].events[6])
    assert run.level()
    run.ends = {traces["tova"].events[6].new_token_id}  # as if tova's 7th token had been end-of-sequence
    assert run.finished("tova") and run.running() == ["streaming"] and run.level()
    assert run.texts["tova"] == "".join(e.text for e in traces["tova"].events[:7])


def test_a_compared_run_that_ends_early_says_where_on_its_panel_and_in_the_note(tiny):
    """A run whose token is the end of sequence ended there: its text panel's label, its retention panel's
    key and the divergence lines say at which step; the runs that went on say nothing of the kind."""
    from kvviz.ui.checks import Request
    from kvviz.ui.common import Progress
    from kvviz.ui.compare import compare_outputs
    from kvviz.ui.compare_views import compared_labels, panel_title

    model, tokenizer = tiny
    policies = {name: kvviz.make_policy(name) for name in ("inertia", "tova")}
    prompt_ids = kvviz.encode_prompt(tokenizer, PROMPT, chat=False)
    run = Progress.start(Request(model, tokenizer, prompt_ids, 20, 6), TINY, policies, [])
    traces = {name: kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=20, max_new_tokens=6).trace
              for name in policies}
    end = tokenizer.vocab_size  # an id no run made: tova's 4th token (step 3) made it, as its end of sequence
    traces["tova"].events[3] = dataclasses.replace(traces["tova"].events[3], new_token_id=end)
    run.ends = {end}
    for name, steps in (("inertia", 6), ("tova", 4)):
        for event in traces[name].events[:steps]:
            run.add(name, event)
    assert run.views["tova"].ended == 3 and run.views["inertia"].ended is None
    assert compared_labels(run.views) == ["inertia", "tova · ended at step 3 (end of sequence)"]
    tab = compare_tab()
    outputs = compare_outputs(tab, ["inertia", "tova"], run.texts, run.views, figures=True, final=True)
    assert [outputs[text]["label"] for text in tab.texts[:2]] == compared_labels(run.views)
    assert outputs[tab.divergence].endswith("\n- **tova** ended at step 3: it produced its end of sequence")
    assert "ended" not in outputs[tab.divergence].replace("**tova** ended", "")
    assert "ended at step 3" in panel_title("tova", run.views["tova"])[-1]
    assert not any("ended" in line for line in panel_title("inertia", run.views["inertia"]))


def test_run_view_retention_equals_the_trace(tiny):
    model, tokenizer = tiny
    trace = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=20, max_new_tokens=16).trace
    view = RunView(trace.prompt_len, 16, trace.budget)
    for event in trace.events:
        view.add(event)
    z, col, row = view.retention()
    assert (col, row) == (1, 1)
    for event in trace.events:
        exists = trace.prompt_len + max(event.step, 0)
        kept_row = np.flatnonzero(z[event.step, :exists] == 100)
        assert kept_row.tolist() == event.kept.tolist()
        assert (set(np.flatnonzero(z[event.step, :exists] == 0).tolist())
                == set(range(exists)) - set(event.kept.tolist()))
        assert (z[event.step, exists:] == EMPTY).all()  # not generated yet


def test_figure_payload_stays_small_for_2k_prompt_and_256_steps():
    prompt_len, steps, budget = 2048, 256, 204
    view = RunView(prompt_len, steps, budget, ["tok"] * prompt_len)
    rng = np.random.default_rng(0)
    kept = np.sort(rng.choice(prompt_len, budget, replace=False))
    from kvviz.trace import StepEvent

    for step in range(steps):
        new = prompt_len + step - 1
        present = np.append(kept, new) if step else kept
        out = np.array([present[rng.integers(present.size)]]) if step else np.empty(0, np.int64)
        kept = np.setdiff1d(present, out)
        view.add(StepEvent(step, 0, 0, "x", kept, out, rng.random(kept.size).astype(np.float32)))
    for figure in (view.retention_figure(), view.rank_figure(), view.timeline_figure(), view.step_detail_figure(100)):
        assert len(figure.to_json()) <= 300_000


def test_rank_rows_rank_only_finite_utilities_and_share_ties():
    """Kept 0..3 with utilities (inf, .5, .2, .5), budget 4: the protected entry is unranked (blank), the two
    .5 share descending rank 1.5 and .2 is third, drawn as (rank - 1) / B = .125, .125, .5.  A step whose
    utilities are all equal (nothing scored yet) has no ranks at all, not a ramp by position."""
    from kvviz.trace import StepEvent

    view = RunView(4, 4, 4)
    none = np.empty(0, np.int64)
    view.add(StepEvent(0, 0, 0, "a", np.arange(4), none, np.zeros(4, np.float32)))
    view.add(StepEvent(1, 0, 0, "b", np.arange(4), np.array([4]), np.array([np.inf, 0.5, 0.2, 0.5], np.float32)))
    assert np.isnan(view.ranks[0]).all()
    np.testing.assert_allclose(view.ranks[1][:4], [np.nan, 0.125, 0.5, 0.125])
    detail = view.step_detail_figure(1)
    marker = detail.data[0].marker
    assert list(marker.symbol) == ["circle"] * 4 + ["x"]  # position 4, evicted now, is drawn
    y = np.asarray(detail.data[0].y, dtype=float)
    assert np.isnan(y[0]) and np.allclose(y[1:], [0.5, 0.2, 0.5, 0.2])  # the cross sits at the lowest utility
    assert "1 kept entries with no finite score" in detail.layout.title.text


def test_the_step_detail_says_why_a_step_has_no_scores_to_draw():
    """Step 0 of an EMA policy: every utility 0, a flat row that explained nothing; of TOVA: no score at all,
    which read as "decides by position".  Each says it has scored nothing yet and when it first does; a
    checkpointed policy before its first checkpoint says so; StreamingLLM really decides by position."""
    from kvviz.trace import StepEvent

    none = np.empty(0, np.int64)

    def view_of(events, interval=None):
        view = RunView(4, len(events), 4, list("abcd"), interval=interval)
        for event in events:
            view.add(event)
        return view

    ema = view_of([StepEvent(0, 0, 0, "x", np.arange(4), none, utility=np.zeros(4, np.float32)),
                   StepEvent(1, 0, 0, "y", np.arange(4), np.array([4]), raw=np.arange(5, dtype=np.float32),
                             utility=np.arange(4, dtype=np.float32))])
    assert "every entry's utility is 0: none scored yet (the first scoring is at step 1)" in \
        plain(ema.step_detail_figure(0).layout.title.text)
    assert "every entry's utility" not in ema.step_detail_figure(1).layout.title.text
    unscored = [StepEvent(0, 0, 0, "x", np.arange(4), none), StepEvent(1, 0, 0, "y", np.arange(4), none)]
    tova = view_of([unscored[0], StepEvent(1, 0, 0, "y", np.arange(4), np.array([4]),
                                           utility=np.arange(4, dtype=np.float32))])
    assert plain(tova.step_detail_figure(0).layout.title.text).endswith(
        " nothing scored by this step: the first score is at step 1")
    assert plain(view_of(unscored, interval=128).step_detail_figure(1).layout.title.text).endswith(
        " no checkpoint by this step: this policy scores entries at its checkpoints only")
    assert plain(view_of(unscored).step_detail_figure(1).layout.title.text).endswith(
        " this policy keeps no per-entry score: it decides by position")


def test_scrubbed_step_line_lies_inside_the_step_axes_at_the_last_step():
    """The scrubbed-step line at the last step was drawn on the plot's right edge (the axis autoranged to
    end there) and half of it was cut: every step axis that carries it ends half a step past the run."""
    from kvviz.trace import StepEvent

    view = RunView(4, 3, 4)
    none = np.empty(0, np.int64)
    view.add(StepEvent(0, 0, 0, "a", np.arange(4), none, np.array([.4, .3, .2, .1], np.float32)))
    view.add(StepEvent(1, 0, 0, "b", np.array([0, 1, 2, 4]), np.array([3]), np.array([.4, .3, .2, .1], np.float32)))
    view.add(StepEvent(2, 0, 0, "c", np.array([0, 1, 4, 5]), np.array([2]), np.array([.4, .3, .2, .1], np.float32)))
    live = view.timeline_figure()
    assert list(live.layout.xaxis.range) == [-0.5, 2.5]
    for figure in (view.timeline_figure(marker_step=2), view.history_figure([1, 2], marker_step=2)):
        lines = [shape for shape in figure.layout.shapes if shape.line.color == STEP_MARKER_COLOR]
        assert lines and all(shape.x0 == 2 for shape in lines)
        low, high = figure.layout.xaxis.range
        assert low < 0 and high - 2 >= 0.5


def test_rank_matrix_tells_kept_unscored_from_evicted_and_not_yet_generated():
    """Prompt 0..3, B = 3.  Step 0 keeps 0, 1, 2 with utilities (inf, .5, .2) and evicts 3: 1 is rank 1
    (0 % of B), 2 is rank 2 ((2 - 1) / 3 = 33 %), 0 is kept with no score, 3 is evicted and 4 (the first
    generated token) does not exist yet.  Step 1 keeps 0, 1, 4 with no finite utility and evicts 2."""
    from kvviz.trace import StepEvent
    from kvviz.ui.figures import GONE, UNSCORED

    view = RunView(4, 2, 3)
    view.add(StepEvent(0, 0, 0, "a", np.array([0, 1, 2]), np.array([3]), np.array([np.inf, .5, .2], np.float32)))
    view.add(StepEvent(1, 0, 0, "b", np.array([0, 1, 4]), np.array([2]), np.full(3, np.inf, np.float32)))
    z, col, row = view.rank_matrix()
    assert (col, row) == (1, 1)
    assert z.tolist() == [[UNSCORED, 0, 33, GONE, EMPTY], [UNSCORED, UNSCORED, GONE, GONE, UNSCORED]]
    heatmap = view.rank_figure().data[0]
    colorbar = heatmap.colorbar
    colour_at = lambda code: [colour for stop, colour in heatmap.colorscale if stop <= code / EMPTY][-1]  # noqa: E731
    assert [colour_at(code) for code in (0, 100, UNSCORED, GONE, EMPTY)] == [
        "#fde725", "#440154", "#c8c8c8", "#f1c9a5", "#ffffff"]  # yellow rank 1, purple B, grey, pale, blank
    assert list(colorbar.tickvals)[-3:] == [UNSCORED, GONE, EMPTY]
    assert list(colorbar.ticktext)[-3:] == ["kept,<br>no score", "evicted", "not yet"]
    # stacked one above the other, their position axes line up: both keys sit in one fixed right margin
    figures = (view.retention_figure(), view.rank_figure())
    margins = [figure.layout.margin for figure in figures]
    assert margins[0].r == margins[1].r and margins[0].autoexpand is margins[1].autoexpand is False
    assert [list(figure.layout.xaxis.range) for figure in figures] == [[-0.5, 4.5]] * 2  # positions 0..4
    assert all(figure.layout.shapes[0].x0 == 3.5 for figure in figures)  # both mark the prompt's end


def test_a_policy_without_utilities_gets_an_explained_rank_panel_and_the_stats_say_why_over_budget(tiny):
    from kvviz.ui.live_views import stats_markdown

    model, tokenizer = tiny
    streaming = kvviz.run(model, tokenizer, PROMPT, "streaming", chat=False, budget=20, max_new_tokens=6).trace
    view = RunView(streaming.prompt_len, 6, 20)
    for event in streaming.events:
        view.add(event)
    panel = view.rank_figure()
    assert "no per-entry utility" in panel.layout.annotations[0].text
    detail = view.step_detail_figure(3)  # no axis of zeros named "no per-entry score": a strip of the entries
    assert detail.layout.yaxis.visible is False and "it decides by position" in detail.layout.title.text
    assert sorted(detail.data[0].x) == sorted(streaming.events[3].present.tolist())
    assert "**tokens** 6 / 6" in stats_markdown(view, 1.0) and "over B" not in stats_markdown(view, 1.0)
    # The token history has no rank to plot either: each token's time in the cache, a cross where it went.
    # StreamingLLM at B = 20 keeps 4 sinks and the newest 16: step 1 evicts every prompt position in between.
    gone, sink = streaming.events[1].evicted[0], 0
    history = view.history_figure([int(gone), sink], "two")
    lines = [t for t in history.data if t.mode == "lines"]
    assert [list(t.x) for t in lines] == [[0, 1], [0, 5]]  # evicted at step 1; a sink kept to step 5
    assert [t.name.split(" · ")[1] for t in lines] == ["evicted at step 1", "kept"]
    assert [list(t.x) for t in history.data if t.mode == "markers"] == [[1]]
    assert "no per-entry score" in history.layout.title.text and "rank" not in str(history.layout.yaxis.title.text)
    assert "decides by position alone" in view.terms_frame(3)[1]
    snapkv = kvviz.run(model, tokenizer, PROMPT, kvviz.make_policy("snapkv", window=4), chat=False, budget=20,
                       max_new_tokens=6).trace
    view = RunView(snapkv.prompt_len, 6, 20)
    for event in snapkv.events:
        view.add(event)
    assert snapkv.events[-1].cache_size == 25  # B + 5 tokens fed back: said as what it is
    assert "(over B: this policy evicts at the prefill only; each generated token adds an entry)" in \
        stats_markdown(view, 1.0)
    avokv = kvviz.run(model, tokenizer, PROMPT,
                      kvviz.make_policy("avokv", interval=4, delay=4, observe_window=4, sinks=2),
                      chat=False, budget=20, max_new_tokens=6).trace
    view = RunView(avokv.prompt_len, 6, 20)
    for event in avokv.events:
        view.add(event)
    assert avokv.events[-1].cache_size > 20 and "(over B: this policy does not evict at every step)" in \
        stats_markdown(view, 1.0)


def follow_view(raw: bool = True) -> RunView:
    """Prompt "ab 7342 519 cd" as tokens [ab][ 73][42][ 5][19][ cd], budget 4.  Step 1 (consumes token
    "!" at 6): present 0..6, evicts 1 and 3, keeps 0, 2, 4, 5, 6 with utilities .9, .1, .5, .3, .8 (one over
    B: the policy may hold more, as checkpointed ones do).  Step 2 (consumes "?" at 7): evicts 5."""
    from kvviz.trace import StepEvent

    view = RunView(6, 3, 4, ["ab", " 73", "42", " 5", "19", " cd"])
    view.add(StepEvent(0, 0, 0, "!", np.arange(6), np.empty(0, np.int64), np.zeros(6, np.float32)), "!")
    view.add(StepEvent(1, 0, 0, "?", np.array([0, 2, 4, 5, 6]), np.array([1, 3]),
                       np.array([0.9, 0.1, 0.5, 0.3, 0.8], np.float32),
                       np.array([0.4, 0.0, 0.1, 0.2, 0.3, 0.05, 0.6], np.float32) if raw else None, scored=True), "?")
    view.add(StepEvent(2, 0, 0, ".", np.array([0, 2, 4, 6, 7]), np.array([5]),
                       np.array([0.9, 0.2, 0.4, 0.7, 0.6], np.float32)), ".")
    return view


def test_follow_finds_text_across_token_boundaries_and_positions_by_number():
    view = follow_view()
    assert view.follow("7342", 2)[0] == [1, 2]  # " 73" + "42"
    assert view.follow("42 5", 2)[0] == [2, 3]
    assert view.follow("CD", 2)[0] == [5]  # case-insensitive
    assert view.follow("?", 2)[0] == [7]  # generated tokens too: "?" is position 7
    assert view.follow("#0, #4-#5", 2)[0] == [0, 4, 5]
    assert view.follow("#0, #4,", 2)[0] == [0, 4]  # a trailing comma: a list still being typed
    positions, note = view.follow("#3, #99", 2)
    # The last is 7 ("?", fed back at step 2): the final token "." came out of the last step, never cached.
    assert positions == [3] and "past the last (#7)" in note
    assert view.follow("#99", 2) == ([], "no position in '#99' exists: the last is #7")
    assert view.follow(".", 2)[0] == []
    assert view.follow("#2-#9999999999", 2)[0] == [2, 3, 4, 5, 6, 7]  # clipped, not expanded
    assert view.follow("#5-3", 2)[0] == [3, 4, 5]  # a range written backwards
    positions, note = view.follow("zzz", 2)
    assert positions == [] and "no token text contains 'zzz'" in note
    # a pasted document is refused at once (an 80 KB one held the handler for seconds)
    assert view.follow("7342" * 501, 2) == ([], "the text to follow is 2004 characters; give at most 2000 (a phrase, "
                                                "or positions as #12, #40-45)")
    # Empty: what the step evicted, closest to staying first (step 1: 3 had raw .2, 1 had 0), then its
    # lowest-utility kept entries (2 at .1, 5 at .3); step 0 evicted nothing and its utilities are all 0:
    # the oldest first.
    assert view.follow("", 1)[0] == [3, 1, 2, 5]
    assert view.follow("", 0)[0] == [0, 1, 2, 3]


def test_the_judged_slots_line_shows_only_where_the_protected_are_unranked(tiny):
    """AvoKV-E's sinks and tail hold +inf and are not ranked: the ranks of its judged entries end at
    B - sinks - tail, which a second line marks.  H2O's recent window competes in the ranks: no such line."""
    model, tokenizer = tiny
    lines = {}
    for name, policy in (("avokv", kvviz.make_policy("avokv", interval=4)), ("h2o", kvviz.make_policy("h2o"))):
        trace = kvviz.run(model, tokenizer, PROMPT, policy, chat=False, budget=60, max_new_tokens=10).trace
        view = RunView(trace.prompt_len, 10, 60, pinned=policy.pinned(60))
        for event in trace.events:
            view.add(event)
        figure = view.history_figure(view.follow("", 5)[0], "", 5)
        lines[name] = [shape.y0 for shape in figure.layout.shapes if shape.line.dash == "dashdot"], figure
    (at, avokv), (none, h2o) = lines["avokv"], lines["h2o"]
    assert at == [24.5] and "the 24 slots for judged entries (B less 36 protected" in plain(avokv.layout.title.text)
    assert none == [] and "judged" not in h2o.layout.title.text  # 60 - 4 sinks - 32 tail above
    # the label is in the key, not on the line, where it lay across the followed tokens' lines
    assert not [a for a in avokv.layout.annotations if "judged" in a.text]


def test_a_policy_the_model_cannot_serve_is_refused_by_the_check_before_the_run():
    """Expected Attention on a model with dynamic RoPE: the check says so (a toast with what to change)
    instead of the run failing after its prefill."""
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.compare import CompareChecks
    from kvviz.ui.live import make_live_check

    name = "tiny-random-mistral"  # a name of its own: the other tests' llama stays as it is
    model, tokenizer = kvviz.models.tiny_model(
        "mistral", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    kvviz.scoring.install(model)
    limits = Limits(models=(name,), max_prompt_tokens=400, max_new_tokens=16)
    _models[name] = (model, tokenizer)
    try:
        defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
        with pytest.raises(Exception, match="fixed frequencies.*choose another policy"):
            make_live_check(limits)(name, PROMPT, "expected-attention", "compression", 0.5, 0, 8, False, *GREEDY,
                                    *defaults)
        with pytest.raises(Exception, match="fixed frequencies"):
            CompareChecks(limits, compare_tab()).check(name, PROMPT, ["inertia", "expected-attention"],
                                                       "compression", 0.5, 0, 8, False)
        make_live_check(limits)(name, PROMPT, "inertia", "compression", 0.5, 0, 8, False, *GREEDY, *defaults)
    finally:
        _models.pop(name, None)


def test_values_typed_past_a_sliders_end_reach_our_checks_and_are_named(tiny, monkeypatch):
    """Gradio's slider check refused 999 with an unnamed "Value 999 is greater than maximum value 64", a
    server traceback and "Error" on the outputs; the value now reaches the registry's check, which names the
    policy's parameter, and the release note (the browser then sets the box to the end) names it too.  A
    fraction typed as the budget is refused, no longer rounded."""
    import gradio as gr

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.controls import parameter_past_end_note, past_end_note
    from kvviz.ui.live import make_live_check
    from kvviz.ui.widgets import TypedSlider

    assert TypedSlider(0, 64, step=1).preprocess(999) == 999
    assert TypedSlider(0, 64, step=1).get_block_name() == "slider"  # drawn by the browser's own slider
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    past_end_note("Max new tokens", 1, 512)(100000)
    past_end_note("Max new tokens", 1, 512)(512)  # in range: nothing said
    past_end_note("Compression ρ", 0, 0.99)(None)  # the box emptied: the browser sets it to 0
    parameter_past_end_note("refresh")("inertia-lazy", 999)
    parameter_past_end_note("refresh")("tova", 999)  # not this policy's parameter: its slider is hidden
    refresh = next(p for p in kvviz.policies.get_spec("inertia-lazy").parameters() if p["name"] == "refresh")
    low, high = refresh["low"], refresh["high"]
    assert warnings == ["Max new tokens goes from 1 to 512: 100000 was set to 512",
                        "Compression ρ was left empty: it was set to 0, its lowest; type the value you want",
                        f"inertia-lazy's refresh goes from {low:g} to {high:g}: 999 was set to {high:g}"]

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    values = {p: PARAMETERS[p]["default"] for p in PARAM_NAMES}
    with pytest.raises(gr.Error, match=f"policy 'inertia-lazy': refresh must be between {low} and {high}, got 999"):
        make_live_check(limits)(TINY, PROMPT, "inertia-lazy", "compression", 0.5, 0, 8, False, *GREEDY,
                                *{**values, "refresh": 999}.values())
    with pytest.raises(gr.Error, match="the budget must be a whole number, got 3.7"):
        make_live_check(limits)(TINY, PROMPT, "inertia", "budget", 0.5, 3.7, 8, False, *GREEDY, *values.values())
    with pytest.raises(gr.Error, match="the budget is empty; type a whole number"):
        make_live_check(limits)(TINY, PROMPT, "inertia", "budget", 0.5, None, 8, False, *GREEDY, *values.values())


def test_one_setting_typed_two_ways_is_named_as_one():
    from kvviz.ui.checks import compare_settings

    with pytest.raises(ValueError, match="^'inertia' and 'inertia alpha=0.8' are one setting, which the registry "
                                         "names 'inertia'; change a value or add another policy to compare$"):
        compare_settings(["inertia", "inertia alpha=0.8"])
    with pytest.raises(ValueError, match="^'inertia alpha=0' and 'single-step' are one setting, which the registry "
                                         "names 'single-step'"):
        compare_settings(["inertia alpha=0", "single-step"])
    with pytest.raises(ValueError, match="^'tova' is given twice"):
        compare_settings(["tova", "tova"])
    assert list(compare_settings(["inertia", "inertia alpha=0.8", "tova"])) == ["inertia", "tova"]


def test_a_setting_dropped_as_a_repeat_is_named_beside_the_comparison(tiny):
    """Four chips, three panels: the page says which chip ran as which policy, for the whole run."""
    from kvviz.ui.checks import _models
    from kvviz.ui.compare import make_compare_handler
    from kvviz.ui.presets import repeats_note

    assert repeats_note(["inertia", "tova", "streaming", "inertia alpha=0.8"]) == \
        "*Run once: `inertia alpha=0.8` is `inertia` (its defaults).*"
    assert repeats_note(["tova", "tova ", "inertia alpha=0.5", "inertia alpha=0.50"]) == \
        "*Run once: `tova` is given twice; `inertia alpha=0.50` is `inertia alpha=0.5`.*"
    assert repeats_note(["inertia alpha=0.8", "inertia"]) == \
        "*Run once: `inertia` and `inertia alpha=0.8` are one setting, `inertia`.*"
    assert repeats_note(["inertia", "tova"]) == "" and repeats_note(["inertia", 3]) == ""
    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    tab = compare_tab()
    compared = ["inertia", "tova", "streaming", "inertia alpha=0.8"]
    updates = list(make_compare_handler(limits, tab)(TINY, PROMPT, compared, "compression", 0.5, 0, 4, False))
    # after the tickets and the clearing
    divergences = [u[tab.divergence] for u in updates[2:] if isinstance(u.get(tab.divergence), str)]
    assert divergences and all(d.startswith("*Run once: `inertia alpha=0.8` is `inertia` (its defaults).*\n\n")
                               for d in divergences)
    assert "**tova** vs **inertia**" in divergences[-1]
    assert list(updates[-1][tab.state]) == ["inertia", "tova", "streaming"]


def test_a_comparison_says_what_it_waits_for_in_one_labelled_panel_per_policy(tiny):
    """Before the first token: at the click, "loading <model>…" while the check loads it (on a page with no
    comparison yet, one panel per chosen policy, labelled); once checked, each chosen policy's empty panel
    and "prefill…"; the Live tab says the same."""
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.compare import CompareChecks, make_compare_handler
    from kvviz.ui.live import make_live_handler

    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    tab = compare_tab()
    announce = positional(CompareChecks(limits, tab).announce, [tab.divergence, *tab.texts, *tab.figs])
    chosen = ["inertia", "tova", "streaming", "avokv interval=16"]
    inputs = (TINY, PROMPT, chosen, "compression", 0.5, 0, 4, False)
    _models.pop(TINY, None)
    note, *panels = announce(*inputs, None)
    assert note == f"*loading {TINY}…*" and TINY not in _models  # the check loads it, not this
    assert [(p["label"], p["visible"]) for p in panels[:4]] == [(label, True) for label in chosen]
    assert [p["visible"] for p in panels[4:]] == [True] * 4
    assert all(p == gr.skip() for p in announce(*inputs, {"inertia": None})[1:])  # an earlier comparison stays
    repeated = announce(TINY, PROMPT, ["inertia", "inertia alpha=0.8", "tova"], "compression", 0.5, 0, 4, False, None)
    assert repeated[0] == f"*Run once: `inertia alpha=0.8` is `inertia` (its defaults).*\n\n*loading {TINY}…*"
    assert all(u == gr.skip() for u in announce(TINY, PROMPT, ["inertia"], "compression", 0.5, 0, 4, False, None))
    _models[TINY] = tiny
    assert all(u == gr.skip() for u in announce(*inputs, None))  # loaded: the check is quick
    prompt_len = len(tiny[1](PROMPT, add_special_tokens=False)["input_ids"])
    updates = make_compare_handler(limits, tab)(*inputs)
    next(updates)  # an API call's tickets
    start = next(updates)
    assert [(start[t]["value"], start[t]["label"], start[t]["visible"]) for t in tab.texts] == \
        [("", label, True) for label in chosen]
    assert [(start[f]["value"], start[f]["visible"]) for f in tab.figs] == [(None, True)] * 4  # the last figures go
    assert start[tab.divergence] == f"*prefill of the {prompt_len}-token prompt…*"
    two = make_compare_handler(limits, tab)(TINY, PROMPT, chosen[:2], "compression", 0.5, 0, 4, False)
    next(two)
    start = next(two)
    assert [start[p]["visible"] for p in [*tab.texts, *tab.figs]] == [True, True, False, False] * 2
    defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
    live = make_live_handler(limits, live_tab())(TINY, PROMPT, "inertia", "compression", 0.5, 0, 4, False, 0.0, 1.0,
                                                 0, *defaults, "", None)
    next(live)
    assert next(live)[live_tab().stats] == f"**run** `inertia` · *prefill of the {prompt_len}-token prompt…*"


def test_a_stopped_or_refused_comparison_check_writes_only_a_real_reason():
    from kvviz.ui.checks import _models
    from kvviz.ui.compare import CompareChecks

    note = CompareChecks(Limits(models=(TINY,), max_prompt_tokens=400), compare_tab()).refusal_note
    _models.pop(TINY, None)  # as if Stop came before the model loaded: nothing to say, and no load
    assert note(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 4, False) == {"__type__": "update"}
    assert TINY not in _models
    assert note(TINY, PROMPT, ["inertia"], "compression", 0.5, 0, 4, False) == (
        "*Not compared: choose two to four policies to compare (one policy twice needs two settings, e.g. "
        "'inertia' and 'inertia alpha=0.5').*")
    # The same setting twice is one policy: "inertia alpha=0.8" is inertia at its default.
    assert "are one setting, which the registry names 'inertia'" in note(
        TINY, PROMPT, ["inertia", "inertia alpha=0.8"], "compression", 0.5, 0, 4, False)
    assert "max new tokens must be between 1 and 512" in note(TINY, PROMPT, ["inertia", "tova"], "compression",
                                                              0.5, 0, 9999, False)
    # A setting the loaded model cannot serve is named as the Policies box has it, among the others
    _models[TINY] = kvviz.load_model(TINY)
    assert note(TINY, PROMPT, ["tova", "inertia layers=99"], "compression", 0.5, 0, 4, False) == (
        "*Not compared: inertia layers=99: layers='99' names a layer beyond this model's 3 layers (indices 0 to 2).*")
    # and one that names itself already is not named twice
    assert note(TINY, PROMPT, ["tova", "avokv interval=64"], "compression", 0.5, 0, 4, False).startswith(
        "*Not compared: avokv interval=64 evicts only at its checkpoints")


def test_a_refused_click_marks_what_the_last_comparison_or_run_left_as_its(tiny):
    """A refusal keeps the last comparison's results on the page, as the Live tab keeps its last run, but
    says they are the previous comparison's: in the note, on each panel and on both tables."""
    from kvviz.ui.checks import _models
    from kvviz.ui.compare import CompareChecks
    from kvviz.ui.live import NOT_RUN, mark_previous_run

    _models[TINY] = tiny
    marks = positional(CompareChecks(Limits(models=(TINY,), max_prompt_tokens=400), compare_tab()).refused_marks,
                       compare_tab().marked)
    refused = (TINY, PROMPT, ["inertia"], "compression", 0.5, 0, 4, False)
    note, *texts, fates, stability = marks(*refused, {"inertia": follow_view(), "tova alpha=0.5": follow_view()})
    assert note == ("*Not compared: choose two to four policies to compare (one policy twice needs two settings, "
                    "e.g. 'inertia' and 'inertia alpha=0.5').*\n\n*Shown: the previous comparison (inertia, tova "
                    "alpha=0.5), not these inputs' results.*\n\n"
                    # and its own notes, which the refusal's takes the place of (follow_view: 6 tokens, B = 4, 5 kept)
                    "**prompt** 6 tokens · **budget** B = 4 · **largest cache while decoding**: inertia 5, "
                    "tova alpha=0.5 5\n- **tova alpha=0.5** vs **inertia**: identical for the 3 tokens both produced")
    assert [t.get("label") for t in texts] == ["inertia · previous comparison", "tova alpha=0.5 · previous comparison",
                                                None, None]
    assert fates["label"] == "Previous comparison: Fate per policy"
    assert stability["label"].startswith("Previous comparison: Stability, a column per policy (InertiaKV App. I;")
    # No comparison yet: the panels the click labelled go back to placeholders; no tables to mark.
    note, *texts, fates, stability = marks(*refused, None)
    assert "Shown:" not in note and [t["label"] for t in texts] == ["policy 1", "policy 2", "policy 3", "policy 4"]
    assert fates == stability == gr.skip()
    # Stop cancelled the check of passing inputs: nothing refused, nothing marked.
    assert all(u == gr.skip() for u in marks(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 4, False,
                                             {"inertia": follow_view()}))
    stats = "**tokens** 4 / 4 · **prompt** 50 tokens"
    view = RunView(4, 2, 4, ["a", "b", "c", "d"])
    assert mark_previous_run(view, stats) == NOT_RUN + stats
    assert mark_previous_run(view, NOT_RUN + stats) == NOT_RUN + stats  # refused twice: said once
    assert NOT_RUN.startswith("*Not run: the last click was refused")
    assert mark_previous_run(None, "") == gr.skip()  # nothing shown yet: nothing to mark


def test_an_edit_after_a_refused_comparison_restates_or_clears_the_reason():
    """The note of a refused click follows the inputs as they are edited: the reason they have now, nothing
    once they pass (with no comparison on the page); what a comparison itself wrote there stays."""
    from kvviz.ui.compare import CompareChecks

    edited = positional(CompareChecks(Limits(models=(TINY,), max_prompt_tokens=400), compare_tab()).edited,
                        compare_tab().marked)
    refused = "*Not compared: choose two to four policies to compare (...).*"
    note, *labels = edited(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 9999, False, None, None, refused)
    assert "max new tokens must be between 1 and 512" in note and all(u == gr.skip() for u in labels[-2:])
    assert edited(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 4, False, None, None, refused)[0] == ""
    for result in ("**Divergence** ...", "", None):  # a comparison's own note, or none: left as it is
        assert edited(TINY, PROMPT, ["inertia"], "compression", 0.5, 0, 4, False, None, None, result)[0] == gr.skip()


def test_an_edit_after_a_comparison_marks_it_as_made_from_earlier_inputs(tiny):
    """A finished comparison stays when the inputs change, but its note names what changed and every panel and
    table says "earlier inputs"; the inputs it ran on, set back, take the marks off.  Only the inputs that
    decide the run count: the budget box while ρ sizes the cache, top-p while decoding is greedy, do not."""
    from kvviz.ui.checks import _models
    from kvviz.ui.common import compared_inputs
    from kvviz.ui.compare import CompareChecks

    _models[TINY] = tiny
    edited = positional(CompareChecks(Limits(models=(TINY,), max_prompt_tokens=400), compare_tab()).edited,
                        compare_tab().marked)
    ran_on = (TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 4, False, 0.0, 0.95, 0)
    ran = {"inputs": compared_inputs(*ran_on), "note": "**prompt** 6 tokens"}
    views = {"inertia": follow_view(), "tova": follow_view()}
    views["tova"].ended = 2

    def edit(**changes):
        fields = ["model", "prompt", "names", "mode", "compression", "budget", "max_new", "chat", "temperature",
                  "top_p", "seed"]
        inputs = [changes.get(name, value) for name, value in zip(fields, ran_on)]
        return edited(*inputs, ran, views, ran["note"])

    note, *texts, fates, stability = edit(prompt="another prompt", max_new=8)
    assert note == ("**Earlier inputs: the prompt, max new tokens changed since this comparison ran; compare again "
                    "for the current ones.**\n\n**prompt** 6 tokens")
    assert [t.get("label") for t in texts[:2]] == ["inertia · earlier inputs",
                                                   "tova · ended at step 2 (end of sequence) · earlier inputs"]
    assert texts[2:] == [gr.skip(), gr.skip()]
    assert fates["label"] == "Fate per policy (earlier inputs)" and stability["label"].endswith("(earlier inputs)")
    assert edit(mode="budget")[0].startswith("**Earlier inputs: the cache size by changed")
    assert edit(temperature=0.6)[0].startswith("**Earlier inputs: the temperature changed")
    # what does not decide this run: no mark
    note, *texts, fates, stability = edit(budget=99, top_p=0.5, seed=3)
    assert note == "**prompt** 6 tokens" and texts[1]["label"] == "tova · ended at step 2 (end of sequence)"
    assert fates["label"] == "Fate per policy"
    # while a comparison runs (no views yet) nothing is marked
    assert all(u == gr.skip() for u in edited(*ran_on[:1], "x", *ran_on[2:], ran, None, "*prefill…*"))


def test_the_history_figure_draws_each_followed_token_from_its_events():
    view = follow_view()
    figure = view.history_figure([5, 1], "test", marker_step=1)
    lines = {trace.name: trace for trace in figure.data if trace.showlegend is not False}
    # Position 5: kept at step 1 with utility .3, 4th of 5 kept (.9, .8, .5 above it); raw .05 is 6th of
    # 7 present; evicted at step 2 (a cross, just past B = 4).  Position 1: evicted at step 1, raw 0 (7th).
    five = lines["#5 ' cd' · evicted at step 2 · raw crossed B 0×"]
    assert list(five.x) == [0, 1, 2] and list(five.y)[1] == 4 and np.isnan(list(five.y)[2])
    raw = [t for t in figure.data if t.name == "#5 ' cd' raw"][0]
    assert list(raw.x) == [1] and list(raw.y) == [6]  # only the steps that scored
    crosses = [t for t in figure.data if t.mode == "markers"]
    # #1's cross at its rank by step 1's raw score (7th), where the step recorded no decision score; #5's
    # step 2 recorded no score at all: just past B
    assert sorted((t.legendgroup, list(t.x)[0], list(t.y)[0]) for t in crosses) == [
        ("#1 ' 73'", 1, 7), ("#5 ' cd'", 2, 5)]
    assert crosses[0].hovertext == ("#1 ' 73' evicted at step 1, rank 7 by the step's raw score",) or \
        crosses[1].hovertext == ("#1 ' 73' evicted at step 1, rank 7 by the step's raw score",)
    assert "test" in figure.layout.title.text and "dotted: rank by the step's raw score" in figure.layout.title.text
    # the key says where a cross stands: a raw rank can lie inside the top B of an eviction made by utility
    assert "<sup>×: evicted, at its rank by the step's raw score</sup>" in figure.layout.title.text
    # the fates above the key: crosses on one step overlap, and lines leave through the bottom
    assert "<sup>0 of 2 kept through step 2, 2 evicted at steps 1 to 2</sup>" in figure.layout.title.text
    assert "<sup>1 of 2 kept through step 2, 1 evicted at step 1</sup>" in view.history_figure([2, 1]).layout.title.text
    assert "<sup>2 of 2 kept through step 2</sup>" in view.history_figure([2, 0]).layout.title.text
    assert view.history_figure([2]).data[0].name == "#2 '42' · kept · raw crossed B 0×"
    assert "no token" in view.history_figure([], "").layout.annotations[0].text
    # a policy that records no raw score (AvoKV-E, R-KV) draws no dotted lines, and its key promises none
    assert "dotted" not in follow_view(raw=False).history_figure([5, 1], "test").layout.title.text


def test_the_step_detail_is_on_a_log_scale_where_a_few_entries_dwarf_the_rest():
    """A sink at 0.6 against utilities near 0.002 put every other entry on the axis: the axis is logarithmic
    where every drawn value is positive and the largest is ten times the median or more, and says so."""
    from kvviz.trace import StepEvent

    def detail(utility):
        view = RunView(6, 3, 5, list("abcdef"))
        view.add(StepEvent(0, 0, 0, "!", np.arange(6), np.empty(0, np.int64), np.zeros(6, np.float32)), "!")
        view.add(StepEvent(1, 0, 0, "?", np.array([0, 1, 2, 4, 6]), np.array([3, 5]),
                           np.array(utility, np.float32)), "?")
        return view.step_detail_figure(1)

    skewed = detail([0.6, 0.001, 0.002, 0.003, 0.004])
    assert skewed.layout.yaxis.type == "log" and "log scale" in skewed.layout.title.text
    # evicted entries: larger crosses, so that they show among the kept
    assert list(skewed.data[0].marker.size) == [6, 6, 6, 11, 6, 11, 6]
    for utility in ([0.5, 0.4, 0.3, 0.2, 0.1], [0.6, 0.0, 0.002, 0.003, 0.004]):  # close, or a zero to draw
        figure = detail(utility)
        assert figure.layout.yaxis.type is None and "log scale" not in figure.layout.title.text


def test_tokens_one_checkpoint_evicts_together_are_crossed_at_their_rank_in_that_decision():
    """AvoKV-E's and R-KV's checkpoints evict many entries at once, and their crosses all sat at (step, B + 1),
    one over another.  A cross now sits at the entry's rank by the checkpoint's score among the entries it
    judged (the sink and the tail are not judged).  Here S over positions 0..6 = (sink, .1, .9, .4, .2, .3,
    tail): descending among the judged, .4 is 2nd and .1 5th."""
    from kvviz.trace import StepEvent

    view = RunView(6, 3, 3, ["a", "b", "c", "d", "e", "f"])
    view.add(StepEvent(0, 0, 0, "!", np.arange(6), np.empty(0, np.int64), np.full(6, np.inf, np.float32)), "!")
    score = np.array([np.nan, 0.1, 0.9, 0.4, 0.2, 0.3, np.nan], np.float32)
    view.add(StepEvent(1, 0, 0, "?", np.array([0, 2, 6]), np.array([1, 3, 4, 5]),
                       np.array([np.inf, 0.9, np.inf], np.float32), components={"S": score}), "?")
    figure = view.history_figure([1, 3], "test")
    crosses = {t.legendgroup: t for t in figure.data if t.mode == "markers"}
    assert list(crosses["#1 'b'"].y) == [5] and list(crosses["#3 'd'"].y) == [2]
    assert crosses["#3 'd'"].hovertext == ("#3 'd' evicted at step 1, rank 2 by that decision's score",)
    # a step that recorded no score (a per-step policy): just past B, as before
    del view.events[1].components["S"]
    assert [list(t.y) for t in view.history_figure([1, 3], "test").data if t.mode == "markers"] == [[4], [4]]


def test_a_cross_deeper_than_the_plot_is_a_triangle_on_its_floor_that_gives_the_rank():
    """B = 2, a prompt of 8 cut to 2 at step 1 by raw scores 8..1 (position p ranks p + 1): the plot reaches
    2B = 4, so #6 (rank 7) and #7 (rank 8) sit on that floor as triangles, #2 (rank 3) is a cross."""
    from kvviz.trace import StepEvent

    view = RunView(8, 2, 2, list("abcdefgh"))
    view.add(StepEvent(0, 0, 0, "!", np.arange(8), np.empty(0, np.int64)), "!")
    raw = np.array([8, 7, 6, 5, 4, 3, 2, 1, 0.5], np.float32)  # positions 0..8, the new token 8 last
    view.add(StepEvent(1, 0, 0, "?", np.array([0, 1, 8]), np.arange(2, 8), np.array([8, 7, 9], np.float32), raw), "?")
    figure = view.history_figure([2, 6, 7], "test")
    crosses = {t.legendgroup: t for t in figure.data if t.mode == "markers"}
    assert [(list(t.y), t.marker.symbol) for t in crosses.values()] == [
        ([3], ("x",)), ([4], ("triangle-down",)), ([4], ("triangle-down",))]
    assert crosses["#7 'h'"].hovertext == ("#7 'h' evicted at step 1, rank 8 by the step's raw score (below the plot)",)
    assert "▼: evicted ranked below 4" in figure.layout.title.text
    assert "▼" not in view.history_figure([2], "test").layout.title.text


def test_the_history_figure_leaves_room_under_the_budget_line_for_its_label():
    """A token ranked first throughout, B = 30: the axis would end at rank 31, and the budget line's label,
    drawn under the line (from 30.5), would fall onto the step axis' tick labels."""
    from kvviz.trace import StepEvent

    view = RunView(31, 2, 30, [f"t{i}" for i in range(31)])
    view.add(StepEvent(0, 0, 0, "!", np.arange(31), np.empty(0, np.int64), np.linspace(1, 0, 31)), "!")
    view.add(StepEvent(1, 0, 0, "?", np.append(np.arange(30), 31), np.array([30]),
                       np.linspace(1, 0, 31)), "?")
    figure = view.history_figure([0], "first")
    bottom, top = figure.layout.yaxis.range
    assert bottom - 30.5 >= 0.06 * (bottom - top)  # a label's height on a 380-pixel figure
    # Following many tokens: the figure grows by their legend's rows, the plot's own height stays
    many = view.history_figure(list(range(12)), "twelve")
    plot_height = lambda f: f.layout.height - f.layout.margin.t - f.layout.margin.b
    assert many.layout.height > figure.layout.height and plot_height(many) == plot_height(figure)


def test_a_result_tables_columns_are_as_wide_as_their_longest_word():
    """The probe's and the spectrum's tables get each column's width from its longest word, header or cell
    (9 px a character, 16 of padding), as a result arrives: Gradio otherwise broke 'Spearman' mid-word."""
    from kvviz.ui.common import fit_columns

    frame = pd.DataFrame({"policy": ["inertia", "avokv interval=16"], "false-safe rate": [0.0769, 0.0],
                          "Spearman": [-0.043, 0.1692]})
    # policy: 'interval=16' (11), false-safe rate: 'false-safe' (10), Spearman: the header (8)
    assert fit_columns(frame) == gr.update(column_widths=["115px", "106px", "88px"])
    assert fit_columns(None) == gr.skip() and fit_columns(pd.DataFrame()) == gr.skip()  # cleared: nothing to fit


def test_the_terms_table_lists_the_last_decision_lowest_score_first():
    """Checkpoints at step 1 of a view over prompt 0..4, budget 2: step 1 judged 0..3 (4 and 5, the tail,
    unjudged) with S = +inf (a sink), -.2, .1, .5 and evicted 1 and 2.  Scrubbed to step 2, the table is step
    1's: 1 (-.2), 2 (.1), 3 (.5), then the sink; step 0 had no decision yet."""
    from kvviz.trace import StepEvent
    from kvviz.ui.live_views import scrub

    nan, none = float("nan"), np.empty(0, np.int64)
    view = RunView(5, 4, 2, ["a", "b", "c", "d", "e"])
    view.add(StepEvent(0, 0, 0, "f", np.arange(5), none), "f")
    terms = {"p": np.array([0.3, 0.1, 0.2, 0.4, nan, nan], np.float32),
             "S": np.array([np.inf, -0.2, 0.1, 0.5, nan, nan], np.float32)}
    view.add(StepEvent(1, 0, 0, "g", np.array([0, 3, 4, 5]), np.array([1, 2]),
                       np.array([np.inf, 0.5, np.inf, np.inf], np.float32), components=terms), "g")
    view.add(StepEvent(2, 0, 0, "h", np.array([0, 3, 4, 5, 6]), none,
                       np.array([np.inf, 0.5, np.inf, np.inf, np.inf], np.float32)), "h")
    frame, caption = view.terms_frame(2)
    assert frame["position"].tolist() == [1, 2, 3, 0] and frame["token"].tolist() == ["b", "c", "d", "a"]
    assert frame["S"].tolist() == pytest.approx([-0.2, 0.1, 0.5, np.inf])
    assert frame["p"].tolist() == pytest.approx([0.1, 0.2, 0.4, 0.3])
    assert frame["fate"].tolist() == ["evicted", "evicted", "kept", "kept (sink)"]
    assert caption == ("**Step 1** (the decision behind step 2's cache): 4 entries with terms, 2 evicted, lowest "
                       "`S` first; the cut fell between `S` 0.1 (highest evicted) and 0.5 (lowest kept); 1 sinks "
                       "kept by rule; 2 in the protected tail, not judged.")
    assert view.terms_frame(0) == (None, "No decision by step 0 yet; the next at step 1.")
    # As shown: the position as '#', the sink's +inf spelled out (JSON has none), each column as wide as its
    # longest word in header or cells, 9 px a character and 16 of padding: # 1, token 5, S 4 ('+inf', '-0.2'),
    # fate 7 ('evicted'; 'kept (sink)' wraps), p 3 ('0.1')
    from kvviz.ui.live_views import decision_views
    shown = decision_views(view, 2)[1]
    assert shown["value"].columns.tolist() == ["#", "token", "S", "fate", "p"]
    assert shown["value"]["S"].tolist() == [-0.2, 0.1, 0.5, "+inf"]
    assert shown["column_widths"] == ["25px", "61px", "52px", "79px", "43px"]
    assert decision_views(view, 0)[1] == gr.update(visible=False)
    # The same decision by a policy with checkpoints every 2 tokens came off that schedule (step 1): the prompt
    # of 5 alone was over B + 1 = 3.  Every 4: the prompt is not over B + 3 = 5, the 6 entries of step 1 are.
    # Every token: on schedule, nothing to explain.
    def caption_at(interval):
        other = RunView(5, 4, 2, ["a", "b", "c", "d", "e"], interval=interval)
        for event in view.events:
            other.add(event)
        return other.terms_frame(2)[1]

    assert caption_at(2).endswith(" A checkpoint off its every-2 schedule: the prompt alone was over B + 1 = 3 "
                                  "entries, the most it holds between checkpoints.")
    assert "the cache would have passed B + 3 = 5 entries" in caption_at(4)
    assert caption_at(1) == caption
    # The key says what the terms are and how the score combines them, at the run's own weights
    from kvviz.ui.common import terms_key
    keyed = RunView(5, 4, 2, ["a", "b", "c", "d", "e"], terms_key=terms_key(kvviz.make_policy("avokv", lambda_b=0.2)))
    for event in view.events:
        keyed.add(event)
    assert keyed.terms_frame(2)[1].startswith(caption + "\n\n*S = 0.1·N(p) − 0.9·N(r) + 0.2·N(b); p: read pressure "
                                              "(attention from the last 8 queries), r: key redundancy")
    assert "S = 0.1·(p) − 0.9·(r) + 0.05·(b)" in terms_key(kvviz.make_policy("avokv", normalise=False))
    assert terms_key(kvviz.make_policy("rkv", lam=0.3)).startswith("score = 0.3·importance − 0.7·redundancy")
    assert terms_key(kvviz.make_policy("lazyeviction")).startswith("score = H1 + H2")
    assert terms_key(kvviz.make_policy("tova")) == ""  # one score: its utility is the whole story
    # two scores 1e-8 apart (LazyEviction's H1 near 0) are shown with the digits that tell them apart
    from kvviz.ui.figures import _apart

    assert _apart(0.1, 0.5) == ("0.1", "0.5") and _apart(0.2384000123, 0.2384) == ("0.23840001", "0.2384")
    assert _apart(0.25, 0.25) == ("0.25", "0.25")
    assert view.follow("", 2) == ([3], "at step 2: nothing evicted; the next 1 in line for eviction")  # lowest utility
    # A step that evicted more than the four followed says how many of them are shown
    from kvviz.trace import StepEvent

    wide = RunView(8, 2, 2, list("abcdefgh"))
    wide.add(StepEvent(0, 0, 0, "x", np.arange(8), np.empty(0, np.int64)))
    wide.add(StepEvent(1, 0, 0, "y", np.array([0, 8]), np.arange(1, 8), utility=np.array([np.inf, 0.5])))
    positions, note = wide.follow("", 1)
    assert positions == [7, 6, 5, 4] and note == "at step 1: 4 of the 7 evicted (newest first)"
    few = RunView(4, 2, 3, list("abcd"))
    few.add(StepEvent(0, 0, 0, "x", np.arange(4), np.empty(0, np.int64)))
    few.add(StepEvent(1, 0, 0, "y", np.array([0, 2, 4]), np.array([1, 3]), utility=np.array([0.2, 0.1, 0.9])))
    assert few.follow("", 1) == ([3, 1, 2, 0], "at step 1: the 2 evicted (newest first), then the next 2 in line "
                                               "for eviction")
    # a value typed past either end (the browser sets the box to the end only when it loses focus) reads as it
    tab = live_tab()
    title = lambda outputs: outputs[tab.detail].layout.title.text  # the step detail names its step
    assert title(scrub(tab, view, 99)) == title(scrub(tab, view, 2))
    assert title(scrub(tab, view, -3)) == title(scrub(tab, view, 0))
    assert title(scrub(tab, view, 2)) != title(scrub(tab, view, 0))
    assert title(scrub(tab, view, "nan")) == title(scrub(tab, view, 2))
    outputs = scrub(tab, view, 2)
    assert len(outputs) == 8 and "**Step 1**" in outputs[tab.terms_note] and outputs[tab.terms]["visible"]
    # the scrubber is left as it is at a step, and set to the step shown where it was typed as something else
    assert outputs[tab.step_slider] == gr.skip() and scrub(tab, view, 1.0)[tab.step_slider] == gr.skip()
    assert [scrub(tab, view, typed)[tab.step_slider]["value"] for typed in (1.5, 99, -3, None)] == [1, 2, 0, 0]
    # and says why, in a toast: the box changed under the user's typing
    from kvviz.ui.live_views import scrub_note
    assert scrub_note(view, 1.5, 1) == "Scrub to step takes whole steps: 1.5 shows step 1"
    assert scrub_note(view, 1e5, 2) == "Scrub to step goes from 0 to 2: 100000 was set to 2"
    assert scrub_note(view, -3, 0) == "Scrub to step goes from 0 to 2: -3 was set to 0"
    assert scrub_note(view, "nan", 2) == "Scrub to step: 'nan' is not a step; showing the last, 2"
    assert scrub_note(view, None, 0) is None and scrub_note(view, 2.0, 2) is None
    # the per-step plot marks the scrubbed step on each of its three rows; the streaming figure stays unmarked
    marks = [shape.x0 for shape in outputs[tab.timeline].layout.shapes if shape.line.color == STEP_MARKER_COLOR]
    assert marks == [2, 2, 2]
    assert not [shape for shape in view.timeline_figure().layout.shapes if shape.line.color == STEP_MARKER_COLOR]
    table = outputs[tab.terms]["value"]
    assert table["#"].tolist() == [1, 2, 3, 0] and table["S"].tolist()[-1] == "+inf"  # not a blank cell
    detail = view.step_detail_figure(1)
    assert "S -0.2" in detail.data[0].hovertext[1] and "S " not in detail.data[0].hovertext[4]  # 4: not judged


def test_whitespace_tokens_show_in_table_cells_not_as_blanks():
    """The fates table and the Why table: a newline, tab or spaces-only token is a symbol, not an empty
    cell; a space before a word stays as it is; the text searched (Follow) is the token's own."""
    from kvviz.trace import StepEvent
    from kvviz.ui.compare_views import compare_fates
    from kvviz.ui.figures import visible_whitespace

    tokens = ["system", "\n", " ", "\t", "  ", " The", "a\r\n"]
    assert [visible_whitespace(t) for t in tokens] == ["system", "⏎", "␣", "⇥", "␣␣", " The", "a␍⏎"]
    assert visible_whitespace("") == ""
    views = {}
    for name, evicted in (("a", 1), ("b", 2)):  # each evicts one whitespace token at step 1
        view = RunView(7, 2, 6, tokens)
        view.add(StepEvent(0, 0, 0, "!", np.arange(7), np.empty(0, np.int64)), "!")
        view.add(StepEvent(1, 0, 0, "?", np.array([p for p in range(8) if p != evicted]), np.array([evicted])), "?")
        views[name] = view
    frame = compare_fates(views, "")[1]["value"]  # what they disagree on: the newline and the space
    assert frame["#"].tolist() == [1, 2] and frame["token"].tolist() == ["⏎", "␣"]
    assert compare_fates(views, "#3-4")[1]["value"]["token"].tolist() == ["⇥", "␣␣"]
    assert compare_fates(views, "a\r")[1]["value"]["#"].tolist() == [6]  # found by its own text
    nan = float("nan")
    terms = {"S": np.array([0.3, -0.1, 0.2, 0.1, 0.5, 0.6, nan, nan], np.float32)}
    view = views["a"]
    view.events[-1].components = terms
    assert view.terms_frame(1)[0]["token"].tolist()[:3] == ["⏎", "⇥", "␣"]  # lowest S first: 1, 3, 2
    # the decision's columns first, then its terms: a narrow table keeps the score and fate in view
    view.events[-1].components = {"p": terms["S"] * 2, **terms}
    assert view.terms_frame(1)[0].columns.tolist() == ["position", "token", "S", "fate", "p"]
    # the step-detail plot's hover too (the newline evicted at this step included)
    hover = view.step_detail_figure(1).data[0].hovertext
    assert [text.split("<br>")[0] for text in hover[:4]] == ["pos 0 · system", "pos 1 · ⏎", "pos 2 · ␣", "pos 3 · ⇥"]


def two_compared_views() -> dict[str, RunView]:
    """Prompt [The][ key][ is][ 42], budget 4: at step 1 policy a evicts 1 (" key"), b evicts 3 (" 42")."""
    from kvviz.trace import StepEvent

    views = {}
    for name, evicted in (("a", 1), ("b", 3)):
        view = RunView(4, 2, 4, ["The", " key", " is", " 42"])
        view.add(StepEvent(0, 0, 0, "!", np.arange(4), np.empty(0, np.int64)), "!")
        view.add(StepEvent(1, 0, 0, "?", np.array([p for p in range(5) if p != evicted]), np.array([evicted])), "?")
        views[name] = view
    return views


def test_the_sampling_accordion_says_how_the_run_will_decode():
    """Closed, its title said 'temperature 0: greedy' after a preset had set T = 0.6 inside it."""
    from kvviz.ui.controls import sampling_label

    assert sampling_label(0, 0.95) == "Sampling (temperature 0: greedy)"
    assert sampling_label(0.6, 0.95) == "Sampling (temperature 0.6, top-p 0.95)"
    assert sampling_label("", 0.95) == "Sampling"


def test_compares_panels_follow_the_number_of_settings_chosen_before_any_run():
    """The page starts with three panels; a four-policy preset showed three until it ran.  Before a run the
    panels follow the box, labelled with each setting; after one they keep showing it."""
    from kvviz.ui.compare import placeholder_panels
    from kvviz.ui.presets import COMPARISONS

    four = next(entries for entries in COMPARISONS.values() if len(entries) == 4)
    tab = compare_tab()
    panels = [*tab.texts, *tab.figs]
    updates = outputs_of(placeholder_panels(tab, four, None), panels)
    assert [u["visible"] for u in updates] == [True] * 8
    assert [u["label"] for u in updates[:4]] == four
    two = outputs_of(placeholder_panels(tab, ["inertia", "tova"], None), panels)
    assert [u["visible"] for u in two] == [True, True, False, False] * 2
    assert placeholder_panels(tab, four, {"a": None}) == gr.skip()  # a comparison is on show: every panel skipped
    assert placeholder_panels(tab, ["inertia"] * 5, None) == gr.skip()  # refused by the run's check


def test_compare_follows_prompt_tokens_through_each_policy():
    """The two runs of two_compared_views: each column the fate of the followed token under one policy."""
    from kvviz.ui.compare_views import compare_fates

    views = two_compared_views()
    note, table = compare_fates(views, "42")
    frame = table["value"]
    # Each column says how far its run went: runs that diverge end at different steps.
    assert frame["#"].tolist() == [3] and frame["a (to step 1)"].tolist() == ["kept"]
    assert frame["b (to step 1)"].tolist() == ["evicted at step 1"]
    assert "**a** 1, **b** 0" in note and "ended at different steps" not in note  # both ran to step 1
    del views["b"].events[1:]  # b ended at the prefill (its end-of-sequence): its 'kept' reaches step 0 only
    note, _ = compare_fates(views, "42")
    assert note.endswith("The runs ended at different steps (a 1, b 0): each policy's count here, and its stability "
                         "column, cover its own run only. Still kept at step 0, where the shortest ended: **a** 1, "
                         "**b** 1.")
    # " key": a evicted it at step 1, after b had ended; at b's last step both still held it
    note, _ = compare_fates(views, "key")
    assert "Kept to the end, of 1: **a** 0, **b** 1." in note
    assert note.endswith("Still kept at step 0, where the shortest ended: **a** 1, **b** 1.")
    views = two_compared_views()
    note, table = compare_fates(views, "")  # what they disagree on: " key" (a drops it) and " 42" (b does)
    assert table["value"]["#"].tolist() == [1, 3] and "2 prompt tokens" in note
    assert compare_fates(views, "?")[1]["visible"] is False  # generated text differs per policy: prompt only
    assert "once a comparison has ended" in compare_fates(None, "42")[0]


def test_compare_marks_the_followed_tokens_on_each_retention_panel():
    """The same two runs: " 42" (#3) is kept to the end by a (a line down its column through the last step,
    no cross) and evicted at step 1 by b (a line through step 0, a cross on step 1)."""
    from kvviz.ui.compare import compare_follow

    views = two_compared_views()
    tab = compare_tab()
    follow = positional(functools.partial(compare_follow, tab), [tab.fates_note, tab.fates, *tab.figs])
    note, table, *panels = follow(views, "42")
    assert len(panels) == 4 and panels[2] == panels[3] == gr.skip()
    kept, evicted = panels[0]["value"], panels[1]["value"]
    line, top = kept.data[2], kept.data[3]  # data[1]: the line's white halo
    assert list(line.x) == [3, 3, None] and list(line.y) == [-0.5, 1.5, None]
    assert list(top.x) == [3] and top.hovertext == ("#3  42: kept to the end",)
    assert len(kept.data) == 4 and "red followed" in kept.layout.title.text
    assert kept.data[0].showscale is False  # a quarter-width panel: its title is the key
    from kvviz.ui.compare_views import divergence_markdown
    assert "identical for the 2 tokens both produced" in divergence_markdown(["a", "b"], views)
    for view in views.values():
        del view.events[1:]  # stopped at the prefill: one token each
    assert "identical for the 1 token both produced" in divergence_markdown(["a", "b"], views)
    from kvviz.ui.compare_views import jaccard_figure
    jaccard = jaccard_figure(["a", "b"], views)  # one point: the prefill's keep sets, both the whole prompt
    assert list(jaccard.data[0].x) == [0] and list(jaccard.data[0].y) == [1.0]
    assert list(jaccard.layout.xaxis.range) == [-0.5, 0.5]  # the step there is, not an axis from -1 to 1
    # the key wraps at its dots, not inside an item, where a quarter-width panel would cut it
    from kvviz.ui.compare_views import compare_panel
    view = views["b"]
    view.pinned = (4, 0)
    title = compare_panel("b", view, [3]).layout.title.text
    assert title.endswith("dark kept · pale evicted</span><br><span style='font-size:10px'>"
                          "green protected · red followed</span>")
    # a label that wraps ("lazyeviction interval=16") no longer makes its panel taller than the others
    from kvviz.ui.compare_views import compare_panels
    long, short = compare_panels({"lazyeviction interval=16 threshold=2": view, "b": views["a"]}, [3])
    assert long.layout.title.text.count("<br>") > short.layout.title.text.count("<br>")
    assert long.layout.height == short.layout.height and long.layout.margin.t == short.layout.margin.t
    assert list(evicted.data[2].y) == [-0.5, 0.5, None]
    cross = evicted.data[4]
    assert list(cross.x) == [3] and list(cross.y) == [1] and cross.marker.symbol == "x"
    assert "Marked in red" in note and table["visible"]
    assert len(views["a"].retention_figure().data) == 1  # the figure a run streams into stays unmarked
    assert list(kept.layout.yaxis.range) == [1.5, -0.5]  # the heatmap's rows, the triangles on its top edge
    # With nothing typed, the table lists the disputed tokens and the panels go back to unmarked.
    note, table, *panels = follow(views, "")
    assert table["value"]["#"].tolist() == [1, 3] and "Marked" not in note
    assert [len(panel["value"].data) for panel in panels[:2]] == [1, 1]
    # Before any comparison has ended, the panels (a run may be drawing them) are left alone.
    assert follow(None, "42")[2:] == [gr.skip()] * 4


def test_compare_panels_share_their_position_and_step_ranges():
    """A run that stopped early (end of sequence after 2 steps) beside one of 5: both panels span 5 steps and
    the positions of the longer run, so a cell is one size across the row and the short run ends where it
    ended, not at the bottom of its panel."""
    from kvviz.trace import StepEvent
    from kvviz.ui.compare_views import compare_panels

    def run(steps: int) -> RunView:
        view = RunView(4, steps, 8, list("abcd"))
        for step in range(steps):
            view.add(StepEvent(step, 0, 0, "x", np.arange(4 + step), np.empty(0, np.int64)), "x")
        return view

    short, long = compare_panels({"short": run(2), "long": run(5)})
    for panel in (short, long):
        assert list(panel.layout.yaxis.range) == [4.5, -0.5]  # step 0 on top, 5 steps
        # positions 0..7: the prompt and the 4 generated tokens cached by step 4 (the last's is never written)
        assert list(panel.layout.xaxis.range) == [-0.5, 7.5]
        assert panel.layout.yaxis.dtick == 1
    assert len(short.data[0].z) == 2  # the short run's own rows, not padded


def test_live_marks_the_typed_follow_tokens_on_its_retention_heatmap():
    """Live's Follow marks what is typed on the retention heatmap as Compare's panels do, a generated token
    from the step it entered the cache; an empty field (the boundary entries, which change per step) marks
    nothing, and the figure a run streams into stays unmarked."""
    from kvviz.trace import StepEvent
    from kvviz.ui.live_views import followed_views, scrub, step_views

    # prompt [a][b][c][d], budget 4: step 1 adds #4 ("x") and evicts #1; step 2 adds #5 and evicts #4
    view = RunView(4, 3, 4, ["a", "b", "c", "d"])
    view.add(StepEvent(0, 0, 0, "x", np.arange(4), np.empty(0, np.int64)), "x")
    view.add(StepEvent(1, 0, 0, "y", np.array([0, 2, 3, 4]), np.array([1])), "y")
    view.add(StepEvent(2, 0, 0, "z", np.array([0, 2, 3, 5]), np.array([4])), "z")
    tab = live_tab()
    followed = followed_views(tab, view, "#1, #4", 2)
    history, retention = followed[tab.history], followed[tab.retention]
    halo, line, top, cross = retention.data[1:]
    # a 1-px red line vanished on the kept cells' navy: it lies on a wider white one
    assert list(halo.x) == list(line.x) and halo.line.width > line.line.width and "255,255,255" in halo.line.color
    # #1: cached from the prefill until step 1 evicts it; #4: from step 1, when it entered, until step 2
    assert list(line.x) == [1, 1, None, 4, 4, None] and list(line.y) == [-0.5, 0.5, None, 0.5, 1.5, None]
    assert list(top.x) == [1, 4] and list(cross.x) == [1, 4] and list(cross.y) == [1, 2]
    assert top.hovertext == ("#1 b: evicted at step 1", "#4 x: evicted at step 2")
    assert "red followed" in retention.layout.title.text and history is not None
    assert [shape.y0 for shape in retention.layout.shapes if shape.line.color == STEP_MARKER_COLOR] == [2]  # the step
    # the step's line is not mistaken for a followed token's, nor for the green of protected entries
    assert STEP_MARKER_COLOR not in (line.line.color, "#2ca02c") and STEP_MARKER_COLOR not in FOLLOW_COLORS
    # scrubbing keeps the marks, at the step scrubbed to; nothing typed, nothing marked
    scrubbed = scrub(tab, view, 1, "#1")[tab.retention]
    assert list(scrubbed.data[2].x) == [1, 1, None]
    assert [shape.y0 for shape in scrubbed.layout.shapes if shape.line.color == STEP_MARKER_COLOR] == [1]
    assert len(scrub(tab, view, 1, "")[tab.retention].data) == 1
    assert len(followed_views(tab, view, "", 2)[tab.retention].data) == 1
    assert "red followed" not in scrub(tab, view, 1, "")[tab.retention].layout.title.text
    # at a run's end the views after it mark what was typed, and leave the heatmap alone without it
    assert len(step_views(tab, view, "#1", 2)[tab.retention].data) == 5
    assert step_views(tab, view, "", 2)[tab.retention] == gr.skip()
    assert len(view.retention_figure().data) == 1
    assert followed_views(tab, None, "#1", 0) == gr.skip()  # both outputs skipped


def test_compare_lists_each_policys_stability_diagnostics(tiny):
    """The table beside the comparison holds, per policy, what diagnostics.summary gives for the same run
    made alone by kvviz.run (a shared prefill changes nothing), n/a where the policy records no such score."""
    from kvviz import diagnostics
    from kvviz.ui.checks import _models
    from kvviz.ui.common import RAW_STEPS
    from kvviz.ui.compare import make_compare_handler
    from kvviz.ui.compare_views import compare_diagnostics

    _models[TINY] = tiny
    model, tokenizer = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    *_, last = make_compare_handler(limits, compare_tab())(TINY, PROMPT, ["inertia", "tova", "streaming"],
                                                           "compression", 0.5, 0, 12, False)
    table = compare_diagnostics(last[compare_tab().state])["value"]
    assert list(table.columns) == ["diagnostic", "inertia", "tova", "streaming"]  # a column per policy: no scrolling
    table = table.set_index("diagnostic")
    # The steps the raw rows average over: every one of the 11 decode steps, but none for StreamingLLM.
    assert table.loc[RAW_STEPS].tolist() == ["11 of 11", "11 of 11", "0 of 11"]
    table = table.drop(RAW_STEPS)
    # StreamingLLM scores nothing: only what its keep sets give has a value.
    assert (table["streaming"] == "n/a").tolist() == [key not in ("keep_turnover", "first_keep_set_retained")
                                                      for key in diagnostics.summary(
        kvviz.run(model, tokenizer, PROMPT, "streaming", chat=False, compression=0.5, max_new_tokens=2).trace)]
    # Utility churn at k = B is only each keep set's turnover (the rank stabilities: tests/test_diagnostics_probe).
    for name in ("inertia", "tova"):
        assert table.loc["utility churn", name] == table.loc["keep turnover", name]
    for name in ("inertia", "tova", "streaming"):
        trace = kvviz.run(model, tokenizer, PROMPT, name, chat=False, compression=0.5, max_new_tokens=12).trace
        for key, value in diagnostics.summary(trace).items():
            assert table.loc[key.replace("_", " "), name] == ("n/a" if np.isnan(value) else f"{value:.4f}")
    assert compare_diagnostics(None)["visible"] is False


def test_a_new_comparison_drops_the_last_ones_state_before_it_runs(tiny):
    """Following tokens while a comparison runs must not show the previous comparison's fates."""
    from kvviz.ui.checks import _models
    from kvviz.ui.compare import make_compare_handler

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    from kvviz.ui.tickets import Tickets

    tab = compare_tab()
    updates = make_compare_handler(limits, tab)(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 4, False)
    first = next(updates)  # an API call's first in its session: only its tickets, before the checks
    assert list(first) == [tab.buttons.tickets] and isinstance(first[tab.buttons.tickets], Tickets)
    start = next(updates)
    # the state outputs (views; inputs and note), before any step
    assert (start[tab.state], start[tab.ran]) == (None, None)
    *_, last = updates
    assert set(last[tab.state]) == {"inertia", "tova"}
    # what the page marks "earlier inputs" against: the inputs this run was given and its own note, which a
    # later click's comparison cannot have replaced
    assert last[tab.ran] == {"inputs": {"model": TINY, "prompt": PROMPT, "policies": ["inertia", "tova"],
                                        "cache size by": "compression", "compression ρ": 0.5, "max new tokens": 4,
                                        "chat template": False, "temperature": 0.0}, "note": last[tab.divergence]}
    assert last[tab.divergence].startswith("**prompt**")


def test_the_probe_step_goes_no_further_than_a_run_may_decode(client):
    """The probe decodes its step's tokens first, with no Stop and the model's queue behind it: no more than
    this server's max new tokens (3000 here), said with what to choose."""
    with pytest.raises(Exception, match="the probe step is 5000: the probe decodes that many tokens first, and this "
                                        r"server decodes at most 3000 \(its max new tokens\); "
                                        "choose a step up to 3000"):
        client.predict(TINY, PROMPT, ["inertia"], False, 5000, 16, api_name="/probe")
    # An empty sample field is refused like an empty step; so is a sample that would hold the model for long.
    with pytest.raises(Exception, match=r"entries sampled \(1-256\) is empty; type a whole number"):
        client.predict(TINY, PROMPT, ["inertia"], False, 2, None, api_name="/probe")
    with pytest.raises(Exception, match=r"entries sampled \(1-256\) is 257: each entry costs a decode of 8 tokens "
                                        r"while the probe holds the model, so this app samples at most 256; for more, "
                                        r"or all of them, run `kvviz probe --sample N` \(or without --sample\)"):
        client.predict(TINY, PROMPT, ["inertia"], False, 2, 257, api_name="/probe")


def test_the_probe_and_spectrum_are_checked_before_they_run(tiny):
    """Refused by a check with no outputs, so that the last probe or spectrum on screen is not marked "Error";
    valid inputs pass the check silently."""
    from kvviz.ui.analyses import make_probe_check, make_spectrum_check
    from kvviz.ui.checks import _models

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    probe_check, spectrum_check = make_probe_check(limits), make_spectrum_check(limits)
    assert probe_check(TINY, PROMPT, ["inertia"], False, 2, 16) is None
    assert spectrum_check(TINY, PROMPT, False, 3, "") is None and spectrum_check(TINY, PROMPT, False, 3, "2") is None
    for args, message in [((TINY, PROMPT, ["inertia"], False, None, 16), "the probe step is empty"),
                          ((TINY, PROMPT, ["inertia"], False, 2, None), r"entries sampled \(1-256\) is empty"),
                          ((TINY, PROMPT, ["inertia"], False, 2, 0), r"entries sampled \(1-256\) must be at least 1"),
                          ((TINY, PROMPT, ["inertia"], False, 17, 16), "the probe step is 17: .* at most 16"),
                          ((TINY, PROMPT, [], False, 2, 16), "choose one to four policies to rank")]:
        with pytest.raises(gr.Error, match=message):
            probe_check(*args)
    # a server that decodes further than the model's context (4096): the probe names its step against that
    with pytest.raises(gr.Error, match="probing step 4090 decodes 4098 tokens"):
        make_probe_check(Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=5000))(
            TINY, PROMPT, ["inertia"], False, 4090, 16)
    for args, message in [((TINY, PROMPT, False, 3, "5"), "layer must be between 0 and 2 for this model, got 5"),
                          ((TINY, PROMPT, False, 0, ""), "the steps compared must be between 1 and 64, got 0"),
                          ((TINY, PROMPT, False, 3, "two"), "the layer must be a whole number, got 'two'")]:
        with pytest.raises(gr.Error, match=message):
            spectrum_check(*args)


def test_the_spectrum_shows_the_librarys_figures_and_refuses_a_bad_layer(client):
    from kvviz.spectrum import spectrum

    table, note, plot, layers = client.predict(TINY, PROMPT, False, 3, "", api_name="/spectrum")  # the middle layer
    model, tokenizer = kvviz.load_model(TINY)
    expected = spectrum(model, kvviz.encode_prompt(tokenizer, PROMPT, chat=False), steps=3)
    assert [row[0] for row in table["data"]] == [row["scorer"] for row in expected.table()]
    assert [row[1] for row in table["data"]] == [round(row["layer_spearman"], 3) for row in expected.table()]
    assert table["headers"] == ["scorer", "Spearman at the layer", "top-B Jaccard at the layer",
                                "Spearman through the EMA", "top-B Jaccard through the EMA"]
    assert "layer 1 of 0-2" in note
    bars = json.loads(plot["plot"])["data"]
    assert [bar["y"] for bar in bars] == [[row[key] for row in expected.table()]
                                         for key in ("layer_spearman", "utility_spearman")]
    import base64

    grid = json.loads(layers["plot"])["data"][0]
    z = grid["z"]  # a numpy array travels as plotly's typed array: base64 bytes, dtype and shape
    z = np.frombuffer(base64.b64decode(z["bdata"]), dtype=z["dtype"]).reshape(
        [int(n) for n in z["shape"].split(",")]) if isinstance(z, dict) else np.asarray(z, dtype=float)
    assert list(grid["y"]) == list(expected.layer_profile())
    assert json.loads(layers["plot"])["layout"]["xaxis"]["dtick"] == 1  # whole layers, not -0.5, 0, 0.5
    np.testing.assert_allclose(z, np.stack(list(expected.layer_profile().values())))
    _, note, _, _ = client.predict(TINY, PROMPT, False, 3, " 2 ", api_name="/spectrum")
    assert "layer 2 of 0-2" in note
    _, note, _, _ = client.predict(TINY, PROMPT, False, 1, "", api_name="/spectrum")
    assert note.endswith("top-B churn between steps n/a (one step has none to compare with).")
    with pytest.raises(Exception, match="layer must be between 0 and 2"):
        client.predict(TINY, PROMPT, False, 3, "5", api_name="/spectrum")
    with pytest.raises(Exception, match="the layer must be a whole number, got 'two'"):
        client.predict(TINY, PROMPT, False, 3, "two", api_name="/spectrum")
    with pytest.raises(Exception, match="the steps compared must be between 1 and 64, got 0"):
        client.predict(TINY, PROMPT, False, 0, "", api_name="/spectrum")


def test_the_probe_draws_avokvs_blindspot_grid_or_says_why_not(client):
    from kvviz.probe import blindspot, probe

    table, note, plot = client.predict(TINY, PROMPT * 2, ["inertia", "tova"], False, 3, 256, api_name="/probe")
    assert {row[0] for row in table["data"]} == {"inertia", "tova"}  # AvoKV-E joins the probe, not the table
    assert table["headers"] == ["policy", "AUROC", "AUROC p", "average precision", "top-k recall", "false-safe rate",
                                "Spearman"]
    assert "Blindspot:" in note and "ranked by AvoKV-E" in note
    # the columns said, with this probe's own k: the top decile of the damage over the entries ranked
    k = re.search(r"high damage is the top decile \(k = (\d+) of (\d+) entries\)", note)
    assert k and np.ceil(0.1 * int(k[2])) <= int(k[1]) < int(k[2])  # at or above the 90th percentile
    assert plot["visible"] is True
    figure = json.loads(plot["value"]["plot"])  # a gr.update payload
    cells = figure["data"][0]["text"]
    # the same grid the library computes on the same probe (the tiny model is deterministic)
    model, tokenizer = kvviz.load_model(TINY)
    prompt_ids = kvviz.encode_prompt(tokenizer, PROMPT * 2, chat=False)
    result = probe(model, tokenizer, prompt_ids, 3, policies={"avokv": kvviz.make_policy("avokv")}, future=8)
    terms = result.terms["avokv"]
    sinks = np.isposinf(terms["S"])
    assert sinks.sum() == 4 and np.isfinite(terms["N(p)"][sinks]).all()  # ranked, but never evicted: left out
    spot = blindspot([(np.where(sinks, np.nan, terms["N(p)"]), terms["N(b)"], result.damage)])
    assert spot.entries_in + spot.entries_out == np.isfinite(terms["S"]).sum()
    assert cells == [[f"{spot.grid_high[r, c]}/{spot.grid_entries[r, c]}" for c in range(5)] for r in range(5)]
    # its test's line as the title, broken into lines that a plot in a 1000-px window holds
    from kvviz.ui.figures import TITLE_12_CHARS
    title = figure["layout"]["title"]["text"]
    assert title.replace("<br>", " ") == "Blindspot: " + spot.summary().replace("<=", "≤").replace(">=", "≥")
    assert len(title.split("<br>")) > 1 and all(len(line) <= TITLE_12_CHARS for line in title.split("<br>"))
    _, note, plot = client.predict(TINY, "The passkey is 71432.", ["inertia"], False, 2, 256, api_name="/probe")
    assert "AvoKV-E judges nothing at step 2" in note and plot["visible"] is False


def test_the_probe_says_what_an_auroc_below_chance_means(tiny, monkeypatch):
    """0.24 against R-KV's 0.85 read as a bug in a browser review; it is a ranking that drops the damaging
    entries first, and the note says so, naming the policy, only where one is below 0.5."""
    import kvviz.probe
    from kvviz.ui.analyses import make_probe_handler
    from kvviz.ui.checks import _models

    _models[TINY] = tiny
    handler = make_probe_handler(Limits(models=(TINY,)))
    table, note, _ = handler(TINY, PROMPT * 2, ["inertia", "tova"], False, 3, 256)
    below = [policy for policy, auroc in zip(table.policy, table.AUROC) if auroc < 0.5]  # a random model's
    assert ("AUROC below 0.5" in note) == bool(below) and all(policy in note for policy in below)
    real = kvviz.probe.aligned_quality

    def one_inverted(utilities, damage, p=0.012):
        quality, aligned = real(utilities, damage)
        return {"inertia": {**quality["inertia"], "auroc": 0.9},
                "tova": {**quality["tova"], "auroc": 0.24, "auroc_p": p}}, aligned

    monkeypatch.setattr(kvviz.probe, "aligned_quality", one_inverted)
    table, note, _ = handler(TINY, PROMPT * 2, ["inertia", "tova"], False, 3, 256)
    assert "AUROC below 0.5 (tova 0.24, p = 0.012): worse than chance" in note
    assert table.set_index("policy").AUROC["tova"] == 0.24 and "AUROC p" in table.columns
    # one that could be chance is not called worse than chance: a handful of high-damage entries
    monkeypatch.setattr(kvviz.probe, "aligned_quality", lambda u, d: one_inverted(u, d, p=0.33))
    _, note, _ = handler(TINY, PROMPT * 2, ["inertia", "tova"], False, 3, 256)
    assert "worse than chance," not in note
    assert "AUROC below 0.5 (tova 0.24, p = 0.330), but with this few high-damage entries not distinguishable" in note
    monkeypatch.setattr(kvviz.probe, "aligned_quality", one_inverted)
    assert "Scored with" not in note and "false-safe rate" in table.columns  # neither protects anything
    monkeypatch.undo()
    table, note, _ = handler(TINY, PROMPT * 2, ["tova", "h2o"], False, 3, 256)
    budget = len(kvviz.engine.encode_prompt(kvviz.load_model(TINY)[1], PROMPT * 2, chat=False)) + 3  # P + 1
    assert f"Scored with the cache whole, so settings that follow B are those of a B that large; never judged: " \
           f"h2o the newest {int(0.5 * budget)} (the step's own among them) (B = {budget})" in note
    # and it is not ranked there: H2O's window is +inf (not judged), not its accumulated attention
    entries = int(note.split(" entries probed")[0])
    assert f"Ranked over the {entries - int(0.5 * budget) + 1} entries every policy judged" in note


def test_the_probe_names_a_ranking_that_is_mostly_one_tied_score(tiny, monkeypatch):
    """LazyEviction scores every entry not yet read twice 0; a ranking of 40 ties and one 1 gets its AUROC
    from ties' half credit.  The note names it, with the share, and its p-value is the exact one."""
    import kvviz.probe
    from kvviz.probe import auroc_p, top_decile
    from kvviz.ui.analyses import make_probe_handler
    from kvviz.ui.checks import _models

    _models[TINY] = tiny
    real, probed = kvviz.probe.probe, []

    def tova_all_tied(*args, **kwargs):
        result = real(*args, **kwargs)
        probed.append(result)
        result.utilities["tova"] = np.where(np.arange(len(result.candidates)) == 0, 1.0, 0.0)
        return result

    monkeypatch.setattr(kvviz.probe, "probe", tova_all_tied)
    table, note, _ = make_probe_handler(Limits(models=(TINY,)))(TINY, PROMPT * 2, ["inertia", "tova"], False, 3, 256)
    entries = int(note.split(" entries probed")[0])
    assert f"Mostly one tied score: tova ({(entries - 1) / entries:.0%}) of the ranked entries share it" in note
    assert "inertia (" not in note  # attention weights are all distinct
    exact = auroc_p(probed[0].utilities["tova"], top_decile(probed[0].damage))  # every entry is aligned here
    assert table.set_index("policy")["AUROC p"]["tova"] == float(f"{exact:.2g}")


def test_an_analysis_of_earlier_inputs_names_what_changed():
    """The probe's result after its prompt or policies changed: the note says which, the labels say so, and the
    inputs it ran on restore both; before any run there is nothing to mark."""
    from kvviz.ui.common import Staleness

    with gr.Blocks():
        outputs = [gr.Markdown(), gr.Dataframe(), gr.Plot()]
    staleness = Staleness("probe", ["model", "prompt", "policies"], outputs[0],
                          {outputs[1]: "Ranking", outputs[2]: "Blindspot"})
    assert staleness.outputs == outputs
    assert staleness.mark(None, "m", "p", ["a", "b"]) == gr.skip()  # every output left as it is
    state = staleness.remember("m", "p", ["a", "b"], "40 entries probed")
    note, table, plot = outputs_of(staleness.mark(state, "m", "p2", ["a", "c"]), outputs)
    assert note == ("**Earlier inputs: the prompt, policies changed since this probe ran; run it again for the "
                    "current ones.** 40 entries probed")
    assert table["label"] == "Ranking (earlier inputs)" and plot["label"] == "Blindspot (earlier inputs)"
    assert "visible" not in plot  # the blindspot stays hidden where the probe had none
    assert outputs_of(staleness.mark(state, "m", "p", ["a", "b"]), outputs) == [
        "40 entries probed", gr.update(label="Ranking"), gr.update(label="Blindspot")]


def test_the_prompt_size_shows_before_a_run(tiny):
    from kvviz.ui.checks import _models
    from kvviz.ui.common import make_prompt_counter

    count = make_prompt_counter(Limits(models=(TINY,), max_prompt_tokens=50))
    _models.pop("tiny-random-qwen2", None)
    assert "once tiny-random-qwen2 is loaded" in count("tiny-random-qwen2", PROMPT, False)
    _models[TINY] = tiny
    tokens = len(kvviz.engine.encode_prompt(tiny[1], PROMPT, chat=False))
    assert tokens > 50 and count(TINY, PROMPT, False) == f"*{tokens} tokens: over the limit of 50, shorten it*"
    short = len(kvviz.engine.encode_prompt(tiny[1], "short", chat=False))
    assert count(TINY, "short", False) == f"*{short} tokens (limit 50)*"
    assert count(TINY, "   ", True) == "*empty prompt*"


def test_a_reused_retention_figure_keeps_its_title_and_bands_up_to_date():
    """Streaming updates the figure in place; once the run outgrows 256 rows the cells cover 2 steps and the
    title must say so, and the sinks band must reach the last step."""
    from kvviz.trace import StepEvent

    view = RunView(8, 400, 6, pinned=(2, 0))
    kept = np.arange(6)
    view.add(StepEvent(0, 0, 0, "x", kept, np.array([6, 7])))
    first = view.retention_figure()
    assert "cell =" not in first.layout.title.text
    for step in range(1, 300):
        new = 8 + step - 1
        view.add(StepEvent(step, 0, 0, "x", np.append(kept[:5], new), np.array([kept[5]])))
        kept = np.append(kept[:5], new)
    again = view.retention_figure()
    assert again is first  # reused in place
    assert "cell = 1 pos × 2 steps" in again.layout.title.text
    sinks = [shape for shape in again.layout.shapes if shape.type == "rect"][0]
    assert sinks.y1 == 299.5


def test_a_short_run_puts_its_step_ticks_on_whole_steps():
    """A run of one or two steps: Plotly's own ticks fell on -0.5 and 0.5, steps that do not exist.  Every
    step axis ticks each step while a run is short, the streamed figures too, and hands back to Plotly's
    ticks once the run is long enough for them to be whole; the time split marks its points meanwhile."""
    from kvviz.trace import StepEvent

    UTILITY = np.array([0.4, 0.3, 0.2, 0.1], np.float32)  # distinct: equal utilities rank nothing
    view = RunView(6, 40, 4, ["a", "b", "c", "d", "e", "f"])
    kept = np.arange(4)
    view.add(StepEvent(0, 0, 0, "x", kept, np.array([4, 5]), UTILITY))
    view.add(StepEvent(1, 0, 0, "x", np.array([0, 1, 2, 6]), np.array([3]), UTILITY))
    streamed = [view.retention_figure(), view.rank_figure(), view.timeline_figure()]
    assert [figure.layout.yaxis.dtick for figure in streamed[:2]] == [1, 1]
    assert {axis.dtick for axis in streamed[2].select_xaxes()} == {1}
    # the time split of one decode step is one point per part: markers, as an area of no width draws nothing
    assert [trace.mode for trace in streamed[2].data[2:]] == ["lines+markers"] * 3
    assert view.history_figure([0, 1]).layout.xaxis.dtick == 1
    for step in range(2, 30):
        view.add(StepEvent(step, 0, 0, "x", np.array([0, 1, 2, 4 + step]), np.array([3 + step]),
                           UTILITY))
    again = [view.retention_figure(), view.rank_figure(), view.timeline_figure()]
    assert all(a is b for a, b in zip(again, streamed))  # updated in place
    assert [figure.layout.yaxis.dtick for figure in again[:2]] == [None, None]
    assert {axis.dtick for axis in again[2].select_xaxes()} == {None}
    assert [trace.mode for trace in again[2].data[2:]] == ["lines"] * 3
    assert view.history_figure([0, 1]).layout.xaxis.dtick is None


def test_evictions_per_step_show_single_evictions_beside_the_first_mass_eviction():
    """The first decode step drops L0 − B entries at once; on a linear axis every later single eviction was a
    bar one pixel high.  The axis is logarithmic from below 1, so a count of 1 has height, and the streamed
    figure's range follows a larger count."""
    import math

    from kvviz.trace import StepEvent

    utility = np.linspace(1, 0, 4).astype(np.float32)
    view = RunView(604, 40, 4, [str(i) for i in range(604)])
    view.add(StepEvent(0, 0, 0, "x", np.arange(104), np.empty(0, np.int64), np.zeros(104, np.float32)))
    view.add(StepEvent(1, 0, 0, "x", np.array([0, 1, 2, 604]), np.arange(3, 104), utility))
    view.add(StepEvent(2, 0, 0, "x", np.array([0, 1, 2, 605]), np.array([604]), utility))
    figure = view.timeline_figure()
    axis = figure.layout.yaxis2  # the middle row
    low, high = axis.range
    assert axis.type == "log" and low < math.log10(1) and math.log10(101) < high
    assert list(figure.data[1].y) == [0, 101, 1]
    view.add(StepEvent(3, 0, 0, "x", np.array([0, 1, 2, 606]), np.arange(104, 604), utility))  # a made-up burst
    assert view.timeline_figure() is figure and figure.layout.yaxis2.range[1] > math.log10(500)


def test_dockerfile_and_space_front_matter_agree_with_the_app():
    readme = (ROOT / "README.md").read_text()
    front = re.match(r"---\n(.*?)\n---\n", readme, re.S).group(1)
    meta = dict(line.split(": ", 1) for line in front.splitlines() if ": " in line)
    dockerfile = (ROOT / "Dockerfile").read_text()
    port = int(meta["app_port"])
    assert meta["sdk"] == "docker"
    assert f"EXPOSE {port}" in dockerfile and f"GRADIO_SERVER_PORT={port}" in dockerfile
    assert "GRADIO_SERVER_NAME=0.0.0.0" in dockerfile
    assert Limits().port == port  # the app's own default
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    assert cmd[-1] == "app.py" and (ROOT / "app.py").exists()
    assert "launch()" in (ROOT / "app.py").read_text()
    assert re.search(r"useradd .*-u 1000", dockerfile)
    # CPU torch unless the build names another index; the device follows the same build
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in dockerfile
    assert '--index-url "$TORCH_INDEX"' in dockerfile
    assert "ARG KVVIZ_DEVICE=cpu" in dockerfile and "KVVIZ_DEVICE=$KVVIZ_DEVICE" in dockerfile
    assert "kvviz.load_model()" in dockerfile  # the default model is baked in at build time


def test_the_deployment_names_its_device_and_dtype_and_refuses_bad_ones(monkeypatch):
    monkeypatch.setenv("KVVIZ_DEVICE", "cpu")
    monkeypatch.setenv("KVVIZ_DTYPE", "bfloat16")
    limits = Limits.from_env()
    assert (limits.device, limits.dtype) == ("cpu", "bfloat16")
    monkeypatch.delenv("KVVIZ_DEVICE")
    monkeypatch.delenv("KVVIZ_DTYPE")
    assert (Limits.from_env().device, Limits.from_env().dtype) == ("cpu", "")  # float32 on the CPU
    with pytest.raises(ValueError, match="unknown device 'gpu': use cpu, cuda or cuda:N"):
        Limits(device="gpu")
    with pytest.raises(ValueError, match=r"KVVIZ_DTYPE, kvviz serve --dtype\) must be one of float32, bfloat16"):
        Limits(dtype="float8")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU is visible here; use cpu"):
            Limits(device="cuda")


def served_models_are_checked_at_start(monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    from kvviz.ui.app import check_served_models

    def answer(error):
        def metadata(*args, **kwargs):
            raise error.__new__(error)  # as the hub's answer would be (built without an HTTP response)
        monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", metadata)

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # the hub asked (here, the stand-in below)
    answer(RepositoryNotFoundError)
    with pytest.raises(ValueError, match=r"^the models \(KVVIZ_DEFAULT_MODEL, KVVIZ_MODELS, kvviz serve --models\): "
                                         r"the Hugging Face hub has no model 'bogus' \(nor the local cache\)"):
        check_served_models(Limits(models=(TINY, "bogus")))
    answer(GatedRepoError)  # it exists; its load asks for a token
    check_served_models(Limits(models=("meta-llama/Llama-3.1-8B",)))
    answer(ConnectionError)  # no answer: not cached, so it could not load
    with pytest.raises(ValueError, match="cannot reach the Hugging Face hub for 'someone/some-model'"):
        check_served_models(Limits(models=("someone/some-model",)))
    with pytest.raises(ValueError, match="'bad id!' is neither a local folder nor a Hugging Face hub id"):
        check_served_models(Limits(models=("bad id!",)))
    check_served_models(Limits(models=(TINY, "tiny-random-qwen2")))  # built here: nothing to ask
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError,
                       match="'someone/some-model' is not in the local Hugging Face cache, and HF_HUB_OFFLINE"):
        check_served_models(Limits(models=("someone/some-model",)))


def test_kvviz_serve_flags_override_the_environment(monkeypatch):
    import kvviz.ui.app
    from kvviz.cli import main

    launched = []
    monkeypatch.setattr(kvviz.ui.app, "launch", launched.append)
    monkeypatch.setenv("KVVIZ_MODELS", "tiny-random-qwen2")
    assert main(["serve", "--dtype", "bfloat16"]) == 0
    assert launched[-1].dtype == "bfloat16" and launched[-1].models[1:] == ("tiny-random-qwen2",)
    assert main(["serve", "--models", "tiny-random-gemma, tiny-random-llama,tiny-random-gemma"]) == 0
    assert launched[-1].models == ("tiny-random-gemma", "tiny-random-llama") and launched[-1].dtype == ""
    assert main(["serve", "--device", "tpu"]) == 2 and len(launched) == 2
    # A flag corrects a bad variable instead of being refused with it; an empty list of models is refused.
    monkeypatch.setenv("KVVIZ_DEVICE", "gpu")
    monkeypatch.setenv("KVVIZ_DTYPE", "fp16")
    assert main(["serve", "--device", "cpu", "--dtype", "float16"]) == 0
    assert (launched[-1].device, launched[-1].dtype) == ("cpu", "float16")
    assert main(["serve", "--device", "cpu", "--dtype", "float16", "--models", " , "]) == 2 and len(launched) == 3
    # A mistyped local path or tiny family is refused at start, not when someone picks it; a hub id is
    # only known to exist once fetched, so it passes.
    for models, said in (("./no-such-model", "no folder './no-such-model'"), ("tiny-random-lama", "no tiny model "
                         "'tiny-random-lama'; choose tiny-random-<family> with a family of llama, qwen2")):
        with pytest.raises(ValueError, match=f"the models .*kvviz serve --models\\): {said}"):
            Limits(models=(models,))
    assert Limits(models=("someone/some-model",)).models == ("someone/some-model",)
    # but the server asks the hub (once, no retries) before it comes up: unknown or unreachable, it is refused
    served_models_are_checked_at_start(monkeypatch)
    # The figure rate: the environment's, the flag over it, and a refusal that names both.
    monkeypatch.delenv("KVVIZ_DEVICE")
    monkeypatch.delenv("KVVIZ_DTYPE")
    monkeypatch.setenv("KVVIZ_FIGURES_PER_SECOND", "2.5")
    assert main(["serve"]) == 0 and launched[-1].figures_per_second == 2.5
    assert main(["serve", "--figures-per-second", "0"]) == 0 and launched[-1].figures_per_second == 0
    for value in ("-1", "nan", "61"):
        assert main(["serve", "--figures-per-second", value]) == 2 and len(launched) == 5
    monkeypatch.setenv("KVVIZ_FIGURES_PER_SECOND", "fast")
    with pytest.raises(ValueError, match="KVVIZ_FIGURES_PER_SECOND must be a number, got 'fast'"):
        Limits.from_env()
    monkeypatch.delenv("KVVIZ_FIGURES_PER_SECOND")
    assert Limits.from_env().figures_per_second == 10
    # Where it listens: the environment's, the flags over it; a port out of range is refused at start.
    monkeypatch.setenv("GRADIO_SERVER_PORT", "8000")
    assert main(["serve"]) == 0 and (launched[-1].host, launched[-1].port) == ("127.0.0.1", 8000)
    assert main(["serve", "--host", "0.0.0.0", "--port", "9000"]) == 0
    assert (launched[-1].host, launched[-1].port) == ("0.0.0.0", 9000)
    for flags in (["--port", "0"], ["--port", "70000"], ["--host", " "]):
        assert main(["serve", *flags]) == 2 and len(launched) == 7


def test_the_live_tab_runs_the_model_in_the_deployments_dtype():
    """A GPU deployment runs bfloat16 models: the app must load them so and decode as the library does."""
    import torch

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models, get_model
    from kvviz.ui.live import make_live_handler

    name = "tiny-random-qwen2"
    limits = Limits(models=(name,), max_prompt_tokens=400, max_new_tokens=16, dtype="bfloat16")
    _models.pop(name, None)
    try:
        model, tokenizer = get_model(limits, name)
        assert model.dtype == torch.bfloat16 and get_model(limits, name)[0] is model  # loaded once
        defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
        *_, last = make_live_handler(limits, live_tab())(name, PROMPT, "inertia", "compression", 0.5, 0, 10, False,
                                                         *GREEDY, *defaults, "", None)
        expected = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, compression=0.5, max_new_tokens=10)
        assert last[live_tab().text] == expected.text
        assert ([e.kept.tolist() for e in last[live_tab().view_state].events]
                == [e.kept.tolist() for e in expected.trace.events])
        # the download says how it decoded
        assert kvviz.Trace.load(last[live_tab().download]["value"]).dtype == "bfloat16"
    finally:
        _models.pop(name, None)


GREEDY = (0.0, 0.95, 0)  # the Sampling widgets as the page starts: temperature 0, top-p, seed


def test_a_one_token_run_says_why_its_cache_is_over_budget_and_offers_no_scrubber(tiny):
    """One new token is the prefill alone: no decode step ran, so nothing was evicted yet (InertiaKV evicts
    at every step) and there is no step to scrub to.  The stats line counts allocated memory as such."""
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.live import make_live_handler

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
    *_, last = make_live_handler(limits, live_tab())(TINY, PROMPT, "inertia", "compression", 0.5, 0, 1, False, *GREEDY,
                                         *defaults, "", None)
    stats, slider = last[live_tab().stats], last[live_tab().step_slider]
    assert "(over B: no decode step ran, and eviction starts at the first, or at a checkpoint)" in stats
    assert "does not evict" not in stats
    assert slider["visible"] is False
    *_, last = make_live_handler(limits, live_tab())(TINY, PROMPT, "inertia", "compression", 0.5, 0, 4, False, *GREEDY,
                                         *defaults, "", None)
    assert "over B" not in last[live_tab().stats]
    assert last[live_tab().step_slider]["visible"] is True and last[live_tab().step_slider]["maximum"] == 3
    assert "**decode** – (no decode step)" in stats
    bytes_ = last[live_tab().view_state].events[-1].cache_bytes
    assert f"entries, {bytes_ / 2**20:.2f} MiB allocated" in last[live_tab().stats]


def test_live_tab_runs_to_the_end_and_offers_the_trace(client, tiny):
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    # Every parameter widget at its registry default, as the browser sends them for InertiaKV.
    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    result = client.predict(TINY, PROMPT, "inertia", "budget", 0.5, 24, 10, False, *GREEDY, *widgets, "",
                            api_name="/live")
    text, stats, retention, ranks, timeline, fate, slider, trace_file, diag, detail = result
    model, tokenizer = tiny
    expected = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=24, max_new_tokens=10).trace
    assert text == tokenizer.decode(expected.token_ids, skip_special_tokens=True)
    assert "budget** 24" in stats and "cache** 24 entries" in stats
    # the whole run's evictions (the first decode step's cut included), then the last step's
    total, last = sum(e.evicted.size for e in expected.events), expected.events[-1]
    assert f"**evicted** {total} in all, {last.evicted.size} at step {last.step} ·" in stats and total > 9
    assert re.search(r" · \*\*prefill\*\* \d+\.\d\d s · \*\*decode\*\* ", stats)  # not in the time row
    loaded = kvviz.Trace.load(trace_file["value"] if isinstance(trace_file, dict) else trace_file)
    assert [e.kept.tolist() for e in loaded.events] == [e.kept.tolist() for e in expected.events]
    assert "raw utility jaccard" in diag
    assert "evicted at step" in fate


def test_an_opened_trace_shows_what_its_run_showed(client, tmp_path):
    """A trace saved by the CLI (library), opened in the Live tab: the same text, heatmaps, per-step plot,
    scrubber and diagnostics as the run itself showed when it ended; a file that is not a trace is refused."""
    from gradio_client import handle_file

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    live = client.predict(TINY, PROMPT, "inertia", "budget", 0.5, 24, 10, False, *GREEDY, *widgets, "",
                          api_name="/live")
    trace_file = live[7]["value"] if isinstance(live[7], dict) else live[7]
    opened = client.predict(handle_file(trace_file), api_name="/open_trace")
    plots = lambda result: [json.loads(result[i]["plot"])["data"] for i in (2, 3, 4, 9)]  # + step detail
    assert opened[0] == live[0] and plots(opened) == plots(live)
    assert opened[5] == live[5] and opened[8] == live[8]  # prompt tokens by fate, diagnostics
    assert opened[6]["maximum"] == live[6]["maximum"] and opened[6]["visible"]  # the scrubber
    assert opened[1].startswith(f"**opened** {Path(trace_file).name}: `inertia` (alpha=0.8, refresh=1")
    # the stats, less what ran (the opened line names it) and the wall time
    assert opened[1].split("\n", 1)[1] == live[1].removeprefix("**run** `inertia` · ").rsplit(" · ", 1)[0]
    (tmp_path / "notes.parquet").write_text("not a trace")
    with pytest.raises(Exception, match="notes.parquet is not a readable parquet file") as refused:
        client.predict(handle_file(str(tmp_path / "notes.parquet")), api_name="/open_trace")
    assert "/" not in str(refused.value)  # the upload's temporary folder stays on the server
    assert not kvviz.Trace.load(trace_file).stopped and kvviz.Trace.load(trace_file).max_new_tokens == 10
    # given in tokens
    assert kvviz.Trace.load(trace_file).compression is None and " in float32 · budget B = 24" in opened[1]


def test_an_opened_traces_settings_rerun_it_in_the_live_tab(tiny, tmp_path, monkeypatch):
    """'Use its settings' sets every Live control to the trace's run (non-default parameters, ρ, sampling,
    no chat template); Run with those controls makes the same tokens and keep sets.  A trace recorded from
    token ids has no prompt text: its ids' text is used, and reads back as the same ids.  A trace of a model
    not served here is refused, naming how to serve it."""
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.live import make_live_handler
    from kvviz.ui.traces import TraceReuse

    _models[TINY] = tiny
    model, tokenizer = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    widgets = {**{name: PARAMETERS[name]["default"] for name in PARAM_NAMES}, "alpha": 0.3, "refresh": 2}
    *_, ran = make_live_handler(limits, live_tab())(TINY, PROMPT, "inertia", "compression", 0.6, 0, 9, False,
                                                    0.7, 0.9, 3, *widgets.values(), "", None)
    saved = ran[live_tab().download]["value"]
    reuse = TraceReuse(limits, live_tab())
    settings_of = positional(reuse.settings, reuse.outputs)  # the controls, as reuse.outputs lists them
    model_name, prompt, chat, policy, mode, rho, budget, max_new, temperature, top_p, seed, description, *params = \
        settings_of(saved)
    assert (model_name, prompt, chat, policy, mode, rho["value"], max_new) == \
        (TINY, PROMPT, False, "inertia", "compression", 0.6, 9)
    assert (temperature, top_p, seed) == (0.7, 0.9, 3) and rho["visible"] and not budget["visible"]
    own = {p["name"] for p in kvviz.REGISTRY["inertia"].parameters()}
    shown = {name: update["value"] for name, update in zip(PARAM_NAMES, params) if update["visible"]}
    assert shown == {name: widgets[name] for name in own}  # InertiaKV's own, at the trace's values, shown
    assert "`alpha` = **0.3**" in description and "`refresh` = **2**" in description
    held = [update.get("value", widgets[name]) for name, update in zip(PARAM_NAMES, params)]  # others as they were
    *_, again = make_live_handler(limits, live_tab())(model_name, prompt, policy, mode, rho["value"],
                                                      budget.get("value"), max_new, chat, temperature, top_p, seed,
                                                      *held, "", None)
    first, second = kvviz.Trace.load(saved), kvviz.Trace.load(again[live_tab().download]["value"])
    assert second.token_ids == first.token_ids and second.params == first.params
    assert [e.kept.tolist() for e in second.events] == [e.kept.tolist() for e in first.events]

    ids = kvviz.engine.encode_prompt(tokenizer, PROMPT, chat=True)  # the chat template's special tokens too
    library = kvviz.run(model, tokenizer, ids, "tova", budget=20, max_new_tokens=6)
    assert library.trace.prompt == "" and library.trace.chat is None
    library.trace.model = TINY
    library.trace.save(tmp_path / "ids.parquet")
    outputs = settings_of(str(tmp_path / "ids.parquet"))
    assert outputs[2] is False and outputs[4] == "budget" and outputs[6]["value"] == 20
    assert kvviz.engine.encode_prompt(tokenizer, outputs[1], chat=False) == ids
    # sampled hotter than the app allows (the library takes any temperature): set to the most, and said
    library.trace.sampling = {"temperature": 3.0, "top_p": 0.9, "seed": 1}
    library.trace.save(tmp_path / "hot.parquet")
    warnings = []
    monkeypatch.setattr(gr, "Warning", warnings.append)
    assert settings_of(str(tmp_path / "hot.parquet"))[8:11] == [2.0, 0.9, 1]
    assert warnings == ["hot.parquet sampled at temperature 3; 2 is the most allowed here, and the rerun is set "
                        "to that"]
    library.trace.model = "someone/other-model"
    library.trace.save(tmp_path / "other.parquet")
    for step in (reuse.check, reuse.settings):  # the page's check (no outputs), and the handler itself
        with pytest.raises(gr.Error, match="ran on someone/other-model, which is not served here; start the app "
                                           "with `kvviz serve --models someone/other-model`"):
            step(str(tmp_path / "other.parquet"))
    library.trace.model, library.trace.policy = TINY, "thinkv"
    library.trace.save(tmp_path / "policy.parquet")
    with pytest.raises(gr.Error, match="ran policy 'thinkv', which this version does not have; choose one of"):
        reuse.check(str(tmp_path / "policy.parquet"))
    assert reuse.check(saved) is None  # a trace it can rerun passes silently


def test_compare_tab_shows_each_policys_own_run_and_where_they_diverge(client, tiny):
    model, tokenizer = tiny
    result = client.predict(TINY, PROMPT, ["inertia", "streaming"], "budget", 0.5, 20, 12, False, *GREEDY, "",
                            api_name="/compare")
    texts, divergence = result[:4], result[8]
    runs = [kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=20, max_new_tokens=12)
            for name in ("inertia", "streaming")]
    streamed = ["".join(e.text for e in run.trace.events) for run in runs]  # token by token, as the tab shows it
    assert [t["value"] for t in texts[:2]] == streamed  # the shared prefill changes nothing
    first = next(i for i, (a, b) in enumerate(zip(*(run.token_ids for run in runs))) if a != b)
    assert f"**streaming** vs **inertia**: first different token at step {first}" in divergence
    # Each narrow panel: titled by its policy with the colour key below; only StreamingLLM pins entries
    # (its sinks), so only its key explains the green band.
    layouts = [json.loads(figure["value"]["plot"])["layout"] for figure in result[4:6]]  # gr.update payloads
    assert [layout["title"]["text"].split("<br>")[0] for layout in layouts] == ["inertia", "streaming"]
    assert ["green protected" in layout["title"]["text"] for layout in layouts] == [False, True]
    assert not [a for layout in layouts for a in layout.get("annotations", []) if a["text"].startswith("green:")]


def outputs_alone(view):
    """The layout of ``view``'s Compare panel as the only panel, titled 'tova'."""
    from kvviz.ui.compare_views import compare_panels

    return compare_panels({"tova": view})[0].layout


def test_a_long_settings_label_wraps_in_its_panels_title():
    """Cut at a quarter-width panel's edge, 'avokv interval=16 lambda_b=0' lost the part that told it from
    'avokv interval=16': a label wraps at its spaces, and every panel of the comparison grows by the lines the
    longest title takes, so that their plots stay in line."""
    from kvviz.trace import StepEvent
    from kvviz.ui.compare import compare_outputs

    views = {}
    for name in ("tova", "avokv interval=16 normalise=false"):
        view = views[name] = RunView(6, 3, 4, list("abcdef"))
        view.add(StepEvent(0, 0, 0, "!", np.arange(6), np.empty(0, np.int64), np.zeros(6, np.float32)), "!")
    tab = compare_tab()
    outputs = compare_outputs(tab, list(views), {name: "" for name in views}, views, figures=True, final=False)
    short, long = (outputs[fig]["value"].layout for fig in tab.figs[:2])
    assert short.title.text.split("<br>")[0] == "tova"
    assert long.title.text.split("<br>")[:2] == ["avokv interval=16", "normalise=false"]
    assert long.height == short.height and long.margin.t == short.margin.t  # in line with each other
    assert long.margin.t - outputs_alone(views["tova"]).margin.t == 20  # one line more than tova's own title


def test_every_comparison_from_the_papers_runs_at_the_tabs_defaults(tiny):
    """Two to four distinct policies (distinct as policies, not only as labels), each accepted by the check
    on the tab's own example and settings, so that picking one and pressing Compare runs."""
    from kvviz.tasks.examples import EXAMPLES
    from kvviz.ui.checks import _models, compare_settings
    from kvviz.ui.compare import CompareChecks
    from kvviz.ui.presets import COMPARISONS

    _models[TINY] = tiny
    check = CompareChecks(Limits(models=(TINY,), max_prompt_tokens=4096, max_new_tokens=512), compare_tab()).check
    for name, entries in COMPARISONS.items():
        settings = compare_settings(entries)
        assert list(settings) == entries, name  # each entry is its own canonical label: none repeats another
        # the first is the reference of the Jaccard and divergence lines; against the full cache every keep
        # set's Jaccard is B / (L0 + t), the same for every policy
        assert entries[0] != "full", name
        check(TINY, EXAMPLES["Four-key needle"], entries, "compression", 0.75, 0, 48, True, 0.0, 0.95, 0)


def test_compare_runs_one_policy_at_two_settings_side_by_side(client, tiny):
    """Typed settings ('inertia alpha=0.3') are policies of their own, labelled by what they change; each
    panel is that setting's own run, and the probe ranks the same settings."""
    model, tokenizer = tiny
    result = client.predict(TINY, PROMPT, ["inertia", "inertia alpha=0.3", "inertia alpha=0.8"], "budget", 0.5, 20,
                            12, False, *GREEDY, "", api_name="/compare")
    texts = result[:4]
    assert [t.get("label") for t in texts[:2]] == ["inertia", "inertia alpha=0.3"]
    assert texts[2]["visible"] is False  # alpha=0.8 is the default: the first panel already
    runs = [kvviz.run(model, tokenizer, PROMPT, kvviz.make_policy("inertia", **params), chat=False, budget=20,
                      max_new_tokens=12) for params in ({}, {"alpha": 0.3})]
    assert [t["value"] for t in texts[:2]] == ["".join(e.text for e in run.trace.events) for run in runs]
    assert runs[0].token_ids != runs[1].token_ids or \
        [e.kept.tolist() for e in runs[0].trace.events] != [e.kept.tolist() for e in runs[1].trace.events]
    with pytest.raises(Exception, match="alpha must be between 0.0 and 1.0"):
        client.predict(TINY, PROMPT, ["inertia", "inertia alpha=7"], "budget", 0.5, 20, 12, False, *GREEDY, "",
                       api_name="/compare")
    # The probe ranks each setting by its own utility: single-step (alpha 0) is not InertiaKV's EMA.
    table = client.predict(TINY, PROMPT, ["inertia", "inertia alpha=0"], False, 4, 256, api_name="/probe")[0]
    assert [row[0] for row in table["data"]] == ["inertia", "single-step"]  # alpha 0 is single-step's own name
    assert table["data"][0][1:] != table["data"][1][1:]
    for bad, message in [(["inertia", 3], "a list of names or settings"), (5, "a list of names or settings"),
                         # alpha 0.8 is inertia
                         (["inertia", "single-step alpha=0.8"], "one setting, which the registry names .inertia.")]:
        with pytest.raises(Exception, match=message):
            client.predict(TINY, PROMPT, bad, "budget", 0.5, 20, 12, False, *GREEDY, "", api_name="/compare")


def test_downloads_keep_only_the_newest_folders(monkeypatch, tmp_path):
    from kvviz.ui import common

    monkeypatch.setattr(common, "DOWNLOADS", tmp_path)
    monkeypatch.setattr(common, "KEEP_DOWNLOADS", 3)
    made = [common.download_folder() for _ in range(5)]
    assert sorted(tmp_path.iterdir()) == sorted(made[-3:])  # the two oldest went


def test_a_comparison_whose_download_fails_still_shows_everything(tiny, monkeypatch):
    """Saving the traces is the last step: a full disk (or any failure there) costs the download only."""
    from kvviz.ui import checks, compare

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    checks._models[TINY] = tiny
    monkeypatch.setattr(compare, "save_comparison", full_disk)
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    tab = compare_tab()
    *_, last = compare.make_compare_handler(limits, tab)(TINY, PROMPT, ["inertia", "tova"], "compression", 0.5, 0, 6,
                                                         False)
    assert list(last[tab.state]) == ["inertia", "tova"] and tab.download not in last  # state, no download
    assert "vs **inertia**" in last[tab.divergence]


def test_each_compared_setting_keeps_its_label_in_the_fates_diagnostics_and_download(tiny):
    from kvviz.ui.checks import Request, _models
    from kvviz.ui.common import Progress
    from kvviz.ui.compare import make_compare_handler, save_comparison
    from kvviz.ui.compare_views import compare_diagnostics, compare_fates
    from kvviz.ui.traces import make_open_handler

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    tab = compare_tab()
    *_, last = make_compare_handler(limits, tab)(TINY, PROMPT, ["inertia", "inertia alpha=0.3"], "compression", 0.5,
                                                 0, 8, False)
    assert list(last[tab.state]) == ["inertia", "inertia alpha=0.3"]
    view_len = last[tab.state]["inertia"].prompt_len
    assert list(compare_diagnostics(last[tab.state])["value"].columns)[1:] == ["inertia", "inertia alpha=0.3"]
    # The download: one trace per setting, in order, each the policy it is labelled as, with its own run.
    import zipfile

    from kvviz.policies import setting_label

    with zipfile.ZipFile(last[tab.download]["value"]) as bundle, tempfile.TemporaryDirectory() as folder:
        assert bundle.namelist() == ["1-inertia.parquet", "2-inertia_alpha=0.3.parquet"]
        bundle.extractall(folder)
        traces = [kvviz.Trace.load(Path(folder) / name) for name in bundle.namelist()]
        # in the Live tab
        opened = make_open_handler(limits, live_tab())(str(Path(folder) / "2-inertia_alpha=0.3.parquet"))
        # a label longer than a file name may be is cut in its name (the index keeps names unique)
        long_label = "inertia layers=" + ",".join(["0"] * 200)
        run = Progress.start(Request(tiny[0], tiny[1], [0] * view_len, 4, 8), TINY,
                             {long_label: kvviz.make_policy("inertia")}, [])
        run.views[long_label] = last[tab.state]["inertia"]
        archive = save_comparison(run)
        with zipfile.ZipFile(archive) as long_names:
            assert [len(name) for name in long_names.namelist()] == [len("1-") + 80 + len(".parquet")]
        assert "**opened** 2-inertia_alpha=0.3.parquet: `inertia` (alpha=0.3" in opened[live_tab().stats]
    assert [setting_label(kvviz.make_policy(t.policy, **t.params)) for t in traces] == list(last[tab.state])
    for trace, view in zip(traces, last[tab.state].values()):
        assert [e.kept.tolist() for e in trace.events] == [e.kept.tolist() for e in view.events]
        assert trace.prompt_len == view.prompt_len and trace.dtype == "float32" and trace.model == TINY
    columns = list(compare_fates(last[tab.state], "#0-3")[1]["value"].columns)
    assert columns[2].startswith("inertia (to step") and columns[3].startswith("inertia alpha=0.3 (to step")


def test_numbers_too_large_for_a_float_are_refused_with_the_range_not_an_overflow():
    """JSON integers reach the API as Python ints of any size: float() of a 400-digit one overflows, and an
    integer went through a float before its range was checked (2**63 - 1 read as 2**63)."""
    from kvviz.ui.checks import fraction, whole_number

    huge = 10**400
    with pytest.raises(ValueError, match=r"^max new tokens must be between 1 and 30, got 1000"):
        whole_number("max new tokens", huge, 1, 30)
    assert whole_number("the seed", 2**63 - 1, 0, 2**63 - 1) == 2**63 - 1
    from kvviz.ui.checks import check_sampling

    # the page carries a seed as a double: the largest it keeps exactly is the largest accepted
    assert check_sampling(0.6, 0.95, 2**53 - 1)["seed"] == 2**53 - 1
    with pytest.raises(ValueError, match=r"^the seed must be between 0 and 9007199254740991, got 9007199254740992"):
        check_sampling(0.6, 0.95, float(2**53))
    with pytest.raises(ValueError, match="^temperature must be a number, got 1000"):  # each argument by its name
        check_sampling(huge, 0.95, 0)
    with pytest.raises(ValueError, match="^compression must be a number, got 1000"):
        fraction("compression", huge)
    with pytest.raises(ValueError, match=r"^policy 'inertia': refresh must be between 0 and 64, got 1000"):
        kvviz.make_policy("inertia", refresh=huge)
    with pytest.raises(ValueError, match=r"^policy 'inertia': alpha must be between 0.0 and 1.0, got 1000"):
        kvviz.make_policy("inertia", alpha=huge)


def test_the_typed_numbers_and_an_empty_prompt_are_refused_before_the_model_loads(monkeypatch):
    """A refusal that needs no model must not wait for a load of minutes (nor leave a model loaded)."""
    from kvviz.ui import analyses, checks

    def no_load(*args):
        raise AssertionError("the model was loaded before a check that needs none")

    monkeypatch.setattr(checks, "get_model", no_load)
    limits = Limits(models=("not-loaded",), max_prompt_tokens=400, max_new_tokens=16)
    tova = [kvviz.make_policy("tova")]
    with pytest.raises(ValueError, match="the budget must be at least 1, got -5"):
        checks.validate(limits, "not-loaded", PROMPT, "budget", 0.5, -5, 8, False, tova)
    with pytest.raises(ValueError, match="the budget is empty"):
        checks.validate(limits, "not-loaded", PROMPT, "budget", 0.5, None, 8, False, tova)
    for compression in (1.0, float("nan")):
        with pytest.raises(ValueError, match=r"compression must be in \[0, 1\)"):
            checks.validate(limits, "not-loaded", PROMPT, "compression", compression, 0, 8, False, tova)
    with pytest.raises(ValueError, match="the prompt is empty"):
        checks.model_and_prompt(limits, "not-loaded", "  ", True)
    check_probe = analyses.make_probe_check(limits)
    with pytest.raises(gr.Error, match="the probe step must be at least 1"):
        check_probe("not-loaded", PROMPT, ["inertia"], False, 0, 0)
    with pytest.raises(gr.Error, match="the prompt is empty"):
        check_probe("not-loaded", "", ["inertia"], False, 4, 16)


def test_a_failure_lets_go_of_what_its_frames_held_and_out_of_memory_says_what_to_change():
    """The user's line for an unforeseen error; the failed call's frames are cleared, so that what they held
    (a failed run's cache) is freed by the handler's release_memory while the error is still being raised."""
    import gc
    import weakref

    import torch

    from kvviz.ui.checks import unexpected

    class Cache:
        pass

    def decode():
        cache = Cache()
        holder.append(weakref.ref(cache))
        raise RuntimeError("a kernel failed")

    holder = []
    try:
        decode()
    except RuntimeError as error:
        failure = unexpected("generation", error)
        gc.collect()
        assert holder[0]() is None  # freed although the error, and its traceback, are still alive here
    assert failure.message == "generation failed: RuntimeError: a kernel failed"
    for error in (MemoryError(), torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")):
        assert unexpected("the comparison", error).message == (
            "the comparison ran out of memory; shorten the prompt, generate fewer tokens or choose a smaller "
            "budget, then try again")


def test_a_budget_never_filled_is_refused_with_a_remedy_that_works(tiny):
    """Prompt L, n new tokens: the run feeds back L + n - 1 tokens, so a budget B evicts only if B < L + n - 1,
    i.e. with n >= B - L + 2 new tokens, offered only within the app's limit (16 here)."""
    from kvviz.ui.checks import _models, validate

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    size = len(kvviz.engine.encode_prompt(tiny[1], PROMPT, chat=False))

    def check(budget, new_tokens):
        return validate(limits, TINY, PROMPT, "budget", 0.5, budget, new_tokens, False, [kvviz.make_policy("tova")])

    # B = L + 5 with 4 new tokens feeds back L + 3: below L + 3, or 7 new tokens (L + 6 fed back) evicts.
    with pytest.raises(ValueError, match=rf"^a budget of {size + 5} holds the {size}-token prompt and all 3 tokens "
                                         rf"fed back, so nothing would be evicted; choose a budget below {size + 3}, "
                                         r"or allow at least 7 new tokens$"):
        check(size + 5, 4)
    assert check(size + 5, 7).budget == size + 5 and check(size + 2, 4).budget == size + 2
    with pytest.raises(ValueError, match="allow at least 7 new tokens"):
        check(size + 5, 6)  # one fewer than offered: L + 5 fed back, all held
    # The largest budget 16 new tokens fill is L + 14; one more is past any remedy but a smaller budget.
    with pytest.raises(ValueError, match="or allow at least 16 new tokens$"):
        check(size + 14, 4)
    assert check(size + 14, 16).budget == size + 14
    with pytest.raises(ValueError, match=rf"choose a budget below {size + 3} \(even 16 new tokens, the most allowed "
                                         r"here, would not fill it\)$"):
        check(size + 15, 4)


def test_a_compression_that_leaves_a_policy_too_small_a_budget_names_the_compression_that_works(tiny):
    """In compression mode no budget box is shown, and "raise the budget above 8" named a control nobody set:
    the refusal names the largest compression that leaves the policy's 8 protected entries and one more, and
    that compression runs while the next step up is refused.  In budget mode it still speaks of the budget."""
    from kvviz.ui.checks import _models, validate

    _models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=16)
    size = len(kvviz.engine.encode_prompt(tiny[1], PROMPT, chat=False))

    def check(mode, compression, budget=0):
        return validate(limits, TINY, PROMPT, mode, compression, budget, 16, False,
                        [kvviz.make_policy("streaming", sinks=8)])

    # floor((1 - rho) * L) > 8: the largest rho to two places, found by trying every one
    works = max(step / 100 for step in range(100) if int((1 - step / 100) * size + 1e-9) >= 9)
    with pytest.raises(ValueError, match=rf"^compression 0.99 leaves a budget of {int(0.01 * size + 1e-9)} of this "
                                         rf"{size}-token prompt, not more than the 8 sink tokens StreamingLLM always "
                                         rf"keeps: lower the compression to {works:g} or less \(or lower sinks\)$"):
        check("compression", 0.99)
    assert check("compression", works).budget >= 9
    with pytest.raises(ValueError, match="lower the compression to"):
        check("compression", round(works + 0.01, 2))
    with pytest.raises(ValueError, match="^budget 8 must exceed the 8 sink tokens StreamingLLM always keeps: raise "
                                         r"the budget above 8 \(or lower sinks\)$"):
        check("budget", 0.5, 8)
    # More sinks than a short prompt's run feeds (the prompt and 15 of its 16 new tokens): no budget above them
    # evicts, so the advice is only what would do: fewer sinks, or n new tokens with short + 20 + 1 <
    # short + n - 1, n >= 23 (where the app allows that many)
    short_prompt = "one two three four five"
    short = len(kvviz.engine.encode_prompt(tiny[1], short_prompt, chat=False))
    for most, more in ((16, ""), (30, " or allow at least 23 new tokens")):
        with pytest.raises(ValueError, match=rf"^budget 8 must exceed the {short + 20} sink tokens StreamingLLM "
                                             rf"always keeps, and a budget above {short + 20} would hold all "
                                             rf"{short + 15} tokens this run feeds, evicting none; lower sinks{more}$"):
            validate(Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=most), TINY, short_prompt,
                     "budget", 0.5, 8, 16, False, [kvviz.make_policy("streaming", sinks=short + 20)])
    assert validate(Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=30), TINY, short_prompt, "budget",
                    0.5, short + 21, 23, False, [kvviz.make_policy("streaming", sinks=short + 20)]).budget == short + 21


def test_a_checkpointed_policy_that_would_reach_no_checkpoint_is_refused_with_remedies_that_work(tiny):
    """AvoKV-E evicts only at its checkpoints: with B = L + 4 the cache is over B from step 5, and at the
    default interval (128) the first checkpoint is step 128, so 12 new tokens (last step 11) decode nothing
    from a cut cache.  Each remedy offered does: 128 + 128 + 1 new tokens (a whole interval after the first
    cut; 130, one step after it, where that is past the limit), or an interval of 10 - 5 + 1 = 6 or less.  A
    checkpoint at the last step cuts after the last forward pass, which nothing reads: refused too."""
    from kvviz.ui.checks import _models, validate

    _models[TINY] = tiny
    size = len(kvviz.engine.encode_prompt(tiny[1], PROMPT, chat=False))

    def check(new_tokens, limit=300, **params):
        return validate(Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=limit), TINY, PROMPT, "budget",
                        0.5, size + 4, new_tokens, False, [kvviz.make_policy("avokv", **params)])

    with pytest.raises(ValueError, match=r"^avokv evicts only at its checkpoints, every 128 generated tokens once the "
                                         rf"cache is over B = {size + 4}: the first here would be at step 128, after "
                                         r"this run's last step \(11\), so no token would be decoded from a cache it "
                                         r"cut; allow at least 257 new tokens or set interval to 6 or less$"):
        check(12)
    with pytest.raises(ValueError, match="allow at least 130 new tokens or set interval to 6 or less$"):
        check(12, limit=200)
    with pytest.raises(ValueError, match="cut; set interval to 6 or less$"):  # 130: past a limit of 100
        check(12, limit=100)
    with pytest.raises(ValueError, match=r"at step 11, at this run's last step, after its last forward, so no token"):
        check(12, interval=11)
    model, tokenizer = tiny
    # 6 or less is sure to; 8 happens to (its step 8 is past step 5)
    for new_tokens, params in ((257, {}), (12, {"interval": 6}), (12, {"interval": 1}), (12, {"interval": 8})):
        check(new_tokens, **params)  # accepted, and a token is decoded from the cut cache
        run = kvviz.run(model, tokenizer, PROMPT, kvviz.make_policy("avokv", **params), chat=False, budget=size + 4,
                        max_new_tokens=new_tokens)
        cuts = [event.step for event in run.trace.events if event.evicted.size]
        assert cuts and cuts[0] < run.trace.events[-1].step, params
    # R-KV checkpoints on the same schedule; the other policies are left to the budget check
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=200)
    with pytest.raises(ValueError, match="^rkv evicts only at its checkpoints"):
        validate(limits, TINY, PROMPT, "budget", 0.5, size + 4, 12, False, [kvviz.make_policy("rkv")])
    assert validate(limits, TINY, PROMPT, "budget", 0.5, size + 4, 12, False, [kvviz.make_policy("tova")])


def test_avokvs_presets_set_its_regime_a_budget_above_the_prompt_and_the_papers_sampling(tiny):
    """Chosen, an AvoKV-E comparison sets B = L0 + 32 over the reasoning example (an example prompt was
    shown), 160 new tokens and T = 0.6, top-p 0.95: the comparison is accepted, and AvoKV-E evicts nothing
    until generation fills B, then cuts at its checkpoints.  Other presets set their policies alone."""
    from kvviz.policies import build_setting
    from kvviz.tasks.examples import EXAMPLES
    from kvviz.ui.checks import _models, validate
    from kvviz.ui.presets import COMPARISONS, REASONING_PRESETS, make_preset_handler

    _models[TINY] = tiny
    model, tokenizer = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=300)
    tab = compare_tab()
    chosen = positional(make_preset_handler(limits, tab), [tab.policies, tab.prompt, tab.settings.mode,
                                                           tab.settings.budget, tab.settings.max_new,
                                                           tab.settings.temperature, tab.settings.top_p,
                                                           tab.preset_note])
    assert len(REASONING_PRESETS) == 2
    name = REASONING_PRESETS[0]
    policies, prompt, mode, budget, new_tokens, temperature, top_p, note = chosen(
        name, TINY, EXAMPLES["Four-key needle"], True)
    prompt_len = len(kvviz.engine.encode_prompt(tokenizer, EXAMPLES["Short reasoning"], chat=True))
    assert (policies, prompt, mode, budget) == (COMPARISONS[name], EXAMPLES["Short reasoning"], "budget",
                                                prompt_len + 32)
    assert (new_tokens, temperature, top_p) == (160, 0.6, 0.95) and f"B = {prompt_len + 32}" in note
    # Edited by hand afterwards, the note says what no longer holds against what the preset set; set back, its own
    from kvviz.ui.presets import preset_note_after_edit, preset_regime
    after = [TINY, prompt, True, mode, budget, new_tokens, temperature, top_p]
    regime = preset_regime(note, *after)

    def edit(index, value):
        return preset_note_after_edit(regime, *after[:index], value, *after[index + 1:])

    assert edit(1, prompt + " More.") == (
        "*Changed by hand since the AvoKV-E preset set its regime: the prompt's tokens (its text, the model or the "
        "chat template), which B was sized to: keep B above them (counted under the prompt). Choose the preset "
        "again to set it back.*")
    assert "the prompt's tokens" in edit(2, False)
    assert edit(4, 100).startswith(f"*Changed by hand since the AvoKV-E preset set its regime: B = 100 (the preset's "
                                   f"{prompt_len + 32}). ")
    assert "the cache is sized by ρ, a share of the prompt" in edit(3, "compression")
    assert "64 new tokens (the preset's 160)" in edit(5, 64)
    assert "temperature 0.0, top-p 0.95 (the paper's 0.6, 0.95)" in edit(6, 0.0)
    assert edit(4, float(budget)) == note  # the browser's 276.0 is the preset's 276
    assert preset_regime("*Back to the ...*", *after) is None and preset_note_after_edit(None, *after) == gr.skip()
    request = validate(limits, TINY, prompt, mode, 0.75, budget, new_tokens, True,
                       [build_setting(entry)[1] for entry in policies], temperature, top_p, 0)
    assert request.budget == prompt_len + 32
    run = kvviz.run(model, tokenizer, prompt, build_setting("avokv interval=16")[1], budget=budget,
                    max_new_tokens=new_tokens, temperature=temperature, top_p=top_p, seed=0)
    cut = [event.step for event in run.trace.events if event.evicted.size]
    assert cut and cut[0] > 32 and max(event.cache_size for event in run.trace.events) <= budget + 15
    # the user's own prompt stays, and B is sized to it; a preset of InertiaKV's sets its policies alone
    own = "Explain, step by step, why the sky is blue."
    assert chosen(name, TINY, own, False)[1:4] == [
        own, "budget", len(kvviz.engine.encode_prompt(tokenizer, own, chat=False)) + 32]
    inertia = list(COMPARISONS)[0]
    assert chosen(inertia, TINY, own, False) == [COMPARISONS[inertia], gr.skip(), "compression", *(gr.skip(),) * 4,
                                                 ""]
    # after an AvoKV-E preset, InertiaKV's undoes what that set (and only that: 3000 tokens the user chose stay)
    undone = chosen(inertia, TINY, prompt, True, mode, new_tokens, temperature, top_p)
    assert undone[:7] == [COMPARISONS[inertia], EXAMPLES["Four-key needle"], "compression", gr.skip(), 48, 0.0,
                          gr.skip()]
    assert undone[7] == ("*Back to the prompt-compression regime InertiaKV runs: the cache sized by compression ρ, "
                         "the four-key needle prompt, 48 new tokens, greedy decoding, as the tab starts.*")
    assert chosen(inertia, TINY, own, False, "budget", 3000, 0.6, 0.95)[1:7] == [
        gr.skip(), "compression", gr.skip(), gr.skip(), 0.0, gr.skip()]


def test_a_budget_above_the_prompt_evicts_once_generation_fills_it(client, tiny):
    """The long-generation regime: B = L0 + 5 with 20 new tokens evicts from step 6 on.  A budget the run
    never fills is refused."""
    model, tokenizer = tiny
    prompt_len = len(kvviz.engine.encode_prompt(tokenizer, PROMPT, chat=False))
    budget = prompt_len + 5
    result = client.predict(TINY, PROMPT, ["inertia", "streaming"], "budget", 0.5, budget, 20, False, *GREEDY, "",
                            api_name="/compare")
    runs = [kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=budget, max_new_tokens=20)
            for name in ("inertia", "streaming")]
    assert [t["value"] for t in result[:2]] == ["".join(e.text for e in run.trace.events) for run in runs]
    sizes = [e.cache_size for e in runs[0].trace.events]
    assert sizes[5] == budget and sizes[-1] == budget and not any(len(e.evicted) for e in runs[0].trace.events[:5])
    with pytest.raises(Exception, match=f"nothing would be evicted; choose a budget below {prompt_len + 19}, or "
                                        "allow at least 21 new tokens$"):
        client.predict(TINY, PROMPT, ["inertia", "streaming"], "budget", 0.5, prompt_len + 19, 20, False, *GREEDY, "",
                       api_name="/compare")
    # a budget that no number of new tokens here would fill: more tokens is not offered as a way out
    with pytest.raises(Exception, match=f"choose a budget below {prompt_len + 19} \\(even 3000 new tokens, the most "
                                        "allowed here, would not fill it\\)$"):
        client.predict(TINY, PROMPT, ["inertia", "streaming"], "budget", 0.5, 10**6, 20, False, *GREEDY, "",
                       api_name="/compare")
    # The same through the API, whose optional last argument is the budget in tokens.
    job = client.submit(PROMPT, "inertia", 0.5, 20, False, TINY, "{}", budget, api_name="/generate")
    list(job)  # to the end
    steps = job.outputs()
    assert steps[-1]["budget"] == budget
    assert [u["kept"] for u in steps] == [e.kept.tolist() for e in runs[0].trace.events]


def test_retention_figure_outlines_sinks_and_the_protected_tail(tiny):
    model, tokenizer = tiny
    policy = kvviz.make_policy("streaming", sinks=3)
    trace = kvviz.run(model, tokenizer, PROMPT, policy, chat=False, budget=20, max_new_tokens=6).trace
    view = RunView(trace.prompt_len, 6, 20, pinned=(3, 5))
    for event in trace.events:
        view.add(event)
    shapes = view.retention_figure().layout.shapes
    sink = [s for s in shapes if s.type == "rect"][0]
    assert (sink.x0, sink.x1) == (-0.5, 2.5)
    tail = [s for s in shapes if s.type == "path"][0]
    assert tail.path.startswith(f"M {trace.prompt_len - 5.5},-0.5")


def test_policy_description_states_the_previous_step_weight_on_the_loaded_model(tiny):
    from kvviz.ui.checks import _models

    _models[TINY] = tiny  # the app's cache of loaded models (3 layers)
    controls = live_tab().controls  # the policy picked: its description, and its parameters shown
    description = controls.show("inertia", TINY)[controls.description]
    assert "0.512" in description  # 0.8 ** 3
    assert "0.8" in controls.show("inertia-decoupled", TINY)[controls.description].split("Previous-step weight on")[1]
    # With alpha changed in its widget the weight follows: 0.3 ** 3 = 0.027.
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS
    from kvviz.ui.controls import describe

    widgets = [0.3 if name == "alpha" else PARAMETERS[name]["default"] for name in PARAM_NAMES]
    assert "**0.027**" in describe("inertia", TINY, *widgets)


def test_an_empty_seed_is_refused_when_sampling_and_ignored_when_greedy():
    """The emptied seed box ran as seed 0 while it stayed blank; greedy decoding reads no seed."""
    from kvviz.ui.checks import check_sampling

    with pytest.raises(ValueError, match="the seed is empty; type a whole number"):
        check_sampling(0.7, 0.9, None)
    assert check_sampling(0.7, 0.9, 0) == {"temperature": 0.7, "top_p": 0.9, "seed": 0}
    assert check_sampling(0.0, 0.9, None) == {}


def test_sampled_runs_draw_what_the_library_draws_and_say_so(client, tiny):
    """Temperature > 0 in the Sampling widgets: the Live run is kvviz.run's sampled run with that seed, its trace
    says how it was generated, and Compare gives every policy the same random stream."""
    from gradio_client import handle_file

    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    model, tokenizer = tiny
    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    sampling = dict(temperature=0.9, top_p=0.9, seed=7)
    live = client.predict(TINY, PROMPT, "inertia", "budget", 0.5, 24, 10, False, *sampling.values(), *widgets, "",
                          api_name="/live")
    expected = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=24, max_new_tokens=10, **sampling)
    greedy = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=24, max_new_tokens=10)
    assert live[0] == expected.text and expected.token_ids != greedy.token_ids
    trace_file = live[7]["value"] if isinstance(live[7], dict) else live[7]
    assert kvviz.Trace.load(trace_file).sampling == sampling
    # the run's own stats say so too, as the opened trace's line does
    assert live[1].startswith("**run** `inertia`, sampled at temperature 0.9, top-p 0.9, seed 7 · ")
    opened = client.predict(handle_file(trace_file), api_name="/open_trace")
    assert "sampled at temperature 0.9, top-p 0.9, seed 7" in opened[1].split("\n")[0]

    result = client.predict(TINY, PROMPT, ["inertia", "streaming"], "budget", 0.5, 20, 12, False,
                            *sampling.values(), "", api_name="/compare")
    for text, name in zip(result[:2], ("inertia", "streaming")):
        run = kvviz.run(model, tokenizer, PROMPT, name, chat=False, budget=20, max_new_tokens=12, **sampling)
        assert text["value"] == "".join(e.text for e in run.trace.events)
    # The API too: its optional arguments after the budget.
    job = client.submit(PROMPT, "inertia", 0.5, 10, False, TINY, "{}", 24, *sampling.values(), api_name="/generate")
    list(job)
    assert job.outputs()[-1]["text"] == expected.text
    # Out of range: the sliders refuse it in the page; the API, which has none, says what to change.
    with pytest.raises(Exception, match="temperature must be between 0 \\(greedy\\) and 2, got 3"):
        client.predict(PROMPT, "inertia", 0.5, 10, False, TINY, "{}", 24, 3.0, 0.9, 0, api_name="/generate")
    with pytest.raises(Exception, match="top-p must be above 0 and at most 1, got 0"):
        client.predict(PROMPT, "inertia", 0.5, 10, False, TINY, "{}", 24, 0.7, 0.0, 0, api_name="/generate")


@pytest.mark.parametrize("text_every_s, text_updates", [(0.0, 25), (float("inf"), 0)])
def test_the_streamed_text_is_sent_no_more_often_than_its_interval(tiny, monkeypatch, text_every_s, text_updates):
    """Between the clearing update and the finished run, the Live tab sends the text only when TEXT_EVERY_S
    has passed (figures held back to the end by figures_per_second=0): at 0 once per token (the prefill's and
    the 24 decode steps'), at infinity never, and the finished run still shows all of it, figures included."""
    from kvviz.ui import checks, live, pacing

    monkeypatch.setattr(pacing, "TEXT_EVERY_S", text_every_s)
    checks._models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=25, figures_per_second=0)
    defaults = [checks.PARAMETERS[p]["default"] for p in checks.PARAM_NAMES]
    tab = live_tab()
    outputs = list(live.make_live_handler(limits, tab)(TINY, PROMPT, "inertia", "compression", 0.5, 0, 25, False,
                                                       *GREEDY, *defaults, "", None))
    streamed = outputs[2:-1]  # after the API call's session holder and the clear, before the finished run
    assert len(streamed) == text_updates and all(isinstance(out[tab.text], str) for out in streamed)
    # the text only grows
    assert [len(out[tab.text]) for out in streamed] == sorted(len(out[tab.text]) for out in streamed)
    final = outputs[-1][tab.text]
    assert final.startswith(streamed[-1][tab.text] if streamed else "") and final
    assert all(list(out) == [tab.text] for out in streamed)  # no figure while streaming: the text alone
    assert outputs[-1][tab.retention].data[0].type == "heatmap"


def test_a_checkpointed_run_that_never_reached_a_checkpoint_says_so_under_its_stats(tiny, tmp_path):
    """AvoKV-E at interval 16 over a prompt two tokens over B: its first checkpoint is at step 14, so an
    8-token run ends over B with nothing cut.  Live refuses to start one (saying what would reach a
    checkpoint); a trace of one, opened (e.g. from `kvviz generate`), says why its cache was not cut.  A
    24-token run is cut, and says nothing."""
    from kvviz import engine
    from kvviz.ui import checks, traces
    from kvviz.ui.live import make_live_handler

    checks._models[TINY] = tiny
    prompt_len = len(engine.encode_prompt(tiny[1], PROMPT, chat=False))
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=30)
    widgets = {name: checks.PARAMETERS[name]["default"] for name in checks.PARAM_NAMES} | {"interval": 16, "delay": 8}

    def live(new_tokens):
        return make_live_handler(limits, live_tab())(TINY, PROMPT, "avokv", "budget", 0.9, prompt_len - 2, new_tokens,
                                                     False, *GREEDY, *widgets.values(), "", None)

    with pytest.raises(gr.Error, match="the first here would be at step 14, after this run's last step \\(7\\)"):
        list(live(8))
    assert "no checkpoint" not in [*live(24)][-1][live_tab().stats]
    run = kvviz.run(*tiny, PROMPT, kvviz.make_policy("avokv", interval=16, delay=8), chat=False,
                    budget=prompt_len - 2, max_new_tokens=8)
    run.trace.save(tmp_path / "short.parquet")
    stats = traces.make_open_handler(limits, live_tab())(str(tmp_path / "short.parquet"))[live_tab().stats]
    assert stats.endswith("*no checkpoint reached: avokv evicts every 16 generated tokens, first at step 14 "
                          "here, and this run ended at step 7; the cache was not cut*")


def test_an_opened_traces_views_are_sized_by_what_it_generated_not_by_a_number_in_its_file(tiny, tmp_path):
    """max_new_tokens is metadata anyone can edit: 10**9 sized the views for a billion positions (gigabytes,
    or the server killed).  A trace is shown for what it asked within the app's limit past what it ran."""
    import pyarrow.parquet as pq

    from kvviz.trace import Trace
    from kvviz.ui import checks, traces

    checks._models[TINY] = tiny
    limits = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=30)
    kvviz.run(*tiny, PROMPT, "inertia", chat=False, budget=20, max_new_tokens=6).trace.save(tmp_path / "run.parquet")
    table = pq.read_table(tmp_path / "run.parquet")
    meta = json.loads(table.schema.metadata[b"kvviz"])
    for asked, expected in [(6, 6), (20, 20), (10**9, 6 + 30), (0, 6)]:  # 6 steps ran (the prefill and 5)
        pq.write_table(table.replace_schema_metadata({b"kvviz": json.dumps({**meta, "max_new_tokens": asked})}),
                       tmp_path / "edited.parquet")
        trace = Trace.load(tmp_path / "edited.parquet")
        assert len(trace.events) == 6 and traces.opened_length(trace, limits) == expected
    outputs = traces.make_open_handler(limits, live_tab())(str(tmp_path / "edited.parquet"))
    assert "opened" in outputs[live_tab().stats]
    # A trace longer than any run here is refused before its views are built: they grow with steps x positions
    small = Limits(models=(TINY,), max_prompt_tokens=400, max_new_tokens=4)
    message = (r"run.parquet has a \d+-token prompt and 5 decode steps; this app opens traces of up to 400 prompt "
               r"tokens and 4 steps \(KVVIZ_MAX_PROMPT_TOKENS, KVVIZ_MAX_NEW_TOKENS\): read it with `kvviz trace "
               "FILE`, or serve with larger limits")
    with pytest.raises(gr.Error, match=message):
        traces.check_trace(str(tmp_path / "run.parquet"), small)
    with pytest.raises(gr.Error, match=message):
        traces.make_open_handler(small, live_tab())(str(tmp_path / "run.parquet"))
    short = Limits(models=(TINY,), max_prompt_tokens=10, max_new_tokens=30)
    with pytest.raises(gr.Error, match="this app opens traces of up to 10 prompt tokens"):
        traces.make_open_handler(short, live_tab())(str(tmp_path / "run.parquet"))
    assert traces.check_trace(str(tmp_path / "run.parquet"), limits) is None


def test_loading_one_model_holds_up_no_session_using_another(tiny, monkeypatch):
    """A load holds a lock for its own name only: a session on a loaded model goes on, and two sessions asking
    for the same new model share one load."""
    import threading
    import time as clock

    from kvviz.ui import checks

    loads = []

    def slow_load(name, device=None, dtype=None):
        loads.append(name)
        clock.sleep(1.5)
        return tiny

    monkeypatch.setattr(checks, "load_model", slow_load)
    monkeypatch.setitem(checks._models, TINY, tiny)
    monkeypatch.delitem(checks._models, "slow-model", raising=False)
    limits = Limits(models=(TINY,))
    threads = [threading.Thread(target=checks.get_model, args=(limits, "slow-model")) for _ in range(2)]
    for thread in threads:
        thread.start()
    clock.sleep(0.2)  # both are in the load by now
    start = clock.perf_counter()
    assert checks.get_model(limits, TINY) is tiny
    assert clock.perf_counter() - start < 0.5
    for thread in threads:
        thread.join()
    assert loads == ["slow-model"] and checks._models["slow-model"] is tiny
    checks._models.pop("slow-model")


def test_the_prompt_counter_says_what_is_wrong_instead_of_failing(tiny):
    from kvviz.ui import checks, common

    checks._models[TINY] = tiny
    count = common.make_prompt_counter(Limits(models=(TINY,), max_prompt_tokens=400))
    assert count(TINY, "half an emoji \ud83d", False) == ("*the prompt has a broken character at position 14 (half "
                                                          "of a pair, e.g. of an emoji cut in two); delete it or paste "
                                                          "the text again*")
    assert count(TINY, "hello there", False).endswith("tokens (limit 400)*")
    # a page's JSON carries a lone surrogate as such (Python's own client refuses to send one): Run's check says
    # what to change where the tokenizer raised a TypeError
    with pytest.raises(ValueError, match="the prompt has a broken character at position 3"):
        checks.check_settings(Limits(models=(TINY,)), TINY, "abc\ud800", "compression", 8)


def test_the_retention_heatmap_labels_where_the_prompt_ends():
    view = follow_view()  # a 6-token prompt
    figure = view.retention_figure()
    labels = [a for a in figure.layout.annotations if a.text == "prompt end"]
    assert len(labels) == 1 and labels[0].x == 5.5
    assert "green" not in figure.layout.title.text  # nothing protected here
    protected = RunView(6, 3, 4, ["a"] * 6, pinned=(2, 3)).retention_figure()  # H2O-like: sinks and a window
    assert plain(protected.layout.title.text).endswith(
        " · blank not yet generated green: protected, the first 2 always and the newest 3 while newest")


def plain(title: str) -> str:
    """A figure's title as text: its lines joined by a space, without their tags."""
    return re.sub(r"<[^>]+>", "", title.replace("<br>", " "))


def test_titles_break_into_lines_a_plot_in_a_1000_px_window_holds():
    """A long title or key is broken into lines (at " · " where it can), none longer than a Live-tab plot
    holds at a 1000-px window, with every word kept, and the figure's top margin grows with its lines."""
    from kvviz.ui.figures import HEAD_CHARS, NOTE_CHARS, titled

    key = "dark kept · pale evicted · blank not yet generated · red followed · cell = 4 pos × 2 steps"
    text, height = titled("Token history: at step 63: the 1 evicted (highest first), then 3 more", key, "",
                          "short")
    head, *notes = text.split("<br><sup>")
    assert [len(line) <= HEAD_CHARS for line in head.split("<br>")] == [True, True]
    notes = [note.removesuffix("</sup>") for note in notes]
    assert notes == ["dark kept · pale evicted · blank not yet generated", "red followed · cell = 4 pos × 2 steps",
                     "short"]  # broken at a " · ", the empty note left out
    assert all(len(note) <= NOTE_CHARS for note in notes) and height == 2 * 22 + 3 * 20
    protected = RunView(6, 3, 4, ["a"] * 6, pinned=(2, 3)).retention_figure()
    unprotected = follow_view().retention_figure()
    lines = protected.layout.title.text.count("<sup>")
    assert unprotected.layout.title.text.count("<sup>") == 1 and lines == 3  # the protected bands' note on two
    assert protected.layout.margin.t == unprotected.layout.margin.t + 20 * (lines - 1)


def test_stop_while_a_model_loads_replaces_the_loading_line_and_leaves_other_notes():
    from kvviz.ui.common import loading_note, stopped_while_loading

    repeats = "*Run once: `tova` is given twice.*"
    assert stopped_while_loading(f"{repeats}\n\n{loading_note('some-model')}") == \
        f"{repeats}\n\n*Stopped before the run started.*"
    assert stopped_while_loading(loading_note("some-model")) == "*Stopped before the run started.*"
    divergence = "| policy | first divergent step |\n|---|---|"
    assert stopped_while_loading(divergence) == gr.skip() and stopped_while_loading(None) == gr.skip()


def test_the_comparison_states_its_prompt_budget_and_the_cache_each_policy_reached(tiny):
    """L0 and B, which the Compare tab showed nowhere, and each cache's largest size while decoding: TOVA
    holds B, SnapKV (prefill-time) grows by each of the 5 tokens fed back."""
    from kvviz.ui.compare_views import divergence_markdown

    model, tokenizer = tiny
    views = {}
    for name, policy in (("tova", "tova"), ("snapkv", kvviz.make_policy("snapkv", window=4))):
        trace = kvviz.run(model, tokenizer, PROMPT, policy, chat=False, budget=20, max_new_tokens=6).trace
        views[name] = RunView(trace.prompt_len, 6, 20)
        for event in trace.events:
            views[name].add(event)
    prompt_len = len(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert divergence_markdown(["tova", "snapkv"], views).split("\n")[0] == (
        f"**prompt** {prompt_len} tokens · **budget** B = 20 · **largest cache while decoding**: tova 20, snapkv 25")


def test_the_diagnostics_table_explains_n_a_only_where_a_row_reads_n_a(tiny):
    from kvviz.ui.live_views import diagnostics_markdown

    model, tokenizer = tiny
    inertia = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, budget=20, max_new_tokens=6).trace
    streaming = kvviz.run(model, tokenizer, PROMPT, "streaming", chat=False, budget=20, max_new_tokens=6).trace
    scored, positional = diagnostics_markdown(inertia), diagnostics_markdown(streaming)
    assert "| n/a |" not in scored and "*n/a:" not in scored
    assert "| diagnostic | value |" in scored  # a short header: a long one wrapped "value" in the narrow column
    assert "| n/a |" in positional and "*n/a: this policy records no raw per-step score" in positional
    # Lazy refresh (r = 4) scores steps 1 and 5 of its 5: the raw rows average over those two
    lazy = kvviz.run(model, tokenizer, PROMPT, "inertia-lazy", chat=False, budget=20, max_new_tokens=6).trace
    assert "| decode steps with a raw score | 2 of 5 |" in diagnostics_markdown(lazy)
    assert "| decode steps with a raw score | 5 of 5 |" in scored


def test_coming_back_to_the_live_tab_counts_the_prompt_once_another_tab_loaded_the_model(tiny):
    """The Live tab's "the token count shows once the model is loaded" stayed after a comparison loaded it."""
    from kvviz.ui.app import build_app
    from kvviz.ui.checks import _models

    app = build_app(Limits(models=(TINY,)))
    live = next(block for block in app.blocks.values() if isinstance(block, gr.Tab) and block.label == "Live")
    selected = [fn for fn in app.fns.values() if (live._id, "select") in [tuple(t) for t in fn.targets]]
    assert len(selected) == 1 and [type(block).__name__ for block in selected[0].outputs] == ["Markdown"]
    _models[TINY] = tiny  # as a comparison would have left it
    note = selected[0].fn(TINY, PROMPT, False)
    assert str(len(tiny[1](PROMPT, add_special_tokens=False)["input_ids"])) in note


def test_the_compare_tab_counts_its_prompt_like_the_live_tab(tiny):
    """Compare's B is a share of its prompt too: its prompt's token count shows under it, as the prompt, the
    model or the chat template change, and when the tab is opened."""
    from kvviz.tasks.examples import EXAMPLES
    from kvviz.ui.app import build_app
    from kvviz.ui.checks import _models

    app = build_app(Limits(models=(TINY,)))
    compare = next(block for block in app.blocks.values() if isinstance(block, gr.Tab) and block.label == "Compare")
    prompt = next(block for block in app.blocks.values() if isinstance(block, gr.Textbox) and block.label == "Prompt"
                  and block.value.startswith(EXAMPLES["Four-key needle"][:40]))
    selected = [fn for fn in app.fns.values() if (compare._id, "select") in [tuple(t) for t in fn.targets]]
    edited = [fn for fn in app.fns.values() if (prompt._id, "change") in [tuple(t) for t in fn.targets]]
    assert len(selected) == 1 and any(fn.outputs == selected[0].outputs for fn in edited)
    assert [type(block).__name__ for block in selected[0].outputs] == ["Markdown"]
    _models[TINY] = tiny
    tokens = len(tiny[1](PROMPT, add_special_tokens=False)["input_ids"])
    assert selected[0].fn(TINY, PROMPT, False) == f"*{tokens} tokens (limit {Limits().max_prompt_tokens})*"


def test_the_tokens_by_fate_carry_their_colour_key():
    view = follow_view()  # step 1 evicts 1 and 3, step 2 evicts 5
    page = view.fate_html()
    assert page.index("kept to the end") < page.index("evicted early") < page.index('title="pos 0')
    assert 'title="pos 1: evicted at step 1"' in page and 'title="pos 0: kept to the end"' in page
    assert "kept at step 1" in view.fate_html(1)


def test_a_typed_setting_the_registry_refuses_is_said_when_it_is_entered():
    """Not only at the next Compare: the newest entry of the Policies box is checked as it comes, and the
    preset box stops naming a comparison the list no longer is."""
    from kvviz.ui.presets import COMPARISONS, policies_edited

    preset, entries = next(iter(COMPARISONS.items()))
    with pytest.warns(UserWarning, match=r"alpha must be between 0.0 and 1.0, got '2' \(in the Policies box"):
        update, seen = policies_edited(preset, [*entries, "inertia alpha=2"])
    assert update["value"] is None and seen == [*entries, "inertia alpha=2"]  # edited: no longer the preset
    with pytest.warns(UserWarning, match="unknown policy 'foo'"):
        policies_edited(preset, ["inertia", "foo"], seen)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a good entry, or the preset's own list, says nothing
        assert policies_edited(preset, list(entries)) == (gr.skip(), list(entries))
        assert policies_edited(preset, ["inertia", "inertia alpha=0.5"])[0]["value"] is None
        policies_edited(preset, [])
        # the page's second change for the same list (as the box loses focus) says the refusal no second time
        assert policies_edited(preset, [*entries, "inertia alpha=2"], seen) == (gr.skip(), gr.skip())


def test_a_full_policies_box_says_why_it_takes_no_fifth():
    """The box takes four chips at most and drops a fifth typed entry unsaid: from the fourth on a line under it
    says so, gone again once one is removed."""
    from kvviz.ui.presets import policies_full_note

    for entries in (None, [], ["inertia", "tova"], ["inertia", "tova", "streaming"]):
        assert policies_full_note(entries) == {"__type__": "update", "value": "", "visible": False}
    four = policies_full_note(["inertia", "tova", "snapkv", "keydiff"])
    assert four["visible"] and "Four chosen" in four["value"] and "remove one" in four["value"]


def test_long_legends_and_messages_go_under_the_plot_a_line_each():
    """Four long settings' Jaccard pairs beside the plot left it 60 px wide at 1000 px, and a followed
    number's 14 tokens in rows of three ran over the token history's x title: both legends now list an entry a
    line under the plot, the figure growing by a line each; a long message in an empty figure is broken."""
    from kvviz.ui.compare_views import jaccard_figure
    from kvviz.ui.figures import LEGEND_LINE, TITLE_12_CHARS, _empty_figure

    names = ["avokv interval=16", "avokv interval=16 lambda_b=0", "avokv interval=16 delay=8",
             "avokv interval=16 normalise=false"]
    views = {name: follow_view() for name in names}
    four, two = jaccard_figure(names, views), jaccard_figure(names[:2], views)
    assert four.layout.legend.orientation == "v" and four.layout.legend.y < 0
    assert four.layout.height - two.layout.height == 2 * LEGEND_LINE == four.layout.margin.b - two.layout.margin.b
    history = follow_view().history_figure([1, 2, 3, 4, 5], "", 2)
    assert history.layout.legend.orientation == "v"
    assert history.layout.height - follow_view().history_figure([1], "", 2).layout.height == 4 * LEGEND_LINE
    message = "no token text contains 'zzzz'; give other text, or positions as #12, #40-45, and try again"
    lines = _empty_figure(message).layout.annotations[0].text.split("<br>")
    assert " ".join(lines) == message and len(lines) > 1 and all(len(line) <= TITLE_12_CHARS for line in lines)


def test_a_live_run_is_marked_as_the_earlier_inputs_once_they_change():
    """The Live tab's stats name the inputs changed since its run (as the Compare tab marks a comparison), only
    those that decide the run; set back, the stats are the run's own; a refused click's note is left alone."""
    from kvviz.ui.live import NOT_RUN, earlier_run_note, run_inputs

    ran_on = (TINY, PROMPT, "inertia", "compression", 0.9, 256, 48, False, 0.0, 0.95, 0, 0.8, 4)
    ran = {"inputs": run_inputs(*ran_on), "note": "**run** `inertia`"}
    view = follow_view()

    def edit(index, value):
        return earlier_run_note(ran, view, ran["note"], *ran_on[:index], value, *ran_on[index + 1:])

    assert edit(2, "tova") == ("**Earlier inputs: the policy changed since this run; run again for the current "
                               "ones.**  \n**run** `inertia`")
    assert edit(11, 0.5).startswith("**Earlier inputs: the policy parameters changed")
    assert edit(4, 0.5).startswith("**Earlier inputs: the compression ρ changed")
    assert edit(5, 99) == edit(9, 0.5) == ran["note"]  # the budget box under ρ, top-p when greedy: not this run's
    # A parameter InertiaKV has no use for (SnapKV's window, which picking SnapKV sets and which stays set,
    # hidden, once InertiaKV is picked again) is not one of this run's inputs.
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    every = {"inputs": run_inputs(*ran_on[:11], *widgets), "note": ran["note"]}
    widgets[PARAM_NAMES.index("window")] = 32
    assert earlier_run_note(every, view, ran["note"], *ran_on[:11], *widgets) == ran["note"]
    widgets[PARAM_NAMES.index("alpha")] = 0.5  # one of its own
    assert earlier_run_note(every, view, ran["note"], *ran_on[:11], *widgets).startswith(
        "**Earlier inputs: the policy parameters changed")
    assert earlier_run_note(ran, view, NOT_RUN + "x", *ran_on) == gr.skip()
    assert earlier_run_note(None, view, "x", *ran_on) == earlier_run_note(ran, None, "x", *ran_on) == gr.skip()


def test_every_endpoint_argument_of_a_wrong_type_is_refused_by_name(client, caplog):
    """An API caller can send anything: a type that would run differently ("false" is truthy) or fail deep
    inside is refused naming the argument, quoting at most a short excerpt of what was sent, and nothing
    reaches the generic path (no logged traceback)."""
    import logging

    long_entry = "inertia " + "x" * 100_000
    deep = "[" * 100_000 + "]" * 100_000
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS

    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    live = (TINY, PROMPT, "inertia", "budget", 0.5, 20, 4, False, *GREEDY, *widgets, "")  # as the page sends them
    cases = [
        ("/generate", dict(prompt=PROMPT, chat="false", model=TINY), "chat must be true or false, got text"),
        ("/generate", dict(prompt=["a", "list"], model=TINY), "the prompt must be text, got a list"),
        ("/generate", dict(prompt={"a": 1}, model=TINY), "the prompt must be text, got an object"),
        ("/generate", dict(prompt=PROMPT, model=TINY, params=deep), "params is nested too deeply"),
        ("/generate", dict(prompt=PROMPT, model=TINY, params=[1, 2]), "params must be a JSON object"),
        ("/generate", dict(prompt=PROMPT, model=TINY, policy=["x" * 9999]),
         "unknown policy \\['x+\\.\\.\\.x+'\\]; choose"),
        ("/generate", dict(prompt=PROMPT, model=["x"] * 1000), "model \\['x', 'x', 'x', 'x', ...\\] is not available"),
        ("/generate", dict(prompt=PROMPT, model=TINY, compression=[0.5]), "compression must be a number, got a list"),
        ("/generate", dict(prompt=PROMPT, model=TINY, max_new_tokens={"n": 4}), "max new tokens must be a whole"),
        ("/generate", dict(prompt=PROMPT, model=TINY, temperature="hot"), "temperature must be a number"),
        ("/compare", (TINY, PROMPT, ["tova", long_entry], "budget", 0.5, 20, 4, False, *GREEDY, ""),
         "in 'inertia x+\\.\\.\\.x+', write each parameter as key=value"),
        ("/compare", (TINY, PROMPT, ["tova", "h2o"], "budget", 0.5, 20, 4, "false", *GREEDY, ""),
         "chat must be true or false"),
        ("/live", (*live[:7], "no", *live[8:]), "chat must be true or false"),
        ("/live", (*live[:6], [4], *live[7:]), "max new tokens must be a whole number, got a list"),
        ("/probe", (TINY, PROMPT, ["inertia"], "yes", 4, 256), "chat must be true or false"),
        ("/spectrum", (TINY, PROMPT, 1, 2, None), "chat must be true or false"),
    ]
    with caplog.at_level(logging.ERROR):
        for api, inputs, message in cases:
            with pytest.raises(Exception) as refusal:
                if isinstance(inputs, dict):
                    client.predict(**inputs, api_name=api)
                else:
                    client.predict(*inputs, api_name=api)
            text = str(refusal.value)
            assert re.search(message, text), (api, text[:300])
            assert len(text) < 700, (api, len(text))  # the 100 KB entry is not echoed back whole
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


def test_a_deployment_on_the_static_backend_streams_the_engines_events_and_refuses_what_it_cannot_run(tiny):
    """KVVIZ_BACKEND=static (what "auto" takes on a GPU) on this CPU: /generate's stream is the engine's,
    step for step, and a model the static step cannot run is refused before the run, naming why."""
    from kvviz.models import tiny_model
    from kvviz.ui import api, checks

    gemma = "tiny-random-gemma"
    checks._models[TINY], checks._models[gemma] = tiny, tiny_model("gemma")
    generate = {backend: api.make_generate_api(Limits(models=(TINY, gemma), max_prompt_tokens=400,
                                                      max_new_tokens=30, backend=backend))
                for backend in ("engine", "static")}
    for policy, params in (("tova", "{}"), ("inertia-lazy", "{}"), ("snapkv", "{}"), ("rkv", '{"interval": 4}'),
                           ("expected-attention-decode", "{}")):
        runs = {backend: list(api(PROMPT, policy, 0.5, 12, False, TINY, params)) for backend, api in generate.items()}
        assert runs["static"] == runs["engine"] and len(runs["static"]) == 12
    with pytest.raises(gr.Error, match=r"static backend \(KVVIZ_BACKEND=static\), which cannot run "
                                       "tova: it reproduces llama, mistral, qwen2, qwen3 decoder layers, not 'gemma'"):
        list(generate["static"](PROMPT, "tova", 0.5, 12, False, gemma, "{}"))
    with pytest.raises(ValueError, match="the backend .KVVIZ_BACKEND. must be auto, engine or static"):
        Limits(backend="gpu")
