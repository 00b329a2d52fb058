"""The Results tab's colours over the shipped results_db: one colour per name, clearly distinct policies, each
other setting a shade of its policy's colour with a marker of its own, one name per setting.

Colour differences are computed here by hand (sRGB -> CIELAB under D65 -> CIEDE2000), apart from the code
under test, and checked against Sharma, Wu and Dalal's published test pairs.
"""

from __future__ import annotations

import itertools
import json
import math
from collections import defaultdict

import pytest

from kvviz.policies import make_policy, setting_label
from kvviz.store import QUALITY_METRICS, RANKING_METRICS, ROOT, Store, policy_added_parameters, setting_names
from kvviz.ui.results import Colours


def lab(colour: str) -> tuple[float, float, float]:
    channels = [int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    x = (0.4124564 * r + 0.3575761 * g + 0.1804375 * b) / 0.95047
    y = 0.2126729 * r + 0.7151522 * g + 0.0721750 * b
    z = (0.0193339 * r + 0.1191920 * g + 0.9503041 * b) / 1.08883

    def f(t):
        return t ** (1 / 3) if t > (6 / 29) ** 3 else t / (3 * (6 / 29) ** 2) + 4 / 29

    return 116 * f(y) - 16, 500 * (f(x) - f(y)), 200 * (f(y) - f(z))


def delta_e(first, second) -> float:
    """CIEDE2000, term by term as Sharma et al. (2005) write it."""
    (l1, a1, b1), (l2, a2, b2) = first, second
    c_bar = (math.hypot(a1, b1) + math.hypot(a2, b2)) / 2
    g = 0.5 * (1 - math.sqrt(c_bar ** 7 / (c_bar ** 7 + 25 ** 7)))
    a1p, a2p = (1 + g) * a1, (1 + g) * a2
    c1p, c2p = math.hypot(a1p, b1), math.hypot(a2p, b2)
    h1p = math.degrees(math.atan2(b1, a1p)) % 360 if c1p else 0.0
    h2p = math.degrees(math.atan2(b2, a2p)) % 360 if c2p else 0.0
    if c1p * c2p == 0:
        dhp = 0.0
    elif abs(h2p - h1p) <= 180:
        dhp = h2p - h1p
    else:
        dhp = h2p - h1p - 360 if h2p > h1p else h2p - h1p + 360
    d_l, d_c = l2 - l1, c2p - c1p
    d_h = 2 * math.sqrt(c1p * c2p) * math.sin(math.radians(dhp / 2))
    l_bar, cp_bar = (l1 + l2) / 2, (c1p + c2p) / 2
    if c1p * c2p == 0:
        hp_bar = h1p + h2p
    elif abs(h1p - h2p) <= 180:
        hp_bar = (h1p + h2p) / 2
    else:
        hp_bar = (h1p + h2p + 360) / 2 if h1p + h2p < 360 else (h1p + h2p - 360) / 2
    t = (1 - 0.17 * math.cos(math.radians(hp_bar - 30)) + 0.24 * math.cos(math.radians(2 * hp_bar))
         + 0.32 * math.cos(math.radians(3 * hp_bar + 6)) - 0.20 * math.cos(math.radians(4 * hp_bar - 63)))
    s_l = 1 + 0.015 * (l_bar - 50) ** 2 / math.sqrt(20 + (l_bar - 50) ** 2)
    s_c, s_h = 1 + 0.045 * cp_bar, 1 + 0.015 * cp_bar * t
    r_t = -2 * math.sqrt(cp_bar ** 7 / (cp_bar ** 7 + 25 ** 7)) * math.sin(
        math.radians(60 * math.exp(-(((hp_bar - 275) / 25) ** 2))))
    return math.sqrt((d_l / s_l) ** 2 + (d_c / s_c) ** 2 + (d_h / s_h) ** 2 + r_t * (d_c / s_c) * (d_h / s_h))


def distance(first: str, second: str) -> float:
    return delta_e(lab(first), lab(second))


def hue(colour: str) -> float:
    _, a, b = lab(colour)
    return math.degrees(math.atan2(b, a)) % 360


@pytest.mark.parametrize("first, second, expected", [
    ((50.0, 2.6772, -79.7751), (50.0, 0.0, -82.7485), 2.0425),  # Sharma et al. 2005, Table 1, pair 1
    ((50.0, 0.0, 0.0), (50.0, -1.0, 2.0), 2.3669),  # pair 7
    ((50.0, 2.5, 0.0), (73.0, 25.0, -18.0), 27.1492),  # pair 17
    ((60.2574, -34.0099, 36.2677), (60.4626, -34.1751, 39.4387), 1.2644)])  # pair 25
def test_the_colour_difference_here_is_ciede2000(first, second, expected):
    assert delta_e(first, second) == pytest.approx(expected, abs=1e-4)
    assert lab("#FFFFFF") == pytest.approx((100.0, 0.0, 0.0), abs=1e-3)


@pytest.fixture(scope="module")
def store() -> Store:
    return Store()  # the shipped results_db


@pytest.fixture(scope="module")
def colours(store) -> Colours:
    return Colours.of(store)


def settings_of(store: Store, source: str | None = None) -> dict[str, str]:
    """Each other setting's name -> its policy, as the store lists them."""
    others = store.other_settings(source=source)
    return dict(zip(setting_names(others.policy, others.setting), others.policy))


def test_every_name_the_results_can_show_has_a_colour_no_other_has(store, colours):
    names = set(store.options("policy")) | set(settings_of(store))
    assert names <= set(colours.map)
    assert len(set(colours.map.values())) == len(colours.map)  # however many settings are shown
    for name, colour in colours.map.items():  # each readable as a line on the page and in a plot area
        assert min(distance(colour, "#FFFFFF"), distance(colour, "#E5ECF6")) >= 25, (name, colour)
    assert Colours.of(store).map == colours.map  # the same store, the same colours


def test_policies_at_their_defaults_are_clearly_distinct(store, colours):
    """CIEDE2000 of about 10 and more is another colour, not a shade; the measured policies, which all share
    the quality figure with the box unticked, are kept further apart than every policy together (source:
    all), and further than the pinks the review found too close (inertia #FF6692, tova #FB00D1 and
    inertia alpha=0.9 #FC0080: 10-18 apart); two names shared #B68100."""
    assert 17 < distance("#FF6692", "#FB00D1") < 19 and distance("#FC0080", "#FF6692") < 12
    measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)  # the quality figure's
    everything = store.options("policy")
    assert len(measured) >= 18 and len(everything) >= 28
    closest = min((distance(colours(a), colours(b)), a, b) for a, b in itertools.combinations(measured, 2))
    # further apart than the pinks found too close (17.9), also as measured policies are added (20 today)
    assert closest[0] > distance("#FF6692", "#FB00D1") + 0.5, closest  # the old palette's: 12.6
    closest = min((distance(colours(a), colours(b)), a, b) for a, b in itertools.combinations(everything, 2))
    assert closest[0] >= 12, closest  # the old palette's: 4.9
    assert colours("full") == "#5A5A5A"  # the reference: neutral, as the grey reference lines are
    assert all(colours.symbol(name) == "circle" for name in everything)


