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

MAX_ID_CHARS = 256
PROMPT_PREFIX_CHARS = 2048  # completions API: the start of the prompt stands for the system part


class IdentityError(ValueError):
    """The request names a program id that cannot be used (wrong type, too long)."""


def _explicit(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    candidates: list[tuple[str, Any]] = [("program_id", body.get("program_id"))]
    extra = body.get("extra_body")
    if isinstance(extra, Mapping):
        candidates.append(("extra_body.program_id", extra.get("program_id")))
    candidates.append(("X-Program-Id", headers.get("x-program-id")))
    meta = body.get("metadata")
    if isinstance(meta, Mapping):
        candidates.append(("metadata.user_id", meta.get("user_id")))
    for where, value in candidates:
        if value is None:
            continue
        if not isinstance(value, str | int) or isinstance(value, bool):
            raise IdentityError(f"{where} must be a string")
        value = str(value)
        if not value or len(value) > MAX_ID_CHARS:
            raise IdentityError(f"{where} must be 1 to {MAX_ID_CHARS} characters")
        return value
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
            if not isinstance(m, Mapping):
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


def resolve(body: Mapping[str, Any], headers: Mapping[str, str], api_key: str | None) -> str:
    """The router-wide program id of a request (namespaced by the client's key)."""
    local = _explicit(body, headers) or fingerprint(body)
    return namespace(api_key) + local
