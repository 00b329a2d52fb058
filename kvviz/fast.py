"""A static decode step for InertiaKV: B + 1 preallocated slots, attention and scores from one pass.

The reference engine (:mod:`kvviz.engine`) goes through the HF forward, a second pass over the keys for
the scores and host-side eviction.  Here, once the cache sits at its budget, one decode step is a fixed
sequence of tensor ops with static shapes:

* the new token's key/value are written into the slot freed by the previous eviction (no copies);
* each layer computes its float32 attention probabilities once and uses them both for the output and,
  head-averaged, for the layer-sequential EMA ``m <- a*m + (1-a)*s``;
* the next token (greedy) and the slot to free (lowest ``m``, ties to the older position) are chosen
  with device reductions, so nothing waits on the host.

That is the shape CUDA graphs need (``graph=True`` captures the step on a GPU and replays it).  Once
launches are gone, what remains is many small element-wise kernels per layer (norms, RoPE, SiLU gating,
the EMA); ``compile=True`` fuses them with ``torch.compile`` one layer at a time (one compiled graph
serves every layer) before the step is captured.  At batch 1 every projection is a matrix-vector product
that reads its whole weight, and a few large ones read closer to the memory bandwidth than many small
ones: ``fuse=True`` (the default) runs q/k/v as one product and gate/up as another (gpt-fast does the
same), over one matrix each whose row slices the layer's own modules then use, so no weight is held
twice.  With a half-precision cache on CUDA the logits come out of cuBLAS in float32 directly, so the
scores never need a float32 copy of the keys.  On a GPU the product of the probabilities with the values
runs in blocks of slots (``value_block``, :func:`attend`): as one product its long sum over slots kept a
handful of the GPU's units busy (on an H200 at 64k context it took 28% of the step, 60 us per layer for
13 MB of values; in blocks of 256 the step ran 1.33x faster).  Prefill and the first decode step (which
attends to the whole prompt) run as in the reference engine.  Llama, Qwen2/2.5/3 and Mistral layouts;
batch size 1; greedy.

Exactness: in float32 the static step computes the engine's formulas, but it sums over slots where the
engine sums over positions, so scores can differ in the last bit.  Keep sets still agree unless two
utilities are within an ulp of each other; the one place where such near-ties are systematic, the mean a
new token enters at, is summed in float64 on both paths so that it does not depend on order.  In
bfloat16 on a GPU the two paths use different attention kernels and agreement is measured, not promised.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from . import engine
from .policies.inertia import InertiaKV
from .policies.recency import Recency
from .scoring import installed


@dataclass
class StaticRun:
    token_ids: list[int]
    kept: list[list[int]]  # sorted positions after each decode step (only when record_kept)
    first_token_time: float = 0.0  # perf_counter when token 1 was out (end of prefill), for benchmarks
    step_seconds: list[float] = field(default_factory=list)  # each static step (token 3 on), device time
    setup_steps: list[bool] = field(default_factory=list)  # steps that also compiled / captured a graph

    def setup_seconds(self) -> float:
        """Time of the steps that compiled or captured (what :meth:`steady_tok_s` leaves out)."""
        return sum(s for s, setup in zip(self.step_seconds, self.setup_steps) if setup)

    def steady_tok_s(self) -> float:
        """Tokens per second over the steps that only replayed (or ran) the step: setup excluded."""
        steady = [s for s, setup in zip(self.step_seconds, self.setup_steps) if not setup]
        return len(steady) / sum(steady) if steady else float("nan")


class StepClock:
    """Marks the end of each step without waiting for the device; read once, at the end.

    On CUDA these are events on the current stream (a host timestamp would need a sync per step and
    break the asynchrony that graph replay buys); on a CPU, where every op is synchronous, plain clocks.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1000 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