def test_other_settings_are_shades_of_their_policys_colour_with_a_marker_each(store, colours):
    settings = settings_of(store)
    policies = store.options("policy")
    # the shipped R-KV rows ran before its pooling and redundancy parameters, with kvviz's earlier R-KV
    old_rkv = "rkv interval=16 pooling=head-mean redundancy=mean-cosine"
    assert {"inertia alpha=0.9", "avokv interval=16", old_rkv} <= set(settings)
    by_policy = defaultdict(list)
    for name, policy in settings.items():
        colour, own = colours(name), colours(policy)
        turn = abs((hue(colour) - hue(own) + 180) % 360 - 180)
        assert turn <= 16, (name, colour, own, turn)  # the policy's hue, lighter or darker
        others = min((distance(colour, colours(other)), other) for other in policies if other != policy)
        assert distance(colour, own) < others[0], (name, others)  # nearer to its own policy than to any other
        assert others[0] >= 8, (name, others)
        by_policy[policy].append(name)
    for policy, names in by_policy.items():  # a marker per setting, the policy's defaults circles
        symbols = [colours.symbol(name) for name in names]
        assert "circle" not in symbols and len(set(symbols)) == min(len(names), 16), (policy, symbols)
    # and across policies: the shipped reasoning sweep's one setting of each, in near shades, had one marker
    assert colours.symbol("avokv interval=16") != colours.symbol(old_rkv)
    if len(settings) <= 16:
        assert len({colours.symbol(name) for name in settings}) == len(settings)
    # Any two names in one figure stay apart beyond a just-noticeable difference (about 1-2), in colour alone
    shown = policies + list(settings)
    closest = min((distance(colours(a), colours(b)), a, b) for a, b in itertools.combinations(shown, 2))
    assert closest[0] >= 3, closest
    # the measured run's settings, which share the default view's quality figure when ticked, more so
    measured = store.options("policy", source="measured") + list(settings_of(store, "measured"))
    closest = min((distance(colours(a), colours(b)), a, b) for a, b in itertools.combinations(measured, 2))
    assert closest[0] >= 5, closest


