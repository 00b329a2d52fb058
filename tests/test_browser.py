"""The Live tab in a real headless Chromium (Debian's), driven by Playwright: run, watch, scrub, stop.

Screenshots land in ``test-artifacts/`` for a person to look at.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest
from servers import free_port, serve

from kvviz.ui.config import Limits

CHROMIUM = shutil.which("chromium")
ARTIFACTS = Path(__file__).resolve().parent.parent / "test-artifacts"
TINY = "tiny-random-llama"
PROMPT = "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. " * 4

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")


@pytest.fixture(scope="module")
def app_url():
    from kvviz.ui.app import build_app

    port = free_port()
    # Room for a run long enough that Stop always lands before it ends (the tiny model decodes 500 tokens in
    # seconds, and on a loaded machine the page can be slower than that).  Two redraws a second, not ten:
    # headless software-rendered Chromium on a loaded 2-core machine takes up to seconds to answer a click
    # under ten (benchmarks/page_responsiveness.py), which made the Stop/Run tests flaky.
    limits = Limits(models=(TINY,), max_prompt_tokens=2000, max_new_tokens=3000, host="127.0.0.1", port=port,
                    figures_per_second=2)
    app = build_app(limits)
    app.queue(default_concurrency_limit=1, max_size=8)
    url = serve(app, port)
    try:
        yield url
    finally:
        app.close()


@pytest.fixture(scope="module")
def shared_page(app_url):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        holder = _PageHolder(browser, app_url)
        yield holder
        browser.close()


class _PageHolder:
    """The module's one page, replaced by a freshly loaded one after a test failed on it: a page left hung or
    mid-run by one failure (seen on a loaded CI machine) would otherwise fail every test after it."""

    def __init__(self, browser, url):
        self.browser, self.url, self.page = browser, url, None
        self.open()

    def open(self):
        if self.page is not None:
            self.page.close()
        self.page = self.browser.new_page(viewport={"width": 1400, "height": 1800})
        self.page.goto(self.url)
        self.page.get_by_role("tab", name="Live").click()  # the app opens on Start here
        self.page.get_by_label("Prompt").first.wait_for()


@pytest.fixture
def page(shared_page, request):
    yield shared_page.page
    report = getattr(request.node, "report_call", None)
    if report is not None and report.failed:
        shared_page.open()


def generated_text(page) -> str:
    return page.get_by_label("Generated text").input_value()


def set_inputs(page, max_new_tokens: int) -> None:
    page.get_by_label("Prompt").first.fill(PROMPT)
    page.get_by_label("Model").first.wait_for()
    max_new = page.get_by_label("Max new tokens", exact=False).locator("xpath=..").locator("input[type=number]")
    max_new.first.fill(str(max_new_tokens))
    max_new.first.press("Enter")
    page.get_by_label("Chat template").uncheck()


def start_a_long_run(page) -> None:
    """Run for 3000 tokens and wait until its text streams."""
    wait_until_settled(page)  # a click while the last run's event is still in flight would be dropped
    set_inputs(page, 3000)
    page.locator("#live-run").click()
    # The last run's views stay up until this one passes its checks; its first update hides the scrubber.
    page.get_by_text("Scrub to step").wait_for(state="hidden", timeout=60_000)
    deadline = time.time() + 60
    while len(generated_text(page)) < 5 and time.time() < deadline:
        time.sleep(0.2)


def wait_for_a_run_to_its_end(page, tokens: int) -> None:
    page.wait_for_function(f"() => document.body.innerText.includes('tokens {tokens} / {tokens}') && "
                           "!document.body.innerText.includes('stopped ·')", timeout=60_000)
    wait_until_settled(page)  # and its event is over: the next click starts a run


def wait_until_settled(page, timeout: float = 120) -> None:
    """Wait until no run decodes on the server (every claimed ticket is done) and the page has no event in
    flight: after that nothing can land on the views, so what they show is what Stop left."""
    from kvviz.ui import tickets

    deadline = time.time() + timeout
    while any(ticket.claimed and not ticket.done for ticket in list(tickets._tickets.values())):
        assert time.time() < deadline, "a run still decodes after Stop"
        time.sleep(0.05)
    page.wait_for_function("() => !document.querySelector('.generating')", timeout=timeout * 1000)


def titles_under_chips(page) -> list[str]:
    """The titles of the plots shown whose label chip (Gradio's, top left of the block) lies over them."""
    return page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].flatMap(plot => {
        const block = plot.closest('.block'), title = plot.querySelector('.gtitle');
        const chip = block && block.querySelector('[data-testid="block-label"]');
        if (!chip || !title || !chip.offsetParent || !plot.offsetParent) return [];
        const a = chip.getBoundingClientRect(), b = title.getBoundingClientRect();
        const apart = a.right <= b.left || b.right <= a.left || a.bottom <= b.top || b.bottom <= a.top;
        return apart ? [] : [title.textContent]; })""")


def test_run_watch_scrub(page):
    set_inputs(page, 48)
    page.locator("#live-run").click()
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .heatmaplayer')]"
                           ".some(layer => !layer.closest('#start-here'))",  # the run's, not the landing's
                           timeout=60_000)
    first = generated_text(page)
    page.wait_for_function(
        "() => !document.querySelector('button.stop-btn, .progress-text')"
        " && document.querySelector('input[type=range]')",
        timeout=120_000)
    page.get_by_text("Scrub to step").wait_for(timeout=120_000)
    final = generated_text(page)
    assert len(final) >= len(first) and final  # text appeared and grew
    # What the page shows is the run itself: the app's defaults (InertiaKV, its ρ), chat template off.
    import kvviz
    from kvviz.ui.live import LIVE_COMPRESSION

    model, tokenizer = kvviz.load_model(TINY)
    run = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, compression=LIVE_COMPRESSION, max_new_tokens=48)
    streamed = "".join(event.text for event in run.trace.events)
    assert final == streamed.replace("\r\n", "\n").replace("\r", "\n")  # a textarea holds "\n" line breaks
    page.screenshot(path=str(ARTIFACTS / "live-after-run.png"), full_page=True)

    slider = page.locator("input[type=range]").filter(has=page.locator("xpath=.")).last
    box = slider.bounding_box()
    page.mouse.click(box["x"] + box["width"] * 0.3, box["y"] + box["height"] / 2)  # scrub back
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => (p.layout && p.layout.title && "
        "String(p.layout.title.text || '').startsWith('Step ')))", timeout=30_000)
    # The token history follows the scrubbed step's boundary entries, then what is typed.
    history = ("() => [...document.querySelectorAll('.js-plotly-plot')].some(p => p.layout && p.layout.title && "
               "String(p.layout.title.text || '').startsWith(%r))")
    page.wait_for_function(history % "Token history: at step ", timeout=30_000)
    page.get_by_label("Follow tokens").fill("passkey")
    page.wait_for_function(history % "Token history: 'passkey'", timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "live-scrubbed.png"), full_page=True)
    # No plot's label chip lies over its title (the heatmaps' and the token history's hang from the top)
    assert titles_under_chips(page) == []
    # A step typed as a fraction shows its whole step, and the box then says which.
    step_box = page.get_by_label("Scrub to step", exact=False).locator("xpath=..").locator("input[type=number]")
    step_box.first.fill("7.5")
    step_box.first.press("Enter")
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot')].some(p => p.layout && "
                           "p.layout.title && String(p.layout.title.text || '').startsWith('Step 7'))", timeout=30_000)
    page.wait_for_function("box => box.value === '7'", arg=step_box.first.element_handle(), timeout=30_000)
    # and says so, in a toast
    page.get_by_test_id("toast-text").filter(has_text="Scrub to step takes whole steps: 7.5 shows step 7").wait_for(
        timeout=30_000)
    page.evaluate("() => document.querySelectorAll('button.toast-close').forEach(b => b.click())")
    # The rank plot's positions stand under the retention plot's: the same plot area, left and right (a key
    # wider than its margin once pushed one plot's right edge in)
    areas = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')]
        .filter(p => /^(Retention|Utility rank)/.test(String(((p.layout || {}).title || {}).text || '')))
        .map(p => { const r = p.querySelector('.nsewdrag').getBoundingClientRect(); return [r.left, r.right]; })""")
    assert len(areas) == 2 and areas[0] == areas[1]
    # A new prompt leaves the run's views up, marked as the earlier inputs'; the run's own prompt unmarks them
    page.get_by_label("Prompt").first.fill(PROMPT + " More.")
    stale = page.get_by_text("Earlier inputs: the prompt changed since this run", exact=False)
    stale.wait_for(timeout=30_000)
    page.get_by_label("Prompt").first.fill(PROMPT)
    stale.wait_for(state="hidden", timeout=30_000)


