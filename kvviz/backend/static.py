"""The static slot backend: any every-step policy over B + 1 preallocated slots, decided on the device; the
prefill-time ones (SnapKV, KVzip, Expected Attention at the prefill), cut by the engine's own prefill pass and
then decoded on slots that take every new token; and the checkpointed ones (AvoKV-E, R-KV, LazyEviction) and
Expected Attention at every step, decoded on slots while the policy object decides on the host, step by step,
as the engine asks it.

One decode step consumes a token over ``slots`` slots, one of which (``free``) has just taken the new token's
key and value; each layer's float32 attention probabilities (:func:`kvviz.fast.layer_forward`) serve both
its output and the policy's scorer (:mod:`kvviz.backend.scorers`), and the slot to free next is chosen by a
device reduction.  Once the cache sits at its budget the step has static shapes and only in-place
updates: on a GPU it is captured as a CUDA graph per step variant (scoring or not) and replayed, with no
host sync unless events are read.  The steps before that run eagerly with the shapes they have:

* step 1 when the prompt exceeds the budget attends to all ``L0 + 1`` entries and frees ``L0 + 1 - B`` of
  them at once (then the survivors move into a ``B + 1``-slot cache by the engine's own compaction rule);
* with a budget above the prompt, the cache grows a slot per step until it holds ``B + 1``.

Events (:class:`~kvviz.trace.StepEvent`) are the engine's: kept and evicted positions, the policy's utility
per kept entry and raw score per present entry, text from :class:`~kvviz.engine.TextPieces`.  Reading them
syncs; ``events_every=k`` reads the device every ``k`` steps only (kept and evicted sets stay exact for
every step, rebuilt on the host from each step's evicted position; utility and raw come with every k-th).
Exactness: in float32 the engine's formulas on slot-ordered tensors; sums over slots may differ from the
engine's in the last bit, which matters only at ulp-close ties (tests/test_backend.py checks the keep sets).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from .. import engine, fast
from ..policies.base import BudgetTooSmall
from ..policies.full import FullCache
from ..reconstruction import reconstruct_once
from ..scoring import LayerView, rope_frequencies
from ..trace import StepEvent
from .sampling import DeviceSampler
from .scorers import SlotView, make_scorer

LONGEST_BLOCK = 256  # steps decoded between two host reads at most (what the host holds of the device's records)


@dataclass
class StepRecord:
    """One step as the device left it: tensors not yet read, so that recording it costs no sync."""

    step: int
    token: torch.Tensor  # (1,) the token this step produced
    evicted: torch.Tensor  # (count,) positions freed this step
    scored: bool
    # Read only every events_every steps: the positions present before eviction and the raw score per slot,
    # the slots after it (positions), the slots freed among them, the utility per slot (None where absent)
    snapshot: list | None = None
    setup: bool = False  # not a step of the steady shape, or one that compiled or captured a graph
    cache_bytes: int = 0
    components: dict | None = None  # a host-decided policy's named terms, by position (StepEvent.components)


@dataclass
class Budget:
    """What a run's budget means for the slots: ``limit`` live entries after each step (the budget; the
    whole run's length for the full cache), ``steady`` slots once the cache is at it."""

    value: int
    limit: int
    steady: int = field(init=False)

    def __post_init__(self):
        self.steady = self.limit + 1


_compiled_layer = None


def compiled_layer_forward():
    """:func:`kvviz.fast.layer_forward` through ``torch.compile``, one graph for every layer (and policy)."""
    global _compiled_layer
    if _compiled_layer is None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled_layer = torch.compile(fast.layer_forward, fullgraph=True, dynamic=False)
    return _compiled_layer


