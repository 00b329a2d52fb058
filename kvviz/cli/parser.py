"""The ``kvviz`` command line's options, each subcommand's own; built without importing torch, so that
``--help`` and a mistyped option answer at once."""

from __future__ import annotations

import argparse

from .analyses import cmd_policies, cmd_probe, cmd_scorers
from .bench import cmd_bench, cmd_serve
from .generate import cmd_generate
from .results import cmd_results
from .traces import cmd_trace


def _prompt_and_model_arguments(parser, default_model: str) -> None:
    from ..model_names import DTYPES

    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-file", help="read the prompt from this file")
    parser.add_argument("--model", default=default_model,
                        help="HF hub id, local folder, or tiny-random-<model_type> (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: float32 on the CPU, bfloat16 on a GPU)")


def _chat_argument(parser) -> None:
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                        help="wrap the prompt in the chat template (default); --no-chat tokenises it as is, "
                             "without special tokens")


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line (what to change), not a usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_generate(sub) -> None:
    """``kvviz generate``'s options."""
    from ..model_names import DEFAULT_MODEL

    gen = sub.add_parser("generate", help="generate text with an eviction policy")
    _prompt_and_model_arguments(gen, DEFAULT_MODEL)
    gen.add_argument("--policy", default="inertia", help="a name from `kvviz policies` (default: %(default)s)")
    budget = gen.add_mutually_exclusive_group()
    budget.add_argument("--compression", type=float,
                        help="rho in [0, 1): budget B = floor((1 - rho) x prompt length); default 0.9 when neither "
                             "this nor --budget is given (except --policy full: no eviction). The library's "
                             "kvviz.run defaults to no compression instead")
    budget.add_argument("--budget", type=int, help="absolute cache budget in tokens (instead of --compression)")
    gen.add_argument("--alpha", type=float, help="EMA coefficient in [0, 1] (InertiaKV family; default: the policy's, "
                                                 "see `kvviz policies`)")
    gen.add_argument("--refresh", type=int, help="score every r-th step (InertiaKV family; 1 = every step, 0 = "
                                                 "score-free; default: the policy's)")
    gen.add_argument("--param", action="append", metavar="NAME=VALUE",
                     help="any other policy parameter, repeatable (names and ranges: `kvviz policies`)")
    _chat_argument(gen)
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default: %(default)s)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    gen.add_argument("--top-p", type=float, help="nucleus sampling, with --temperature (default 1: the whole "
                                                 "distribution)")
    gen.add_argument("--seed", type=int, help="sampling seed, with --temperature (default 0)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--trace", help="save the per-step trace to this parquet file")
    gen.add_argument("--backend", choices=("auto", "engine", "static"), default="auto",
                     help="the decoder: auto (default) takes the static slot backend on a GPU for the policies it "
                          "runs and the engine otherwise; static refuses a policy it cannot run")
    gen.add_argument("--static", action="store_true",
                     help="InertiaKV on the static decode path (greedy; a CUDA graph per step on a GPU)")
    gen.add_argument("--compile", action="store_true", help="with --static: fuse each layer with torch.compile")
    gen.set_defaults(func=cmd_generate)


def _add_policies(sub) -> None:
    """``kvviz policies``'s options."""
    pol = sub.add_parser("policies", help="list the policy registry")
    pol.add_argument("--json", action="store_true", help="print the registry as one JSON list instead")
    pol.set_defaults(func=cmd_policies)


