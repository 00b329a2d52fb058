"""``kvviz probe``, ``kvviz scorers`` and ``kvviz policies``: which entries hurt to remove, how scorers rank
against attention, and what the registry holds."""

from __future__ import annotations

import json
import math

import numpy as np

from .. import settings
from ..settings import CLI_NAMES
from .common import _read_prompt


def cmd_probe(args) -> int:
    from .. import engine, probe
    from ..models import load_model

    names, policies = _probe_policies(args)
    prompt = _read_prompt(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    probe.check_fits(model, prompt_ids, args.step, args.future, step_name="--step", future_name="--future")
    result = probe.probe(model, tokenizer, prompt_ids, args.step, policies=policies, sample=args.sample,
                         seed=args.seed, future=args.future, batch=args.batch)
    quality, aligned = probe.aligned_quality(result.utilities, result.damage) if result.utilities else ({}, None)
    # AvoKV-E's ranks are the blindspot's axes: after the damage pass, so that its refusal loses nothing above
    spot, spot_note = probe.blindspot_at(model, tokenizer, prompt_ids, result) if args.blindspot else (None, "")
    if args.json:
        print(json.dumps({"step": args.step, "prompt_len": len(prompt_ids), "future": args.future,
                          "candidates": result.candidates.tolist(), "damage": result.damage.tolist(),
                          "candidates_per_second": result.candidates_per_second, "ranking": quality,
                          "ranked": [] if aligned is None else result.candidates[aligned].tolist(),
                          **({"blindspot": _blindspot_json(spot) if spot else {"none": spot_note}}
                             if args.blindspot else {})}))
        return 0
    print(f"probe at step {args.step}: {len(result.candidates)} candidates, {args.future} future tokens, "
          f"{result.candidates_per_second:.1f} candidates/s")
    protected = probe.protection_note(policies, len(prompt_ids), args.step)
    if protected:
        print(protected)
    _print_probe_ranking(result, quality, aligned)
    skipped = sorted(set(names) - set(quality))
    if skipped:
        print(f"(no per-entry utility to rank: {', '.join(skipped)})")
    if spot:
        _print_blindspot(spot, spot_note)
    elif args.blindspot:
        print(f"\nblindspot: {spot_note}")
    return 0


def _probe_policies(args) -> tuple[list[str], dict]:
    """The options checked and the policies to rank built, before the model loads."""
    from ..policies import REGISTRY, build_setting

    if args.step < 1:
        raise ValueError(f"--step must be >= 1, got {args.step}")
    for option, value in (("--future", args.future), ("--batch", args.batch)):
        if value < 1:
            raise ValueError(f"{option} must be >= 1, got {value}")
    if args.sample is not None and args.sample < 1:
        raise ValueError(f"--sample must be >= 1 (leave it out to probe every entry), got {args.sample}")
    names = list(REGISTRY) if args.policies == "all" else [n.strip() for n in args.policies.split(",") if n.strip()]
    if not names:  # otherwise the whole probe runs and prints an empty ranking
        raise ValueError("--policies names no policy; give registry names, e.g. --policies inertia,tova, or 'all'")
    return names, dict(build_setting(name) for name in names)  # a name, or a setting such as 'avokv delay=32'


def _print_probe_ranking(result, quality: dict, aligned) -> None:
    """Each policy's ranking of the probed damage (AUROC, p, AP, ...), best first, and what the columns mean."""
    from .. import probe

    if aligned is not None and not aligned.all():
        print(f"ranked over the {int(aligned.sum())} entries every policy judged "
              f"({int((~aligned).sum())} left out: a protected tail, sinks or a window some policy never judges)")
    width = max([20, *(len(name) + 2 for name in quality)])  # expected-attention-decode is 25 characters
    print(f"{'policy':<{width}}{'AUROC':>8}{'p':>8}{'AP':>8}{'top-k rec':>11}{'false-safe':>12}{'Spearman':>10}")
    for name, q in sorted(quality.items(), key=lambda item: -np.nan_to_num(item[1]["auroc"])):
        p_value = "<0.001" if q["auroc_p"] < 0.001 else f"{q['auroc_p']:.3f}"  # never "0.000", which reads as certainty
        print(f"{name:<{width}}{q['auroc']:>8.3f}{p_value:>8}{q['average_precision']:>8.3f}"
              f"{q['topk_recall']:>11.3f}{q['false_safe_rate']:>12.3f}{q['spearman']:>10.3f}")
    if quality:  # what the columns measure, with this probe's own k
        k = int(probe.top_decile(result.damage[aligned]).sum())
        print(f"(label: the top decile of damage, k = {k} of {int(aligned.sum())} entries; p: the AUROC against "
              "chance (0.5), two-sided Mann-Whitney, exact and counting ties, large with few high-damage entries; "
              "top-k rec: the share of them in a policy's own k highest utilities; false-safe: the share of them "
              "in its k lowest, the first it would evict)")
        tied = probe.tied_rankings({name: result.utilities[name] for name in quality}, aligned)
        if tied:
            print("(mostly one tied score: " + ", ".join(f"{name} ({share:.0%})" for name, share in tied.items())
                  + " of the ranked entries share it, so that AUROC comes largely from ties' half credit)")


def cmd_scorers(args) -> int:
    from .. import engine
    from ..models import load_model
    from ..probe import check_fits
    from ..spectrum import spectrum

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    settings.compression(args.compression, CLI_NAMES["compression"])
    if not 0.0 <= args.alpha <= 1.0:
        raise ValueError(f"--alpha must be in [0, 1], got {args.alpha}")
    prompt = _read_prompt(args)
    model, tokenizer = load_model(args.model, device=args.device, dtype=args.dtype)
    prompt_ids = engine.encode_prompt(tokenizer, prompt, chat=args.chat)
    # spectrum's own check speaks of max_new_tokens (steps + 1), which this command has no option for
    check_fits(model, prompt_ids, args.steps, 1, step_name="--steps", doing="")
    result = spectrum(model, prompt_ids, steps=args.steps, layer=args.layer, compression=args.compression,
                      alpha=args.alpha)
    rows, cross = result.table(), result.cross_layer_summary()
    if args.json:
        finite = lambda value: value if math.isfinite(value) else None  # strict JSON has no NaN
        print(json.dumps({"layer": result.layer, "num_layers": result.num_layers, "compression": args.compression,
                          "prompt_len": len(prompt_ids), "steps": result.steps, "cache_sizes": result.cache_sizes,
                          "budgets": result.budgets,
                          "scorers": [{key: finite(value) if isinstance(value, float) else value
                                       for key, value in row.items()} for row in rows],
                          "by_layer": {name: [finite(float(value)) for value in values]
                                       for name, values in result.layer_profile().items()},
                          **{key: finite(value) for key, value in cross.items()}}))
        return 0
    span = lambda first, last: f"{first}" if first == last else f"{first}-{last}"
    sizes, keep = result.cache_sizes, result.budgets
    print(f"scorers against attention over decode steps {span(1, result.steps[-1])} of a full-cache greedy run "
          f"({span(sizes[0], sizes[-1])} entries); top-B at {100 * (1 - args.compression):.3g}% "  # 0.1%, not 0%
          f"(B = {span(keep[0], keep[-1])})")
    level = f"layer {result.layer} of {result.num_layers}"
    print(f"{'':<12}{level:^20}{'InertiaKV utility':^20}")
    print(f"{'scorer':<12}" + f"{'Spearman':>10}{'Jaccard':>10}" * 2)
    for row in rows:
        print(f"{row['scorer']:<12}{row['layer_spearman']:>10.3f}{row['layer_jaccard']:>10.3f}"
              f"{row['utility_spearman']:>10.3f}{row['utility_jaccard']:>10.3f}")
    if args.by_layer:
        profile = result.layer_profile()
        print("\nSpearman with attention at each layer (mean over steps)")
        print(f"{'layer':<8}" + "".join(f"{name:>11}" for name in profile))
        for index in range(result.num_layers):
            print(f"{index:<8}" + "".join(f"{values[index]:>11.3f}" for values in profile.values()))
    print(f"\ncross-layer agreement of attention: top-B Jaccard between layers {cross['cross_layer_jaccard']:.3f} "
          f"(sd over layer pairs {cross['cross_layer_jaccard_std']:.3f}); layer {result.layer}'s top-B churn "
          f"between steps {cross['layer_churn']:.3f}")
    return 0


def _blindspot_json(spot) -> dict:
    def finite(value: float) -> float | None:  # strict JSON has no NaN or Infinity
        return value if math.isfinite(value) else None

    return {"grid_entries": spot.grid_entries.tolist(), "grid_high_damage": spot.grid_high.tolist(),
            "entries_in": spot.entries_in, "high_damage_in": spot.high_damage_in, "entries_out": spot.entries_out,
            "high_damage_out": spot.high_damage_out, "wilson": [finite(v) for v in spot.wilson],
            "enrichment": finite(spot.enrichment), "fisher_p": finite(spot.fisher_p)}


def _print_blindspot(spot, note: str) -> None:
    """AvoKV-E Fig. 1(a) as a table: high-damage / entries per (payload rank, read-pressure rank) bin."""
    bins = spot.grid_entries.shape[0]
    edges = [f"{i / bins:.1f}-{(i + 1) / bins:.1f}" for i in range(bins)]
    print(f"\nblindspot (AvoKV-E Fig. 1a): high-damage entries / entries, by read-pressure rank N(p) (columns) "
          f"and payload rank N(b) (rows); {note}")
    corner = "N(b) \\ N(p)"
    print(f"{corner:<12}" + "".join(f"{edge:>10}" for edge in edges))
    for row in reversed(range(bins)):
        print(f"{edges[row]:<12}" + "".join(f"{f'{spot.grid_high[row, col]}/{spot.grid_entries[row, col]}':>10}"
                                            for col in range(bins)))
    print(spot.summary())


def cmd_policies(args) -> int:
    from ..policies import REGISTRY

    if args.json:
        print(json.dumps([{"name": s.name, "display": s.display, "family": s.family, "description": s.description,
                           "paper": s.paper, "parameters": s.parameters()} for s in REGISTRY.values()], default=str))
        return 0
    width = max(len(name) for name in REGISTRY)
    families = max(len(spec.family) for spec in REGISTRY.values())
    for spec in REGISTRY.values():
        print(f"{spec.name:<{width}} {spec.family:<{families}} {spec.description}")
        for p in spec.parameters():
            bounds = f"choices {list(p['choices'])}" if p.get("choices") else (
                f"range [{p['low']}, {p['high']}]" if p.get("low") is not None else "")
            parts = [f"--param {p['name']}={p['default']}", bounds, p.get("help", "")]
            print(f"{'':<16}" + "  ".join(part for part in parts if part))  # no wide gap where a part is empty
    return 0
