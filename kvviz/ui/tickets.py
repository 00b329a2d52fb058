"""Stop for the app's runs: each Run or Compare click gets a ticket, the run goes by it, and Stop sets
every ticket of the session, so that a decoding run ends between two steps showing what it ran and one
still waiting (in the queue or its check) does nothing when its turn comes."""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterator

import gradio as gr

log = logging.getLogger(__name__)

_tickets: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> Ticket, while a session holds it


class Ticket(threading.Event):
    """One run's stop switch: Stop sets it, and the run ends before its next step, showing what ran (or,
    stopped while queued or checked, does nothing when its turn comes).  Not Gradio's cancel, which drops the
    run's last update, where the run so far is shown."""

    def __init__(self):
        super().__init__()
        self.id = uuid.uuid4().hex
        self.claimed = False  # a run goes by it: a ticket starts one run at most
        self.done = False  # that run is over, or none will start by it (its check refused, its queue was full)
        _tickets[self.id] = self


class Tickets:
    """A session's tickets (held in its State, never replaced): one a click, all of them set by Stop."""

    def __init__(self):
        self._lock = threading.Lock()
        self._held: list[Ticket] = []

    def _prune(self) -> None:
        """Keep the tickets that matter: a run that has not ended, or one that may still start."""
        self._held = [held for held in self._held if not held.done and (held.claimed or not held.is_set())]

    def issue(self, exclusive: bool = False) -> Ticket | None:
        """A new ticket; ``exclusive`` (a click): None while a ticket of the session is neither stopped nor
        over -- its run is being checked, waits in the queue or decodes -- so a second click does nothing."""
        with self._lock:
            self._prune()
            if exclusive and any(not held.is_set() for held in self._held):
                return None
            self._held.append(Ticket())
            return self._held[-1]

    def retire(self) -> None:
        """No run will start by the tickets not yet claimed: their check refused, or their run failed to
        start (a full queue).  The next click then gets a ticket."""
        with self._lock:
            for ticket in self._held:
                if not ticket.claimed:
                    ticket.done = True

    def stop(self) -> bool:
        """Set every ticket; whether a run of this session was decoding (it then ends by itself)."""
        with self._lock:
            running = any(ticket.claimed and not ticket.done for ticket in self._held)
            for ticket in self._held:
                ticket.set()
            self._prune()  # a stopped run still showing itself stays: a second Stop must not cancel it
            return running


def button_ticket(tickets: Tickets | None) -> tuple[Tickets, str]:
    """A Run (Compare) click, before its check: a new ticket, and its id in a hidden field that the run is
    sent with, so that a run waiting in the queue goes by its own click's ticket.

    A click while the session's run is pending (checked, queued or decoding) and not stopped does nothing:
    the error, never shown, ends its chain before the check.  After Stop the click goes ahead, and its run
    waits for the stopped one to show itself (the run events' ``always_last``)."""
    tickets = tickets or Tickets()
    ticket = tickets.issue(exclusive=True)
    if ticket is None:
        raise gr.Error("a run of this session is pending", visible=False, print_exception=False)
    return tickets, ticket.id


def stopped_run_failed(what: str, error: Exception) -> None:
    """A stopped run that fails (its last step, or showing what it ran) warns and ends as a run does: ended by
    an error, the browser would drop the run event a click made after Stop has deferred until this one ends."""
    log.exception("%s failed", what)
    gr.Warning(f"{what} could not show what it ran: {type(error).__name__}: {error}")


def retire(tickets: Tickets | None) -> None:
    """A click's check refused, or its check or run did not start (a full queue): its ticket is retired, so
    that the next click is not taken for a second one while this run is pending."""
    if tickets is not None:
        tickets.retire()


def run_ticket(ticket_id, tickets: Tickets | None) -> tuple[Ticket | None, Tickets | None]:
    """The ticket a starting run goes by, or None if Stop came before it started (or its ticket already
    started a run), and the session's holder if it was made here.  An API call sends no id (""): it gets a
    ticket of its own in the session's holder (made here for the session's first call, and kept by the run's
    first update, before its checks), which /stop_live or /stop_compare then sets."""
    if not isinstance(ticket_id, str):
        raise TypeError(f"the last input is the run's ticket id (a string, '' for an API call), got {ticket_id!r}")
    if not ticket_id:
        made = Tickets() if tickets is None else None
        return (made or tickets).issue(), made
    ticket = _tickets.get(ticket_id)
    if ticket is None or ticket.is_set() or ticket.claimed or ticket.done:
        return None, None
    ticket.claimed = True
    return ticket, None


def ticketed(ticket_id, tickets: Tickets | None, steps) -> Iterator[dict]:
    """A run by its ticket: ``steps(ticket, made)`` streams it (``made``: a holder made here for an API
    session); stopped while queued or checked, it leaves every view as it is (one skip of all its outputs).
    Its ticket is over however the run ends, refused as it starts included, so that the next click gets one."""
    ticket, made = run_ticket(ticket_id, tickets)
    if ticket is None:
        yield gr.skip()
        return
    try:
        yield from steps(ticket, made)
    finally:
        ticket.done = True


def request_stop(tickets: Tickets | None):
    """Stop: every ticket of the session set.  When no run of it is decoding, a new value for the hidden
    field whose change cancels the Run's events: a run waiting in the queue then leaves it (and the next Run
    click is not dropped while it would have waited), which its set ticket alone would only do at its turn."""
    if tickets is None or tickets.stop():
        return gr.skip()
    return time.time()
