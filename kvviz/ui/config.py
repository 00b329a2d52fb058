"""Limits of a deployment (a public Space sets them), read from the environment once at start."""

from __future__ import annotations

import os
from dataclasses import dataclass

from .. import settings
from ..models import DEFAULT_MODEL, DTYPES, check_device, check_model_name
from ..trace import TraceBounds


def _number(name: str, default, kind=int):
    """The environment variable ``name`` as ``kind`` (int or float), ``default`` when unset or empty."""
    value = os.environ.get(name, "")
    try:
        return kind(value) if value else default
    except ValueError:
        raise ValueError(f"{name} must be {'a whole number' if kind is int else 'a number'}, got {value!r}") from None


@dataclass(frozen=True)
class Limits:
    """``KVVIZ_DEFAULT_MODEL``, ``KVVIZ_MODELS`` (extra allowed, comma-separated), ``KVVIZ_MAX_PROMPT_TOKENS``,
    ``KVVIZ_MAX_NEW_TOKENS``, ``KVVIZ_QUEUE_SIZE``, ``KVVIZ_RUNS_PER_MODEL``, ``KVVIZ_DEVICE`` and
    ``KVVIZ_DTYPE`` (where every model runs: ``cpu`` or ``cuda[:N]``; ``float32``, ``bfloat16`` or
    ``float16``, empty for float32 on the CPU and bfloat16 on a GPU), ``KVVIZ_FIGURES_PER_SECOND`` (how
    often a streaming run redraws its retention heatmap, at most; the other views follow at a fifth and a
    tenth of it; 0: only once the run ends), ``KVVIZ_BACKEND`` (the Live tab's and /generate's decoder: auto,
    engine or static, :func:`kvviz.backend.choose`); host/port from ``GRADIO_SERVER_*``."""

    models: tuple[str, ...] = (DEFAULT_MODEL,)
    max_prompt_tokens: int = 4096
    max_new_tokens: int = 512
    queue_size: int = 16
    runs_per_model: int = 1
    host: str = "127.0.0.1"
    port: int = 7860
    device: str = "cpu"
    dtype: str = ""
    # Each redraw costs the browser far more than the server (benchmarks/page_responsiveness.py): a slow
    # client or a fast model may want fewer.
    figures_per_second: float = 10.0
    # Which decoder runs the Live tab and /generate (kvviz.backend.choose): "auto" takes the static slot path
    # on a GPU where it runs the policy, the hook engine otherwise; comparisons share one prefill on the engine.
    backend: str = "auto"

    def __post_init__(self):
        # Refused at start, not at the first run: a deployment on the wrong device should not come up.
        try:
            check_device(self.device)
        except ValueError as error:
            raise ValueError(f"the device (KVVIZ_DEVICE, kvviz serve --device): {error}") from None
        if not self.models or not all(isinstance(name, str) and name for name in self.models):
            raise ValueError(f"name at least one model to serve (KVVIZ_DEFAULT_MODEL, KVVIZ_MODELS, kvviz serve "
                             f"--models), got {self.models!r}")
        for name in self.models:  # a mistyped path would otherwise fail only when someone picks it
            try:
                check_model_name(name)
            except ValueError as error:
                raise ValueError(f"the models (KVVIZ_DEFAULT_MODEL, KVVIZ_MODELS, kvviz serve --models): {error}") \
                    from None
        settings.max_new_tokens(self.max_new_tokens, "the max new tokens (KVVIZ_MAX_NEW_TOKENS)")
        if not 0 <= self.figures_per_second <= 60:  # also refuses NaN
            raise ValueError(f"the figures per second (KVVIZ_FIGURES_PER_SECOND, kvviz serve --figures-per-second) "
                             f"must be from 0 (only when a run ends) to 60, got {self.figures_per_second}")
        if not (isinstance(self.port, int) and 1 <= self.port <= 65535):
            raise ValueError(f"the port (GRADIO_SERVER_PORT, kvviz serve --port) must be from 1 to 65535, "
                             f"got {self.port!r}")
        if not (isinstance(self.host, str) and self.host.strip()):
            raise ValueError("the host (GRADIO_SERVER_NAME, kvviz serve --host) is empty; give an address such "
                             "as 127.0.0.1, or 0.0.0.0 for every interface")
        if self.backend not in ("auto", "engine", "static"):
            raise ValueError(f"the backend (KVVIZ_BACKEND) must be auto, engine or static, got {self.backend!r}")
        if self.dtype not in ("", *DTYPES):
            raise ValueError(f"the dtype (KVVIZ_DTYPE, kvviz serve --dtype) must be one of {', '.join(DTYPES)} "
                             f"(or empty for the device's default), got {self.dtype!r}")

    def trace_bounds(self) -> TraceBounds:
        """What an opened trace may hold: no longer a prompt, nor more steps, than a run here could make (its
        views grow with steps x positions)."""
        return TraceBounds(max_steps=self.max_new_tokens, max_prompt_tokens=self.max_prompt_tokens,
                           reader="this app", advice=" (KVVIZ_MAX_PROMPT_TOKENS, KVVIZ_MAX_NEW_TOKENS): read it with "
                           "`kvviz trace FILE`, or serve with larger limits")

    @classmethod
    def from_env(cls, **overrides) -> "Limits":
        """The environment's settings, ``overrides`` (``kvviz serve``'s flags) taking precedence; each is
        checked once, as it is finally set, so a flag can correct a bad variable."""
        default = os.environ.get("KVVIZ_DEFAULT_MODEL", DEFAULT_MODEL)
        extra = [m.strip() for m in os.environ.get("KVVIZ_MODELS", "").split(",") if m.strip()]
        settings = dict(
            models=tuple(dict.fromkeys([default, *extra])),
            max_prompt_tokens=_number("KVVIZ_MAX_PROMPT_TOKENS", 4096),
            max_new_tokens=_number("KVVIZ_MAX_NEW_TOKENS", 512),
            queue_size=_number("KVVIZ_QUEUE_SIZE", 16),
            runs_per_model=_number("KVVIZ_RUNS_PER_MODEL", 1),
            host=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
            port=_number("GRADIO_SERVER_PORT", 7860),
            device=os.environ.get("KVVIZ_DEVICE", "cpu").strip() or "cpu",
            dtype=os.environ.get("KVVIZ_DTYPE", "").strip(),
            figures_per_second=_number("KVVIZ_FIGURES_PER_SECOND", 10.0, float),
            backend=os.environ.get("KVVIZ_BACKEND", "auto").strip() or "auto",
        )
        return cls(**{**settings, **overrides})