def _add_probe(sub) -> None:
    """``kvviz probe``'s options."""
    from ..model_names import DEFAULT_MODEL

    probe = sub.add_parser("probe", help="oracle damage probe: which entries hurt to remove, and who ranks them")
    _prompt_and_model_arguments(probe, DEFAULT_MODEL)
    probe.add_argument("--step", type=int, default=8, help="decode step to probe, >= 1 (default: %(default)s)")
    probe.add_argument("--sample", type=int, help="probe a seeded sample of this many entries (default: all)")
    probe.add_argument("--seed", type=int, default=0, help="seed of --sample's draw (default: %(default)s)")
    probe.add_argument("--future", type=int, default=8,
                       help="W_fut: teacher-forced tokens replayed (default: %(default)s)")
    probe.add_argument("--batch", type=int, default=16, help="candidates per forward pass (default: %(default)s)")
    probe.add_argument("--policies", default="inertia,inertia-lazy,tova,h2o,rkv,avokv,keydiff,knorm,recency",
                       help="comma-separated registry names or settings ('avokv delay=32'), or 'all' "
                       "(default: %(default)s)")
    _chat_argument(probe)
    probe.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    probe.add_argument("--blindspot", action="store_true", help="also AvoKV-E's blindspot test (Fig. 1a): "
                       "high-damage share by read-pressure and payload rank, from AvoKV-E's ranks at --step (computed "
                       "apart when avokv is not among --policies; the ranking table lists --policies only)")
    probe.set_defaults(func=cmd_probe)


def _add_scorers(sub) -> None:
    """``kvviz scorers``'s options."""
    from ..model_names import DEFAULT_MODEL

    sc = sub.add_parser("scorers", help="each scorer's ranking against attention, per layer and through "
                        "the EMA (InertiaKV §5.1), and how much layers agree")
    _prompt_and_model_arguments(sc, DEFAULT_MODEL)
    sc.add_argument("--steps", type=int, default=8,
                    help="decode steps compared, each with the whole cache (default: %(default)s)")
    sc.add_argument("--layer", type=int, help="layer of the per-layer comparison (default: the middle one)")
    sc.add_argument("--compression", type=float, default=0.9,
                    help="rho in [0, 1): top-B sets at B = (1 - rho) x cache size (default: %(default)s)")
    sc.add_argument("--alpha", type=float, default=0.8,
                    help="EMA coefficient in [0, 1] of the utilities compared (default: %(default)s)")
    sc.add_argument("--by-layer", action="store_true", help="also each scorer's Spearman at every layer")
    _chat_argument(sc)
    sc.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    sc.set_defaults(func=cmd_scorers)


def _add_trace(sub) -> None:
    """``kvviz trace``'s options."""
    tr = sub.add_parser("trace", help="a saved trace: its diagnostics, or what happened to chosen tokens")
    tr.add_argument("file", help="a parquet trace (kvviz generate --trace, or the app's download)")
    tr.add_argument("--follow", metavar="TEXT_OR_POSITIONS",
                    help="text to find in the tokens (e.g. 7342519) or positions (#12, #40-45)")
    tr.add_argument("--csv", action="store_true", help="with --follow: every step of every followed token as CSV")
    tr.add_argument("--read-lag", action="store_true", help="when generated entries are first strongly read, split "
                    "by their early attention (AvoKV-E Fig. 1b; needs a run that scored every step and kept the cache)")
    tr.add_argument("--model", help="tokenizer for the prompt's text (default: the model the trace names)")
    tr.set_defaults(func=cmd_trace)


def _add_bench(sub) -> None:
    """``kvviz bench``'s options."""
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from ..bench import probe_cost, speed

    speed.add_arguments(bench_sub.add_parser("speed", help="decode speed: generate vs engine policies"))
    probe_cost.add_arguments(bench_sub.add_parser("probe", help="damage-probe cost: batched vs one at a time"))
    run = bench_sub.add_parser("run", help="run (or resume) a sweep from a TOML config")
    run.add_argument("config", help="a sweep's TOML file, e.g. configs/needle-grid.toml")
    run.add_argument("--out", help="folder for rows and config (default: the repository's results_db/<name>, "
                     "kvviz.store.ROOT, where `kvviz results` and the app read; not relative to the current folder)")
    run.add_argument("--shards", type=int, default=1,
                     help="split the samples into this many shards (default: %(default)s)")
    run.add_argument("--shard", type=int, default=0,
                     help="which shard this process runs, 0 to --shards - 1 (default: %(default)s)")
    run.add_argument("--backend", choices=("local", "ray"), default="local",
                     help="ray: run each sample's cells as a Ray task (one GPU each on a cuda config), the rows "
                     "written by this process to rows.jsonl; resumable as local is (default: %(default)s)")
    run.add_argument("--ray-address", help="an existing Ray cluster (default: start a local one on loopback)")
    run.add_argument("--status", action="store_true", help="only print how many cells are done, per task")
    rank = bench_sub.add_parser("ranking", help="run (or resume) a damage-ranking sweep (AvoKV-E's Table 3 "
                                "measured) from a TOML config")
    rank.add_argument("config", help="a ranking sweep's TOML file, e.g. configs/ranking-arithmetic.toml")
    rank.add_argument("--out", help="folder for rows and config (default: the repository's results_db/<name>)")
    rank.add_argument("--status", action="store_true", help="only print how many traces are done, per task")
    bench.set_defaults(func=cmd_bench)


