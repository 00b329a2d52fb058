"""What the Results tab draws for one combination of filters: each section's figure, table and CSV."""

from __future__ import annotations

import functools
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gradio as gr
import pandas as pd

from ...held import quality_vs_depth
from ...stats import paired_table
from ...store import FULL_CACHE_FLOOR, QUALITY_METRICS, Store, held_over_note, setting_names, suite_notes
from .colours import Colours
from .layout import _caption, _legend_room, _versus
from .lines import DEFAULT_POLICIES, _depth_figure, _hits_figure, _line_figure, _paired_figure, _refresh_figure, curated
from .pairing import PAIRINGS, inertia_figure, matched_memory, paired
from .panels import _cache_figure, _comparison_figure, _grid_figure, _ranking_figure, _speed_figure

ALL = "(all)"
# The start of the settings box's label, which the quality figure names where it hides other settings
SETTINGS_BOX = "Other parameter settings too"
SECTIONS = ("Quality vs compression", "Max-length hits vs compression", "Paired differences", "Measured vs paper",
            "α sensitivity", "Refresh interval", "InertiaKV settings vs its defaults", "Quality vs decode speed",
            "Quality vs cache held", "Quality vs needle depth", "Needle in a haystack grid",
            "Damage ranking (AvoKV-E Table 3)")
OPEN = ("Quality vs compression",)  # the sections open when the tab loads: the others one click each
# The ranking figure is AvoKV-E's table: its method first, then the paper's own scorers before ours
RANKING_FIRST = ("avokv", *DEFAULT_POLICIES)

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




def query(store: Store, model: str, task: str, policies: list[str], source: str, suite: str | None = None,
          colours: Colours | None = None, reference: str | None = None, settings: bool = False,
          sweeps: list[str] | None = None, every: bool = False, pairing: str = PAIRINGS[0]):
    """Every figure, its table and its CSV for the current filters, in the tab's output order."""
    drawn = dict(sections(store, model, task, policies, source, suite, colours, reference, settings, sweeps, every,
                          pairing))
    return tuple(item for index in range(len(SECTIONS)) for item in drawn[index])


@dataclass
class View:
    """The filters as the figures read them: None for "(all)", and what each figure shares, read once."""

    store: Store
    model: str | None
    task: str | None
    policies: list[str] | None
    source: str | None
    suite: str
    colours: Colours
    reference: str | None
    settings: bool
    sweeps: tuple[str, ...] | None
    every: bool
    pairing: str

    @property
    def drawn(self) -> list[str] | None:
        """The policies a figure draws: those chosen and the full cache, the reference each is read against."""
        return with_reference(self.policies)

    def limit(self, frame: pd.DataFrame, first=DEFAULT_POLICIES) -> tuple[pd.DataFrame, list[str]]:
        """``frame`` cut to the default policies unless policies were chosen or every one asked for."""
        return (frame, []) if self.policies or self.every else curated(frame, first)

    @functools.cached_property
    def quality(self) -> pd.DataFrame:
        return self.store.quality_vs_compression(self.task, self.model, self.drawn, self.source,
                                                 settings=self.settings, sweeps=self.sweeps)

    @functools.cached_property
    def speed(self) -> pd.DataFrame:
        speed = self.store.speed_vs_quality(self.task, self.model, self.drawn, settings=self.settings,
                                            sweeps=self.sweeps)
        return speed.iloc[0:0] if self.source == "paper" else speed  # the papers report no per-run speed

    @functools.cached_property
    def hidden(self) -> pd.DataFrame:
        """The other settings the figures at defaults leave out (none when the settings box is ticked)."""
        if self.settings:
            return pd.DataFrame()
        return self.store.other_settings(self.task, self.model, self.policies, self.source, self.sweeps)


def _view(store, model, task, policies, source, suite, colours, reference, settings, sweeps, every,
          pairing) -> View:
    suites = store.comparable_suites()
    references = store.options("policy", source="measured", metrics=QUALITY_METRICS)
    return View(store, None if model in (None, ALL) else model, None if task in (None, ALL) else task,
                policies or None, None if source in (None, ALL) else source,
                suite if suite in suites else (suites[0] if suites else "RULER"), colours or Colours.of(store),
                reference if reference in references else default_reference(references), bool(settings),
                tuple(sweeps) if sweeps else None, bool(every), pairing if pairing in PAIRINGS else PAIRINGS[0])


