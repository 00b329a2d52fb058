"""A widget of our own, kept apart from the tab modules: Gradio writes a type stub (``.pyi``) beside any module that
subclasses one of its components (ignored by git)."""

from __future__ import annotations

import gradio as gr


class TypedSlider(gr.Slider):
    """A slider that hands on its value as typed, in range or not, so that our checks refuse it by name.

    Gradio's own check raises a bare "Value 999 is greater than maximum value 64" (the setting unnamed), logs
    a traceback and marks the event's outputs "Error".  The browser itself sets a value typed past an end to
    that end when the box loses focus, just after the release event, which still carries the typed value:
    :func:`kvviz.ui.controls.past_end_note` tells the user then.  ``is_template``: the browser draws it as a Slider."""

    is_template = True

    def preprocess(self, payload: float | None) -> float | None:
        return None if payload is None else gr.Number.round_to_precision(payload, self.precision)
