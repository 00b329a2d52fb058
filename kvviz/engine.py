"""The decode engine: prefill once, then one token per step over a cache physically cut to the keep set.

:func:`decode` is the whole loop; read it top to bottom.  :class:`EvictingCache` holds the policy and
budget next to the slot cache; the engine drives it explicitly, and inside ``model.generate`` (see
:func:`attach`) it drives itself from the first layer's cache update of every forward pass.
"""

from __future__ import annotations

import inspect
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import numpy as np
import torch

from . import scoring, settings
from .cache import SlotCache
from .policies import Policy, make_policy, setting_label
from .policies.base import BudgetTooSmall
from .reconstruction import REPEAT_ALL, REPEAT_FROM, reconstruct_once, repeat_passes  # noqa: F401 (found here)
from .settings import MAX_NEW_TOKENS, Settings, compressed, largest_compression, resolve_budget  # noqa: F401
from .trace import StepEvent, Trace, model_dtype


def check_compression(compression: float) -> None:
    """A compression ratio in [0, 1) (NaN is not); what any prompt needs before its own budget is worked out."""
    settings.compression(compression)


def at_compression(error: BudgetTooSmall, compression: float, prompt_len: int, *, given: str | None = None,
                   option: str = "the compression") -> str:
    """``error``'s refusal told in terms of the compression that set its budget: a message that said "raise the
    budget above 36" to someone who set no budget, only a compression, named a control they had not used.
    ``given``: how the compression was given (default ``"compression 0.9"``); ``option``: what to lower."""
    most = largest_compression(prompt_len, error.reserved + 1)
    fix = (f"lower {option} to {most:g} or less" if most is not None else
           f"use a prompt of more than {error.reserved} tokens, or an absolute budget above {error.reserved}")
    return (f"{given or f'compression {compression:g}'} leaves a budget of {error.budget} of this {prompt_len}-token "
            f"prompt, not more than {error.kept}: {fix}{error.instead}")


