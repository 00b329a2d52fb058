"""The Results tab's figures and filters as a browser review of them at 1000 and 1400 px read them, each check
on a small store of its own."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvviz.store import Store
from kvviz.ui.results import (
    ALL,
    LEGEND_ROW,
    SETTINGS_BOX,
    _dodge,
    _line_figure,
    _on_cut_axes,
    _refresh_figure,
    caption_of,
    query,
    with_reference,
)

FIGURES = ["quality", "hits", "paired", "comparison", "alpha", "refresh", "inertia", "speed", "cache", "depth", "grid",
           "ranking"]


def write_rows(folder: Path, rows: list[dict]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def sweep_store(tmp_path: Path, policies: list[str], cuts=(0.5, 0.9, 0.95), samples: int = 3) -> Store:
    """A measured sweep of ``policies`` (and the full cache) at ``cuts``, with timings, max-length hits and a
    needle grid: every figure that can draw the full cache has its rows."""
    base = {"source": "measured", "sweep": "s", "model": "m", "metric": "string_match", "params": {},
            "decode_tok_s": 10.0, "max_cache": 50, "max_decode_cache": 50, "prompt_len": 100,
            "hit_max_tokens": False}
    rows = [{**base, "task": task, "policy": "full", "compression": None, "sample": sample, "score": 1.0,
             "meta": {"length": 1000, "depth": 0.5}} for task in ("t", "needle_grid") for sample in range(samples)]
    rows += [{**base, "task": task, "policy": policy, "compression": cut, "sample": sample,
              "score": (index + sample) % 4 / 4, "decode_tok_s": 10.0 + index, "meta": {"length": 1000, "depth": 0.5}}
             for task in ("t", "needle_grid") for index, policy in enumerate(policies) for cut in cuts
             for sample in range(samples)]
    write_rows(tmp_path / "s", rows)
    return Store(tmp_path)


def figures(out) -> dict:
    return dict(zip(FIGURES, out[0::3]))


def note(fig) -> str:
    """The caveats the tab writes under ``fig``, as one text."""
    return " ".join(caption_of(fig)[1])


def test_the_policies_filter_keeps_the_full_cache_every_policy_is_read_against(tmp_path):
    """Picking tova in the Policies filter dropped the full cache's dotted line: it is the reference, not a
    policy one filters out.  The figures that draw it keep it; the policies not picked stay out."""
    assert with_reference(["tova"]) == ["tova", "full"] and with_reference(["full", "tova"]) == ["full", "tova"]
    assert with_reference([]) is None and with_reference(None) is None  # none picked: all
    store = sweep_store(tmp_path, ["tova", "h2o"])
    out = query(store, ALL, ALL, ["tova"], "measured")
    drawn = figures(out)
    for name in ("quality", "hits", "speed"):
        names = {trace.name for trace in drawn[name].data}
        assert "full" in names and "tova" in names and "h2o" not in names, (name, names)
    quality = {trace.name: trace for trace in drawn["quality"].data if trace.xaxis in (None, "x")}
    assert quality["full"].line.dash == "dot"  # the reference line, across the panel
    assert any(name.startswith("full cache") for name in (trace.name for trace in drawn["cache"].data))
    grid = [annotation.text for annotation in drawn["grid"].layout.annotations]
    assert "full cache" in grid and not any(text.startswith("h2o") for text in grid)
    assert set(out[1].policy) == {"tova", "full"}  # the table under the quality figure too


def test_a_picked_policy_with_no_rows_for_the_filters_is_named_with_where_its_rows_are(tmp_path):
    """A policy only the papers report, picked under the measured source, drew the full cache alone without a
    word: the quality figure names it and where its rows are; one drawn (as itself or at a setting) is not
    named, nor is a name that merely begins with it."""
    write_rows(tmp_path / "p", [{"source": "paper", "sweep": "p", "model": "m", "task": task, "policy": policy,
                                 "metric": "string_match", "params": {}, "compression": 0.5, "sample": 0,
                                 "score": 1.0} for task in ("A", "B") for policy in ("thinkv (impl.)", "full")]
               + [{"source": "paper", "sweep": "p", "model": "m", "task": "A", "policy": "attention only",
                   "metric": "auroc", "params": {}, "compression": None, "sample": 0, "score": 0.7}])
    store = sweep_store(tmp_path, ["tova"])  # measured tova and full on tasks t and needle_grid
    said = note(figures(query(store, ALL, ALL, ["thinkv (impl.)", "tova"], "measured"))["quality"])
    assert "thinkv (impl.): no rows for these filters (its rows: paper on A, B)" in said and "tova:" not in said
    said = note(figures(query(store, ALL, "A", ["tova"], ALL))["quality"])
    assert "tova: no rows for these filters (its rows: measured on needle_grid, t)" in said
    said = note(figures(query(store, ALL, "A", ["thinkv (impl.)"], ALL))["quality"])
    assert "no rows for these filters" not in said  # drawn there
    # "thinkv" would be drawn only by a setting of itself: "thinkv (impl.)" is another policy
    said = note(figures(query(store, ALL, "A", ["thinkv", "thinkv (impl.)"], ALL))["quality"])
    assert "thinkv: no rows at all" in said
    # rows of a damage probe's ranking, not quality: said so, not "no rows"
    said = note(figures(query(store, ALL, ALL, ["attention only"], ALL))["quality"])
    assert "attention only: only auroc rows (A: a damage probe's ranking" in said


def test_the_full_cache_line_spans_the_same_x_in_every_panel_that_shares_an_axis():
    """One task run at ρ 0.5 to 0.95 and another at 0.75 only: the dotted line ran across each panel's own
    cuts, a stub in the second while the panels share one x axis.  It spans every panel's cuts alike, per axis
    the panels share (a budget panel's, a paper panel's own)."""
    rows = [("measured", "t1", "full", None, None, 1.0), ("measured", "t1", "tova", 0.5, None, 0.8),
            ("measured", "t1", "tova", 0.95, None, 0.3), ("measured", "t2", "full", None, None, 0.6),
            ("measured", "t2", "tova", 0.75, None, 0.5), ("measured", "t3", "full", None, None, 0.4),
            ("measured", "t3", "tova", None, 80, 0.1), ("measured", "t3", "tova", None, 112, 0.2),
            ("measured", "t4", "full", None, None, 0.5), ("measured", "t4", "tova", None, 96, 0.3),
            ("paper", "P", "full", None, None, 50.0), ("paper", "P", "tova", 0.9, None, 40.0)]
    frame = pd.DataFrame([{"source": source, "model": "m", "task": task, "policy": policy, "compression": cut,
                           "absolute_budget": budget, "score": score}
                          for source, task, policy, cut, budget, score in rows])
    fig = _line_figure(frame, "compression", "score", "Q", "ρ", "mean score")
    spans = {fig.layout[trace.xaxis.replace("x", "xaxis")].matches or trace.xaxis: [] for trace in fig.data}
    for trace in fig.data:
        if trace.name == "full":
            spans[fig.layout[trace.xaxis.replace("x", "xaxis")].matches or trace.xaxis].append(list(trace.x))
    lines = sorted(spans.values())
    assert sorted(map(len, lines)) == [1, 2, 2]  # a paper panel, two budget panels, two compression panels
    for panels in lines:
        assert all(span == panels[0] for span in panels)  # the same extent in each panel of one axis
    assert [0.5, 0.95] in sum(lines, []) and [80.0, 112.0] in sum(lines, [])
    paper = next(span for panels in lines if len(panels) == 1 for span in panels)
    assert paper[0] < 0.9 < paper[1]  # one cut: a short line around it, not a point under its markers


def test_score_free_lines_span_the_same_r_in_every_panel():
    """The refresh figure's Score-Free lines are references too: one task run at r = 1..16 and another at
    r = 1..4, they stopped at 4 in the second panel."""
    frame = pd.DataFrame([{"source": "measured", "model": "m", "task": task, "compression": 0.9, "refresh": r,
                           "score": 0.5, "decode_tok_s": 10.0, "sweeps": "s"}
                          for task, rs in (("a", (0, 1, 16)), ("b", (0, 1, 4))) for r in rs])
    fig = _refresh_figure(frame)
    free = [list(trace.x) for trace in fig.data if "score-free" in trace.name]
    assert len(free) == 4 and all(span == [1, 16] for span in free)


def nudged(fig, cuts: list[float]) -> dict[float, list[float]]:
    """Each drawn point's x, by the cut (of ``cuts``) it is nearest to."""
    points = {cut: [] for cut in cuts}
    for trace in fig.data:
        for x in (trace.x if trace.x is not None else ()):
            points[min(cuts, key=lambda cut: abs(cut - x))].append(x)
    return points


