"""Per-step events and the trace they make up (save to / load from parquet)."""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .notes import budget_note, checkpoint_note, run_note, sampling_note  # noqa: F401 -- their old home


def model_dtype(model) -> str:
    """A model's dtype as a trace records it: ``"bfloat16"``, ``"float32"``."""
    return str(model.dtype).removeprefix("torch.")


@dataclass
class StepEvent:
    """What happened at one decode step.

    Step ``k >= 1`` is the forward pass that consumes generated token ``k`` (``token_id``) and produces
    token ``k + 1`` (``new_token_id``, text ``text``).  Step 0 is the prefill, which produces token 1.

    Attributes
    ----------
    kept : np.ndarray
        Sorted absolute positions in the cache after this step's eviction (what step ``k + 1`` attends to).
    evicted : np.ndarray
        Positions dropped at this step, sorted.
    utility : np.ndarray or None
        The policy's utility for each position in ``kept`` (same order), if the policy has one.
    raw : np.ndarray or None
        The policy's un-aggregated score of this step (e.g. layer-mean attention) for every position present
        before eviction, i.e. ``union(kept, evicted)`` in position order; ``None`` if it computed none.
    scored : bool
        Whether the policy was handed this step's per-layer views (its ``wants_scores``; at the prefill, its
        ``prefill_window``): InertiaKV on its refresh steps, a checkpointed policy (AvoKV-E, R-KV,
        LazyEviction) at every step, as it keeps a window of queries (LazyEviction: its read times) between
        checkpoints.  Whether it made a score of them is
        ``raw is not None``.
    t_forward, t_score, t_evict : float
        Seconds in the model forward (scoring excluded), in scoring, and in choosing and applying evictions.
    cache_bytes : int
        Bytes the cache's key/value buffers hold after this step (allocated slots, all layers).
    components : dict of str to np.ndarray, or None
        The named terms of this step's eviction decision (e.g. AvoKV-E's ``p``, ``r``, ``b``, ``N(p)``, ...,
        ``S``), each aligned with ``present`` like ``raw`` (NaN for entries not judged); ``None`` on steps
        that decided nothing this way.
    """

    step: int
    token_id: int
    new_token_id: int
    text: str
    kept: np.ndarray
    evicted: np.ndarray
    utility: np.ndarray | None = None
    raw: np.ndarray | None = None
    scored: bool = False
    t_forward: float = 0.0
    t_score: float = 0.0
    t_evict: float = 0.0
    cache_bytes: int = 0
    components: dict[str, np.ndarray] | None = None

    @property
    def cache_size(self) -> int:
        return int(self.kept.size)

    @property
    def present(self) -> np.ndarray:
        """Positions in the cache during this step, before its eviction (what ``raw`` is aligned with)."""
        return np.union1d(self.kept, self.evicted)

    def to_json(self) -> dict:
        return {
            "step": self.step,
            "token_id": self.token_id,
            "new_token_id": self.new_token_id,
            "text": self.text,
            "kept": self.kept.tolist(),
            "evicted": self.evicted.tolist(),
            "cache_size": self.cache_size,
            "scored": self.scored,
            "t_forward": self.t_forward,
            "t_score": self.t_score,
            "t_evict": self.t_evict,
            "cache_bytes": self.cache_bytes,
            # null for what is not finite (JSON has neither): not judged, or a sink's S kept by rule
            **({"components": {name: [v if math.isfinite(v) else None for v in values.tolist()]
                               for name, values in self.components.items()}} if self.components else {}),
        }


def time_split(events) -> dict[str, float]:
    """Seconds the decode steps (step >= 1) spent in the forward pass, in scoring and in eviction."""
    steps = [event for event in events if event.step >= 1]
    return {"forward": sum(e.t_forward for e in steps), "score": sum(e.t_score for e in steps),
            "evict": sum(e.t_evict for e in steps)}