def settle(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a host clock reads what it cost: on CUDA a forward returns
    before its kernels ran, and the next sync (scores copied to the host, say) would bill them to whatever
    came next.  Nothing to wait for elsewhere: a CPU op has run when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EvictingCache(SlotCache):
    """A :class:`SlotCache` that applies ``policy`` under ``budget`` and records one event per step.

    Also the attention wrapper's score sink: layer views go to ``policy.observe`` with the slot positions.
    """

    def __init__(self, model, policy: Policy, *, budget: int | None = None, compression: float | None = None,
                 capacity: int = 0, auto: bool = False):
        super().__init__(model.config.num_hidden_layers, capacity)
        scoring.install(model)
        self.policy, self.auto = policy, auto
        self.device = model.device
        self._budget_args = {"budget": budget, "compression": compression}
        self.budget = budget
        self.step = -1
        self.score_seconds = 0.0
        self.components: dict[str, np.ndarray] | None = None
        self.events: list[StepEvent] = []

    # -- score sink -----------------------------------------------------------------------------------
    @property
    def prefill_window(self) -> int:
        return self.policy.prefill_window

    def wants_layer(self, layer: int) -> bool:
        return self.policy.wants_layer(layer)

    def on_layer(self, view) -> None:
        settle(self.device)  # the layer's forward so far is the forward's time, not the scoring's
        start = time.perf_counter()
        self.policy.observe(view, self.live_positions())
        settle(self.device)
        self.score_seconds += time.perf_counter() - start

    def on_prefill_layer(self, view) -> None:
        settle(self.device)
        start = time.perf_counter()
        self.policy.observe_prefill(view, self.live_positions())
        settle(self.device)
        self.score_seconds += time.perf_counter() - start

    # -- step protocol --------------------------------------------------------------------------------
    def start_prefill(self, prompt_len: int, max_new_tokens: int | None = None) -> bool:
        """Reset the policy for a prompt; True if the policy reads the prefill's queries (``prefill_window`` > 0:
        prefill-time policies, and checkpointed ones that start their window with the prompt's)."""
        self.budget = resolve_budget(prompt_len, **self._budget_args)
        try:
            self.policy.reset(prompt_len, self.budget, len(self.layers))
        except BudgetTooSmall as error:
            if self._budget_args["compression"] is None:
                raise
            raise ValueError(at_compression(error, self._budget_args["compression"], prompt_len)) from None
        self.step = 0
        self.score_seconds = 0.0
        self.final_bound = None if max_new_tokens is None else self.policy.cache_bound(self.budget, max_new_tokens)
        return self.policy.prefill_window > 0

    def start_step(self, step: int) -> bool:
        """Announce decode step ``step`` (its token enters at position ``self.seen``); True if it scores."""
        self.step = step
        self.score_seconds = 0.0
        scores = self.policy.wants_scores(step)
        self.policy.begin_step(step, self.live_positions(), self.seen)
        return scores

    def finish_step(self) -> tuple[np.ndarray, np.ndarray | None, float]:
        """Apply the policy's evictions for the current step.

        Returns the evicted positions, the policy's raw scores of this step for every position present
        before eviction (sorted by position; ``None`` if it computed none) and the seconds it took; the
        named terms of the decision, aligned the same way, are left in ``self.components``.
        """
        start = time.perf_counter()
        positions = self.live_positions()
        raw = self.policy.raw_scores(positions)
        if raw is not None:
            raw = raw[torch.argsort(positions)].float().numpy().copy()
        slots = self.policy.select_evictions(self.step, positions, self.budget)
        recording = time.perf_counter()  # the terms are recorded for the views: not the policy's cost
        components = self.policy.components(positions)
        self.components = None if not components else {  # by position, like raw
            name: values[torch.argsort(positions)].float().numpy().copy() for name, values in components.items()}
        start += time.perf_counter() - recording
        evicted = positions[slots].sort().values.numpy().copy()
        self.evict(slots)
        bound = self.final_bound if self.final_bound is not None else self.policy.cache_bound(self.budget, self.step)
        if bound is not None and slots.numel() and self.layers[0].capacity > bound + 1:
            self.resize(bound + 1)  # the prompt no longer fits the budget: hand its memory back once
        settle(self.device)
        return evicted, raw, time.perf_counter() - start

    def kept_and_utility(self) -> tuple[np.ndarray, np.ndarray | None]:
        positions = self.live_positions()
        order = torch.argsort(positions)
        kept = positions[order]
        utility = self.policy.utility(kept)
        return kept.numpy().copy(), None if utility is None else utility.float().numpy().copy()

    # -- self-driving mode, for model.generate ---------------------------------------------------------
    def begin_forward(self, count: int) -> None:
        if self.auto:
            if self.step < 0:
                scoring.set_active_sink(self if self.start_prefill(count) else None)
            else:
                self.close_step()
                scores = self.start_step(self.step + 1)
                scoring.set_active_sink(self if scores else None)
        super().begin_forward(count)

    def close_step(self) -> None:
        """Finish the step in flight (generate mode) and record its event (token fields unknown: -1)."""
        if self.step < 0 or (self.events and self.events[-1].step >= self.step):
            return
        components = None
        if self.step == 0 and self.policy.prefill_window == 0:
            evicted, raw, seconds = np.empty(0, np.int64), None, 0.0  # decode-time: never evicts at prefill
        else:
            evicted, raw, seconds = self.finish_step()
            components = self.components
        kept, utility = self.kept_and_utility()
        self.events.append(StepEvent(self.step, -1, -1, "", kept, evicted, utility, raw, t_evict=seconds,
                                     components=components))


@contextmanager
def attach(model, policy: str | Policy = "inertia", *, budget: int | None = None,
           compression: float | None = None, **params):
    """Use a policy inside a plain ``model.generate`` call::

        with kvviz.attach(model, "inertia", compression=0.9) as cache:
            out = model.generate(input_ids, cache=cache, max_new_tokens=64, do_sample=False)
        cache.events  # one StepEvent per decode step, same keep sets as kvviz.run

    Batch size 1 and no padding, as in the engine.
    """
    policy = make_policy(policy, **params) if isinstance(policy, str) else policy
    if policy.reconstructs:
        raise ValueError(f"{type(policy).__name__} scores from an extra reconstruction pass after the prefill, "
                         "which model.generate cannot run; use kvviz.run or kvviz.stream")
    policy.check_model(model)
    with scoring.installed(model):  # on exit the model gets its own attention implementation back
        cache = EvictingCache(model, policy, budget=budget, compression=compression, auto=True)
        try:
            yield cache
        finally:
            cache.close_step()
            scoring.set_active_sink(None)
        if cache.step < 0:  # generate() made a cache of its own: it ran unevicted, and nothing said so
            warnings.warn(f"kvviz.attach: the cache saw no forward pass, so nothing was evicted; pass it to "
                          f"model.generate as {cache_kwarg(model)}=cache", stacklevel=3)


# ------------------------------------------------------------------------------------------------ sampling

@dataclass
class Sampler:
    """Greedy when ``temperature == 0``; otherwise temperature + nucleus (top-p) sampling with a seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        settings.temperature(self.temperature)
        settings.top_p(self.top_p)
        self.generator = torch.Generator().manual_seed(self.seed)

    def settings(self) -> dict:
        """The arguments that recreate this sampler, for a trace; empty when greedy (they change nothing)."""
        if self.temperature == 0:
            return {}
        return {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}

    def __call__(self, logits: torch.Tensor) -> int:
        if self.temperature == 0:
            return int(logits.argmax())
        scaled = logits.float().cpu() / self.temperature
        if not torch.isfinite(scaled).all():  # T so small that logits / T overflow (1e-38): shifted by the
            # largest logit, in float64, which holds any T > 0 (float32 reads 5e-324 as 0); the limit is greedy
            shifted = logits.double().cpu()
            scaled = ((shifted - shifted.max()) / self.temperature).float()
        probs = torch.softmax(scaled, dim=-1)
        sorted_probs, order = probs.sort(descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > self.top_p  # keep the smallest prefix reaching top_p
        sorted_probs[outside] = 0.0
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=self.generator)
        return int(order[choice])


def eos_ids(model, tokenizer) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


def cache_kwarg(model) -> str:
    """transformers >= 5.24 names the forward's cache argument ``cache``; earlier 5.x ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


# --------------------------------------------------------------------------------------------- the loop

@dataclass
class Prefill:
    """A prompt's full-cache prefill, shared by several policies (copied, never modified).

    ``queries`` keeps each layer's last ``window`` post-RoPE prompt queries, ``(num_heads, window, head_dim)``,
    so that prefill-time policies (SnapKV) with an observation window up to ``window`` can score the shared
    prefill exactly as if they had run their own: the keys they attend over are the cache's.
    """

    prompt_ids: list[int]
    cache: SlotCache
    logits: torch.Tensor  # last position's logits
    seconds: float
    window: int = 0
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)
    rope: dict[int, torch.Tensor | None] = field(default_factory=dict)
    reconstructions: dict = field(default_factory=dict)  # KVzip's scores per setting (reconstruct_once)

    def replay(self, sink, window: int) -> None:
        """Hand ``sink`` the prefill views it would have seen with an observation ``window`` (≤ ``self.window``)."""
        size = self.cache.size
        for index, layer in enumerate(self.cache.layers):
            if index in self.queries and sink.wants_layer(index):  # layers without attention record nothing
                sink.on_prefill_layer(scoring.PrefillView(index, self.queries[index][:, -window:],
                                                          layer.keys[0, :, :size], layer.values[0, :, :size],
                                                          self.scaling[index], self.rope.get(index)))