def test_stop_cancels_a_long_run_and_leaves_what_ran_to_scrub(page):
    start_a_long_run(page)
    # A DOM click: no scrolling or hit-testing while the outputs re-render under the button.
    page.evaluate("document.querySelector('#live-stop').click()")
    wait_until_settled(page)  # updates already in flight may land; then nothing more can
    last = generated_text(page)
    assert 5 <= len(last) and "tokens 3000 / 3000" not in page.evaluate("() => document.body.innerText")
    # What ran stays to be read as a finished run's is: the scrubber over its steps, its trace's download.
    page.get_by_text("Scrub to step").wait_for(timeout=60_000)
    page.get_by_text("stopped", exact=True).wait_for(timeout=30_000)
    page.screenshot(path=str(ARTIFACTS / "live-stopped.png"), full_page=True)
    page.locator("a[href*='trace-inertia.parquet']").first.wait_for(timeout=30_000)
    # Run again: the next click gets a new ticket, and its run goes to its end.
    set_inputs(page, 12)
    page.locator("#live-run").click()
    wait_for_a_run_to_its_end(page, 12)


def test_a_second_click_while_running_is_stopped_with_the_first(page):
    """Run, Run again while it runs, Stop: the run shows what it ran and nothing starts after it."""
    page.get_by_role("tab", name="Live").click()
    start_a_long_run(page)
    page.evaluate("document.querySelector('#live-run').click()")
    time.sleep(0.5)
    page.evaluate("document.querySelector('#live-stop').click()")
    page.get_by_text("Scrub to step").wait_for(timeout=60_000)
    stopped = generated_text(page)
    wait_until_settled(page)  # nor does a second run start after it
    assert generated_text(page) == stopped and page.get_by_text("Scrub to step").is_visible()
    assert page.evaluate("() => document.body.innerText.includes('stopped ·')")
    # The second click ended at its ticket without a word: no "Error" badge over the views (nor a toast,
    # which this Gradio shows for no error of an unqueued event anyway).
    assert page.get_by_test_id("toast-text").filter(has_text="pending").count() == 0
    assert page.get_by_text("Error", exact=True).count() == 0


def held_open(shown, clicked: list, before: set):
    """``shown`` (the stopped run's last update), held open until the next click has reached the server and
    for 1.5 s more, so that the click's check passes and its run is sent while the stopped run still shows
    itself -- however late the browser sends the click (or however early: its ticket may come before the
    stopped run gets here); ``clicked`` records whether it came, ``before`` holds the tickets from before it."""
    from kvviz.ui import tickets

    def held(*args, **kwargs):
        if not clicked:  # the stopped run's; the next run ends as usual

            def fresh_ticket() -> bool:  # the click's, not yet run
                return any(not (ticket.claimed or ticket.done or ticket.is_set())
                           for id, ticket in list(tickets._tickets.items()) if id not in before)

            # The browser sends the click when it has digested the stream's last updates: 0.05-4.5 s alone
            # here, longer on a loaded machine (the 20 s this waited once ran out in CI).
            deadline = time.time() + 60
            while not fresh_ticket() and time.time() < deadline:
                time.sleep(0.05)
            clicked.append(fresh_ticket())
            time.sleep(1.5)
        return shown(*args, **kwargs)

    return held


