"""The Compare tab's analyses run on their own button, on the tab's model, prompt and policies: the oracle
damage probe (each policy's utility ranked against the damage of removing each entry, and AvoKV-E's
attention-only blindspot) and the scorer spectrum (InertiaKV §5.1: how far each scorer ranks the cache from
last-query attention).  Each is checked first, so that a refusal leaves the last result as it was."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import gradio as gr
import numpy as np
import pandas as pd

from .checks import build_policies, model_and_prompt, policy_settings, refusing, release_memory, whole_number
from .common import Staleness, fit_columns
from .config import Limits
from .figures import blindspot_figure, spectrum_figure, spectrum_layers_figure

log = logging.getLogger(__name__)

# The probe table's headers in words, which wrap: "average_precision" held its column wide, and the table's
# last columns were cut at a 1000-px window
SPECTRUM_HEADERS = {"layer_spearman": "Spearman at the layer", "layer_jaccard": "top-B Jaccard at the layer",
                    "utility_spearman": "Spearman through the EMA", "utility_jaccard": "top-B Jaccard through the EMA"}
PROBE_HEADERS = {"auroc": "AUROC", "auroc_p": "AUROC p", "average_precision": "average precision",
                 "topk_recall": "top-k recall", "false_safe_rate": "false-safe rate", "spearman": "Spearman"}


def make_spectrum_check(limits: Limits):
    """The spectrum's inputs checked before it runs, with no outputs: a refusal is the toast alone, and the last
    spectrum stays on screen unmarked (raised by the run itself, it would mark every output "Error")."""
    from ..spectrum import check_layer

    def check_spectrum(model_name, prompt, chat, steps, layer):
        with refusing("checking the spectrum's inputs"):
            whole_number("the steps compared", steps, 1, 64)
            layer = (None if layer is None or not str(layer).strip()
                     else whole_number("the layer", str(layer).strip(), 0))
            model, _, _ = model_and_prompt(limits, model_name, prompt, chat)
            check_layer(model, layer)
    return check_spectrum


def probe_step(limits: Limits, step) -> int:
    """The probe's step, checked: it decodes that many tokens before probing, so no more than a run may
    decode here (the probe has no Stop, and every run of the model waits behind it)."""
    step = whole_number("the probe step", step, 1)
    if step > limits.max_new_tokens:
        raise ValueError(f"the probe step is {step}: the probe decodes that many tokens first, and this server "
                         f"decodes at most {limits.max_new_tokens} (its max new tokens); choose a step up to "
                         f"{limits.max_new_tokens}")
    return step


# Entries the app's probe replays at most, each a decode of 8 tokens (0.6 s on SmolLM2-135M on 2 CPU cores):
# the probe has no Stop and holds the model, and "all" of a 4k-token cache held it for an hour and a half.
MAX_PROBE_SAMPLE = 256
SAMPLE_NAME = f"entries sampled (1-{MAX_PROBE_SAMPLE})"


def probe_sample(sample) -> int:
    """The probe's sample of entries, checked (``kvviz probe`` replays any number, all by default)."""
    sample = whole_number(SAMPLE_NAME, sample, 1)
    if sample > MAX_PROBE_SAMPLE:
        raise ValueError(f"{SAMPLE_NAME} is {sample}: each entry costs a decode of 8 tokens while the probe holds the "
                         f"model, so this app samples at most {MAX_PROBE_SAMPLE}; for more, or all of them, run "
                         "`kvviz probe --sample N` (or without --sample)")
    return sample


def make_probe_check(limits: Limits):
    """The probe's inputs checked before it runs, as :func:`make_spectrum_check` does for the spectrum."""
    from ..probe import check_fits

    def check_probe(model_name, prompt, names, chat, step, sample):
        with refusing("checking the probe's inputs"):
            policy_settings(names, 1, "rank")
            step = probe_step(limits, step)  # the typed numbers before a model load that can take minutes
            probe_sample(sample)
            model, _, prompt_ids = model_and_prompt(limits, model_name, prompt, chat)
            check_fits(model, prompt_ids, step, 8)
    return check_probe


