"""Figure updates paced by what the browser has drawn.

A fast run can make figures faster than a slow client draws them: the page then falls behind the server,
and a click on Stop waits behind every frame still queued.  A :class:`FramePacer` sends a new frame only
once the browser has acknowledged the last one (the figure's ``change`` event, which the page fires after
it applied the update), and never more often than ``max_per_second``.  ``patience`` bounds the wait for an
acknowledgement that never comes (a client that dropped it), so a run never stops drawing altogether; it
stretches to a few times the slowest draw the page has taken, so a page that needs 5 s a frame is not sent
a frame every 3 s.  While a frame is not yet drawn, text updates slow to ``BEHIND_TEXT_EVERY_S`` too: every
message the page has to apply delays the click on Stop.  A client that has acknowledged nothing (an API
client reading the stream, no page) gets the plain rate.

Pacers live in a :class:`Pacers` registry keyed by the browser session, since the acknowledgement arrives
as a separate request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

# The text at most 30 times a second while the page keeps up: a tiny model or a GPU makes hundreds of tokens
# a second, and an update each (each re-rendering the growing text) would saturate the page.
TEXT_EVERY_S = 1 / 30
BEHIND_TEXT_EVERY_S = 0.5  # ... and while it is still drawing a frame
MAX_PATIENCE_S = 30.0  # even a page that draws this slowly gets a frame now and then


@dataclass
class FramePacer:
    """When the next figure frame may go out.

    Parameters
    ----------
    max_per_second : float
        The most frames a second, even on a client that draws at once; 0 sends none until the run ends.
    patience : float
        Seconds after which a frame goes out although the previous one was not acknowledged, at least; three
        times the slowest acknowledged draw if that is longer (up to ``MAX_PATIENCE_S``).
    """

    max_per_second: float = 10.0
    patience: float = 3.0
    sent: int = 0
    drawn: int = 0
    last_sent: float = field(default=-float("inf"))
    slowest_draw: float = 0.0
    _sent_at: list = field(default_factory=list)  # when each frame not yet acknowledged went out

    def due(self, now: float | None = None) -> bool:
        """Whether a frame may be sent now."""
        if not self.max_per_second:
            return False
        now = time.perf_counter() if now is None else now
        since = now - self.last_sent
        if since < 1 / self.max_per_second:
            return False
        return self.drawn == 0 or self.drawn >= self.sent or since >= self.waits()

    def waits(self) -> float:
        """Seconds an unacknowledged frame holds back the next one."""
        return max(self.patience, min(3 * self.slowest_draw, MAX_PATIENCE_S))

    def text_due(self, last_text: float, now: float | None = None) -> bool:
        """Whether a text-only update may go out, the last having gone at ``last_text``."""
        now = time.perf_counter() if now is None else now
        behind = self.drawn > 0 and self.drawn < self.sent  # a page, still drawing a frame
        return now - last_text >= (BEHIND_TEXT_EVERY_S if behind else TEXT_EVERY_S)

    def send(self, now: float | None = None) -> int:
        """Record a frame as sent; returns its number (1, 2, ...)."""
        self.last_sent = time.perf_counter() if now is None else now
        self.sent += 1
        self._sent_at.append(self.last_sent)
        return self.sent

    def acknowledge(self, now: float | None = None) -> None:
        """The browser drew a frame.  Acknowledgements are not numbered: the page draws in order."""
        if self.drawn >= self.sent:
            return
        now = time.perf_counter() if now is None else now
        self.slowest_draw = max(self.slowest_draw, now - self._sent_at.pop(0))
        self.drawn += 1

    def backlog(self) -> int:
        """Frames sent but not yet acknowledged."""
        return self.sent - self.drawn


class Pacers:
    """One :class:`FramePacer` per (session, figure stream); safe to use from the server's threads."""

    def __init__(self, max_per_second: float = 10.0, patience: float = 3.0):
        self.max_per_second, self.patience = max_per_second, patience
        self._pacers: dict[tuple[str, str], FramePacer] = {}
        self._lock = threading.Lock()

    def start(self, session: str, stream: str) -> FramePacer:
        """A fresh pacer for a new run of ``stream`` (e.g. "live") in ``session``."""
        pacer = FramePacer(self.max_per_second, self.patience)
        with self._lock:
            self._pacers[(session, stream)] = pacer
        return pacer

    def acknowledge(self, session: str, stream: str) -> None:
        with self._lock:
            pacer = self._pacers.get((session, stream))
        if pacer is not None:
            pacer.acknowledge()

    def finish(self, session: str, stream: str, pacer: FramePacer) -> None:
        """Forget ``pacer`` unless a newer run of the same stream has replaced it."""
        with self._lock:
            if self._pacers.get((session, stream)) is pacer:
                del self._pacers[(session, stream)]

    def __len__(self) -> int:
        return len(self._pacers)
