"""The ``kvviz`` command: generate with a policy, list policies, run benchmarks, serve the app.

One module per group of subcommands (:mod:`.generate`, :mod:`.analyses`, :mod:`.traces`, :mod:`.bench`,
:mod:`.results`), their options in :mod:`.parser`; :func:`main` is the entry point.
"""

from __future__ import annotations

import os
import sys

from .parser import build_parser

__all__ = ["build_parser", "main"]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"kvviz: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvviz trace F --follow X | head`: the reader had enough
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