@dataclass
class Trace:
    """A whole run: its settings and every step's event (``events[0]`` is the prefill)."""

    prompt_ids: list[int]
    budget: int
    policy: str
    params: dict = field(default_factory=dict)
    model: str = ""
    events: list[StepEvent] = field(default_factory=list)
    sampling: dict = field(default_factory=dict)  # engine.Sampler's arguments (temperature, top_p, seed); {}: greedy
    dtype: str = ""  # the model's dtype ("bfloat16"); "" in traces saved before it was recorded
    max_new_tokens: int = 0  # what the run was asked for; 0 in traces saved before it was recorded
    stopped: bool = False  # Stop ended it before end-of-sequence or max_new_tokens
    # The ρ that set the budget, B = floor((1 - ρ) L0); None where an absolute budget did (or in traces saved
    # before it was recorded)
    compression: float | None = None
    # The prompt as given, before any chat template, and whether the template was asked for (a model without
    # one reads the text as is): what reruns the run from text.  "" and None where the run was given token ids,
    # and in traces saved before they were recorded.
    prompt: str = ""
    chat: bool | None = None

    @classmethod
    def from_run(cls, settings, prompt_ids, budget: int, policy: str, params: dict, events: list[StepEvent], *,
                 model: str = "", dtype: str = "", stopped: bool = False, prompt: str = "",
                 chat: bool | None = None) -> "Trace":
        """The trace of a run made under ``settings`` (a :class:`kvviz.settings.Settings`: its sampling, its
        length and the compression that set ``budget`` are recorded from it, so that no caller records one and
        runs another).

        Parameters
        ----------
        settings : kvviz.settings.Settings
            What the run was asked for.
        prompt_ids : sequence of int, shape (L0,)
            The prompt's token ids, as fed (after any chat template).
        budget : int
            The budget in tokens the run held (``settings.budget_for(L0)``).
        policy, params : str, dict
            The policy's registry name and every parameter it ran with (``Policy.params()``).
        events : list of StepEvent
            The run's steps, the prefill first.
        model, dtype : str
            The model's name and dtype (:func:`model_dtype`).
        stopped : bool
            Whether Stop ended the run early.
        prompt, chat : str, bool or None
            The prompt as typed and whether the chat template was asked for; ``""`` and None for token ids.
        """
        return cls(list(prompt_ids), budget, policy, params, model, events, settings.sampling, dtype,
                   settings.max_new_tokens, stopped=stopped, compression=settings.compression, prompt=prompt,
                   chat=chat)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """Generated token ids (token 1 comes out of the prefill)."""
        return [e.new_token_id for e in self.events if e.new_token_id >= 0]

    @property
    def decode_steps(self) -> list[StepEvent]:
        return [e for e in self.events if e.step >= 1]

    def meta(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "budget": self.budget, "policy": self.policy,
                "params": self.params, "model": self.model, "sampling": self.sampling, "dtype": self.dtype,
                "max_new_tokens": self.max_new_tokens, "stopped": self.stopped, "compression": self.compression,
                "prompt": self.prompt, "chat": self.chat}

    def save(self, path: str | Path) -> None:
        # Imported here: the engine (and a GPU machine's benchmark, which may lack them) never saves a trace.
        import pandas as pd
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = [asdict(e) for e in self.events]
        for row in rows:
            for key in ("kept", "evicted", "utility", "raw"):
                row[key] = None if row[key] is None else row[key].tolist()
            if row["components"] is not None:
                row["components"] = {name: values.tolist() for name, values in row["components"].items()}
        table = pa.Table.from_pandas(pd.DataFrame(rows), preserve_index=False)
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"kvviz": json.dumps(self.meta())})
        pq.write_table(table, path)

    @classmethod
    def load(cls, path: str | Path, bounds: "TraceBounds | None" = None) -> "Trace":
        """Read a trace written by :meth:`save`; anything else raises ``ValueError`` saying what is wrong.

        Nothing is converted to Python objects before the file's sizes are checked against ``bounds`` (steps,
        prompt tokens, entries per step, text lengths, metadata bytes), first from the parquet footer and
        then from the arrow buffers: a few KB of compressed parquet can hold millions of rows or a string of
        hundreds of MB, and converting those first held a server for a minute and gigabytes.
        """
        import pyarrow as pa

        bounds = bounds or TraceBounds()
        name = Path(path).name
        try:
            meta, table = _read_bounded(Path(path), name, bounds)
            events = [StepEvent(**row) for row in _event_rows(table)]
            del table
            trace = cls(events=events, **meta)
        except (TypeError, KeyError) as error:  # a column or a metadata key missing or of a wrong type
            raise ValueError(f"{name} is not a kvviz trace this version reads ({type(error).__name__}: "
                             f"{str(error)[:200]})") from None
        finally:
            pa.default_memory_pool().release_unused()  # a refused file's buffers go back to the system now
        trace.check(name)  # ValueError only: every setting's type is checked before it is used
        return trace

    def check(self, name: str = "the trace") -> None:
        """Raise ``ValueError`` unless this is one run: settings of the right types, steps 0, 1, 2, ..., and
        at each step distinct kept and evicted positions that existed then (the prompt plus the tokens fed
        back so far), one utility per kept entry, and one raw score and one value of each term per entry present."""
        settings = [("prompt_ids", isinstance(self.prompt_ids, list) and all(_is_int(i) for i in self.prompt_ids),
                     "a list of token ids"),
                    ("budget", _is_int(self.budget) and self.budget >= 1, "a whole number >= 1"),
                    ("policy", isinstance(self.policy, str), "a string"),
                    ("model", isinstance(self.model, str), "a string"),
                    ("params", isinstance(self.params, dict), "an object"),
                    ("dtype", isinstance(self.dtype, str), "a string"),
                    ("max_new_tokens", _is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "a whole number"),
                    ("stopped", isinstance(self.stopped, bool), "true or false"),
                    ("compression", self.compression is None or (
                        isinstance(self.compression, (int, float)) and not isinstance(self.compression, bool)
                        and 0 <= self.compression < 1), "absent (an absolute budget) or a ratio in [0, 1)"),
                    ("sampling", isinstance(self.sampling, dict) and (not self.sampling or (
                        set(self.sampling) == {"temperature", "top_p", "seed"} and _is_int(self.sampling["seed"])
                        and all(isinstance(self.sampling[k], (int, float)) and not isinstance(self.sampling[k], bool)
                                for k in ("temperature", "top_p")))),
                     "empty (greedy) or an object of temperature, top_p and an integer seed"),
                    ("prompt", isinstance(self.prompt, str), "a string"),
                    ("chat", self.chat is None or isinstance(self.chat, bool), "absent, true or false")]
        for key, ok, kind in settings:
            if not ok:
                raise ValueError(f"{name}: its {key} is {getattr(self, key)!r:.60}, not {kind}")
        if not self.events:
            raise ValueError(f"{name} holds no steps")
        for index, event in enumerate(self.events):
            self._check_step(name, index, event)

    def _check_step(self, name: str, index: int, event: StepEvent) -> None:
        """One row of :meth:`check`: the ``index``-th step, its types, positions and per-entry arrays."""
        if event.step != index:
            raise ValueError(f"{name}: row {index} is step {event.step}; a trace's steps run 0, 1, 2, ...")
        if not isinstance(event.text, str) or not _is_int(event.new_token_id):
            raise ValueError(f"{name}: step {event.step} has no text or token id of the right type")
        # the views' statistics add these up: a string among them failed there, not here
        timed = (event.t_forward, event.t_score, event.t_evict)
        if not (all(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
                    for t in timed) and _is_int(event.cache_bytes) and event.cache_bytes >= 0
                and isinstance(event.scored, bool)):
            raise ValueError(f"{name}: step {event.step} has times, a cache size or a scored flag of the wrong "
                             "type (seconds >= 0, bytes a whole number, scored true or false)")
        end = self.prompt_len + event.step  # positions 0 .. end - 1 exist during step k
        for what, positions in (("kept", event.kept), ("evicted", event.evicted)):
            if positions.size and (positions.min() < 0 or positions.max() >= end):
                raise ValueError(f"{name}: step {event.step} has {what} positions outside 0..{end - 1}")
            if np.unique(positions).size != positions.size:
                raise ValueError(f"{name}: step {event.step} lists a {what} position twice")
        if np.intersect1d(event.kept, event.evicted).size:
            raise ValueError(f"{name}: step {event.step} has positions both kept and evicted")
        if event.utility is not None and event.utility.shape != event.kept.shape:
            raise ValueError(f"{name}: step {event.step} has {event.utility.size} utilities for "
                             f"{event.kept.size} kept positions")
        present = event.kept.size + event.evicted.size
        if event.raw is not None and event.raw.size != present:
            raise ValueError(f"{name}: step {event.step} has {event.raw.size} raw scores for {present} "
                             "entries present")
        for term, values in (event.components or {}).items():
            if values.shape != (present,):
                raise ValueError(f"{name}: step {event.step} has {values.size} values of {term!r} for "
                                 f"{present} entries present")


