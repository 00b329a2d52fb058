"""Load test: N concurrent sessions against a kvviz app on loopback, bounded in time.

Starts the app in this process (tiny random model by default, so it measures the server, not the model),
sends ``--sessions`` concurrent /generate requests through gradio_client, and prints one JSON line: how
many completed, how many were told the queue is full, how many failed otherwise, the wall time, and the
peak resident memory of the process.  Only 127.0.0.1 is contacted.

    .venv/bin/python benchmarks/load_test.py --sessions 16 --queue-size 8
"""

from __future__ import annotations

import argparse
import json
import resource
import socket
import time
from concurrent.futures import ThreadPoolExecutor, wait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--queue-size", type=int, default=16)
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--time-limit", type=float, default=300.0, help="stop waiting after this many seconds")
    args = parser.parse_args()

    from gradio_client import Client

    from kvviz.ui.app import build_app
    from kvviz.ui.config import Limits

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    limits = Limits(models=(args.model,), queue_size=args.queue_size, host="127.0.0.1", port=port)
    app = build_app(limits)
    app.queue(default_concurrency_limit=limits.runs_per_model, max_size=limits.queue_size)
    app.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
    prompt = "The passkey is 7342519. Remember it. " + "The grass is green. The sky is blue. " * 20 + "What is it?"

    def session(index: int) -> str:
        client = Client(f"http://127.0.0.1:{port}/", verbose=False)
        try:
            client.predict(prompt, "inertia", 0.8, args.max_new_tokens, True, args.model, "{}", api_name="/generate")
            return "completed"
        except Exception as error:  # noqa: BLE001 - we classify every outcome
            return "queue_full" if "queue is full" in str(error).lower() else f"error: {error}"

    start = time.perf_counter()
    with ThreadPoolExecutor(args.sessions) as pool:
        futures = [pool.submit(session, i) for i in range(args.sessions)]
        done, pending = wait(futures, timeout=args.time_limit)
    outcomes = [f.result() for f in done]
    report = {
        "sessions": args.sessions,
        "queue_size": args.queue_size,
        "completed": outcomes.count("completed"),
        "queue_full": outcomes.count("queue_full"),
        "other_errors": [o for o in outcomes if o.startswith("error")],
        "unfinished": len(pending),
        "seconds": round(time.perf_counter() - start, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    app.close()
    print(json.dumps(report))
    return 0 if not report["other_errors"] and not pending else 1


if __name__ == "__main__":
    raise SystemExit(main())