def make_spectrum_handler(limits: Limits):
    def run_spectrum(model_name, prompt, chat, steps, layer):
        from ..spectrum import spectrum

        try:
            with refusing("the scorer spectrum"):
                steps = whole_number("the steps compared", steps, 1, 64)
                layer = None if layer is None or not str(layer).strip() else whole_number("the layer",
                                                                                          str(layer).strip(), 0)
                model, _, prompt_ids = model_and_prompt(limits, model_name, prompt, chat)
                result = spectrum(model, prompt_ids, steps=steps, layer=layer)
        finally:
            release_memory()
        rows = pd.DataFrame([{key: round(value, 3) if isinstance(value, float) else value for key, value in row.items()}
                             for row in result.table()]).rename(columns=SPECTRUM_HEADERS)
        cross = result.cross_layer_summary()
        note = (f"Steps 1–{result.steps[-1]} of the full-cache greedy run ({result.cache_sizes[-1]} entries at the "
                f"end), top-B at 10%; layer {result.layer} of 0-{result.num_layers - 1}. Attention's own agreement "
                f"between layers: top-B Jaccard {cross['cross_layer_jaccard']:.3f} (sd over layer pairs "
                f"{cross['cross_layer_jaccard_std']:.3f}); layer {result.layer}'s top-B churn between steps "
                + ("n/a (one step has none to compare with)." if np.isnan(cross["layer_churn"])
                   else f"{cross['layer_churn']:.3f}."))
        return rows, note, spectrum_figure(result), spectrum_layers_figure(result)

    return run_spectrum


def make_probe_handler(limits: Limits):
    def run_probe(model_name, prompt, names, chat, step, sample):
        from ..probe import aligned_quality, blindspot_at, check_fits, probe, protection_note, tied_rankings, top_decile

        try:
            with refusing("the probe"):
                settings = policy_settings(names, 1, "rank")  # each costs a decode of its own
                names = list(settings)
                model, tokenizer, prompt_ids = model_and_prompt(limits, model_name, prompt, chat)
                step = probe_step(limits, step)
                sample = probe_sample(sample)
                check_fits(model, prompt_ids, step, 8)
                policies = build_policies(settings)
                result = probe(model, tokenizer, prompt_ids, step, policies=policies, sample=sample, future=8)
                protected = protection_note(policies, len(prompt_ids), step)
                quality, aligned = aligned_quality(result.utilities, result.damage) if result.utilities else ({}, None)
                # p-values to 2 significant digits: rounded to 4 decimals, 3e-7 read as 0
                rows = pd.DataFrame([{"policy": n, **{k: float(f"{v:.2g}") if k == "auroc_p" else round(v, 4)
                                                      for k, v in q.items()}} for n, q in quality.items()])
                rows = rows.rename(columns=PROBE_HEADERS)
                try:
                    spot, spot_note = blindspot_at(model, tokenizer, prompt_ids, result)
                except Exception as error:  # the ranking above stands; only the blindspot is lost
                    log.exception("blindspot failed")
                    spot, spot_note = None, f"it failed ({type(error).__name__})"
        finally:
            release_memory()
        missing = sorted(set(names) - set(result.utilities))
        # Below chance reads as a bug; it is a ranking that keeps the harmless entries and drops the damaging
        # ones (AvoKV-E on SmolLM2, whose 0.9-weighted key redundancy marks a needle's digits as replaceable)
        inverted = [name for name, q in quality.items() if q.get("auroc", 0.5) < 0.5]
        below = [name for name in inverted if quality[name].get("auroc_p", 0.0) < 0.05]  # not chance either
        within = [name for name in inverted if name not in below]
        ranked = int(aligned.sum()) if aligned is not None else len(result.damage)
        high_damage = int(top_decile(result.damage[aligned] if aligned is not None else result.damage).sum())
        tied = [f"{name} ({share:.0%})" for name, share in tied_rankings(
            {name: result.utilities[name] for name in quality}, aligned).items()]
        note = (f"{len(result.candidates)} entries probed at step {step} ({result.candidates_per_second:.0f}/s); "
                "damage = mean KL over the next 8 tokens."
                + (f" No per-entry utility: {', '.join(missing)}." if missing else "")
                + (f" Ranked over the {int(aligned.sum())} entries every policy judged ({int((~aligned).sum())} left"
                   " out: a protected tail, sinks or a window some policy never judges)."
                   if aligned is not None and not aligned.all() else "")
                + (f" {protected[0].upper()}{protected[1:]}." if protected else "")
                + (f" AUROC below 0.5 ({auroc_list(quality, below)}): worse than chance, that ranking puts the "
                   "entries whose removal hurt most among the least useful." if below else "")
                + (f" AUROC below 0.5 ({auroc_list(quality, within)}), but with this few high-damage entries not "
                   "distinguishable from chance (Mann-Whitney p >= 0.05)." if within else "")
                + (f" Mostly one tied score: {', '.join(tied)} of the ranked entries share it, so that AUROC "
                   "comes largely from ties' half credit (its p-value counts the ties)." if tied else "")
                + f" Blindspot: {spot_note}."
                + (f"\n\n*The columns: high damage is the top decile (k = {high_damage} of {ranked} entries); AUROC "
                   "and average precision rank it by each policy's utility; AUROC p: against chance (0.5), two-sided "
                   "Mann-Whitney, exact, counting ties; top-k recall: the share of the k in a policy's k highest "
                   "utilities; false-safe rate: the share in its k lowest, the first it would evict; Spearman: "
                   "utility against damage over all of them.*" if quality else ""))
        return rows, note, gr.update(value=blindspot_figure(spot) if spot else None, visible=spot is not None)

    return run_probe