@dataclass(frozen=True)
class TraceBounds:
    """The largest trace :meth:`Trace.load` converts; the defaults suit a file of one's own, an app passes its
    run limits (``max_steps`` decode steps, ``max_prompt_tokens``) so that it opens only what it could make."""

    max_steps: int = 1_000_000
    max_prompt_tokens: int = 1_000_000
    max_text_chars: int = 1_000  # one step's text: a token's, or a few tokens' held for a split character
    max_name_chars: int = 1_000  # the model, policy and dtype names, a components term's name
    max_terms: int = 64  # named terms of an eviction decision (AvoKV-E has 7)
    reader: str = "this reader"  # who refuses, and what to do instead, in a refusal of a trace too large
    advice: str = ""

    def too_large(self, name: str, what: str) -> ValueError:
        """The refusal of a file ``name`` that ``what`` (``"has a 9000-token prompt"``), naming these bounds."""
        return ValueError(f"{name} {what}; {self.reader} opens traces of up to {self.max_prompt_tokens} prompt "
                          f"tokens and {self.max_steps} steps{self.advice}")

    def refuse_size(self, name: str, prompt_len: int, steps: int) -> None:
        """Raise ``ValueError`` for a trace with a longer prompt or more decode steps than these bounds allow."""
        if prompt_len > self.max_prompt_tokens or steps > self.max_steps:
            raise self.too_large(name, f"has a {prompt_len}-token prompt and {steps} decode steps")

    @property
    def max_prompt_chars(self) -> int:
        return 64 * self.max_prompt_tokens + 10_000

    @property
    def max_meta_bytes(self) -> int:
        """The metadata JSON: the prompt's ids and text (escaped, up to 6 bytes a character), settings."""
        return 12 * self.max_prompt_tokens + 6 * self.max_prompt_chars + 1_000_000


