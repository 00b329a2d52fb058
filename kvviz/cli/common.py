"""What several ``kvviz`` commands share: reading the prompt, refusing an unwritable output up front, and how
their summaries name a rate."""

from __future__ import annotations

import os
from pathlib import Path

# How the generate and trace summaries label their rates: the one over the whole run counts the prefill's time
# (most of a short run's on a long prompt), the decode one only the decode steps' forward, scoring and eviction.
WITH_PREFILL = "including the prefill"


WITHOUT_PREFILL = "without the prefill"


def _check_writable(path: str, option: str, example: str = "trace.parquet") -> None:
    """Refuse an output file that cannot be written, before minutes of loading and decoding are spent.

    Checks what can be known up front (a folder that exists and may be written into; the path itself not
    a folder nor a read-only file); the save afterwards still reports anything else (a full disk).
    """
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path!r} is a folder; give a file path such as {str(target / example)!r}")
    if not folder.exists():
        raise ValueError(f"{option} {path!r}: the folder {str(folder)!r} does not exist; create it or choose "
                         "another path")
    if not folder.is_dir():
        raise ValueError(f"{option} {path!r}: {str(folder)!r} is a file, not a folder; choose another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path!r} is not writable (permission denied); choose a writable path")


def _read_prompt(args) -> str:
    if getattr(args, "prompt_file", None):
        try:
            prompt = Path(args.prompt_file).read_text()
        except OSError as error:
            raise ValueError(f"cannot read --prompt-file {args.prompt_file!r}: {error.strerror}") from None
        except UnicodeDecodeError as error:
            raise ValueError(f"--prompt-file {args.prompt_file!r} is not UTF-8 text (byte {error.start}); "
                             "save it as UTF-8") from None
    else:
        prompt = args.prompt
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty; pass --prompt TEXT or --prompt-file FILE with some text")
    return prompt
