"""The Results tab: Plotly figures over the DuckDB store, with filters and CSV export of each table.

Measured and paper-reported rows are never mixed silently: each line is labelled with its source and
paper rows are drawn dashed.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gradio as gr
import pandas as pd
import plotly.graph_objects as go

from ..store import Store

ALL = "(all)"


def _line_figure(frame: pd.DataFrame, x: str, y: str, title: str, xlabel: str, ylabel: str) -> go.Figure:
    fig = go.Figure()
    if frame.empty:
        fig.add_annotation(text="no rows for these filters", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    group_cols = [c for c in ("source", "model", "task", "policy", "compression") if c in frame and c not in (x,)]
    for keys, part in frame.groupby(group_cols, dropna=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        label = " · ".join(str(k) for k in keys)
        dash = "dash" if "source" in group_cols and keys[group_cols.index("source")] == "paper" else "solid"
        xs, ys = part[x], part[y]
        if x == "compression" and "policy" in group_cols and keys[group_cols.index("policy")] == "full" \
                and len(part) == 1 and frame[x].notna().any():
            # The full cache does not depend on the compression: draw it as a reference across the range.
            xs, ys, dash = [frame[x].min(), frame[x].max()], [ys.iloc[0]] * 2, "dot"
        fig.add_scatter(x=xs, y=ys, name=label, mode="lines+markers", line=dict(dash=dash))
    fig.update_layout(title=title, xaxis_title=xlabel, yaxis_title=ylabel, height=380,
                      margin=dict(l=50, r=20, t=40, b=40), legend=dict(font=dict(size=10)))
    return fig


def _grid_figure(frame: pd.DataFrame) -> go.Figure:
    fig = go.Figure()
    if frame.empty:
        fig.add_annotation(text="no needle-grid rows", showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
        return fig
    first = frame[(frame.policy == frame.policy.iloc[0]) & (frame.compression == frame.compression.iloc[0])]
    pivot = first.pivot_table(index="depth", columns="length", values="score")
    fig.add_heatmap(z=pivot.values, x=[str(c) for c in pivot.columns], y=[f"{d:.0%}" for d in pivot.index],
                    colorscale="RdYlGn", zmin=0, zmax=1)
    fig.update_layout(title=f"Needle grid: {first.policy.iloc[0]} at rho={first.compression.iloc[0]} (ROUGE-L F)",
                      xaxis_title="context length", yaxis_title="needle depth", height=380)
    return fig


def _csv(frame: pd.DataFrame, name: str) -> str:
    path = Path(tempfile.mkdtemp(prefix="kvviz-")) / f"{name}.csv"
    frame.to_csv(path, index=False)
    return str(path)


def query(store: Store, model: str, task: str, policies: list[str], source: str):
    model = None if model in (None, ALL) else model
    task = None if task in (None, ALL) else task
    source = None if source in (None, ALL) else source
    policies = policies or None
    quality = store.quality_vs_compression(task, model, policies, source)
    alpha = store.alpha_sensitivity(task, model, source)
    refresh = store.refresh_curve(task, model, source)
    grid = store.needle_grid(model, policies, source)
    return (
        _line_figure(quality, "compression", "score", "Quality vs compression", "compression ρ", "mean score"),
        quality, gr.update(value=_csv(quality, "quality_vs_compression")),
        _line_figure(alpha, "alpha", "score", "α sensitivity (InertiaKV)", "α", "mean score"),
        alpha, gr.update(value=_csv(alpha, "alpha_sensitivity")),
        _line_figure(refresh, "refresh", "score", "Refresh interval (0 = score-free)", "r", "mean score"),
        refresh, gr.update(value=_csv(refresh, "refresh_curve")),
        _grid_figure(grid),
    )


def build_results_tab(app: gr.Blocks, store: Store | None = None) -> None:
    """Lay out the tab inside the current Blocks context; figures render on load and on every filter change."""
    store = store or Store()
    if store.problems:
        gr.Markdown("**Some results could not be read:** " + "; ".join(store.problems))
    if not store.shards:
        gr.Markdown("No sweep results are stored yet (`results_db/` is empty). Run `kvviz bench run CONFIG` to add some.")
        return
    with gr.Row():
        model = gr.Dropdown([ALL, *store.options("model")], value=ALL, label="Model")
        task = gr.Dropdown([ALL, *store.options("task")], value=ALL, label="Task")
        policies = gr.Dropdown(store.options("policy"), value=[], multiselect=True, label="Policies (none = all)")
        source = gr.Radio([ALL, "measured", "paper"], value=ALL, label="Source")
    outputs = []
    for title in ("Quality vs compression", "α sensitivity", "Refresh interval"):
        with gr.Accordion(title, open=title == "Quality vs compression"):
            plot = gr.Plot()
            table = gr.Dataframe(interactive=False)
            csv = gr.DownloadButton("Download CSV")
            outputs += [plot, table, csv]
    with gr.Accordion("Needle in a haystack grid", open=False):
        outputs.append(gr.Plot())
    filters = [model, task, policies, source]

    def handler(model_value, task_value, policy_values, source_value):
        return query(store, model_value, task_value, policy_values, source_value)

    gr.on([app.load, *(widget.change for widget in filters)], handler, filters, outputs, api_name="results",
          api_visibility="undocumented")