EVENT_COLUMNS = {f.name for f in StepEvent.__dataclass_fields__.values()}
LIST_COLUMNS = ("kept", "evicted", "utility", "raw")


def _check_file(path: Path, name: str, bounds: TraceBounds) -> None:
    """Refuse what is no trace file before arrow reads it: a missing path, a folder, a zip, a file that does not
    end in a parquet footer, or one with a footer larger than these bounds' settings could make."""
    if not path.exists():  # said plainly: arrow's message for this would read as a corrupt file
        raise ValueError(f"{path} does not exist; give the path of a trace saved with "
                         "`kvviz generate --trace FILE` or the Live tab's download")
    if path.is_dir():  # arrow would read the folder as a dataset and complain about some file in it
        raise ValueError(f"{path} is a folder; give the path of a trace file (.parquet) saved with "
                         "`kvviz generate --trace FILE` or the Live tab's download")
    if zipfile.is_zipfile(path):  # the Compare tab's download: one trace per policy inside
        raise ValueError(f"{name} is a zip (a comparison's download?), not a trace; unzip it and open one of "
                         "its .parquet files, a trace per policy")
    with open(path, "rb") as handle:  # the footer's length, from the file's last 8 bytes, before arrow reads it
        handle.seek(0, 2)
        size = handle.tell()
        handle.seek(max(0, size - 8))
        tail = handle.read(8)
    if size < 12 or tail[4:] != b"PAR1":
        raise ValueError(f"{name} is not a readable parquet file (it does not end in a parquet footer); open a "
                         "trace saved with `kvviz generate --trace FILE` or the Live tab's download")
    footer = int.from_bytes(tail[:4], "little")
    if footer > 3 * bounds.max_meta_bytes + 4_000_000:  # the settings are in it twice: as is and in arrow's schema
        raise bounds.too_large(name, f"has a parquet footer of {footer:,} bytes")


