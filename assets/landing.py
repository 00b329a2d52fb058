"""Make the app's first view: the passkey example under a few policies on the default model, saved as traces.

    .venv/bin/python assets/landing.py        # writes assets/landing/*.parquet and landing.json (CPU, ~1 min)

The app opens on this finished comparison (kvviz/ui/landing.py) without loading a model.  The script
refuses to write a comparison that shows nothing: the full cache must answer right, and of the policies
one must answer right and one wrong.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import kvviz  # noqa: E402
from kvviz.tasks.examples import EXAMPLES, PASSKEY  # noqa: E402

POLICIES = ["inertia", "tova", "streaming"]
COMPRESSION = 0.3  # at 0.5 the 135M model lost the passkey under InertiaKV, SnapKV, TOVA, StreamingLLM and K-norm alike
NEW_TOKENS = 12


def main(folder: Path = HERE / "landing") -> int:
    model, tokenizer = kvviz.load_model()
    prompt = EXAMPLES["Passkey in a haystack"]
    full = kvviz.run(model, tokenizer, prompt, "full", max_new_tokens=NEW_TOKENS).text.strip()
    runs = {name: kvviz.run(model, tokenizer, prompt, name, compression=COMPRESSION, max_new_tokens=NEW_TOKENS)
            for name in POLICIES}
    right = {name: PASSKEY in run.text for name, run in runs.items()}
    print(f"full cache: {full!r}; " + "; ".join(f"{name}: {run.text.strip()!r}" for name, run in runs.items()))
    if PASSKEY not in full or all(right.values()) or not any(right.values()):
        print("not written: the full cache must answer right, and one policy right and one wrong")
        return 1
    folder.mkdir(exist_ok=True)
    for name, run in runs.items():
        run.trace.save(folder / f"{name}.parquet")
    prompt_ids = runs[POLICIES[0]].trace.prompt_ids
    manifest = {"prompt": prompt, "needle": PASSKEY, "compression": COMPRESSION, "model": kvviz.DEFAULT_MODEL,
                "full_answer": full, "tokens": [tokenizer.decode([i]) for i in prompt_ids],
                "traces": {name: f"{name}.parquet" for name in POLICIES}}
    (folder / "landing.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
