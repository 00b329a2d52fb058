"""The /generate API endpoint: one generation streamed as JSON, with no widgets behind it."""

from __future__ import annotations

import json
from collections.abc import Iterator

from ..quote import excerpt, kind
from .checks import policy_from_inputs, refused, release_memory, unexpected, validate
from .config import Limits


def make_generate_api(limits: Limits):
    def generate(prompt: str, policy: str = "inertia", compression: float = 0.9, max_new_tokens: int = 64,
                 chat: bool = True, model: str = "", params: str = "{}", budget: int = 0, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0) -> Iterator[dict]:
        """Stream one generation as JSON: per step the text so far and the kept and evicted positions.

        ``budget`` > 0 sizes the cache in tokens instead of ``compression`` (it may exceed the prompt: eviction
        then starts once generation fills it).  ``temperature`` > 0 samples (with ``top_p`` and ``seed``).
        """
        try:
            # the JSON text the signature asks for; an object sent as itself means the same
            if not isinstance(params, (dict, str)) and params is not None:
                raise ValueError(f"params must be a JSON object of policy parameters, got {kind(params)} "
                                 f"({excerpt(params)})")
            values = params if isinstance(params, dict) else json.loads(params or "{}")
            if not isinstance(values, dict):
                raise ValueError("params must be a JSON object of policy parameters")
            policy_obj = policy_from_inputs(policy, values, strict=True)
            by_budget = budget not in (None, 0)
            request = validate(limits, model or limits.models[0], prompt, "budget" if by_budget else "compression",
                               compression, budget, max_new_tokens, chat, [policy_obj], temperature, top_p, seed,
                               backend=limits.backend)
            policy_obj = policy_from_inputs(policy, values, strict=True)  # fresh state
        except json.JSONDecodeError as error:
            raise refused(f"params is not valid JSON ({error}); send an object such as "
                          '{"alpha": 0.9}') from None
        except RecursionError:  # JSON nested thousands deep: no policy parameter is
            raise refused('params is nested too deeply; send a flat object such as {"alpha": 0.9}') from None
        except ValueError as error:
            raise refused(str(error)) from None
        except Exception as error:
            raise unexpected("starting the run", error) from None
        text = ""
        try:
            for event in request.events(policy_obj, limits):
                text += event.text
                yield {"step": event.step, "text": text, "token_id": event.new_token_id, "budget": request.budget,
                       "prompt_len": len(request.prompt_ids), "kept": event.kept.tolist(),
                       "evicted": event.evicted.tolist()}
        except Exception as error:
            raise unexpected("generation", error) from None
        finally:
            release_memory()

    return generate
