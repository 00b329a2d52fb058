"""The colour and marker each policy keeps in every figure of the Results tab.

Each policy at its defaults gets a clearly different colour; each other setting of it a shade of its hue
with a marker of its own; the full cache, every figure's reference, is grey.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
from plotly.colors import qualitative

from ...store import QUALITY_METRICS, Store, setting_names

# Not D3 after Plotly: its first hues repeat Plotly's (blue, orange, green, red, purple, pink); nor the
# Dark24 hues closest to Plotly's (pink, red, violet, orange).
PALETTE = qualitative.Plotly + [c for c in qualitative.Dark24 if c not in ("#E15F99", "#FB0D0D", "#DA16FF", "#EB663B")]


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