class _QueryRecorder:
    """Score sink for a shared prefill: keeps each layer's last ``prefill_window`` queries, scores nothing."""

    def __init__(self, window: int):
        self.prefill_window = window
        self.queries: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.rope: dict[int, torch.Tensor | None] = {}

    def wants_layer(self, layer: int) -> bool:
        return True

    def on_layer(self, view) -> None:  # never called: a prefill has no decode step
        pass

    def on_prefill_layer(self, view) -> None:
        self.queries[view.layer] = view.queries.clone()
        self.scaling[view.layer] = view.scaling
        self.rope[view.layer] = view.rope


# What a shared prefill may spend on recording prompt queries for the prefill-time policies that share it.
# Expected Attention reads every prompt query: at 64k on a Llama-3.1-8B shape, all of them are 17 GB (heads x
# head_dim x L per layer), where a prefill of its own reduces each layer's queries to statistics as it goes.
SHARED_QUERIES_BYTES = 1 << 30


def shared_window(policies, model, prompt_len: int) -> int:
    """The query window a prefill of ``prompt_len`` tokens shared by ``policies`` records: the widest one
    whose queries fit SHARED_QUERIES_BYTES over all layers.  A policy whose window does not fit runs its
    own prefill (:func:`decode` does that by itself when the shared window is too short)."""
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_query = config.num_hidden_layers * heads * head_dim * model.dtype.itemsize
    windows = [min(policy.prefill_window, prompt_len) for policy in policies]
    return max((window for window in windows if window * per_query <= SHARED_QUERIES_BYTES), default=0)


