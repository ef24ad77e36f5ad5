"""Which program a request belongs to.

Explicit ids win, in order: body `program_id`, `extra_body.program_id` (for clients that
send it literally), header `X-Program-Id`, Anthropic `metadata.user_id`. Without any, a
fingerprint of the conversation's stable start (system prompt + first user message) is
used, so unmodified agents still get affinity: every call of one conversation re-sends
the same start. Ids are namespaced per client API key so two tenants never share one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from router.policy.labels import check_label

PROMPT_PREFIX_CHARS = 2048  # completions API: the start of the prompt stands for the system part


def _explicit(body: Mapping[str, Any], header: str | None) -> str | None:
    """The first explicit id, checked as a label: a bad one is an error (LabelError naming
    its source), never a silent fallback to the next source."""
    candidates: list[tuple[str, Any]] = [("program_id", body.get("program_id"))]
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        candidates.append(("extra_body.program_id", extra.get("program_id")))
    candidates.append(("X-Program-Id", header))
    meta = body.get("metadata")
    if isinstance(meta, dict):
        candidates.append(("metadata.user_id", meta.get("user_id")))
    for where, value in candidates:
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # numeric ids (e.g. a task number) are their decimal text
        return check_label(value, where)
    return None


def _text(content: Any) -> Any:
    """Message content as compared for the fingerprint (strings and content-part lists)."""
    return content if isinstance(content, str | list) else None


def _stable_start(body: Mapping[str, Any]) -> Any:
    messages = body.get("messages")
    if isinstance(messages, list):
        system = body.get("system")  # Anthropic keeps it outside the messages
        first_user = None
        for m in messages:
            if not isinstance(m, dict):
                continue
            role = m.get("role")
            if role in ("system", "developer") and system is None:
                system = _text(m.get("content"))
            elif role == "user":
                first_user = _text(m.get("content"))
                break
        return [system, first_user]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[:PROMPT_PREFIX_CHARS]
    return None


def fingerprint(body: Mapping[str, Any]) -> str:
    """A stable id from the conversation's start; same start, same program."""
    blob = json.dumps(_stable_start(body), sort_keys=True, default=str).encode()
    return "fp-" + hashlib.sha256(blob).hexdigest()[:16]


def namespace(api_key: str | None) -> str:
    """A short, non-reversible tag of the client key ("" without keys)."""
    if not api_key:
        return ""
    return "k" + hashlib.sha256(api_key.encode()).hexdigest()[:8] + "/"


def resolve(body: Mapping[str, Any], header: str | None, namespace_tag: str) -> str:
    """The router-wide program id of a request: the explicit id (`header` is the
    `X-Program-Id` value) or the fingerprint, behind the client key's `namespace`."""
    return namespace_tag + (_explicit(body, header) or fingerprint(body))
