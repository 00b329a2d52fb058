"""InertiaKV's "ranking inertia", measured where top-B churn cannot show it.

At k = B the top-B by utility is the keep set, so utility churn is the keep set's turnover (2 / (B + 1)
a step when a new entry displaces an old one) for every policy that evicts by its utility.  The rank
stabilities are not tied to B: the Spearman correlation of consecutive steps' raw scores over the entries
present at both, and of their utilities over the entries kept at both.  This runs the default model
(SmolLM2-135M-Instruct) greedily on the Live tab's prompts at ρ = 0.9 with InertiaKV at several α (α = 0 is
single-step attention), TOVA and H2O, and prints one JSON line per prompt and policy with every mean of
``kvviz.diagnostics.summary`` (and, for the rank stabilities, how many step pairs they average and their
standard deviation), then one line per policy with the means over the prompts.  H2O's utility is a running
sum of attention, whose ranking moves less and less as it grows, so its stability nears 1 by construction.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/rank_stability.py [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import kvviz
from kvviz import diagnostics
from kvviz.tasks.examples import EXAMPLES

POLICIES = {"inertia alpha=0.0": ("inertia", {"alpha": 0.0}), "inertia alpha=0.5": ("inertia", {"alpha": 0.5}),
            "inertia": ("inertia", {}), "inertia alpha=0.95": ("inertia", {"alpha": 0.95}),
            "tova": ("tova", {}), "h2o": ("h2o", {})}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--compression", type=float, default=0.9)
    args = parser.parse_args()
    model, tokenizer = kvviz.load_model()
    means: dict[str, list[dict]] = {label: [] for label in POLICIES}
    for example, prompt in EXAMPLES.items():
        for label, (name, params) in POLICIES.items():
            trace = kvviz.run(model, tokenizer, prompt, name, compression=args.compression,
                              max_new_tokens=args.new_tokens, **params).trace
            values = diagnostics.summary(trace)
            means[label].append(values)
            # how many recomputation pairs each mean is over, and their spread: one greedy run per cell
            spread = {}
            for kind, pairs in (("raw", diagnostics.raw_rank_stability(trace)),
                                ("utility", diagnostics.utility_rank_stability(trace))):
                finite = [value for _, value in pairs if not np.isnan(value)]
                spread[f"{kind}_rank_stability_pairs"] = len(finite)
                spread[f"{kind}_rank_stability_sd"] = round(float(np.std(finite, ddof=1)), 4) if len(finite) > 1 \
                    else None
            print(json.dumps({"prompt": example, "policy": label, "prompt_len": trace.prompt_len,
                              "budget": trace.budget, "turnover_one_in_one_out": round(2 / (trace.budget + 1), 4),
                              **{key: round(value, 4) for key, value in values.items()}, **spread}), flush=True)
    for label, rows in means.items():
        print(json.dumps({"policy": label, "prompts": len(rows), **{
            key: round(float(np.nanmean([row[key] for row in rows])), 4) for key in rows[0]}}))


if __name__ == "__main__":
    main()