@functools.cache  # one probe per device and dtype, not one per StaticInertia
def fp32_logits_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.bmm(..., out_dtype=torch.float32)`` runs here for a ``dtype`` cache (CUDA, half types)."""
    if dtype == torch.float32 or device.type != "cuda":
        return False
    try:
        probe = torch.ones(1, 2, 2, device=device, dtype=dtype)
        return torch.bmm(probe, probe, out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


VALUE_BLOCK = 256  # slots per block of the value product on a GPU (see attend); 0: one product


def padded_slots(slots: int, block: int) -> int:
    """The slot cache's length for ``slots`` live slots: whole blocks of ``block`` (0: no padding)."""
    return -(-slots // block) * block if block else slots


def attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
           fp32_logits: bool = False, slots: int | None = None, block: int = 0,
           bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token against the slot cache; the probabilities serve the output and the scores alike.

    Parameters
    ----------
    query : torch.Tensor
        ``(num_kv_heads, groups, head_dim)``, query heads grouped by their KV head (no ``repeat_kv`` copy).
    keys, values : torch.Tensor
        ``(num_kv_heads, padded, head_dim)`` in the model's dtype; the slots from ``slots`` on are padding,
        whose values must be zero (finite, in any case).
    fp32_logits : bool
        Half-precision cache on CUDA: float32 logits straight from the half-precision keys (cuBLAS
        accumulates in float32 anyway), instead of upcasting a float32 copy of the whole cache per layer.
    slots : int or None
        The live slots (``None``: all ``padded``); padding gets probability zero.
    block : int
        The value product in blocks of this many slots (``padded`` a multiple of it), one batched product
        whose partial outputs are summed in float32.  With 0, one product: ``groups`` rows times ``head_dim``
        columns of output, each summed over every slot, which cuBLAS spreads over few tiles (on an H200,
        60 us per layer at 6554 slots); blocks give it ``padded / block`` times as many independent sums.
    bias : torch.Tensor or None
        ``(slots,)`` float32 added to the scaled logits: ``-inf`` for slots not written yet (a cache whose
        live length changes inside one captured shape: the static backend's full cache and prefill-time runs).

    Returns
    -------
    out : torch.Tensor
        ``(num_kv_heads, groups, head_dim)`` in the model's dtype.
    probs : torch.Tensor
        Float32 softmax over the live slots, ``(num_kv_heads, groups, slots)``.
    """
    kv_heads, groups, head_dim = query.shape
    padded = keys.shape[1]
    slots = padded if slots is None else slots
    # Logits and softmax over the live slots alone, not over padding masked with -inf: a longer row is summed
    # in another order (by the product's kernel, by the softmax), which moves probabilities by an ulp, enough
    # to flip the engine's near-ties.
    live_keys = keys[:, :slots]
    if fp32_logits:
        logits = torch.bmm(query, live_keys.transpose(1, 2), out_dtype=torch.float32)
    else:
        logits = torch.bmm(query.float(), live_keys.float().transpose(1, 2))
    probs = torch.softmax(logits * scaling if bias is None else logits * scaling + bias, dim=-1)
    weights, values_in = (probs.to(values.dtype), values) if fp32_logits else (probs, values.float())
    if slots < padded:
        weights = F.pad(weights, (0, padded - slots))  # padding weighs nothing
    if block and padded > block:
        blocks = padded // block
        weights = weights.view(kv_heads, groups, blocks, block).transpose(1, 2).reshape(-1, groups, block)
        partial = torch.bmm(weights, values_in.reshape(kv_heads * blocks, block, head_dim),
                            **({"out_dtype": torch.float32} if fp32_logits else {}))
        out = partial.view(kv_heads, blocks, groups, head_dim).sum(1)
    else:
        out = torch.bmm(weights, values_in)
    return out.to(values.dtype), probs


def decode_layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, free: torch.Tensor,
                 keys: torch.Tensor, values: torch.Tensor, ema: torch.Tensor | None, alpha: float,
                 fp32_logits: bool, fused: tuple | None = None, slots: int | None = None,
                 block: int = 0) -> torch.Tensor:
    """One decoder layer for one token over the slot cache; updates ``keys``/``values`` (and ``ema``) in place.

    A module-level function of the layer, not a method: compiled once, the same graph serves every layer
    (their parameters are inputs), so an L-layer model costs one compilation, not L.

    Parameters
    ----------
    hidden : torch.Tensor
        ``(1, 1, hidden_size)``.
    free : torch.Tensor
        ``(1,)`` long, the slot the new token's key and value overwrite.
    keys, values : torch.Tensor
        ``(1, num_kv_heads, padded, head_dim)``, this layer's slot cache: ``slots`` live slots, then padding.
    ema : torch.Tensor or None
        ``(slots,)`` float32 utilities, updated layer-sequentially ``m <- a*m + (1-a)*s`` with ``s`` the
        head-mean attention of this layer; ``None`` on steps that do not score.
    fused : tuple or None
        This layer's :func:`fused_projections` (``None``: one product per projection module).
    slots, block : int
        As in :func:`attend` (``slots=None``: no padding).
    """
    hidden, probs = layer_forward(layer, hidden, cos, sin, free, keys, values, fp32_logits, fused, slots, block)
    if ema is not None:
        ema.copy_(alpha * ema + (1.0 - alpha) * probs.mean((0, 1)))  # the engine's expression, same rounding
    return hidden


def layer_forward(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, free: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, fp32_logits: bool, fused: tuple | None = None,
                  slots: int | None = None, block: int = 0, query_out: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_layer` without a policy: the layer's output and its attention probabilities, for a scorer
    (:mod:`kvviz.backend`) to read.  Arguments as in :func:`decode_layer`; ``query_out``, ``(num_heads,
    head_dim)``, if given, receives the post-RoPE query (what a policy that buffers queries reads); ``bias`` as
    in :func:`attend`.

    Returns
    -------
    hidden : torch.Tensor
        ``(1, 1, hidden_size)``.
    probs : torch.Tensor
        Float32 softmax of the new query over the live slots, ``(num_kv_heads, groups, slots)``.
    """
    attn = layer.self_attn
    heads, kv_heads, head_dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    x = layer.input_layernorm(hidden)
    if fused is None:
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
    else:
        q, k, v = F.linear(x, fused[0], fused[1]).split([heads * head_dim] + [kv_heads * head_dim] * 2, dim=-1)
    q = q.view(1, 1, heads, head_dim).transpose(1, 2)
    k = k.view(1, 1, kv_heads, head_dim).transpose(1, 2)
    v = v.view(1, 1, kv_heads, head_dim).transpose(1, 2)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    if query_out is not None:
        query_out.copy_(q[0, :, 0])
    keys.index_copy_(2, free, k)
    values.index_copy_(2, free, v)
    out, probs = attend(q.view(kv_heads, heads // kv_heads, head_dim), keys[0], values[0], attn.scaling,
                        fp32_logits, slots, block, bias)
    hidden = hidden + attn.o_proj(out.reshape(1, 1, heads * head_dim))
    x = layer.post_attention_layernorm(hidden)
    if fused is None:
        return hidden + layer.mlp(x), probs
    gate, up = F.linear(x, fused[2], fused[3]).chunk(2, dim=-1)
    return hidden + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up), probs  # the HF MLP's formula


def fused_projections(layer) -> tuple | None:
    """One matrix for the layer's q/k/v projections and one for gate/up, with the modules re-pointed to them.

    Each module's weight (and bias) becomes a row slice of the stacked matrix, so the layer computes what it
    did, the HF forward still works, and the weights are not held twice: the first call stacks and frees
    the originals, a layer at a time.  A later call finds the slices still back to back in one storage and
    returns a view over them, so it sees in-place updates of the weights; once they have been replaced
    (``.to()``, ``load_state_dict(assign=True)``, ``param.data = ...``) it stacks again.  (Sharing storage, the
    re-pointed weights cannot go through ``safetensors.torch.save_file`` as a raw state dict;
    ``save_pretrained`` writes them.)

    Returns
    -------
    tuple or None
        ``(qkv_weight, qkv_bias, gate_up_weight, gate_up_bias)``: ``(q + 2 kv, hidden)`` and
        ``(2 intermediate, hidden)`` matrices, biases ``None`` where the modules have none.  ``None`` when a
        projection is not a plain ``nn.Linear`` with a plain weight (quantised or sharded weights are tensor
        subclasses; accelerate's offloading hooks move weights on their own; mixed dtypes or devices): the
        layer is left as it is and :func:`decode_layer` calls the modules one by one.
    """
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj))
    modules = [module for group in groups for module in group]
    if (any(hasattr(module, "_hf_hook") for module in layer.modules())
            or not all(type(module) is torch.nn.Linear for module in modules)):
        return None
    tensors = [tensor for module in modules for tensor in (module.weight, module.bias) if tensor is not None]
    if (not all(type(tensor) is torch.nn.Parameter and type(tensor.data) is torch.Tensor for tensor in tensors)
            or len({(tensor.dtype, tensor.device) for tensor in tensors}) != 1
            or any(len({module.bias is None for module in group}) != 1 for group in groups)):
        return None
    fused = []
    # Not inference tensors even when called under inference mode: the model's forward may later run without it.
    with torch.inference_mode(False), torch.no_grad():
        for group in groups:
            weight = _stacked_view([module.weight for module in group])
            bias = None if group[0].bias is None else _stacked_view([module.bias for module in group])
            if weight is None or (bias is None and group[0].bias is not None):
                weight, bias = _stack(group)
            fused += [weight, bias]
    return tuple(fused)


