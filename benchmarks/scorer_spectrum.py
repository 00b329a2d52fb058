"""InertiaKV §5.1's scorer spectrum on the default model: each scorer's Spearman and top-B Jaccard (B = 10%)
against last-query attention, at the middle layer and through the InertiaKV utility.

Also each scorer's Spearman at every layer (``by_layer``).  The prompts are the sweeps' single-needle
haystacks (prose, about ``--tokens`` tokens, seeds 0 .. samples-1), each decoded ``--steps`` greedy steps with
the full cache.  One JSON line per prompt, then one with the mean over prompts of each scorer's per-prompt
means, and of attention's cross-layer agreement.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/scorer_spectrum.py [--samples 4 --tokens 1000]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import kvviz
from kvviz.engine import encode_prompt
from kvviz.spectrum import spectrum
from kvviz.tasks.synthetic import single_needle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the default model")
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layer", type=int, default=None)
    args = parser.parse_args()
    model, tokenizer = kvviz.load_model(args.model) if args.model else kvviz.load_model()
    tables, crosses, profiles = [], [], []
    for seed in range(args.samples):
        sample = single_needle(tokenizer, args.tokens, seed, haystack="prose")
        prompt_ids = encode_prompt(tokenizer, sample.prompt)
        result = spectrum(model, prompt_ids, steps=args.steps, layer=args.layer)
        tables.append({row["scorer"]: row for row in result.table()})
        crosses.append(result.cross_layer_summary())
        profiles.append(result.layer_profile())
        print(json.dumps({"seed": seed, "prompt_len": len(prompt_ids), "layer": result.layer,
                          "steps": args.steps, "scorers": result.table(), **crosses[-1],
                          "by_layer": {name: [round(float(v), 4) for v in values]
                                       for name, values in profiles[-1].items()}}), flush=True)
    mean = {name: {key: round(float(np.mean([table[name][key] for table in tables])), 4)
                   for key in ("layer_spearman", "layer_jaccard", "utility_spearman", "utility_jaccard")}
            for name in tables[0]}
    print(json.dumps({"mean_over_prompts": args.samples, "model": model.config.name_or_path, "layer": result.layer,
                      "scorers": mean, **{key: round(float(np.mean([c[key] for c in crosses])), 4)
                                          for key in crosses[0]},
                      "by_layer": {name: [round(float(v), 4) for v in np.nanmean([p[name] for p in profiles], axis=0)]
                                   for name in profiles[0]}}))


if __name__ == "__main__":
    main()
