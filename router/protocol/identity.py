"""Which program a request belongs to.

The sources, in order (docs/router.md "Program identity"):

1. an explicit program id: body `program_id`, `extra_body.program_id` (for clients that
   send it literally), header `X-Program-Id`;
2. the session header an agent harness sends on its own (`SESSION_HEADERS`: NVIDIA
   Dynamo's, Claude Code's, Codex's, OpenCode's), the order Dynamo's router reads them in;
3. Anthropic `metadata.user_id`;
4. a fingerprint of the conversation's stable start (system prompt + first user message),
   so unmodified agents still get affinity: every call of one conversation re-sends it.

A session header names a *session*, not a program: a harness's subagents (Claude Code's
Task tool) send their parent's value on conversations of their own, so the header alone
would merge a parent and its subagents into one program whose context flips between two
prefixes. Under a session the conversation's stable start names the program:
`<session>/<fingerprint>`; the owner files the first program it sees of a session as the
main one and the others as its subagents (router/owner/sessions.py).

An explicit id or `metadata.user_id` that is not a label is the client's error (a 400
naming its source); a session header that is not one is ignored (the next source is
used) and counted, since the client did not choose it for the router. Ids and sessions
are namespaced per client API key so two tenants never share one.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any, NamedTuple

from router.policy.labels import LabelError, check_label
from router.protocol.sanitize import header_text

PROMPT_PREFIX_CHARS = 2048  # completions API: the start of the prompt stands for the system part
# (header as the router reads it, the name it is shown and counted by), in precedence order
SESSION_HEADERS = (
    ("x-dynamo-session-id", "X-Dynamo-Session-ID"),
    ("x-claude-code-session-id", "X-Claude-Code-Session-Id"),
    ("session-id", "session-id"),  # Codex CLI
    ("session_id", "session_id"),  # older Codex, other clients
    ("x-opencode-session", "x-opencode-session"),
)
FINGERPRINT = "fingerprint"  # the source of a derived id


class Identity(NamedTuple):
    """Who a request is: its program, where that came from, and its session if any."""

    program_id: str  # namespaced
    source: str  # the field or header that named it, or FINGERPRINT
    session: str | None = None  # namespaced session a harness header named
    ignored: tuple[str, ...] = ()  # session headers skipped as unusable (for the metric)


def session_headers(headers: Mapping[str, str]) -> tuple[tuple[str, str | None], ...]:
    """The session headers present, by shown name, in precedence order; a value that is
    not UTF-8 text is None (ignored later, like any other unusable value). Empty ones
    count as absent, as an empty `X-Program-Id` does."""
    out = []
    for header, name in SESSION_HEADERS:
        try:
            value = header_text(headers, header)
        except LabelError:
            value = None
        else:
            if not value:
                continue
        out.append((name, value))
    return tuple(out)


def _explicit(body: Mapping[str, Any], header: str | None) -> tuple[str, str] | None:
    """The first explicit id and its source, checked as a label: a bad one is an error
    (LabelError naming its source), never a silent fallback to the next source."""
    candidates: list[tuple[str, Any]] = [("program_id", body.get("program_id"))]
    extra = body.get("extra_body")
    if isinstance(extra, dict):
        candidates.append(("extra_body.program_id", extra.get("program_id")))
    candidates.append(("X-Program-Id", header))
    return _first(candidates)


def _user_id(body: Mapping[str, Any]) -> tuple[str, str] | None:
    meta = body.get("metadata")
    return _first([("metadata.user_id", meta.get("user_id"))]) if isinstance(meta, dict) else None


def _first(candidates: list[tuple[str, Any]]) -> tuple[str, str] | None:
    for where, value in candidates:
        if value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # numeric ids (e.g. a task number) are their decimal text
        return check_label(value, where), where
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


def resolve(
    body: Mapping[str, Any],
    header: str | None,
    namespace_tag: str,
    sessions: tuple[tuple[str, str | None], ...] = (),
) -> Identity:
    """The router-wide identity of a request: `header` is the `X-Program-Id` value,
    `sessions` the session headers (`session_headers`), all behind the client key's
    `namespace_tag`. Raises LabelError for a bad explicit id or `metadata.user_id`."""
    explicit = _explicit(body, header)
    if explicit is not None:
        return Identity(namespace_tag + explicit[0], explicit[1])
    ignored = []
    for name, value in sessions:
        try:
            session = namespace_tag + check_label(value, name)
        except LabelError:
            ignored.append(name)
            continue
        return Identity(f"{session}/{fingerprint(body)}", name, session, tuple(ignored))
    user = _user_id(body)
    if user is not None:
        return Identity(namespace_tag + user[0], user[1], None, tuple(ignored))
    return Identity(namespace_tag + fingerprint(body), FINGERPRINT, None, tuple(ignored))
