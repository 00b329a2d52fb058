"""The Analyses tab's figures: AvoKV-E's blindspot grid and InertiaKV's correlation spectrum."""

from __future__ import annotations

import textwrap

import numpy as np
import plotly.graph_objects as go

from .plots import CHIP_HEIGHT, SMALL_LINE, TITLE_12_CHARS, TITLE_GAP


def blindspot_figure(spot) -> go.Figure:
    """AvoKV-E Fig. 1(a) from a :class:`kvviz.probe.Blindspot`: the high-damage share per (read-pressure rank,
    payload rank) bin, each cell labelled high-damage / entries, the blindspot cell outlined."""
    bins = spot.grid_entries.shape[0]
    edges = [f"{i / bins:.1f}–{(i + 1) / bins:.1f}" for i in range(bins)]
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.where(spot.grid_entries > 0, spot.grid_high / spot.grid_entries, np.nan)
    labels = [[f"{spot.grid_high[r, c]}/{spot.grid_entries[r, c]}" for c in range(bins)] for r in range(bins)]
    fig = go.Figure(go.Heatmap(
        z=share, x=edges, y=edges, text=labels, texttemplate="%{text}", colorscale="Reds", zmin=0, zmax=0.5,
        colorbar=dict(title="high-damage<br>share"),
        hovertemplate="N(p) %{x}<br>N(b) %{y}<br>high-damage %{text} (%{z:.0%})<extra></extra>"))
    # N(p) <= 0.2, N(b) >= 0.8: the first column, top row
    fig.add_shape(type="rect", x0=-0.5, x1=0.5, y0=bins - 1.5, y1=bins - 0.5, line=dict(color="#1f3b73", width=3))
    # The test's line, broken to fit the plot, under the plot's label chip
    lines = textwrap.wrap("Blindspot: " + spot.summary().replace("<=", "≤").replace(">=", "≥"), TITLE_12_CHARS)
    top = CHIP_HEIGHT + SMALL_LINE * len(lines) + TITLE_GAP
    fig.update_layout(
        title=dict(text="<br>".join(lines), font=dict(size=12), yref="container", y=1, yanchor="top",
                   pad_t=CHIP_HEIGHT),
        xaxis_title="read-pressure rank N(p) (AvoKV-E)", yaxis_title="payload rank N(b)", height=330 + top,
        margin=dict(l=60, r=20, t=top, b=50))
    return fig


def spectrum_figure(spectrum) -> go.Figure:
    """InertiaKV §5.1's correlation spectrum from a :class:`kvviz.spectrum.Spectrum`: each scorer's mean
    Spearman with attention, at the chosen layer and through the InertiaKV utility, as grouped bars."""
    rows = spectrum.table()
    names = [row["scorer"] for row in rows]
    fig = go.Figure()
    for key, label, color in (("layer_spearman", f"layer {spectrum.layer}", "#7a9cc6"),
                              ("utility_spearman", "InertiaKV utility (EMA over layers)", "#1f3b73")):
        jaccard = key.replace("spearman", "jaccard")
        fig.add_bar(x=names, y=[row[key] for row in rows], name=label, marker_color=color,
                    customdata=[row[jaccard] for row in rows],
                    hovertemplate="%{x}<br>Spearman %{y:.3f}<br>top-B Jaccard %{customdata:.3f}"
                                  "<extra>" + label + "</extra>")
    fig.update_layout(barmode="group", yaxis=dict(title="Spearman with attention", range=[-1, 1.05]), height=340,
                      title=dict(text=f"Scorers against last-query attention, steps 1–{spectrum.steps[-1]}",
                                 font=dict(size=12)),
                      legend=dict(orientation="h", y=-0.2), margin=dict(l=60, r=20, t=50, b=40))
    return fig


def spectrum_layers_figure(spectrum) -> go.Figure:
    """Each scorer's Spearman with attention at every layer (mean over steps): where on the spectrum a
    scorer sits depends on the layer, and the paper reports one (15).  The compared layer is outlined."""
    profile = spectrum.layer_profile()
    names = list(profile)
    z = np.array([profile[name] for name in names])
    fig = go.Figure(go.Heatmap(
        z=z, x=list(range(spectrum.num_layers)), y=names, colorscale="RdBu", zmid=0, zmin=-1, zmax=1,
        colorbar=dict(title="Spearman"), hovertemplate="%{y} at layer %{x}<br>Spearman %{z:.3f}<extra></extra>"))
    fig.add_shape(type="rect", x0=spectrum.layer - 0.5, x1=spectrum.layer + 0.5, y0=-0.5, y1=len(names) - 0.5,
                  line=dict(color="#222", width=2))
    fig.update_layout(title=dict(text="Spearman with attention at each layer (mean over steps)", font=dict(size=12)),
                      xaxis=dict(title="layer (from 0)", dtick=1 if spectrum.num_layers <= 40 else None),  # no 0.5
                      yaxis=dict(autorange="reversed"),  # the bar chart's order, top down
                      height=300, margin=dict(l=80, r=20, t=50, b=40))
    return fig
