"""The Results tab: Plotly figures over the DuckDB store, with filters and CSV export of each table.

Measured and paper-reported rows are never mixed silently: they sit in separate panels named by their
source (small multiples, a panel per source / model / task), paper rows are drawn dashed, and the
measured-vs-paper figure puts them side by side on a common scale (quality relative to each source's own
full cache).  A policy has the same colour in every panel and every figure (:class:`Colours`): each policy at
its defaults a clearly different one, each other setting of it a shade of its hue with a marker of its own.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import tempfile
import textwrap
import threading
from collections import OrderedDict
from pathlib import Path

import gradio as gr
import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.colors import qualitative
from plotly.subplots import make_subplots

from ..policies import REGISTRY
from ..stats import paired_table
from ..held import quality_vs_depth
from ..store import NOT_RANKED, RANKED_FLOOR
from ..store import (FULL_CACHE_FLOOR, QUALITY_METRICS, Store, held_over_note, ranking_caveats, setting_names,
                     suite_notes)
from .checks import refused

log = logging.getLogger(__name__)

ALL = "(all)"
# Not D3 after Plotly: its first hues repeat Plotly's (blue, orange, green, red, purple, pink); nor the
# Dark24 hues closest to Plotly's (pink, red, violet, orange).
PALETTE = qualitative.Plotly + [c for c in qualitative.Dark24 if c not in ("#E15F99", "#FB0D0D", "#DA16FF", "#EB663B")]
# Plotly's modebar (download, zoom, ...) shows at the top right of a hovered figure, over whatever is there:
# every figure keeps this strip above its title free for it (a long title ran under it)
MODEBAR_STRIP = 24
MARGIN = dict(l=50, r=20, t=50 + MODEBAR_STRIP, b=40)
NOTE_HEIGHT = 22  # pixels of top margin per small line under a figure's title (a browser draws them 21 apart)
TITLE_PAD = 12 + MODEBAR_STRIP  # pixels above a title hung from the top of its figure
PANEL_TITLE_HEIGHT = 16  # pixels of top margin per line of the first row's panel titles
LEGEND_ROW = 30  # pixels a browser gives each legend entry of a line-and-marker trace
# Characters on one note line, and on a title's first line: longer ones ran past the edge of a figure in a
# 1000-px window (the page's 768-px column: ~115 small characters, ~70 of the title's)
NOTE_WIDTH, TITLE_WIDTH = 105, 70
# Marker per model in the measured-vs-paper panels, named in a note under the title.
SYMBOLS = ("circle", "square", "diamond", "triangle-up", "x", "star", "cross", "pentagon")
GLYPHS = {"circle": "●", "square": "■", "diamond": "◆", "triangle-up": "▲", "x": "✕", "star": "★", "cross": "✚",
          "pentagon": "⬟"}


def _lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB components in [0, 1] (last axis) as CIELAB under D65."""
    rgb = np.asarray(rgb, dtype=float)
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = linear @ np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750],
                             [0.0193339, 0.1191920, 0.9503041]]).T / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > (6 / 29) ** 3, np.cbrt(xyz), xyz / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


def _delta_e(lab1: np.ndarray, lab2: np.ndarray) -> np.ndarray:
    """CIEDE2000 colour difference (Sharma, Wu and Dalal 2005) between CIELAB colours, broadcast."""
    L1, a1, b1 = np.moveaxis(np.asarray(lab1, dtype=float), -1, 0)
    L2, a2, b2 = np.moveaxis(np.asarray(lab2, dtype=float), -1, 0)
    mean_c = (np.hypot(a1, b1) + np.hypot(a2, b2)) / 2
    g = 0.5 * (1 - np.sqrt(mean_c ** 7 / (mean_c ** 7 + 25.0 ** 7)))
    a1, a2 = (1 + g) * a1, (1 + g) * a2
    c1, c2 = np.hypot(a1, b1), np.hypot(a2, b2)
    h1, h2 = np.degrees(np.arctan2(b1, a1)) % 360, np.degrees(np.arctan2(b2, a2)) % 360
    grey = c1 * c2 == 0
    dh = np.where(grey, 0.0, (h2 - h1 + 180) % 360 - 180)
    d_hue = 2 * np.sqrt(c1 * c2) * np.sin(np.radians(dh / 2))
    total = h1 + h2
    mean_h = np.where(grey, total, np.where(np.abs(h1 - h2) <= 180, total / 2,
                                            np.where(total < 360, total / 2 + 180, total / 2 - 180)))
    t = (1 - 0.17 * np.cos(np.radians(mean_h - 30)) + 0.24 * np.cos(np.radians(2 * mean_h))
         + 0.32 * np.cos(np.radians(3 * mean_h + 6)) - 0.20 * np.cos(np.radians(4 * mean_h - 63)))
    mean_l, mean_c = (L1 + L2) / 2, (c1 + c2) / 2
    s_l = 1 + 0.015 * (mean_l - 50) ** 2 / np.sqrt(20 + (mean_l - 50) ** 2)
    s_c, s_h = 1 + 0.045 * mean_c, 1 + 0.015 * mean_c * t
    r_t = -2 * np.sqrt(mean_c ** 7 / (mean_c ** 7 + 25.0 ** 7)) * np.sin(
        np.radians(60 * np.exp(-(((mean_h - 275) / 25) ** 2))))
    dl, dc, dhs = (L2 - L1) / s_l, (c2 - c1) / s_c, d_hue / s_h
    return np.sqrt(dl ** 2 + dc ** 2 + dhs ** 2 + r_t * dc * dhs)


@functools.cache
def _candidates() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The colours :class:`Colours` picks from: an sRGB grid (18 levels a channel), as hex, CIELAB, chroma and
    hue angle (degrees)."""
    levels = np.arange(0, 256, 15)
    rgb = np.stack(np.meshgrid(levels, levels, levels, indexing="ij"), axis=-1).reshape(-1, 3)
    lab = _lab(rgb / 255)
    return (np.array(["#%02X%02X%02X" % tuple(c) for c in rgb]), lab, np.hypot(lab[:, 1], lab[:, 2]),
            np.degrees(np.arctan2(lab[:, 2], lab[:, 1])) % 360)


def _rgb(colour: str) -> np.ndarray:
    """``"#RRGGBB"`` as sRGB components in [0, 1]."""
    return np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)]) / 255


# What lines are drawn on: the page, and the plot area of Plotly's default template.
BACKGROUNDS = ("#FFFFFF", "#E5ECF6")
# The full cache is every figure's reference: a neutral grey, as the reference lines drawn in grey are.
REFERENCE_COLOURS = {"full": "#5A5A5A"}
# A policy at its defaults is drawn with circles; each other setting of it with the next of these.
VARIANT_SYMBOLS = ("square", "diamond", "triangle-up", "triangle-down", "pentagon", "hexagon", "star", "x",
                   "cross", "triangle-left", "triangle-right", "hexagram", "star-square", "star-diamond",
                   "diamond-wide", "hourglass")


class Colours:
    """One colour and one marker per policy name, stable for the life of the tab.

    Each policy at its defaults gets a clearly coloured candidate (chroma >= 35, CIELAB L 30-72, CIEDE2000 at
    least CONTRAST from the BACKGROUNDS: readable as a line) as far (CIEDE2000) from every colour already
    given and from the backgrounds as can be.  The policies of one :meth:`extend` are picked one by one, each
    the farthest from all before it, then, round by round, each moved to the candidate farthest from all the
    others where that is farther than where it is (greedy picks alone leave the closest pair closer).
    Colours given before stay, so the first names, which share figures most, are the most distinct; the full
    cache, every figure's reference, is grey.  Another setting of a policy (``"inertia alpha=0.9"``, a name
    in ``bases``) gets a shade of its policy's hue (within 15 degrees), lighter or darker, nearer to its
    policy's colour than to any other policy's, again the farthest from every colour given; and a marker of
    its own (VARIANT_SYMBOLS, the next one over all settings given, unused by its policy's others; its policy's
    defaults are circles).  No two names share a colour.  A name first
    met later (``__call__``) is given one the same way, and keeps it.
    """

    BASE_L, BASE_CHROMA = (30, 72), 35
    SHADE_L, SHADE_CHROMA, SHADE_HUE = (25, 78), 20, 15
    CONTRAST = 30  # every colour's least distance to the backgrounds
    SHADE_MARGIN = 3  # a shade's distance to its policy's colour, at least this much below that to any other
    ROUNDS = 20  # of moving each new policy's colour (a round that parts no pair further ends it)

    def __init__(self, names: list[str] = (), bases: dict[str, str] | None = None):
        hexes, lab, _, _ = _candidates()
        self.map: dict[str, str] = {}
        self.symbols: dict[str, str] = {}
        self.bases: dict[str, str] = {}  # another setting's name -> its policy's
        self._lab: dict[str, np.ndarray] = {}
        self._distance: dict[str, np.ndarray] = {}  # each name's colour's distance to every candidate
        self._background = np.min([_delta_e(lab, _lab(_rgb(colour))) for colour in BACKGROUNDS], axis=0)
        self._lock = threading.RLock()
        self.extend(names, bases)

    @classmethod
    def of(cls, store: Store) -> "Colours":
        """Measured policies first: they share figures most, so they get the most distinct colours; policies
        only the papers report, or only a damage-ranking sweep ranked (one figure each), come after; then each
        other setting run, as --settings names it (measured ones first), a shade of its policy's colour."""
        measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
        policies = [name for name in store.options("policy") if name not in measured]
        others, run = store.other_settings(), store.other_settings(source="measured")
        settings = dict(zip(setting_names(others.policy, others.setting), others.policy))
        run = set(setting_names(run.policy, run.setting))
        colours = cls(measured)
        colours.extend(policies)
        colours.extend(sorted(settings, key=lambda name: name not in run), settings)  # stable: measured first
        return colours

    def __call__(self, policy) -> str | None:
        if not isinstance(policy, str):
            return None
        if policy not in self.map:
            with self._lock:
                base = self._base_of(policy)
                self.extend([policy], {policy: base} if base else None)
        return self.map[policy]

    def symbol(self, policy) -> str:
        """The marker of ``policy``'s points: circles at a policy's defaults, another per other setting."""
        self(policy)
        return self.symbols.get(policy, "circle")

    def _base_of(self, name: str) -> str | None:
        """The policy a name first met later is a setting of: the longest known policy it starts with,
        followed by ``key=value`` changes."""
        known = [base for base in self.map if base not in self.bases and name.startswith(base + " ")
                 and "=" in name[len(base):]]
        return max(known, key=len) if known else None

    def extend(self, names: list[str], bases: dict[str, str] | None = None) -> None:
        """Give each of ``names`` not yet given one a colour: the policies among them first, together, then
        the other settings (those in ``bases``, a shade of their policy's colour)."""
        bases = bases or {}
        with self._lock:
            names = [name for name in dict.fromkeys(names) if name not in self.map]
            settings = [name for name in names if bases.get(name)]
            policies = [name for name in names if not bases.get(name)]
            policies += [base for base in dict.fromkeys(bases[name] for name in settings)
                         if base not in self.map and base not in policies]  # run only at other settings
            self._add_policies(policies)
            for name in settings:
                self._add_setting(name, bases[name])

    def _nearest(self, leave_out: str | None = None) -> np.ndarray:
        """Each candidate's distance to the closest colour given (but ``leave_out``'s), or background."""
        given = [distance for name, distance in self._distance.items() if name != leave_out]
        return np.minimum(self._background, np.min(given, axis=0)) if given else self._background

    def _add_policies(self, names: list[str]) -> None:
        hexes, lab, chroma, _ = _candidates()
        light = (lab[:, 0] >= self.BASE_L[0]) & (lab[:, 0] <= self.BASE_L[1])
        clear = light & (chroma >= self.BASE_CHROMA) & (self._background >= self.CONTRAST)
        moving = []
        for name in names:
            if name in REFERENCE_COLOURS:
                colour = REFERENCE_COLOURS[name]
                self._give(name, colour, _lab(_rgb(colour)))
                continue
            self._give(name, *self._farthest(clear, self._nearest()))
            moving.append(name)
        for _ in range(self.ROUNDS if len(moving) > 1 else 0):
            moved = False
            for name in moving:
                nearest = self._nearest(leave_out=name)
                colour, colour_lab = self._farthest(clear, nearest, leave_out=name)
                if nearest[hexes == colour][0] > nearest[hexes == self.map[name]][0] + 1e-9:
                    self._give(name, colour, colour_lab)
                    moved = True
            if not moved:
                break

    def _add_setting(self, name: str, base: str) -> None:
        hexes, lab, chroma, hue = _candidates()
        own = self._distance[base]
        others = [distance for policy, distance in self._distance.items()
                  if policy != base and policy not in self.bases]  # the other policies' colours
        other = np.min(others, axis=0) if others else np.full(len(hexes), np.inf)
        base_chroma = np.hypot(*self._lab[base][1:])
        base_hue = np.degrees(np.arctan2(self._lab[base][2], self._lab[base][1]))
        if base_chroma < self.SHADE_CHROMA / 2:  # a grey policy's other settings: other greys
            family = chroma < self.SHADE_CHROMA / 2
        else:
            family = (np.abs((hue - base_hue + 180) % 360 - 180) <= self.SHADE_HUE) & (chroma >= self.SHADE_CHROMA)
        light = (lab[:, 0] >= self.SHADE_L[0]) & (lab[:, 0] <= self.SHADE_L[1]) & (self._background >= self.CONTRAST)
        # from the strictest: a shade of the family, readable, clearly nearer to its policy than to any other
        allowed = [family & light & (own + self.SHADE_MARGIN <= other), family & (own < other), family]
        # The next marker over every setting so far, not over this policy's only: two policies' first settings
        # (avokv interval=16, rkv interval=16) were both squares in near shades. One unused by its siblings.
        used = {self.symbols[other] for other, b in self.bases.items() if b == base}
        turn = [VARIANT_SYMBOLS[(len(self.bases) + k) % len(VARIANT_SYMBOLS)] for k in range(len(VARIANT_SYMBOLS))]
        self.symbols[name] = next((symbol for symbol in turn if symbol not in used), turn[0])
        self.bases[name] = base
        self._give(name, *self._farthest(allowed, self._nearest()))

    def _farthest(self, allowed, nearest: np.ndarray, leave_out: str | None = None) -> tuple[str, np.ndarray]:
        """The free candidate farthest from every colour given, in the first of ``allowed`` (one mask or
        several, strictest first) that has one, else in any (the grid has thousands: one always is free)."""
        hexes, lab, _, _ = _candidates()
        free = ~np.isin(hexes, [colour for name, colour in self.map.items() if name != leave_out])
        masks = [allowed] if isinstance(allowed, np.ndarray) else list(allowed)
        mask = next((free & m for m in masks if (free & m).any()), free)
        index = int(np.argmax(np.where(mask, nearest, -np.inf)))
        return str(hexes[index]), lab[index]

    def _give(self, name: str, colour: str, colour_lab: np.ndarray) -> None:
        _, lab, _, _ = _candidates()
        self.map[name] = colour
        self._lab[name], self._distance[name] = colour_lab, _delta_e(lab, colour_lab)


