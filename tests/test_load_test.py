"""benchmarks/load_test.py always ends in its full report: a server that refuses connections, one that never
answers, and one that never starts are counted and said, never a traceback (issue 44: on a busy 2-core machine
the client's connect timeout used to end the script before it printed anything)."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
KEYS = ["sessions", "queue_size", "model", "max_new_tokens", "time_limit_s", "server", "completed", "queue_full",
        "timed_out", "errors", "not_run", "failures", "latency_s", "first_update_s", "connect_s", "wall_s",
        "server_rss_mb"]


@pytest.fixture(scope="module")
def load_test():
    spec = importlib.util.spec_from_file_location("load_test", ROOT / "benchmarks" / "load_test.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(load_test, capsys, tmp_path, *args: str) -> tuple[int, dict, list[dict], float]:
    out = tmp_path / "load.jsonl"
    start = time.perf_counter()
    code = load_test.main(["--sessions", "3", "--time-limit", "10", "--http-timeout", "1", "--out", str(out), *args])
    seconds = time.perf_counter() - start
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    printed = json.loads(captured.out.strip().splitlines()[-1])
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert list(printed) == KEYS and written[1] == printed and written[0]["meta"]["cpus"] >= 1
    return code, printed, written, seconds


def test_refused_connections_are_counted_and_the_report_is_printed(load_test, capsys, tmp_path):
    code, report, _, seconds = run(load_test, capsys, tmp_path, "--url", f"http://127.0.0.1:{free_port()}/")
    assert code == 1 and seconds < 10
    assert (report["completed"], report["queue_full"], report["timed_out"], report["errors"]) == (0, 0, 0, 3)
    [(kind, count)] = report["failures"].items()
    assert count == 3 and kind.startswith("error at connect: ConnectError")
    assert report["latency_s"] is None and report["first_update_s"] is None and report["wall_s"] is not None


def test_a_server_that_never_answers_is_counted_as_timed_out(load_test, capsys, tmp_path):
    with socket.socket() as listening:  # accepts connections (the kernel's backlog) but never answers
        listening.bind(("127.0.0.1", 0))
        listening.listen(8)
        url = f"http://127.0.0.1:{listening.getsockname()[1]}/"
        code, report, _, seconds = run(load_test, capsys, tmp_path, "--url", url)
    assert code == 1 and seconds < 10
    assert (report["completed"], report["timed_out"], report["errors"]) == (0, 3, 0)
    assert all(kind.startswith("timed_out at connect: ReadTimeout") for kind in report["failures"])


def test_a_server_that_fails_to_start_is_said_and_no_session_runs(load_test, capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(load_test, "server_command", lambda port, model: [
        sys.executable, "-c", "import sys; print('kvviz: error: no such model'); sys.exit(2)"])
    code, report, _, seconds = run(load_test, capsys, tmp_path)
    assert code == 1 and seconds < 10
    assert report["server"]["started"] is False
    assert report["server"]["error"] == "exited with status 2 before listening: kvviz: error: no such model"
    assert report["not_run"] == 3 and report["completed"] == report["errors"] == 0
    assert report["server_rss_mb"]["before"] is None


def test_only_loopback_is_load_tested(load_test):
    with pytest.raises(SystemExit):
        load_test.parse_args(["--url", "http://example.com/"])
