"""How a rerun changed one policy's stored rows: its cells at one git revision against another.

For each sweep folder, reads the policy's rows from ``rows*.jsonl`` as committed at ``--before`` and at
``--after`` (``git show``), matches them by cell key and prints, per task and compression or budget, the
mean score before and after and how many predictions changed; a last line gives the totals.

    python benchmarks/compare_sweep_rows.py --policy avokv --before 07e4fe5 --after 4036ecf \\
        results_db/sweep-2k results_db/needle-grid
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import defaultdict
from pathlib import Path


def rows_at(revision: str, folder: str, policy: str) -> dict[str, dict]:
    """The policy's rows in ``folder`` as committed at ``revision``, by cell key."""
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
                    if row.get("policy") == policy:
                        rows[row["cell"]] = row
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", help="sweep folders, relative to the repository root")
    parser.add_argument("--policy", required=True)
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
            cut = f"B={old['absolute_budget']}" if old.get("absolute_budget") is not None else f"rho={old['compression']}"
            group = groups[(old["task"], cut)]
            group[0] += old["score"]
            group[1] += new["score"]
            group[2] += 1
            group[3] += old["prediction"] != new["prediction"]
        print(f"{folder}: {len(set(before) & set(after))} cells in both"
              + (f", {len(missing)} in only one" if missing else ""))
        for (task, cut), (old, new, count, changed) in sorted(groups.items()):
            print(f"  {task:<20} {cut:<9} before {old / count:.3f}  after {new / count:.3f}  "
                  f"n={count:<3} predictions changed {changed}")
            total += count
            changed_total += changed
    print(f"total: {changed_total} of {total} predictions changed")


if __name__ == "__main__":
    main()
