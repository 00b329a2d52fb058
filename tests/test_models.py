"""Which models kvviz accepts, and what each policy or path refuses on the families it cannot serve exactly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

import kvviz
from kvviz.fast import StaticInertia
from kvviz.models import ModelNotFound, check_supported, tiny_model
from kvviz.scoring import rope_frequencies

# Every test here loads models through transformers' own loaders and configs.
pytestmark = pytest.mark.transformers_api


def test_every_family_loads_by_its_tiny_name_with_the_capture_installed():
    for family in kvviz.models.SUPPORTED_TYPES:
        model, _ = kvviz.load_model(f"tiny-random-{family}")
        assert model.config.model_type == family
        assert model.config._attn_implementation == kvviz.scoring.ATTN_IMPLEMENTATION
    moe, _ = kvviz.load_model("tiny-random-qwen3_moe")
    assert type(moe.model.layers[0].mlp).__name__ == "Qwen3MoeSparseMoeBlock"  # experts, not a dense MLP


def test_an_unsupported_family_is_refused_with_the_families_that_are():
    with pytest.raises(ModelNotFound, match="'gpt2' model; kvviz supports Llama \\(llama\\), Qwen2/2.5 \\(qwen2\\)"
                                            ".*Gemma \\(gemma\\)"):
        check_supported(AutoConfig.for_model("gpt2"), "gpt2")
    with pytest.raises(ModelNotFound, match="no tiny model 'tiny-random-gpt2'; "
                                            "choose tiny-random-<family> with a family of llama"):
        kvviz.load_model("tiny-random-gpt2")


def test_models_with_sliding_window_layers_are_refused():
    with pytest.raises(ModelNotFound, match="sliding-window attention \\(64\\)"):
        check_supported(AutoConfig.for_model("mistral", sliding_window=64), "m")
    # A window longer than the model's context passes the first rule; the layer types still say sliding.
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=1 << 20, max_window_layers=1,
                                  num_hidden_layers=3)
    assert "sliding_attention" in config.layer_types
    with pytest.raises(ModelNotFound, match="sliding_attention layers"):
        check_supported(config, "q")
    check_supported(AutoConfig.for_model("qwen2", use_sliding_window=False, num_hidden_layers=3), "q")


LONGROPE = dict(rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                 "long_factor": [4.0] * 8}, original_max_position_embeddings=64,
                max_position_embeddings=256)  # Phi-3-128k's scheme, its switch moved to position 64


def forward_counter(model) -> list:
    """A list that grows by one at every forward pass of ``model``."""
    calls: list = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize("overrides, family", [
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "llama"),
    (dict(partial_rotary_factor=0.5), "phi3"),  # Phi-4-mini's layout: RoPE over part of each head
    (LONGROPE, "phi3"),
])
def test_expected_attention_refuses_rope_it_cannot_rotate_back_before_any_forward(overrides, family, tiny_prompt):
    from kvviz.probe import probe

    model, tokenizer = tiny_model(family, **overrides)
    kvviz.scoring.install(model)
    assert rope_frequencies(model) is None
    kvviz.run(model, tokenizer, tiny_prompt[:40], "inertia", budget=30, max_new_tokens=3)  # the rest still runs
    calls = forward_counter(model)
    for name in ("expected-attention", "expected-attention-decode"):
        with pytest.raises(ValueError, match="fixed frequencies.*choose another policy"):
            kvviz.run(model, tokenizer, tiny_prompt[:40], name, budget=30, max_new_tokens=3)
        with pytest.raises(ValueError, match="fixed frequencies"):  # not after the probe's own decoding
            probe(model, tokenizer, tiny_prompt[:40], 2, policies={"ea": kvviz.make_policy(name)}, sample=4)
    assert calls == []


def test_kvzip_refuses_a_repeat_pass_past_the_positions_its_cache_was_rotated_for(tiny_prompt):
    """KVzip's repeat pass runs past the prompt by the chunk it repeats: beyond LongRoPE's switch (or the
    context) transformers would rotate its queries otherwise than the cached keys, and score nonsense."""
    longrope, tokenizer = tiny_model("phi3", **LONGROPE)
    kvviz.scoring.install(longrope)
    prompt = tiny_prompt[:40]  # prompt + new tokens fit under the switch; prompt + its repeat does not
    reach = len(prompt) + max(len(ids) for *_, ids in kvviz.engine.repeat_passes(tokenizer, prompt))
    assert len(prompt) + 3 <= 64 < reach
    calls = forward_counter(longrope)
    with pytest.raises(ValueError, match=f"runs to position {reach - 1}, beyond LongRoPE's original length of 64, "
                                         "past which transformers rotates every position otherwise"
                                         ".*shorten the prompt"):
        kvviz.run(longrope, tokenizer, prompt, "kvzip", budget=30, max_new_tokens=3)
    assert calls == []
    short, _ = tiny_model("llama", max_position_embeddings=reach - 1)  # the same reach past a plain context
    kvviz.scoring.install(short)
    with pytest.raises(ValueError, match=f"beyond the model's context of {reach - 1}; shorten the prompt"):
        kvviz.run(short, tokenizer, prompt, "kvzip", budget=30, max_new_tokens=3)
    fits, _ = tiny_model("llama", max_position_embeddings=reach)
    kvviz.scoring.install(fits)
    assert kvviz.run(fits, tokenizer, prompt, "kvzip", budget=30, max_new_tokens=3).trace.events[0].kept.size == 30


def test_fixed_frequency_rope_is_described_on_every_family():
    for family in kvviz.models.SUPPORTED_TYPES:
        model, _ = kvviz.load_model(f"tiny-random-{family}")
        rope = rope_frequencies(model)
        assert rope is not None and 2 * rope.numel() == model.config.head_dim
        theta = model.config.rope_parameters["rope_theta"]  # 1e6 for Mixtral, 1e4 for the others
        torch.testing.assert_close(rope[1] / rope[0], torch.tensor(theta ** (-2 / model.config.head_dim)))


@pytest.mark.parametrize("family", ["qwen3_moe", "phi3", "gemma"])
def test_the_static_path_refuses_layouts_its_step_does_not_reproduce(family):
    model, _ = kvviz.load_model(f"tiny-random-{family}")
    with pytest.raises(ValueError, match=f"not '{family}': decode this model with the engine"):
        StaticInertia(model)


def test_a_half_precision_model_is_the_one_transformers_loads(tmp_path):
    """Loaded in bfloat16, the model must compute what transformers' own bfloat16 load computes: a cast after
    loading would round RoPE's float32 inverse frequencies too, and the angles would drift with position."""
    from transformers import AutoModelForCausalLM

    model, tokenizer = tiny_model("llama", max_position_embeddings=8192)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ours, _ = kvviz.load_model(str(tmp_path), dtype="bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16, attn_implementation="sdpa")
    assert ours.dtype == torch.bfloat16 and ours.model.rotary_emb.inv_freq.dtype == torch.float32
    assert kvviz.load_model("tiny-random-llama", dtype="bfloat16")[0].model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(3, 320, (1, 3000), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(ours(input_ids=ids).logits, theirs(input_ids=ids).logits)


def test_a_refused_family_is_refused_from_its_config_before_any_weight_loads(tmp_path, monkeypatch):
    import transformers

    AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2, vocab_size=16).save_pretrained(tmp_path)

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded for a model that is refused")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ModelNotFound, match="'gpt2' model"):
        kvviz.load_model(str(tmp_path))


def test_an_unknown_dtype_or_a_missing_folder_is_named():
    with pytest.raises(ValueError, match="unknown dtype 'fp8': use one of float32, bfloat16, float16"):
        kvviz.load_model("tiny-random-llama", dtype="fp8")
    with pytest.raises(ValueError, match="no folder './no/such/model'"):
        kvviz.load_model("./no/such/model")


def test_a_hub_id_with_the_hub_unreachable_fails_at_once_or_loads_from_the_cache(tmp_path, monkeypatch):
    """huggingface_hub retries a connection that fails five times (half a minute) for every file: one request
    without retries asks first.  No answer: a model not in the hub's cache is refused at once, saying what to
    do, and one in it loads from it alone; an answer (even "no such model") is left to transformers."""
    import huggingface_hub
    import transformers
    from huggingface_hub.errors import RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # online as far as kvviz can tell, but no network

    def no_network(url, **kwargs):
        assert url.endswith("/someone/model/resolve/main/config.json")
        raise ConnectionError("[Errno -2] Name or service not known")  # what httpx's ConnectError says

    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_network)
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: None)
    asked = []
    originals = {auto: getattr(transformers, auto).from_pretrained
                 for auto in ("AutoConfig", "AutoTokenizer", "AutoModelForCausalLM")}
    model, tokenizer = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    for auto, original in originals.items():  # the hub's cache, as the saved tiny model
        def load(source, *args, _original=original, _auto=auto, **kwargs):
            if source != tmp_path:  # not transformers' own calls with the folder below
                asked.append((_auto, source, kwargs.get("local_files_only", False)))
            return _original(tmp_path, *args, **{k: v for k, v in kwargs.items() if k != "local_files_only"})
        monkeypatch.setattr(getattr(transformers, auto), "from_pretrained", load)

    for load_it in (kvviz.load_model, kvviz.models.load_tokenizer):
        with pytest.raises(ModelNotFound, match=r"^cannot reach the Hugging Face hub for 'someone/model' "
                                                r"\(ConnectionError: \[Errno -2\] Name or service not known\) and it "
                                                r"is not in the local cache: pass a local folder"):
            load_it("someone/model")
    assert asked == []  # transformers, and its retries, were never reached
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: "/cache/config.json")
    assert kvviz.load_model("someone/model")[0].config.model_type == "llama"
    assert asked == [("AutoConfig", "someone/model", True), ("AutoTokenizer", "someone/model", True),
                     ("AutoModelForCausalLM", "someone/model", True)]

    class NoSuchModel(RepositoryNotFoundError):  # without the HTTP response the real one is built from
        def __init__(self):
            Exception.__init__(self, "401 Client Error: Repository Not Found")

    def no_such_model(url, **kwargs):
        raise NoSuchModel()

    asked.clear()
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", no_such_model)
    kvviz.models.load_tokenizer("someone/model")  # the hub answered: transformers asks it, as before
    assert asked == [("AutoTokenizer", "someone/model", False)]
