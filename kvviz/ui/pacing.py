"""Figure updates paced by what the browser has drawn.

A fast run can make figures faster than a slow client draws them: the page then falls behind the server,
and a click on Stop waits behind every frame still queued.  A :class:`FramePacer` sends a new frame only
once the browser has acknowledged the last one (the figure's ``change`` event, which the page fires after
it applied the update), and never more often than ``max_per_second``.  ``patience`` bounds the wait for an
acknowledgement that never comes (a client that dropped it), so a run never stops drawing altogether.  A
client that has acknowledged nothing (an API client reading the stream, no page) gets the plain rate.

Pacers live in a :class:`Pacers` registry keyed by the browser session, since the acknowledgement arrives
as a separate request.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field


@dataclass
class FramePacer:
    """When the next figure frame may go out.

    Parameters
    ----------
    max_per_second : float
        The most frames a second, even on a client that draws at once; 0 sends none until the run ends.
    patience : float
        Seconds after which a frame goes out although the previous one was not acknowledged.
    """

    max_per_second: float = 10.0
    patience: float = 3.0
    sent: int = 0
    drawn: int = 0
    last_sent: float = field(default=-float("inf"))

    def due(self, now: float | None = None) -> bool:
        """Whether a frame may be sent now."""
        if not self.max_per_second:
            return False
        now = time.perf_counter() if now is None else now
        since = now - self.last_sent
        if since < 1 / self.max_per_second:
            return False
        return self.drawn == 0 or self.drawn >= self.sent or since >= self.patience

    def send(self, now: float | None = None) -> int:
        """Record a frame as sent; returns its number (1, 2, ...)."""
        self.last_sent = time.perf_counter() if now is None else now
        self.sent += 1
        return self.sent

    def acknowledge(self) -> None:
        """The browser drew a frame.  Acknowledgements are not numbered: the page draws in order."""
        self.drawn = min(self.drawn + 1, self.sent)

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
