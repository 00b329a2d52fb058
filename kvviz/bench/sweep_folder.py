"""A sweep's folder: its rows files, written one fsynced line per cell and resumed from what they hold, and
the claim and checks that keep two configs from writing into one folder."""

from __future__ import annotations

import fcntl
import json
import os
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .sweep_cells import _describe, cells, policy_settings


def check_shard(index: int, shards: int) -> None:
    if shards < 1:
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if not 0 <= index < shards:
        raise ValueError(f"--shard {index} is not one of {shards} shard(s); use --shard 0 to {shards - 1}")


def check_store(config: dict, out_dir: str | Path) -> None:
    """Refuse to add rows to a folder whose rows came from a different config: a resumed sweep would then
    mix two experiments under one name (and the CLI would overwrite the config that made the old rows).

    A config that only raises tasks' ``samples`` is the same experiment grown (:func:`grown`): it resumes."""
    out_dir = Path(out_dir)
    saved = out_dir / "config.toml"
    if not saved.exists() or not any(p.stat().st_size for p in out_dir.glob("rows*.jsonl")):
        return
    try:
        previous = tomllib.loads(saved.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{saved} is not valid TOML ({error}); restore it, or pass --out with a new folder") \
            from None
    if previous != config and not grown(previous, config):
        changed = sorted(key for key in previous.keys() | config.keys() if previous.get(key) != config.get(key))
        raise ValueError(f"{out_dir} holds rows of a different config ({saved} differs in {', '.join(changed)}); "
                         f"pass --out with a new folder, or resume with {saved}")


# Held shared by every process writing a sweep's rows (the shards, a Ray driver) for as long as it runs, so that
# none can put another config in that folder meanwhile; the last to finish removes it.
RUNNING_LOCK = ".sweep.lock"


@contextmanager
def claim(out_dir: str | Path, config: dict, config_text: bytes | None = None) -> Iterator[None]:
    """Hold ``out_dir`` for a run of ``config`` while the ``with`` lasts; with ``config_text``, save it there
    as ``config.toml`` first.

    The checks (:func:`check_store`, :func:`check_params_as_run`), the saving and the claim are one step under
    the folder's lock: two runs started together with different configs cannot both pass, and a config that
    is neither the saved one nor that one grown is refused while another run holds the folder, even before it
    has written a row."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    folder = os.open(out_dir, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)  # only for the steps below: a waiting run waits for seconds at most
        check_store(config, out_dir)
        check_params_as_run(config, out_dir)
        saved = out_dir / "config.toml"
        if config_text is not None and not (saved.exists() and saved.read_bytes() == config_text):
            try:
                previous = tomllib.loads(saved.read_text())
            except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError):  # none, or none a run could have saved
                previous = None
            if previous is not None and previous != config and not grown(previous, config) \
                    and _held(out_dir / RUNNING_LOCK):
                raise ValueError(f"another sweep is running in {out_dir} with the config saved there ({saved}); "
                                 "let it finish or stop it, or pass --out with a new folder")
            saved.write_bytes(config_text)
        running = os.open(out_dir / RUNNING_LOCK, os.O_RDONLY | os.O_CREAT, 0o644)
        fcntl.flock(running, fcntl.LOCK_SH)  # never waits: exclusive locks on it are only probes made under ours
    finally:
        os.close(folder)  # releases the folder's lock
    try:
        yield
    finally:
        _release(out_dir, running)


def _release(out_dir: Path, running: int) -> None:
    """Let go of a claim, and remove the lock file if no other run holds it, under the folder's lock (which
    every open of that file is made under, so no run can be holding a removed file's lock)."""
    try:
        folder = os.open(out_dir, os.O_RDONLY)
    except OSError:  # the folder itself is gone
        os.close(running)
        return
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        os.close(running)
        if not _held(out_dir / RUNNING_LOCK):
            (out_dir / RUNNING_LOCK).unlink(missing_ok=True)
    finally:
        os.close(folder)


def _held(path: Path) -> bool:
    """Whether any process holds ``path``'s lock (this one included, through another open of it)."""
    try:
        probe = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(probe)


def check_params_as_run(config: dict, out_dir: str | Path) -> None:
    """Refuse to resume a folder whose rows ran one of ``config``'s settings with other parameters than the code
    builds from it now: a registry default changed in between, and the new rows would join the old ones as one
    setting.  Each row records every parameter its policy ran with (``policy_params``); of rows from before they
    did only the parameters added to their policy since are checked (a row without R-KV's ``pooling`` ran
    ``"head-mean"``, :attr:`kvviz.policies.base.Policy.added_parameters`), and so are those a row's
    ``policy_params`` lack.  A folder that already holds every cell of ``config`` is not refused: rerunning it
    writes nothing, so nothing can join the old rows (``make sweeps`` over finished sweeps stays a no-op)."""
    from ..policies import get_spec, make_policy

    if {cell.key for cell in cells(config)} <= finished_cells(out_dir):
        return

    # As a row stores them: JSON numbers, lists for tuples
    now = {(name, json.dumps(dict(params), sort_keys=True)): json.loads(json.dumps(make_policy(name, **dict(params))
                                                                                   .params()))
           for name, params in policy_settings(config)}
    for shard in sorted(Path(out_dir).glob("rows*.jsonl")):
        for row in stored_rows(shard):
            ran, params = row.get("policy_params"), row.get("params")
            if not isinstance(params, dict):
                continue
            built = now.get((row.get("policy"), json.dumps(params, sort_keys=True)))
            if built is None:
                continue
            added = get_spec(row["policy"]).cls.added_parameters
            if isinstance(ran, dict):
                ran = {**{key: value for key, value in added.items() if key not in ran}, **ran}
            else:  # written before rows recorded every parameter: what they lack of those added since is known
                ran = {key: value for key, value in added.items() if key not in params}
                built = {key: built[key] for key in ran}
            if ran != built:
                changed = ", ".join(f"{key} = {ran.get(key)!r} then, {built.get(key)!r} now"
                                    for key in sorted(ran.keys() | built.keys()) if ran.get(key) != built.get(key))
                spelled = _describe((row["policy"], tuple(sorted(params.items()))))
                raise ValueError(
                    f"{shard} holds rows of {spelled} run with other parameters than the code gives it now "
                    f"({changed}: a default changed since, at commit {row.get('git_commit') or 'unknown'}); "
                    "resuming would file both under one setting.  Pass --out with a new folder, or spell the old "
                    "values out in the config's params to rerun under them")


def grown(previous: dict, config: dict) -> bool:
    """``config`` is ``previous`` with more samples of some of its tasks and nothing else changed.

    Sample ``i`` of a task is the same whatever the count (its prompt and seeds come from ``i``; a benchmark's
    are its first records), so the rows of ``previous`` are rows of ``config``, and a sweep is extended by
    raising ``samples`` and running it again.  Fewer samples is not growth: the rows past the new count
    would be stored under a config that does not ask for them.
    """
    if previous.keys() != config.keys() or any(previous[key] != config[key] for key in previous if key != "tasks"):
        return False
    old, new = previous.get("tasks"), config.get("tasks")
    if not (isinstance(old, list) and isinstance(new, list) and len(old) == len(new)):
        return False
    return all(isinstance(before, dict) and isinstance(after, dict) and before.keys() == after.keys()
               and all(before[key] == after[key] for key in before if key != "samples")
               and isinstance(before.get("samples"), int) and isinstance(after.get("samples"), int)
               and after["samples"] >= before["samples"] for before, after in zip(old, new))


class RowFile:
    """Append-only JSONL whose every row is one complete, fsynced line, written by one process at a time.

    Use it as a context manager: the file is locked (``flock``) from opening until the ``with`` ends or the
    process dies, so that the same shard started twice is refused instead of running every cell again, and
    the repair of a torn last line cannot cut rows that another writer has just appended."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._created = not path.exists()  # removed again if no row comes: a run with nothing left adds no file
        self._lock = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise ValueError(f"{path} is being written by another process (the same sweep and shard running "
                             "already); let it finish or stop it, then rerun to resume") from None
        try:
            self.done = stored_cells(path)  # read first: a bad line stops before any change
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1  # drop a torn last line left by a kill mid-write
            if keep != len(data):
                with open(path, "r+b") as handle:
                    handle.truncate(keep)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> RowFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._lock is not None:
            if self._created and self.path.stat().st_size == 0:
                self.path.unlink()
            os.close(self._lock)  # releases the flock
            self._lock = None

    def append(self, row: dict) -> None:
        line = (json.dumps(row) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            start = os.lseek(fd, 0, os.SEEK_END)
            try:
                written = 0
                while written < len(line):  # os.write may write part of it (a full disk, a signal)
                    written += os.write(fd, line[written:])
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, start)  # no part-row for the next one to be glued onto
                raise
        finally:
            os.close(fd)
        self.done.add(row["cell"])


def stored_cells(path: Path) -> set[str]:
    """Cell keys of the complete lines of one rows file (:func:`stored_rows`)."""
    return {row["cell"] for row in stored_rows(path)}


def stored_rows(path: Path) -> list[dict]:
    """The rows of the complete lines of one rows file; a torn last line (no newline yet: a kill mid-write,
    or another shard writing now) is not a row.  A complete line that is not a row is an error naming it."""
    data = path.read_bytes()
    rows = []
    for number, line in enumerate(data[:data.rfind(b"\n") + 1].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as error:  # JSONDecodeError, or bytes that are not UTF-8
            raise ValueError(f"{path} line {number} is not a JSON row ({error}); repair or delete that line") \
                from None
        if not isinstance(row, dict) or not isinstance(row.get("cell"), str):
            raise ValueError(f"{path} line {number} has no \"cell\" key, so it is not a sweep row; "
                             "repair or delete that line")
        rows.append(row)
    return rows


def finished_cells(out_dir: str | Path, skip: Path | None = None) -> set[str]:
    """Keys of the cells that any complete line of any shard in ``out_dir`` holds (``skip``: one shard left out)."""
    done = set()
    for shard in Path(out_dir).glob("rows*.jsonl"):
        if shard != skip:
            done |= stored_cells(shard)
    return done


def status(config: dict, out_dir: str | Path, by_cut: bool = False) -> dict:
    """Finished and total cells per task label of ``config`` in ``out_dir`` (every shard counted); with
    ``by_cut``, per (task label, :attr:`Cell.cut`): ``full``, each ``rho=...`` and each ``B=...``."""
    done = finished_cells(out_dir)
    counts: dict = {}
    for cell in cells(config):
        entry = counts.setdefault((cell.task, cell.cut) if by_cut else cell.task, [0, 0])
        entry[0] += cell.key in done
        entry[1] += 1
    return {key: (finished, total) for key, (finished, total) in counts.items()}
