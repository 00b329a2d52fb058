"""Which decoder runs a generation: the hook engine (:mod:`kvviz.engine`, the reference) or the static slot
backend (:mod:`kvviz.backend.static`, the GPU engine).

:func:`choose` decides: ``backend="auto"`` takes the static backend on a CUDA device when it runs the model
and the policy (:func:`refusal` says why not), the engine otherwise -- on a CPU too, where the static path is
no faster (``benchmarks/results/README.md``) and the engine is the reference.  ``"static"`` insists (and
refuses, naming why); ``"engine"`` always takes the engine.  :func:`kvviz.stream` and :func:`kvviz.run`
take the same ``backend`` argument.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

BACKENDS = ("auto", "engine", "static")

def prefill_time(policy) -> bool:
    """Whether ``policy`` evicts at the prefill only (SnapKV, KVzip, Expected Attention without ``decode``):
    the static backend runs its prefill and selection as the engine does, then decodes without evicting."""
    from ..policies.expected_attention import ExpectedAttention
    from ..policies.kvzip import KVzip
    from ..policies.snapkv import SnapKV

    kind = type(policy)
    return kind in (SnapKV, KVzip) or (kind is ExpectedAttention and not policy.decode)


def checkpointed(policy) -> bool:
    """Whether ``policy`` is a checkpointed one (AvoKV-E, R-KV, LazyEviction): the static backend feeds the
    policy itself each step's views and asks it for evictions on the host, as the engine does (every step
    then runs eagerly, never from a CUDA graph)."""
    from ..policies.avokv import AvoKVE
    from ..policies.lazyeviction import LazyEviction
    from ..policies.rkv import RKV

    return type(policy) in (AvoKVE, RKV, LazyEviction)


def decided_on_host(policy) -> bool:
    """Whether the static backend hands ``policy`` object itself each step's views and asks it what to evict:
    the checkpointed policies, and Expected Attention with ``decode`` (its float64 query statistics and
    Gaussian expectation are the policy's own code, run on the host exactly as the engine runs them)."""
    from ..policies.expected_attention import ExpectedAttention

    return checkpointed(policy) or (type(policy) is ExpectedAttention and policy.decode)


def refusal(model, policy) -> str | None:
    """Why the static backend cannot run ``policy`` on ``model``, as a sentence; None when it can."""
    from ..fast import SUPPORTED
    from .scorers import SCORER_OF

    model_type = getattr(model.config, "model_type", None)
    if model_type not in SUPPORTED:
        return (f"it reproduces {', '.join(SUPPORTED)} decoder layers, not {model_type!r}")
    name = type(policy).__name__
    if type(policy) not in SCORER_OF and not prefill_time(policy) and not decided_on_host(policy):
        return (f"{name} is not a policy it knows (a subclass of one may change its rule); it runs InertiaKV (every "
                "setting), TOVA, H2O, StreamingLLM, KeyDiff, K-norm, recency, random, the full cache, SnapKV, "
                "KVzip, Expected Attention, AvoKV-E, R-KV and LazyEviction")
    return None


def supports(model, policy) -> bool:
    """Whether the static backend runs ``policy`` on ``model`` (:func:`refusal` says why not)."""
    return refusal(model, policy) is None


def choose(model, policy, backend: str = "auto", device: str | torch.device | None = None) -> str:
    """``"static"`` or ``"engine"``: the backend that decodes ``policy`` on ``model`` (on ``device``, default the
    model's).  ``"auto"``: static on CUDA where :func:`supports`, else the engine; ``"static"`` raises
    ValueError naming why it cannot; ``"engine"`` is the engine."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "engine":
        return "engine"
    why = refusal(model, policy)
    if backend == "static":
        if why:
            raise ValueError(f"backend='static' cannot run {type(policy).__name__}: {why}; use backend='engine' "
                             "(or 'auto', which falls back to it)")
        return "static"
    device = torch.device(device if device is not None else model.device)
    return "static" if device.type == "cuda" and why is None else "engine"


def stream(model, tokenizer, prompt_ids: list[int], policy, **kwargs) -> Iterator:
    """The static backend's step events (:meth:`kvviz.backend.static.StaticBackend.stream`'s arguments)."""
    from .static import StaticBackend

    yield from StaticBackend(model, policy).stream(tokenizer, prompt_ids, **kwargs)


__all__ = ["BACKENDS", "checkpointed", "choose", "decided_on_host", "prefill_time", "refusal", "stream", "supports"]