class StaticBackend:
    """Decode with ``policy`` on the static slot path (see the module docstring).

    Parameters
    ----------
    model
        A Llama, Qwen2/2.5/3 or Mistral causal LM (:data:`kvviz.fast.SUPPORTED`), batch size 1.
    policy
        An every-step policy :func:`kvviz.backend.refusal` accepts; refused with the reason otherwise.
    compile : bool
        The steady step's layers through ``torch.compile`` (the growing and first steps run eagerly).
    fuse, value_block
        As in :class:`kvviz.fast.StaticInertia`: stacked q/k/v and gate/up products; the value product in
        blocks of slots (default: 256 on a GPU, one product elsewhere).
    """

    def __init__(self, model, policy, *, compile: bool = False, fuse: bool = True, value_block: int | None = None):
        from . import decided_on_host, prefill_time, refusal

        why = refusal(model, policy)
        if why:
            raise ValueError(f"the static backend cannot run this: {why}")
        self.prefill_time = prefill_time(policy)
        self.host = decided_on_host(policy)  # decided by the policy object on the host, every step
        # never evicts while decoding (the full cache; a prefill-time policy after its cut): attends over all
        # its preallocated slots with a mask, one step shape for the whole run, captured once on a GPU
        self.grows = self.prefill_time or type(policy) is FullCache
        if value_block is not None and value_block < 0:
            raise ValueError(f"value_block must be 0 (one value product) or a positive slot count, got {value_block}")
        self.model, self.policy, self.compiled, self.fuse = model, policy, compile, fuse
        self.layers = model.model.layers
        self.fp32_logits = fast.fp32_logits_supported(model.device, model.dtype)
        self.value_block = (fast.VALUE_BLOCK if model.device.type == "cuda" else 0) if value_block is None \
            else value_block
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.projections()  # stacked now, outside any timing

    def projections(self) -> list[tuple | None]:
        return [fast.fused_projections(layer) if self.fuse else None for layer in self.layers]

    # -- the public entry points -----------------------------------------------------------------------
    def stream(self, tokenizer, prompt_ids: list[int], *, budget: int | None = None, compression: float | None = None,
               max_new_tokens: int = engine.MAX_NEW_TOKENS, temperature: float = 0.0, top_p: float = 1.0,
               seed: int = 0, events_every: int = 1, ignore_eos: bool = False, graph: bool | None = None,
               shared: engine.Prefill | None = None, reads_per_second: float | None = None) -> Iterator[StepEvent]:
        """The engine's step events for one generation (:func:`kvviz.engine.decode`'s arguments).

        ``events_every=k`` snapshots the device every k steps: each step's event is still yielded, with its
        kept and evicted positions, but utility and raw only on every k-th (None between), and the steps of
        a block come out together.  ``reads_per_second``: the host waits for the device at most about this
        often (a UI's frame rate), taking the steps decoded since in one block, every step's event complete;
        the block's length follows the measured step time (at most :data:`LONGEST_BLOCK`).  None: at every
        snapshot.  On a GPU the steady step is replayed from CUDA graphs when decoding is greedy and the
        policy draws nothing on the host (not Random); ``graph=False`` runs it eagerly.
        """
        if events_every < 1:
            raise ValueError(f"events_every must be at least 1 (read the device every k steps), got {events_every}")
        if reads_per_second is not None and not reads_per_second > 0:
            raise ValueError(f"reads_per_second must be above 0 (or None: read at every snapshot), got "
                             f"{reads_per_second}")
        sampler = DeviceSampler(temperature, top_p, seed, self.model.device)
        eos = set() if ignore_eos else engine.eos_ids(self.model, tokenizer)
        resolved = self._budget(tokenizer, prompt_ids, budget, compression, max_new_tokens)
        records = self._decode(tokenizer, prompt_ids, resolved, max_new_tokens, sampler, graph=graph, shared=shared,
                               snapshot_every=events_every)
        pieces = engine.TextPieces(tokenizer)
        kept, previous = np.arange(len(prompt_ids), dtype=np.int64), -1
        pending: list[StepRecord] = []
        last_mark, block = time.perf_counter(), 1
        try:
            for record in records:
                pending.append(record)
                last = record.step == max_new_tokens - 1
                if record.snapshot is None or (len(pending) < block and not last):
                    continue
                engine.settle(self.model.device)  # what the block cost, and the tensors are ready to read
                now = time.perf_counter()
                seconds, last_mark = (now - last_mark) / len(pending), now
                if reads_per_second is not None:  # as many steps as the device decodes between two frames
                    block = max(1, min(LONGEST_BLOCK, int(1 / (reads_per_second * max(seconds, 1e-9)))))
                for done in pending:
                    kept, event = self._event(done, kept, previous, len(prompt_ids), pieces, eos, max_new_tokens,
                                              seconds)
                    previous = event.new_token_id
                    yield event
                    if event.new_token_id in eos:
                        return
                pending = []
        finally:
            records.close()

    def generate(self, tokenizer, prompt_ids: list[int], budget: int, max_new_tokens: int, *,
                 graph: bool | None = None, timer=None, shared: engine.Prefill | None = None,
                 on_ready=None) -> fast.StaticRun:
        """Greedy tokens of a fixed-length run and each step's device time, no events: the benchmark's run
        (:meth:`kvviz.fast.StaticInertia.generate`'s result).  ``timer`` is called once token 1 is out;
        ``on_ready`` once the steady slots have replaced the prompt-sized cache."""
        clock = fast.StepClock(self.model.device)
        tokens, setup, first_token_time = [], [], 0.0
        resolved = self._budget(tokenizer, prompt_ids, budget, None, max_new_tokens)
        for record in self._decode(tokenizer, prompt_ids, resolved, max_new_tokens,
                                   DeviceSampler(device=self.model.device), graph=graph, shared=shared,
                                   snapshot_every=0, on_ready=on_ready):
            tokens.append(record.token)
            if record.step == 0:
                if timer is not None:
                    timer()
                first_token_time = time.perf_counter()
                clock.mark()
            else:
                clock.mark()
                setup.append(record.setup)
        step_seconds = clock.intervals()
        # Step 1 (over the whole prompt, or the first of a growing cache) is left out of the timings, as
        # StaticInertia leaves out its step 1, which the engine runs.
        return fast.StaticRun([int(t) for t in torch.cat(tokens).tolist()], [], first_token_time,
                              step_seconds[1:], setup[1:])

    # -- the loop --------------------------------------------------------------------------------------
    def _budget(self, tokenizer, prompt_ids, budget, compression, max_new_tokens) -> Budget:
        """The budget as the engine resolves it, the policy reset for this prompt (its refusals, the engine's)."""
        prompt_len = len(prompt_ids)
        engine.check_policy(self.model, tokenizer, prompt_ids, self.policy)
        value = engine.resolve_budget(prompt_len, budget=budget, compression=compression)
        try:
            self.policy.reset(prompt_len, value, len(self.layers))
        except BudgetTooSmall as error:
            if compression is None:
                raise
            raise ValueError(engine.at_compression(error, compression, prompt_len)) from None
        if type(self.policy) is FullCache:
            return Budget(value, prompt_len + max_new_tokens)
        if self.prefill_time:  # cut once at the prefill, then every new token is kept, as the engine keeps it
            return Budget(value, min(prompt_len, value) + max_new_tokens)
        if self.host:  # the slots the engine's cache has: the most the policy holds (B + interval - 1)
            bound = self.policy.cache_bound(value, max_new_tokens)
            return Budget(value, min(prompt_len + max_new_tokens, max(prompt_len, bound) + 1) - 1)
        return Budget(value, value)

    @torch.inference_mode()
    def _decode(self, tokenizer, prompt_ids: list[int], budget: Budget, max_new_tokens: int, sampler: DeviceSampler,
                *, graph: bool | None, shared, snapshot_every: int, on_ready=None) -> Iterator[StepRecord]:
        """Prefill, then one :class:`StepRecord` per step; a snapshot every ``snapshot_every`` steps (0: none)."""
        if self.host:
            return (yield from self._decode_host(tokenizer, prompt_ids, budget, max_new_tokens, sampler, shared=shared,
                                                 snapshot_every=snapshot_every))
        run = yield from self._start(tokenizer, prompt_ids, budget, sampler, shared, max_new_tokens)
        step = functools.partial(self._step, run)
        # A sampled step draws from a generator and Random from the host's: those steps run eagerly.
        capture = self.model.device.type == "cuda" and sampler.greedy and run.scorer.capturable and graph is not False
        graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        runs: dict[bool, int] = {}
        ready = on_ready is None
        for k in range(1, max_new_tokens):
            slots = run.live + 1
            count = max(0, slots - budget.limit)
            scoring = self.policy.wants_scores(k)
            run.scorer.prepare(len(run.eligible) if scoring else 0)
            steady = run.bias is not None or (count == 1 and slots == budget.steady == run.cache.capacity)
            attended = None if run.bias is not None else slots  # masked: every slot, the same shape each step
            setup = self._setup_step(runs, scoring, steady, capture)
            if steady and capture:
                if scoring in graphs:
                    graphs[scoring].replay()
                else:  # runs this step once, eagerly, and records it
                    graphs[scoring] = fast.capture_step(lambda scoring=scoring, attended=attended, count=count: step(
                        scoring, attended, count, self._layer_fn(True)))
                victims = run.free.clone() if count else run.free.new_empty(0)
            else:
                victims = step(scoring, attended, count, self._layer_fn(steady))
            wanted = snapshot_every and (k % snapshot_every == 0 or k == max_new_tokens - 1 or count > 1)
            before = run.positions[:slots].clone() if count > 1 else None  # the positions present, new token's too
            snapshot = self._present(run, slots, before) if wanted else None
            evicted, victims = self._settle(run, budget, slots, count, victims, before)
            if not ready and run.cache.capacity == budget.steady:
                on_ready()
                ready = True
            if snapshot is not None:
                snapshot += self._after(run, slots if count <= 1 else run.live, victims)
            yield StepRecord(k, run.token.reshape(1).clone(), evicted, scoring, snapshot, setup, run.cache.nbytes())

    def _decode_host(self, tokenizer, prompt_ids: list[int], budget: Budget, max_new_tokens: int,
                     sampler: DeviceSampler, *, shared, snapshot_every: int) -> Iterator[StepRecord]:
        """A host-decided policy's run (checkpointed, or Expected Attention at every step): each step the slots
        decode the token, the policy object gets the engine's calls (begin_step, each eligible layer's view,
        raw_scores, select_evictions, components) on the host, and the survivors are compacted as the engine's
        cache compacts them, so the slots keep its order."""
        policy, device, prompt_len = self.policy, self.model.device, len(prompt_ids)
        run = yield from self._start(tokenizer, prompt_ids, budget, sampler, shared, max_new_tokens)
        for k in range(1, max_new_tokens):
            slots = run.live + 1
            scoring = policy.wants_scores(k)
            policy.begin_step(k, run.positions[: run.live].cpu(), prompt_len + k - 1)
            self._step(run, scoring, slots, 0, fast.layer_forward)
            present = run.positions[:slots].cpu()
            raw = policy.raw_scores(present)
            drop = policy.select_evictions(k, present, budget.value).to(device)
            components = policy.components(present)
            order = torch.argsort(present)
            components = None if not components else {
                name: values[order].float().numpy().copy() for name, values in components.items()}
            evicted = present[drop.cpu()]
            if drop.numel():
                self._compact(run, drop, slots, run.cache.capacity)
            else:
                run.live = slots
                run.free.fill_(slots)
            snapshot = None
            if snapshot_every and (k % snapshot_every == 0 or k == max_new_tokens - 1 or drop.numel() > 1):
                after = run.positions[: run.live].cpu()
                utility = policy.utility(after)
                snapshot = [present, raw, after, torch.empty(0, dtype=torch.long), utility]
            yield StepRecord(k, run.token.reshape(1).clone(), evicted, scoring, snapshot, False, run.cache.nbytes(),
                             components)

    def _start(self, tokenizer, prompt_ids: list[int], budget: Budget, sampler: DeviceSampler, shared,
               max_new_tokens: int) -> Iterator[StepRecord]:
        """Prefill (or copy ``shared``) and yield step 0's record; returns the run's state for step 1, whose slots
        hold every entry the prefill kept (the prompt's slots, or the steady B + 1 if the prompt fits them)."""
        model, policy, device = self.model, self.policy, self.model.device
        prompt_len = len(prompt_ids)
        projections = self.projections()
        if shared is not None and shared.prompt_ids != list(prompt_ids):
            raise ValueError("the shared prefill was made for another prompt")
        if self.prefill_time or self.host:
            prefill, token, record = self._prefill_and_cut(tokenizer, prompt_ids, budget, sampler, shared,
                                                           max_new_tokens)
            kept = prefill.live_positions().to(device)  # slot order, as the engine's cache holds them
            layers = prefill.layers
        else:
            prefill = shared if shared is not None else engine.prefill(model, prompt_ids)
            token = sampler(prefill.logits)
            utility = policy.utility(torch.arange(prompt_len))  # the engine's step 0: the policy as reset
            prompt_positions, none = torch.arange(prompt_len), torch.empty(0, dtype=torch.long)
            record = StepRecord(0, token, none, False, [prompt_positions, None, prompt_positions, none, utility],
                                cache_bytes=prefill.cache.nbytes())
            kept = torch.arange(prompt_len, device=device)
            layers = prefill.cache.layers
        yield record
        capacity = max(kept.numel() + 1, budget.steady)
        cache = self._slots(capacity, [(layer.keys, layer.values) for layer in layers], kept.numel())
        del prefill, layers  # a prefill of our own: only the slots hold it now
        positions = torch.full((capacity,), -1, dtype=torch.long, device=device)
        positions[: kept.numel()] = kept
        # A prefill-time policy decodes as the full cache does: its budget leaves room for every new token.
        if self.host:
            scorer = _PolicyOnHost(policy, rope_frequencies(model))
        else:
            scorer = make_scorer(FullCache() if self.prefill_time else policy, device, capacity)
        bias = None
        if self.grows:  # every slot it will fill exists already: one shape for the whole run, unwritten masked
            bias = torch.full((cache.keys[0].shape[2],), float("-inf"), device=device)
            bias[: kept.numel()] = 0.0
        return _Run(cache, positions, free=torch.tensor([kept.numel()], device=device),
                    token=token.reshape(1, 1).clone(), position=torch.tensor([[prompt_len]], device=device),
                    evicted=torch.zeros(1, dtype=torch.long, device=device), live=kept.numel(),
                    scorer=scorer, sampler=sampler, projections=projections,
                    eligible=[index for index in range(len(self.layers)) if policy.wants_layer(index)], bias=bias)

    def _prefill_and_cut(self, tokenizer, prompt_ids: list[int], budget: Budget, sampler: DeviceSampler, shared,
                         max_new_tokens: int) -> tuple[engine.EvictingCache, torch.Tensor, StepRecord]:
        """A prefill-time policy's step 0 through the engine's own prefill, scoring passes and selection (they run
        once a run, so the engine's hooks cost nothing per token): the cache it left, the first token, the
        step's record."""
        prompt_len = len(prompt_ids)
        cache = engine.run_cache(self.model, self.policy, prompt_len, max_new_tokens, budget.value, None)
        scores = cache.start_prefill(prompt_len, max_new_tokens)  # whether it reads the prompt's queries
        logits, _ = engine.prefill_into(self.model, prompt_ids, cache, scores, shared)
        if self.policy.reconstructs:
            reconstruct_once(self.model, tokenizer, cache, prompt_ids, shared)
        evicted, raw, _ = cache.finish_step() if scores else (np.empty(0, np.int64), None, 0.0)
        kept, utility = cache.kept_and_utility()
        token = sampler(logits)
        snapshot = [torch.arange(prompt_len), None if raw is None else torch.from_numpy(raw), torch.from_numpy(kept),
                    torch.empty(0, dtype=torch.long), None if utility is None else torch.from_numpy(utility)]
        return cache, token, StepRecord(0, token, torch.from_numpy(evicted), scores, snapshot,
                                        cache_bytes=cache.nbytes(), components=cache.components if scores else None)

    def _step(self, run: "_Run", scoring: bool, slots: int | None, count: int, layer_fn) -> torch.Tensor:
        """One token over ``slots`` slots (None: all, the unwritten masked), freeing ``count``; in place only (a
        CUDA graph replays it)."""
        model, scorer = self.model, run.scorer
        keys, values = run.cache
        if run.bias is not None:
            run.bias.index_fill_(0, run.free, 0.0)  # the new token's slot joins the attention
        scorer.begin(scoring, run.free, slots)
        run.positions.index_copy_(0, run.free, run.position[0])
        live_positions = run.positions[:slots]
        hidden = model.model.embed_tokens(run.token)
        cos, sin = model.model.rotary_emb(hidden, run.position)
        for index, (layer, fused, layer_keys, layer_values) in enumerate(zip(self.layers, run.projections,
                                                                            keys, values)):
            observed = scoring and index in run.eligible
            # a host-decided policy buffers the query itself (a fresh tensor: it keeps what it is given)
            query = hidden.new_empty(self.heads, layer_keys.shape[-1]) if observed and self.host else None
            hidden, probs = layer_fn(layer, hidden, cos, sin, run.free, layer_keys, layer_values, self.fp32_logits,
                                     fused, slots, self.value_block, query_out=query, bias=run.bias)
            if observed:
                scorer.observe(SlotView(index, query, layer_keys[0, :, :slots], layer_values[0, :, :slots],
                                        layer.self_attn.scaling, _attn=probs.reshape(self.heads, slots),
                                        groups=self.heads // self.kv_heads), live_positions)
        logits = model.lm_head(model.model.norm(hidden))[0, -1]
        run.token.copy_(run.sampler(logits).reshape(1, 1))
        victims = scorer.evict(live_positions, count)
        if count == 1:  # the steady step: the freed slot takes the next token
            run.evicted.copy_(live_positions[victims])
            run.free.copy_(victims)
        run.position.add_(1)
        return victims

    def _setup_step(self, runs: dict[bool, int], scoring: bool, steady: bool, capture: bool) -> bool:
        """Whether a step is setup, which the benchmark's steady rate leaves out: every step before the static
        shape; of a captured variant, the capture (and compile) and the graph's first upload; of a compiled
        one, its first step.  Counts the variant's steady steps."""
        if not steady:
            return True
        if not (capture or self.compiled):
            return False
        runs[scoring] = runs.get(scoring, 0) + 1
        return runs[scoring] <= 2 if capture else runs[scoring] == 1

    def _present(self, run: "_Run", slots: int, before: torch.Tensor | None) -> list:
        """A snapshot's first half, read before a compaction resets the step's scores: the positions present
        (the new token's too) and the step's raw score per slot."""
        raw = run.scorer.raw(run.positions[:slots])
        return [(before if before is not None else run.positions[:slots]).clone(), None if raw is None else raw.clone()]

    def _after(self, run: "_Run", count: int, victims: torch.Tensor) -> list:
        """A snapshot's second half, the first ``count`` slots after eviction: their positions, the freed ones
        among them, the utility per slot."""
        after = run.positions[:count]
        utility = run.scorer.utility(after)
        return [after.clone(), victims.clone(), None if utility is None else utility.clone()]

    def _settle(self, run: "_Run", budget: Budget, slots: int, count: int, victims: torch.Tensor,
                before: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's evicted positions, and the freed slots left to report; on step 1 over the whole prompt the
        survivors move into the steady slots, as the engine moves them."""
        if count == 1:
            run.live = slots - 1
            return run.evicted.clone(), victims
        if count == 0:
            run.live = slots
            run.free.fill_(slots)
            return run.evicted.new_empty(0), victims
        evicted = before[victims]
        self._compact(run, victims, slots, budget.steady)
        return evicted, victims.new_empty(0)

    def _compact(self, run: "_Run", freed: torch.Tensor, slots: int, capacity: int) -> None:
        """Free ``freed`` of ``slots`` slots, the survivors moved into a ``capacity``-slot cache as the engine's
        cache moves them (:func:`engine_compaction`); the next token takes the first slot after them."""
        order = engine_compaction(freed, slots)
        moved = [(keys[:, :, order], values[:, :, order]) for keys, values in zip(*run.cache)]
        run.cache = self._slots(capacity, moved, order.numel())
        compacted = torch.full((capacity,), -1, dtype=torch.long, device=self.model.device)
        compacted[: order.numel()] = run.positions[order]
        run.positions = compacted
        run.scorer.compact(order, capacity)
        run.live = order.numel()
        run.free = torch.tensor([run.live], device=self.model.device)

    def _layer_fn(self, steady: bool):
        """The compiled layer for the steady shape; eager while shapes still change (no recompiling per step)."""
        return compiled_layer_forward() if self.compiled and steady else fast.layer_forward

    def _slots(self, capacity: int, sources: list[tuple[torch.Tensor, torch.Tensor]], count: int) -> "Slots":
        """Zeroed per-layer slot buffers for ``capacity`` slots (padded to whole value blocks), the first ``count``
        filled from ``sources``' ``(1, kv_heads, >= count, head_dim)`` keys and values."""
        padded = fast.padded_slots(capacity, self.value_block)
        keys, values = [], []
        for source_keys, source_values in sources:
            for source, out in ((source_keys, keys), (source_values, values)):
                buffer = source.new_zeros(1, source.shape[1], padded, source.shape[3])
                buffer[:, :, :count] = source[:, :, :count]
                out.append(buffer)
        return Slots(keys, values, capacity)

    def _event(self, record: StepRecord, kept: np.ndarray, previous: int, prompt_len: int, pieces, eos: set[int],
               max_new_tokens: int, seconds: float) -> tuple[np.ndarray, StepEvent]:
        """The engine's event for ``record``; ``kept`` the positions kept after the step before."""
        token, step = int(record.token), record.step
        evicted = np.sort(record.evicted.cpu().numpy())
        if step:
            if self.prefill_time:  # the engine announces each step to the policy, which may track positions
                with torch.inference_mode():  # its state was made in the prefill's inference mode
                    self.policy.begin_step(step, torch.from_numpy(kept), prompt_len + step - 1)
            kept = np.append(kept, prompt_len + step - 1)
        kept = np.setdiff1d(kept, evicted)  # sorted
        utility = raw = None
        if record.snapshot is not None:
            present, raw_by_slot, after, freed, utility_by_slot = (None if t is None else t.cpu()
                                                                   for t in record.snapshot)
            live = torch.ones(after.numel(), dtype=torch.bool)
            live[freed] = False
            order = torch.argsort(after[live])
            if not np.array_equal(after[live][order].numpy(), kept):
                raise AssertionError(f"step {step}: the host's kept positions are not the device's")
            if utility_by_slot is not None:
                utility = utility_by_slot[live][order].float().numpy()
            elif self.prefill_time:  # its utility is the prefill's, kept by the policy on the host
                with torch.inference_mode():
                    kept_utility = self.policy.utility(torch.from_numpy(kept))
                utility = None if kept_utility is None else kept_utility.float().numpy()
            if raw_by_slot is not None:
                raw = raw_by_slot[torch.argsort(present)].float().numpy()
        last = token in eos or step == max_new_tokens - 1
        return kept, StepEvent(step, previous, token, pieces.add(token, flush=last), kept, evicted, utility, raw,
                               record.scored, seconds, 0.0, 0.0, record.cache_bytes, record.components)


@dataclass
class Slots:
    """Each layer's slot buffers, ``(1, num_kv_heads, padded, head_dim)``; ``capacity`` slots of them usable."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    capacity: int

    def __iter__(self):  # keys, values = slots
        return iter((self.keys, self.values))

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)


def engine_compaction(freed: torch.Tensor, slots: int) -> torch.Tensor:
    """Where :meth:`kvviz.cache.SlotCache.evict` puts the survivors of freeing ``freed`` of ``slots`` slots: the
    holes below the new length take the survivors above it, in order.  Returns ``(slots - len(freed),)``: the
    old slot of each new one (what keeps a policy that draws slot indices, Random, on the engine's draws)."""
    new_length = slots - freed.numel()
    dropped = torch.zeros(slots, dtype=torch.bool, device=freed.device)
    dropped[freed] = True
    holes = torch.nonzero(dropped[:new_length]).flatten()
    sources = torch.nonzero(~dropped[new_length:]).flatten() + new_length
    order = torch.arange(new_length, device=freed.device)
    order[holes] = sources
    return order


@dataclass
class _Run:
    """A run's device state between steps: the slots, the position in each (-1: empty), the slot the next
    token takes, that token and its position, the position the steady step freed, and the live entries;
    and what stays fixed: the scorer, the sampler, each layer's stacked projections, the scored layers."""

    cache: "Slots"
    positions: torch.Tensor
    free: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    evicted: torch.Tensor
    live: int
    scorer: object
    sampler: DeviceSampler
    projections: list
    eligible: list[int]
    bias: torch.Tensor | None = None  # a run that never evicts: -inf on the slots not written yet


class _PolicyOnHost:
    """The scorer of a host-decided policy on the static slots: each view handed on to the policy object as the
    engine hands it (the attention left for the view to compute from the query, as the engine's does), with
    the slots' positions on the host.  It frees nothing itself: :meth:`StaticBackend._decode_host` asks the
    policy."""

    capturable = False

    def __init__(self, policy, rope: torch.Tensor | None):
        self.policy, self.rope = policy, rope  # rope: as the engine's views carry it (Expected Attention reads it)

    def prepare(self, layers: int) -> None:
        pass

    def begin(self, scoring: bool, free: torch.Tensor, slots: int) -> None:
        pass

    def observe(self, view, positions: torch.Tensor) -> None:
        self.policy.observe(LayerView(view.layer, view.query, view.keys, view.values, view.scaling, self.rope),
                            positions.cpu())

    def evict(self, positions: torch.Tensor, count: int) -> torch.Tensor:
        return positions.new_empty(0)

    def compact(self, index: torch.Tensor, capacity: int) -> None:
        pass  # the policy keeps its state by position

    def raw(self, positions: torch.Tensor) -> None:
        return None

    def utility(self, positions: torch.Tensor) -> None:
        return None
