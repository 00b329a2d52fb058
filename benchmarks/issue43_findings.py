"""Print issue 43's findings from the stored rows: the tables behind docs/findings.md's prose-needle section.

    .venv/bin/python benchmarks/issue43_findings.py [--task prose_needle] [--rho 0.9]

1. The full cache on each measured task: mean, n, and whether it ranks policies (>= 0.8) or is marked
   "full cache fails: not ranked".
2. Each policy against the full cache and against InertiaKV at one compression, paired by sample: mean
   difference, 95% paired-bootstrap interval, wins / ties / losses, exact sign (McNemar) test, and the smallest
   difference the pairs would detect (80% power at the observed disagreement).
3. The same at equal cache held (kvviz/held.py): a policy's cell paired with the reference's cell of the same
   sample that held the same largest decode cache (within one entry).
4. Score by needle depth: each policy's mean in each fifth of the text, and the paired difference between
   the needles in the last quarter and the rest (a recency test: unpaired across samples, Fisher's exact test).
5. InertiaKV's own questions (prose-2k-inertia): each setting (alpha, refresh interval, score-free,
   decoupled) paired with InertiaKV at its defaults on the same samples, as the Results tab's section does.
"""

from __future__ import annotations

import argparse

import pandas as pd
from scipy import stats

from kvviz.held import full_cache_ranking, held_table, quality_vs_depth
from kvviz.stats import paired_table
from kvviz.store import Store
from kvviz.ui.results.pairing import inertia_family, paired

pd.set_option("display.width", 200)
pd.set_option("display.max_columns", 30)
pd.set_option("display.max_rows", 200)

SHOWN = ["policy", "compression", "score", "reference", "delta", "low", "high", "wins", "ties", "losses", "p_sign",
         "detectable", "pairs"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="prose_needle")
    parser.add_argument("--rho", type=float, default=0.9)
    args = parser.parse_args()
    store = Store()

    print("== 1. full cache per measured task (ranks policies at >= 0.8)")
    print(full_cache_ranking(store).round(3).to_string(index=False))

    for reference in ("full", "inertia"):
        print(f"\n== 2. paired against {reference} on {args.task} (nominal budget)")
        table = paired_table(store.paired_scores(reference, task=args.task))
        print(table[SHOWN].sort_values(["compression", "delta"]).round(3).to_string(index=False))

    for reference in ("tova", "inertia"):
        print(f"\n== 3. paired against {reference} at equal cache held (within one entry) on {args.task}")
        table = held_table(store, reference, task=args.task)
        if table.empty:
            print("(no cells pair at equal held cache)")
            continue
        print(table[[*SHOWN, "held", "reference_held", "reference_compression"]]
              .sort_values(["compression", "delta"]).round(3).to_string(index=False))

    print(f"\n== 4. score by needle depth on {args.task} at rho = {args.rho:g} (and the full cache)")
    depth = quality_vs_depth(store, task=args.task, bins=5)
    depth = depth[depth.compression.isna() | (depth.compression == args.rho)]
    wide = depth.pivot_table(index="policy", columns="depth", values="score")
    wide.columns = [f"{(c - 0.1):.1f}-{(c + 0.1):.1f}" for c in wide.columns]
    wide["n"] = depth.groupby("policy").samples.sum()
    print(wide.round(2).to_string())

    print(f"\n   needles in the last quarter (depth >= 0.75) vs the rest, at rho = {args.rho:g}")
    rows = store.frame(
        """SELECT policy, CASE WHEN policy = 'full' THEN NULL ELSE compression END AS compression, score,
                  TRY_CAST(json_extract_string(meta, '$.depth') AS DOUBLE) AS depth
           FROM results WHERE source = 'measured' AND task = ? AND setting = '{}' AND sample IS NOT NULL""",
        [args.task])
    rows = rows[rows.compression.isna() | (rows.compression == args.rho)]
    out = []
    for policy, part in rows.groupby("policy"):
        late, early = part[part.depth >= 0.75].score, part[part.depth < 0.75].score
        table = [[(late >= 1).sum(), (late < 1).sum()], [(early >= 1).sum(), (early < 1).sum()]]
        p = stats.fisher_exact(table).pvalue if len(late) and len(early) else float("nan")
        out.append(dict(policy=policy, late=late.mean(), late_n=len(late), early=early.mean(), early_n=len(early),
                        difference=late.mean() - early.mean(), fisher_p=p))
    print(pd.DataFrame(out).round(3).to_string(index=False))

    print(f"\n== 5. InertiaKV's settings against its defaults (alpha 0.8, r = 1) on {args.task}, prose-2k-inertia")
    table = paired(store, "inertia", args.task, None, tuple(inertia_family(store)), True, ("prose-2k-inertia",))
    print(table[SHOWN].sort_values("delta").round(3).to_string(index=False) if len(table) else "(no rows yet)")


if __name__ == "__main__":
    main()