def test_paired_points_nudged_apart_stay_nearer_their_own_cut_than_the_next(tmp_path):
    """Twelve policies at ρ 0.5, 0.9 and 0.95: nudged apart by 0.012 of the panel's span each, the ρ 0.9 and
    0.95 clusters interleaved.  Every point sits within half the smallest gap of its cut, and the clusters of
    neighbouring cuts keep apart."""
    policies = [f"p{index:02d}" for index in range(12)]
    store = sweep_store(tmp_path, policies)
    fig = figures(query(store, ALL, "t", [], "measured", reference="full", every=True))["paired"]
    assert {trace.name for trace in fig.data} == set(policies)
    for trace in fig.data:
        offsets = [x - cut for x, cut in zip(trace.x, (0.5, 0.9, 0.95))]
        assert max(map(abs, offsets)) < 0.05 / 2, trace.name
        assert max(offsets) - min(offsets) < 1e-9  # one policy's points moved alike: its line keeps its shape
    points = nudged(fig, [0.5, 0.9, 0.95])
    assert max(points[0.9]) < min(points[0.95])
    assert len({round(x, 9) for x in points[0.9]}) == 12  # still drawn apart


def test_coinciding_points_are_nudged_no_further_than_the_room_between_cuts():
    """Four policies at one value at ρ 0.9 and at 0.95 on an axis from 0.1: DODGE of that span (0.02 a step)
    spread each cluster over 0.06, past the 0.05 to the next cut."""
    rows = [(policy, cut, 0.0) for policy in ("a", "b", "c", "d") for cut in (0.9, 0.95)] + [("a", 0.1, 0.5)]
    frame = _on_cut_axes(pd.DataFrame([{"source": "measured", "model": "m", "task": "t", "policy": policy,
                                        "compression": cut, "score": score} for policy, cut, score in rows]))
    offsets = _dodge(frame, "score")
    assert offsets[frame.position == 0.9].abs().max() < 0.05 / 2
    assert offsets[frame.position == 0.9].nunique() == 4  # still apart
    assert (frame.position + offsets)[frame.position == 0.9].max() < (frame.position + offsets)[
        frame.position == 0.95].min()