@torch.inference_mode()
def prefill(model, prompt_ids: list[int], window: int = 0) -> Prefill:
    """Run the prompt once into a full cache; ``window`` > 0 also keeps the last ``window`` queries per layer
    (what prefill-time policies need to share it)."""
    cache = SlotCache(model.config.num_hidden_layers, len(prompt_ids))
    recorder = _QueryRecorder(window) if window > 0 else None
    with scoring.installed(model) if recorder is not None else nullcontext():
        start = time.perf_counter()
        with scoring.scoring(recorder):
            logits = model(input_ids=torch.tensor([prompt_ids], device=model.device),
                           position_ids=torch.arange(len(prompt_ids), device=model.device)[None],
                           logits_to_keep=1, **{cache_kwarg(model): cache}).logits[0, -1]
        settle(model.device)
        seconds = time.perf_counter() - start
    if recorder is None:
        return Prefill(list(prompt_ids), cache, logits, seconds)
    return Prefill(list(prompt_ids), cache, logits, seconds, window, recorder.queries, recorder.scaling,
                   recorder.rope)


@torch.inference_mode()
def decode(model, tokenizer, prompt_ids: list[int], policy: Policy, *, budget: int | None = None,
           compression: float | None = None, max_new_tokens: int = 64,
           sampler: Sampler | None = None, ignore_eos: bool = False,
           shared: Prefill | None = None, cache: EvictingCache | None = None) -> Iterator[StepEvent]:
    """Generate up to ``max_new_tokens`` tokens, evicting with ``policy``; yield one event per step.

    The first event (step 0) is the prefill; each later event is one decode step.  Stops after an EOS
    unless ``ignore_eos`` (benchmarks that need a fixed length).  With ``shared``, a decode-time policy
    starts from a copy of that prefill instead of running its own (its step 0 then reports 0 s forward); so
    does a prefill-time policy whose observation window the shared prefill recorded.
    ``cache``: an empty :class:`EvictingCache` for ``policy`` to use, for callers that continue from it.
    """
    sampler = sampler or Sampler()
    device, prompt_len = model.device, len(prompt_ids)
    eos, cache_arg = set() if ignore_eos else eos_ids(model, tokenizer), cache_kwarg(model)
    check_policy(model, tokenizer, prompt_ids, policy)
    cache = run_cache(model, policy, prompt_len, max_new_tokens, budget, compression, cache)
    prefill_scores = cache.start_prefill(prompt_len, max_new_tokens)

    last_logits, t_forward = prefill_into(model, prompt_ids, cache, prefill_scores, shared)
    if policy.reconstructs:
        cache.score_seconds += reconstruct_once(model, tokenizer, cache, prompt_ids, shared)
    evicted, raw, t_evict = cache.finish_step() if prefill_scores else (np.empty(0, np.int64), None, 0.0)
    token = sampler(last_logits)
    pieces = TextPieces(tokenizer)
    last = token in eos or max_new_tokens == 1  # the run's last token: give out any character still held
    kept, utility = cache.kept_and_utility()
    yield StepEvent(0, -1, token, pieces.add(token, flush=last), kept, evicted, utility, raw, prefill_scores,
                    t_forward, cache.score_seconds, t_evict, cache.nbytes(),
                    cache.components if prefill_scores else None)

    for step in range(1, max_new_tokens):
        if token in eos:
            break
        position = cache.seen
        scores = cache.start_step(step)
        start = time.perf_counter()
        with scoring.scoring(cache if scores else None):
            logits = model(input_ids=torch.tensor([[token]], device=device),
                           position_ids=torch.tensor([[position]], device=device), **{cache_arg: cache}).logits
        settle(device)
        t_forward = time.perf_counter() - start - cache.score_seconds
        evicted, raw, t_evict = cache.finish_step()
        consumed, token = token, sampler(logits[0, -1])
        last = token in eos or step == max_new_tokens - 1
        kept, utility = cache.kept_and_utility()
        yield StepEvent(step, consumed, token, pieces.add(token, flush=last), kept, evicted, utility, raw, scores,
                        t_forward, cache.score_seconds, t_evict, cache.nbytes(), cache.components)


