"""Progress before the first token (layers of the prefill, heartbeats) and figure frames paced by the browser."""

from __future__ import annotations

import threading
import time
from contextlib import closing
from types import SimpleNamespace

import pytest
import torch

import kvviz
from kvviz.progress import Cancelled, ForwardProgress, Heartbeat, decoder_layers, with_heartbeats
from kvviz.ui import pacing
from kvviz.ui.pacing import FramePacer, Pacers


def test_forward_progress_counts_every_layer_of_a_forward_and_removes_its_hooks(tiny):
    model, _ = tiny
    seen = []
    layers = model.config.num_hidden_layers
    with ForwardProgress(model, on_layer=seen.append) as progress:
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert progress.fraction == 1.0
        model(input_ids=torch.tensor([[4, 5]]))  # a second forward counts from zero again
    assert seen == [k / layers for k in range(1, layers + 1)] * 2
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in decoder_layers(model))


def test_a_cancelled_forward_stops_between_two_layers(tiny):
    model, _ = tiny
    with ForwardProgress(model) as progress:
        progress.on_layer = lambda fraction: progress.cancel() if progress.done == 1 else None
        with pytest.raises(Cancelled):
            model(input_ids=torch.tensor([[1, 2, 3]]))
        assert progress.done == 1  # the second layer never ran
    assert model(input_ids=torch.tensor([[1, 2, 3]])).logits.shape[1] == 3  # the hooks are gone


def test_a_followed_progress_ignores_forwards_on_other_threads(tiny):
    model, _ = tiny
    with ForwardProgress(model) as progress:
        worker = threading.Thread(target=progress.follow)
        worker.start(), worker.join()
        model(input_ids=torch.tensor([[1, 2, 3]]))  # this thread's forward: another session's
        assert progress.done == 0
        progress.follow()
        model(input_ids=torch.tensor([[1, 2, 3]]))
        assert progress.fraction == 1.0


def test_heartbeats_run_on_start_in_the_worker_thread_before_the_first_item():
    seen = []
    items = list(with_heartbeats(iter([1]), every=0.1, on_start=lambda: seen.append(threading.current_thread().name)))
    assert items == [1] and seen == ["kvviz-run"]


def test_prefill_progress_through_the_engine_reaches_one_before_the_first_event(tiny, tiny_prompt):
    model, tokenizer = tiny
    fractions = []
    with ForwardProgress(model, on_layer=fractions.append):
        first = next(kvviz.stream(model, tokenizer, tiny_prompt, "inertia", compression=0.5,
                                  max_new_tokens=2, backend="engine"))
    assert first.step == 0 and fractions[:model.config.num_hidden_layers][-1] == 1.0


def slow(items, pause):
    for item in items:
        time.sleep(pause)
        yield item


def test_heartbeats_fill_the_waits_and_the_items_arrive_in_order():
    out = list(with_heartbeats(slow(["a", "b"], 0.35), every=0.1))
    items = [item for item in out if not isinstance(item, Heartbeat)]
    beats = [item.seconds for item in out if isinstance(item, Heartbeat)]
    assert items == ["a", "b"]
    assert len(beats) >= 4 and beats == sorted(beats)  # ~3 per 0.35 s wait


def test_an_error_in_the_run_is_raised_to_the_consumer():
    def failing():
        yield 1
        raise RuntimeError("the run failed")

    stream = with_heartbeats(failing(), every=0.1)
    assert next(stream) == 1
    with pytest.raises(RuntimeError, match="the run failed"):
        list(stream)


def test_the_run_goes_at_most_ahead_items_ahead_of_a_consumer_that_waits():
    """A page slower than the model takes several events at once instead of holding the decode to its pace:
    while the consumer holds its first item, the worker makes ``ahead`` more (queued) and one more (waiting to
    be queued), then waits; none is lost or reordered."""
    for ahead in (1, 4):
        produced = []

        def counted(produced=produced):
            for index in range(12):
                produced.append(index)
                yield index

        stream = with_heartbeats(counted(), every=5.0, ahead=ahead)
        assert next(stream) == 0
        deadline = time.monotonic() + 10
        while len(produced) < ahead + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # room to overrun, were it not held
        assert len(produced) == 1 + ahead + 1
        assert list(stream) == list(range(1, 12))


