"""``kvviz trace FILE``: a saved run's summary, its read lags, or what happened to the tokens it follows."""

from __future__ import annotations

import sys

import numpy as np

from .common import WITHOUT_PREFILL


def cmd_trace(args) -> int:
    """A saved run (``kvviz generate --trace``, the app's download): what it was, its diagnostics, and what
    happened to the tokens ``--follow`` names."""
    from ..trace import Trace

    _check_trace_options(args)
    trace = Trace.load(args.file)
    if args.read_lag:
        return _print_read_lags(trace)
    if not args.follow:
        _print_trace_summary(trace)
        return 0
    return _print_followed(trace, args)


def _check_trace_options(args) -> None:
    """Options another view would silently drop: refused before the file is read."""
    if args.follow is not None and not args.follow.strip():  # e.g. an unset shell variable: not the summary
        raise ValueError("--follow is empty; give text to find in the tokens (e.g. 7342519) or positions (#12, "
                         "#40-45), or leave --follow out for the run's summary")
    if args.read_lag and (args.follow or args.csv):
        given = " and ".join(flag for flag, on in (("--follow", args.follow), ("--csv", args.csv)) if on)
        raise ValueError(f"--read-lag prints its own table over every generated entry, which {given} would not "
                         f"change: drop {given}, or run it without --read-lag")
    if args.csv and not args.follow:
        raise ValueError("--csv prints the followed tokens' steps; add --follow TEXT_OR_POSITIONS")


def _print_trace_summary(trace) -> None:
    """What the run was (policy, prompt, budget, rates) and its diagnostics."""
    from .. import diagnostics
    from ..notes import budget_note, checkpoint_note, run_note
    from ..trace import time_split

    steps = trace.decode_steps
    params = ", ".join(f"{key}={value}" for key, value in trace.params.items())
    print(f"{trace.policy}" + (f" ({params})" if params else "") + f"{run_note(trace)}: "
          f"prompt {trace.prompt_len} tokens, {budget_note(trace)}, {len(steps)} decode steps, "
          f"{sum(e.evicted.size for e in trace.events)} evictions"
          + (f", stopped (of {trace.max_new_tokens} new tokens asked for)" if trace.stopped else ""))
    if trace.prompt:  # recorded since traces keep the text they ran from
        shown = trace.prompt if len(trace.prompt) <= 72 else trace.prompt[:69] + "..."
        print(f"prompt ({'through the chat template' if trace.chat else 'as is'}): {shown!r}")
    note = checkpoint_note(trace)  # why a checkpointed policy's cache ended over budget, if it did
    if note:
        print(note)
    seconds = time_split(trace.events)
    total = sum(seconds.values())
    if total:
        print(f"decode {len(steps) / total:.1f} tok/s {WITHOUT_PREFILL}: " + ", ".join(
            f"{part} {value / total:.0%}" for part, value in seconds.items()))
    values = diagnostics.summary(trace)
    for name, value in values.items():
        print(f"{name.replace('_', ' '):<24}{'n/a' if np.isnan(value) else f'{value:.4f}'}")
    if any(np.isnan(value) for value in values.values()):
        print(f"({diagnostics.NOT_AVAILABLE})")
    decided = [e.step for e in trace.events if e.components]
    if decided:
        print(f"terms recorded at {len(decided)} decision(s), steps {', '.join(map(str, decided[:8]))}"
              + (" ..." if len(decided) > 8 else ""))