def prefill_into(model, prompt_ids: list[int], cache: EvictingCache, prefill_scores: bool,
                 shared: Prefill | None = None) -> tuple[torch.Tensor, float]:
    """The prompt's forward into ``cache`` (or a copy of ``shared``'s, where it recorded what the policy's
    prefill scoring needs): the last position's logits, shape (vocab,), and the forward's seconds (0 for a
    copy), scoring time excluded."""
    policy, device, prompt_len = cache.policy, model.device, len(prompt_ids)
    start = time.perf_counter()
    if shared is not None and (not prefill_scores or shared.window >= min(policy.prefill_window, prompt_len)):
        if shared.prompt_ids != list(prompt_ids):
            raise ValueError("the shared prefill was made for another prompt")
        cache.copy_from(shared.cache)
        if prefill_scores:
            shared.replay(cache, policy.prefill_window)
        return shared.logits, 0.0
    with scoring.scoring(cache if prefill_scores else None):  # only policies with a prefill_window look
        last_logits = model(input_ids=torch.tensor([prompt_ids], device=device),
                            position_ids=torch.arange(prompt_len, device=device)[None],
                            logits_to_keep=1, **{cache_kwarg(model): cache}).logits[0, -1]
    settle(device)
    return last_logits, time.perf_counter() - start - cache.score_seconds


def run_cache(model, policy: Policy, prompt_len: int, max_new_tokens: int, budget: int | None,
              compression: float | None, cache: EvictingCache | None = None) -> EvictingCache:
    """The :class:`EvictingCache` a run of ``policy`` decodes into: ``cache`` if given (checked to be made for
    this policy and budget), else a new one sized to what the policy can hold at most."""
    if cache is not None:
        if cache.policy is not policy or cache._budget_args != {"budget": budget, "compression": compression}:
            # the cache's own would run silently in place of what this call names
            raise ValueError(f"the cache given was made for {type(cache.policy).__name__} at {cache._budget_args}, "
                             f"this call names {type(policy).__name__} at budget={budget}, "
                             f"compression={compression}: pass the cache's policy and budget, or no cache")
        return cache
    bound = policy.cache_bound(resolve_budget(prompt_len, budget=budget, compression=compression), max_new_tokens)
    total = prompt_len + max_new_tokens
    capacity = total if bound is None else min(total, max(prompt_len, bound) + 1)
    return EvictingCache(model, policy, budget=budget, compression=compression, capacity=capacity)


