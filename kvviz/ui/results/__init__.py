"""The Results tab: Plotly figures over the DuckDB store, with filters and CSV export of each table.

Measured and paper-reported rows are never mixed silently: they sit in separate panels named by their
source, paper rows are drawn dashed, and the measured-vs-paper figure puts them side by side on a common
scale.  A policy has the same colour in every panel and every figure (:class:`Colours`).  Each figure has a
title of at most two lines, one sentence on how to read it and its caveats in a note under it, and draws at
most eight policies unless more are asked for.

Modules: ``colours`` (the allocator), ``layout`` (titles, notes, panels), ``lines`` and ``panels`` (the
figures), ``pairing`` (paired differences, at equal memory too), ``compose`` (one filter combination's
sections) and ``tab`` (the Gradio layout and wiring).
"""

from .colours import BACKGROUNDS, PALETTE, REFERENCE_COLOURS, VARIANT_SYMBOLS, Colours, _delta_e, _lab
from .compose import (
    ALL,
    OPEN,
    SECTIONS,
    SETTINGS_BOX,
    View,
    _csv,
    _draws_note,
    absent_note,
    default_reference,
    empty_filters_hint,
    query,
    sections,
    weak_full_cache_note,
    with_reference,
)
from .layout import (
    DODGE,
    DODGE_MOST,
    LEGEND_ROW,
    MARGIN,
    MODEBAR_STRIP,
    NOTE_WIDTH,
    PANEL_TITLE_HEIGHT,
    TITLE_WIDTH,
    _dodge,
    _legend_room,
    _on_cut_axes,
    caption_of,
    legend_entries,
    note_markdown,
)
from .lines import (
    DEFAULT_POLICIES,
    DEPTH_CAPTION,
    SHOW_ALL,
    SHOWN_MOST,
    _depth_figure,
    _hits_figure,
    _line_figure,
    _paired_figure,
    _refresh_figure,
    curated,
    policy_of,
)
from .pairing import PAIRINGS, inertia_family, matched_memory, paired
from .panels import (
    PAPER_GREY,
    SWEEPS_WIDTH,
    _cache_figure,
    _comparison_figure,
    _grid_figure,
    _ranking_caveats,
    _ranking_figure,
    _speed_figure,
)
from .tab import FILTERS_CACHED, INTROS, PENDING, QUALITY_NOTE, Drawing, build_results_tab
