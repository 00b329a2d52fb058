"""``kvviz results``: the stored sweeps as tables -- quality per policy and cut of the cache, paired
differences, measured vs paper, damage rankings."""

from __future__ import annotations

import re
import sys
from pathlib import Path


def cmd_results(args) -> int:
    """Print the stored sweeps as tables: mean score (and samples) per policy x compression (or absolute
    budget) for each task."""
    store, root, policies = _opened(args)
    if args.paper:
        return _print_paper(store, args, policies)
    if args.ranking:
        return _print_ranking_paired(store, root, args, policies) if args.vs else _print_ranking(store, args, policies)
    if args.vs:
        return _print_paired(store, root, args, policies)
    return _print_quality(store, args, policies)


def _opened(args):
    """The store the options name, its root and the ``--policies`` asked for, every filter and combination of
    options checked; ``args.sweep_list`` is set to the ``--sweeps`` asked for."""
    from ..store import ROOT, Store

    root = Path(args.root) if args.root else ROOT
    store = Store(root)
    for problem in store.problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not store.shards:  # nothing to filter: say where results were looked for, not "no rows for these filters"
        raise ValueError(f"no sweep results under {root} (expected {root}/<sweep>/rows*.jsonl, or "
                         f"{root}/rows*.jsonl for one sweep's folder); run `kvviz bench run CONFIG` or pass --root")
    policies = [name.strip() for name in args.policies.split(",") if name.strip()] if args.policies else None
    if policies == []:  # e.g. --policies , : otherwise "no rows for these filters together"
        raise ValueError("--policies names no policy; give registry names, e.g. --policies inertia,tova, or leave "
                         "it out for every policy")
    sweeps = [name.strip() for name in args.sweeps.split(",") if name.strip()] if args.sweeps else None
    if sweeps == []:
        raise ValueError("--sweeps names no sweep; give folder names under results_db/, e.g. --sweeps sweep-2k, or "
                         "leave it out for every sweep")
    _check_filters(store, root, {"--task": ("task", [args.task] if args.task else []),
                                 "--model": ("model", [args.model] if args.model else []),
                                 "--policies": ("policy", policies or []),
                                 "--sweeps": ("sweep", sweeps or [])})
    args.sweep_list = sweeps  # for the paired and ranking tables
    if args.paper and (args.vs or args.ranking):
        raise ValueError(f"--paper and {'--vs' if args.vs else '--ranking'} are two different tables; give one of "
                         "them")
    if args.settings and args.paper:
        raise ValueError("--paper compares each policy at its defaults: drop --settings")
    ignored = [flag for flag, value in (("--task", args.task), ("--model", args.model), ("--source", args.source),
                                        ("--sweeps", args.sweeps)) if value]
    if args.paper and ignored:  # the comparison is every model's paper and measured rows over the suite's tasks
        raise ValueError(f"--paper compares every model's paper and measured rows over all of {args.paper}'s tasks, "
                         f"which {' and '.join(ignored)} would not change: drop {' and '.join(ignored)} "
                         "(--policies applies)")
    return store, root, policies


def _print_paper(store, args, policies) -> int:
    """``--paper SUITE``: each policy's score relative to the full cache's, the paper's and the measured."""
    from ..notes import suite_notes

    frame = store.paper_comparison(args.paper, policies)
    if frame.empty:
        raise ValueError(f"no paper and measured rows on {args.paper!r}; "
                         f"comparable: {', '.join(store.comparable_suites()) or 'none'}")
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return 0
    table = frame.pivot_table(index=["origin", "model", "policy"], columns="compression", values="relative")
    print(f"{args.paper}: score / full-cache score (paper: printed aggregate; measured: mean over tasks)")
    print(table.round(3).to_string())
    for note in suite_notes(frame, store.left_out_of_suite(args.paper, policies), args.paper):
        print(note)
    return 0


