"""The Gradio Blocks app: a Live tab that streams text next to the retention and utility-rank heatmaps.

It consumes the engine's step events and nothing else; validation happens before any work starts and
every error reaches the user as a message, never as a traceback.
"""

from __future__ import annotations

import gc
import os
import threading
import time

import gradio as gr

from .. import engine
from ..models import DEFAULT_MODEL, load_model
from ..policies import REGISTRY
from . import figures

EXAMPLES = [
    ["The passkey is 7342519. Remember it. " + "The grass is green. The sky is blue. The sun is bright. " * 60
     + "What is the passkey?", "inertia", 0.9, 32],
    ["Write a long story about a lighthouse keeper who finds a message in a bottle.", "inertia-lazy", 0.5, 128],
    ["If Anna has 3 apples and buys 5 more, then gives 2 away, how many does she have? Think step by step.",
     "score-free", 0.5, 96],
]
UPDATE_EVERY_S = 0.2  # figures refresh at most 5 times a second; text on every token

_models: dict[str, tuple] = {}
_model_lock = threading.Lock()


def get_model(name: str):
    with _model_lock:
        if name not in _models:
            _models[name] = load_model(name)
        return _models[name]


def allowed_models() -> list[str]:
    extra = [m.strip() for m in os.environ.get("KVVIZ_MODELS", "").split(",") if m.strip()]
    return [os.environ.get("KVVIZ_DEFAULT_MODEL", DEFAULT_MODEL), *extra]


def max_prompt_tokens() -> int:
    return int(os.environ.get("KVVIZ_MAX_PROMPT_TOKENS", "4096"))


def live_run(prompt, model_name, policy, compression, max_new_tokens, chat):
    """Generator behind the Run button: yields (text, retention fig, rank fig, stats markdown)."""
    try:
        if model_name not in allowed_models():
            raise ValueError(f"model {model_name!r} is not allowed here; choose one of {allowed_models()}")
        model, tokenizer = get_model(model_name)
        prompt_ids = engine.encode_prompt(tokenizer, prompt or "", chat=chat)
        if len(prompt_ids) > max_prompt_tokens():
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the limit here is {max_prompt_tokens()}")
        engine.check_prompt(model, prompt_ids, int(max_new_tokens))
        budget = engine.resolve_budget(len(prompt_ids), compression=None if policy == "full" else compression)
        policy_obj = REGISTRY[policy].build()
    except (ValueError, KeyError) as error:
        raise gr.Error(str(error)) from None

    events, text, last = [], "", 0.0
    start = time.perf_counter()
    try:
        for event in engine.decode(model, tokenizer, prompt_ids, policy_obj, budget=budget,
                                   max_new_tokens=int(max_new_tokens)):
            events.append(event)
            text += event.text
            now = time.perf_counter()
            if now - last >= UPDATE_EVERY_S:
                last = now
                yield text, *_figures(events, len(prompt_ids), budget), _stats(events, len(prompt_ids), budget, now - start)
            else:
                yield text, gr.skip(), gr.skip(), gr.skip()
        yield text, *_figures(events, len(prompt_ids), budget), _stats(events, len(prompt_ids), budget,
                                                                       time.perf_counter() - start)
    except Exception as error:  # a failed run reports and frees; the server keeps serving
        raise gr.Error(f"generation failed: {error}") from None
    finally:
        del events
        gc.collect()


def _figures(events, prompt_len, budget):
    return figures.retention_figure(events, prompt_len, budget), figures.rank_figure(events, prompt_len)


def _stats(events, prompt_len, budget, elapsed):
    last = events[-1]
    steps = [e for e in events if e.step >= 1]
    forward = sum(e.t_forward for e in steps)
    score = sum(e.t_score for e in steps)
    evict = sum(e.t_evict for e in steps)
    total = forward + score + evict or 1e-9
    return (f"**prompt** {prompt_len} tokens · **budget** {budget} · **cache now** {last.cache_size} "
            f"({last.cache_bytes / 2**20:.1f} MiB) · **evicted this step** {last.evicted.size} · "
            f"**decode** {len(steps) / total if steps else 0:.1f} tok/s · **time split** forward "
            f"{forward / total:.0%} / scoring {score / total:.0%} / eviction {evict / total:.0%} · "
            f"{elapsed:.1f} s")


def build_app() -> gr.Blocks:
    with gr.Blocks(title="kvviz") as app:
        gr.Markdown("# kvviz\nWatch what a KV-cache eviction policy keeps and drops while the model decodes.")
        with gr.Tab("Live"):
            with gr.Row():
                with gr.Column(scale=1):
                    prompt = gr.Textbox(label="Prompt", lines=8)
                    model = gr.Dropdown(allowed_models(), value=allowed_models()[0], label="Model")
                    policy = gr.Dropdown([(f"{s.display} ({s.name})", s.name) for s in REGISTRY.values()],
                                         value="inertia", label="Policy")
                    compression = gr.Slider(0.0, 0.99, value=0.9, step=0.01, label="Compression ρ (B = ⌊(1−ρ)·L0⌋)")
                    max_new = gr.Slider(1, 512, value=64, step=1, label="Max new tokens")
                    chat = gr.Checkbox(value=True, label="Chat template")
                    with gr.Row():
                        run = gr.Button("Run", variant="primary")
                        stop = gr.Button("Stop")
                    gr.Examples(EXAMPLES, [prompt, policy, compression, max_new])
                with gr.Column(scale=2):
                    text = gr.Textbox(label="Generated text", lines=6)
                    stats = gr.Markdown()
                    retention = gr.Plot(label="Retention")
                    ranks = gr.Plot(label="Utility rank")
            event = run.click(live_run, [prompt, model, policy, compression, max_new, chat],
                              [text, retention, ranks, stats], concurrency_limit=1, concurrency_id="model")
            stop.click(None, cancels=[event])
        with gr.Tab("Compare"):
            gr.Markdown("Side-by-side comparison of policies on one prompt is not built yet.")
        with gr.Tab("Results"):
            gr.Markdown("The results store (benchmark sweeps) is not built yet; no data is shown here.")
    return app


def launch() -> None:
    app = build_app()
    app.queue(default_concurrency_limit=1, max_size=int(os.environ.get("KVVIZ_QUEUE_SIZE", "16")))
    app.launch(server_name=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
               server_port=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
