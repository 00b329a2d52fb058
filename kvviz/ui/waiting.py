"""What a tab shows between Run and the first token: the prefill's progress, layer by layer.

The Live and Compare tabs iterate a run's events through :func:`events_with_progress`, which passes every
event on and, while the prefill runs, a status line at each heartbeat.  Stop (closing the iterator)
cancels the prefill between two layers instead of waiting for the whole forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import closing

from ..progress import ForwardProgress, Heartbeat, with_heartbeats


def prefill_note(prompt_len: int, fraction: float, seconds: float) -> str:
    """The status line while a ``prompt_len``-token prefill is ``fraction`` done after ``seconds``."""
    return f"*prefill of the {prompt_len:,}-token prompt: {fraction:.0%} of the layers, {seconds:.0f} s…*"


# How many events the decode may run ahead of a page that draws slower than it decodes (one ahead held a
# 48-token comparison of the tiny model to 18 s on a 2-core machine, the pace of the page's updates); bounded,
# as each event holds a step's scores.
RUN_AHEAD = 256


def events_with_progress(events: Iterator, model, prompt_len: int, every: float = 0.5) -> Iterator:
    """``events``, with a :func:`prefill_note` (a str) every ``every`` s until the first event arrives.

    Later waits (a decode step slower than ``every``) yield nothing: the tab's own stats say how it goes.
    """
    progress = ForwardProgress(model)
    with progress, closing(with_heartbeats(events, every, on_close=progress.cancel, on_start=progress.follow,
                                           ahead=RUN_AHEAD)) as stream:
        started = False
        for item in stream:
            if isinstance(item, Heartbeat):
                if not started:
                    yield prefill_note(prompt_len, progress.fraction, item.seconds)
                continue
            started = True
            yield item
