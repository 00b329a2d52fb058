"""Values echoed back in a message, cut short: an API caller can send 100 KB, or a list nested 100k deep."""

from __future__ import annotations

import reprlib

_short = reprlib.Repr()  # keyword arguments only from Python 3.12
_short.maxlevel, _short.maxlist, _short.maxtuple, _short.maxdict, _short.maxset = 2, 4, 4, 4, 4
_short.maxstring, _short.maxlong, _short.maxother = 60, 40, 60


def excerpt(value) -> str:
    """``repr(value)``, at most about 60 characters of any string and a few items of any container
    (``'aaaaaaaaaaaaaaaaaaaaaaaaaaaa...aaaaaaaaaaaaaaaaaaaaaaaaaaaaa'``, ``[[[...]]]``)."""
    return _short.repr(value)


def kind(value) -> str:
    """What a value is, in a word for a message: ``text``, ``a list``, ``a number``, ``true or false``."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "text", list: "a list", tuple: "a list", dict: "an object", type(None): "nothing"}.get(
        type(value), type(value).__name__)


def cut(text: str, limit: int = 80) -> str:
    """``text`` unquoted, its middle cut to keep it within about ``limit`` characters."""
    half = max(limit // 2 - 2, 1)
    return text if len(text) <= limit else f"{text[:half]}...{text[-half:]}"
