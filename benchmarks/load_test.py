"""Load test: N concurrent sessions against a kvviz server in its own process, on loopback, bounded in time.

Starts ``kvviz serve`` as a separate process (tiny random model by default, so it measures the server, not
the model; ``HF_HUB_OFFLINE=1``, so nothing but 127.0.0.1 is contacted), waits for its port, then opens
``--sessions`` gradio_client sessions at once, each streaming one /generate run.  Whatever happens -- a server
that never comes up, connections refused or timed out on a busy machine, a full queue -- it prints one report
as a JSON line and writes it (after a metadata line) to ``--out``: how many sessions completed, were told the
queue is full, timed out or failed otherwise (by kind), latency and time-to-first-update percentiles, and the
server's resident memory before the sessions, at its peak during them and after them.

    .venv/bin/python benchmarks/load_test.py --sessions 16 --out benchmarks/results/DATE-cpu-load-16.jsonl

``--url`` sends the sessions to a server that is already running instead (its memory is then not measured).
Exit status: 0 when every session completed or was told the queue is full, else 1.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Nothing but the server on 127.0.0.1: no telemetry from gradio_client, no hub lookups by the server.
os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The passkey is 7342519. Remember it. " + "The grass is green. The sky is blue. " * 20 + "What is it?"
POLL_S = 0.05  # how often a session looks at its job, and the start-up loop at the port
MEMORY_EVERY_S = 0.2  # how often the server's memory is sampled


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--queue-size", type=int, default=16, help="the server's KVVIZ_QUEUE_SIZE")
    parser.add_argument("--model", default="tiny-random-llama")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--time-limit", type=float, default=300.0,
                        help="seconds the sessions may take, all together, from the first one's start")
    parser.add_argument("--start-timeout", type=float, default=240.0, help="seconds the server may take to listen")
    parser.add_argument("--http-timeout", type=float, default=30.0,
                        help="seconds one HTTP connect or read may take (gradio_client's default, 5, is what a busy "
                             "2-core machine overran; a queued run's stream gets a heartbeat every 15)")
    parser.add_argument("--url", help="a running server to test instead of starting one (http://127.0.0.1:PORT/)")
    parser.add_argument("--out", help="also write the metadata and the report here, as two JSON lines")
    args = parser.parse_args(argv)
    if args.sessions < 1 or args.queue_size < 1 or args.max_new_tokens < 1:
        parser.error("--sessions, --queue-size and --max-new-tokens must be at least 1")
    if not all(value > 0 for value in (args.time_limit, args.start_timeout, args.http_timeout)):
        parser.error("--time-limit, --start-timeout and --http-timeout must be positive")
    if args.url and not args.url.startswith(("http://127.0.0.1:", "http://localhost:")):
        parser.error("--url must be a server on this machine (http://127.0.0.1:PORT/): the test sends only to loopback")
    return args


# ------------------------------------------------------------------------------------------ the server

def rss_mb(pid: int) -> tuple[float | None, float | None]:
    """The process's resident memory now and at its peak so far (VmRSS, VmHWM), in MB; None where unknown."""
    try:
        fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if ":" in line)
        return tuple(round(int(fields[name].split()[0]) / 1024, 1) if name in fields else None
                     for name in ("VmRSS", "VmHWM"))
    except (OSError, ValueError):
        pass
    try:  # not Linux: psutil, where installed
        import psutil

        return round(psutil.Process(pid).memory_info().rss / 2**20, 1), None
    except Exception:  # noqa: BLE001 - no psutil, or the process is gone: unknown, not a crash
        return None, None