def plot_height(fig) -> float:
    margin = fig.layout.margin
    return (fig.layout.height or 450) - (100 if margin.t is None else margin.t) - (80 if margin.b is None else margin.b)


def test_no_legend_is_taller_than_its_plot(tmp_path):
    """Plotly bounds a legend beside the plot by the plot's height, and scrolls the rest: with 25 policies the
    max-length, speed and cache figures (400-700 px) scrolled.  Each figure is as tall as its legend."""
    from kvviz.ui.results import legend_entries

    store = sweep_store(tmp_path, [f"p{index:02d}" for index in range(25)], cuts=(0.5, 0.9), samples=2)
    drawn = figures(query(store, ALL, ALL, [], "measured", reference="full", every=True))
    for name, fig in drawn.items():
        entries = legend_entries(fig)
        assert plot_height(fig) >= LEGEND_ROW * entries, (name, entries, fig.layout.height)
    assert legend_entries(drawn["hits"]) == 26 and legend_entries(drawn["speed"]) == 26


def test_every_right_hand_axis_of_the_refresh_figure_says_what_it_measures():
    """Only the right edge's panels titled their decode-speed axis; between two panels an untitled one read
    as the next panel's left axis."""
    frame = pd.DataFrame([{"source": "measured", "model": "m", "task": task, "compression": 0.9, "refresh": r,
                           "score": 0.5, "decode_tok_s": 10.0 + r, "sweeps": "s"}
                          for task in ("a", "b", "c", "d") for r in (1, 4)])
    fig = _refresh_figure(frame)
    speeds = {trace.yaxis for trace in fig.data if "tok/s" in trace.name}
    assert len(speeds) == 4
    for axis in speeds:
        assert fig.layout[axis.replace("y", "yaxis")].title.text == "decode tok/s (measured)", axis