def test_a_name_first_met_later_gets_a_colour_of_its_own_and_keeps_it(store):
    colours = Colours.of(store)
    before = dict(colours.map)
    shade, new = colours("inertia alpha=0.42"), colours("a-new-policy")
    assert colours.map == {**before, "inertia alpha=0.42": shade, "a-new-policy": new}
    assert shade not in before.values() and new not in before.values() and shade != new
    assert abs((hue(shade) - hue(colours("inertia")) + 180) % 360 - 180) <= 16
    assert colours.symbol("inertia alpha=0.42") != "circle" and colours.symbol("a-new-policy") == "circle"
    assert colours("inertia alpha=0.42") == shade and colours(None) is None


def shipped_rows():
    for shard in sorted(ROOT.glob("*/rows*.jsonl")):
        for line in shard.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def test_a_setting_is_named_as_the_compare_tab_names_it(store):
    """``inertia`` at alpha = 0 is the registry's ``single-step`` (the Compare tab's label for it): the store
    names every measured row by :func:`kvviz.policies.setting_label` of the policy it ran."""
    added = policy_added_parameters()  # a row from before a parameter existed ran its earlier value

    def ran(row) -> dict:
        return {**{key: value for key, value in added.get(row["policy"], {}).items()
                   if key not in (row.get("policy_params") or {})}, **row["params"]}

    def names(metrics) -> set[str]:
        return {setting_label(make_policy(row["policy"], **ran(row))) for row in shipped_rows()
                if row.get("source") == "measured" and row["metric"] in metrics}

    named = set(store.options("policy", source="measured", metrics=QUALITY_METRICS)) | set(
        settings_of(store, "measured"))
    # every setting's label, and its policy's (R-KV's shipped rows are all of another setting than its defaults)
    assert named == names(QUALITY_METRICS) | {label.split(" ")[0] for label in names(QUALITY_METRICS)}
    assert set(store.damage_ranking(source="measured", settings=True).policy) == names(RANKING_METRICS)
    assert "single-step" in named and not [name for name in named if name.startswith("inertia alpha=0 ")
                                           or name in ("inertia alpha=0", "inertia alpha=0.0")]
    # the paper's alpha = 0 column too
    assert "inertia alpha=0" not in settings_of(store, "paper")


