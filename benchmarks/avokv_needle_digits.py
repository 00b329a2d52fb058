"""Why AvoKV-E scores 0 on the stored needle tasks while R-KV scores ~1: what each keeps of the needle.

The sweep's single-needle prompts (2k tokens, SmolLM2-135M-Instruct, ρ = 0.5) are over budget before
decoding starts, so both checkpointed policies compress the prompt at step 1, from one observed query.
For each sample this prints one JSON line: the needle's digit positions, which of them each policy keeps
at step 1, the answer it then gives, and AvoKV-E's percentile ranks of read pressure N(p) and key
redundancy N(r) for those digits among all candidates (N(r) near 1 = most redundant: the 0.9-weighted
term that removes them).  A last line gives the means.

    HF_HUB_OFFLINE=1 PYTHONPATH=. .venv/bin/python benchmarks/avokv_needle_digits.py [--samples 3]
"""

from __future__ import annotations

import argparse
import json

import kvviz
from kvviz.engine import encode_prompt
from kvviz.policies.checkpointed import percentile_rank
from kvviz.tasks.synthetic import single_needle


def digit_positions(tokenizer, prompt_ids: list[int], answer: str) -> list[int]:
    """Prompt positions whose token text overlaps the (first) occurrence of ``answer``."""
    texts = [tokenizer.decode([token]) for token in prompt_ids]
    start = "".join(texts).index(answer)
    positions, offset = [], 0
    for position, text in enumerate(texts):
        if offset + len(text) > start and offset < start + len(answer):
            positions.append(position)
        offset += len(text)
    return positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--compression", type=float, default=0.5)
    args = parser.parse_args()
    model, tokenizer = kvviz.load_model()
    kept_share = {"avokv": [], "rkv": []}
    redundancy, pressure = [], []
    for seed in range(args.samples):
        sample = single_needle(tokenizer, 2000, seed=seed)
        prompt_ids = encode_prompt(tokenizer, sample.prompt, chat=True)
        digits = digit_positions(tokenizer, prompt_ids, sample.answers[0])
        line = {"sample": seed, "answer": sample.answers[0], "prompt_len": len(prompt_ids), "digit_positions": digits}
        for name in ("avokv", "rkv"):
            policy = kvviz.make_policy(name)
            run = kvviz.run(model, tokenizer, prompt_ids, policy, compression=args.compression, max_new_tokens=24)
            kept = set(run.trace.events[1].kept.tolist())
            line[f"{name}_keeps_digit"] = [position in kept for position in digits]
            line[f"{name}_answer"] = run.text.strip()[-40:]
            kept_share[name].append(sum(position in kept for position in digits) / len(digits))
            if name == "avokv":
                # The first checkpoint is at step 1; later ones overwrite features, so rerun to step 1 only.
                policy = kvviz.make_policy(name)
                kvviz.run(model, tokenizer, prompt_ids, policy, compression=args.compression, max_new_tokens=2)
                candidates = policy.candidates.tolist()  # slots = positions at step 1 (nothing evicted before)
                features = {key: total / policy.layers_seen for key, total in policy.features.items()}
                ranks = {key: percentile_rank(features[key]) for key in ("p", "r")}
                index = {position: i for i, position in enumerate(candidates)}
                line["avokv_N_p"] = [round(float(ranks["p"][index[d]]), 3) for d in digits]
                line["avokv_N_r"] = [round(float(ranks["r"][index[d]]), 3) for d in digits]
                pressure += line["avokv_N_p"]
                redundancy += line["avokv_N_r"]
        print(json.dumps(line), flush=True)
    mean = lambda values: round(sum(values) / len(values), 3)
    print(json.dumps({"summary": True, "samples": args.samples, "compression": args.compression,
                      "avokv_digits_kept": mean(kept_share["avokv"]), "rkv_digits_kept": mean(kept_share["rkv"]),
                      "avokv_mean_N_r_of_digits": mean(redundancy), "avokv_mean_N_p_of_digits": mean(pressure)}))


if __name__ == "__main__":
    main()
