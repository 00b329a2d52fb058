"""The Compare tab's comparisons from the papers, ready to run, and its Policies box: what a preset sets
(AvoKV-E's presets their regime too), what a hand edit of the box or of a preset's regime is told."""

from __future__ import annotations

import logging

import gradio as gr

from .. import engine
from ..models import load_tokenizer
from ..policies import build_setting
from ..tasks.examples import EXAMPLES
from .checks import _models, distinct_settings
from .config import Limits

log = logging.getLogger(__name__)

# The comparisons the papers make, ready to run (editable once chosen): settings as the Policies box takes them,
# the reference first (the divergence and Jaccard lines are against it).  AvoKV-E and R-KV check every 16 tokens
# instead of 128, so that the tab's 48 new tokens see several checkpoints (and AvoKV-E's delay matters).
COMPARISONS = {
    "InertiaKV against TOVA (one step of attention) and StreamingLLM (sinks and a window)": ["inertia", "tova",
                                                                                             "streaming"],
    "InertiaKV against lightweight baselines of its Table 4": ["inertia", "tova", "snapkv", "keydiff"],
    "EMA against single-step and cumulative aggregation (InertiaKV §3.1, App. G)": ["inertia", "single-step",
                                                                                     "cumulative"],
    "EMA strength α = 0.8, 0, 0.3, 0.95 (InertiaKV Table 5)": ["inertia", "single-step", "inertia alpha=0.3",
                                                                "inertia alpha=0.95"],
    "Full refresh, Lazy (r = 4) and Score-Free (InertiaKV §3.2)": ["inertia", "inertia-lazy", "score-free"],
    "Scorers under the EMA (InertiaKV §5.1)": ["inertia", "inertia-vnorm", "inertia-entropy", "inertia-knorm"],
    "AvoKV-E without payload, delay or rank normalisation (AvoKV-E Table 4)": [
        "avokv interval=16", "avokv interval=16 lambda_b=0", "avokv interval=16 delay=8",
        "avokv interval=16 normalise=false"],
    # AvoKV-E first: every keep set's Jaccard against the full cache's is only B / (L0 + t), whatever kept it
    "AvoKV-E against R-KV and LazyEviction, its redundancy- and recurrence-based baselines, and the full cache "
    "(AvoKV-E §5)": ["avokv interval=16", "rkv interval=16", "lazyeviction interval=16", "full"],
}
# The presets of AvoKV-E's variants run in its regime, long generation under an active-KV budget that the
# reasoning trace fills (§5.1: sampled at T = 0.6, top-p 0.95).  Chosen, they set B = L0 + REASONING_HEADROOM,
# so that eviction starts once the trace has filled it, REASONING_NEW_TOKENS new tokens (several checkpoints
# after that at interval 16) and the paper's sampling; over an example prompt, the reasoning one.  Left at
# compression 0.75, their first checkpoint cut the prompt, a regime the paper never runs.
REASONING_PRESETS = [name for name in COMPARISONS if name.startswith("AvoKV-E")]
REASONING_HEADROOM, REASONING_NEW_TOKENS = 32, 160
REASONING_SAMPLING = {"temperature": 0.6, "top_p": 0.95}
# The Compare tab's own start, which the other presets (InertiaKV's prompt-compression regime) go back to
# where an AvoKV-E preset had changed it
COMPARE_EXAMPLE, COMPARE_NEW_TOKENS = "Four-key needle", 48


def make_preset_handler(limits: Limits, tab):
    """The handler of the Compare tab's presets box (``tab``: the tab's components, :class:`.compare.CompareTab`)."""
    settings = tab.settings

    def preset_chosen(name: str, model_name: str, prompt: str, chat: bool, mode: str = "compression",
                      new_tokens=None, temperature=None, top_p=None) -> dict:
        """A comparison from the papers chosen: its policies and, for AvoKV-E's, the settings of its regime
        (:data:`REASONING_PRESETS`), with a line saying what was set; the others undo what an AvoKV-E preset
        set (each value still as it left it) and leave the user's own."""
        if name not in COMPARISONS:
            return gr.skip()
        if name not in REASONING_PRESETS:
            return compression_regime(name, prompt, mode, new_tokens, temperature, top_p)
        if prompt in EXAMPLES.values():  # an example, not the user's own text: the reasoning one
            prompt = EXAMPLES["Short reasoning"]
        try:
            loaded = _models.get(model_name)
            tokenizer = loaded[1] if loaded else load_tokenizer(model_name)
            prompt_len = len(engine.encode_prompt(tokenizer, prompt, chat=bool(chat)))
        except Exception as error:  # noqa: BLE001 -- the policies are still set; the rest is said to be left
            log.warning("sizing the %s preset for %s", name, model_name, exc_info=True)
            return {tab.policies: COMPARISONS[name], tab.preset_note: (
                f"*Could not count the prompt's tokens ({type(error).__name__}), so the cache was left as it was: "
                "AvoKV-E's regime is a budget above the prompt.*")}
        budget, new_tokens = prompt_len + REASONING_HEADROOM, min(REASONING_NEW_TOKENS, limits.max_new_tokens)
        note = (f"{REGIME_SET}: budget B = {budget} ({prompt_len}-token prompt + {REASONING_HEADROOM}), "
                f"so eviction starts once generation fills it; {new_tokens} new tokens; sampled at temperature "
                f"{REASONING_SAMPLING['temperature']}, top-p {REASONING_SAMPLING['top_p']}, as the paper does.*")
        return {tab.policies: COMPARISONS[name], tab.prompt: prompt, settings.mode: "budget", settings.budget: budget,
                settings.max_new: new_tokens, settings.temperature: REASONING_SAMPLING["temperature"],
                settings.top_p: REASONING_SAMPLING["top_p"], tab.preset_note: note}

    def compression_regime(name: str, prompt: str, mode: str, new_tokens, temperature, top_p) -> dict:
        sampled = (temperature, top_p) == tuple(REASONING_SAMPLING.values())
        prompt_back = prompt == EXAMPLES["Short reasoning"]
        tokens_back = new_tokens == min(REASONING_NEW_TOKENS, limits.max_new_tokens)
        undone = {"the cache sized by compression ρ": mode != "compression",
                  f"the {COMPARE_EXAMPLE.lower()} prompt": prompt_back,
                  f"{COMPARE_NEW_TOKENS} new tokens": tokens_back, "greedy decoding": sampled}
        said = [what for what, back in undone.items() if back]
        note = f"*Back to the prompt-compression regime InertiaKV runs: {', '.join(said)}, as the tab starts.*" \
            if said else ""
        outputs = {tab.policies: COMPARISONS[name], settings.mode: "compression", tab.preset_note: note}
        if prompt_back:
            outputs[tab.prompt] = EXAMPLES[COMPARE_EXAMPLE]
        if tokens_back:
            outputs[settings.max_new] = COMPARE_NEW_TOKENS
        if sampled:
            outputs[settings.temperature] = 0.0
        return outputs

    return preset_chosen


