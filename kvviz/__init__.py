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

from __future__ import annotations

import importlib
import importlib.util

__version__ = "0.1.0"

# name -> the submodule that defines it.  Imported on first use (PEP 562): the command line imports this
# package for every subcommand, and `kvviz --help` should not wait seconds for torch and transformers.
_EXPORTS = {
    **dict.fromkeys(["EvictingCache", "Result", "Sampler", "attach", "decode", "encode_prompt", "resolve_budget",
                     "run", "stream"], "engine"),
    **dict.fromkeys(["DEFAULT_MODEL", "ModelNotFound", "load_model"], "models"),
    **dict.fromkeys(["REGISTRY", "Policy", "make_policy"], "policies"),
    **dict.fromkeys(["StepEvent", "Trace"], "trace"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        # a submodule, as `kvviz.engine` was when this file imported them all
        if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'kvviz' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # once: later look-ups find it directly
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
