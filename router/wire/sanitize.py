"""Client-supplied text the router stores, echoes or forwards, checked before it is used.

Two kinds of client text reach places where a bad character does harm:

- **Labels** the router keeps and shows: program ids, agent roles, tool names, request ids.
  They go into JSON (hint batches, `/v1/programs`), URLs and the `x-mori-program-id`
  response header, so a control character or a lone surrogate in one would break every
  later hint sync or listing. A bad label is the client's error: `LabelError`, a 400
  that names the field.
- **Forwarded headers** (`anthropic-version`, `anthropic-beta`, `x-request-id`): passed on
  to the engine as they are only when they are valid header values. Surrounding
  whitespace is stripped and a value with other bytes is dropped, so a malformed header
  can never fail the upstream request (which would look like a replica failure).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

MAX_LABEL_CHARS = 256
MAX_HEADER_CHARS = 1024
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "x-request-id")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


class LabelError(ValueError):
    """A client-supplied label that cannot be used; the message names its field."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field} {problem}")
        self.field = field


def check_label(value: object, field: str) -> str:
    """`value` as a label, or LabelError.

    A label is 1 to MAX_LABEL_CHARS printable characters (Unicode letters, digits,
    punctuation, symbols and spaces; no control, format or surrogate code points, so it
    always encodes as UTF-8) without leading or trailing whitespace.
    """
    if not isinstance(value, str):
        raise LabelError(field, "must be a string")
    text = value
    if not 1 <= len(text) <= MAX_LABEL_CHARS:
        raise LabelError(field, f"must be 1 to {MAX_LABEL_CHARS} characters")
    if not text.isprintable():
        raise LabelError(field, "must be printable text (no control characters or surrogates)")
    if text != text.strip():
        raise LabelError(field, "must not start or end with whitespace")
    return text


def header_text(headers: Mapping[str, str], name: str) -> str | None:
    """A request header as UTF-8 text (None when absent), or LabelError.

    ASGI servers hand header values over as Latin-1; a client sending UTF-8 (the only
    sensible encoding for a label) is decoded back here, and other bytes are refused."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        return value.encode("latin-1").decode("utf-8").strip()
    except (UnicodeEncodeError, UnicodeDecodeError):
        raise LabelError(_header_name(name), "must be valid UTF-8") from None


def forwarded_headers(
    headers: Mapping[str, str], names: Iterable[str] = FORWARDED_HEADERS
) -> dict[str, str]:
    """The request headers to pass on to the engine, each a valid header value or left out."""
    out = {}
    for name in names:
        value = headers.get(name)
        if value is None:
            continue
        value = value.strip(" \t")
        if value and len(value) <= MAX_HEADER_CHARS and _visible_ascii(value):
            out[name] = value
    return out


def _visible_ascii(value: str) -> bool:
    """RFC 9110 field-value characters the upstream client can encode: VCHAR, SP, HTAB."""
    return _HEADER_VALUE.fullmatch(value) is not None


def _header_name(name: str) -> str:
    return "-".join(part.capitalize() for part in name.split("-"))