def test_the_live_and_compare_tabs_let_the_run_go_ahead_of_the_page(tiny):
    """The tabs' event stream: with the page busy on its first event, the run makes RUN_AHEAD more (a 48-token
    comparison of the tiny model went at the pace of the page's updates, 18 s on a 2-core machine)."""
    from kvviz.ui.waiting import RUN_AHEAD, events_with_progress

    model, _ = tiny
    produced = []

    def counted():
        for index in range(RUN_AHEAD + 10):
            produced.append(index)
            yield index

    with closing(events_with_progress(counted(), model, prompt_len=3)) as stream:
        assert next(stream) == 0
        deadline = time.monotonic() + 10
        while len(produced) < RUN_AHEAD + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(produced) == RUN_AHEAD + 2 and RUN_AHEAD >= 4 * 16  # sixteen steps of four policies
        assert list(stream) == list(range(1, RUN_AHEAD + 10))


def test_closing_stops_the_worker_and_calls_on_close():
    produced, closed = [], threading.Event()

    def endless():
        count = 0
        while True:
            count += 1
            produced.append(count)
            yield count

    stream = with_heartbeats(endless(), every=0.1, on_close=closed.set)
    assert next(stream) == 1
    stream.close()
    assert closed.is_set()
    settled = len(produced)
    time.sleep(0.3)
    assert len(produced) == settled <= 3  # one item in the queue, one being put: no more after close
    assert not [t for t in threading.enumerate() if t.name == "kvviz-run"]


def test_pacer_waits_for_the_browser_and_for_its_rate():
    pacer = FramePacer(max_per_second=10, patience=3.0)
    assert pacer.due(now=0.0)
    pacer.send(now=0.0)
    assert not pacer.due(now=0.05)  # faster than 10 a second
    assert pacer.due(now=0.1)  # no page has acknowledged anything yet: the plain rate
    pacer.send(now=0.1)
    pacer.acknowledge(now=0.2)  # a page: frame 1 drawn, frame 2 not yet
    assert not pacer.due(now=0.5)
    pacer.acknowledge(now=0.5)
    assert pacer.due(now=0.5)
    pacer.send(now=0.5)
    assert not pacer.due(now=3.4) and pacer.due(now=3.5)  # no acknowledgement: patience then sends anyway
    pacer.send(now=3.5)
    assert pacer.backlog() == 2
    for _ in range(5):
        pacer.acknowledge(now=4.0)
    assert pacer.backlog() == 0  # never below zero: acknowledgements beyond what was sent are ignored


def test_a_slow_page_stretches_the_patience_and_slows_the_text():
    """A page that took 5 s to draw a frame is not sent the next after 3 s but after 15 (three of its draws);
    while a frame is undrawn the text goes out every BEHIND_TEXT_EVERY_S, not 30 times a second; an API
    client (nothing ever acknowledged) keeps both plain rates."""
    pacer = FramePacer(max_per_second=2, patience=3.0)
    pacer.send(now=0.0)
    pacer.acknowledge(now=5.0)  # drawn 5 s after it went out
    assert pacer.waits() == 15.0
    pacer.send(now=5.0)
    assert not pacer.due(now=19.9) and pacer.due(now=20.0)
    assert not pacer.text_due(last_text=19.9, now=20.0)  # behind: text every 0.5 s
    assert pacer.text_due(last_text=19.5, now=20.0)
    pacer.acknowledge(now=20.0)
    assert pacer.text_due(last_text=19.95, now=20.0)  # caught up: 30 a second again
    slowest = FramePacer(max_per_second=2, patience=3.0)
    slowest.send(now=0.0)
    slowest.acknowledge(now=100.0)
    assert slowest.waits() == pacing.MAX_PATIENCE_S  # never a page left without frames for longer
    api = FramePacer(max_per_second=2, patience=3.0)
    api.send(now=0.0)
    assert api.text_due(last_text=0.0, now=0.04) and api.due(now=0.5)


def test_zero_rate_sends_nothing_until_the_end():
    assert not FramePacer(max_per_second=0).due(now=100.0)


def test_pacers_are_per_session_and_a_newer_run_replaces_the_older():
    pacers = Pacers(max_per_second=10)
    first = pacers.start("session-a", "live")
    other = pacers.start("session-b", "live")
    first.send(now=0.0), other.send(now=0.0)
    first.send(now=0.1), other.send(now=0.1)
    pacers.acknowledge("session-a", "live")
    assert first.backlog() == 1 and other.backlog() == 2
    assert not first.due(now=0.3) and other.due(now=0.3)  # only session a's page is behind
    second = pacers.start("session-a", "live")
    pacers.finish("session-a", "live", first)  # the older run ending does not drop the newer one's pacer
    pacers.acknowledge("session-a", "live")
    assert second.drawn == 0 and len(pacers) == 2  # nothing sent yet: nothing to acknowledge
    pacers.finish("session-a", "live", second)
    pacers.acknowledge("session-z", "live")  # an unknown session is ignored
    assert len(pacers) == 1