def _print_quality(store, args, policies) -> int:
    """The default tables: per source, model and task, each policy's mean score by compression or budget."""
    sweeps = args.sweep_list
    frame, others = _quality_frame(store, args, policies)
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return 0
    others_here = store.other_settings(args.task, args.model, policies, args.source, sweeps, per_table=True)
    measured = store.speed_vs_quality(args.task, args.model, policies, settings=args.settings, sweeps=sweeps)
    speed = _speed_by_kind(measured)
    for (source, model, task), part in frame.groupby(["source", "model", "task"]):
        _print_quality_table(source, model, task, part, speed)
        if source == "measured":
            _print_cache_over_budget(measured[(measured.model == model) & (measured.task == task)])
        if not args.settings:
            _print_hidden_settings(others_here[(others_here.model == model) & (others_here.task == task)
                                               & (others_here.source == source)])
    if args.source != "paper":  # papers print no per-run max-length hits
        _print_max_length_hits(store.max_length_hits(args.task, args.model, policies, settings=args.settings,
                                                     sweeps=sweeps))
    # The whole list, and where else the settings are shown, once under all the tables.
    if len(others) and not args.settings:
        print(f"\nnot in these tables: {int(others.rows.sum())} rows with non-default parameters (policy, setting, "
              f"rows): {_settings_listed(others)}; --settings lists each setting as its own row, --vs POLICY "
              "--settings pairs them, and the app's Results tab plots the α and refresh sweeps")
    return 0


def _quality_frame(store, args, policies):
    """The quality rows these filters match, and the non-default settings they leave out; an empty result
    refused with what the filters do match."""
    sweeps = args.sweep_list
    frame = store.quality_vs_compression(args.task, args.model, policies, args.source, settings=args.settings,
                                         sweeps=sweeps)
    others = store.other_settings(args.task, args.model, policies, args.source, sweeps)
    if frame.empty and len(others):  # e.g. AvoKV-E run only at interval=16
        raise ValueError("these filters match only rows with non-default parameters (" + _settings_listed(others)
                         + "): add --settings to list them")
    if frame.empty and len(store.damage_ranking(args.task, args.model, policies, args.source, True, sweeps)):
        raise ValueError("these filters match only damage-ranking rows (AUROC, AP, ...: how a policy ranks the "
                         "damage of removing one entry): add --ranking to print them")
    if frame.empty:  # each value is stored (checked above), but not in combination
        raise ValueError("no rows for these filters together; drop one, or see `kvviz results --help`")
    return frame, others


def _speed_by_kind(measured):
    """Mean decode tok/s per model, task, policy and kind of cut (ρ or B)."""
    # Compression and budget cells come from different sweeps, run at other times under other loads: a mean
    # over both would compare nothing, so each kind gets its own speed column where a table holds both
    kinds = measured.assign(kind=measured.absolute_budget.isna().map({True: "ρ", False: "B"}))
    return kinds.groupby(["model", "task", "policy", "kind"]).decode_tok_s.mean()


def _print_quality_table(source: str, model: str, task: str, part, speed) -> None:
    """One table: each policy's mean score (and count) per cut, the full cache and draws in its title."""
    import pandas as pd

    draws = int(part.draws.max())
    digits = _score_digits(part.score)
    full = part[part.policy == "full"]
    part = part[part.policy != "full"]
    cells = part.assign(cell=[f"{s:.{digits}f} ({n})" for s, n in zip(part.score, part.samples)])
    table = _by_cut(cells, "cell")
    if source == "measured":
        present = [kind for kind in ("ρ", "B") if (part.absolute_budget.isna() if kind == "ρ"
                                                     else part.absolute_budget.notna()).any()]
        for kind in present:  # decode tok/s, the mean over the row's cells of that kind
            table["tok/s" if len(present) == 1 else f"tok/s ({kind} cells)"] = [
                f"{speed.get((model, task, p, kind), float('nan')):.2f}" for p in table.index]
    # The count in brackets is samples for a sweep, but how many printed figures a paper cell averages (one
    # number can be printed in several tables): said once per table, not guessed.
    counted = "mean score (samples)" if source == "measured" else "mean printed score (figures)"
    print(f"\n{task} · {model} · {source} · {counted}"
          + (f" · full cache {full.score.iloc[0]:.{digits}f} ({full.samples.iloc[0]})" if len(full) else "")
          + (f" · each sample the mean of up to {draws} sampled draws" if draws > 1 else ""))
    with pd.option_context("display.width", 200):
        print(table.to_string())