def test_the_settings_box_has_a_row_of_its_own(tmp_path):
    """Beside Model, Task, Policies and Source, the checkbox's long label wrapped a word a line at 1000 px."""
    import gradio as gr

    from kvviz.ui.results import build_results_tab

    def row_of(block):  # Gradio puts a row's inputs in a Form of their own
        while not isinstance(block, gr.Row):
            block = block.parent
        return block

    def inputs(layout) -> list:
        return [found for child in layout.children
                for found in (inputs(child) if isinstance(child, gr.blocks.BlockContext) else [child])]

    with gr.Blocks() as app, gr.Tab("Results") as results_tab:
        build_results_tab(results_tab, sweep_store(tmp_path, ["tova"]))
    box = next(block for block in app.blocks.values()
               if isinstance(block, gr.Checkbox) and block.label.startswith(SETTINGS_BOX))
    assert inputs(row_of(box)) == [box]
    policies = next(block for block in app.blocks.values()
                    if isinstance(block, gr.Dropdown) and block.label == "Policies (none = all)")
    assert [block.label for block in inputs(row_of(policies))] == ["Model", "Task", "Policies (none = all)", "Source"]


def test_a_speed_panels_sweeps_wrap_under_what_it_holds():
    """Four sweeps' names on one line with what the panel holds ran into the next panel's title at 1000 px:
    each title line holds at most SWEEPS_WIDTH characters (a sweep's name is never broken at its hyphens),
    and the top margin grows by a line of panel title each."""
    from kvviz.ui.results import MARGIN, PANEL_TITLE_HEIGHT, SWEEPS_WIDTH, _speed_figure

    sweeps = ["sweep-2k", "sweep-2k-expected-attention", "sweep-2k-inertia", "sweep-2k-kvzip"]
    frame = pd.DataFrame([{"model": "m", "task": "t", "policy": policy, "compression": cut, "absolute_budget": None,
                           "score": 0.5, "decode_tok_s": 10.0, "decode_cache": 50.0, "sweeps": sweep}
                          for policy, cut, sweep in [("full", None, sweeps[0]), *(
                              (f"p{index}", 0.5, sweep) for index, sweep in enumerate(sweeps))]])
    fig = _speed_figure(frame, lambda policy: "#000000")
    title = fig.layout.annotations[0].text
    lines = title.split("<br>")
    assert lines[0] == "compression cells (ρ)" and len(lines) >= 3
    assert all(len(line) <= SWEEPS_WIDTH for line in lines)
    assert sorted(name.strip() for line in lines[1:] for name in line.split(",") if name.strip()) == sorted(sweeps)
    assert fig.layout.margin.t >= MARGIN["t"] + PANEL_TITLE_HEIGHT * len(lines)  # the title's line, then these


def test_every_title_and_note_line_fits_a_figure_in_a_1000_px_window(shipped_query):
    """Lines of notes and parentheticals were cut at the right edge of a figure in a 1000-px window (the page's
    768-px column): every small line under a title holds at most NOTE_WIDTH characters, every title's first
    line TITLE_WIDTH, whatever the filters (the shipped store, each source, every setting shown)."""
    import re

    from kvviz.ui.results import NOTE_WIDTH, TITLE_WIDTH

    for source in (ALL, "measured", "paper"):
        for settings in (False, True):
            for figure in shipped_query(source, settings=settings)[0::3]:
                text = figure.layout.title.text or ""
                first, *small = text.split("<br>")
                assert len(re.sub("<[^>]+>", "", first)) <= TITLE_WIDTH, first
                for line in small:
                    assert len(re.sub("<[^>]+>", "", line)) <= NOTE_WIDTH, line


def test_every_figure_leaves_the_strip_the_modebar_shows_in_free(shipped_query):
    """Plotly's modebar appears at the top right of a hovered figure and covered the end of a long title: every
    titled figure hangs its title below a strip of MODEBAR_STRIP pixels, with that much more top margin."""
    from kvviz.ui.results import MODEBAR_STRIP

    for figure in shipped_query(ALL, settings=True)[0::3]:
        if figure.layout.title.text:
            title = figure.layout.title
            assert (title.yref, title.y, title.yanchor) == ("container", 1, "top"), title.text[:40]
            assert title.pad.t >= MODEBAR_STRIP + 8, title.text[:40]
            assert figure.layout.margin.t >= title.pad.t + 20, title.text[:40]  # the title's line, under the strip


