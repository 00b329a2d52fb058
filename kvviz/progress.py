"""What a run is doing while it has nothing to show yet: how far a forward pass has come, and heartbeats.

A first run spends seconds loading the model and tens of seconds in the prefill (one forward over the whole
prompt) before its first token.  :class:`ForwardProgress` counts the decoder layers a forward has finished,
so a prefill can report a real percentage, and can stop it between two layers when the user presses Stop.
:func:`with_heartbeats` runs a run's event iterator in a worker thread and, while it waits for the next
event, yields a :class:`Heartbeat` every ``every`` seconds, so a UI can redraw its progress line.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn


class Cancelled(Exception):
    """Raised inside a forward pass, between two layers, once its run was cancelled."""


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers: the module list as long as ``config.num_hidden_layers``."""
    count = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__} has no list of {count} decoder layers to follow")


class ForwardProgress:
    """Counts the decoder layers finished by the forward passes run inside ``with ForwardProgress(model)``.

    ``fraction`` is the share of the current forward's layers done, in [0, 1]; ``cancel()`` makes the next
    layer raise :class:`Cancelled`, so a long prefill stops within one layer's time.  ``on_layer`` (optional)
    is called with the fraction after every layer.  Once :meth:`follow` names a thread, only forwards on
    that thread count (a server runs other sessions' forwards on the same model at the same time).
    """

    def __init__(self, model: nn.Module, on_layer: Callable[[float], None] | None = None):
        self.layers = decoder_layers(model)
        self.done = 0
        self.on_layer = on_layer
        self.thread: int | None = None
        self._cancelled = threading.Event()
        self._hooks: list = []

    def follow(self, thread: int | None = None) -> None:
        """Count only the forwards of ``thread`` (default: the calling thread)."""
        self.thread = threading.get_ident() if thread is None else thread

    def _ours(self) -> bool:
        return self.thread is None or threading.get_ident() == self.thread

    @property
    def fraction(self) -> float:
        return self.done / len(self.layers)

    def cancel(self) -> None:
        self._cancelled.set()

    def _before(self, index: int):
        def hook(module, args):
            if not self._ours():
                return
            if self._cancelled.is_set():
                raise Cancelled("the run was cancelled")
            if index == 0:  # a new forward starts counting again
                self.done = 0
        return hook

    def _after(self, module, args, output) -> None:
        if not self._ours():
            return
        self.done += 1
        if self.on_layer is not None:
            self.on_layer(self.fraction)

    def __enter__(self) -> ForwardProgress:
        for index, layer in enumerate(self.layers):
            self._hooks.append(layer.register_forward_pre_hook(self._before(index)))
            self._hooks.append(layer.register_forward_hook(self._after))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


@dataclass(frozen=True)
class Heartbeat:
    """No new event for a while: ``seconds`` since the iterator started."""
    seconds: float


_DONE = object()


def with_heartbeats(events: Iterator, every: float = 0.5, on_close: Callable[[], None] | None = None,
                    join_seconds: float = 10.0, on_start: Callable[[], None] | None = None,
                    ahead: int = 1) -> Iterator:
    """``events``' items, with a :class:`Heartbeat` each ``every`` s that passes without one.

    The iterator runs in a daemon thread, which first calls ``on_start`` (e.g. :meth:`ForwardProgress.follow`);
    its exception is raised here.  Closing this generator (a UI's Stop)
    calls ``on_close`` (e.g. :meth:`ForwardProgress.cancel`) and waits up to ``join_seconds`` for the thread
    to end after its current item.  The worker runs at most ``ahead`` items ahead of the consumer: a UI that
    draws slower than the model decodes then takes several at once instead of holding the decode to its pace.
    """
    items: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def work() -> None:
        try:
            if on_start is not None:
                on_start()
            for item in events:
                while not stop.is_set():
                    try:
                        items.put(("item", item), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            _offer(items, ("done", _DONE), stop)
        except BaseException as error:  # handed to the consumer, which raises it
            _offer(items, ("error", error), stop)
        finally:
            close = getattr(events, "close", None)
            if close is not None:
                close()

    start = time.perf_counter()
    worker = threading.Thread(target=work, name="kvviz-run", daemon=True)
    worker.start()
    try:
        while True:
            try:
                kind, item = items.get(timeout=every)
            except queue.Empty:
                yield Heartbeat(time.perf_counter() - start)
                continue
            if kind == "done":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()
        if worker.is_alive():
            if on_close is not None:
                on_close()
            worker.join(timeout=join_seconds)  # so that a caller freeing memory next finds the run's tensors gone


def _offer(items: queue.Queue, entry: tuple, stop: threading.Event) -> None:
    """Put ``entry`` unless the consumer has gone (then nobody would take it, and a full queue would block)."""
    while not stop.is_set():
        try:
            items.put(entry, timeout=0.1)
            return
        except queue.Full:
            continue