def _print_hidden_settings(hidden) -> None:
    """Without --settings each table is every policy at its defaults: say, under it, what it hides."""
    from ..store import setting_names

    if len(hidden):
        print(f"{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden "
              f"({', '.join(setting_names(hidden.policy, hidden.setting))}): use --settings")


RANKING_COLUMNS = {"auroc": "AUROC", "ap": "AP", "topk_recall": "top-k rec", "false_safe_rate": "false-safe",
                   "spearman": "Spearman"}


def _ranking_frame(store, args, policies):
    """The damage-ranking rows for the filters, or a ValueError saying whether another filter has some."""
    frame = store.damage_ranking(args.task, args.model, policies, args.source, settings=args.settings,
                                 sweeps=args.sweep_list)
    if frame.empty:
        if len(store.damage_ranking(settings=True)):
            raise ValueError("no damage-ranking rows for these filters together (`kvviz results --ranking "
                             "--settings` lists every one); drop a filter")
        raise ValueError("no damage-ranking rows stored; run `kvviz bench ranking configs/ranking-arithmetic.toml`")
    return frame


def _print_ranking(store, args, policies) -> int:
    """Per source, model, task and sweep, each policy's damage ranking (AvoKV-E's Table 3 metrics): a measured
    cell is the mean over traces ± its standard error, a paper cell the printed figure."""
    import pandas as pd

    from ..store import ranking_caveats

    frame = _ranking_frame(store, args, policies)
    if args.csv:
        frame.to_csv(sys.stdout, index=False)
        return 0
    frame = frame.assign(paper=frame.paper.fillna(""))  # measured rows have none; groupby drops a null key
    for (source, _, model, task, sweep), part in frame.groupby(["source", "paper", "model", "task", "sweep"],
                                                               sort=False):
        measured = source == "measured"
        cells = part.assign(cell=[f"{score:.3f}" + (f" ± {stderr:.3f}" if measured and stderr == stderr else "")
                                  for score, stderr in zip(part.score, part.stderr)])
        table = cells.pivot(index="policy", columns="metric", values="cell")
        table = table[[metric for metric in RANKING_COLUMNS if metric in table]].rename(columns=RANKING_COLUMNS)
        # by AUROC, best first; a policy with no AUROC row (undefined in every trace) after them
        by_auroc = list(part[part.metric == "auroc"].sort_values("score", ascending=False).policy)
        table = table.loc[by_auroc + sorted(set(table.index) - set(by_auroc))]
        if measured:
            counts = part.groupby("policy")[["traces", "candidates"]].max()
            table["traces"] = counts.traces.astype(int)
            table["ranked"] = counts.candidates.map(lambda count: "?" if pd.isna(count) else int(count))
            caveats = ranking_caveats(part).iloc[0]
            past_end, by_step = int(caveats.past_end), int(caveats.ended_by_step)
            heading = (f"{sweep}: mean over traces ± standard error; probed at step {part.step.iloc[0]}; ranked: "
                       "entries every policy judged, summed over traces"
                       + (f", {caveats.prompt_share:.0%} of them the prompt's"
                          if caveats.prompt_share == caveats.prompt_share else "")
                       + (f"; in {past_end} trace(s) the answer ended within or before the replay"
                          + (f" ({by_step} at or before the step)" if by_step else "") if past_end else ""))
        else:
            # what every row's note says after naming its own row ("row 'attention only'; ranking vs ...")
            shared = {re.sub(r"^row '[^']*'; ", "", note) for note in part.notes.dropna()}
            heading = part.paper.iloc[0] + (f": {shared.pop()}" if len(shared) == 1 else "")
        print(f"\n{task} · {model} · {source} · damage ranking ({heading})")
        with pd.option_context("display.width", 200, "display.max_colwidth", 40):
            print(table.to_string())
    if not args.settings:  # as the quality tables say what they leave out
        every = store.damage_ranking(args.task, args.model, policies, args.source, settings=True,
                                     sweeps=args.sweep_list)
        hidden = sorted(set(every.policy) - set(frame.policy))
        if hidden:
            print(f"\n{len(hidden)} other setting{'s' * (len(hidden) > 1)} hidden ({', '.join(hidden)}): "
                  "use --settings")
    print("\n(high damage: the top decile of each trace's oracle damage; top-k rec: its share among the k highest "
          "utilities; false-safe: its share among the k lowest, the first evicted (random: about 0.1); AUROC 0.5 "
          "and Spearman 0 are chance; `--vs POLICY` pairs the policies trace by trace)")
    return 0


