"""Last-query attention scores captured beside SDPA, without switching the model to eager attention.

The model keeps running `sdpa`; we register a thin wrapper (``kvviz_sdpa``) with
``transformers.AttentionInterface`` that calls the stock SDPA function and, only while a *sink* is active
on the current thread, hands each layer's tensors to it.  The sink (the engine's eviction controller)
decides whether to compute anything; scores are computed lazily by :class:`LayerView` so policies that
only look at keys or values pay nothing for attention.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "kvviz_sdpa"
ROPE_ATTRIBUTE = "kvviz_rope"  # set on each attention module by install(): the model's RoPE frequencies


@dataclass
class LayerView:
    """One attention layer's view of the current decode step, handed to a policy.

    Parameters
    ----------
    layer : int
        Layer index in the model.
    query : torch.Tensor
        Post-RoPE query of the newest token, shape ``(num_heads, head_dim)``.
    keys, values : torch.Tensor
        The cached (post-RoPE) keys and values in slot order, including the newest token,
        shape ``(num_kv_heads, n, head_dim)``.  Views into the cache: do not modify.
    scaling : float
        The softmax scale the model uses.
    rope : torch.Tensor or None
        The model's RoPE inverse frequencies, shape ``(head_dim // 2,)`` (a position ``p`` rotates dims
        ``i`` and ``i + head_dim/2`` by ``p * rope[i]``, Hugging Face's rotate-half layout); ``None`` if the
        model has none.  What policies that reason about future positions (Expected Attention) need.
    """

    layer: int
    query: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    rope: torch.Tensor | None = None
    _attn: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_groups(self) -> int:
        return self.query.shape[0] // self.keys.shape[0]

    @property
    def attn(self) -> torch.Tensor:
        """Float32 softmax of the newest query over every cached slot, shape ``(num_heads, n)``.

        GQA-aware: query heads are grouped by their KV head and multiplied against that head's keys
        directly (no ``repeat_kv`` copy of the cache).
        """
        if self._attn is None:
            num_kv, n, dim = self.keys.shape
            grouped_q = self.query.float().view(num_kv, self.num_groups, dim)
            logits = torch.matmul(grouped_q, self.keys.float().transpose(1, 2)) * self.scaling
            self._attn = torch.softmax(logits, dim=-1).reshape(num_kv * self.num_groups, n)
        return self._attn

    def value_norms(self) -> torch.Tensor:
        """L2 norm of each cached value, per query head (the KV head's norm repeated over its group),
        ``(num_heads, n)``."""
        norms = self.values.float().norm(dim=-1)
        return norms.repeat_interleave(self.num_groups, dim=0)


@dataclass
class PrefillView:
    """One layer at prefill, for prefill-time policies (SnapKV): the last ``window`` prompt queries.

    Parameters
    ----------
    queries : torch.Tensor
        Post-RoPE queries of the last ``w`` prompt tokens (positions ``n - w .. n - 1``), shape
        ``(num_heads, w, head_dim)``.
    keys, values : torch.Tensor
        The whole prompt's keys and values, ``(num_kv_heads, n, head_dim)``.
    rope : torch.Tensor or None
        The model's RoPE inverse frequencies, as in :class:`LayerView`.
    """

    layer: int
    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    scaling: float
    rope: torch.Tensor | None = None

    @property
    def attn(self) -> torch.Tensor:
        """Causal float32 softmax of each window query over the prompt, ``(num_heads, w, n)``."""
        num_kv, n, dim = self.keys.shape
        heads, window, _ = self.queries.shape
        grouped = self.queries.float().reshape(num_kv, heads // num_kv * window, dim)
        logits = torch.matmul(grouped, self.keys.float().transpose(1, 2)).view(heads, window, n) * self.scaling
        query_pos = torch.arange(n - window, n, device=logits.device)[:, None]
        logits = logits.masked_fill(torch.arange(n, device=logits.device)[None] > query_pos, float("-inf"))
        return torch.softmax(logits, dim=-1)


class ScoreSink(Protocol):
    """What the attention wrapper talks to: the engine's controller during a decode step."""

    prefill_window: int  # > 0: hand the last `prefill_window` prompt queries over at prefill

    def wants_layer(self, layer: int) -> bool: ...

    def on_layer(self, view: LayerView) -> None: ...

    def on_prefill_layer(self, view: PrefillView) -> None: ...


_active = threading.local()


def active_sink() -> ScoreSink | None:
    return getattr(_active, "sink", None)


@contextmanager
def scoring(sink: ScoreSink | None):
    """Route this thread's attention calls to ``sink`` for the duration of the block (``None``: no scoring)."""
    previous = active_sink()
    _active.sink = sink
    try:
        yield
    finally:
        _active.sink = previous


def set_active_sink(sink: ScoreSink | None) -> None:
    """Non-scoped variant of :func:`scoring`, for the ``model.generate`` integration (the cache drives it)."""
    _active.sink = sink


def kvviz_sdpa_forward(module, query, key, value, attention_mask, **kwargs):
    """SDPA, plus a hand-off of the newest query and the cache to the active sink (batch size 1)."""
    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    sink = active_sink()
    layer = getattr(module, "layer_idx", None)
    if sink is None or layer is None or not sink.wants_layer(layer):
        return out
    scaling = float(kwargs.get("scaling") or query.shape[-1] ** -0.5)
    rope = getattr(module, ROPE_ATTRIBUTE, None)
    # A decode step: one new query over a cache that holds more than it (a one-token prompt's prefill is a
    # single query too, but over nothing but itself).
    if query.shape[2] == 1 and key.shape[2] > 1:
        sink.on_layer(LayerView(layer, query[0, :, -1], key[0], value[0], scaling, rope))
    elif sink.prefill_window > 0:
        window = min(sink.prefill_window, query.shape[2])
        sink.on_prefill_layer(PrefillView(layer, query[0, :, -window:], key[0], value[0], scaling, rope))
    return out


def dynamic_rope(rope_type: str) -> bool:
    """Whether transformers changes this RoPE's frequencies with the sequence length (dynamic NTK and its
    variants, LongRoPE), rather than keeping one rotation per position."""
    return rope_type == "longrope" or "dynamic" in rope_type


def fixed_rope_limit(model) -> int:
    """How many positions one forward pass may reach with the rotation every cached key was given: the
    context, or for LongRoPE its original length, past which transformers switches every position to the
    long factors (keys cached before the switch keep the short ones)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") == "longrope":
        return int(rope.get("original_max_position_embeddings")
                   or getattr(config, "original_max_position_embeddings", None) or config.max_position_embeddings)
    return config.max_position_embeddings


def rope_frequencies(model) -> torch.Tensor | None:
    """The inverse frequencies of ``model``'s rotary embedding, ``(head_dim // 2,)``; ``None`` without one,
    where it rotates only part of each head (partial rotary), or where its frequencies change with the
    sequence length (dynamic NTK, Phi-3's LongRoPE): the views then describe no fixed rotation."""
    head_dim = getattr(model.config, "head_dim", None) or \
        model.config.hidden_size // model.config.num_attention_heads
    for module in model.modules():
        inv_freq = getattr(module, "inv_freq", None)
        if type(module).__name__.endswith("RotaryEmbedding") and isinstance(inv_freq, torch.Tensor):
            if dynamic_rope(str(getattr(module, "rope_type", "default"))):
                return None
            return inv_freq if 2 * inv_freq.numel() == head_dim else None
    return None


_registered = False
_ABSENT = object()  # an attention module that had no ROPE_ATTRIBUTE before install()
_holds_lock = threading.Lock()
_holds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [open installed() blocks, saved state]


def _attention_modules(model) -> list[torch.nn.Module]:
    return [module for module in model.modules() if hasattr(module, "layer_idx") and hasattr(module, "o_proj")]


def install(model) -> None:
    """Switch ``model`` from SDPA to the score-capturing SDPA wrapper (numerically identical outputs).

    Sets ``config._attn_implementation`` to ``kvviz_sdpa`` and a ``kvviz_rope`` attribute on each attention
    module, for good: what :func:`~kvviz.models.load_model` wants for the models it builds.  For someone
    else's model use :func:`installed`, which puts both back afterwards (a call to ``install`` inside such a
    block is undone with it).  A model on another implementation is refused before anything changes.
    """
    global _registered
    current = model.config._attn_implementation
    if current not in (ATTN_IMPLEMENTATION, "sdpa"):
        raise ValueError(
            f"kvviz captures scores beside SDPA, but this model uses attn_implementation={current!r}; "
            "load it with attn_implementation='sdpa'."
        )
    if not _registered:
        AttentionInterface.register(ATTN_IMPLEMENTATION, kvviz_sdpa_forward)
        AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)
        _registered = True
    rope = rope_frequencies(model)
    for module in _attention_modules(model):
        setattr(module, ROPE_ATTRIBUTE, rope)
    if current != ATTN_IMPLEMENTATION:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)


