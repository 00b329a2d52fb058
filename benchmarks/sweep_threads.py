"""Is a sweep faster as one process with all threads, or as one single-thread process per core?

Decodes the same ~2k-token single-needle prompt with InertiaKV at 90% compression on the default model,
first in one process with ``torch.set_num_threads(cores)``, then in ``cores`` concurrent processes with one
thread each, and prints one JSON line with the aggregate decode throughput of each and their ratio.  Run
it on an otherwise idle machine (it measures contention, so anything else running skews it).

    HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/sweep_threads.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TOKENS = 32


def worker(threads: int) -> None:
    """Prefill, then time ``TOKENS`` decode steps; print tokens and seconds of the decode."""
    import torch

    torch.set_num_threads(threads)
    from kvviz import engine
    from kvviz.models import load_model
    from kvviz.policies import make_policy
    from kvviz.tasks.synthetic import single_needle

    model, tokenizer = load_model()
    sample = single_needle(tokenizer, 2000, seed=0)
    prompt = engine.encode_prompt(tokenizer, sample.prompt)
    shared = engine.prefill(model, prompt)
    start = time.perf_counter()
    steps = sum(1 for _ in engine.decode(model, tokenizer, prompt, make_policy("inertia"), compression=0.9,
                                         max_new_tokens=TOKENS, ignore_eos=True, shared=shared))
    print(json.dumps({"tokens": steps - 1, "seconds": time.perf_counter() - start}))


def run(processes: int, threads: int) -> float:
    """Aggregate decode tok/s of ``processes`` concurrent workers with ``threads`` threads each."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(threads)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, text=True) for _ in range(processes)]
    results = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return sum(r["tokens"] / r["seconds"] for r in results)


def main() -> None:
    cores = os.cpu_count() or 1
    one = run(1, cores)
    many = run(cores, 1)
    print(json.dumps({"cores": cores, "one_process_tok_s": round(one, 2),
                      f"{cores}_single_thread_processes_tok_s": round(many, 2), "ratio": round(many / one, 2)}))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]))
    else:
        main()