def sections(store: Store, model: str, task: str, policies: list[str], source: str, suite: str | None = None,
             colours: Colours | None = None, reference: str | None = None, settings: bool = False,
             sweeps: list[str] | None = None, every: bool = False, pairing: str = PAIRINGS[0]):
    """:func:`query`'s sections one at a time, as ``(index in SECTIONS, (figure, table, CSV update))``: those
    open when the tab loads (``OPEN``) first, which a reader then sees while the others are drawn.  Without
    chosen policies or ``every``, each figure draws the default policies (:func:`curated`)."""
    view = _view(store, model, task, policies, source, suite, colours, reference, settings, sweeps, every, pairing)
    builders = [_quality, _hits, _paired, _comparison, _alpha, _refresh, _inertia, _speed, _cache, _depth, _grid,
                _ranking]
    # An empty figure says which filter empties it: a source without the chosen model's, task's or sweep's rows,
    # or (in the figures that the settings box fills) the settings it hides
    hint = empty_filters_hint(store, view.model, view.task, view.source, view.sweeps)
    for index in sorted(range(len(SECTIONS)), key=lambda index: SECTIONS[index] not in OPEN):
        figure, frame, name = builders[index](view)
        why = hint or (_hidden_hint(view) if builders[index] in (_quality, _hits, _paired, _speed, _cache) else "")
        for note in figure.layout.annotations if why else ():
            if str(note.text).endswith("these filters"):
                note.text += f"<br>{why}"
        _legend_room(figure)
        yield index, (figure, frame.round(4), gr.update(value=_csv(frame, name)))  # the CSV keeps full precision


def _hidden_hint(view: View) -> str:
    count = len(view.hidden)
    return f"{count} other setting{'s' * (count > 1)} hidden: tick '{SETTINGS_BOX}'" if count else ""


def _quality(view: View) -> tuple:
    quality, more = view.limit(view.quality)
    # One nominal B is not one memory size: the quality and paired figures name the cells that held well over it
    notes = [] if view.source == "paper" else [held_over_note(view.speed)]
    notes += [weak_full_cache_note(quality), absent_note(view.store, view.quality, view.policies), *more]
    if len(view.hidden):  # a policy run only at interval 16 is otherwise unseen
        names = setting_names(view.hidden.policy, view.hidden.setting)
        notes.append(f"{len(names)} other setting{'s' * (len(names) > 1)} hidden ({', '.join(names[:4])}"
                     + (", ..." if len(names) > 4 else "") + f"): tick '{SETTINGS_BOX}'")
    what = "every setting run, each its own line" if view.settings else "each policy at its defaults"
    figure = _line_figure(quality, "compression", "score",
                          f"Quality vs {_versus(quality)} ({what}; bars: ± 1 standard error{_draws_note(quality)})",
                          "compression ρ", "mean score", view.colours, notes=notes,
                          read="Each line is a policy's mean score at each cut (higher is better); the dotted grey "
                               "line is the full cache, which every policy is read against.")
    return figure, quality, "quality_vs_compression"


def _hits(view: View) -> tuple:
    hits = view.store.max_length_hits(view.task, view.model, view.drawn, settings=view.settings, sweeps=view.sweeps)
    hits, more = view.limit(hits.iloc[0:0] if view.source == "paper" else hits)
    figure = _hits_figure(hits, view.colours, view.settings, "the papers print max-length hits per table, not per "
                          "run: choose the measured source" if view.source == "paper" else None)
    return _noted(figure, more), hits, "max_length_hits"


def _noted(figure, notes: list[str]):
    return _caption(figure, notes=notes)


def _paired(view: View) -> tuple:
    reference, policies = view.reference, view.policies
    differences = paired(view.store, reference, view.task, view.model, tuple(policies) if policies else None,
                         view.settings, view.sweeps) \
        if reference and view.source != "paper" else paired_table(pd.DataFrame())
    notes = []
    if view.pairing == PAIRINGS[0] and reference:
        differences, notes = matched_memory(view.store, differences, view.speed, reference, view.task, view.model)
        notes += ["equal-memory pairs come from every sweep: the sweeps filter picks the same-cut pairs only"] \
            if view.sweeps and any(differences.paired_at != "same cut") else []
    differences, more = view.limit(differences)
    if reference and not differences.empty and view.pairing != PAIRINGS[0]:  # matched memory says it instead
        reference_held = view.store.speed_vs_quality(view.task, view.model, [reference], sweeps=view.sweeps)
        notes.append(held_over_note(pd.concat([view.speed[view.speed.policy.isin(differences.policy)],
                                               reference_held])))
    # A suite's panel averages every task of it that pairs; Measured vs paper leaves out those its full
    # cache fails, so "mean of 3 tasks" here and "mean over 2" there need their tasks named
    suites = differences[differences.tasks != differences.task][["task", "tasks"]].drop_duplicates() \
        if not differences.empty else differences
    notes = [f"{row.task}: {row.tasks} (a difference needs no full cache: none is left out)"
             for row in suites.itertuples()] + notes + more
    figure = _paired_figure(differences, reference, view.colours, _unpaired(view), notes)
    return figure, differences, f"paired_vs_{reference}"