def test_run_right_after_stop_runs_once_the_stopped_run_has_shown_itself(page, monkeypatch):
    """Stop, then Run while the stopped run still shows what it ran (held open here until the click has come,
    as a long run's figures and trace take a while): the click is not dropped; its run waits for that, then
    goes to its end with the inputs as they are then."""
    from kvviz.ui import live, tickets

    clicked, before = [], set()
    monkeypatch.setattr(live, "live_result", held_open(live.live_result, clicked, before))
    page.get_by_role("tab", name="Live").click()
    start_a_long_run(page)
    max_new = page.get_by_label("Max new tokens", exact=False).locator("xpath=..").locator("input[type=number]")
    max_new.first.fill("12", force=True)  # for the next run (the running one keeps its inputs); forced: no
    # waiting for the streaming page to hold still
    page.evaluate("document.querySelector('#live-stop').click()")
    deadline = time.time() + 10
    while not all(ticket.is_set() for ticket in tickets._tickets.values()) and time.time() < deadline:
        time.sleep(0.05)  # Stop has reached the server
    before.update(tickets._tickets)
    page.evaluate("document.querySelector('#live-run').click()")
    wait_for_a_run_to_its_end(page, 12)
    assert clicked[0]  # the click had come while the stopped run showed itself
    page.get_by_text("Scrub to step").wait_for(timeout=60_000)


def test_a_click_refused_by_a_full_queue_leaves_run_working(page, app_url, monkeypatch):
    """A full queue refuses the click's check: the click's ticket is retired, so once the queue has room the
    next click runs (it is not taken for a second click while a run is pending)."""
    import threading

    from gradio_client import Client

    from kvviz import engine
    from kvviz.ui import tickets

    release, decode = threading.Event(), engine.decode

    def held(*args, **kwargs):  # the API client's run holds the model until released
        for event in decode(*args, **kwargs):
            release.wait(60)
            yield event

    monkeypatch.setattr(engine, "decode", held)
    client = Client(app_url, verbose=False)
    jobs = [client.submit(PROMPT, "inertia", 0.5, 30, False, TINY, "{}", api_name="/generate") for _ in range(10)]
    try:
        deadline = time.time() + 60  # one decoding, eight waiting: the queue (eight) is full
        while sum(job.status().code.name == "IN_QUEUE" for job in jobs) < 8 and time.time() < deadline:
            time.sleep(0.1)
        page.get_by_role("tab", name="Live").click()
        set_inputs(page, 11)  # not the last test's count, which its views still show
        before = set(tickets._tickets)
        page.locator("#live-run").click()
        deadline = time.time() + 20
        def new_runs_done() -> bool:
            new = set(tickets._tickets) - before
            return bool(new) and all(tickets._tickets[id].done for id in new)

        while not new_runs_done() and time.time() < deadline:
            time.sleep(0.1)
        clicked = [tickets._tickets[id] for id in set(tickets._tickets) - before]
        assert clicked and all(ticket.done and not ticket.claimed for ticket in clicked)  # refused, retired
    finally:
        release.set()
        for job in jobs:
            job.cancel()
    deadline = time.time() + 60
    while not all(job.done() for job in jobs) and time.time() < deadline:
        time.sleep(0.2)
    page.locator("#live-run").click()
    wait_for_a_run_to_its_end(page, 11)


def test_stop_takes_a_queued_run_out_of_the_queue(page, app_url):
    """While another session (an API client here) holds the model, a run waits in the queue; Stop takes it
    out, so that the next Run click is queued in its place (not dropped as a click while a run is pending)
    and runs once the other session's run ends."""
    from gradio_client import Client

    job = Client(app_url, verbose=False).submit(PROMPT, "inertia", 0.5, 3000, False, TINY, "{}",
                                                api_name="/generate")
    try:
        deadline = time.time() + 60
        while len(job.outputs()) < 3 and time.time() < deadline:
            time.sleep(0.1)
        page.get_by_role("tab", name="Live").click()
        set_inputs(page, 3000)
        page.locator("#live-run").click()
        time.sleep(2.0)  # checked, then queued behind the other session's run
        page.evaluate("document.querySelector('#live-stop').click()")
        time.sleep(1.0)
        set_inputs(page, 12)
        page.locator("#live-run").click()
        time.sleep(2.0)
        assert not job.done()  # the other session still held the model
    finally:
        job.cancel()
    wait_for_a_run_to_its_end(page, 12)


# A filter change re-queries the whole shipped store: ~10 s on an idle 2-core machine, close to a minute on one
# loaded several times over (CI's), where a 30-s wait failed.
QUERY_WAIT = 180_000


def test_results_tab_shows_figures_and_filters(page, app_url):
    # A page of its own: the figures it loads would slow every later test's clicks on the shared page.
    page = page.context.browser.new_page(viewport={"width": 1400, "height": 1800})
    try:
        page.goto(app_url)
        _results_tab_shows_figures_and_filters(page)
    finally:
        page.close()