def _print_ranking_paired(store, root: Path, args, policies) -> int:
    """Per model, task and sweep, each policy's damage-ranking metrics against ``--vs``'s on the same traces:
    mean Δ, its paired-bootstrap interval, wins/ties/losses and the sign test, as ``--vs`` prints for quality.
    The false-safe rate is better lower, so its Δ is the reduction (reference − policy): a win is a better
    ranking in every column."""
    import pandas as pd

    from ..stats import ALPHA, paired_table

    if args.source == "paper":
        raise ValueError("--vs pairs measured traces; the papers print one figure over all their traces: drop "
                         "--source paper")
    if policies and set(policies) <= {args.vs}:
        raise ValueError(f"the policies chosen are only the reference, {args.vs}: add another to --policies, or "
                         "drop it")
    pairs = store.ranking_pairs(args.vs, args.task, args.model, policies, settings=args.settings,
                                sweeps=args.sweep_list)
    if pairs.empty:
        ranked = sorted(set(store.damage_ranking(source="measured").policy))
        raise ValueError(f"--vs {args.vs}: no measured damage-ranking traces pair with it under these filters; "
                         f"ranked: {', '.join(ranked) or 'none'} (under {root})")
    lower_better = pairs.metric == "false_safe_rate"
    pairs = pairs.assign(score=pairs.score.where(~lower_better, -pairs.score),
                         reference_score=pairs.reference_score.where(~lower_better, -pairs.reference_score))
    table = paired_table(pairs).merge(pairs[["task", "metric"]].drop_duplicates(), on="task")
    if args.csv:
        table.to_csv(sys.stdout, index=False)
        return 0
    print(f"damage ranking, paired difference policy − {args.vs} on the same traces (false-safe: {args.vs} − "
          "policy, the reduction, so that in every column + and a win are the better ranking): mean Δ [95% "
          f"paired-bootstrap interval] wins/ties/losses; * the exact sign test says they differ (p < {ALPHA}; "
          "each test on its own: among many policies and metrics, some stars are chance)")
    table = table.assign(task=table.task.str.rsplit(": ", n=1).str[0])
    columns = {**RANKING_COLUMNS, "false_safe_rate": "false-safe ↓"}
    for (model, task), part in table.groupby(["model", "task"], sort=False):
        cells = part.assign(cell=[f"{row.delta:+.3f} [{row.low:+.3f}, {row.high:+.3f}] {row.wins}/{row.ties}/"
                                  f"{row.losses}" + (" *" if row.significant else "") for row in part.itertuples()])
        grid = cells.pivot(index="policy", columns="metric", values="cell")
        grid = grid[[metric for metric in columns if metric in grid]].rename(columns=columns)
        print(f"\n{task} · {model} · vs {args.vs} ({int(part.pairs.max())} traces)")
        with pd.option_context("display.width", 250, "display.max_colwidth", 40):
            print(grid.to_string())
    return 0


