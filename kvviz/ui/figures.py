"""Plotly figures built from step events (no Gradio here, so they can be tested and reused)."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

from ..trace import StepEvent

NOT_YET, EVICTED, KEPT = np.nan, 0.0, 1.0


def retention_matrix(events: list[StepEvent], prompt_len: int) -> np.ndarray:
    """Rows: steps (0 = after prefill); columns: absolute positions; 1 kept, 0 evicted, NaN not yet generated."""
    total = prompt_len + len(events)
    grid = np.full((len(events), total), NOT_YET, dtype=np.float32)
    for row, event in enumerate(events):
        grid[row, : prompt_len + event.step] = EVICTED
        grid[row, event.kept] = KEPT
    return grid


def utility_rank_matrix(events: list[StepEvent], prompt_len: int) -> np.ndarray | None:
    """Each kept position's rank by the policy's utility at each step (0 = most useful); NaN elsewhere."""
    if not events or all(e.utility is None for e in events):
        return None
    grid = np.full((len(events), prompt_len + len(events)), np.nan, dtype=np.float32)
    for row, event in enumerate(events):
        if event.utility is not None and event.kept.size:
            order = np.argsort(-event.utility, kind="stable")
            ranks = np.empty_like(order)
            ranks[order] = np.arange(order.size)
            grid[row, event.kept] = ranks
    return grid


def heatmap(grid: np.ndarray, title: str, colorscale, zmin=None, zmax=None, colorbar_title="") -> go.Figure:
    fig = go.Figure(go.Heatmap(z=grid, colorscale=colorscale, zmin=zmin, zmax=zmax, hoverongaps=False,
                               colorbar=dict(title=colorbar_title),
                               hovertemplate="position %{x}<br>step %{y}<br>value %{z}<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="absolute position", yaxis_title="decode step",
                      margin=dict(l=50, r=20, t=40, b=40), height=360)
    return fig


def retention_figure(events: list[StepEvent], prompt_len: int, budget: int) -> go.Figure:
    grid = retention_matrix(events, prompt_len)
    fig = heatmap(grid, f"Retention (budget {budget}; dark = kept, pale = evicted, blank = not yet generated)",
                  [[0, "#f3d9c4"], [1, "#1f3b73"]], 0, 1)
    fig.update_traces(showscale=False)
    fig.add_vline(x=prompt_len - 0.5, line_dash="dot", line_color="#888")
    return fig


def rank_figure(events: list[StepEvent], prompt_len: int) -> go.Figure | None:
    grid = utility_rank_matrix(events, prompt_len)
    if grid is None:
        return None
    return heatmap(grid, "Utility rank of kept tokens (0 = most useful)", "Viridis_r", colorbar_title="rank")