class MemorySampler:
    """The server's RSS every MEMORY_EVERY_S seconds in a daemon thread, keeping the largest."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(MEMORY_EVERY_S):
            self.sample()

    def sample(self) -> float | None:
        now, _ = rss_mb(self.pid)
        if now is not None and (self.peak is None or now > self.peak):
            self.peak = now
        return now

    def __enter__(self) -> "MemorySampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sample()


def server_command(port: int, model: str) -> list[str]:
    return [sys.executable, "-m", "kvviz.cli", "serve", "--models", model, "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def start_server(args, port: int, log: Path) -> tuple[subprocess.Popen | None, dict]:
    """``kvviz serve`` on ``port`` in its own process, polled until it listens (or exits, or the start-up
    timeout passes: then it is stopped and the returned dict says why)."""
    env = {**os.environ, "KVVIZ_QUEUE_SIZE": str(args.queue_size), "KVVIZ_DEFAULT_MODEL": args.model,
           "KVVIZ_MODELS": "", "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    info: dict = {"started": False, "command": " ".join(server_command(port, args.model)[1:]), "port": port}
    start = time.perf_counter()
    try:
        with open(log, "wb") as handle:
            proc = subprocess.Popen(server_command(port, args.model), env=env, cwd=ROOT, stdout=handle,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    except OSError as error:
        info["error"] = f"could not start: {error}"
        return None, info
    info["pid"] = proc.pid
    for _ in range(math.ceil(args.start_timeout / POLL_S) + 1):  # bounded in count and in time
        if proc.poll() is not None:
            info["error"] = f"exited with status {proc.returncode} before listening: {log_tail(log)}"
            return None, info
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                info.update(started=True, start_s=round(time.perf_counter() - start, 2))
                return proc, info
        except OSError:
            pass
        if time.perf_counter() - start > args.start_timeout:
            break
        time.sleep(POLL_S)
    info["error"] = f"not listening after {args.start_timeout:g} s: {log_tail(log)}"
    stop_server(proc)
    return None, info


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=15)


# ---------------------------------------------------------------------------------------- the sessions

def classify(error: BaseException) -> str:
    """queue_full, timed_out or error, from what the client raised."""
    import concurrent.futures

    import httpx

    text = str(error).lower()
    if "queue is full" in text:
        return "queue_full"
    if isinstance(error, (httpx.TimeoutException, TimeoutError, concurrent.futures.TimeoutError)) \
            or "timed out" in text or "timeout" in text:
        return "timed_out"
    return "error"


def session(url: str, args, deadline: float) -> dict:
    """One user: connect, submit a /generate run, watch it until it ends or the deadline.  Never raises: every
    outcome, the client's creation included, comes back as a dict."""
    start = time.perf_counter()
    out: dict = {"outcome": "error", "stage": "connect"}
    client = None
    try:
        import httpx
        from gradio_client import Client

        client = Client(url, verbose=False, analytics_enabled=False, download_files=False,
                        httpx_kwargs={"timeout": httpx.Timeout(args.http_timeout)})
        out["connect_s"] = time.perf_counter() - start
        out["stage"] = "run"
        job = client.submit(PROMPT, "inertia", 0.8, args.max_new_tokens, True, args.model, "{}",
                            api_name="/generate")
        for _ in range(math.ceil(max(0.0, deadline - time.perf_counter()) / POLL_S) + 2):
            if "first_update_s" not in out and job.outputs():
                out["first_update_s"] = time.perf_counter() - start
            if job.done() or time.perf_counter() >= deadline:
                break
            time.sleep(POLL_S)
        if not job.done():
            out.update(outcome="timed_out", error=f"still running at the {args.time_limit:g} s limit")
            job.cancel()
            return out
        if "first_update_s" not in out and job.outputs():
            out["first_update_s"] = time.perf_counter() - start
        job.result(timeout=0)  # raises what the server answered, e.g. that the queue is full
        out.update(outcome="completed", latency_s=time.perf_counter() - start)
    except BaseException as error:  # noqa: BLE001 - every outcome is counted, none ends the test
        if isinstance(error, KeyboardInterrupt):
            raise
        message = str(error).splitlines()[0] if str(error) else ""
        out.update(outcome=classify(error), error=f"{type(error).__name__}: {message}"[:200])
    finally:
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001
                pass
    return out


def run_sessions(url: str, args) -> tuple[list[dict], float]:
    """Every session in its own daemon thread, started together; the results, and the wall time.  A thread
    still stuck at the limit (plus the HTTP timeout) is counted as timed out and left behind."""
    results: list[dict | None] = [None] * args.sessions
    start = time.perf_counter()
    deadline = start + args.time_limit

    def one(index: int) -> None:
        results[index] = session(url, args, deadline)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(args.sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=max(0.0, deadline + 2 * args.http_timeout - time.perf_counter()))
    outcomes = [r if r is not None else {"outcome": "timed_out", "stage": "unknown",
                                         "error": "the session did not return by the limit"} for r in results]
    return outcomes, time.perf_counter() - start


