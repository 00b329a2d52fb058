"""How a rerun changed stored rows: the cells of a sweep folder at one git revision against another.

For each sweep folder, reads the rows of ``rows*.jsonl`` as committed at ``--before`` and at ``--after``
(``git show``) and matches them by cell key.  With ``--policy``, prints that policy's mean score before and
after and how many predictions changed, per task and compression or budget; without it, one such line per
policy and parameter setting.  A last line gives the totals.

    python benchmarks/compare_sweep_rows.py --policy avokv --before 07e4fe5 --after 4036ecf \\
        results_db/sweep-2k results_db/needle-grid
    python benchmarks/compare_sweep_rows.py --before 27fddb8 results_db/sweep-2k   # every policy
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import defaultdict
from pathlib import Path


def rows_at(revision: str, folder: str, policy: str | None = None) -> dict[str, dict]:
    """The rows in ``folder`` as committed at ``revision`` (one policy's, or all), by cell key."""
    listing = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:{folder}"], capture_output=True,
                             text=True, check=True).stdout.split()
    rows = {}
    for name in listing:
        if name.startswith("rows") and name.endswith(".jsonl"):
            text = subprocess.run(["git", "show", f"{revision}:{folder}/{name}"], capture_output=True, text=True,
                                  check=True).stdout
            for line in text.splitlines():
                if line.strip():
                    row = json.loads(line)
                    if policy is None or row.get("policy") == policy:
                        rows[row["cell"]] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="sweep folders, relative to the repository root")
    parser.add_argument("--policy", help="one policy, in detail (default: every policy, a line each)")
    parser.add_argument("--before", required=True, help="git revision with the old rows")
    parser.add_argument("--after", default="HEAD", help="git revision with the new rows")
    args = parser.parse_args()
    total = changed_total = 0
    for folder in args.folders:
        folder = Path(folder).as_posix().rstrip("/")
        before, after = rows_at(args.before, folder, args.policy), rows_at(args.after, folder, args.policy)
        missing = sorted(set(before) ^ set(after))
        groups = defaultdict(lambda: [0.0, 0.0, 0, 0])
        for cell in set(before) & set(after):
            old, new = before[cell], after[cell]
            if args.policy:
                cut = (f"B={old['absolute_budget']}" if old.get("absolute_budget") is not None
                       else f"rho={old['compression']}")
                key = (old["task"], cut)
            else:  # a parameter sweep's settings apart (e.g. inertia alpha=0.9)
                settings = " ".join(f"{name}={value}" for name, value in sorted((old.get("params") or {}).items()))
                key = (f"{old['policy']} {settings}".strip(),)
            group = groups[key]
            group[0] += old["score"]
            group[1] += new["score"]
            group[2] += 1
            group[3] += old["prediction"] != new["prediction"]
        print(f"{folder}: {len(set(before) & set(after))} cells in both"
              + (f", {len(missing)} in only one" if missing else ""))
        for key, (old, new, count, changed) in sorted(groups.items()):
            label = "  ".join(f"{part:<20}" if i == 0 else f"{part:<9}" for i, part in enumerate(key))
            print(f"  {label} before {old / count:.3f}  after {new / count:.3f}  "
                  f"n={count:<3} predictions changed {changed}")
            total += count
            changed_total += changed
    print(f"total: {changed_total} of {total} predictions changed")


if __name__ == "__main__":
    main()