def check_policy(model, tokenizer, prompt_ids: list[int], policy: Policy) -> None:
    """What ``policy`` needs of this model and prompt, before any forward pass: its own model check (Expected
    Attention's RoPE), and for KVzip a repeat pass within the positions whose rotation stays fixed."""
    policy.check_model(model)
    if policy.reconstructs:
        reach = len(prompt_ids) + max((len(ids) for _, _, ids in repeat_passes(tokenizer, prompt_ids)), default=0)
        limit = scoring.fixed_rope_limit(model)
        if reach > limit:
            where = (f"LongRoPE's original length of {limit}, past which transformers rotates every position "
                     "otherwise than it rotated the cached keys" if limit < model.config.max_position_embeddings
                     else f"the model's context of {limit}")
            raise ValueError(f"KVzip's repeat pass after this {len(prompt_ids)}-token prompt runs to position "
                             f"{reach - 1}, beyond {where}; shorten the prompt or choose another policy")


def decode_many(model, tokenizer, prompt_ids: list[int], policies: dict[str, Policy], *,
                sampler_args: dict | None = None, **kwargs) -> Iterator[tuple[str, StepEvent]]:
    """Run several policies on one prompt with one shared prefill, interleaved step by step.

    Yields ``(policy name, event)``; a policy that reaches EOS drops out while the others go on.
    Prefill-time policies (SnapKV) score the same prefill through the queries it recorded; one whose queries
    would pass SHARED_QUERIES_BYTES (Expected Attention on a long prompt: it reads them all) runs its own.
    """
    for policy in policies.values():  # all refused before the shared prefill, not one by one as they start
        check_policy(model, tokenizer, prompt_ids, policy)
    with scoring.installed(model):  # one hold over the prefill and every stream; restored after the last
        shared = prefill(model, prompt_ids, window=shared_window(policies.values(), model, len(prompt_ids)))
        streams = {name: decode(model, tokenizer, prompt_ids, policy, shared=shared,
                                sampler=Sampler(**(sampler_args or {})), **kwargs)
                   for name, policy in policies.items()}
        while streams:
            for name in list(streams):
                try:
                    yield name, next(streams[name])
                except StopIteration:
                    del streams[name]