def _note_lines(note: str) -> list[str]:
    """``note`` as lines of at most about NOTE_WIDTH characters: broken at its "; " (between policies), where one
    line is not enough its head (up to its first "): ") on a line of its own, and a part still too long at
    spaces; none for an empty note."""
    head, colon, rest = note.partition("): ")
    if len(note) > NOTE_WIDTH and colon:
        return [*textwrap.wrap(head + "):", NOTE_WIDTH), *_note_lines(rest)]
    lines: list[str] = []
    for part in note.split("; ") if note else []:
        if lines and len(lines[-1]) + 2 + len(part) <= NOTE_WIDTH:
            lines[-1] += "; " + part
        else:
            lines += textwrap.wrap(part, NOTE_WIDTH)
    return lines


def _empty(fig: go.Figure, text: str = "no rows for these filters") -> go.Figure:
    """``fig`` saying ``text``, without axes to read (they would span a meaningless default range)."""
    fig.add_annotation(text=text, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


FACETS = ("source", "model", "task")  # what splits a figure into panels, when it varies
# The x axis of each kind of cell in the quality and max-length-hits figures: a compression cell sits at its ρ,
# a budget cell at its absolute budget (AvoKV-E's reasoning regime); a panel holds one kind.
CUT_AXES = {"compression": "compression ρ", "absolute_budget": "KV budget (tokens)"}


def _label(column: str, value) -> str:
    if column == "compression":
        return "full" if value != value else f"ρ={value:g}"  # NaN: the full cache has no ρ
    return str(value)


def _cut_label(compression, budget) -> str:
    """How a row cut the cache: ``B=64`` (an absolute budget), ``ρ=0.5``, or ``full`` (neither)."""
    if not pd.isna(budget):  # NaN or NA: a compression cell, or the full cache
        return f"B={budget:g}"
    return _label("compression", float("nan") if pd.isna(compression) else compression)


def _with_budgets(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with an ``absolute_budget`` column of floats, NaN where none (the store's is a nullable
    integer, whose NA neither compares nor mixes with ρ); a frame without one holds compression cells alone."""
    if "absolute_budget" not in frame:
        return frame.assign(absolute_budget=float("nan"))
    return frame.assign(absolute_budget=frame["absolute_budget"].astype(float))


def _versus(frame: pd.DataFrame) -> str:
    """What the policies' cells in ``frame`` vary, for a figure's title: compression, KV budget or both."""
    cells = _with_budgets(frame)
    cells = cells[cells.policy != "full"] if "policy" in cells else cells
    budget = cells.absolute_budget.notna()
    if budget.empty or not budget.any():
        return "compression"
    return "KV budget" if budget.all() else "compression or KV budget"


def _on_cut_axes(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each row's x axis (``axis``: a key of CUT_AXES) and its place on it (``position``).

    The full cache has neither a ρ nor a budget: it is drawn, as the usual flat reference, in every panel of
    its source / model / task, of either kind."""
    frame = _with_budgets(frame)
    budget = frame["absolute_budget"].notna()
    placed = frame.assign(axis=budget.map({True: "absolute_budget", False: "compression"}),
                          position=frame["absolute_budget"].where(budget, frame["compression"]))
    full = placed.policy.eq("full") if "policy" in placed else pd.Series(False, index=placed.index)
    if not full.any() or not budget.any():
        return placed
    facets = [c for c in FACETS if c in placed]
    kinds = placed[~full][[*facets, "axis"]].drop_duplicates()
    references = placed[full].drop(columns="axis").merge(kinds, on=facets, how="left")
    return pd.concat([placed[~full], references.fillna({"axis": "compression"})], ignore_index=True)


# Of a figure's plot width, between panels with a right-hand axis: its ticks, its title and the next panel's
# ticks side by side (at 0.1, a 1000-px figure's titles ran over the next panel's ticks; at 0.14, those of a
# figure in a 1000-px window, whose legend leaves its two panels ~380 px)
Y2_SPACING = 0.22


def _facets(frame: pd.DataFrame, title: str, ylabel: str, y2label: str | None = None, columns: int = 3,
            notes: list[str] = ()):
    """Small multiples: one panel per combination of source / model / task that varies in ``frame``.

    A column that takes one value goes into the title instead. Measured panels share their y range (all
    fractions); paper panels keep their own, as each printed table has its own scale; ``y2label``
    gives every panel a right-hand axis, shared the same way and titled on each panel. Returns the
    figure and ``[(panel keys, rows, row, col)]`` in drawing order; :func:`_axis_titles` labels the x axes
    once the traces are in.  ``notes``: small lines under the title (and its parenthetical).
    """
    # ``axis`` (from _on_cut_axes) splits panels too, where both kinds occur; each panel's x title names it
    varying = [c for c in (*FACETS, "axis") if c in frame and frame[c].nunique(dropna=False) > 1]
    fixed = [_label(c, frame[c].iloc[0]) for c in FACETS if c in frame and c not in varying and not frame.empty]
    groups = list(frame.groupby(varying, dropna=False, sort=True)) if varying else [((), frame)]
    columns = min(columns, len(groups))
    rows = math.ceil(len(groups) / columns)
    titles = [_panel_title([_label(c, v) for c, v in zip(varying, keys if isinstance(keys, tuple) else (keys,))
                            if c != "axis"]) for keys, _ in groups] if varying else None
    title_lines = max((title.count("<br>") + 1 for title in titles), default=0) if titles else 0
    height = 120 + 260 * rows
    gap = 95 if "axis" in varying else 70  # room for ticks and a title (and an x title on every panel)
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=titles,
                        horizontal_spacing=Y2_SPACING if y2label else 0.06,
                        vertical_spacing=gap / (height - MARGIN["t"] - MARGIN["b"]),
                        specs=[[{"secondary_y": bool(y2label)}] * columns] * rows)
    panels, first_axis = [], {}  # (source, secondary) -> the axis the others of that source match
    first_x = {}  # kind of x axis -> the x axis the other panels of that kind match
    for index, (keys, part) in enumerate(groups):
        row, col = index // columns + 1, index % columns + 1
        panels.append((keys, part, row, col))
        source = part["source"].iloc[0] if "source" in part and not part.empty else None
        for secondary in (False, True) if y2label else (False,):
            axis = fig.get_subplot(row, col, secondary_y=secondary).yaxis.plotly_name.replace("axis", "")  # "y3"
            if source == "paper" and not secondary:
                continue  # each printed table has its own scale (0-100, 0-1, %): each paper panel its own axis
            if (source, secondary) in first_axis:
                fig.update_yaxes(matches=first_axis[source, secondary], row=row, col=col, secondary_y=secondary)
            else:
                first_axis[source, secondary] = axis
        if y2label:  # on every panel: between two panels, an untitled right axis read as the next one's left
            fig.update_yaxes(title_text=y2label, row=row, col=col, secondary_y=True)
        fig.update_yaxes(title_text=ylabel if col == 1 else None, row=row, col=col, secondary_y=False)
        kind = part["axis"].iloc[0] if "axis" in part and not part.empty else None
        x_axis = fig.get_subplot(row, col, secondary_y=False).xaxis.plotly_name.replace("axis", "")  # "x3"
        if first_x.setdefault((source, kind), x_axis) != x_axis:
            # one x range per source and kind: measured panels compare at a glance, and a paper's budgets
            # (AvoKV-E's up to 1024) do not squeeze a measured sweep's into a corner
            fig.update_xaxes(matches=first_x[source, kind], row=row, col=col)
    # What the figure is and which rows it shows on the first line; the parenthetical, which can run past a
    # narrow figure's edge and hide that, on a second.
    head, paren, rest = title.partition(" (")
    rows_shown = " · ".join(fixed)
    # each note wrapped as well: a line longer than a figure in a 1000-px window is cut at its edge
    small_lines = [*_note_lines(f"({rest}" if paren else ""), *(line for note in notes for line in _note_lines(note))]
    if fixed and len(head) + 3 + len(rows_shown) > TITLE_WIDTH:  # the rows it shows on a small line of their own
        small_lines.insert(0, rows_shown)
    elif fixed:
        head += f" · {rows_shown}"
    text = head + "".join(f"<br><sup>{line}</sup>" for line in small_lines)
    small = len(small_lines)  # lines under the title's own
    top = MARGIN["t"] + NOTE_HEIGHT * small + PANEL_TITLE_HEIGHT * title_lines
    # Hung from the top: centred in the margin (Plotly's default), seven notes reached the panel titles
    fig.update_layout(title=dict(text=text, yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      height=height + top - MARGIN["t"], margin={**MARGIN, "t": top}, legend=dict(font=dict(size=10)))
    if y2label:  # the legend clear of the right-hand axis's ticks and title (by default it lay over the title)
        fig.update_layout(legend_x=1.09)
    fig.update_annotations(font_size=11)
    if frame.empty:
        _empty(fig)
    return fig, panels


def _panel_title(labels: list[str]) -> str:
    """A panel's title from its facet values: the last (the task) on a line of its own under the others
    (source, model); on one line, "paper · Llama-3.1-8B-Instruct · LongBench/2wikimqa" ran into its
    neighbours' titles in a figure under 1000 px wide."""
    return " · ".join(labels[:-1]) + "<br>" + labels[-1] if len(labels) > 1 else "".join(labels)


def _axis_titles(fig: go.Figure, panels: list, xlabel: str) -> None:
    """The x title under the lowest panel of each column only: above, it would collide with the titles of
    the panels below.  Panels on a compression and on a budget axis (:func:`_on_cut_axes`) each have their
    own title, with room made for it; panels all on one such axis get its name instead of ``xlabel``."""
    kinds = [part["axis"].iloc[0] if "axis" in part and not part.empty else None for _, part, _, _ in panels]
    if len(set(kinds)) > 1:
        for (_, _, row, col), kind in zip(panels, kinds):
            fig.update_xaxes(title_text=CUT_AXES[kind], row=row, col=col)
        return
    xlabel = CUT_AXES.get(kinds[0], xlabel) if kinds else xlabel
    lowest = {}
    for _, _, row, col in panels:
        lowest[col] = max(row, lowest.get(col, 0))
    for col, row in lowest.items():
        fig.update_xaxes(title_text=xlabel, row=row, col=col)


def _hover_counts(part: pd.DataFrame) -> list[str]:
    """What each point averages, for its hover: samples (a paper row: printed figures), or generations."""
    if "recorded" in part:
        return [f"{hits:g} of {recorded:g} generations" for hits, recorded in zip(part.hits, part.recorded)]
    if "samples" not in part:
        return [""] * len(part)
    unit = "printed figures" if "source" in part and part["source"].iloc[0] == "paper" else "samples"
    return [f"n = {n:g} {unit}" for n in part.samples]


def _line_figure(frame: pd.DataFrame, x: str, y: str, title: str, xlabel: str, ylabel: str,
                 colours: Colours | None = None, join_fewer_than: int = 0, notes: list[str] = ()) -> go.Figure:
    """``y`` against ``x``, a panel per source / model / task, a line per policy (and compression or budget,
    if not x).  With x = ``"compression"``, budget cells are drawn against their budget in panels of their own
    (:func:`_on_cut_axes`), and ``xlabel`` is the compression axis's title only.

    A line has one colour and one legend entry across the panels (a policy its usual colour); clicking it
    in the legend toggles it everywhere.  Paper rows are dashed.  A line of fewer than ``join_fewer_than``
    points is drawn as markers alone (α: two far-apart values joined would read as measured in between).
    The hover gives each point's value, standard error and what it averages.
    """
    cuts = [c for c in ("compression", "absolute_budget") if c in frame]
    reference = x == "compression"  # the full cache is then a flat line across each panel
    offsets = pd.Series(0.0, index=frame.index)
    extents = {}
    if reference:
        frame, x, cuts = _on_cut_axes(frame), "position", []
        offsets = _dodge(frame, y)
        extents = _shared_extents(frame[frame.policy != "full"], x)
        if offsets.ne(0).any():
            notes = [*notes, "points of several policies that coincide are nudged apart on x around their cut"]
    fig, panels = _facets(frame, title, ylabel, notes=notes)
    line_cols = [c for c in ("policy",) if c in frame] + cuts
    palette = {}  # lines that are not a single policy (α sensitivity: one per ρ) share colours across panels
    shown = set()
    for _, panel, row, col in panels:
        for keys, part in panel.groupby(line_cols, dropna=False, sort=True):
            keys = keys if isinstance(keys, tuple) else (keys,)
            values = dict(zip(line_cols, keys))
            policy = values.get("policy")
            label = " · ".join([str(policy)] * ("policy" in values) + [
                _cut_label(values.get("compression"), values.get("absolute_budget"))] * bool(cuts))
            colour = colours(policy) if colours and line_cols == ["policy"] else None
            # each other setting of a policy: a shade of its colour, and a marker of its own
            marker = dict(symbol=colours.symbol(policy)) if colour else None
            colour = colour or palette.setdefault(label, PALETTE[len(palette) % len(PALETTE)])
            paper = part["source"].iloc[0] == "paper"
            dash = "dash" if paper else "solid"
            xs, ys = part[x] + offsets[part.index], part[y]
            stderr = part["stderr"] if "stderr" in part and not paper else pd.Series(np.nan, index=part.index)
            where = [_cut_label(c, b) for c, b in zip(part.compression, part.absolute_budget)] if reference \
                else [f"{xlabel} = {position:g}" for position in xs]
            hover = [f"{label}<br>{at}<br>{ylabel} {value:.3f}" + ("" if pd.isna(error) else f" ± {error:.3f}")
                     + (f"<br>{count}" if count else "") for at, value, error, count in
                     zip(where, ys, stderr, _hover_counts(part))]
            mode = "lines+markers" if len(part) >= join_fewer_than else "markers"
            if reference and policy == "full" and len(part) == 1 and panel[x].notna().any():
                # The full cache does not depend on the compression: a reference across the x axis the panel
                # shares, the same length in each panel (across its own cuts, it stopped short where a panel
                # ran fewer cuts than its neighbours)
                xs, ys, dash, mode = extents[_axis_key(panel)], [ys.iloc[0]] * 2, "dot", "lines"
                hover = [f"full cache (no cut)<br>{ylabel} {part[y].iloc[0]:.3f}<br>{_hover_counts(part)[0]}"] * 2
            # ± one standard error over samples, where there are several; a paper row's "samples" are the
            # printed figures it averages, often one number printed twice: no error of anything
            error = dict(type="data", array=stderr, visible=True, thickness=1) \
                if stderr.notna().any() and len(xs) == len(part) else None
            fig.add_scatter(x=xs, y=ys, name=label, legendgroup=label, showlegend=label not in shown,
                            mode=mode, line=dict(dash=dash, color=colour), marker=marker, error_y=error,
                            hovertext=hover, hoverinfo="text", row=row, col=col)
            shown.add(label)
        if not panel.empty and "source" in panel and panel["source"].iloc[0] == "paper":
            _readable_range(fig, panel[y], row, col)
    _axis_titles(fig, panels, xlabel)
    return fig


def _axis_key(panel: pd.DataFrame) -> tuple:
    """The x axis a panel of :func:`_facets` shares with the others of its source and kind of cut."""
    return tuple(panel[c].iloc[0] if c in panel and not panel.empty else None for c in ("source", "axis"))


def _shared_extents(frame: pd.DataFrame, x: str, lone: float | None = None) -> dict[tuple, list[float]]:
    """Per x axis the panels share (:func:`_axis_key`), the span of ``x`` over all of them: where a reference
    line runs in each of its panels.  An axis of one value gets a short span around it, ``lone`` either side
    (default a tenth of the value, at least 0.05), or the line would be a point under that cut's markers."""
    extents = {}
    columns = [c for c in ("source", "axis") if c in frame]
    for _, part in frame.groupby(columns, dropna=False) if columns else [((), frame)]:
        low, high = part[x].min(), part[x].max()
        pad = 0.0 if high > low else (lone if lone is not None else max(abs(low) * 0.1, 0.05))
        extents[_axis_key(part)] = [low - pad, high + pad]
    return extents


DODGE = 0.025  # of an axis's span: how far apart on x coinciding points are drawn (a marker's width)
CLUSTER_ROOM = 0.6  # of the smallest gap between a panel's cuts: the widest a cluster of nudged points is drawn
DODGE_MOST = 4  # a larger cluster (every policy at 0 at ρ = 0.95) would spread past the cut: left as it is


def _dodge(frame: pd.DataFrame, y: str) -> pd.Series:
    """Per row of ``frame`` (placed by :func:`_on_cut_axes`), an x offset that draws apart the points of
    several lines at one cut with the same value (to 3 decimals) in one panel: tova, AvoKV-E and its
    interval-16 setting all at 0.063 on B=80 showed as one marker.  Points that stand alone, and clusters of
    more than DODGE_MOST, stay where they are; the full cache, a line across the panel, is never moved.  The
    step is DODGE of the span of the axis the panel shares (source and kind of cut), or of the cut itself
    where that axis holds one; at most what keeps a cluster within CLUSTER_ROOM of the panel's smallest gap
    between cuts (:func:`_nudge_step`)."""
    offsets = pd.Series(0.0, index=frame.index)
    if frame.empty:
        return offsets
    facets = [c for c in (*FACETS, "axis") if c in frame]
    moving = frame[frame.policy != "full"] if "policy" in frame else frame
    for _, axis in moving.groupby([c for c in ("source", "axis") if c in frame], dropna=False):
        span = axis.position.max() - axis.position.min()
        for _, panel in axis.groupby(facets, dropna=False):
            for _, group in panel.assign(value=panel[y].round(3)).groupby(["position", "value"], dropna=False):
                if 1 < len(group) <= DODGE_MOST:
                    step = _nudge_step(DODGE * (span or abs(group.position.iloc[0]) or 1.0), panel.position,
                                       len(group))
                    offsets[group.index] = step * (np.arange(len(group)) - (len(group) - 1) / 2)
    return offsets


def _nudge_step(step: float, cuts: pd.Series, points: int) -> float:
    """``step``, the x distance between neighbouring points of a cluster of ``points`` nudged apart around
    one cut, made small enough that the cluster spans at most CLUSTER_ROOM of the smallest gap between the
    panel's ``cuts``: wider, the clusters of neighbouring cuts (ρ 0.9 and 0.95) interleaved, and no point
    could be told to its cut."""
    distinct = np.unique(cuts.dropna())
    if points < 2 or len(distinct) < 2:
        return step
    return min(step, CLUSTER_ROOM * float(np.diff(distinct).min()) / (points - 1))


def _readable_range(fig: go.Figure, values: pd.Series, row: int, col: int) -> None:
    """A paper panel's y range, at least 10% of its largest value tall: printed figures that differ in the
    second decimal (52.52 against 52.62) would otherwise fill the panel as if they differed a lot."""
    low, high = values.min(), values.max()
    least = 0.1 * max(abs(low), abs(high))
    if pd.isna(low) or high - low >= least or least == 0:
        return
    middle = (low + high) / 2
    fig.update_yaxes(range=[middle - 0.6 * least, middle + 0.6 * least], row=row, col=col, secondary_y=False)


def _hits_figure(frame: pd.DataFrame, colours: Colours, settings: bool = False, empty: str | None = None) -> go.Figure:
    """The quality figure's panels and lines for the share of generations that reached max_new_tokens instead
    of ending, from the groups where some row records it (rows written before the field do not).  ``empty``:
    what to say when there are no rows (default: that there are none measured for these filters)."""
    recorded = frame[frame.recorded > 0]
    if recorded.empty:
        return _empty(go.Figure(), (empty or "no measured rows for these filters") if frame.empty else
                      f"none of the {int(frame.rows.sum())} measured rows for these filters records max-length hits "
                      "(hit_max_tokens): they were written before sweeps recorded it; a new sweep records it")
    fig = _line_figure(recorded, "compression", "hit_rate", f"Max-length hits vs {_versus(recorded)} (share of "
                       "generations that reached max_new_tokens instead of ending; "
                       + ("every setting run, each its own line)" if settings else "each policy at its defaults)"),
                       "compression ρ", "max-length hit rate", colours)
    fig.update_yaxes(range=[-0.05, 1.05])  # a share: 1 of 20 should not fill the panel
    return fig


PAIRED_DODGE = 0.012  # of a panel's span: how far apart on x the paired figure draws neighbouring policies


def _paired_figure(frame: pd.DataFrame, reference: str, colours: Colours, empty: str | None = None,
                   notes: list[str] = ()) -> go.Figure:
    """Each policy's paired difference to ``reference`` against compression (budget cells against their budget,
    in panels of their own), with its bootstrap interval, a panel per model / task (and per suite over its
    tasks); the policies are nudged apart on x so that intervals at the same cut do not hide each other.
    ``empty``: what to say when no pair is left (default: that none pairs under these filters); ``notes``: small
    lines under the title."""
    if frame.empty:
        return _empty(go.Figure(), empty or f"no measured samples pair with {reference} under these filters")
    frame = frame.assign(source="measured")
    placed = _on_cut_axes(frame)
    fig, panels = _facets(placed, f"Paired difference to {reference} on the same samples (mean Δ; bars: 95% "
                          "paired-bootstrap interval; filled: sign test p < 0.05; policies nudged apart on x "
                          "around their cut)", f"Δ score vs {reference}", notes=notes)
    policies = sorted(frame.policy.unique()) if not frame.empty else []
    shown = set()
    for _, panel, row, col in panels:
        fig.add_hline(y=0, line=dict(color="grey", width=1), row=row, col=col)
        # each policy nudged by its own offset, the panel's policies centred on their cut, never so far apart
        # that they reach a neighbouring cut's
        present = [policy for policy in policies if policy in set(panel.policy)]
        spread = _nudge_step(PAIRED_DODGE * ((panel.position.max() - panel.position.min()) or 1), panel.position,
                             len(present)) if len(panel) else 0
        for policy, part in panel.groupby("policy", sort=True):
            nudge = spread * (present.index(policy) - (len(present) - 1) / 2)
            symbol = colours.symbol(policy)  # filled or open: the sign test; the shape: the setting
            cuts = [_cut_label(c, b) for c, b in zip(part.compression, part.absolute_budget)]
            fig.add_scatter(
                x=part.position + nudge, y=part.delta, name=policy, legendgroup=policy,
                showlegend=policy not in shown, mode="lines+markers", line=dict(color=colours(policy)),
                marker=dict(symbol=[symbol if flag else f"{symbol}-open" for flag in part.significant], size=8),
                error_y=dict(type="data", array=part.high - part.delta, arrayminus=part.delta - part.low,
                             visible=True, thickness=1),
                customdata=list(zip(cuts, *(part[c] for c in ("low", "high", "wins", "ties", "losses", "pairs",
                                                             "p_sign")),
                                    [f"{d:.3f}" if pd.notna(d) else "none (too few differing samples)"
                                     for d in (part.detectable if "detectable" in part else [np.nan] * len(part))])),
                hovertemplate=(f"{policy} − {reference}<br>%{{customdata[0]}}<br>Δ %{{y:+.3f}} "
                               "[%{customdata[1]:+.3f}, %{customdata[2]:+.3f}]<br>wins/ties/losses "
                               "%{customdata[3]}/%{customdata[4]}/%{customdata[5]} of %{customdata[6]}"
                               "<br>sign test p = %{customdata[7]:.3g}<br>smallest |Δ| detectable (80% power): "
                               "%{customdata[8]}<extra></extra>"),
                row=row, col=col)
            shown.add(policy)
    _axis_titles(fig, panels, "compression ρ")
    return fig


def _comparison_figure(frame: pd.DataFrame, suite: str, colours: Colours, notes: list[str] = ()) -> go.Figure:
    """Paper panel(s) and the measured panel side by side, each source relative to its own full cache;
    ``notes`` (what each side averages, and the tasks left out) under the title."""
    origins = list(dict.fromkeys(frame.origin)) if not frame.empty else []
    if not origins:
        return _empty(go.Figure(), f"no paper and measured rows to compare on {suite}")
    # more models than symbols: round again (the hover names the model)
    symbols = {model: SYMBOLS[i % len(SYMBOLS)] for i, model in enumerate(sorted(set(frame.model)))}
    # The marker key is a note line: in the panel titles, three models' names ran past a half-width panel
    key = "markers: " + ", ".join(f"{GLYPHS[symbols[m]]} {m}" for m in sorted(symbols)) + " (the hover names each)"
    fig = make_subplots(rows=1, cols=len(origins), shared_yaxes=True, subplot_titles=origins)
    shown = set()
    for col, origin in enumerate(origins, start=1):
        part = frame[frame.origin == origin]
        for (model, policy), line in part.groupby(["model", "policy"]):
            fig.add_scatter(
                x=line.compression, y=line.relative, mode="lines+markers", name=policy, legendgroup=policy,
                showlegend=policy not in shown, row=1, col=col,
                line=dict(color=colours(policy), dash="dash" if origin.startswith("paper") else "solid"),
                marker=dict(symbol=symbols[model]),
                customdata=line[["score", "full_score", "tasks"]].values,
                hovertemplate=(f"{policy} · {model}<br>ρ=%{{x}}<br>relative %{{y:.3f}}<br>"
                               "score %{customdata[0]:.3g} of full %{customdata[1]:.3g}<br>"
                               "tasks %{customdata[2]}<extra></extra>"))
            shown.add(policy)
        fig.add_hline(y=1.0, line_dash="dot", line_color="grey", row=1, col=col)
        fig.update_xaxes(title_text="compression ρ", row=1, col=col)
    fig.update_yaxes(title_text="score / full-cache score", row=1, col=1)
    fig.update_layout(legend=dict(font=dict(size=10)))
    fig.update_annotations(font_size=11)
    _title(fig, f"Measured vs paper: {suite}, relative to each source's full cache",
           [line for note in [key, *notes] for line in _note_lines(note)])
    # the panels' titles (the legend's room: query's _legend_room)
    fig.update_layout(margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT,
                      height=fig.layout.height + PANEL_TITLE_HEIGHT)
    return fig


# How the refresh figure draws the points of each sweep's speed line: a line never joins two runs
SWEEP_SYMBOLS = ("diamond", "triangle-up", "square", "cross", "x", "star")


def _refresh_figure(frame: pd.DataFrame) -> go.Figure:
    """Score (left axis) and decode speed (right axis, dotted) against the refresh interval r >= 1, a panel per
    source / model / task and a colour per compression (or absolute budget).

    Score-Free (r = 0 in the store) scores once, at the first decode step, and never again: InertiaKV's separate
    operating point, neither r = 0 nor the limit r -> inf.  It is a horizontal line in each panel (its score,
    and its speed on the right axis), joined to no r.  A speed line joins the points of one sweep only
    (``sweeps``, a marker each): two runs differ in the machine's load, which a line across them would show as
    the cost of refreshing."""
    runs = sorted(set(frame["sweeps"].dropna())) if "sweeps" in frame else []
    symbols = {run: SWEEP_SYMBOLS[i % len(SWEEP_SYMBOLS)] for i, run in enumerate(runs)}
    notes = ["score-free (scores at step 1 only, never refreshes): a horizontal line, a separate operating point, "
             "not r → ∞"]
    if len(runs) > 1:
        notes.append("speed: one line per sweep (" + ", ".join(f"{GLYPHS.get(symbols[run], symbols[run])} {run}"
                                                              for run in runs)
                     + "): runs at other times differ in machine load")
    # two panels a row: each has a right-hand axis, whose title ran over the next panel's ticks three a row
    fig, panels = _facets(frame, "Refresh interval r: quality and decode speed (r: decode steps between scorings; "
                          "bars: ± 1 standard error)",
                          "mean score", y2label="decode tok/s (measured)", columns=2,
                          notes=[line for note in notes for line in _note_lines(note)])
    palette, shown = {}, set()

    def add(name: str, **trace) -> None:  # one legend entry per name across the panels
        fig.add_scatter(name=name, legendgroup=name, showlegend=name not in shown, **trace)
        shown.add(name)

    # score-free's lines across the r of every panel sharing the x axis: across a panel's own, they stopped
    # short where a task ran fewer r than its neighbours (one r: a short line around it)
    extents = _shared_extents(frame[frame.refresh > 0], "refresh", lone=0.5)
    for _, panel, row, col in panels:
        span = extents.get(_axis_key(panel), [0.5, 1.5])
        for cut, part in _with_budgets(panel).groupby(["compression", "absolute_budget"], dropna=False, sort=True):
            label = _cut_label(*cut)
            colour = palette.setdefault(label, PALETTE[len(palette) % len(PALETTE)])
            dash = "dash" if part["source"].iloc[0] == "paper" else "solid"
            place = dict(row=row, col=col)
            lines = part[part.refresh > 0]
            if len(lines):
                error = dict(type="data", array=lines.stderr, visible=True, thickness=1) \
                    if dash == "solid" and "stderr" in lines and lines.stderr.notna().any() else None  # measured
                add(f"{label} score", x=lines.refresh, y=lines.score, mode="lines+markers", error_y=error,
                    line=dict(dash=dash, color=colour), secondary_y=False, **place)
                timed = lines[lines.decode_tok_s.notna()]
                by_run = timed.groupby("sweeps", dropna=False, sort=True) if "sweeps" in timed else [(None, timed)]
                for run, points in by_run:
                    run = None if pd.isna(run) else run
                    add(f"{label} tok/s" + (f" · {run}" if len(runs) > 1 and run else ""), x=points.refresh,
                        y=points.decode_tok_s, mode="lines+markers", line=dict(dash="dot", color=colour),
                        marker=dict(symbol=symbols.get(run, "diamond")), secondary_y=True,
                        hovertemplate="r = %{x}<br>%{y:.2f} tok/s" + (f"<br>run: {run}" if run else "")
                                      + "<extra></extra>", **place)
            for free in part[part.refresh == 0].itertuples():
                add(f"{label} score-free score", x=span, y=[free.score] * 2, mode="lines",
                    line=dict(dash="dashdot", color=colour, width=1), secondary_y=False,
                    hovertemplate=f"score-free · {label}<br>score {free.score:.3f}<extra></extra>", **place)
                if not pd.isna(free.decode_tok_s):
                    run = getattr(free, "sweeps", None)
                    add(f"{label} score-free tok/s", x=span, y=[free.decode_tok_s] * 2, mode="lines",
                        line=dict(dash="longdashdot", color=colour, width=1), secondary_y=True,
                        hovertemplate=f"score-free · {label}<br>{free.decode_tok_s:.2f} tok/s"
                                      + (f"<br>run: {run}" if isinstance(run, str) else "") + "<extra></extra>",
                        **place)
    _axis_titles(fig, panels, "refresh interval r (steps)")  # longer, two bottom titles ran together at 900 px
    return fig


def _comparable(frame: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """The rows whose means can stand side by side, one point per (model, policy, cut), and what they cover.

    Per model and kind of cut (compression or absolute budget): only the tasks that every policy has at
    every cut of that kind, and the full cache over those same tasks, once per kind (column ``kind``).
    Averaging whatever tasks each point has would put a policy run on three tasks next to one run on four,
    or a greedy reasoning sweep's mean next to a sampled one's.  The notes, one per (model, kind), name the
    tasks and those left out.
    """
    cells = _with_budgets(frame)
    cells = cells.assign(kind=cells.absolute_budget.notna().map({True: "budget", False: "compression"}))
    full, evicting = cells[cells.policy == "full"], cells[cells.policy != "full"]
    if evicting.empty:  # the full cache alone: one point per task set it has, nothing to match
        return full.assign(kind="full"), [f"full cache: mean over {', '.join(sorted(set(full.task)))}"]
    several = evicting.model.nunique() > 1
    parts, notes = [], []
    for (model, kind), part in evicting.groupby(["model", "kind"]):
        tasks = part.groupby(["policy", "compression", "absolute_budget"], dropna=False).task.agg(frozenset)
        common = sorted(frozenset.intersection(*tasks))
        left_out = sorted(set(part.task) - set(common))
        parts += [part[part.task.isin(common)], full[(full.model == model) & full.task.isin(common)].assign(kind=kind)]
        note = (f"{kind} cells: mean over {', '.join(common)}" if common else
                f"{kind} cells: no task is run at every point, so none is shown; pick a task")
        if common and left_out:
            note += f"; {', '.join(left_out)} left out (not run at every point)"
        notes.append(f"{model}, {note}" if several else note)
    return pd.concat(parts), notes


def _per_point(frame: pd.DataFrame, values: list[str]) -> pd.DataFrame:
    """``values`` averaged per (model, kind, policy, compression or absolute budget) over the tasks of
    :func:`_comparable`'s ``frame``; with a ``sweeps`` column, also the sweeps each point's rows come from
    (speeds compare within one run, not across machines)."""
    groups = _with_budgets(frame).groupby(["model", "kind", "policy", "compression", "absolute_budget"],
                                          dropna=False)
    points = groups[values].mean()
    if "sweeps" in frame:
        points["sweeps"] = groups.sweeps.agg(lambda names: ", ".join(sorted(
            {name for joined in names.dropna() for name in joined.split(", ")})) or "not recorded")
    return points.reset_index()


def _point_labels(part: pd.DataFrame, kinds: int) -> list[str]:
    """Each point's cut for the hover; the full cache's says which kind's tasks it averages, if both show."""
    return [f"full ({kind} tasks)" if policy == "full" and kinds > 1 else _cut_label(c, b)
            for policy, kind, c, b in zip(part.policy, part.kind, part.compression, part.absolute_budget)]


SWEEPS_WIDTH = 45  # characters of sweep names on one line of a speed panel's title (half of a 1000-px figure)


KIND_SYMBOLS = {"compression": "circle", "budget": "square", "full": "circle"}


def _cut_order(part: pd.DataFrame) -> pd.Series:
    """How hard each of a kind's cells cuts the cache, 0 (least) to 1 (most): a compression's ρ up, an absolute
    budget down; the full cache 0."""
    budget = part.absolute_budget.notna()
    severity = part.compression.where(~budget, -part.absolute_budget).astype(float)
    ranks = severity.rank(method="dense") - 1
    top = ranks.max()
    return (ranks / top).fillna(0.0) if top and top > 0 else pd.Series(0.0, index=part.index)


def _speed_figure(frame: pd.DataFrame, colours: Colours) -> go.Figure:
    """Quality against measured decode speed, one point per (policy, compression or budget), averaged over
    the tasks every point has (:func:`_comparable`).

    A panel per kind of cell: compression cells and absolute-budget cells come from other sweeps, prompts and
    lengths, so their speeds never share an axis (each panel names the sweeps its points come from).  A line
    per policy joins its cells in order of the cut, the marker the larger the harder the cut."""
    if frame.empty:
        return _empty(go.Figure(), "no measured rows with a decode speed for these filters")
    rows, notes = _comparable(frame)
    per_point = _per_point(rows, ["score", "decode_tok_s", "decode_cache"])
    several = per_point.model.nunique() > 1
    kinds = sorted(per_point.kind.unique(), key=["compression", "budget", "full"].index)
    names = {"compression": "compression cells (ρ)", "budget": "absolute-budget cells", "full": "full cache"}
    titles = []
    for kind in kinds:
        sweeps = sorted({name for joined in per_point[per_point.kind == kind].sweeps for name in joined.split(", ")})
        # what the panel holds on a line, its sweeps wrapped under it: on one line, four sweeps' names ran into
        # the next panel's title at 1000 px
        wrapped = textwrap.wrap(", ".join(sweeps), SWEEPS_WIDTH, break_on_hyphens=False)  # a name stays whole
        titles.append("<br>".join([names[kind], *wrapped]))
    fig = make_subplots(rows=1, cols=len(kinds), subplot_titles=titles, horizontal_spacing=0.08)
    shown = set()
    for col, kind in enumerate(kinds, start=1):
        panel = per_point[per_point.kind == kind]
        order = _cut_order(panel[panel.policy != "full"]).reindex(panel.index, fill_value=0.0)
        for (model, policy), part in panel.assign(order=order).groupby(["model", "policy"]):
            part = part.sort_values("order")
            cuts = _point_labels(part, 1)
            name = f"{policy} · {model}" if several else policy
            # No text on the points: a dozen policies share one cluster of speeds; the hover names the cut.
            fig.add_scatter(x=part.decode_tok_s, y=part.score, name=name, legendgroup=name,
                            showlegend=name not in shown, mode="lines+markers",
                            line=dict(color=colours(policy), width=1),
                            marker=dict(size=7 + 7 * part.order, color=colours(policy), symbol=KIND_SYMBOLS[kind]),
                            customdata=list(zip(cuts, part.decode_cache, part.sweeps)),
                            hovertemplate=(f"{policy}<br>%{{customdata[0]}}<br>score %{{y:.3f}}<br>"
                                           "%{x:.2f} tok/s<br>largest cache while decoding %{customdata[1]:.0f}"
                                           "<br>run: %{customdata[2]}<extra></extra>"), row=1, col=col)
            shown.add(name)
        fig.update_xaxes(title_text="decode tok/s", row=1, col=col)
    fig.update_yaxes(title_text="mean score", row=1, col=1)
    fig.update_layout(legend=dict(font=dict(size=10)))
    fig.update_annotations(font_size=11)
    _title(fig, "Quality vs decode speed (measured)",
           notes + ["a line per policy through its cells; the larger the marker, the harder the cut"])
    lines = max(title.count("<br>") + 1 for title in titles)  # the panels' titles
    fig.update_layout(margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT * lines + 4,
                      height=fig.layout.height + PANEL_TITLE_HEIGHT * lines + 4)
    return fig


def _title(fig: go.Figure, title: str, notes: list[str]) -> None:
    """``title`` with each note on a small line of its own below it (one long line would run past the edge),
    and the top margin and height that make room for them."""
    notes = [line for note in notes for line in _note_lines(note)]  # a line longer than the figure is cut
    # Anchored at the top: centred in the margin (Plotly's default) it would run into panel titles under it
    fig.update_layout(title=dict(text="<br>".join([title, *(f"<sup>{note}</sup>" for note in notes)]),
                                 yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      margin={**MARGIN, "t": MARGIN["t"] + NOTE_HEIGHT * len(notes)},
                      height=400 + MODEBAR_STRIP + NOTE_HEIGHT * len(notes))


def _cache_figure(frame: pd.DataFrame, colours: Colours) -> go.Figure:
    """Quality against the cache each policy really held: one point per (policy, compression or budget), at
    the mean over samples of the largest cache any decode step held, averaged over the tasks every point
    has (:func:`_comparable`), with the full cache's score over the same tasks as a dotted line.  The same
    nominal B is not the same memory: a checkpointed policy (AvoKV-E, R-KV, LazyEviction) runs up to
    B + interval - 1, a prefill-time one grows by the tokens generated; AvoKV-E compares policies at matched
    active-KV sizes, which this axis shows."""
    fig = go.Figure()
    evicting = frame[frame.policy != "full"]
    if evicting.empty:
        return _empty(fig, "no measured rows of an evicting policy with a decode speed for these filters")
    # The largest cache while decoding: a row's max_cache also counts the prefill, where at a compression
    # every decode-time policy once held its whole prompt.  Older rows that cannot tell the two apart are
    # left out (decode_cache: the store says how).
    if evicting.decode_cache.isna().all():
        return _empty(fig, "no measured cells with a decode-time cache size for these filters (rows written "
                           "before sweeps recorded max_decode_cache cannot tell it at a compression for "
                           "policies that evict while decoding)")
    rows, notes = _comparable(frame[frame.decode_cache.notna() | (frame.policy == "full")])
    per_point = _per_point(rows, ["score", "decode_cache"])
    kinds = per_point[per_point.policy != "full"].kind.nunique()
    several = per_point.model.nunique() > 1
    shown = set()
    # One line per policy and kind of cut: absolute budgets and compressions come from other prompts and tasks
    for (model, policy, kind), part in per_point[per_point.policy != "full"].groupby(["model", "policy", "kind"]):
        part = part.sort_values("decode_cache")
        cuts = _point_labels(part, kinds)
        name = f"{policy} · {model}" if several else policy
        fig.add_scatter(x=part.decode_cache, y=part.score, name=name, legendgroup=name,
                        showlegend=name not in shown, mode="lines+markers",
                        marker=dict(size=9, color=colours(policy), symbol=KIND_SYMBOLS[kind]),
                        line=dict(color=colours(policy), width=1),
                        customdata=cuts, hovertemplate=(f"{policy}<br>%{{customdata}}<br>score %{{y:.3f}}<br>"
                                                        "largest cache while decoding %{x:.0f} entries"
                                                        "<extra></extra>"))
        shown.add(name)
    # The full cache's scores as dotted lines named in the legend (a label on the plot sat on the points)
    evicting_cache = per_point[per_point.policy != "full"].decode_cache
    span = [evicting_cache.min(), evicting_cache.max()]
    for row in per_point[per_point.policy == "full"].itertuples():
        what = " · ".join(filter(None, [row.model if several else "", f"{row.kind} tasks" if kinds > 1 else ""]))
        name = f"full cache{f' ({what})' if what else ''}: {row.score:.2f}"
        fig.add_scatter(x=span, y=[row.score] * 2, name=name, mode="lines", hoverinfo="name",
                        line=dict(dash="dashdot" if row.kind == "budget" else "dot", color=colours("full"), width=1))
    fig.update_layout(xaxis_title="largest cache while decoding (entries, mean over samples)",
                      yaxis_title="mean score", legend=dict(font=dict(size=10)))
    _title(fig, "Quality vs the cache actually held (measured)",
           notes + (["squares: budget cells; dotted (dash-dot for the budget cells): the full cache over the same "
                     "tasks"] if kinds > 1
                    else ["dotted: the full cache over the same tasks"]))
    return fig


DEPTH_POLICIES = 8  # lines a depth figure draws when no policy is chosen: more tangle at ten depths
# which come first: the reference, the paper's method, then issue 43's headline baselines
DEPTH_FIRST = ("full", "inertia", "tova", "h2o", "snapkv", "streaming", "knorm", "keydiff")
DEPTH_CAPTION = ("Read each line left to right: its score on the samples whose needle lies in that tenth of the "
                 "text (0: the start, 1: just before the question); a policy that keeps only recent entries "
                 "rises to the right, one that retrieves stays flat.")


def _depth_shown(frame: pd.DataFrame, chosen: bool) -> tuple[pd.DataFrame, list[str]]:
    """The rows a depth figure draws: the full cache and the evicting policies at the most-run compression
    (the largest on a tie), at most ``DEPTH_POLICIES`` lines unless policies were chosen; and notes saying
    what was left out."""
    notes = []
    evicting = frame[frame.compression.notna()]
    if evicting.empty:
        return frame, notes
    runs = evicting.groupby("compression").policy.nunique()
    rho = max(runs[runs == runs.max()].index)
    if len(runs) > 1:
        notes.append(f"other compressions ({', '.join(f'{c:g}' for c in runs.index if c != rho)}): "
                     "filter the sweeps, or see the table")
    frame = frame[frame.compression.isna() | (frame.compression == rho)]
    names = list(dict.fromkeys([*DEPTH_FIRST, *sorted(frame.policy.unique())]))
    names = [name for name in names if name in set(frame.policy)]
    if not chosen and len(names) > DEPTH_POLICIES:
        notes.append(f"{len(names) - DEPTH_POLICIES} more polic{'ies' if len(names) > DEPTH_POLICIES + 1 else 'y'} ({', '.join(names[DEPTH_POLICIES:][:4])}"
                     f"{', ...' * (len(names) > DEPTH_POLICIES + 4)}): choose them in Policies")
        names = names[:DEPTH_POLICIES]
    return frame[frame.policy.isin(names)], notes


def _depth_figure(frame: pd.DataFrame, colours: Colours, chosen: bool = False) -> go.Figure:
    """Mean score per needle-depth decile, a line per policy at one compression, a panel per model / task;
    only rows whose sample records its needle's depth (the prose tasks, single_needle)."""
    if frame.empty:
        return _empty(go.Figure(), "no rows with a recorded needle depth for these filters (the prose tasks and "
                                   "single_needle record one)")
    shown, notes = _depth_shown(frame, chosen)
    full = frame[frame.policy == "full"]
    full = full.assign(total=full.score * full.samples).groupby(["model", "task"])[["total", "samples"]].sum()
    weak = full[full.total < RANKED_FLOOR * full.samples].reset_index()
    if len(weak):
        notes.append(f"{NOT_RANKED} (full cache under {RANKED_FLOOR:g}): "
                     + ", ".join(f"{row.task} ({row.total / row.samples:.2f})" for row in weak.itertuples()))
    rho = shown.compression.dropna().unique()
    notes.append(f"n per point: {shown.samples.min():g} to {shown.samples.max():g} samples; "
                 "a depth with few samples moves in large steps")
    title = f"Quality vs needle depth{f' at ρ = {rho[0]:g}' if len(rho) else ''} (mean score per tenth of the text; " \
            "bars: ± 1 standard error)"
    lines = shown.drop(columns=["compression"]).assign(source="measured")
    return _line_figure(lines, "depth", "score", title, "needle depth (share of the text before it)", "mean score",
                        colours, notes=notes)


# AvoKV-E's Table 3 metrics as panels: title, and a random ranking's value (the dotted line).  High damage is
# the top decile, so a random ranking finds a tenth of it among any k entries and has that precision.
RANKING_PANELS = {"auroc": ("AUROC", 0.5), "ap": ("average precision", 0.1), "topk_recall": ("top-k recall", 0.1),
                  "false_safe_rate": ("false-safe rate (lower is better)", 0.1), "spearman": ("Spearman", 0.0)}
RANKING_BAR = 17  # pixels per bar of a ranking panel
FILTERS_CACHED = 64  # filter combinations whose figures the tab keeps (under 1 MB each on the shipped store)
PAPER_GREY = "#A0A0A0"  # a paper's scorer that is none of our policies ('attention only', 'ThinKV-style proxy')


def _ranking_labels(frame: pd.DataFrame) -> pd.Series:
    """Each row's bar label: the policy; a paper's scorer as ``AvoKV-E: attention only``; and where measured rows
    come from more than one ranking sweep (another model, task or step), the measured ones with their sweep."""
    measured = frame.source == "measured"
    several = frame[measured].sweep.nunique() > 1
    return pd.Series([f"{row.paper}: {row.policy}" if row.source == "paper"
                      else f"{row.policy} · {row.sweep}" if several else row.policy
                      for row in frame.itertuples()], index=frame.index)


def _ranking_hover(bar, metric: str) -> str:
    """A bar's hover: a measured mean with its standard error, traces and entries; a paper's printed figure
    with where the paper says it comes from."""
    if bar.source == "paper":
        where = "<br>".join(textwrap.wrap(bar.notes, 80)) if isinstance(bar.notes, str) else "the paper's figure"
        return f"{bar.label}<br>{metric} {bar.score:.3f} (printed)<br>{where}"
    spread = f" ± {bar.stderr:.3f}" if pd.notna(bar.stderr) else ""
    entries = f", {int(bar.candidates)} entries ranked" if pd.notna(bar.candidates) else ""
    return (f"{bar.label}<br>{metric} {bar.score:.3f}{spread}<br>{bar.model} · {bar.task} · {bar.sweep}<br>"
            f"{int(bar.traces)} trace(s){entries}")


def _ranking_caveats(measured: pd.DataFrame) -> list[str]:
    """What qualifies the measured bars: traces whose replay ran past the answer's end, and how many of the
    ranked entries were the prompt's (per sweep; every policy of a sweep ranks the same entries)."""
    lines = []
    caveats = ranking_caveats(measured)
    several = len(caveats) > 1
    # the probe decodes past the end of a short answer: its replay there is not the answer's
    ended = [f"{int(row.past_end)} trace(s){f' of {sweep}' if several else ''}"
             + (f" ({int(row.ended_by_step)} at or before the probed step)" if row.ended_by_step else "")
             for sweep, row in caveats.iterrows() if row.past_end]
    if ended:
        lines.append(f"in {'; '.join(ended)} the full-cache answer ended within or before the probe's replay")
    shares = [f"{row.prompt_share:.0%}" + (f" in {sweep}" if several else "")
              for sweep, row in caveats.iterrows() if row.prompt_share == row.prompt_share]
    if shares:
        lines.append(f"prompt entries among those ranked: {', '.join(shares)} (the rest were generated)")
    return lines


def _ranking_figure(frame: pd.DataFrame, colours: Colours, notes: list[str] = ()) -> go.Figure:
    """AvoKV-E's oracle ranking table as bars: a panel per metric, a bar per scorer (measured: the mean over
    traces with ± 1 standard error; a paper's: its one printed figure, hatched), the scorers in the order of
    their AUROC within each source and measured sweep, and a random ranking's value dotted."""
    if frame.empty:
        return _empty(go.Figure(), "no damage-ranking rows for these filters (run `kvviz bench ranking "
                                   "configs/ranking-arithmetic.toml`)")
    frame = frame.assign(paper=frame.paper.fillna("paper"))  # a paper row may not say which paper
    frame = frame.assign(label=_ranking_labels(frame))
    auroc = frame[frame.metric == "auroc"].set_index("label").score
    sweep_of = frame.drop_duplicates("label").set_index("label").sweep
    # measured first, each sweep's bars together (they ranked different entries), by AUROC within it
    order = sorted(frame.label.unique(), key=lambda label: (
        not frame[frame.label == label].source.eq("measured").any(), str(sweep_of[label]),
        -auroc.get(label, -np.inf), label))
    metrics = [metric for metric in RANKING_PANELS if metric in set(frame.metric)]
    columns = min(3, len(metrics))
    grid_rows = -(-len(metrics) // columns)
    fig = make_subplots(rows=grid_rows, cols=columns, shared_yaxes=True, horizontal_spacing=0.03,
                        vertical_spacing=0.1, subplot_titles=[RANKING_PANELS[m][0] for m in metrics])
    for index, metric in enumerate(metrics):
        row, col = index // columns + 1, index % columns + 1
        part = frame[frame.metric == metric].set_index("label").reindex(order).dropna(subset=["score"])
        paper = part.source == "paper"
        fig.add_bar(
            x=part.score, y=part.index, orientation="h", row=row, col=col, showlegend=False,
            marker=dict(color=[colours(bar.policy) if bar.source == "measured" or bar.policy in REGISTRY
                               else PAPER_GREY for bar in part.itertuples()],
                        pattern=dict(shape=["/" if p else "" for p in paper], solidity=0.4)),
            # none for a paper's figure or a lone trace (a zero-width bar would read as certainty)
            error_x=dict(array=[None if value != value else value for value in part.stderr], thickness=1, width=3,
                         color="#404040"),
            hovertext=[_ranking_hover(bar, RANKING_PANELS[metric][0]) for bar in part.reset_index().itertuples()],
            hovertemplate="%{hovertext}<extra></extra>")
        chance = RANKING_PANELS[metric][1]
        fig.add_vline(x=chance, line_dash="dot", line_color="grey", row=row, col=col)
    fig.update_yaxes(categoryorder="array", categoryarray=order[::-1], tickfont=dict(size=10))
    fig.update_annotations(font_size=11)
    measured = frame[frame.source == "measured"]
    papers = frame[frame.source == "paper"]
    lines = []
    if len(measured):
        lines.append(f"solid: measured, the mean over {int(measured.traces.max())} traces ± 1 standard error; "
                     f"{', '.join(sorted(set(measured.model)))} on {', '.join(sorted(set(measured.task)))}")
    lines += _ranking_caveats(measured)
    if len(papers):
        lines.append(f"hatched: {', '.join(sorted(set(papers.paper)))}'s printed figures, over all its traces "
                     f"({', '.join(sorted(set(papers.model)))}, {', '.join(sorted(set(papers.task)))}): "
                     "compare orders, not levels")
    lines.append("dotted: a random ranking (high damage = the top decile of a trace's oracle damage)")
    _title(fig, "Damage ranking: each utility against the oracle damage of one entry",
           [*lines, *notes])
    bars = len(order)
    panel = max(RANKING_BAR * bars, 120)
    fig.update_layout(height=fig.layout.height - 400 + grid_rows * (panel + 60) + 40,
                      margin_t=fig.layout.margin.t + PANEL_TITLE_HEIGHT, margin_l=10)
    fig.update_yaxes(automargin=True)
    return fig


def _grid_figure(frame: pd.DataFrame, empty: str = "no needle-grid rows for these filters") -> go.Figure:
    """One heatmap (depth × context length) per (policy, compression or absolute budget), each cell's score
    written in it."""
    if frame.empty:
        return _empty(go.Figure(), empty)
    panels = list(_with_budgets(frame).groupby(["model", "policy", "compression", "absolute_budget"], dropna=False))
    several = frame.model.nunique() > 1  # a panel per model too, named
    # three a row: five in a 1000-px window ran each panel's depth labels over its neighbour's cells and its
    # title into the next one's
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    titles = [(f"{m}<br>" if several else "") + ("full cache" if p == "full" else f"{p} {_cut_label(c, b)}")
              for (m, p, c, b), _ in panels]
    fig = make_subplots(rows=rows, cols=columns, subplot_titles=titles, horizontal_spacing=0.07,
                        vertical_spacing=0.12 / max(rows, 1) + 0.04)
    for index, (_, part) in enumerate(panels):
        pivot = part.pivot_table(index="depth", columns="length", values="score")
        fig.add_heatmap(z=pivot.values, x=[str(c) for c in pivot.columns], y=[f"{d:.0%}" for d in pivot.index],
                        colorscale="RdYlGn", zmin=0, zmax=1, showscale=index == 0, texttemplate="%{z:.2f}",
                        textfont=dict(size=9),
                        hovertemplate="length %{x}<br>depth %{y}<br>ROUGE-L %{z:.2f}<extra></extra>",
                        row=index // columns + 1, col=index % columns + 1)
    fig.update_layout(title=dict(text="Needle in a haystack: ROUGE-L F by context length and needle depth<br><sup>"
                                      "x: the context in prompt tokens; y: the share of it before the needle</sup>",
                                 yref="container", y=1, yanchor="top", pad=dict(t=TITLE_PAD)),
                      height=100 + MODEBAR_STRIP + 200 * rows + PANEL_TITLE_HEIGHT * several,
                      margin={**MARGIN, "t": MARGIN["t"] + NOTE_HEIGHT + PANEL_TITLE_HEIGHT * several})
    fig.update_annotations(font_size=10)
    return fig


_CSV_DIR = Path(tempfile.mkdtemp(prefix="kvviz-results-"))


WHOLE_COLUMNS = ("absolute_budget", "budget", "samples", "pairs", "wins", "ties", "losses", "rows", "hits",
                 "recorded", "draws")


def _csv(frame: pd.DataFrame, name: str) -> str:
    """Write the table once per distinct content (the file name carries its hash), so that filter changes
    do not pile up files and concurrent sessions never overwrite each other's download."""
    # Counts and budgets stay whole numbers ("80", not "80.0"); a NaN among them made pandas write floats
    counts = {c: "Int64" for c in WHOLE_COLUMNS if c in frame and pd.api.types.is_float_dtype(frame[c])
              and (frame[c].dropna() % 1 == 0).all()}
    text = frame.astype(counts).to_csv(index=False)
    path = _CSV_DIR / f"{name}-{hashlib.sha1(text.encode()).hexdigest()[:12]}.csv"
    if not path.exists():
        path.write_text(text)
    return str(path)


@functools.lru_cache(maxsize=32)
def paired(store: Store, reference: str, task: str | None, model: str | None,
           policies: tuple[str, ...] | None, settings: bool = False,
           sweeps: tuple[str, ...] | None = None) -> pd.DataFrame:
    """The paired-difference table (a few seconds of resampling: kept per filter combination; the store never
    changes while the app runs)."""
    return paired_table(store.paired_scores(reference, task, model, list(policies) if policies else None,
                                            settings=settings, sweeps=sweeps))


def query(store: Store, model: str, task: str, policies: list[str], source: str, suite: str | None = None,
          colours: Colours | None = None, reference: str | None = None, settings: bool = False,
          sweeps: list[str] | None = None):
    """Every figure, its table and its CSV for the current filters, in the tab's output order."""
    drawn = dict(sections(store, model, task, policies, source, suite, colours, reference, settings, sweeps))
    return tuple(item for index in range(len(SECTIONS)) for item in drawn[index])


def sections(store: Store, model: str, task: str, policies: list[str], source: str, suite: str | None = None,
             colours: Colours | None = None, reference: str | None = None, settings: bool = False,
             sweeps: list[str] | None = None):
    """:func:`query`'s sections one at a time, as ``(index in SECTIONS, (figure, table, CSV update))``: those
    open when the tab loads (``OPEN``) first, which a reader then sees while the others are drawn."""
    model = None if model in (None, ALL) else model
    task = None if task in (None, ALL) else task
    source = None if source in (None, ALL) else source
    policies = policies or None
    sweeps = tuple(sweeps) if sweeps else None
    colours = colours or Colours.of(store)
    suites = store.comparable_suites()
    suite = suite if suite in suites else (suites[0] if suites else "RULER")

    settings = bool(settings)
    # The full cache is what every policy is read against, not one of them: the figures that draw it keep it
    drawn = with_reference(policies)
    quality = store.quality_vs_compression(task, model, drawn, source, settings=settings, sweeps=sweeps)
    references = store.options("policy", source="measured", metrics=QUALITY_METRICS)
    reference = reference if reference in references else default_reference(references)
    hits = store.max_length_hits(task, model, drawn, settings=settings, sweeps=sweeps)
    comparison = store.paper_comparison(suite, policies)
    suite_lines = suite_notes(comparison, store.left_out_of_suite(suite, policies), suite) if len(comparison) else []
    alpha = store.alpha_sensitivity(task, model, source, sweeps=sweeps)
    refresh = store.refresh_curve(task, model, source, sweeps=sweeps)
    speed = store.speed_vs_quality(task, model, drawn, settings=settings, sweeps=sweeps)
    # One nominal B is not one memory size: the quality and paired figures name the cells that held well over it
    quality_notes = [] if source == "paper" else _note_lines(held_over_note(speed))
    quality_notes += _note_lines(weak_full_cache_note(quality))
    quality_notes += _note_lines(absent_note(store, quality, policies))
    hidden = store.other_settings(task, model, policies, source, sweeps) if not settings else pd.DataFrame()
    if len(hidden):  # as `kvviz results` says under a table: a policy run only at interval 16 is otherwise unseen
        names = setting_names(hidden.policy, hidden.setting)
        quality_notes.append(f"{len(names)} other setting{'s' * (len(names) > 1)} hidden ({', '.join(names[:4])}"
                    + (", ..." if len(names) > 4 else "") + f"): tick '{SETTINGS_BOX}'")

    def paired_section() -> tuple:
        # seconds of resampling: drawn after the sections open at load
        differences = paired(store, reference, task, model, tuple(policies) if policies else None, settings,
                             sweeps) if reference and source != "paper" else paired_table(pd.DataFrame())
        if reference and not differences.empty:
            reference_held = store.speed_vs_quality(task, model, [reference], sweeps=sweeps)
            paired_held = _note_lines(held_over_note(pd.concat(
                [speed[speed.policy.isin(differences.policy)], reference_held])))
        else:
            paired_held = []
        # A suite's panel averages every task of it that pairs; Measured vs paper leaves out those its full
        # cache fails, so "mean of 3 tasks" here and "mean over 2" there need their tasks named
        suites = differences[differences.tasks != differences.task][["task", "tasks"]].drop_duplicates() \
            if not differences.empty else differences
        paired_held = [f"{row.task}: {row.tasks} (a difference needs no full cache: none is left out)"
                       for row in suites.itertuples()] + paired_held
        return _paired_figure(differences, reference, colours, unpaired, paired_held), differences, \
            f"paired_vs_{reference}"

    if source == "paper":  # the papers report no per-run decode speed or max-length hits
        speed, hits = speed.iloc[0:0], hits.iloc[0:0]
    # The grid is a task of its own: another task chosen leaves it empty, saying why
    depth = quality_vs_depth(store, task, model, drawn, sweeps=list(sweeps) if sweeps else None) \
        if source != "paper" else quality_vs_depth(store, task, model, []).iloc[0:0]
    grid = store.needle_grid(model, drawn, source, sweeps=sweeps)
    grid_empty = "no needle-grid rows for these filters"
    if task not in (None, "needle_grid"):
        grid, grid_empty = grid.iloc[0:0], f"the grid is the task needle_grid: choose it (or {ALL}) as the Task"
    # The papers' ranking table is the reference this figure exists for: like Measured vs paper, model, task and
    # source leave it (and the measured rows) alone; the policies, and for measured rows the sweeps, apply
    ranking = pd.concat([store.damage_ranking(None, None, policies, "measured", settings=settings, sweeps=sweeps),
                         store.damage_ranking(None, None, policies, "paper")], ignore_index=True)
    ranking_hidden = [] if settings else sorted(
        set(store.damage_ranking(None, None, policies, "measured", settings=True, sweeps=sweeps).policy)
        - set(ranking.policy))
    ranking_notes = [f"{len(ranking_hidden)} other setting{'s' * (len(ranking_hidden) > 1)} hidden "
                     f"({', '.join(ranking_hidden[:4])}{', ...' * (len(ranking_hidden) > 4)}): tick '{SETTINGS_BOX}'"
                     ] if ranking_hidden else []
    unpaired = ("papers print no per-sample scores: choose the measured source to pair samples"
                if source == "paper" else
                f"the policies chosen are only the reference, {reference}: pick another in Policies, or another "
                "reference" if reference and policies and set(policies) <= {reference, "full"} else None)
    # each section's (figure, table, CSV name), built when it is its turn; in SECTIONS order
    builders = [
        lambda: (_line_figure(quality, "compression", "score",
                              f"Quality vs {_versus(quality)} ("
                              + ("every setting run, each its own line" if settings else "each policy at its defaults")
                              + "; bars: ± 1 standard error"
                              f"{_draws_note(quality)})", "compression ρ", "mean score", colours,
                              notes=quality_notes), quality, "quality_vs_compression"),
        lambda: (_hits_figure(hits, colours, settings, "the papers print max-length hits per table, not per run: "
                              "choose the measured source" if source == "paper" else None), hits, "max_length_hits"),
        paired_section,
        lambda: (_comparison_figure(comparison, suite, colours, suite_lines), comparison,
                 f"measured_vs_paper_{suite}"),
        lambda: (_line_figure(alpha, "alpha", "score", "α sensitivity (InertiaKV; bars: ± 1 standard error; a cut "
                              "run at fewer than three α: markers only)", "α", "mean score", join_fewer_than=3),
                 alpha, "alpha_sensitivity"),
        lambda: (_refresh_figure(refresh), refresh, "refresh_curve"),
        lambda: (_speed_figure(speed, colours), speed, "speed_vs_quality"),
        lambda: (_cache_figure(speed, colours), speed, "quality_vs_cache"),
        lambda: (_depth_figure(depth, colours, chosen=bool(policies)), depth, "quality_vs_depth"),
        lambda: (_grid_figure(grid, grid_empty), grid, "needle_grid"),
        lambda: (_ranking_figure(ranking, colours, ranking_notes), ranking, "damage_ranking"),
    ]
    # An empty figure says which filter empties it: a source without the chosen model's, task's or sweep's rows,
    # or (in the figures that the settings box fills) the settings it hides
    hint = empty_filters_hint(store, model, task, source, sweeps)
    hidden_hint = f"{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden: tick '{SETTINGS_BOX}'" \
        if len(hidden) else ""
    drawn_with_settings = {"quality_vs_compression", "max_length_hits", f"paired_vs_{reference}", "speed_vs_quality",
                           "quality_vs_cache"}
    for index in sorted(range(len(SECTIONS)), key=lambda index: SECTIONS[index] not in OPEN):
        figure, frame, name = builders[index]()
        why = hint or (hidden_hint if name in drawn_with_settings else "")
        for note in figure.layout.annotations if why else ():
            if str(note.text).endswith("these filters"):
                note.text += f"<br>{why}"
        _legend_room(figure)
        yield index, (figure, frame.round(4), gr.update(value=_csv(frame, name)))  # the CSV keeps full precision


def legend_entries(fig: go.Figure) -> int:
    """How many entries ``fig``'s legend lists: its named scatter traces not left out of it (Plotly lists a
    trace whose ``showlegend`` is unset where the figure has more than one)."""
    scatters = [trace for trace in fig.data if trace.type == "scatter" and trace.name]
    return sum(trace.showlegend or (trace.showlegend is None and len(fig.data) > 1) for trace in scatters)


def _legend_room(fig: go.Figure) -> None:
    """``fig`` made tall enough that its legend, beside the plot, fits its plot area (Plotly's bound for such
    a legend): a longer one scrolled (every setting shown, 17-27 entries in figures 400-700 px tall)."""
    margin = fig.layout.margin
    top, bottom = (100 if margin.t is None else margin.t), (80 if margin.b is None else margin.b)  # or Plotly's
    height = fig.layout.height or 450  # Plotly's default
    needed = top + bottom + LEGEND_ROW * legend_entries(fig)
    if needed > height:
        fig.update_layout(height=needed, margin=dict(t=top, b=bottom))


def with_reference(policies: list[str] | None) -> list[str] | None:
    """The policies a figure draws for the Policies filter ``policies`` (None: all): those and the full cache,
    the reference each of them is read against (its dotted line, its panel of the grid, its speed)."""
    return [*policies, *(["full"] if "full" not in policies else [])] if policies else None


def empty_filters_hint(store: Store, model: str | None, task: str | None, source: str | None,
                       sweeps: tuple | None) -> str:
    """Which of the chosen model, task or sweeps has no rows of the chosen source, and what to choose instead:
    a paper's model or benchmark under the measured source emptied every figure without a reason."""
    if source is None:
        return ""
    other = "paper" if source == "measured" else "measured"
    for column, values in (("model", [model] if model else []), ("task", [task] if task else []),
                           ("sweep", list(sweeps or []))):
        if not values:
            continue
        have = set(store.options(column, source=source))  # one query a column, not one a value
        missing = [value for value in values if value not in have]
        if missing:
            return (f"{column} {', '.join(missing)} has only {other} rows: choose Source {other} or (all)"
                    if set(missing) <= set(store.options(column, source=other)) else "")
    return ""


def absent_note(store: Store, quality: pd.DataFrame, policies: list[str] | None) -> str:
    """For the chosen policies the quality figure draws nothing of, where their rows are (e.g. a policy only
    the papers report, under the measured source): the figure otherwise showed the full cache alone."""
    names = set(quality.policy) if len(quality) else set()

    def drawn(policy: str) -> bool:  # as itself or a setting of it ("avokv interval=16"; "thinkv (impl.)" is not "thinkv")
        return any(name == policy or name.startswith(policy + " ")
                   and all("=" in word for word in name[len(policy):].split()) for name in names)

    absent = [policy for policy in policies or [] if policy != "full" and not drawn(policy)]
    if not absent:
        return ""
    where = store.where_run(absent)
    parts = []
    for policy in absent:
        rows = where[(where.policy == policy) & where.quality]
        others = where[(where.policy == policy) & ~where.quality]
        places = []
        for source in rows.source.unique():
            tasks = rows[rows.source == source].task.unique().tolist()
            places.append(f"{source} on {', '.join(tasks[:4])}" + (", ..." if len(tasks) > 4 else ""))
        if places:
            parts.append(f"{policy}: no rows for these filters (its rows: {' and '.join(places)})")
        elif len(others):  # AvoKV-E's ranking of damage (AUROC, AP): the Damage ranking figure draws them
            parts.append(f"{policy}: only {', '.join(others.metric.unique())} rows ({', '.join(others.task.unique())}: "
                         f"a damage probe's ranking), drawn under '{SECTIONS[-1]}'")
        else:
            parts.append(f"{policy}: no rows at all")
    return "; ".join(parts)


def weak_full_cache_note(quality: pd.DataFrame) -> str:
    """The measured tasks on which the full cache itself scores under FULL_CACHE_FLOOR, named with its score
    (empty where none): there a policy above the dotted line is noise, not better than keeping everything --
    SmolLM2-135M solves none of 16 greedy arithmetic problems, and evicting policies scored above that."""
    full = quality[(quality.policy == "full") & (quality.source == "measured")] if len(quality) else quality
    weak = full[full.score < FULL_CACHE_FLOOR].sort_values(["model", "task"])
    if weak.empty:
        return ""
    tasks = "; ".join(f"{row.task} {row.score:.3f}" + (f" ({row.model})" if full.model.nunique() > 1 else "")
                      for row in weak.itertuples())
    return (f"full cache under {FULL_CACHE_FLOOR:g} (the model fails these even unevicted): {tasks} (a policy "
            "above it there is noise, not better than no eviction)")


def _draws_note(frame: pd.DataFrame) -> str:
    """Where sampled cells are drawn: each sample's point is the mean of its draws (as ``kvviz results`` says),
    naming the tasks that were sampled (the others were greedy, one generation a sample)."""
    if "draws" not in frame or not (frame["draws"] > 1).any():
        return ""
    sampled = frame[frame["draws"] > 1].groupby("task")["draws"].max()
    return " over samples; " + ", ".join(f"on {task} each sample the mean of up to {int(draws)} sampled draws"
                                         for task, draws in sampled.items())


def default_reference(policies: list[str]) -> str | None:
    """InertiaKV where it was measured (the papers' deltas are to it), else the full cache, else the first."""
    return next((name for name in ("inertia", "full") if name in policies), policies[0] if policies else None)


# The start of the settings box's label, which the quality figure names where it hides other settings
SETTINGS_BOX = "Other parameter settings too"
SECTIONS = ("Quality vs compression", "Max-length hits vs compression", "Paired differences", "Measured vs paper", "α sensitivity",
            "Refresh interval", "Quality vs decode speed", "Quality vs cache held", "Quality vs needle depth",
            "Needle in a haystack grid",
            "Damage ranking (AvoKV-E Table 3)")
OPEN = ("Quality vs compression", "Measured vs paper")  # the sections open when the tab loads
# What a closed section shows while the open ones are already drawn for new filters: no figure, table or
# download of the earlier filters under the new ones
PENDING = (_empty(go.Figure(layout=dict(height=160, margin=dict(t=20, b=20))),
                  "drawing for the new filters: a few seconds"),
           pd.DataFrame({"table": ["drawing for the new filters"]}), gr.update(value=None))


class Drawing:
    """One filter combination's sections, drawn in a thread of its own and read by every request for it.

    The thread, not a request, draws: a request that goes away (a filter changed again, a closed page)
    leaves no half-drawn combination behind, and requests for it while it is drawn wait for the same
    figures.  ``parts`` maps a section's index in ``SECTIONS`` to its (figure, table, CSV update), as
    ``keep(index, section)`` returns them; ``opened`` is set once the ``OPEN`` sections are drawn, ``done``
    once all are (both also when drawing failed, with ``error`` set).
    """

    def __init__(self, sections, keep):
        self.parts: dict[int, tuple] = {}
        self.error: Exception | None = None
        self.opened, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._draw, args=(sections, keep), name="results-draw", daemon=True).start()

    def _draw(self, sections, keep) -> None:
        opened = {SECTIONS.index(title) for title in OPEN}
        try:
            for index, section in sections:
                self.parts[index] = keep(index, section)
                if opened <= self.parts.keys():
                    self.opened.set()
        except Exception as error:  # logged here, with its traceback; raised to each request for it as one line
            log.exception("drawing the results failed")
            self.error = error
        finally:
            self.opened.set()
            self.done.set()

    def outputs(self, pending: tuple | None = None) -> tuple:
        """Every output in the tab's order: a drawn section's (an update dict anew each time: Gradio may
        consume it), and ``pending`` for one not drawn yet."""
        return tuple(dict(item) if isinstance(item, dict) else item
                     for index in range(len(SECTIONS)) for item in self.parts.get(index, pending))


# A reader of the papers takes a near-zero row for a broken implementation: say where it comes from
QUALITY_NOTE = ("Measured rows are SmolLM2-135M on short synthetic tasks, not the papers' 8B models. "
                "A row can be low by design rather than by fault: AvoKV-E near 0 on single_needle and "
                "multi_key_needle, whose answers are numbers, comes from its first checkpoint compressing "
                "an over-budget prompt, where key redundancy (weight 0.9) drops a number's mutually "
                "similar digit tokens (`benchmarks/avokv_needle_digits.py`); needle_grid's needle is a "
                "sentence of words, which it keeps as well as the others do. The paper applies it to "
                "generated reasoning, where the prompt fits the budget. "
                "`results_db/README.md` discusses each such row.")


def build_results_tab(app: gr.Blocks, store: Store | None = None, warm: bool = False) -> None:
    """Lay out the tab inside the current Blocks context; figures render on load and on every filter change,
    each filter combination once (and with ``warm`` the defaults at once, in the background)."""
    store = store or Store()
    if store.problems:
        gr.Markdown("**Some results could not be read:**\n" + "\n".join(f"- {p}" for p in store.problems))
    if not store.shards:
        gr.Markdown("No sweep results are stored yet (`results_db/` is empty). Run `kvviz bench run CONFIG` to add some.")
        return
    colours = Colours.of(store)
    suites = store.comparable_suites()
    with gr.Row():
        model = gr.Dropdown([ALL, *store.options("model")], value=ALL, label="Model")
        task = gr.Dropdown([ALL, *store.options("task")], value=ALL, label="Task")
        measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
        ranked = store.options("policy", source="measured")
        # names only a paper reports (its ablations, methods not implemented here), or only a damage-ranking
        # sweep ranked, are marked as such
        policies = gr.Dropdown([name if name in measured else (f"{name} (damage ranking only)", name)
                                if name in ranked else (f"{name} (paper only)", name)
                                for name in store.options("policy")], value=[], multiselect=True,
                               label="Policies (none = all)")
        # measured first: paper scores are on each benchmark's own scale (0-100, 0-1, %), ours are 0-1
        source = gr.Radio([ALL, "measured", "paper"], value="measured", label="Source")
    # A row of its own: a fifth column beside the four above, its long label wrapped a word a line at 1000 px
    with gr.Row():
        # A policy run only at other settings (AvoKV-E at interval=16) is otherwise in no figure but the grid's.
        settings = gr.Checkbox(False, label=f"{SETTINGS_BOX} (α and refresh sweeps, intervals, "
                                            "ablations): each its own policy, e.g. 'avokv interval=16', paired "
                                            "against the reference at its defaults")
    with gr.Row():
        # One run's cells (results_db/README.md says where and when each ran): its speeds compare
        sweeps = gr.Dropdown(store.options("sweep"), value=[], multiselect=True,
                             label="Sweeps (none = all; a cell run by two sweeps counts in either)")
    outputs = []
    suite = reference = None
    for title in SECTIONS:
        with gr.Accordion(title, open=title in OPEN):
            if title == "Quality vs compression":
                gr.Markdown(QUALITY_NOTE)
            if title == "Measured vs paper":
                gr.Markdown("Paper rows are each benchmark's printed aggregate; measured rows are the tasks that "
                            "stand in for it here (e.g. the RULER-style generators): their mean score divided by "
                            "the full cache's mean score on the same tasks, leaving out any task where the full "
                            f"cache itself scores under {FULL_CACHE_FLOOR:g} (variable tracking on SmolLM2-135M: "
                            "there a policy's score is mostly noise); the figure names the tasks left out. "
                            "Models differ: compare shapes, not levels. "
                            "The policy filter applies; model, task and source do not. A paper row's samples "
                            "are the printed cells it averages (one number printed in several tables counts "
                            "each time).")
                suite = gr.Dropdown(suites or ["RULER"], value=(suites or ["RULER"])[0], label="Benchmark")
            if title == "Paired differences":
                gr.Markdown("Each policy's score minus the reference's on the same samples (same prompt, "
                            "compression and generation settings), so that the task's own noise cancels: the "
                            "mean difference, its 95% paired-bootstrap interval (per task, resampling samples; "
                            "for a benchmark, the mean over its tasks, resampled within each task) and "
                            "wins / ties / losses with an exact sign test in the table. A filled marker: the "
                            "sign test says the two differ (p < 0.05); a hollow one: the run cannot tell them "
                            "apart, whatever the interval (a few differing samples among many ties make it "
                            "narrow). Measured rows only.")
                reference = gr.Dropdown(measured, value=default_reference(measured), label="Reference policy")
            if title == SECTIONS[-1]:
                gr.Markdown("How well each policy's utility at one decode step ranks what removing each entry "
                            "would cost: the damage probe (the Compare tab's, and `kvviz probe`) removes one "
                            "entry at a time and measures the KL of the next tokens; the top decile of a trace's "
                            "damage is high damage. A measured trace is one probe of one sample "
                            "(`kvviz bench ranking`), ranked over the entries every policy judged; the paper "
                            "prints one figure over its 5,440 candidates from 30 traces. The policy filter "
                            "applies, and the sweeps to measured rows; model, task and source do not. "
                            "`kvviz results --ranking --vs inertia` pairs the policies trace by trace (bootstrap "
                            "interval and sign test).")
            if title == "Quality vs decode speed":
                gr.Markdown("Decode speed as each cell recorded it on the machine it ran on. Cells rerun later "
                            "may come from another machine (results_db/README.md says which), so compare speeds "
                            "within one run, or measure them together with `kvviz bench speed --policies ...`.")
            # The accordion names the figure: a label tag (Gradio's default, "Plot") covered its title's start
            plot = gr.Plot(label=title, show_label=False)
            if title == "Quality vs needle depth":
                gr.Markdown(DEPTH_CAPTION)
            table = gr.Dataframe(interactive=False, max_height=300)
            csv = gr.DownloadButton("Download CSV")
            outputs += [plot, table, csv]
    filters = [model, task, policies, source, suite, reference, settings, sweeps]

    # The store does not change while the app runs, so each filter combination is drawn once (3-8 s of this
    # 2-core machine's time), the sections open at load first; every page load asks for the defaults, which
    # are drawn as the app starts.
    drawings: OrderedDict[tuple, Drawing] = OrderedDict()  # the last FILTERS_CACHED combinations, newest last
    guard = threading.Lock()

    def kept(index: int, section: tuple) -> tuple:
        # kept as the JSON Gradio sends (a Plot passes its own PlotData through), not turned into it per request
        return tuple(block.postprocess(value) if isinstance(block, gr.Plot) else value
                     for block, value in zip(outputs[3 * index:3 * index + 3], section))

    def drawing_for(key: tuple) -> Drawing:
        with guard:
            drawing = drawings.get(key)
            if drawing is None or drawing.error is not None:  # a failed drawing is tried again
                model_value, task_value, policy_values, source_value, suite_value, reference_value, \
                    settings_value, sweep_values = key
                drawing = drawings[key] = Drawing(sections(
                    store, model_value, task_value, list(policy_values), source_value, suite_value, colours,
                    reference_value, settings_value, list(sweep_values)), kept)
                if len(drawings) > FILTERS_CACHED:
                    drawings.popitem(last=False)
            drawings.move_to_end(key)
            return drawing

    def key_of(model_value, task_value, policy_values, source_value, suite_value, reference_value, settings_value,
               sweep_values=None) -> tuple:
        return (model_value, task_value, tuple(policy_values or ()), source_value, suite_value, reference_value,
                bool(settings_value), tuple(sweep_values or ()))

    def handler(model_value, task_value, policy_values, source_value, suite_value, reference_value, settings_value,
                sweep_values=None):
        drawing = drawing_for(key_of(model_value, task_value, policy_values, source_value, suite_value,
                                     reference_value, settings_value, sweep_values))
        drawing.opened.wait()
        if not drawing.done.is_set():  # the open sections now; the others say they are being drawn
            yield drawing.outputs(pending=PENDING)
        drawing.done.wait()
        if drawing.error is not None:  # a line the user can read: with show_error off, a bare "Error" otherwise
            error = drawing.error
            raise refused(f"drawing the results failed: {type(error).__name__}: {error}; change a filter or "
                          "reload the page to draw them again")
        # every section, the open ones again: the last update is what an API client gets
        yield drawing.outputs()

    if warm:  # what a page load asks for first, drawn before anyone asks
        drawing_for(key_of(*(widget.value for widget in filters)))

    # always_last: a filter changed while the figures for the last one are drawn is queued, not dropped
    # (Gradio's default, "once", ignored it, and the figures kept showing the earlier filters)
    gr.on([app.load, *(widget.change for widget in filters)], handler, filters, outputs, api_name="results",
          api_visibility="undocumented", trigger_mode="always_last")