def test_the_two_spellings_of_single_step_are_one_line_and_no_sample_counts_twice(store):
    """sweep-2k ran single-step, sweep-2k-inertia InertiaKV at alpha = 0 on the same samples at ρ = 0.9: one
    line, each cell once (the store keeps one row of a cell run by two sweeps)."""
    cells = defaultdict(dict)  # (task, compression) -> cell -> score
    spellings = defaultdict(set)
    for row in shipped_rows():
        if row.get("source") != "measured" or row["metric"] not in QUALITY_METRICS \
                or setting_label(make_policy(row["policy"], **row["params"])) != "single-step":
            continue  # a ranking sweep's rows are no generation's score
        cell = (row["sample"], row["seed"], row["prompt_len"], row.get("draw") or 0)
        cells[row["task"], row["compression"]].setdefault(cell, row["score"])
        spellings[cell + (row["task"], row["compression"])].add((row["policy"], json.dumps(row["params"])))
    assert any(len(spelled) == 2 for spelled in spellings.values())  # cells both sweeps ran
    quality = store.quality_vs_compression(policies=["single-step"], source="measured", settings=True)
    assert set(quality.policy) == {"single-step"}
    got = {(row.task, row.compression): (row.samples, row.score) for row in quality.itertuples()}
    assert got == {key: (len(scores), pytest.approx(sum(scores.values()) / len(scores)))
                   for key, scores in cells.items()}
    assert got["single_needle", 0.9][0] == 20  # not 40
    alpha = store.alpha_sensitivity(task="single_needle", source="measured")
    assert alpha[(alpha.compression == 0.9) & (alpha.alpha == 0.0)].samples.tolist() == [20]


def figure_colours(figure) -> dict[str, set[str]]:
    """Each legend name's colours in a figure (lines' and markers')."""
    found = defaultdict(set)
    for trace in figure.data:
        colour = (trace.line.color if "line" in trace and trace.line.color else None) or trace.marker.color
        if isinstance(colour, str):
            found[trace.name].add(colour)
    return found


@pytest.mark.parametrize("task, source, settings", [("(all)", "measured", True), ("(all)", "(all)", True),
                                                     ("single_needle", "measured", True), ("(all)", "measured", False),
                                                     ("(all)", "paper", True)])
def test_figures_keep_each_names_colour_across_figures_and_filters(shipped_query, colours, task, source, settings):
    out = shipped_query(source, task, settings, every=True)  # every policy
    figures = dict(zip(["quality", "hits", "paired", "comparison", "alpha", "refresh", "inertia", "speed", "cache",
                        "depth", "grid"], out[0::3]))
    for name in ("quality", "hits", "paired", "comparison", "speed", "cache"):
        found = figure_colours(figures[name])
        # the quality-vs-cache figure names its full-cache lines by what they average: the full cache's colour
        found = {("full" if label.startswith("full cache") else label): colour for label, colour in found.items()}
        names = [label for label in found if label in colours.map]
        assert len(names) == len(found), (name, set(found) - set(colours.map))  # every line is a policy's
        for label in names:
            assert found[label] == {colours(label)}, (name, label)
        assert len({colours(label) for label in names}) == len(names)
    for trace in figures["quality"].data:  # each setting's own marker, its policy's defaults circles
        assert trace.marker.symbol == colours.symbol(trace.name)
    if settings and source == "measured":
        drawn = {trace.name for trace in figures["quality"].data}
        assert {"inertia alpha=0.9", "single-step"} <= drawn and "inertia alpha=0" not in drawn
        for trace in figures["paired"].data:  # filled or open: the sign test; the shape: the setting
            assert {symbol.removesuffix("-open") for symbol in trace.marker.symbol} == {colours.symbol(trace.name)}


@pytest.mark.parametrize("source", ["measured", "(all)"])
def test_no_legend_of_every_setting_shown_scrolls(shipped_query, source):
    """With every setting shown, 17-27 legend entries scrolled in the 400-700 px max-length, speed and cache
    figures: Plotly bounds a legend beside the plot by the plot's height.  Each figure is at least as tall."""
    from kvviz.ui.results import LEGEND_ROW, legend_entries

    out = shipped_query(source, settings=True, every=True)  # the longest
    for figure in out[0::3]:
        margin = figure.layout.margin
        plot = (figure.layout.height or 450) - (100 if margin.t is None else margin.t) - (80 if margin.b is None
                                                                                          else margin.b)
        assert plot >= LEGEND_ROW * legend_entries(figure), (figure.layout.title.text, legend_entries(figure))
