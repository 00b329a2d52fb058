"""Regenerate the README's screenshots of the app on the default model (CPU, a few minutes).

    .venv/bin/python assets/screenshots.py   # writes assets/start.png, live.png, compare.png, results.png

It starts the app on a free loopback port and drives Debian's chromium through Playwright, as the browser
test does: the first view (the shipped comparison, no run), a Live run of the passkey example under
InertiaKV, a comparison of the default four-key-needle example with the asked-for key's digits followed,
and the Results tab's paired differences.
"""

from __future__ import annotations

import re
import shutil
import socket
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from playwright.sync_api import sync_playwright  # noqa: E402

from kvviz.models import DEFAULT_MODEL  # noqa: E402
from kvviz.ui.app import build_app  # noqa: E402
from kvviz.ui.config import Limits  # noqa: E402

WIDTH, HEIGHT = 1400, 1100
WAIT_MS = 600_000  # a CPU run of the default model


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    browser_path = shutil.which("chromium")
    if browser_path is None:
        raise SystemExit("needs Debian's chromium (make browser)")
    port = free_port()
    app = build_app(Limits(models=(DEFAULT_MODEL,), host="127.0.0.1", port=port))
    app.queue(default_concurrency_limit=1)
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=browser_path, headless=True,
                                                 args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.goto(f"http://127.0.0.1:{port}/")
            # the first view: the shipped comparison, its answers, the needle's columns marked
            page.locator("#start-here .js-plotly-plot").first.wait_for(timeout=WAIT_MS)
            time.sleep(3)
            page.screenshot(path=HERE / "start.png")

            page.get_by_role("tab", name="Live").click()
            page.locator("#live-run").click()
            page.get_by_text("Scrub to step").wait_for(timeout=WAIT_MS)
            time.sleep(3)  # the last figures settle
            page.evaluate("window.scrollTo(0, 0)")  # the prompt, the streamed text and the heatmaps
            time.sleep(1)
            page.screenshot(path=HERE / "live.png")

            page.get_by_role("tab", name="Compare").click()
            page.get_by_role("button", name="Compare", exact=True).click()
            # Case-sensitive: the Live tab's hidden fate key says "kept to the end" too
            page.get_by_text(re.compile("Kept to the end, of")).wait_for(timeout=WAIT_MS)
            # the asked-for key's digits, followed: marked in red on every retention panel
            page.locator("#compare-follow textarea").fill("9074615")
            page.get_by_text(re.compile("Marked in red")).wait_for(timeout=WAIT_MS)
            time.sleep(3)
            page.evaluate("window.scrollTo(0, 0)")
            time.sleep(1)
            page.screenshot(path=HERE / "compare.png")

            page.get_by_role("tab", name="Results").click()
            page.get_by_text("Paired differences", exact=True).click()
            page.get_by_text("Paired difference to", exact=False).first.wait_for(timeout=WAIT_MS)
            time.sleep(3)
            # the figure from its title down, not its title at the window's bottom edge
            page.get_by_text("Paired difference to", exact=False).first.evaluate(
                "e => { e.scrollIntoView({block: 'start'}); window.scrollBy(0, -60); }")
            time.sleep(1)
            page.screenshot(path=HERE / "results.png")
            browser.close()
    finally:
        app.close()
    for name in ("start", "live", "compare", "results"):
        print(HERE / f"{name}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