def _score_digits(scores) -> int:
    """Decimals to print scores with: 3 for 0-1 metrics (a paper's 0.288 and 0.294 are not both 0.29), 2 on
    a 0-100 scale."""
    return 3 if scores.dropna().abs().max() <= 1 else 2


def _settings_listed(others) -> str:
    """The first eight (policy, setting, rows) of :meth:`Store.other_settings`, as one phrase."""
    from ..store import setting_names

    names = setting_names(others.policy, others.setting)
    listed = ", ".join(f"{name} ({rows})" for name, rows in zip(names[:8], others.rows[:8]))
    return listed + (f", and {len(others) - 8} more" if len(others) > 8 else "")


def _print_paired(store, root: Path, args, policies) -> int:
    """Per task and model, each policy's paired difference to ``--vs`` on the same samples, policy x compression."""
    import pandas as pd

    from ..stats import ALPHA, paired_table
    from ..store import QUALITY_METRICS, setting_names

    measured = store.options("policy", source="measured", metrics=QUALITY_METRICS)
    reference_policy, reference_setting = store.setting_of(args.vs)  # "avokv lambda_b=0": one of its settings
    if reference_policy not in measured:  # paper rows name policies too, but have no samples to pair
        raise ValueError(f"--vs {args.vs}: no measured quality rows of that policy under {root}"
                         + (" (only damage-ranking rows: add --ranking)" if args.vs in store.options(
                             "policy", source="measured") else "") + f"; measured: {', '.join(measured) or 'none'}")
    if args.source == "paper":
        raise ValueError("--vs pairs measured samples; the papers print aggregates, not samples: drop --source paper")
    sweeps = args.sweep_list
    table = paired_table(store.paired_scores(args.vs, args.task, args.model, policies, settings=args.settings,
                                             sweeps=sweeps))
    if table.empty and reference_setting == "{}" and store.quality_vs_compression(
            args.task, args.model, [args.vs], "measured", sweeps=sweeps).empty:
        others = store.other_settings(args.task, args.model, [args.vs], "measured", sweeps)
        if len(others):  # pairs are made against the reference at its defaults
            raise ValueError(f"--vs {args.vs}: under these filters {args.vs} ran only with non-default parameters "
                             f"({_settings_listed(others)}), and pairs are made against its defaults; pick a "
                             f"reference run at its defaults, or name a setting (e.g. --vs "
                             f"'{setting_names(others.policy, others.setting)[0]}')")
    if table.empty:
        raise ValueError(f"no measured samples pair with {args.vs} under these filters (same task, sample and "
                         f"compression); drop a filter or pick another --vs")
    if args.csv:
        table.to_csv(sys.stdout, index=False)
        return 0
    print(f"paired difference policy − {args.vs} on the same samples: mean Δ [95% paired-bootstrap interval] "
          f"wins/ties/losses; * the exact sign test says they differ (p < {ALPHA})")
    # The reference's cache counts as much as the policies': every name of the table, the reference's too
    held = store.speed_vs_quality(args.task, args.model, settings=args.settings or reference_setting != "{}",
                                  sweeps=sweeps)
    for (model, task), part in table.groupby(["model", "task"], sort=False):
        cells = part.assign(cell=[
            f"{row.delta:+.3f} [{row.low:+.3f}, {row.high:+.3f}] {row.wins}/{row.ties}/{row.losses}"
            + (" *" if row.significant else "") for row in part.itertuples()])
        covered = part.tasks.iloc[0]
        print(f"\n{task}" + (f" ({covered})" if covered != task else "") + f" · {model} · vs {args.vs}")
        with pd.option_context("display.width", 250):
            print(_by_cut(cells, "cell").to_string())
        _print_cache_over_budget(held[(held.model == model) & (held.task == task)
                                      & held.policy.isin([*part.policy, args.vs])])
    return 0