REGIME_SET = "*Set to AvoKV-E's regime"  # how an AvoKV-E preset's note begins


def preset_regime(note, model_name, prompt, chat, mode, budget, new_tokens, temperature, top_p) -> dict | None:
    """What an AvoKV-E preset just set (the inputs after it, and its note), for :func:`preset_note_after_edit`;
    None after any other preset, which sets no regime to keep."""
    if not isinstance(note, str) or not note.startswith(REGIME_SET):
        return None
    return {"note": note, "set": [model_name, prompt, bool(chat), mode, budget, new_tokens, temperature, top_p]}


def preset_note_after_edit(regime: dict | None, model_name, prompt, chat, mode, budget, new_tokens, temperature,
                           top_p):
    """An input changed by hand after an AvoKV-E preset set its regime (``regime``: :func:`preset_regime`): its
    note says what no longer holds, against what the preset set, and how to get it back; with every input
    back as the preset left it, the preset's own note.  Nothing after any other preset."""
    if not regime:
        return gr.skip()
    set_model, set_prompt, set_chat, _, set_budget, set_tokens, set_temperature, set_top_p = regime["set"]
    changed = []
    if (model_name, prompt, bool(chat)) != (set_model, set_prompt, set_chat):
        # a longer prompt over B is the regime the preset left
        changed.append("the prompt's tokens (its text, the model or the chat template), which B was sized to: "
                       "keep B above them (counted under the prompt)")
    if mode != "budget":
        changed.append("the cache is sized by ρ, a share of the prompt, not by a budget above it")
    elif budget != set_budget:
        changed.append(f"B = {budget} (the preset's {set_budget})")
    if new_tokens != set_tokens:
        changed.append(f"{new_tokens} new tokens (the preset's {set_tokens})")
    if (temperature, top_p) != (set_temperature, set_top_p):
        changed.append(f"temperature {temperature}, top-p {top_p} (the paper's {set_temperature}, {set_top_p})")
    if not changed:
        return regime["note"]
    return (f"*Changed by hand since the AvoKV-E preset set its regime: {'; '.join(changed)}. Choose the preset "
            "again to set it back.*")


def repeats_note(entries) -> str:
    """What :func:`policy_settings` dropped as a repeat, for the page (markdown): a chip that stays in the box
    but gets no panel would otherwise pass for a lost policy.  Empty when nothing repeats (or the entries are
    not a list of settings, which the check refuses)."""
    try:
        if isinstance(entries, str):
            entries = [entries]
        _, repeats = distinct_settings(entries or [])
    except (TypeError, ValueError):
        return ""
    parts = []
    for entry, first, label in repeats:
        entry, first = entry.strip(), first.strip()
        if entry == first:
            parts.append(f"`{entry}` is given twice")
        elif first == label:
            # a label with no changes is the registry entry itself, at its defaults
            parts.append(f"`{entry}` is `{label}`" + ("" if " " in label else " (its defaults)"))
        else:
            parts.append(f"`{entry}` and `{first}` are one setting, `{label}`")
    return f"*Run once: {'; '.join(parts)}.*" if parts else ""


def policies_edited(preset: str, entries, seen=None) -> tuple:
    """The Policies box edited by hand: a typed entry the registry refuses is said at once, in a toast, not
    at the next Compare (the newest entry only: it is appended last, and the older ones were said when they
    came); and the preset box empties once the list is no longer that preset's, which it went on naming.

    ``seen`` is the list this last ran on: the page sends the box's change twice for one entry (as it is added
    and as the box loses focus), which said the refusal twice.  Returns the preset box and the new ``seen``."""
    entries = list(entries or [])
    if entries == seen:
        return gr.skip(), gr.skip()
    if entries:
        try:
            build_setting(entries[-1])
        except ValueError as error:
            gr.Warning(f"{error} (in the Policies box: change or remove it)")
    return (gr.update(value=None) if COMPARISONS.get(preset) != entries else gr.skip()), entries


# The box takes no fifth chip and ignores a fifth typed entry without a word (Gradio's max_choices): a line
# under it says so once it is full.  (Not its label: updating the box from its own change event makes the page
# send the change again.)
POLICIES_FULL = "*Four chosen, the most a comparison shows: remove one (its ×) to pick or type another.*"


def policies_full_note(entries) -> dict:
    """The line under the Policies box: shown once it holds four ``entries``, why a fifth will not go in."""
    full = len(entries or []) >= 4
    return gr.update(value=POLICIES_FULL if full else "", visible=full)
