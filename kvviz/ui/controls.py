"""The settings both run tabs share (cache size, new tokens, chat template, sampling) and the Live tab's policy
parameters: one widget per parameter name, shared by the policies that take it, set to the chosen one's
meaning and range."""

from __future__ import annotations

from dataclasses import dataclass

import gradio as gr

from ..policies import REGISTRY, setting_label, shown_value
from .checks import MAX_TEMPERATURE, PARAM_NAMES, PARAMETERS, _models, policy_from_inputs, unused_parameters
from .config import Limits
from .widgets import TypedSlider


def sampling_label(temperature, top_p) -> str:
    """The Sampling accordion's title: greedy at temperature 0, else the temperature and top-p."""
    try:
        temperature, top_p = float(temperature), float(top_p)
    except (TypeError, ValueError):  # a value being typed: the run's check will say what is wrong
        return "Sampling"
    return ("Sampling (temperature 0: greedy)" if temperature == 0 else
            f"Sampling (temperature {temperature:g}, top-p {top_p:g})")


@dataclass
class RunSettings:
    """Cache size (by compression or absolute budget), max new tokens, chat template and sampling."""

    mode: gr.Radio
    compression: TypedSlider
    budget: gr.Number
    max_new: TypedSlider
    chat: gr.Checkbox
    temperature: TypedSlider
    top_p: TypedSlider
    seed: gr.Number
    sampling: gr.Accordion

    @classmethod
    def layout(cls, limits: Limits, compression: float, max_new_tokens: int) -> "RunSettings":
        mode = gr.Radio(["compression", "budget"], value="compression", label="Cache size by")
        rho = TypedSlider(0.0, 0.99, value=compression, step=0.01, label="Compression ρ: B = ⌊(1−ρ)·L0⌋")
        # precision None: a fraction typed reaches whole_number, which refuses it (precision 0 rounded it silently)
        budget = gr.Number(value=256, label="Budget B (tokens)", visible=False)
        max_new = TypedSlider(1, limits.max_new_tokens, value=min(max_new_tokens, limits.max_new_tokens), step=1,
                              label="Max new tokens")
        chat = gr.Checkbox(value=True, label="Chat template")
        with gr.Accordion(sampling_label(0.0, 0.95), open=False) as sampling:
            temperature = TypedSlider(0.0, MAX_TEMPERATURE, value=0.0, step=0.05,
                                      label="Temperature (AvoKV-E samples at 0.6)")
            top_p = TypedSlider(0.05, 1.0, value=0.95, step=0.01, label="Top-p")
            seed = gr.Number(value=0, label="Seed (the same random stream for every policy)")
        return cls(mode, rho, budget, max_new, chat, temperature, top_p, seed, sampling)

    @property
    def inputs(self) -> list:
        """As the run handlers take them, after the model, the prompt and the policy (or policies)."""
        return [self.mode, self.compression, self.budget, self.max_new, self.chat, self.temperature, self.top_p,
                self.seed]

    def wire(self) -> None:
        # The closed accordion's title says how the run will decode, however the values were set (a preset sets them)
        for control in (self.temperature, self.top_p):
            control.change(lambda t, p: gr.update(label=sampling_label(t, p)), [self.temperature, self.top_p],
                           self.sampling, api_name=False, queue=False, show_progress="hidden")
        for slider, label in ((self.compression, "Compression ρ"), (self.max_new, "Max new tokens"),
                              (self.temperature, "Temperature"), (self.top_p, "Top-p")):
            # queued: an unqueued event cannot show a toast
            slider.release(past_end_note(label, slider.minimum, slider.maximum), slider, None, api_name=False,
                           show_progress="hidden")
        self.mode.change(lambda value: {self.compression: gr.update(visible=value == "compression"),
                                        self.budget: gr.update(visible=value == "budget")},
                         self.mode, [self.compression, self.budget], api_name=False)