@contextmanager
def installed(model):
    """:func:`install` for the duration of the block, then give ``model`` back its attention implementation
    and its attention modules' ``kvviz_rope`` attributes as they were before (a model already installed
    stays installed).

    Blocks on one model may nest, or overlap on several threads in any order: the state is saved when the
    first opens and put back when the last closes, so no run loses the capture while another is in flight.
    """
    with _holds_lock:
        hold = _holds.get(model)
        if hold is None:
            saved = (model.config._attn_implementation,
                     [(module, getattr(module, ROPE_ATTRIBUTE, _ABSENT)) for module in _attention_modules(model)])
            install(model)  # raises before anything is held or changed
            hold = _holds[model] = [0, saved]
        hold[0] += 1
    try:
        yield model
    finally:
        with _holds_lock:
            hold[0] -= 1
            if hold[0] == 0:
                del _holds[model]
                _restore(model, *hold[1])


def _restore(model, implementation: str, ropes: list) -> None:
    for module, rope in ropes:
        if rope is _ABSENT:
            if hasattr(module, ROPE_ATTRIBUTE):
                delattr(module, ROPE_ATTRIBUTE)
        else:
            setattr(module, ROPE_ATTRIBUTE, rope)
    if model.config._attn_implementation != implementation:
        model.set_attn_implementation(implementation)
