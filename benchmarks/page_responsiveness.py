"""How busy a fast stream keeps the browser, by how the Live tab paces its text and figures.

Serves the app on the tiny random model (hundreds of tokens a second on a CPU, as a real model on a GPU),
opens it in Debian's headless Chromium (Playwright), starts a 3000-token run and, while it streams, times
a round trip into the page's main thread (``page.evaluate``) every 0.2 s: a busy page answers late, and a
click made then waits as long.  Then it clicks Stop and times until the stopped run's scrubber shows.
Every setting runs in one process, one after the other, each on a fresh app and page; one JSON line per
setting, with its median and 95th percentile over the first setting's (the app before any pacing: text
every token, figures at a fixed 10 a second).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/page_responsiveness.py [--seconds 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import shutil
import socket
import statistics
import time
from datetime import datetime, timezone

from kvviz.ui import app, pacing
from kvviz.ui.config import Limits

TINY = "tiny-random-llama"
PROMPT = "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. " * 4


def measure(page, url: str, seconds: float) -> dict:
    page.goto(url)
    page.get_by_role("tab", name="Live").click()  # the app opens on Start here
    page.get_by_label("Prompt").first.fill(PROMPT)
    max_new = page.get_by_label("Max new tokens", exact=False).locator("xpath=..").locator("input[type=number]")
    max_new.first.fill("3000")
    max_new.first.press("Enter")
    page.get_by_label("Chat template").uncheck()
    page.locator("#live-run").click()
    deadline = time.time() + 60
    while not page.get_by_label("Generated text").input_value() and time.time() < deadline:
        time.sleep(0.1)
    waits, start = [], time.time()
    while time.time() - start < seconds:
        sent = time.perf_counter()
        page.evaluate("1")
        waits.append(time.perf_counter() - sent)
        time.sleep(0.2)
    shown = len(page.get_by_label("Generated text").input_value())
    clicked = time.perf_counter()
    page.evaluate("document.querySelector('#live-stop').click()")
    page.get_by_text("Scrub to step").wait_for(timeout=120_000)
    stop_s = time.perf_counter() - clicked
    waits.sort()
    return {"round_trips": len(waits), "median_ms": round(1000 * statistics.median(waits), 1),
            "p95_ms": round(1000 * waits[int(0.95 * (len(waits) - 1))], 1), "max_ms": round(1000 * waits[-1], 1),
            "characters_shown": shown, "stop_to_scrubber_s": round(stop_s, 2)}


@contextlib.contextmanager
def pacing_as(text_every_s: float, paced: bool):
    """The app's pacing for one setting: the text's interval, and whether figures and text wait for the page
    (``paced=False``: a frame whenever the rate allows, the text at its interval even while a frame is
    undrawn, as before the page acknowledged frames)."""
    saved = pacing.TEXT_EVERY_S, pacing.BEHIND_TEXT_EVERY_S, pacing.FramePacer.waits
    pacing.TEXT_EVERY_S = text_every_s
    if not paced:
        pacing.BEHIND_TEXT_EVERY_S = text_every_s
        pacing.FramePacer.waits = lambda self: 0.0
    try:
        yield
    finally:
        pacing.TEXT_EVERY_S, pacing.BEHIND_TEXT_EVERY_S, pacing.FramePacer.waits = saved


def serve(figures_per_second: float):
    """The app on the tiny model at this figure rate, on a free loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = Limits(models=(TINY,), max_prompt_tokens=2000, max_new_tokens=3000, host="127.0.0.1", port=port,
                    figures_per_second=figures_per_second)
    demo = app.build_app(limits)
    demo.queue(default_concurrency_limit=1)
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    return demo, f"http://127.0.0.1:{port}/"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each setting streams while timed")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("Debian's chromium is not installed: make browser")
    from playwright.sync_api import sync_playwright

    rows = [{"meta": {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "model": TINY,
                      "machine": platform.node(), "seconds_each": args.seconds}}]
    text_every = pacing.TEXT_EVERY_S
    # The app before any pacing first, then the text at most 30/s unpaced, then paced as the app ships (at the
    # default rate cap and the browser tests' 2/s), then figures only at the end.
    settings = [("unpaced: text every token, 10 figures/s", 0.0, 10.0, False),
                ("unpaced: text at most 30/s, 10 figures/s", text_every, 10.0, False),
                ("paced by the page (the app): up to 10 figures/s", text_every, 10.0, True),
                ("paced by the page: up to 2 figures/s", text_every, 2.0, True),
                ("figures only at the end", text_every, 0.0, True)]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for label, text_every_s, rate, paced in settings:  # read by the running handler at each step
            demo, url = serve(rate)
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            try:
                with pacing_as(text_every_s, paced):
                    rows.append({"what": label, "text_every_s": round(text_every_s, 4), "figures_per_second": rate,
                                 "paced": paced, **measure(page, url, args.seconds)})
            finally:
                page.close()
                demo.close()
        browser.close()
    for row in rows[2:]:
        row["median_vs_first"] = round(row["median_ms"] / rows[1]["median_ms"], 3)
        row["p95_vs_first"] = round(row["p95_ms"] / rows[1]["p95_ms"], 3)
    lines = [json.dumps(row) for row in rows]
    print("\n".join(lines))
    if args.out:
        with open(args.out, "w") as handle:
            handle.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