def _results_tab_shows_figures_and_filters(page):
    page.get_by_role("tab", name="Results").click()
    page.get_by_text("Quality vs compression").first.wait_for(timeout=QUERY_WAIT)
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => p.data && p.data.length > 0 && "
        "String((p.layout.title || {}).text || '').startsWith('Quality vs compression'))", timeout=QUERY_WAIT)
    # measured vs paper (a closed section, opened here): two panels (paper and measured), each with lines
    # relative to its full cache
    page.get_by_text("Measured vs paper", exact=True).first.click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => String((p.layout.title || {}).text || '')"
        ".startsWith('Measured vs paper') && new Set(p.data.map(t => t.xaxis)).size === 2)", timeout=QUERY_WAIT)
    page.screenshot(path=str(ARTIFACTS / "results-measured.png"), full_page=True)
    page.get_by_text("Measured vs paper", exact=True).first.click()  # closed again: the tab as it loads
    page.get_by_label("paper", exact=True).check()  # the source filter re-queries the store
    page.wait_for_function(
        "() => { const p = [...document.querySelectorAll('.js-plotly-plot')].find(p => String((p.layout.title || {})"
        ".text || '').startsWith('Quality vs compression')); return p && p.data.length > 0 && "
        "String(p.layout.title.text).split('<br>')[0].endsWith(' · paper') && "
        "p.data.every(t => t.line.dash !== 'solid'); }",
        timeout=QUERY_WAIT)  # one source left: named once in the title, every line a paper's (dashed)
    # a closed section gets the new filters' figure too (sent after the open ones), not its pending note
    page.get_by_text("Paired differences", exact=True).first.click()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => (p.layout.annotations || [])"
        ".some(a => String(a.text).startsWith('papers print no per-sample scores')))", timeout=QUERY_WAIT)
    page.get_by_text("Paired differences", exact=True).first.click()
    page.screenshot(path=str(ARTIFACTS / "results-tab.png"), full_page=True)
    assert titles_under_chips(page) == []


def test_a_saved_trace_opens_into_the_live_views(page, tmp_path):
    import kvviz

    model, tokenizer = kvviz.load_model(TINY)
    run = kvviz.run(model, tokenizer, PROMPT, "tova", chat=False, budget=30, max_new_tokens=12)
    run.trace.save(tmp_path / "tova-run.parquet")
    page.get_by_role("tab", name="Live").click()
    page.get_by_text("Open a saved trace").click()
    page.locator("#live-open input[type=file]").set_input_files(str(tmp_path / "tova-run.parquet"))
    page.get_by_text("tova-run.parquet: tova on tiny-random-llama").wait_for(timeout=60_000)
    assert generated_text(page) == "".join(e.text for e in run.trace.events).replace("\r\n", "\n").replace("\r", "\n")
    assert page.get_by_text("Scrub to step").is_visible()
    page.wait_for_function(
        "() => [...document.querySelectorAll('.js-plotly-plot')].some(p => String((p.layout.title || {}).text || '')"
        ".startsWith('Retention (B = 30)'))", timeout=30_000)
    # Its settings into the controls: SnapKV with a window of its own, not the default the policy's own
    # change would set; the budget in tokens; no chat template.
    run = kvviz.run(model, tokenizer, PROMPT, "snapkv", chat=False, budget=30, max_new_tokens=12, window=8)
    run.trace.save(tmp_path / "snapkv-run.parquet")
    page.locator("#live-open").get_by_label("Clear").click()  # the box shows the file it holds, not an upload
    page.locator("#live-reuse").wait_for(state="hidden", timeout=30_000)
    page.locator("#live-open input[type=file]").set_input_files(str(tmp_path / "snapkv-run.parquet"))
    page.get_by_text("snapkv-run.parquet: snapkv (window=8, kernel=7) on tiny-random-llama").wait_for(timeout=60_000)
    page.locator("#live-reuse").click()
    policy = page.get_by_label("Policy", exact=True).first
    page.wait_for_function("e => e.value.endsWith('(snapkv)')", arg=policy.element_handle(), timeout=30_000)
    time.sleep(2)  # any event the new values set off has run
    page.get_by_text("Policy parameters").first.click()
    assert page.get_by_label("number input for window", exact=False).first.input_value() == "8"
    page.get_by_text("Policy parameters").first.click()  # closed again, as the other tests expect
    assert page.get_by_label("Budget B (tokens)").first.input_value() == "30"
    assert page.get_by_label("Prompt").first.input_value() == PROMPT
    assert not page.get_by_label("Chat template").first.is_checked()
    assert page.get_by_text("Changed here: window = 8").is_visible()  # the description, of what the controls hold
    # A refused file says what to do and leaves the box empty: shown there, it read as the trace open
    import zipfile
    with zipfile.ZipFile(tmp_path / "comparison.zip", "w") as archive:
        archive.write(tmp_path / "tova-run.parquet", "tova-run.parquet")
    page.locator("#live-open").get_by_label("Clear").click()
    page.locator("#live-open input[type=file]").set_input_files(str(tmp_path / "comparison.zip"))
    page.get_by_test_id("toast-text").filter(has_text="unzip it").first.wait_for(timeout=30_000)
    page.wait_for_function("() => !document.querySelector('#live-open').innerText.includes('.zip')",
                           timeout=30_000)  # the box draws the name as 'comparison' and '.zip' apart
    assert page.locator("#live-reuse").is_hidden()
    # back to what the other tests expect
    page.get_by_label("compression", exact=True).first.check()
    policy.click()
    page.get_by_role("option", name="(inertia)", exact=False).first.click()


def test_the_examples_box_names_the_example_only_while_the_prompt_is_it(page):
    """An edited prompt empties the Examples box (it went on naming the passkey over another text), and
    picking an example, also the one named before, puts its text back."""
    from kvviz.tasks.examples import EXAMPLES

    page.get_by_role("tab", name="Live").click()
    examples = page.get_by_label("Examples").first
    page.get_by_label("Prompt").first.fill("A prompt of my own.")
    page.wait_for_function("e => e.value === ''", arg=examples.element_handle(), timeout=30_000)
    for name in ("Passkey in a haystack", "Short reasoning"):
        examples.click()
        page.get_by_role("option", name=name).click()
        page.wait_for_function("([e, text]) => e.value === text",
                               arg=[page.get_by_label("Prompt").first.element_handle(), EXAMPLES[name]],
                               timeout=30_000)
        assert examples.input_value() == name