def _stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``tensors`` stacked along dim 0 without a copy, when they lie back to back in one storage; else None."""
    first = tensors[0]
    if first.is_meta:  # every meta storage reports address 0: adjacency cannot be told
        return None
    storage = first.untyped_storage()
    row = math.prod(first.shape[1:])  # elements per row of a row-major stack (1 for a bias)
    offset = first.storage_offset()
    for tensor in tensors:
        # is_contiguous() ignores the stride of a dimension of size 1: the row stride is checked itself
        if (not tensor.is_contiguous() or tensor.shape[1:] != first.shape[1:] or tensor.storage_offset() != offset
                or tensor.stride(0) != row
                or tensor.untyped_storage().data_ptr() != storage.data_ptr()
                or tensor.untyped_storage().nbytes() != storage.nbytes()):
            return None
        offset += tensor.numel()
    shape = (sum(tensor.shape[0] for tensor in tensors), *first.shape[1:])
    return first.detach().as_strided(shape, (row, *first.stride()[1:]), first.storage_offset())


def _stack(group) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stack the group's weights (and biases) and re-point each module to its rows of them."""
    weight = torch.cat([module.weight for module in group])
    bias = None if group[0].bias is None else torch.cat([module.bias for module in group])
    start = 0
    for module in group:
        rows = module.weight.shape[0]
        module.weight = torch.nn.Parameter(weight[start:start + rows], module.weight.requires_grad)
        if bias is not None:
            module.bias = torch.nn.Parameter(bias[start:start + rows], module.bias.requires_grad)
        start += rows
    return weight, bias