def test_a_slow_prefill_reports_rising_layer_shares_then_the_events(tiny, tiny_prompt):
    from kvviz.ui.waiting import events_with_progress

    model, tokenizer = tiny
    layers = decoder_layers(model)
    slow_layers = [layer.register_forward_pre_hook(lambda module, args: time.sleep(0.15)) for layer in layers]
    try:
        events = kvviz.stream(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=2,
                              backend="engine")
        out = list(events_with_progress(events, model, len(tiny_prompt), every=0.05))
    finally:
        for handle in slow_layers:
            handle.remove()
    notes = [item for item in out if isinstance(item, str)]
    steps = [item.step for item in out if not isinstance(item, str)]
    assert steps == [0, 1]
    assert out.index(notes[-1]) < out.index(next(item for item in out if not isinstance(item, str)))
    shares = [int(note.split(": ")[1].split("%")[0]) for note in notes]
    assert shares == sorted(shares) and len(set(shares)) >= 2  # it rises, layer by layer
    assert f"{len(tiny_prompt):,}-token prompt" in notes[0]
    assert all(not layer._forward_hooks for layer in layers)


def test_closing_during_the_prefill_cancels_it_between_layers(tiny, tiny_prompt):
    from kvviz.ui.waiting import events_with_progress

    model, tokenizer = tiny
    layers = decoder_layers(model)
    ran = []
    slow_layers = [layer.register_forward_pre_hook(lambda module, args: (ran.append(1), time.sleep(0.3)))
                   for layer in layers]
    try:
        events = kvviz.stream(model, tokenizer, tiny_prompt, "inertia", compression=0.5, max_new_tokens=2,
                              backend="engine")
        stream = events_with_progress(events, model, len(tiny_prompt), every=0.05)
        assert isinstance(next(stream), str)  # the prefill is under way
        stream.close()
    finally:
        for handle in slow_layers:
            handle.remove()
    assert len(ran) < len(layers)  # stopped before the prefill reached its last layer
    assert not [t for t in threading.enumerate() if t.name == "kvviz-run"]


def test_the_live_run_sends_a_new_heatmap_only_once_the_page_drew_the_last(tiny, monkeypatch):
    """A page that acknowledged one frame and then no more gets no second heatmap until patience runs out;
    an API client (no acknowledgement ever) gets every frame the rate allows; the text streams either way."""
    import gradio as gr

    from kvviz.ui import live
    from kvviz.ui.checks import PARAM_NAMES, PARAMETERS, _models
    from kvviz.ui.config import Limits
    from kvviz.ui.tickets import button_ticket

    _models["tiny-random-llama"] = tiny
    limits = Limits(models=("tiny-random-llama",), max_prompt_tokens=400, max_new_tokens=64,
                    figures_per_second=60)
    with gr.Blocks():
        tab = live.layout(limits)
    defaults = [PARAMETERS[p]["default"] for p in PARAM_NAMES]
    prompt = "The quick brown fox jumps over the lazy dog. The passkey is 71432. " * 3

    def heatmaps(pacers: Pacers, session: str) -> int:
        tickets, ticket = button_ticket(None)
        handler = live.make_live_handler(limits, tab, pacers)
        updates = list(handler("tiny-random-llama", prompt, "inertia", "compression", 0.5, 0, 40, False,
                               0.0, 1.0, 0, *defaults, ticket, tickets, session=session))
        assert updates[-1][tab.view_state].steps == 40  # ran to the end
        return sum(1 for update in updates[:-1] if update.get(tab.retention) is not None)

    clock = iter(range(10**6))  # 1 s between frames: never under the 60-a-second cap
    monkeypatch.setattr(live, "time", SimpleNamespace(perf_counter=lambda: float(next(clock))))
    assert heatmaps(Pacers(max_per_second=60, patience=1000.0), "api") > 10  # draws nothing: the plain rate

    class BehindPage(Pacers):
        """A page that draws the first heatmap, then falls behind (acknowledges nothing more)."""

        def start(self, session, stream):
            pacer = super().start(session, stream)
            send = pacer.send

            def sent(now=None):
                number = send(now)
                if number == 1:
                    pacer.acknowledge(now)  # drawn at once
                return number

            pacer.send = sent
            return pacer

    # frame 1, drawn; frame 2; then nothing until the page draws frame 2 (patience: 1000 s)
    assert heatmaps(BehindPage(max_per_second=60, patience=1000.0), "page") == 2