def test_a_refused_comparison_keeps_its_message_on_screen(page):
    """What to change stays until closed: a toast that vanished after 10 s left only bare "Error" badges."""
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Prompt").nth(1).fill(PROMPT * 40)  # past this app's 2000-token limit
    page.get_by_role("button", name="Compare", exact=True).click()
    message = page.get_by_test_id("toast-text").filter(has_text="the limit here is 2000, shorten it")
    message.wait_for(timeout=30_000)
    time.sleep(12)
    assert message.is_visible()
    # Refused by the check before the run: only the toast says "Error", not a badge over every panel, and
    # the reason stays in the page where the comparison would have been.
    assert page.get_by_text("Error", exact=True).count() == 1
    assert page.get_by_text("Not compared: the prompt has").is_visible()
    # Fixing the input clears the reason (typed: the browser sends no input event for Playwright's fill).
    page.get_by_label("Prompt").nth(1).fill(PROMPT[:-1])
    page.get_by_label("Prompt").nth(1).press("End")
    page.get_by_label("Prompt").nth(1).type(PROMPT[-1])
    page.get_by_text("Not compared: the prompt has").wait_for(state="hidden", timeout=30_000)
    # The next click closes the refusal's toast: it would otherwise sit over a comparison that runs.
    page.get_by_role("button", name="Compare", exact=True).click()
    message.wait_for(state="hidden", timeout=30_000)
    page.locator("a[download='comparison.zip']").wait_for(timeout=120_000)  # and the comparison runs
    # and has ended: the fates table follows the run's completion, which re-sends its last output (a click
    # refused before that had its marks overwritten by it)
    page.get_by_text("Fate per policy", exact=True).wait_for(timeout=60_000)
    assert page.get_by_test_id("toast-text").count() == 0
    wait_until_settled(page)  # its last event is over too: a refusal clicked before it was overwritten by it
    # Refused now, the comparison that ran stays, marked as the previous one (not these inputs' results).
    page.get_by_label("Prompt").nth(1).fill(PROMPT * 40)
    page.get_by_role("button", name="Compare", exact=True).click()
    # (the fates table and the panels redraw first: on a machine loaded several times over that took > 30 s)
    page.get_by_text("Shown: the previous comparison (inertia, tova, streaming)").wait_for(timeout=120_000)
    page.get_by_label("inertia · previous comparison").wait_for(timeout=30_000)
    page.screenshot(path=ARTIFACTS / "compare_refused_after_a_comparison.png", full_page=True)
    # Passing but other inputs: the comparison is marked as made from earlier ones; its own, back, unmark it.
    page.get_by_label("Prompt").nth(1).fill(PROMPT + " More.")
    stale = page.get_by_text("Earlier inputs: the prompt changed since this comparison ran", exact=False)
    stale.wait_for(timeout=30_000)
    page.get_by_label("inertia · earlier inputs").wait_for(timeout=10_000)
    page.get_by_label("Prompt").nth(1).fill(PROMPT)
    stale.wait_for(state="hidden", timeout=30_000)
    page.get_by_label("inertia", exact=True).wait_for(timeout=10_000)
    # closed: the Live tab's refusal of the same prompt must show a toast of its own
    page.evaluate("() => document.querySelectorAll('button.toast-close.error').forEach(b => b.click())")
    message.wait_for(state="hidden", timeout=30_000)


def test_a_refused_run_leaves_the_views_and_shows_the_count(page):
    """Bad input is refused by the check: the toast, the prompt's token count beside it, no "Error" badges."""
    page.get_by_role("tab", name="Live").click()
    page.get_by_label("Prompt").first.fill(PROMPT * 40)  # past this app's 2000-token limit
    toasts = page.get_by_test_id("toast-text").filter(has_text="the limit here is 2000, shorten it")
    before = toasts.count()  # the Compare test's toast stays until closed: this run must add one of its own
    page.locator("#live-run").click()
    deadline = time.monotonic() + 30
    while toasts.count() <= before:
        assert time.monotonic() < deadline, "the Live tab's refusal never showed a toast"
        time.sleep(0.2)
    page.get_by_text("tokens: over the limit of 2000, shorten it").wait_for(timeout=30_000)
    assert page.get_by_text("Error", exact=True).count() <= 2  # a toast each: this one, maybe Compare's
    assert page.locator(".wrap .error").count() == 0  # no output panel marked


def test_a_parameter_typed_past_its_end_is_named_and_set_to_the_end(page):
    """A policy parameter typed past its slider's end: the note names the policy and parameter (not Gradio's
    bare "Value 999 is greater than maximum value 64"), the box reads the end, and no panel says "Error"."""
    page.get_by_role("tab", name="Live").click()
    page.get_by_label("Policy", exact=True).first.click()
    page.get_by_role("option", name="(inertia-lazy)", exact=False).first.click()
    page.get_by_text("Policy parameters").first.click()
    box = page.get_by_label("number input for refresh", exact=False).first
    box.wait_for()
    box.fill("999")
    box.press("Tab")  # leaving the box releases the slider
    note = page.get_by_test_id("toast-text").filter(
        has_text="inertia-lazy's refresh goes from 0 to 64: 999 was set to 64")
    note.first.wait_for(timeout=30_000)
    from playwright.sync_api import expect

    expect(box).to_have_value("64", timeout=30_000)  # the box's update may land after the note's
    assert page.locator(".wrap .error").count() == 0
    page.get_by_label("Policy", exact=True).first.click()
    page.get_by_role("option", name="(inertia)", exact=False).first.click()  # as the other tests expect