_compiled_layer = None


def compiled_decode_layer():
    """``decode_layer`` through ``torch.compile`` (Inductor fuses the norms, RoPE, SiLU-gating and the EMA).

    Not ``mode="reduce-overhead"``: its CUDA graphs are skipped because the step mutates the cache tensors it
    is given. We capture the whole step ourselves instead (:meth:`StaticInertia.generate`). Shapes are
    static (one graph per budget); the recompile limit is raised so that a sweep over budgets and step
    variants never silently falls back to eager.
    """
    global _compiled_layer
    if _compiled_layer is None:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        _compiled_layer = torch.compile(decode_layer, fullgraph=True, dynamic=False)
    return _compiled_layer


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")  # decoder layouts decode_layer reproduces


LONGEST = torch.iinfo(torch.long).max  # a position no entry has: where the lowest utility is not


@dataclass
class _Slots:
    """The static step's ``slots`` (B + 1), on the device and updated in place: each layer's keys and values,
    the position in each slot (-1: empty), the EMA utility per slot, the slot the next token takes, that token
    and its position."""

    slots: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    positions: torch.Tensor
    m: torch.Tensor
    free: torch.Tensor
    token: torch.Tensor
    position: torch.Tensor
    slot_ids: torch.Tensor

    def kept(self) -> list[int]:
        """The positions in the slots after the step's eviction, sorted (reads the device)."""
        return sorted(self.positions[self.slot_ids != self.free[0]].tolist())