def _unpaired(view: View) -> str | None:
    """Why no pair is drawn, where a filter says why."""
    if view.source == "paper":
        return "papers print no per-sample scores: choose the measured source to pair samples"
    if view.reference and view.policies and set(view.policies) <= {view.reference, "full"}:
        return (f"the policies chosen are only the reference, {view.reference}: pick another in Policies, or "
                "another reference")
    return None


def _comparison(view: View) -> tuple:
    comparison = view.store.paper_comparison(view.suite, view.policies)
    notes = suite_notes(comparison, view.store.left_out_of_suite(view.suite, view.policies), view.suite) \
        if len(comparison) else []
    comparison, more = view.limit(comparison)
    figure = _comparison_figure(comparison, view.suite, view.colours, [*notes, *more])
    return figure, comparison, f"measured_vs_paper_{view.suite}"


def _alpha(view: View) -> tuple:
    alpha = view.store.alpha_sensitivity(view.task, view.model, view.source, sweeps=view.sweeps)
    figure = _line_figure(alpha, "alpha", "score", "α sensitivity (InertiaKV; bars: ± 1 standard error; a cut "
                          "run at fewer than three α: markers only)", "α", "mean score", join_fewer_than=3,
                          read="Each line is one cut: a flat line means the EMA coefficient α changes nothing "
                               "there; the paired figure of InertiaKV's settings says whether a step is real.")
    return figure, alpha, "alpha_sensitivity"


def _refresh(view: View) -> tuple:
    refresh = view.store.refresh_curve(view.task, view.model, view.source, sweeps=view.sweeps)
    return _refresh_figure(refresh), refresh, "refresh_curve"


def _inertia(view: View) -> tuple:
    return inertia_figure(view.store, view.task, view.model, view.sweeps, view.colours, view.source)


def _speed(view: View) -> tuple:
    speed, more = view.limit(view.speed)
    return _noted(_speed_figure(speed, view.colours), more), speed, "speed_vs_quality"


def _cache(view: View) -> tuple:
    speed, more = view.limit(view.speed)
    return _noted(_cache_figure(speed, view.colours), more), speed, "quality_vs_cache"


def _depth(view: View) -> tuple:
    if view.source == "paper":
        depth = quality_vs_depth(view.store, view.task, view.model, []).iloc[0:0]
    else:
        depth = quality_vs_depth(view.store, view.task, view.model, view.drawn,
                                 sweeps=list(view.sweeps) if view.sweeps else None)
    depth, more = view.limit(depth.sort_values("policy", kind="stable"))  # the table holds what is drawn
    depth = depth.sort_index()
    return _noted(_depth_figure(depth, view.colours, chosen=True), more), depth, "quality_vs_depth"


def _grid(view: View) -> tuple:
    # The grid is a task of its own: another task chosen leaves it empty, saying why
    grid = view.store.needle_grid(view.model, view.drawn, view.source, sweeps=view.sweeps)
    empty = "no needle-grid rows for these filters"
    if view.task not in (None, "needle_grid"):
        grid, empty = grid.iloc[0:0], f"the grid is the task needle_grid: choose it (or {ALL}) as the Task"
    grid, more = view.limit(grid)
    return _noted(_grid_figure(grid, empty), more), grid, "needle_grid"


def _ranking(view: View) -> tuple:
    # The papers' ranking table is the reference this figure exists for: like Measured vs paper, model, task and
    # source leave it (and the measured rows) alone; the policies, and for measured rows the sweeps, apply
    store, policies = view.store, view.policies
    papers = store.damage_ranking(None, None, policies, "paper")  # first: its scorers fill the default after ours
    ranking = pd.concat([papers, store.damage_ranking(None, None, policies, "measured", settings=view.settings,
                                                      sweeps=view.sweeps)], ignore_index=True)
    hidden = [] if view.settings else sorted(
        set(store.damage_ranking(None, None, policies, "measured", settings=True, sweeps=view.sweeps).policy)
        - set(ranking.policy))
    notes = [f"{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden ({', '.join(hidden[:4])}"
             f"{', ...' * (len(hidden) > 4)}): tick '{SETTINGS_BOX}'"] if hidden else []
    ranking, more = view.limit(ranking, RANKING_FIRST)
    ranking = ranking.sort_values("source", kind="stable", key=lambda source: source != "measured")
    return _ranking_figure(ranking, view.colours, notes + more), ranking, "damage_ranking"


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

    # as itself or a setting of it ("avokv interval=16"; "thinkv (impl.)" is not "thinkv")
    def drawn(policy: str) -> bool:
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