def test_an_empty_figure_says_which_filter_empties_it(tmp_path):
    """A model only a paper reports, under the measured source, emptied every figure with a bare "no rows for
    these filters"; now each says the model has paper rows only.  Policies = the reference alone says so, not
    that nothing pairs; a sweep of settings alone points to the settings box where the figure draws settings."""
    write_rows(tmp_path / "p", [{"source": "paper", "sweep": "p", "model": "big", "task": "A", "policy": policy,
                                 "metric": "string_match", "params": {}, "compression": 0.5, "sample": 0,
                                 "score": 1.0} for policy in ("tova", "full")])
    write_rows(tmp_path / "i", [{"source": "measured", "sweep": "i", "model": "m", "task": "t", "policy": "avokv",
                                 "metric": "string_match", "params": {"interval": 16}, "compression": 0.5,
                                 "sample": 0, "score": 1.0}])
    store = sweep_store(tmp_path, ["tova", "h2o"])

    def empties(*args, **kwargs) -> dict:
        drawn = figures(query(store, *args, **kwargs))
        return {name: [note.text for note in fig.layout.annotations if "these filters" in str(note.text)]
                for name, fig in drawn.items()}

    said = empties("big", ALL, [], "measured")
    only_paper = "<br>model big has only paper rows: choose Source paper or (all)"
    assert said["quality"] == ["no rows for these filters" + only_paper]
    assert said["speed"][0].endswith(only_paper)
    assert empties("m", ALL, [], "measured")["quality"] == []  # it has measured rows: nothing to say
    paired = figures(query(store, ALL, ALL, ["tova"], "measured", reference="tova"))["paired"]
    assert [note.text for note in paired.layout.annotations] == [
        "the policies chosen are only the reference, tova: pick another in Policies, or another reference"]
    said = empties(ALL, ALL, [], "measured", sweeps=["i"])
    assert said["quality"] == ["no rows for these filters<br>1 other setting hidden: tick 'Other parameter settings "
                               "too'"]
    assert said["alpha"] == ["no rows for these filters"]  # the settings box does not fill it


def test_two_models_needle_grids_are_never_averaged_into_one(tmp_path):
    """The grid query grouped by policy and cut, not model: a second model's grid would have been averaged into
    the first's cells (1.0 and 0.0 drawn as 0.5).  Each model gets its panels, named, and its own rows."""
    base = {"source": "measured", "sweep": "g", "task": "needle_grid", "metric": "string_match", "params": {},
            "policy": "tova", "compression": 0.5, "sample": 0, "meta": {"length": 1000, "depth": 0.5}}
    write_rows(tmp_path / "g", [{**base, "model": "a", "score": 1.0}, {**base, "model": "b", "score": 0.0}])
    store = Store(tmp_path)
    grid = store.needle_grid()
    assert grid[["model", "score"]].values.tolist() == [["a", 1.0], ["b", 0.0]]
    drawn = figures(query(store, ALL, ALL, [], ALL))["grid"]
    assert [trace.z.tolist() for trace in drawn.data] == [[[1.0]], [[0.0]]]
    assert [note.text for note in drawn.layout.annotations] == ["a<br>tova ρ=0.5", "b<br>tova ρ=0.5"]


def shown_policies(fig, table: pd.DataFrame) -> set[str]:
    """The distinct policies a figure draws: its legend's, and its table's (bars and heatmaps have no legend),
    each setting counted as its policy."""
    from kvviz.ui.results import policy_of

    names = {trace.name.split(" · ")[0] for trace in fig.data if trace.name and trace.showlegend is not False}
    names |= set(table.policy) if "policy" in table else set()
    return {policy_of(name) for name in names if not name.startswith(("full cache", "ρ=", "B="))}


def test_every_figure_over_the_shipped_store_reads_in_one_look(shipped_query):
    """A title carried up to ten lines of caveats and a legend up to 25 policies.  With the tab's default
    filters every figure over results_db/ has a title of at most two lines, draws at most eight policies, has a
    sentence on how to read it, and keeps its caveats in the note under it, none in its title."""
    from kvviz.ui.results import SECTIONS, SHOWN_MOST

    out = shipped_query("measured")
    drawn = {index: out[3 * index:3 * index + 3] for index in range(len(SECTIONS))}
    assert len(out) == 3 * len(SECTIONS)
    for index, (fig, table, _) in drawn.items():
        title = fig.layout.title.text or ""
        assert title.count("<br>") + title.count("\n") <= 1, (SECTIONS[index], title)
        policies = shown_policies(fig, table)
        assert len(policies) <= SHOWN_MOST, (SECTIONS[index], sorted(policies))
        read, notes = caption_of(fig)
        assert len(read) > 40 and read.endswith(".") and read.count(". ") == 0, (SECTIONS[index], read)
        for caveat in notes:
            assert caveat not in title and caveat[:30] not in title, (SECTIONS[index], caveat)
    quality = drawn[SECTIONS.index("Quality vs compression")][0]
    assert any(note.startswith("held over") for note in caption_of(quality)[1])  # a caveat, under the figure
    assert "full" in shown_policies(quality, drawn[0][1])  # the reference always counted among the eight


