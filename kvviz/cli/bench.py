"""``kvviz bench`` (speed, probe cost, sweeps, damage-ranking sweeps) and ``kvviz serve``."""

from __future__ import annotations

from pathlib import Path

from .common import _check_writable


def cmd_bench(args) -> int:
    from ..bench import probe_cost, speed, sweep

    if args.bench == "run":
        from .. import store

        config = sweep.load_config(args.config)
        # The store's folder, not ./results_db: wherever this runs from, `kvviz results` reads what it writes.
        out = Path(args.out) if args.out else store.ROOT / config["name"]
        if args.status:
            sweep.check_store(config, out)  # counts against another config's rows would mean nothing
            progress = sweep.status(config, out)
            # with absolute budgets, also how far each cut is: the full cache, each ρ, each B=...
            by_cut = sweep.status(config, out, by_cut=True) \
                if any(budgets for _, budgets in sweep.setting_grids(config).values()) else {}
            for task, (finished, total) in progress.items():
                print(f"{config['name']} {task}: {finished} of {total} cells")
                for (_, cut), (finished, total) in ((key, value) for key, value in by_cut.items() if key[0] == task):
                    print(f"  {cut}: {finished} of {total} cells")
            finished, total = (sum(v[i] for v in progress.values()) for i in (0, 1))
            print(f"{config['name']}: {finished} of {total} cells done")
            return 0
        # Options the chosen backend would silently ignore: ray deals out the samples itself, local needs no cluster.
        if args.backend == "ray" and (args.shard or args.shards != 1):
            raise ValueError("--backend ray runs every sample as its own task on the cluster: "
                             "drop --shards and --shard")
        if args.ray_address and args.backend != "ray":
            raise ValueError("--ray-address applies to --backend ray only; add --backend ray or drop --ray-address")
        sweep.check_shard(args.shard if args.backend == "local" else 0, args.shards)
        text = _sweep_folder(config, args.config, out)
        if args.backend == "ray":
            written = sweep.run_ray(config, out, address=args.ray_address, config_text=text)
        else:
            written = sweep.run(config, out, shard=(args.shard, args.shards), config_text=text)
        print(f"{written} new rows in {out}")
        return 0
    if args.bench == "ranking":
        return _bench_ranking(args)
    if args.out:  # refused before the model loads, not by a traceback after the measurements
        _check_writable(args.out, "--out", "results.jsonl")
    return {"speed": speed.main, "probe": probe_cost.main}[args.bench](args)


def _bench_ranking(args) -> int:
    """Run (or resume, or count) a damage-ranking sweep into the store's folder for it."""
    from .. import store
    from ..bench import ranking, sweep

    config = ranking.load_config(args.config)
    out = Path(args.out) if args.out else store.ROOT / config["name"]
    sweep.check_store(config, out)  # rows of another config in that folder: neither counted nor added to
    if args.status:
        progress = ranking.status(config, out)
        for task, (finished, total) in progress.items():
            print(f"{config['name']} {task}: {finished} of {total} traces")
        return 0
    text = _sweep_folder(config, args.config, out)
    written = ranking.run(config, out, config_text=text)
    print(f"{written} new rows in {out}")
    return 0


def _sweep_folder(config: dict, config_path: str, out: Path) -> bytes:
    """Make a sweep's folder, refusing a file in its place or a folder of another config's rows (before the run
    saves this config over the config that made them); returns the config file's text, which the run saves."""
    from ..bench import sweep

    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; a sweep writes a folder (its rows and config), so "
                         "give a folder path")
    sweep.check_store(config, out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"the sweep's folder {str(out)!r} cannot be made ({error.strerror or error}); "
                         "choose another --out") from None
    return Path(config_path).read_bytes()


def cmd_serve(args) -> int:
    from ..ui.app import launch
    from ..ui.config import Limits

    overrides = {"device": args.device, "dtype": args.dtype, "figures_per_second": args.figures_per_second,
                 "host": args.host, "port": args.port}
    if args.models is not None:
        overrides["models"] = tuple(dict.fromkeys(name.strip() for name in args.models.split(",") if name.strip()))
    # The same app as `python app.py`, the flags over the environment.
    launch(Limits.from_env(**{key: value for key, value in overrides.items() if value is not None}))
    return 0