def capture_step(run_step) -> "torch.cuda.CUDAGraph":
    """Run ``run_step`` once on a side stream, then record it as a CUDA graph on that same stream without
    running it.  The eager run warms up cuBLAS and any compile; BLAS handles and workspaces are created per
    stream on first use, which must not happen inside a capture (PyTorch's make_graphed_callables captures on
    its warm-up stream for this)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):
        run_step()
    return graph


class StaticInertia:
    """InertiaKV decoding over a static slot cache (attention scorer, all layers eligible).

    ``refresh`` as in :class:`~kvviz.policies.inertia.InertiaKV` (1 every step, r lazy, 0 score-free);
    ``scoring=False`` is the B-slot cache without scoring or an eviction choice -- the speed baseline: its slots
    are kept in position order, so the oldest entry is always in the slot after the newest one and a step
    only moves a ring pointer (a sliding window, the ``recency`` policy's keep sets).  Its slowdown against a
    scoring step is what scoring and eviction cost together.
    ``compile=True`` runs each layer through :func:`compiled_decode_layer`.  ``fuse=True`` (default) runs q/k/v
    and gate/up as one product each (:func:`fused_projections`: the model's projection weights become row
    slices of two matrices per layer, same values, same memory); ``fuse=False`` calls the modules one by one.
    ``value_block``: the value product in blocks of this many slots (:func:`attend`), the slot cache padded to
    a multiple of it; ``None`` (default) is :data:`VALUE_BLOCK` on a GPU and 0 (one product) elsewhere.
    """

    def __init__(self, model, *, alpha: float = 0.8, refresh: int = 1, scoring: bool = True,
                 compile: bool = False, fuse: bool = True, value_block: int | None = None):
        if model.config.model_type not in SUPPORTED:
            raise ValueError(f"the static path reproduces {', '.join(SUPPORTED)} decoder layers, not "
                             f"{model.config.model_type!r}: decode this model with the engine instead")
        if not 0.0 <= alpha <= 1.0 or refresh < 0:
            raise ValueError(f"alpha must be in [0, 1] and refresh >= 0, got alpha={alpha}, refresh={refresh}")
        if value_block is not None and value_block < 0:
            raise ValueError(f"value_block must be 0 (one value product) or a positive slot count, got {value_block}")
        self.model, self.alpha, self.refresh, self.scoring = model, alpha, refresh, scoring
        self.layers = model.model.layers
        self.compiled = compile
        self.layer_step = compiled_decode_layer() if compile else decode_layer
        self.fp32_logits = fp32_logits_supported(model.device, model.dtype)
        self.fuse = fuse
        if value_block is None:
            value_block = VALUE_BLOCK if model.device.type == "cuda" else 0
        self.value_block = value_block
        self.projections()  # stacked now, outside any timing; generate() takes the then current weights

    def projections(self) -> list[tuple | None]:
        """Each layer's :func:`fused_projections` (all ``None`` with ``fuse=False``)."""
        return [fused_projections(layer) if self.fuse else None for layer in self.layers]

    @classmethod
    def from_policy(cls, model, policy, *, compile: bool = False, fuse: bool = True) -> "StaticInertia":
        """The static path for an engine policy, when it is one the static step computes exactly."""
        # The exact class: subclasses (inertia-decoupled) change the update rule the static step hard-codes.
        if type(policy) is not InertiaKV or (policy.scorer, policy.aggregation, policy.layers) != (
                "attention", "ema", "all"):
            settings = ", ".join(f"{key}={value}" for key, value in policy.params().items())
            raise ValueError("the static path runs InertiaKV with its attention scorer, EMA aggregation and all "
                             "layers (inertia, inertia-lazy, score-free, single-step; --alpha and --refresh "
                             f"may change); got {type(policy).__name__}" + (f" ({settings})" if settings else "")
                             + ": use the engine for this policy")
        return cls(model, alpha=policy.alpha, refresh=policy.refresh, compile=compile, fuse=fuse)

    def reference_policy(self):
        """The engine policy this step computes: its keep sets are this step's (the first two steps run it)."""
        return InertiaKV(alpha=self.alpha, refresh=self.refresh) if self.scoring else Recency()

    @torch.inference_mode()
    def generate(self, tokenizer, prompt_ids: list[int], budget: int, max_new_tokens: int,
                 record_kept: bool = False, graph: bool = False, timer=None,
                 stop_ids: set[int] | None = None, shared: engine.Prefill | None = None,
                 on_ready=None) -> StaticRun:
        """Greedy decoding of up to ``max_new_tokens`` tokens under budget ``B`` (``B <= len(prompt_ids) + 1``).

        ``stop_ids``: end after the first of these tokens (it is included).  Checking a token means
        waiting for the device once per step, so benchmarks leave it out and get a fixed length.
        ``shared``: start from a copy of this prompt's prefill (:func:`kvviz.engine.prefill`), as the engine does.
        ``on_ready``: called with no arguments once the B + 1 slots hold the cache and the engine's
        prompt-sized cache is released (a benchmark resets its peak-memory counter there).
        """
        if not 1 <= budget <= len(prompt_ids) + 1:
            raise ValueError(f"the static path starts once the cache is full at step 1, so the budget must be "
                             f"between 1 and the prompt length + 1 ({len(prompt_ids) + 1}), got {budget}: "
                             "lower the budget, or use the engine")
        stop_ids = stop_ids or set()
        projections = self.projections()  # the weights as they are now; a restack's copy before any clock starts
        start = self._start(tokenizer, prompt_ids, budget, max_new_tokens, record_kept, timer, stop_ids, shared)
        if isinstance(start, StaticRun):  # ended within the engine's two steps
            return start
        tokens, kept_log, first_token_time, slots = start
        if on_ready is not None:
            on_ready()
        step = functools.partial(self._step, slots, projections)
        graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        runs: dict[bool, int] = {}  # steps so far of each variant
        setup_steps: list[bool] = []
        captured = graph and self.model.device.type == "cuda"
        clock = StepClock(self.model.device)
        clock.mark()
        for k in range(2, max_new_tokens):
            scoring = self.scoring and ((k - 1) % self.refresh == 0 if self.refresh else False)
            setup_steps.append(self._setup_step(runs, scoring, captured))
            if captured and scoring in graphs:
                graphs[scoring].replay()
            elif captured:  # runs this step once, then records it for the variant's later steps
                graphs[scoring] = capture_step(lambda scoring=scoring: step(scoring))
            else:
                step(scoring)
            clock.mark()
            tokens.append(slots.token.clone())  # stays on the device: converted once at the end
            if record_kept:  # test-only: reading the kept set syncs with the host
                kept_log.append(slots.kept())
            if stop_ids and int(slots.token) in stop_ids:
                break
        tokens = tokens[:2] + [int(t) for t in tokens[2:]]
        return StaticRun(tokens, kept_log, first_token_time, clock.intervals(), setup_steps)

    def _start(self, tokenizer, prompt_ids: list[int], budget: int, max_new_tokens: int, record_kept: bool, timer,
               stop_ids: set[int], shared) -> StaticRun | tuple:
        """Prefill and step 1 through the reference engine (step 1 attends to the whole prompt), then the B + 1
        slots: ``(tokens, kept log, first token's time, slots)``, or the whole run where it ends first.

        The engine's cache has room for the whole prompt (8.6 GB at 64k on Llama-3.1-8B): it is released with
        this call, so that only the slots are live once it returns."""
        model = self.model
        policy = self.reference_policy()
        # The score capture is installed for these two steps only: the static step calls no HF attention,
        # and the caller's model gets its own attention implementation back.
        with installed(model):
            cache = engine.EvictingCache(model, policy, budget=budget, capacity=len(prompt_ids) + 1)
            events = engine.decode(model, tokenizer, prompt_ids, policy, budget=budget, max_new_tokens=2,
                                   ignore_eos=True, cache=cache, shared=shared)
            first = next(events)
            if timer is not None:
                timer()
            first_token_time = time.perf_counter()
            if first.new_token_id in stop_ids:
                return StaticRun([first.new_token_id], [], first_token_time)
            second = next(events)
            tokens = [first.new_token_id, second.new_token_id]
            kept_log = [second.kept.tolist()] if record_kept else []
            if max_new_tokens <= 2 or second.new_token_id in stop_ids:
                return StaticRun(tokens[:max_new_tokens], kept_log, first_token_time)
        slots = self._slots(cache, policy, budget, len(prompt_ids) + 1, tokens[-1])
        events.close()
        return tokens, kept_log, first_token_time, slots

    def _slots(self, cache, policy, budget: int, position: int, token: int) -> "_Slots":
        """The B + 1 slots filled from the engine's ``cache`` after step 1, the next step to consume ``token``
        at ``position``."""
        device = self.model.device
        slots = budget + 1
        # The slot cache is padded to whole value blocks; padding is never written, so it stays zero.
        padded = padded_slots(slots, self.value_block)
        size = cache.size
        live = cache.live_positions()
        # The ring needs the slots in position order, the oldest first (the scoring step takes any order).
        order = live.argsort() if not self.scoring else torch.arange(size, device=live.device)
        keys = [layer.keys[:, :, :size].index_select(2, order.to(layer.keys.device)) for layer in cache.layers]
        values = [layer.values[:, :, :size].index_select(2, order.to(layer.values.device)) for layer in cache.layers]
        keys = [torch.cat([k, k.new_zeros(1, k.shape[1], padded - size, k.shape[3])], 2) for k in keys]
        values = [torch.cat([v, v.new_zeros(1, v.shape[1], padded - size, v.shape[3])], 2) for v in values]
        positions = torch.full((slots,), -1, dtype=torch.long, device=device)
        positions[:size] = live[order].to(device)
        m = torch.zeros(slots, dtype=torch.float32, device=device)
        if self.scoring:
            m[:size] = policy.m[live[order]].to(device)
        free = torch.tensor([size], device=device)  # the empty slot takes the next token
        return _Slots(slots, keys, values, positions, m, free, token=torch.tensor([[token]], device=device),
                      position=torch.tensor([[position]], device=device),
                      slot_ids=torch.arange(slots, device=device))

    def _step(self, s: "_Slots", projections: list, scoring: bool) -> None:
        """One decode step over the slots, in place only: a CUDA graph replays exactly these kernels."""
        model, device, slots = self.model, self.model.device, s.slots
        if self.scoring:
            # A new token enters at 0 on scoring steps, else at the mean of the entries already cached,
            # summed in float64 as the engine does (the mean must not depend on slot order).
            m_enter = torch.zeros((), device=device) if scoring else \
                (torch.where(s.slot_ids == s.free, 0.0, s.m.double()).sum() / (slots - 1)).float()
            s.m.index_fill_(0, s.free, 0.0)
            s.m.index_add_(0, s.free, m_enter.reshape(1))
        s.positions.index_copy_(0, s.free, s.position[0])
        hidden = model.model.embed_tokens(s.token)
        cos, sin = model.model.rotary_emb(hidden, s.position)
        for layer, fused, layer_keys, layer_values in zip(self.layers, projections, s.keys, s.values):
            hidden = self.layer_step(layer, hidden, cos, sin, s.free, layer_keys, layer_values,
                                     s.m if scoring else None, self.alpha, self.fp32_logits, fused, slots,
                                     self.value_block)
        logits = model.lm_head(model.model.norm(hidden))[0, -1]
        s.token.copy_(logits.argmax().reshape(1, 1))
        if self.scoring:
            lowest = torch.where(s.m == s.m.min(), s.positions, LONGEST).argmin()  # ties: the older position goes
            s.free.copy_(lowest.reshape(1))
        else:  # the oldest entry sits in the next slot round
            s.free.copy_((s.free + 1) % slots)
        s.position.add_(1)

    def _setup_step(self, runs: dict[bool, int], scoring: bool, captured: bool) -> bool:
        """Count a step of its variant, and say whether it is setup, not steady-state time: the variant's first
        step when it compiles or captures, and its first replay (graph upload, and the host gap the capture
        left)."""
        count = runs.get(scoring, 0)
        runs[scoring] = count + 1
        return (count == 0 and (self.compiled or captured)) or (count == 1 and captured)
