"""Limits of a deployment (a public Space sets them), read from the environment once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..models import DEFAULT_MODEL


def _int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    try:
        return int(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None


@dataclass(frozen=True)
class Limits:
    """``KVVIZ_DEFAULT_MODEL``, ``KVVIZ_MODELS`` (extra allowed, comma-separated), ``KVVIZ_MAX_PROMPT_TOKENS``,
    ``KVVIZ_MAX_NEW_TOKENS``, ``KVVIZ_QUEUE_SIZE``, ``KVVIZ_RUNS_PER_MODEL``; host/port from ``GRADIO_SERVER_*``."""

    models: tuple[str, ...] = (DEFAULT_MODEL,)
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512
    queue_size: int = 16
    runs_per_model: int = 1
    host: str = "127.0.0.1"
    port: int = 7860

    @classmethod
    def from_env(cls) -> "Limits":
        default = os.environ.get("KVVIZ_DEFAULT_MODEL", DEFAULT_MODEL)
        extra = [m.strip() for m in os.environ.get("KVVIZ_MODELS", "").split(",") if m.strip()]
        return cls(
            models=tuple(dict.fromkeys([default, *extra])),
            max_prompt_tokens=_int("KVVIZ_MAX_PROMPT_TOKENS", 4096),
            max_new_tokens=_int("KVVIZ_MAX_NEW_TOKENS", 512),
            queue_size=_int("KVVIZ_QUEUE_SIZE", 16),
            runs_per_model=_int("KVVIZ_RUNS_PER_MODEL", 1),
            host=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
            port=_int("GRADIO_SERVER_PORT", 7860),
        )