def _print_cache_over_budget(frame) -> None:
    """Name the cells whose policy held well over its nominal budget (:func:`kvviz.store.held_over_note`):
    one B is not one memory size, and AvoKV-E compares at matched measured cache sizes."""
    from ..notes import held_over_note

    note = held_over_note(frame)
    if note:
        print(note)
    # A budget no cell of a column ever filled: its cells are the full cache's run under the policies' names
    budgets = frame[frame.absolute_budget.notna() & (frame.policy != "full")]
    unfilled = [f"B={int(budget)} (largest cache {part.decode_cache.max():.0f})"
                for budget, part in budgets.groupby("absolute_budget") if (part.decode_cache < budget).all()]
    if unfilled:
        print(f"never filled: {', '.join(unfilled)}: those cells evicted nothing, so they ran as the full cache")


def _by_cut(part, values: str):
    """``values`` per policy (rows) and cut of the cache (columns): each compression ρ as before, then each
    absolute budget as ``B=...``, which a ρ could otherwise be mistaken for; empty where a policy has none."""
    import pandas as pd

    budget = part.absolute_budget.notna()
    tables = []
    if (~budget).any():  # each ρ written as typed (0.5), the same in every table (pandas wrote 0.50 in some)
        table = part[~budget].pivot(index="policy", columns="compression", values=values)
        tables.append(table.set_axis([f"{rho:g}" for rho in table.columns], axis=1))
    if budget.any():
        table = part[budget].pivot(index="policy", columns="absolute_budget", values=values)
        tables.append(table.set_axis([f"B={int(tokens)}" for tokens in table.columns], axis=1))
    table = pd.concat(tables, axis=1).fillna("")
    table.columns.name = "compression" if not budget.any() else "KV budget" if budget.all() else "compression / budget"
    return table


def _print_max_length_hits(frame) -> None:
    """Per task and model, the share of generations that reached max_new_tokens instead of ending, policy x
    compression (or absolute budget); nothing when no selected row records it (rows written before the field)."""
    import pandas as pd

    if not frame.recorded.sum():
        return
    print("\nmax-length hits: share of generations that reached max_new_tokens instead of ending "
          "(hits/rows that record it)")
    for (model, task), part in frame[frame.recorded > 0].groupby(["model", "task"]):
        full = part[part.policy == "full"]
        part = part[part.policy != "full"]
        print(f"\n{task} · {model} · max-length hits" + (
            f" · full cache {full.hit_rate.iloc[0]:.2f} ({full.hits.iloc[0]}/{full.recorded.iloc[0]})" if len(full)
            else ""))
        if len(part):
            cells = part.assign(cell=[f"{rate:.2f} ({hits}/{recorded})"
                                      for rate, hits, recorded in zip(part.hit_rate, part.hits, part.recorded)])
            with pd.option_context("display.width", 200):
                print(_by_cut(cells, "cell").to_string())
    unrecorded = int((frame.rows - frame.recorded).sum())
    if unrecorded:
        print(f"\nnot in the max-length tables: {unrecorded} rows written before sweeps recorded hit_max_tokens")


def _check_filters(store, root: Path, filters: dict[str, tuple[str, list[str]]]) -> None:
    """Refuse a filter value the store does not hold, listing the values it does.

    ``filters`` maps an option to the store column it filters and the values given (empty: not given).
    """
    for option, (column, values) in filters.items():
        stored = store.options(column) if values else []
        unknown = [value for value in values if value not in stored]
        if unknown:
            raise ValueError(f"{option} {', '.join(unknown)}: not in the results under {root}; stored: "
                             f"{', '.join(stored) or 'none'}")