def past_end_note(label: str, low: float, high: float):
    """A slider's release handler: a value typed past an end, or a box left empty, is set to that end (the
    lowest, for an empty box) by the browser, and a run then goes ahead with it; say so."""
    def note(value) -> None:
        if value is None:
            gr.Warning(f"{label} was left empty: it was set to {low:g}, its lowest; type the value you want")
        elif isinstance(value, (int, float)) and not low <= value <= high:
            gr.Warning(f"{label} goes from {low:g} to {high:g}: {value:g} was set to {min(max(value, low), high):g}")
    return note


def parameter_past_end_note(name: str):
    """The release handler of a policy parameter's shared slider, whose range is the chosen policy's."""
    def note(policy_name: str, value) -> None:
        spec = REGISTRY.get(policy_name)
        own = {p["name"]: p for p in spec.parameters()} if spec else {}
        if name in own and own[name].get("low") is not None:
            past_end_note(f"{spec.name}'s {name}", own[name]["low"], own[name]["high"])(value)
    return note


def parameter_widget(p: dict):
    label = f"{p['name']}: {p.get('help', '')}"
    if p.get("choices"):
        return gr.Dropdown(list(p["choices"]), value=p["default"], label=label, visible=False)
    if isinstance(p["default"], bool):
        return gr.Checkbox(value=p["default"], label=label, visible=False)
    if p.get("low") is not None:
        step = 1 if isinstance(p["default"], int) else 0.01
        return TypedSlider(p["low"], p["high"], value=p["default"], step=step, label=label, visible=False)
    return gr.Textbox(value=str(p["default"]), label=label, visible=False)


def parameter_update(p: dict, visible: bool = True, value=None):
    """Show a shared widget with this policy's help text, range and ``value`` (its default where None), or
    set it so, hidden."""
    update = {"visible": visible, "value": p["default"] if value is None else value,
              "label": f"{p['name']}: {p.get('help', '')}"}
    if p.get("choices"):
        update["choices"] = list(p["choices"])
    elif p.get("low") is not None and not isinstance(p["default"], bool):
        update.update(minimum=p["low"], maximum=p["high"])
    return gr.update(**update)


def parameter_updates(spec, values: dict | None = None) -> dict:
    """Every shared parameter widget set for ``spec``, by parameter name: its own shown at ``values`` (its
    defaults where absent), less those the values leave unused, and the others hidden."""
    values = values or {}
    own = {p["name"]: p for p in spec.parameters()}
    unused = unused_parameters(spec, values) or {}
    return {name: parameter_update(own[name], visible=name not in unused, value=values.get(name, own[name]["default"]))
            if name in own else gr.update(visible=False) for name in PARAM_NAMES}


def shown_parameters(policy_name: str) -> dict:
    """The parameter widgets as the policy just picked shows them, by name (all hidden for an unknown one)."""
    spec = REGISTRY.get(policy_name)
    return parameter_updates(spec) if spec else {name: gr.update(visible=False) for name in PARAM_NAMES}


def parameters_in_use(policy_name: str, *param_values) -> dict:
    """Hide the parameters that the chosen settings leave unused (cumulative's alpha, a decoupled EMA's last_k
    under the mean of all layers) and show again those that are used, by name.  Values stay as they are: a run
    leaves out the hidden ones (policy_from_inputs), and one shown again holds what it held (single-step's
    alpha 0 after aggregation sum and back to ema)."""
    spec = REGISTRY.get(policy_name)
    unused = unused_parameters(spec, dict(zip(PARAM_NAMES, param_values))) if spec else None
    if unused is None:
        return {name: gr.skip() for name in PARAM_NAMES}
    own = {p["name"] for p in spec.parameters()}
    return {name: gr.update(visible=name not in unused) if name in own else gr.skip() for name in PARAM_NAMES}


