"""kvviz: see what a KV-cache eviction policy keeps and drops while a language model decodes.

The library surface::

    model, tokenizer = kvviz.load_model()                      # SmolLM2-135M-Instruct by default
    result = kvviz.run(model, tokenizer, long_prompt, "inertia", compression=0.5)   # B = half the prompt
    for event in kvviz.stream(model, tokenizer, long_prompt, "inertia-lazy", budget=256): ...
    input_ids = torch.tensor([kvviz.encode_prompt(tokenizer, long_prompt, chat=True)])
    with kvviz.attach(model, "inertia", compression=0.5) as cache:
        model.generate(input_ids, cache=cache, max_new_tokens=64, do_sample=False)

Without ``compression`` or ``budget`` the library compresses nothing (B = the prompt length).
"""

from .engine import EvictingCache, Result, Sampler, attach, decode, encode_prompt, resolve_budget, run, stream
from .models import DEFAULT_MODEL, ModelNotFound, load_model
from .policies import REGISTRY, Policy, make_policy
from .trace import StepEvent, Trace

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL", "REGISTRY", "EvictingCache", "ModelNotFound", "Policy", "Result", "Sampler", "StepEvent",
    "Trace", "attach", "decode", "encode_prompt", "load_model", "make_policy", "resolve_budget", "run", "stream",
]
