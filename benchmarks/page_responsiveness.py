"""How busy a fast stream keeps the browser, by how often the Live tab sends its text and redraws its figures.

Serves the app on the tiny random model (hundreds of tokens a second on a CPU, as a real model on a GPU),
opens it in Debian's headless Chromium (Playwright), starts a 3000-token run and, while it streams, times
a round trip into the page's main thread (``page.evaluate``) every 0.2 s: a busy page answers late, and a
click made then waits as long.  Every setting runs in one process, one after the other, each on a fresh
app and page; one JSON line per setting, with its median and 95th percentile over the first setting's (the
app before the text was throttled).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/page_responsiveness.py [--seconds 10] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import socket
import statistics
import time
from datetime import datetime, timezone

from kvviz.ui import app, common
from kvviz.ui.config import Limits

TINY = "tiny-random-llama"
PROMPT = "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. " * 4


def measure(page, url: str, seconds: float) -> dict:
    page.goto(url)
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
    page.evaluate("document.querySelector('#live-stop').click()")
    page.get_by_text("Scrub to step").wait_for(timeout=120_000)
    waits.sort()
    return {"round_trips": len(waits), "median_ms": round(1000 * statistics.median(waits), 1),
            "p95_ms": round(1000 * waits[int(0.95 * (len(waits) - 1))], 1), "max_ms": round(1000 * waits[-1], 1),
            "characters_shown": shown}


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
    text_every = common.TEXT_EVERY_S
    # The app as it was (text per token, figures 10/s) first, then the text at most 30/s at each figure rate.
    settings = [("text every token, 10 figures/s", 0.0, 10.0), *((f"text at most 30/s, {rate:g} figures/s",
                                                                 text_every, rate) for rate in (10.0, 4.0, 2.0, 0.0))]
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        for label, common.TEXT_EVERY_S, rate in settings:  # TEXT_EVERY_S: read by the running handler at each step
            demo, url = serve(rate)
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            try:
                rows.append({"what": label, "text_every_s": round(common.TEXT_EVERY_S, 4), "figures_per_second": rate,
                             **measure(page, url, args.seconds)})
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