def describe(policy_name: str, model_name: str | None = None, *param_values) -> str:
    """The policy's description, with the previous-step weight its current parameters give on the loaded model.

    Parameters that make it another registry entry (InertiaKV with aggregation sum is cumulative, with alpha 0
    single-step) describe that entry, named as the Compare tab would name the setting."""
    spec = REGISTRY.get(policy_name)
    if spec is None:
        return ""
    try:
        policy = policy_from_inputs(policy_name, dict(zip(PARAM_NAMES, param_values))) if param_values \
            else spec.build()
    except ValueError:
        policy = None  # a value being typed; Run reports it
    label = setting_label(policy) if policy is not None else policy_name
    named = REGISTRY.get(label.split()[0], spec)
    description = (f"These settings are **{label}**: " if named is not spec else "") + \
        f"**{named.display}**" + (f" ({named.family})" if named.family != named.display else "") + \
        f". {named.description}" + (f" *{named.paper}*." if named.paper else "")
    if policy is not None:  # the entry's text describes its own values: say which of them these settings change
        params = policy.params()
        changed = [f"`{p['name']}` = **{shown_value(params[p['name']])}**, not {shown_value(p['default'])} "
                   f"({p.get('help', '')})" for p in named.parameters() if params[p["name"]] != p["default"]]
        if changed:
            description += " Changed here: " + "; ".join(changed) + "."
    loaded = _models.get(model_name or "")
    if loaded and policy is not None:  # how much memory across steps this rule keeps on the model in use
        weight = policy.previous_step_weight(loaded[0].config.num_hidden_layers)
        if weight is not None:
            description += f" Previous-step weight on {model_name} with these parameters: **{weight:.3g}**."
    return description


@dataclass
class PolicyControls:
    """The Live tab's policy, its description and the parameter widgets, one per name in PARAM_NAMES."""

    policy: gr.Dropdown
    description: gr.Markdown
    widgets: dict[str, gr.components.Component]

    @classmethod
    def layout(cls, choices: list) -> "PolicyControls":
        policy = gr.Dropdown(choices, value="inertia", label="Policy")
        description = gr.Markdown()
        with gr.Accordion("Policy parameters", open=False):
            widgets = {name: parameter_widget(PARAMETERS[name]) for name in PARAM_NAMES}
        return cls(policy, description, widgets)

    def by_widget(self, updates: dict) -> dict:
        """Updates by parameter name as updates by widget."""
        return {self.widgets[name]: update for name, update in updates.items()}

    def show(self, policy_name: str, model_name: str | None = None) -> dict:
        """A policy picked: its description and its parameters at their defaults, the others' hidden."""
        return {self.description: describe(policy_name, model_name), **self.by_widget(shown_parameters(policy_name))}

    def show_in_use(self, policy_name: str, *param_values) -> dict:
        return self.by_widget(parameters_in_use(policy_name, *param_values))

    def wire(self, model: gr.Dropdown) -> None:
        widgets = list(self.widgets.values())
        # input, not change: a trace's settings set the policy and its parameters together (the change
        # event would then reset the parameters to the policy's defaults)
        self.policy.input(self.show, [self.policy, model], [self.description, *widgets], api_name=False)
        describing = {"fn": describe, "inputs": [self.policy, model, *widgets], "outputs": self.description,
                      "api_name": False}
        for widget in widgets:  # e.g. alpha changes the previous-step weight the description states
            if isinstance(widget, (gr.Dropdown, gr.Checkbox)):  # e.g. aggregation=sum leaves alpha unused
                widget.input(self.show_in_use, [self.policy, *widgets], widgets, api_name=False,
                             trigger_mode="always_last").then(**describing)
            else:
                widget.input(**describing, trigger_mode="always_last")
        for name, widget in self.widgets.items():
            if isinstance(widget, TypedSlider):
                widget.release(parameter_past_end_note(name), [self.policy, widget], None, api_name=False,
                               show_progress="hidden")
        model.change(describe, [self.policy, model, *widgets], self.description, api_name=False)


def policy_choices() -> list[tuple[str, str]]:
    """The policy boxes' choices: each registry entry's display name and, in brackets, its name."""
    return [(f"{s.display} ({s.name})", s.name) for s in REGISTRY.values()]