def test_an_emptied_slider_box_is_named_with_the_value_it_was_set_to(page):
    """Emptying Compression ρ's box: the browser sets it to the slider's lowest (0, the full cache), and a run
    would go ahead with that; the note says so, where nothing was said before."""
    page.get_by_role("tab", name="Live").click()
    box = page.get_by_label("number input for Compression ρ", exact=False).first
    before = box.input_value()
    box.fill("")
    box.press("Tab")
    note = page.get_by_test_id("toast-text").filter(
        has_text="Compression ρ was left empty: it was set to 0, its lowest; type the value you want")
    note.first.wait_for(timeout=30_000)
    assert box.input_value() == "0"
    box.fill(before)  # as the other tests expect
    box.press("Tab")
    assert box.input_value() == before


def test_the_scorer_spectrum_runs_at_the_middle_layer_when_layer_is_left_empty(page):
    """The Layer field starts empty and stays so in the browser (a Number widget would send 0): the run is
    at the middle layer, 1 of the tiny model's 3, and draws its bars."""
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Prompt").nth(1).fill(PROMPT)
    page.get_by_text("Scorer spectrum (InertiaKV §5.1)").click()
    assert page.get_by_label("Layer (empty: the middle one)").input_value() == ""
    page.get_by_role("button", name="Run spectrum").click()
    page.get_by_text("layer 1 of 0-2", exact=False).wait_for(timeout=60_000)
    page.wait_for_function("() => [...document.querySelectorAll('.js-plotly-plot .legendtext')]"
                           ".some(e => e.textContent === 'layer 1')", timeout=30_000)
    page.screenshot(path=ARTIFACTS / "compare-spectrum.png", full_page=False)
    assert titles_under_chips(page) == []