def auroc_list(quality: dict[str, dict], names: list[str]) -> str:
    """``"tova 0.24, p = 0.012"`` for each of ``names``: the probe's AUROC and its p-value against chance."""
    return "; ".join(f"{name} {quality[name]['auroc']:.2f}, p = {quality[name].get('auroc_p', float('nan')):.3f}"
                     for name in names)


PROBE_LABEL = "Ranking quality (AUROC / AP vs top-decile damage)"
BLINDSPOT_LABEL = "Attention-only blindspot (AvoKV-E Fig. 1a)"
SPECTRUM_LABEL, SPECTRUM_LAYERS_LABEL, SPECTRUM_TABLE_LABEL = "Scorer spectrum", "By layer", "Mean over steps"


@dataclass
class AnalysesPanel:
    """The Compare tab's two accordions: the oracle damage probe and the scorer spectrum."""

    p_step: gr.Number
    p_sample: gr.Number
    p_run: gr.Button
    p_table: gr.Dataframe
    p_note: gr.Markdown
    p_blindspot: gr.Plot
    p_state: gr.State  # the inputs the probe last ran on, and its note (Staleness)
    s_steps: gr.Number
    s_layer: gr.Textbox
    s_run: gr.Button
    s_figure: gr.Plot
    s_layers: gr.Plot
    s_table: gr.Dataframe
    s_note: gr.Markdown
    s_state: gr.State

    @classmethod
    def layout(cls) -> "AnalysesPanel":
        with gr.Accordion("Oracle damage probe", open=False):
            gr.Markdown("Removes one cache entry at a time at the chosen step, replays the next 8 tokens "
                        "of the full-cache continuation, and ranks each policy's utility against the damage. "
                        "Below: AvoKV-E's blindspot test, the share of high-damage entries (top decile) "
                        "by AvoKV-E's read-pressure and payload ranks at that step; the outlined cell holds "
                        "the rarely read entries with large values that attention alone would evict.")
            with gr.Row():
                p_step = gr.Number(value=8, label="Step")
                p_sample = gr.Number(value=128, label=f"Entries sampled (1-{MAX_PROBE_SAMPLE})")
                p_run = gr.Button("Run probe")
            p_table = gr.Dataframe(label=PROBE_LABEL, interactive=False, wrap=True)
            p_note = gr.Markdown()
            # AvoKV-E Fig. 1(a): is removing a rarely read entry with a large value damaging?
            p_blindspot = gr.Plot(label=BLINDSPOT_LABEL, visible=False)
        with gr.Accordion("Scorer spectrum (InertiaKV §5.1)", open=False):
            gr.Markdown("How far each scorer's ranking of the cache sits from last-query attention: "
                        "Spearman and top-B Jaccard (B = 10% of the cache) at one layer, and through "
                        "InertiaKV's EMA over layers, on the full-cache greedy run of this prompt. "
                        "Scorers close to attention (value-norm, entropy weighting) keep quality in the "
                        "paper; those far from it (key norm, recency) fail on retrieval.")
            with gr.Row():
                s_steps = gr.Number(value=8, label="Steps")
                # a Textbox: a Number widget cannot stay empty in the browser (it shows and sends 0)
                s_layer = gr.Textbox(value="", label="Layer (empty: the middle one)", placeholder="middle")
                s_run = gr.Button("Run spectrum")
            s_figure = gr.Plot(label=SPECTRUM_LABEL)
            s_layers = gr.Plot(label=SPECTRUM_LAYERS_LABEL)
            s_table = gr.Dataframe(label=SPECTRUM_TABLE_LABEL, interactive=False, wrap=True)
            s_note = gr.Markdown()
        return cls(p_step, p_sample, p_run, p_table, p_note, p_blindspot, gr.State(None), s_steps, s_layer, s_run,
                   s_figure, s_layers, s_table, s_note, gr.State(None))

    def wire(self, limits: Limits, model, prompt, policies, chat, compared) -> None:
        """Each runs on its own button over the Compare tab's ``model``, ``prompt``, ``policies`` and ``chat``;
        a new prompt, policy list or comparison (``compared``: its passed check) marks its last result."""
        probe_staleness = Staleness("probe", ["model", "prompt", "policies", "chat template", "step",
                                              "entries sampled"], self.p_note,
                                    {self.p_table: PROBE_LABEL, self.p_blindspot: BLINDSPOT_LABEL})
        spectrum_staleness = Staleness("spectrum", ["model", "prompt", "chat template", "steps", "layer"], self.s_note,
                                       {self.s_figure: SPECTRUM_LABEL, self.s_layers: SPECTRUM_LAYERS_LABEL,
                                        self.s_table: SPECTRUM_TABLE_LABEL})
        # Each is checked first (no outputs), so that a refusal leaves the last result unmarked.
        probe_inputs = [model, prompt, policies, chat, self.p_step, self.p_sample]
        self.p_run.click(make_probe_check(limits), probe_inputs, None, api_name=False, concurrency_limit=None).success(
            make_probe_handler(limits), probe_inputs, [self.p_table, self.p_note, self.p_blindspot],
            concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name="probe"
        ).success(probe_staleness.remember, [*probe_inputs, self.p_note], self.p_state, api_name=False, queue=False)
        spectrum_inputs = [model, prompt, chat, self.s_steps, self.s_layer]
        self.s_run.click(make_spectrum_check(limits), spectrum_inputs, None, api_name=False,
                         concurrency_limit=None).success(
            make_spectrum_handler(limits), spectrum_inputs, [self.s_table, self.s_note, self.s_figure, self.s_layers],
            concurrency_limit=limits.runs_per_model, concurrency_id="model", api_name="spectrum"
        ).success(spectrum_staleness.remember, [*spectrum_inputs, self.s_note], self.s_state, api_name=False,
                  queue=False)
        for staleness, state, inputs in ((probe_staleness, self.p_state, probe_inputs),
                                         (spectrum_staleness, self.s_state, spectrum_inputs)):
            for trigger in (compared.success, *(component.change for component in inputs)):
                trigger(staleness.mark, [state, *inputs], staleness.outputs, api_name=False, queue=False,
                        trigger_mode="always_last", show_progress="hidden")
        # each column as wide as its longest word, set as a result arrives (the API's result stays a table)
        for table in (self.p_table, self.s_table):
            table.change(fit_columns, table, table, api_name=False, queue=False, show_progress="hidden")
