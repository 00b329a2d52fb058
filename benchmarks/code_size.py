"""The sizes the next person has to hold in mind, and how long the tests take.

Prints the longest source files and functions of the library (``kvviz/`` and ``app.py``), each against the
project's limits (files under ~600 lines, functions under ~60), and with ``--tests`` the wall time of
``make test``'s own commands on this machine, with the load average before and after (a busy machine
makes the suite slower than the 8-minute target means).

    .venv/bin/python benchmarks/code_size.py [--top 5] [--tests]
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILE_LIMIT, FUNCTION_LIMIT, TEST_MINUTES = 600, 60, 8.0


def sources(root: Path = ROOT) -> list[Path]:
    return sorted([*root.joinpath("kvviz").rglob("*.py"), root / "app.py"])


def file_lengths(paths: list[Path]) -> list[tuple[int, str]]:
    return sorted(((len(p.read_text().splitlines()), str(p.relative_to(ROOT))) for p in paths), reverse=True)


def function_lengths(paths: list[Path]) -> list[tuple[int, str]]:
    """Every function and method by its span in lines (decorators and docstring included)."""
    found = []
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                found.append((node.end_lineno - start + 1, f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"))
    return sorted(found, reverse=True)


def timed_tests() -> float:
    """Seconds for the commands `make test` runs (the venv already installed)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    subprocess.run(["make", "-s", "test"], cwd=ROOT, env=env, check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5, help="how many of the longest to list")
    parser.add_argument("--tests", action="store_true", help="also time `make test` (minutes)")
    args = parser.parse_args(argv)
    paths = sources()
    files, functions = file_lengths(paths), function_lengths(paths)
    print(f"longest files (limit ~{FILE_LIMIT} lines):")
    for lines, name in files[: args.top]:
        print(f"  {lines:5d}  {name}{'  OVER' if lines > FILE_LIMIT else ''}")
    print(f"longest functions (limit ~{FUNCTION_LIMIT} lines):")
    for lines, name in functions[: args.top]:
        print(f"  {lines:5d}  {name}{'  OVER' if lines > FUNCTION_LIMIT else ''}")
    over = sum(lines > FUNCTION_LIMIT for lines, _ in functions)
    print(f"{len(files)} files, {len(functions)} functions, {over} over {FUNCTION_LIMIT} lines")
    if args.tests:
        load = os.getloadavg()[0]
        seconds = timed_tests()
        print(f"make test: {seconds / 60:.1f} min on {os.cpu_count()} cores "
              f"(load {load:.1f} before, {os.getloadavg()[0]:.1f} after; target {TEST_MINUTES:.0f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