class TextPieces:
    """The text each new token adds, with a character split across tokens held back until it is whole.

    A byte-level tokenizer spreads an emoji or a CJK character over several tokens, and each of them
    decoded on its own reads as U+FFFD.  A piece is the decode of a window of recent tokens cut where the
    previous piece ended; while the window ends in an incomplete character nothing is given out, so the
    pieces joined are the decode of all tokens so far, up to a character still being written.
    ``flush=True`` (a run's last token) gives out whatever is held, complete or not.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window's first token: context for the tokenizer's spacing rules
        self.given = 0  # tokens whose text has been given out

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int, flush: bool = False) -> str:
        self.ids.append(token)
        before, after = self._text(self.ids[self.start:self.given]), self._text(self.ids[self.start:])
        if not flush and (after.endswith("\ufffd") or len(after) <= len(before)):
            return ""
        self.start, self.given = self.given, len(self.ids)
        return after[len(before):]


# ------------------------------------------------------------------------------------------- convenience

def encode_prompt(tokenizer, prompt: str, *, chat: bool = True) -> list[int]:
    """Token ids for ``prompt``: through the chat template, or (``chat=False``) as is, no special tokens."""
    if not prompt or not prompt.strip():
        raise ValueError("the prompt is empty; type some text")
    if chat and tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def stream(model, tokenizer, prompt: str | list[int], policy: str | Policy = "inertia", *, chat: bool = True,
           compression: float | None = None, budget: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS,
           temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, backend: str = "auto",
           reads_per_second: float | None = None, **params) -> Iterator[StepEvent]:
    """Iterate over the step events of one generation (prompt as text or token ids).

    ``backend``: ``"engine"`` (this module's decode), ``"static"`` (:mod:`kvviz.backend`'s slot path; refused,
    saying why, where it cannot run the policy or model) or ``"auto"`` (:func:`kvviz.backend.choose`).
    ``reads_per_second``: on the static backend, how often at most the host waits for the device (None: every
    step)."""
    from . import backend as backends

    prompt_ids = prompt if isinstance(prompt, list) else encode_prompt(tokenizer, prompt, chat=chat)
    check_prompt(model, prompt_ids, max_new_tokens)
    policy = make_policy(policy, **params) if isinstance(policy, str) else policy
    if backends.choose(model, policy, backend) == "static":
        yield from backends.stream(model, tokenizer, prompt_ids, policy, budget=budget, compression=compression,
                                   max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                   reads_per_second=reads_per_second)
        return
    with scoring.installed(model):  # run() streams too: once it ends the model has its own attention back
        yield from decode(model, tokenizer, prompt_ids, policy, budget=budget, compression=compression,
                          max_new_tokens=max_new_tokens, sampler=Sampler(temperature, top_p, seed))


def check_prompt(model, prompt_ids: list[int], max_new_tokens: int) -> None:
    if not prompt_ids:
        raise ValueError("the prompt is empty; type some text")
    settings.max_new_tokens(max_new_tokens)
    limit = model.config.max_position_embeddings
    if len(prompt_ids) + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's context "
            f"of {limit} tokens; shorten the prompt or generate fewer tokens"
        )


@dataclass
class Result:
    text: str
    trace: Trace

    @property
    def token_ids(self) -> list[int]:
        return self.trace.token_ids


def run(model, tokenizer, prompt: str | list[int], policy: str | Policy = "inertia", **kwargs) -> Result:
    """Generate to completion; return the text and the full trace.

    The budget comes from ``compression=rho`` (``floor((1 - rho) * prompt length)``) or ``budget=B``; with
    neither, nothing is compressed (budget = prompt length: eviction starts only once generation adds
    tokens).  The CLI differs: ``kvviz generate`` defaults to ``--compression 0.9``.
    """
    run_kwargs = {k: v for k, v in kwargs.items() if k in _RUN_ARGS}
    policy_kwargs = {k: v for k, v in kwargs.items() if k not in _RUN_ARGS}
    if not isinstance(policy, str) and policy_kwargs:
        raise ValueError(f"run() takes {', '.join(sorted(_RUN_ARGS))}, not {', '.join(policy_kwargs)}: set a "
                         "policy object's parameters where it is made")
    if not run_kwargs.get("temperature") and run_kwargs.keys() & {"top_p", "seed"}:
        raise settings.greedy_but_given([f"{k}=" for k in ("top_p", "seed") if k in run_kwargs], "temperature",
                                        "pass temperature > 0 (the random policy's own seed: "
                                        "make_policy('random', seed=N))")
    asked = Settings(**{k: v for k, v in run_kwargs.items() if k in Settings.__dataclass_fields__})
    try:
        policy_obj = make_policy(policy, **policy_kwargs) if isinstance(policy, str) else policy
    except ValueError as error:
        if "has no parameter" not in str(error):
            raise
        raise ValueError(f"{error}; and run() itself takes {', '.join(sorted(_RUN_ARGS))}") from None
    if isinstance(prompt, list):
        prompt_ids = prompt
    else:
        prompt_ids = encode_prompt(tokenizer, prompt, chat=run_kwargs.get("chat", True))
    events = list(stream(model, tokenizer, prompt_ids, policy_obj, **run_kwargs))
    # A policy object is named by its registry entry (what budget_note, the diagnostics and the app look up)
    name = policy if isinstance(policy, str) else setting_label(policy_obj).split()[0]
    trace = Trace.from_run(asked, prompt_ids, asked.budget_for(len(prompt_ids)), name, policy_obj.params(), events,
                           model=getattr(model.config, "name_or_path", ""), dtype=model_dtype(model),
                           prompt=prompt if isinstance(prompt, str) else "",
                           chat=run_kwargs.get("chat", True) if isinstance(prompt, str) else None)
    text = tokenizer.decode(trace.token_ids, skip_special_tokens=True)
    return Result(text, trace)


_RUN_ARGS = {"chat", "compression", "budget", "max_new_tokens", "temperature", "top_p", "seed", "backend"}