# ------------------------------------------------------------------------------------------ the report

def percentiles(values: list[float]) -> dict | None:
    """p50 / p90 / p99 / max of ``values`` (nearest rank), None without any."""
    if not values:
        return None
    ordered = sorted(values)

    def rank(p: float) -> float:
        return round(ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))], 2)

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "max": round(ordered[-1], 2), "n": len(ordered)}


def report_of(args, outcomes: list[dict], server: dict, memory: dict, wall_s: float | None) -> dict:
    counts = {kind: sum(o["outcome"] == kind for o in outcomes) for kind in ("completed", "queue_full", "timed_out",
                                                                            "error")}
    kinds: dict[str, int] = {}
    for o in outcomes:
        if o["outcome"] in ("timed_out", "error"):
            kind = f"{o['outcome']} at {o['stage']}: {o.get('error', '')}"
            kinds[kind] = kinds.get(kind, 0) + 1
    return {
        "sessions": args.sessions, "queue_size": args.queue_size, "model": args.model,
        "max_new_tokens": args.max_new_tokens, "time_limit_s": args.time_limit,
        "server": server,
        "completed": counts["completed"], "queue_full": counts["queue_full"], "timed_out": counts["timed_out"],
        "errors": counts["error"], "not_run": args.sessions - len(outcomes),
        "failures": dict(sorted(kinds.items(), key=lambda item: -item[1])),
        # from a session's start (its connection included) to the run's end / its first streamed step
        "latency_s": percentiles([o["latency_s"] for o in outcomes if "latency_s" in o]),
        "first_update_s": percentiles([o["first_update_s"] for o in outcomes if "first_update_s" in o]),
        "connect_s": percentiles([o["connect_s"] for o in outcomes if "connect_s" in o]),
        "wall_s": None if wall_s is None else round(wall_s, 2),
        "server_rss_mb": memory,
    }


def metadata() -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        # uncommitted changes to tracked files (other work in the same tree) that the server ran with
        changed = subprocess.run(["git", "diff", "--name-only", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                 timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        commit, changed = None, []
    versions = {}
    for package in ("torch", "transformers", "gradio", "gradio_client"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    return {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "loadavg_at_start": load_average(), "python": platform.python_version(), **versions,
            "commit": commit, "uncommitted": changed, "argv": sys.argv[1:]}


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (how busy it was), None where the system has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = metadata()
    outcomes: list[dict] = []
    wall_s = None
    memory: dict = {"before": None, "peak": None, "after": None, "lifetime_peak": None}
    if args.url:
        memory["note"] = "a server this script did not start is not measured"
    server: dict = {"started": bool(args.url), "url": args.url} if args.url else {}
    proc = None
    with tempfile.TemporaryDirectory(prefix="kvviz-load-") as scratch:
        try:
            if args.url:
                outcomes, wall_s = run_sessions(args.url, args)
            else:
                port = free_port()
                proc, server = start_server(args, port, Path(scratch) / "server.log")
                if proc is not None:
                    before, _ = rss_mb(proc.pid)
                    with MemorySampler(proc.pid) as sampler:
                        outcomes, wall_s = run_sessions(f"http://127.0.0.1:{port}/", args)
                        after = sampler.sample()
                    _, lifetime = rss_mb(proc.pid)
                    memory = {"before": before, "peak": sampler.peak, "after": after, "lifetime_peak": lifetime}
                    if proc.poll() is not None:
                        server["exited"] = f"status {proc.returncode} during the sessions: " \
                                           f"{log_tail(Path(scratch) / 'server.log')}"
        except Exception as error:  # noqa: BLE001 - the report is printed whatever went wrong
            server["harness_error"] = f"{type(error).__name__}: {error}"[:300]
        finally:
            if proc is not None:
                stop_server(proc)
    meta["loadavg_at_end"] = load_average()
    report = report_of(args, outcomes, server, memory, wall_s)
    print(json.dumps(report), flush=True)
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"meta": meta}) + "\n" + json.dumps(report) + "\n")
        except OSError as error:
            print(f"load_test: could not write {args.out}: {error}", file=sys.stderr)
    ok = server.get("started") and len(outcomes) == args.sessions and \
        report["completed"] + report["queue_full"] == args.sessions
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
