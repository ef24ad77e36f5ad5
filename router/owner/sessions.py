"""Sessions: which program of a harness's session is its main one, and who each program is.

A harness's session header names a session (router.protocol.identity); the programs under
it are its conversations, `<session>/<fingerprint>`. The first one the router sees is
the session's main program. One that starts differently later is a subagent (Claude
Code's Task tool sends its parent's session header on a conversation of its own): it gets
the main program as its parent, as an explicit `X-Parent-Id` would give it, so the agent
runtime layer files it under its parent's task. The decision needs one place that sees
every request in order, so it lives here in the owner, not in the data-plane workers.

Both books are bounded, least recently seen dropped first: a session that comes back
after being dropped starts afresh (its next conversation is taken for its main one).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, NamedTuple

from router.protocol.identity import Identity

SESSIONS = 4096  # sessions remembered (their main programs)
PROGRAMS = 65536  # programs whose identity /v1/programs and /v1/sessions show


class Who(NamedTuple):
    """Where a program's id came from, its session and its parent."""

    source: str | None  # router.protocol.identity: the field or header, or "fingerprint"
    session: str | None
    parent: str | None


class Sessions:
    """The owner's book of sessions and program identities."""

    def __init__(self, sessions: int = SESSIONS, programs: int = PROGRAMS) -> None:
        self._capacity = (sessions, programs)
        self._mains: OrderedDict[str, str] = OrderedDict()  # session -> main program
        self._programs: OrderedDict[str, Who] = OrderedDict()

    def admit(self, program_id: str, identity: Identity | None, parent: str | None) -> str | None:
        """File one request's program; returns its parent: the one the request named,
        else its session's main program (None for the main program itself, and for a
        program of no session)."""
        session = identity.session if identity is not None else None
        if session is not None:
            main = self._mains.setdefault(session, program_id)
            _touch(self._mains, session, self._capacity[0])
            if parent is None and main != program_id:
                parent = main
        source = identity.source if identity is not None else None
        self._programs[program_id] = Who(source, session, parent)
        _touch(self._programs, program_id, self._capacity[1])
        return parent

    def of(self, program_id: str) -> dict[str, Any]:
        """A program's identity as `/v1/programs` shows it: the source of its id and its
        parent. (A session's program ids start with the session; the `session` a
        runtime-layer policy shows there is its own, the task.)"""
        who = self._programs.get(program_id, Who(None, None, None))
        return {"identity": who.source, "parent": who.parent}

    def view(self) -> list[dict[str, Any]]:
        """Every remembered session: its main program and its subagents (least recently
        seen first)."""
        subagents: dict[str, list[str]] = {session: [] for session in self._mains}
        for pid, who in self._programs.items():
            if who.session in subagents and pid != self._mains[who.session]:
                subagents[who.session].append(pid)
        return [
            {"session": session, "main": main, "subagents": subagents[session]}
            for session, main in self._mains.items()
        ]


def _touch(book: OrderedDict[str, Any], key: str, capacity: int) -> None:
    """Mark `key` most recently seen, dropping the least recently seen beyond capacity."""
    book.move_to_end(key)
    while len(book) > capacity:
        book.popitem(last=False)