def test_a_spectrum_of_an_earlier_prompt_is_marked_until_the_prompt_is_back(page):
    """Run after the spectrum above: a new prompt leaves its bars up, marked on their labels and in the note
    as made from earlier inputs; the prompt it ran on, typed back, takes the marks off."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Compare").click()
    prompt = page.get_by_label("Prompt").nth(1)
    prompt.fill(PROMPT + " Another line.")
    # 60 s: on a machine loaded to several times its cores the mark once took over 30
    page.get_by_text("Earlier inputs: the prompt changed since this spectrum ran", exact=False).wait_for(timeout=60_000)
    expect(page.get_by_text("Scorer spectrum (earlier inputs)", exact=True)).to_have_count(1)  # the plot's label
    prompt.fill(PROMPT)
    page.get_by_text("Earlier inputs: the prompt changed since this spectrum ran", exact=False).wait_for(
        state="hidden", timeout=60_000)
    expect(page.get_by_text("Scorer spectrum (earlier inputs)", exact=True)).to_have_count(0)


def test_a_typed_setting_compares_one_policy_at_two_values(page):
    """The Policies box takes a typed setting: Enter adds it beside the picked names, and its run gets a
    panel of its own, labelled by what it changes."""
    from playwright.sync_api import expect

    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Prompt").nth(1).fill(PROMPT)
    policies = page.get_by_label("Policies (2 to 4)", exact=False)
    policies.click()
    policies.fill("inertia alpha=0.3")
    policies.press("Enter")
    page.keyboard.press("Escape")  # close the list of choices
    # edited by hand: the preset box no longer names a comparison the list has stopped being
    expect(page.get_by_label("Comparisons from the papers")).to_have_value("", timeout=30_000)
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_label("inertia alpha=0.3", exact=True).wait_for(timeout=60_000)
    # its divergence line (the Jaccard legend names the pair too: the list item, not "the" text)
    page.locator("li").filter(has_text="inertia alpha=0.3 vs inertia").first.wait_for(timeout=60_000)
    page.locator("a[download='comparison.zip']").wait_for(timeout=60_000)  # every run's trace, to download
    page.screenshot(path=ARTIFACTS / "compare-settings.png", full_page=True)
    assert titles_under_chips(page) == []
    # A comparison from the papers fills the box with its settings.
    page.get_by_label("Comparisons from the papers").click()
    page.get_by_role("option", name="EMA strength α", exact=False).click()
    page.get_by_text("inertia alpha=0.95", exact=True).wait_for(timeout=10_000)
    # four chips, the box's limit: a line says why a fifth will not go in, which the box would drop unsaid
    expect(page.get_by_text("Four chosen, the most", exact=False)).to_be_visible(timeout=10_000)
    # a typed setting the registry refuses is said as it is entered, not at the next Compare (three chips:
    # a fifth would be dropped by the box's limit of four)
    page.get_by_label("Comparisons from the papers").click()
    page.get_by_role("option", name="Full refresh, Lazy", exact=False).click()
    page.get_by_text("Score-Free (score-free)", exact=True).wait_for(timeout=10_000)
    expect(page.get_by_text("Four chosen, the most", exact=False)).to_be_hidden(timeout=10_000)
    policies.click()
    policies.fill("inertia alpha=2")
    policies.press("Enter")
    page.keyboard.press("Escape")
    page.get_by_test_id("toast-text").filter(has_text="alpha must be between 0.0 and 1.0, got '2' (in the Policies "
                                             "box").wait_for(timeout=30_000)
    # Compare then: the refusal says it once, the warning given at the entry gone with the click
    page.get_by_role("button", name="Compare", exact=True).click()
    page.get_by_test_id("toast-text").filter(has_text="(in the Policies box").wait_for(state="hidden", timeout=10_000)
    refusals = page.get_by_test_id("toast-text").filter(has_text="alpha must be between 0.0 and 1.0, got '2'")
    expect(refusals).to_have_count(1, timeout=30_000)


def test_a_stopped_comparison_shows_and_zips_what_ran(page):
    """Stop in the Compare tab: the runs so far, cut to the steps all of them made, their divergence lines,
    the zip of their traces and the fates, as a comparison that had ended there."""
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Prompt").nth(1).fill(PROMPT)
    max_new = page.get_by_label("Max new tokens", exact=False).locator("xpath=..").locator("input[type=number]")
    max_new.nth(1).fill("3000")
    max_new.nth(1).press("Enter")
    page.get_by_label("Comparisons from the papers").click()
    page.get_by_role("option", name="InertiaKV against TOVA", exact=False).click()
    page.get_by_text("StreamingLLM (streaming)", exact=True).wait_for(timeout=10_000)
    panel = page.get_by_label("inertia", exact=True)
    earlier = panel.input_value() if panel.count() else ""  # the last comparison's text, still up
    page.get_by_role("button", name="Compare", exact=True).click()
    # A few of its steps before Stop: stopped at its first token (the prefill's, on a loaded CI machine), no
    # step had evicted anything, so no prompt token was disputed and the fates table rightly stayed hidden.
    deadline = time.time() + 120
    while time.time() < deadline:
        text = panel.input_value() if panel.count() else ""
        if text != earlier and len(text) >= 20:
            break
        time.sleep(0.2)
    page.evaluate("document.querySelector('#compare-stop').click()")  # as the Live tab's Stop test does
    page.get_by_text("stopped after", exact=False).wait_for(timeout=120_000)  # a loaded machine: slower
    page.locator("a[download='comparison.zip']").wait_for(timeout=30_000)
    page.get_by_label("Fate per policy").first.wait_for(timeout=120_000)  # redraws the panels: slower when loaded
    wait_until_settled(page)  # nothing may land over it
    assert page.get_by_text("stopped after", exact=False).is_visible()
    page.screenshot(path=ARTIFACTS / "compare-stopped.png", full_page=True)


def test_compare_right_after_stop_compares_once_the_stopped_comparison_has_shown_itself(page, monkeypatch):
    """The Compare tab's Stop, then Compare while the stopped comparison still shows itself (held open here
    until the click has come): the click is not dropped, and its comparison runs to its end."""
    from kvviz.ui import compare, tickets

    clicked, before = [], set()
    monkeypatch.setattr(compare, "comparison_result", held_open(compare.comparison_result, clicked, before))
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Prompt").nth(1).fill(PROMPT)
    max_new = page.get_by_label("Max new tokens", exact=False).locator("xpath=..").locator("input[type=number]")
    max_new.nth(1).fill("3000")
    max_new.nth(1).press("Enter")
    page.get_by_label("Chat template").nth(1).uncheck()
    page.get_by_role("button", name="Compare", exact=True).click()

    def decoding():
        return [ticket for ticket in tickets._tickets.values() if ticket.claimed and not ticket.done]

    deadline = time.time() + 60
    while not decoding() and time.time() < deadline:  # checked, out of the queue and decoding
        time.sleep(0.1)
    time.sleep(1.0)
    max_new.nth(1).fill("9", force=True)  # for the next comparison
    page.evaluate("document.querySelector('#compare-stop').click()")
    deadline = time.time() + 10
    while not all(ticket.is_set() for ticket in tickets._tickets.values()) and time.time() < deadline:
        time.sleep(0.05)  # Stop has reached the server
    before.update(tickets._tickets)
    page.evaluate("document.querySelector('#compare-run').click()")  # a DOM click: no waiting for the page
    # the stopped one, shown (a loaded machine: slower)
    page.get_by_text("stopped after", exact=False).wait_for(timeout=120_000)
    page.get_by_text("stopped after", exact=False).wait_for(state="hidden", timeout=60_000)  # the next one's
    # The comparison ran to its end with the inputs of its click: InertiaKV's panel holds its 9 tokens (the
    # Compare tab's default compression is 0.75), and its zip is offered.  Waited for: on a loaded machine the
    # page can sit between the two comparisons' updates (the last one's zip still in the page, hidden).
    from playwright.sync_api import expect

    import kvviz

    model, tokenizer = kvviz.load_model(TINY)
    run = kvviz.run(model, tokenizer, PROMPT, "inertia", chat=False, compression=0.75, max_new_tokens=9)
    expected = "".join(event.text for event in run.trace.events).replace("\r\n", "\n").replace("\r", "\n")
    expect(page.get_by_label("inertia", exact=True)).to_have_value(expected, timeout=60_000)
    page.locator("a[download='comparison.zip']").wait_for(state="visible", timeout=60_000)
    page.wait_for_function("() => !document.querySelector('.generating')", timeout=60_000)
    expect(page.get_by_text("stopped after", exact=False)).to_have_count(0)
    assert clicked[0]  # the click had come while the stopped comparison showed itself


def test_results_figures_keep_their_titles_notes_and_panel_titles_apart_at_900_px(page, tmp_path):
    """Drawn by Plotly in Chromium at 900 px, as a narrow window shows the Results tab: each figure's title
    and notes end above its first panel title, no two panel titles overlap, and nothing runs past the figure's
    edges (seven notes reached the first panel titles; three models' names in a panel title ran off the left;
    one-line panel titles ran into each other)."""
    from kvviz.store import Store
    from kvviz.ui.results import ALL, SECTIONS, query

    figures = dict(zip(SECTIONS, query(Store(), ALL, ALL, [], ALL)[0::3]))
    # a page of its own beside the app's, which the other tests go on using
    page = page.context.browser.new_page(viewport={"width": 900, "height": 800})
    try:
        for section in ("Quality vs compression", "Paired differences", "Measured vs paper", "Refresh interval",
                        "Damage ranking (AvoKV-E Table 3)"):
            path = tmp_path / "figure.html"
            figures[section].update_layout(width=900).write_html(path, include_plotlyjs=True)
            page.goto(path.as_uri())
            page.wait_for_selector(".gtitle")
            boxes = page.evaluate("""() => {
                const box = e => { const r = e.getBoundingClientRect();
                                   return {left: r.left, right: r.right, top: r.top, bottom: r.bottom}; };
                return {title: box(document.querySelector('.gtitle')),
                        panels: [...document.querySelectorAll('.annotation')].map(box)}; }""")
            title, panels = boxes["title"], boxes["panels"]
            assert panels, section
            assert title["bottom"] < min(p["top"] for p in panels), section
            assert title["left"] >= 0 and title["right"] <= 900, section
            for panel in panels:
                assert panel["left"] >= 0 and panel["right"] <= 900, section
            for i, first in enumerate(panels):
                for second in panels[i + 1:]:
                    apart = (first["right"] <= second["left"] or second["right"] <= first["left"]
                             or first["bottom"] <= second["top"] or second["bottom"] <= first["top"])
                    assert apart, (section, first, second)
    finally:
        page.close()


def test_a_long_chosen_preset_ends_in_an_ellipsis_before_the_dropdown_arrow(page, app_url):
    """At 1400 px the Compare tab's presets sit in a 260-px box beside the views: a chosen name ran under the
    box's arrow, cut mid-word.  Its text now stops short of the arrow and ends in an ellipsis."""
    wide = page.context.browser.new_page(viewport={"width": 1400, "height": 900})
    try:
        wide.goto(app_url)
        wide.get_by_role("tab", name="Compare").click()
        box = wide.get_by_label("Comparisons from the papers")
        box.wait_for()
        drawn = box.evaluate("""e => { const s = getComputedStyle(e), r = e.getBoundingClientRect();
            const arrow = e.closest('.wrap-inner').querySelector('.icon-wrap').getBoundingClientRect();
            return {overflow: s.textOverflow, textRight: r.right - parseFloat(s.paddingRight),
                    arrowLeft: arrow.left, cut: e.scrollWidth > e.clientWidth}; }""")
        assert drawn["cut"]  # the name is longer than its box at this width
        assert drawn["overflow"] == "ellipsis" and drawn["textRight"] <= drawn["arrowLeft"], drawn
    finally:
        wide.close()


