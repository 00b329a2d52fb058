"""What a Results-tab filter change costs, drawn afresh and asked for again (the tab keeps each combination's
figures: the store does not change while the app runs).

Builds the tab over the shipped results_db, then for a few filter combinations times the tab's own handler
twice. The first call draws every section (store queries, paired bootstrap, Plotly), sending the sections open
at load as soon as they are drawn (``open_s``: what a reader waits for) and the rest with its last update
(``first_s``; ``open_vs_first`` their ratio); the second returns what the first drew (its figures already in
the JSON Gradio sends). Gradio still converts the tables and CSV downloads on every request
(``postprocess_s``, timed once). One JSON line per combination, times in seconds, and a repeated request's
time (handler plus postprocess) as a share of the first's.

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/results_filters.py [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from datetime import datetime, timezone

import gradio as gr

from kvviz.store import Store
from kvviz.ui.results import ALL, build_results_tab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the JSON lines here")
    args = parser.parse_args()
    with gr.Blocks() as app, gr.Tab("Results") as tab:
        build_results_tab(tab, Store())
    function = next(fn for fn in app.fns.values() if fn.api_name == "results")
    defaults = [block.value for block in function.inputs]
    changes = {"defaults (the tab opened)": {}, "source: all": {3: ALL}, "source: paper": {3: "paper"},
               "task: single_needle": {1: "single_needle"}, "policies: inertia, tova": {2: ["inertia", "tova"]},
               "every setting": {6: True}}
    lines = [{"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": platform.machine(),
              "cpus": os.cpu_count(), "python": platform.python_version(), "gradio": gr.__version__}]
    for name, change in changes.items():
        values = [change.get(index, value) for index, value in enumerate(defaults)]
        times, opened = [], None
        for _ in range(2):
            start = time.perf_counter()
            for update in function.fn(*values):  # the open sections (a new combination), then everything
                opened = opened or time.perf_counter() - start
                out = update  # the last one is everything
            times.append(time.perf_counter() - start)
        # what Gradio still does on every request, drawn or not: turn each figure and table into JSON
        start = time.perf_counter()
        for block, value in zip(function.outputs, out):
            block.postprocess(value.get("value") if isinstance(value, dict) else value)  # an update: its value
        sent = time.perf_counter() - start
        lines.append({"filters": name, "open_s": round(opened, 3), "first_s": round(times[0], 3),
                      "open_vs_first": round(opened / times[0], 3), "again_s": round(times[1], 6),
                      "postprocess_s": round(sent, 3), "first_request_s": round(times[0] + sent, 3),
                      "again_request_s": round(times[1] + sent, 3),
                      "again_vs_first_request": round((times[1] + sent) / (times[0] + sent), 4)})
    for line in lines:
        print(json.dumps(line))
    if args.out:
        with open(args.out, "w") as file:
            file.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