def _check_chunks(parquet, name: str, bounds: TraceBounds, prompt_len: int) -> None:
    """The footer's sizes of each column chunk, before any is read: entries of the list columns and bytes of
    the step texts that ``rows`` steps of a ``prompt_len``-token prompt could hold."""
    rows = parquet.metadata.num_rows
    # Entries a list column can hold: at step k, at most the prompt plus k tokens (a row's empty list counts 1)
    entries = rows * (prompt_len + rows) + rows
    text_bytes = rows * 4 * bounds.max_text_chars
    for group in range(parquet.metadata.num_row_groups):
        for index in range(parquet.metadata.num_columns):
            chunk = parquet.metadata.row_group(group).column(index)
            column = chunk.path_in_schema.split(".")[0]
            if column in LIST_COLUMNS or column == "components":
                entries_left = entries if column != "components" else entries * bounds.max_terms
                if chunk.num_values > entries_left:
                    raise ValueError(f"{name}'s {column} column holds {chunk.num_values:,} entries; {rows} steps "
                                     f"of a {prompt_len}-token prompt have at most {entries:,}")
            if column == "text" and chunk.total_uncompressed_size > text_bytes + 100_000:
                raise ValueError(f"{name}'s step texts take {chunk.total_uncompressed_size:,} bytes; a step's text "
                                 f"is a token or a few ({bounds.max_text_chars} characters at most)")


def _check_table(table, columns: list[str], name: str, bounds: TraceBounds, prompt_len: int, components) -> None:
    """The buffers just read, before any conversion: the footer's counts are the writer's word."""
    import pyarrow as pa
    import pyarrow.compute as pc

    bounds.refuse_size(name, prompt_len, table.num_rows - 1)
    if "text" in columns and table.num_rows:
        if not (pa.types.is_string(table["text"].type) or pa.types.is_large_string(table["text"].type)):
            raise ValueError(f"{name}'s step texts are {table['text'].type}, not text")
        longest = pc.max(pc.utf8_length(table["text"])).as_py() or 0
        if longest > bounds.max_text_chars:
            raise ValueError(f"{name} has a step text of {longest:,} characters; a step's text is a token or a few "
                             f"({bounds.max_text_chars} characters at most)")
    lists = [table[column] for column in LIST_COLUMNS if column in columns]
    if components is not None and pa.types.is_struct(components):
        lists += [pc.struct_field(table["components"], [i]) for i in range(components.num_fields)]
    for values in lists:
        if (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)) and table.num_rows:
            lengths = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            limit = prompt_len + np.arange(table.num_rows)  # at step k: the prompt and k tokens
            if np.any(np.nan_to_num(lengths, nan=0) > limit):
                raise ValueError(f"{name} lists more entries at a step than the prompt and the tokens so far")