def test_a_narrow_window_puts_the_views_below_the_settings_at_the_page_width(page, app_url):
    """At 900 px each tab's views go below its settings, at nearly the page's width (beside them they had
    ~370 px: the tables broke numbers mid-digit); at 1400 px they sit beside the settings."""
    def boxes(tab_page, tab: str) -> tuple[dict, dict]:
        tab_page.get_by_role("tab", name=tab).click()
        return (tab_page.locator(f"#{tab.lower()}-run").bounding_box(),
                tab_page.locator(f"#{tab.lower()}-views").bounding_box())

    for run, views in (boxes(page, "Live"), boxes(page, "Compare")):
        assert views["x"] >= run["x"] + run["width"]  # beside
    narrow_page = page.context.browser.new_page(viewport={"width": 900, "height": 800})
    try:
        narrow_page.goto(app_url)
        narrow_page.get_by_role("tab", name="Live").wait_for()
        for tab in ("Live", "Compare"):
            run, views = boxes(narrow_page, tab)
            assert views["y"] >= run["y"] + run["height"], tab  # below
            assert views["width"] >= 600, tab
    finally:
        narrow_page.close()


def test_an_avokv_preset_note_says_what_a_hand_edit_changed_and_returns_when_set_back(page):
    """An AvoKV-E preset sizes B to the prompt and says so; a budget typed by hand turns the note into what
    changed against the preset's, and the preset's value typed back restores its note."""
    page.get_by_role("tab", name="Compare").click()
    page.get_by_label("Comparisons from the papers").click()
    page.get_by_role("option", name="AvoKV-E without payload", exact=False).click()
    regime = page.get_by_text("Set to AvoKV-E's regime: budget B = ", exact=False)
    regime.wait_for(timeout=30_000)
    preset_budget = re.search(r"budget B = (\d+)", regime.inner_text()).group(1)
    budget = page.get_by_label("Budget B (tokens)").filter(visible=True)  # the Live tab's is hidden
    budget.fill("100")
    budget.press("Tab")
    page.get_by_text(f"B = 100 (the preset's {preset_budget})", exact=False).wait_for(timeout=30_000)
    assert not regime.is_visible()
    budget.fill(preset_budget)
    budget.press("Tab")
    regime.wait_for(timeout=30_000)
    # back to the tab's own regime, as the tests before this one left it
    page.get_by_label("Comparisons from the papers").click()
    page.get_by_role("option", name="InertiaKV against TOVA", exact=False).click()
    page.get_by_text("Back to the prompt-compression regime", exact=False).wait_for(timeout=30_000)


def test_the_first_view_shows_a_finished_comparison_and_its_answers_without_a_click(page, app_url):
    """A first-time visitor sees, before touching anything, what eviction did to one answer."""
    from kvviz.ui.landing import load_landing

    landing = load_landing()
    # a new visit (the module's page has moved on to the Live tab)
    visit = page.context.browser.new_context(viewport={"width": 1400, "height": 1100})
    fresh = visit.new_page()
    try:
        fresh.goto(app_url)
        summary = fresh.locator("#landing-summary")
        summary.wait_for(timeout=60_000)
        assert fresh.get_by_role("tab", name="Start here").get_attribute("aria-selected") == "true"
        for label in landing.traces:
            assert fresh.get_by_label(f"{landing.display(label)} answered").input_value() == landing.answer(label)
            assert landing.display(label) in summary.inner_text()
        assert "right" in summary.inner_text() and "wrong" in summary.inner_text()
        fresh.locator("#start-here .js-plotly-plot").first.wait_for(timeout=60_000)  # the heatmaps drew
        assert fresh.locator("#start-here .js-plotly-plot").count() == len(landing.traces)
        fresh.screenshot(path=str(ARTIFACTS / "start-here.png"))
    finally:
        visit.close()
