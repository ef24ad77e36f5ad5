"""Labels: the client-chosen names the policy keeps (program ids, agent roles, tool names).

They go into JSON (hint batches, `/v1/programs`), URLs and response headers, so a control
character or a lone surrogate in one would break every later hint sync or listing. A bad
label is the client's error: `LabelError`, which the router answers with a 400 naming the
field. The check lives in the pure core because the policy validates labels it is given
directly (an application graph's roles), not only those the router's intake reads.
"""

from __future__ import annotations

MAX_LABEL_CHARS = 256


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
