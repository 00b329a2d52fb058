"""The engine's sampling rule where the logits are, without waiting for the host.

:class:`kvviz.engine.Sampler` copies the logits to the host and returns a Python int: a sync per token.
:func:`sample` runs the same operations, in the same order, on the logits' device and returns the token as
a ``(1,)`` tensor there; with a generator on the same device in the same state it draws the same token (on
a CPU: the engine's own generator type, so a seeded run gives the engine's tokens).  On a GPU its generator
is a CUDA one, whose stream of numbers differs from the engine's CPU generator: same rule, other draws.
"""

from __future__ import annotations

import torch

from ..engine import Sampler


def sample(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """The next token of ``logits`` ``(vocab,)`` as a ``(1,)`` long tensor on their device.

    Greedy when ``temperature == 0`` (``argmax`` of the logits as given); otherwise the engine's temperature
    and nucleus rule, its overflow fallback (logits / T shifted by the largest logit in float64) chosen with
    ``torch.where`` rather than a host-side test.
    """
    if temperature == 0:
        return logits.argmax().reshape(1)
    scaled = logits.float() / temperature
    shifted = logits.double()
    fallback = ((shifted - shifted.max()) / temperature).float()
    scaled = torch.where(torch.isfinite(scaled).all(), scaled, fallback)
    probs = torch.softmax(scaled, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
    return order[choice].reshape(1)


class DeviceSampler:
    """:class:`~kvviz.engine.Sampler`'s settings (checked by it) with a generator on ``device``, seeded alike."""

    def __init__(self, temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, device: str | torch.device = "cpu"):
        self.settings = Sampler(temperature, top_p, seed)  # its checks and messages
        self.temperature, self.top_p = temperature, top_p
        self.generator = torch.Generator(device).manual_seed(seed) if temperature else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return sample(logits, self.temperature, self.top_p, self.generator)
