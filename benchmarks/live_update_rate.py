"""How often the Live tab refreshes its figures, and how big they are, on the default model.

Drives the Live tab's handler directly (no browser) on the passkey example doubled (~2.5k tokens) with
InertiaKV at 90% compression for 64 tokens, and prints one JSON line: retention-heatmap updates per second
(the rank heatmap and per-step plot follow every half second) and the
largest figure payload in bytes (the issue's targets: >= 5 updates/s, <= 300 KB).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/live_update_rate.py
"""

from __future__ import annotations

import json
import time

import gradio as gr

from kvviz.tasks.examples import EXAMPLES
from kvviz.ui import live
from kvviz.ui.checks import PARAM_NAMES, PARAMETERS
from kvviz.ui.config import Limits


def main() -> None:
    with gr.Blocks():
        tab = live.layout(Limits())
    handler = live.make_live_handler(Limits(), tab)
    widgets = [PARAMETERS[name]["default"] for name in PARAM_NAMES]
    prompt = EXAMPLES["Passkey in a haystack"] * 2
    stamps, sizes, yields = [], [], 0
    greedy = (0.0, 1.0, 0)  # temperature, top-p, seed
    # "" and None: no click's ticket id nor session tickets, as an API call
    for out in handler("SmolLM2-135M-Instruct", prompt, "inertia", "compression", 0.9, 256, 64, True, *greedy,
                       *widgets, "", None):
        yields += 1
        figures = [out.get(plot) for plot in (tab.retention, tab.ranks, tab.timeline)] if isinstance(out, dict) else []
        if figures and figures[0] is not None and not isinstance(figures[0], dict):  # a figure, not a clear
            stamps.append(time.perf_counter())
            sizes.append(max(len(figure.to_json()) for figure in figures
                             if figure is not None and not isinstance(figure, dict)))  # updates are dicts
    span = stamps[-1] - stamps[1]  # from the first decode step's update to the last
    print(json.dumps({"yields": yields, "figure_updates": len(stamps),
                      "figure_updates_per_s": round((len(stamps) - 2) / span, 2), "max_figure_bytes": max(sizes)}))


if __name__ == "__main__":
    main()
