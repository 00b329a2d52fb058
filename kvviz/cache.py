"""A KV cache that physically drops entries: preallocated slots, O(evicted) compaction per layer.

Layout: each layer holds ``keys``/``values`` buffers of shape ``(1, num_kv_heads, capacity, head_dim)``.
Slots ``[0, n)`` are live; ``positions[slot]`` is the absolute position of the token in that slot, shared
by all layers (eviction is token-level).  Slot order is arbitrary: decode attention over a set of
post-RoPE keys does not depend on their order, and every token is fed with its true ``position_ids``.

Eviction fills each hole below the new length with a survivor from above it, so evicting ``k`` entries
moves at most ``k`` tokens per layer; in steady state (one in, one out) that is at most one token.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's slot buffers (see module docstring)."""

    is_sliding = False

    def __init__(self, capacity: int = 0):
        super().__init__()
        self.capacity = capacity
        self.n = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.shape[0] != 1:
            raise ValueError(
                f"kvviz evicts per sequence and supports batch size 1, got a batch of {key_states.shape[0]}; "
                "run the prompts one at a time"
            )
        self.device, self.dtype = key_states.device, key_states.dtype
        self._allocate(max(self.capacity, key_states.shape[-2]), key_states, value_states)
        self.is_initialized = True

    def _allocate(self, capacity: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_like.shape
        keys = key_like.new_empty(batch, heads, capacity, key_dim)
        values = value_like.new_empty(batch, heads, capacity, value_like.shape[-1])
        if self.n:
            keys[:, :, : self.n] = self.keys[:, :, : self.n]
            values[:, :, : self.n] = self.values[:, :, : self.n]
        self.keys, self.values, self.capacity = keys, values, capacity

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        incoming = key_states.shape[-2]
        if self.n + incoming > self.capacity:  # only when the caller gave no capacity: grow geometrically
            self._allocate(max(2 * self.capacity, self.n + incoming), self.keys, self.values)
        self.keys[:, :, self.n : self.n + incoming] = key_states
        self.values[:, :, self.n : self.n + incoming] = value_states
        self.n += incoming
        return self.keys[:, :, : self.n], self.values[:, :, : self.n]

    def move(self, holes: torch.Tensor, sources: torch.Tensor, new_length: int) -> None:
        if holes.numel():
            self.keys.index_copy_(2, holes, self.keys.index_select(2, sources))
            self.values.index_copy_(2, holes, self.values.index_select(2, sources))
        self.n = new_length

    def resize(self, capacity: int) -> None:
        if self.is_initialized and capacity != self.capacity and capacity >= self.n:
            self._allocate(capacity, self.keys, self.values)

    def get_mask_sizes(self, query_length_or_cache_position, *args) -> tuple[int, int]:
        # transformers >= 5.24 passes the query length, earlier 5.x the cache_position tensor.
        q = query_length_or_cache_position
        query_length = q if isinstance(q, int) else q.shape[0]
        return self.n + query_length, 0

    def get_seq_length(self) -> int:
        return self.n

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.n = 0

    def nbytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes


class SlotCache(Cache):
    """HF ``Cache`` of :class:`SlotLayer` s that records which absolute position sits in each slot.

    Parameters
    ----------
    num_layers : int
        Number of decoder layers.
    capacity : int, optional
        Slots to preallocate per layer; ``0`` grows on demand (e.g. inside ``model.generate``).
    """

    def __init__(self, num_layers: int, capacity: int = 0):
        super().__init__(layers=[SlotLayer(capacity) for _ in range(num_layers)])
        self.positions = torch.empty(max(capacity, 1), dtype=torch.long)
        self.seen = 0  # tokens ever written = absolute position of the next token

    def __len__(self) -> int:
        return len(self.layers)

    @property
    def size(self) -> int:
        """Live entries."""
        return self.layers[0].n

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            self.begin_forward(key_states.shape[-2])
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def begin_forward(self, count: int) -> None:
        """Called once per forward, before layer 0 writes: record the new tokens' absolute positions."""
        start = self.size
        if start + count > self.positions.numel():
            grown = torch.empty(max(2 * self.positions.numel(), start + count), dtype=torch.long)
            grown[:start] = self.positions[:start]
            self.positions = grown
        self.positions[start : start + count] = torch.arange(self.seen, self.seen + count)
        self.seen += count

    def live_positions(self) -> torch.Tensor:
        """Absolute position of each live slot, in slot order, shape ``(n,)`` (a view)."""
        return self.positions[: self.size]

    def evict(self, slots: torch.Tensor) -> None:
        """Drop the entries in ``slots`` (slot indices, unique, on CPU) from every layer.

        Survivors from the tail ``[n - k, n)`` move into the holes below ``n - k``.
        """
        count = slots.numel()
        if count == 0:
            return
        size = self.size
        new_length = size - count
        dropped = torch.zeros(size, dtype=torch.bool)
        dropped[slots] = True
        holes = torch.nonzero(dropped[:new_length]).flatten()
        sources = torch.nonzero(~dropped[new_length:]).flatten() + new_length
        self.positions[holes] = self.positions[sources]
        device = self.layers[0].keys.device
        holes_d, sources_d = holes.to(device), sources.to(device)
        for layer in self.layers:
            layer.move(holes_d, sources_d, new_length)

    def copy_from(self, other: "SlotCache") -> None:
        """Fill this (empty) cache with a copy of ``other``'s live entries, positions included; the next token
        then takes the position ``other``'s would (``seen`` is copied too, past any evicted entries)."""
        if self.seen:
            raise ValueError("copy_from needs an empty cache")
        size = other.size
        for index, layer in enumerate(other.layers):
            self.update(layer.keys[:, :, :size], layer.values[:, :, :size], index)
        self.positions[:size] = other.positions[:size]
        self.seen = other.seen

    def resize(self, capacity: int) -> None:
        """Reallocate every layer to ``capacity`` slots (frees memory once the cache sits at its budget)."""
        for layer in self.layers:
            layer.resize(capacity)

    def nbytes(self) -> int:
        """Bytes held by the key/value buffers (allocated capacity, not just live entries)."""
        return sum(layer.nbytes() for layer in self.layers)
