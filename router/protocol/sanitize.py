"""Client-supplied text the router stores, echoes or forwards, checked before it is used.

Two kinds of client text reach places where a bad character does harm:

- **Labels** the router keeps and shows (program ids, agent roles, tool names, request ids):
  checked by `router.policy.labels.check_label`; a header that carries one is read as
  UTF-8 text here first (`header_text`).
- **Forwarded headers** (`anthropic-version`, `anthropic-beta`, `x-request-id`): passed on
  to the engine as they are only when they are valid header values. Surrounding
  whitespace is stripped and a value with other bytes is dropped, so a malformed header
  can never fail the upstream request (which would look like a replica failure).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from router.policy.labels import LabelError

MAX_HEADER_CHARS = 1024
FORWARDED_HEADERS = ("anthropic-version", "anthropic-beta", "x-request-id")
_HEADER_VALUE = re.compile(r"[\t\x20-\x7e]*")


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