def _read_bounded(path: Path, name: str, bounds: TraceBounds):
    """The trace's metadata (a dict) and its arrow table, each size checked before it is read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _check_file(path, name, bounds)
    try:
        parquet = pq.ParquetFile(path)
    except (OSError, pa.ArrowException) as error:
        # arrow names the full path (a server's temporary upload folder, in the app): the name is enough
        raise ValueError(f"{name} is not a readable parquet file "
                         f"({str(error).replace(str(path), name)[:200]})") from None
    meta = _checked_meta(parquet.metadata.metadata or {}, name, bounds, parquet.metadata.num_rows)
    rows, prompt_len = parquet.metadata.num_rows, len(meta["prompt_ids"])
    bounds.refuse_size(name, prompt_len, rows - 1)
    columns = parquet.schema_arrow.names
    if set(columns) - EVENT_COLUMNS:
        raise ValueError(f"{name} has columns a kvviz trace does not: "
                         f"{', '.join(sorted(set(columns) - EVENT_COLUMNS))[:200]}")
    _check_chunks(parquet, name, bounds, prompt_len)
    components = parquet.schema_arrow.field("components").type if "components" in columns else None
    if components is not None and pa.types.is_struct(components) and (components.num_fields > bounds.max_terms or any(
            len(components.field(i).name) > bounds.max_name_chars for i in range(components.num_fields))):
        raise ValueError(f"{name} names more than {bounds.max_terms} decision terms, or one too long a name")
    try:
        table = parquet.read()
    except (OSError, pa.ArrowException) as error:
        raise ValueError(f"{name} is not a readable parquet file ({str(error).replace(str(path), name)[:200]})") \
            from None
    _check_table(table, columns, name, bounds, prompt_len, components)
    return meta, table


def _checked_meta(metadata: dict, name: str, bounds: TraceBounds, metadata_rows: int) -> dict:
    """The ``kvviz`` metadata of a trace file, its sizes checked before and after it is parsed."""
    raw = metadata.get(b"kvviz")
    if raw is None:
        raise ValueError(f"{name} is a parquet file but not a kvviz trace (no kvviz metadata); save one with "
                         "`kvviz generate --trace FILE` or the Live tab's download")
    if len(raw) > bounds.max_meta_bytes:
        raise bounds.too_large(name, f"has settings of {len(raw):,} bytes")
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as error:  # RecursionError: a value nested thousands deep
        raise ValueError(f"{name}'s settings are not readable JSON ({type(error).__name__})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{name}'s settings are not an object of named settings")
    fields = set(Trace.__dataclass_fields__) - {"events"}
    if set(meta) - fields:
        raise ValueError(f"{name} has settings a kvviz trace does not: {', '.join(sorted(set(meta) - fields))[:200]}")
    ids = meta.get("prompt_ids")
    if not isinstance(ids, list):
        raise ValueError(f"{name}: its prompt_ids is {ids!r:.60}, not a list of token ids")
    bounds.refuse_size(name, len(ids), max(0, metadata_rows - 1))
    if isinstance(meta.get("prompt"), str) and len(meta["prompt"]) > bounds.max_prompt_chars:
        raise ValueError(f"{name}'s prompt text has {len(meta['prompt']):,} characters, more than "
                         f"{bounds.max_prompt_tokens:,} tokens make")
    for key in ("model", "policy", "dtype"):
        if isinstance(meta.get(key), str) and len(meta[key]) > bounds.max_name_chars:
            raise ValueError(f"{name}: its {key} is {len(meta[key]):,} characters long; a name has at most "
                             f"{bounds.max_name_chars}")
    return meta


def _event_rows(table) -> list[dict]:
    """One dict per row for :class:`StepEvent`: the position and score lists as numpy arrays straight from
    arrow's buffers (a Python int per entry cost seconds and gigabytes on a large trace)."""
    import pyarrow as pa

    columns = {}
    for column in table.column_names:
        values = table[column].combine_chunks()
        if column in ("kept", "evicted", "utility", "raw") and (pa.types.is_list(values.type)
                                                                  or pa.types.is_large_list(values.type)):
            dtype = np.int64 if column in ("kept", "evicted") else np.float32
            offsets = values.offsets.to_numpy()
            flat = values.flatten().to_numpy(zero_copy_only=False).astype(dtype)  # flatten honours slicing
            flat_offsets = offsets - offsets[0]
            valid = values.is_valid().to_numpy(zero_copy_only=False)
            columns[column] = [flat[flat_offsets[i]:flat_offsets[i + 1]] if valid[i] else None
                               for i in range(len(values))]
        elif column in ("kept", "evicted", "utility", "raw") and pa.types.is_null(values.type):
            columns[column] = [None] * len(values)
        else:
            columns[column] = values.to_pylist()
    rows = [dict(zip(columns, row)) for row in zip(*columns.values())]
    for row in rows:
        row["kept"] = np.asarray(row["kept"], dtype=np.int64)  # required: a missing column is no trace
        row["evicted"] = np.asarray(row.get("evicted") if row.get("evicted") is not None else [], dtype=np.int64)
        if row.get("components") is not None:  # NaN (not judged) comes back from parquet as null
            row["components"] = {term: np.asarray(values, dtype=np.float32)
                                 for term, values in row["components"].items() if values is not None}
    return rows


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
