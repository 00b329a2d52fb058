"""Per-entry scorers of one layer's view: InertiaKV's ``scorer`` choices (§5.1's ablations) and the scores of
KeyDiff and K-norm.  Not policies themselves; :data:`SCORERS` maps each name to its function.

Every scorer has one signature, stated here once: it takes a :class:`~kvviz.scoring.LayerView` over ``n``
cached entries (query ``(num_heads, head_dim)``, keys and values ``(num_kv_heads, n, head_dim)``, the softmax
``attn`` ``(num_heads, n)``, computed only if read) and ``positions``, the ``(n,)`` absolute positions of those
entries in slot order, and returns an ``(n,)`` score per entry, higher = keep.
"""

from __future__ import annotations

import math

import torch

from ..scoring import LayerView


def attention_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Head-mean last-query attention; ``(n,)`` float32 summing to 1."""
    return view.attn.mean(0)


def vnorm_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Each head's attention times its value norms normalised to mean 1 over the cache, then head-mean;
    ``(n,)`` float32."""
    norms = view.value_norms()
    return (view.attn * norms / norms.mean(-1, keepdim=True)).mean(0)


def entropy_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Head-mean attention weighted by the layer's normalised entropy (mean over heads of H / log n); ``(n,)``
    float32, plain head-mean attention when ``n < 2`` (no entropy to normalise)."""
    attn = view.attn
    n = attn.shape[-1]
    if n < 2:
        return attn.mean(0)
    entropy = -(attn * attn.clamp_min(1e-30).log()).sum(-1) / math.log(n)
    return entropy.mean() * attn.mean(0)


def keydiff_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Minus the cosine of each key to the mean normalised key (distinctive keys score high), head-mean over KV
    heads; ``(n,)`` float32 in ``[-1, 1]``.  Reads the keys only: no attention is computed."""
    unit = torch.nn.functional.normalize(view.keys.float(), dim=-1)
    anchor = torch.nn.functional.normalize(unit.mean(1, keepdim=True), dim=-1)
    return -(unit * anchor).sum(-1).mean(0)


def knorm_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Minus the key L2 norm over its mean (low-norm keys score high), mean over KV heads of
    ``-||k_i|| / mean ||k||``; ``(n,)`` float32.  Reads the keys only."""
    norms = view.keys.float().norm(dim=-1)
    return -(norms / norms.mean(-1, keepdim=True)).mean(0)


def recency_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Position over the newest position, ``(p + 1) / (max p + 1)``: 1 for the newest token, decreasing with
    age; ``(n,)`` float32 in ``(0, 1]``.  Reads the positions only."""
    positions = positions.float()
    return (positions + 1) / (positions.max() + 1)


SCORERS = {"attention": attention_score, "vnorm": vnorm_score, "entropy": entropy_score,
           "keydiff": keydiff_score, "knorm": knorm_score, "recency": recency_score}