def _print_followed(trace, args) -> int:
    """What happened to the tokens --follow names: per step as CSV, or one line of fate and ranks each."""
    from .. import diagnostics
    from ..notes import budget_note

    tokens = _trace_tokens(trace, args.model)
    positions, note = diagnostics.find_positions(tokens, args.follow)
    history = diagnostics.token_history(trace.events, positions)
    history.insert(2, "token", [tokens[p] for p in history["position"]])
    if args.csv:  # %g: a rank is 165, not 165.0 (tied ranks share their mean: 30.5)
        print(history.to_csv(index=False, float_format="%.10g"), end="")
        return 0
    crossings = diagnostics.boundary_crossings(history, trace.budget)
    print(f"{note}{len(positions)} position(s); {budget_note(trace)}; ranks count from 1 = most useful")
    print(f"{'position':>8}  {'token':<12}{'fate':<20}{'raw crossed B':>14}{'utility rank (mean, worst)':>28}")
    for position, rows in history.groupby("position", sort=False):
        gone = rows[rows["evicted"]]
        fate = f"evicted at step {int(gone['step'].iloc[0])}" if len(gone) else (
            "kept" if rows["kept"].iloc[-1] else "never cached")
        ranked = rows.loc[rows["step"] >= 1, "utility_rank"].dropna()
        rank = f"{ranked.mean():.1f}, {ranked.max():g}" if len(ranked) else "-"
        raw = crossings[position] if rows["raw_rank"].notna().any() else "-"
        print(f"{position:>8}  {repr(tokens[position])[:11]:<12}{fate:<20}{raw:>14}{rank:>28}")
    return 0


def _print_read_lags(trace) -> int:
    """AvoKV-E Fig. 1(b): when generated entries are first strongly read, split by how much they were read at first."""
    from .. import diagnostics

    record = "kvviz generate --policy inertia --budget 100000 --max-new-tokens 256 --trace F"
    if not diagnostics.scores_attention(trace.policy, trace.params):
        scorer = f" (scorer {trace.params['scorer']})" if "scorer" in trace.params else ""
        raise ValueError(f"{trace.policy}{scorer} does not record attention as its per-step score; record a run "
                         f"of a policy that does, e.g. {record}")
    lags = diagnostics.read_lags(trace.events, trace.prompt_len)
    if not lags.positions.size:
        raise ValueError(f"no generated entry has {lags.horizon} later queries in this trace "
                         f"({len(trace.decode_steps)} decode steps): record a longer run, e.g. {record}")
    split = diagnostics.read_lag_split(lags)
    print(f"read lags (AvoKV-E Fig. 1b): {lags.positions.size} generated entries with {lags.horizon} later queries "
          f"({lags.dropped} too near the end left out); a strong read reaches 85% of the entry's peak attention")
    times = list(split["low"]["read_by"])
    print(f"{'first read':<28}{'entries':>8}" + "".join(f"{f'F({t})':>8}" for t in times) + f"{'never':>8}")
    for name, label in (("low", "N(early) <= 0.4 (rarely)"), ("high", "N(early) >= 0.6 (well)")):
        group = split[name]
        print(f"{label:<28}{group['entries']:>8}" + "".join(f"{group['read_by'][t]:>8.0%}" for t in times)
              + f"{group['never']:>8.0%}")
    print(f"one-sided KS p that the well read are read sooner: {split['ks_p']:.3g}")
    first = times[0]
    if all(split[name]["read_by"][first] == 1.0 for name in ("low", "high") if split[name]["entries"]):
        # The next query is each entry's peak reader (common on a small model): nothing is left to split.
        print(f"every entry was strongly read at lag {first}: the split says nothing about delayed reads here; "
              "a larger model or a longer run reads later")
    return 0


def _trace_tokens(trace, model_name: str | None) -> list[str]:
    """Each position's text: the prompt through the run's tokenizer (no weights; ids where it cannot load),
    then the generated tokens as the run recorded them."""
    try:
        from ..models import load_tokenizer

        tokenizer = load_tokenizer(model_name or trace.model)
        prompt = [tokenizer.decode([i]) for i in trace.prompt_ids]
    except Exception as error:  # noqa: BLE001 -- the trace is still readable by positions
        print(f"kvviz: prompt tokens shown as ids ({model_name or trace.model or 'no model'} did not load: "
              f"{type(error).__name__}; --model names another)", file=sys.stderr)
        prompt = [f"⟨{i}⟩" for i in trace.prompt_ids]
    return prompt + [event.text for event in trace.events]
