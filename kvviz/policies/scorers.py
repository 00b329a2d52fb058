"""Per-entry scorers of one layer's view: InertiaKV's ``scorer`` choices (§5.1's ablations) and the scores of
KeyDiff and K-norm.  Not policies themselves; :data:`SCORERS` maps each name to its function.

Every scorer takes a :class:`~kvviz.scoring.LayerView` over ``n`` cached entries (query ``(num_heads,
head_dim)``, keys and values ``(num_kv_heads, n, head_dim)``) and ``positions``, the ``(n,)`` absolute
positions of those entries in slot order, and returns an ``(n,)`` score per entry, higher = keep.
"""

from __future__ import annotations

import math

import torch

from ..scoring import LayerView


def attention_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Head-mean last-query attention.

    Parameters
    ----------
    view : LayerView
        The layer's newest query ``(num_heads, head_dim)`` and keys ``(num_kv_heads, n, head_dim)``.
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries (unused).

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32, summing to 1.
    """
    return view.attn.mean(0)


def vnorm_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Each head's attention times its value norms normalised to mean 1 over the cache, then head-mean.

    Parameters
    ----------
    view : LayerView
        The layer's newest query ``(num_heads, head_dim)``, keys and values ``(num_kv_heads, n, head_dim)``.
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries (unused).

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32.
    """
    norms = view.value_norms()
    return (view.attn * norms / norms.mean(-1, keepdim=True)).mean(0)


def entropy_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Head-mean attention weighted by the layer's normalised entropy (mean over heads of H / log n).

    Parameters
    ----------
    view : LayerView
        The layer's newest query ``(num_heads, head_dim)`` and keys ``(num_kv_heads, n, head_dim)``.
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries (unused).

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32; plain head-mean attention when ``n < 2`` (no entropy to normalise).
    """
    attn = view.attn
    n = attn.shape[-1]
    if n < 2:
        return attn.mean(0)
    entropy = -(attn * attn.clamp_min(1e-30).log()).sum(-1) / math.log(n)
    return entropy.mean() * attn.mean(0)


def keydiff_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Minus the cosine of each key to the mean normalised key (distinctive keys score high), head-mean.

    Parameters
    ----------
    view : LayerView
        The layer's keys ``(num_kv_heads, n, head_dim)`` (no attention computed).
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries (unused).

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32 in ``[-1, 1]``, the mean over KV heads.
    """
    unit = torch.nn.functional.normalize(view.keys.float(), dim=-1)
    anchor = torch.nn.functional.normalize(unit.mean(1, keepdim=True), dim=-1)
    return -(unit * anchor).sum(-1).mean(0)


def knorm_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Minus the key L2 norm over its mean (low-norm keys score high), head-mean.

    Parameters
    ----------
    view : LayerView
        The layer's keys ``(num_kv_heads, n, head_dim)`` (no attention computed).
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries (unused).

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32, the mean over KV heads of ``-||k_i|| / mean ||k||``.
    """
    norms = view.keys.float().norm(dim=-1)
    return -(norms / norms.mean(-1, keepdim=True)).mean(0)


def recency_score(view: LayerView, positions: torch.Tensor) -> torch.Tensor:
    """Position over the newest position: 1 for the newest token, decreasing with age.

    Parameters
    ----------
    view : LayerView
        The layer's view (unused).
    positions : torch.Tensor
        ``(n,)`` absolute positions of the cached entries.

    Returns
    -------
    torch.Tensor
        ``(n,)`` float32 ``(p + 1) / (max p + 1)``, in ``(0, 1]``.
    """
    positions = positions.float()
    return (positions + 1) / (positions.max() + 1)


SCORERS = {"attention": attention_score, "vnorm": vnorm_score, "entropy": entropy_score,
           "keydiff": keydiff_score, "knorm": knorm_score, "recency": recency_score}
