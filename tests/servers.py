"""Test servers that wait for readiness themselves: Gradio's launch checks its own URL (five tries of 3 s),
and on a machine whose other work kept it at several times its core count in load that check failed
("When localhost is not accessible, a shareable link must be created") though the server came up."""

from __future__ import annotations

import socket
import time
from unittest import mock

import httpx

READY_SECONDS = 180  # a page's first answer on a loaded 2-core machine; the poll ends as soon as it answers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(app, port: int) -> str:
    """Launch ``app`` (queued already) on 127.0.0.1:``port`` without Gradio's reachability check, then poll
    until it answers; its URL."""
    url = f"http://127.0.0.1:{port}/"
    with mock.patch("gradio.networking.url_ok", lambda _url: True):
        app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    deadline = time.monotonic() + READY_SECONDS
    while True:
        try:
            if httpx.get(url, timeout=10).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            app.close()
            raise RuntimeError(f"the test server at {url} did not answer within {READY_SECONDS} s")
        time.sleep(0.2)