def test_show_all_policies_brings_the_others_back():
    """The default eight are a click away from the rest: 'Show all policies' draws every measured policy, and
    the default figure's note names those it left out."""
    from kvviz.ui.results import SHOW_ALL, sections

    store = Store()
    _, (default, table, _) = next(sections(store, ALL, ALL, [], "measured"))
    _, (every, everything, _) = next(sections(store, ALL, ALL, [], "measured", every=True))
    assert set(table.policy) < set(everything.policy) and len(set(everything.policy)) > 8
    left_out = set(everything.policy) - set(table.policy)
    said = next(note for note in caption_of(default)[1] if note.startswith(f"{len(left_out)} more policies ("))
    named = said.split(" (", 1)[1].split(")")[0].split(", ")
    assert SHOW_ALL in said and len(named) == 5 and named[-1] == "..." and set(named[:4]) <= left_out
    assert {trace.name for trace in every.data} >= set(left_out)


def test_only_the_first_section_is_open_and_each_figure_has_its_note_under_it(tmp_path):
    import gradio as gr

    from kvviz.ui.results import SECTIONS, build_results_tab

    with gr.Blocks() as app, gr.Tab("Results") as results_tab:
        build_results_tab(results_tab, sweep_store(tmp_path, ["tova"]))
    accordions = [block for block in app.blocks.values() if isinstance(block, gr.Accordion)]
    assert [block.label for block in accordions] == list(SECTIONS)
    assert [block.open for block in accordions] == [True] + [False] * (len(SECTIONS) - 1)
    for accordion in accordions:
        children = accordion.children
        plot = next(index for index, child in enumerate(children) if isinstance(child, gr.Plot))
        assert isinstance(children[plot + 1], gr.Markdown), accordion.label
    results = next(fn for fn in app.fns.values() if fn.api_name == "results")
    defaults = [block.preprocess(block.get_config()["value"]) for block in results.inputs]
    last = list(results.fn(*defaults))[-1]
    assert len(last) == 4 * len(SECTIONS) + 1  # and the filters it shows
    assert last[1].startswith("**How to read it:** Each line is a policy's mean score")


def test_inertia_settings_are_paired_against_its_defaults_from_any_sweep(tmp_path):
    """A sweep of InertiaKV's α, refresh, score-free and layer weighting lands in results_db/ without code
    changes: each setting is paired against InertiaKV at its defaults, with its interval, sign test and the
    smallest difference the run could detect."""
    from kvviz.ui.results import SECTIONS, inertia_family

    base = {"source": "measured", "sweep": "prose-2k-inertia", "model": "m", "task": "prose_needle",
            "metric": "string_match", "seed": 0, "prompt_len": 100, "max_new_tokens": 10, "chat": False}
    runs = [("inertia", {}), ("inertia", {"alpha": 0.5}), ("inertia", {"refresh": 16}), ("score-free", {}),
            ("inertia-decoupled", {})]
    rows = [{**base, "policy": "full", "params": {}, "compression": None, "sample": sample, "score": 1.0}
            for sample in range(12)]
    rows += [{**base, "policy": policy, "params": params, "compression": 0.9, "sample": sample,
              "score": float(sample % (index + 2) != 0)}
             for index, (policy, params) in enumerate(runs) for sample in range(12)]
    write_rows(tmp_path / "prose-2k-inertia", rows)
    store = Store(tmp_path)
    assert {"inertia", "score-free", "single-step", "inertia-lazy", "inertia-decoupled"} <= set(inertia_family(store))
    at = 3 * SECTIONS.index("InertiaKV settings vs its defaults")
    figure, table = query(store, ALL, ALL, [], "measured")[at:at + 2]
    assert set(table.policy) == {"inertia alpha=0.5", "inertia refresh=16", "score-free", "inertia-decoupled"}
    assert {"low", "high", "p_sign", "detectable", "wins", "losses"} <= set(table.columns)
    notes = " ".join(caption_of(figure)[1])
    assert "sign test (McNemar's on 0/1 scores) p < 0.05: " in notes and "smallest |Δ| these runs could detect" in notes
