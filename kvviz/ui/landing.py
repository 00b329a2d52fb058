"""The app's first view: a finished comparison read from shipped traces, so that a visitor sees what eviction
did to an answer before loading any model.  ``assets/landing.py`` makes the traces on the default model."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import numpy as np

from ..policies import REGISTRY
from ..trace import Trace
from .compare_views import compare_panels
from .figures import RunView

FOLDER = Path(__file__).resolve().parents[2] / "assets" / "landing"


@dataclass
class Landing:
    """One prompt under a few policies at one compression, with the needle the question asks for."""

    prompt: str
    needle: str
    compression: float
    model: str
    full_answer: str  # the full cache's answer: what a policy should still give
    tokens: list[str]  # the prompt's token texts (no tokenizer is loaded to show them)
    traces: dict[str, Trace]

    @functools.cached_property
    def views(self) -> dict[str, RunView]:
        views = {}
        for label, trace in self.traces.items():
            view = RunView(trace.prompt_len, len(trace.events), trace.budget, self.tokens)
            for event in trace.events:
                view.add(event, event.text)
            views[label] = view
        return views

    @functools.cached_property
    def needle_positions(self) -> list[int]:
        """The prompt positions of every token of the needle's occurrences."""
        first = next(iter(self.views.values()))
        return first.follow(self.needle, 0, prompt_only=True)[0]

    @staticmethod
    def display(label: str) -> str:
        return REGISTRY[label].display if label in REGISTRY else label

    def answer(self, label: str) -> str:
        return "".join(event.text for event in self.traces[label].events).strip()

    def copies(self) -> list[list[int]]:
        """The needle's occurrences in the prompt, each its run of consecutive positions."""
        runs: list[list[int]] = []
        for position in self.needle_positions:
            if runs and position == runs[-1][-1] + 1:
                runs[-1].append(position)
            else:
                runs.append([position])
        return runs

    def kept_at_end(self, label: str) -> int:
        """How many of the needle's tokens the policy still holds after its last step."""
        return int(np.isin(self.needle_positions, self.traces[label].events[-1].kept).sum())

    def summary(self) -> str:
        """One line per policy on what it kept of the needle and what it answered, then how to read the
        heatmaps."""
        tokens, copies = len(self.needle_positions), len(self.copies())
        lines = [f"**One passkey question, {len(self.traces)} policies, each left {1 - self.compression:.0%} of the "
                 f"prompt's cache** ({self.model}; with the full cache it answers `{self.full_answer}`). The passkey "
                 f"{self.needle} is written {copies} times, {tokens} tokens in all:"]
        for label in self.traces:
            kept = self.kept_at_end(label)
            answer = self.answer(label)
            lines.append(f"- **{self.display(label)}** kept {kept} of them and answered `{answer}`: "
                         f"{'right' if self.needle in answer else 'wrong'}.")
        lines.append("\nBelow, in each heatmap a row is a decode step and a column a cached position (dark: kept, "
                     "pale: evicted); the red columns are the passkey. An answer is only as good as what the "
                     "policy kept of them.")
        return "\n".join(lines)


def load_landing(folder: Path = FOLDER) -> Landing | None:
    """The shipped comparison, or None where its files are missing (the app then opens on the Live tab)."""
    manifest_path = folder / "landing.json"
    if not manifest_path.exists():
        return None
    manifest = json.loads(manifest_path.read_text())
    traces = {label: Trace.load(folder / name) for label, name in manifest["traces"].items()}
    return Landing(manifest["prompt"], manifest["needle"], manifest["compression"], manifest["model"],
                   manifest["full_answer"], manifest["tokens"], traces)


def layout(landing: Landing) -> None:
    """The Start-here tab: the shipped comparison's sentence, and each policy's answer over its heatmap with
    the needle's columns in red."""
    gr.Markdown(landing.summary(), elem_id="landing-summary")
    panels = compare_panels(landing.views, followed=landing.needle_positions)
    with gr.Row():
        for label, panel in zip(landing.traces, panels):
            with gr.Column(min_width=300):
                gr.Textbox(landing.answer(label), label=f"{landing.display(label)} answered", interactive=False,
                           elem_classes=["landing-answer"])
                gr.Plot(panel, show_label=False)
    gr.Markdown("Run it yourself: the Live tab starts on this prompt with InertiaKV, and the Compare tab runs "
                "any policies side by side.")