def _add_results(sub) -> None:
    """``kvviz results``'s options."""
    res = sub.add_parser("results", help="print the stored sweeps (results_db/) as tables")
    res.add_argument("--task", help="one task label, e.g. single_needle")
    res.add_argument("--model", help="one model name")
    res.add_argument("--policies", help="comma-separated registry names")
    res.add_argument("--source", choices=("measured", "paper"), help="only measured or only paper rows")
    res.add_argument("--sweeps", help="comma-separated sweep names (folders under results_db/): only the cells they "
                     "ran, e.g. to compare decode speeds within one run")
    res.add_argument("--paper", metavar="SUITE", help="measured vs paper on this benchmark, e.g. RULER")
    res.add_argument("--vs", metavar="POLICY", help="each policy's paired difference to this one on the same "
                     "samples, with a bootstrap confidence interval and wins/ties/losses, e.g. --vs inertia, or "
                     "to one setting as --settings names it, e.g. --vs 'avokv lambda_b=0'")
    res.add_argument("--settings", action="store_true", help="also every other parameter setting run (the α "
                     "and refresh sweeps, ablations), each its own row such as 'avokv interval=16'; with --vs, "
                     "paired against the reference as --vs names it")
    res.add_argument("--ranking", action="store_true", help="the damage-ranking rows instead (AUROC, AP, top-k "
                     "recall, false-safe rate, Spearman of each policy's utility against oracle damage: AvoKV-E's "
                     "Table 3 and `kvviz bench ranking`)")
    res.add_argument("--csv", action="store_true", help="the long table as CSV instead")
    res.add_argument("--root", help="results folder (default: the repository's results_db/)")
    res.set_defaults(func=cmd_results)


def _add_serve(sub) -> None:
    """``kvviz serve``'s options."""
    from ..model_names import DTYPES

    serve = sub.add_parser("serve", help="start the Gradio app (same as python app.py)")
    serve.add_argument("--device", help="where every model runs: cpu, cuda or cuda:N (default: $KVVIZ_DEVICE or cpu)")
    serve.add_argument("--dtype", choices=DTYPES,
                       help="model dtype (default: $KVVIZ_DTYPE, else float32 on the CPU, bfloat16 on a GPU)")
    serve.add_argument("--models", help="the models offered, comma-separated, the first the default (default: "
                                        "$KVVIZ_DEFAULT_MODEL and $KVVIZ_MODELS)")
    serve.add_argument("--figures-per-second", type=float,
                       help="most redraws a second of a streaming run's heatmap, 0 to 60; 0 for none until it ends "
                            "(default: $KVVIZ_FIGURES_PER_SECOND, else 10; fewer keep a slow browser responsive)")
    serve.add_argument("--host", help="address to listen on; 0.0.0.0 for every interface (default: "
                                      "$GRADIO_SERVER_NAME, else 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: $GRADIO_SERVER_PORT, else 7860)")
    serve.set_defaults(func=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvviz", description="Explore decoding-time KV-cache eviction.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _add_generate(sub)
    _add_policies(sub)
    _add_probe(sub)
    _add_scorers(sub)
    _add_trace(sub)
    _add_bench(sub)
    _add_results(sub)
    _add_serve(sub)
    return parser
