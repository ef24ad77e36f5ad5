"""The link between a data-plane worker and the policy owner: framed messages on a
socketpair, batched per event-loop turn.

A worker asks the owner once per request (`GO`, answered by `ROUTE` or `ERROR`) and
reports each attempt (`ATTEMPT`); the owner tells every worker about drains and rejoins.
Messages are tuples whose first item is a kind below, pickled (both ends are this
program, on a private socketpair). Writes made in one loop turn go out in one `write`,
so under load one system call carries many messages in each direction. An attempt's
report goes at the end of its loop turn too, though nobody waits for it: the owner acts
on a step's end (the door lets a start in, the hints move the program's KV), and a
report held for a later request's `GO` held all of that up by the wait
(bench/results/2026-12-03-link-reports.md).
"""

from __future__ import annotations

import asyncio
import pickle
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from router.policy.types import NO_HINTS, AgentHints
from router.protocol.accounting import Usage
from router.protocol.agent_identity import Anchor
from router.protocol.identity import Identity
from router.protocol.segments import RawSegment

# worker -> owner
GO = 1  # (GO, seq, Ticket): a request wants a replica
ATTEMPT = 2  # (ATTEMPT, seq, Outcome): how the last routed attempt went
CANCEL = 3  # (CANCEL, seq): the client left while the request waited for a replica
SILENT = 4  # (SILENT, url): the worker's requests on the replica have been silent stall_s
# owner -> worker
HELLO = 10  # (HELLO, RouterConfig, admin_url, anchors): what the worker serves with
ROUTE = 11  # (ROUTE, seq, url): forward the request to this replica
ERROR = 12  # (ERROR, seq, ApiError): answer the request with this error
DRAINED = 13  # (DRAINED, url, why): cut the worker's silent requests on the replica
REJOINED = 14  # (REJOINED, url)


class Ticket(NamedTuple):
    """What the owner needs of a request to place it (the body stays with the worker);
    a NamedTuple: immutable, and a quarter of a frozen dataclass's cost to build."""

    program_id: str
    prompt_chars: int
    arrival: float  # time.monotonic() when the worker had it parsed (same clock here)
    agent: str | None = None  # agent role: explicit, else its anchor's hash (agent_identity)
    # tools + leading system messages, for a policy that warms anchors (CacheSage; HELLO
    # says whether the owner's policy wants them: they can be tens of KiB)
    anchor: Anchor | None = None
    parent: str | None = None  # the program this one works for (X-Parent-Id)
    app: str | None = None  # the application (agent graph) its task runs (X-App-Id)
    segments: tuple[RawSegment, ...] = ()  # the prompt, message by message (segments.py)
    round: str | None = None  # the All-Gather round the application names (X-Round-Id)
    identity: Identity | None = None  # the id's source and session (the owner's Sessions)
    hints: AgentHints = NO_HINTS  # the request's priority and expected output length


@dataclass
class Outcome:
    """How one attempt on a replica went, as the worker saw it."""

    usage: Usage = field(default_factory=Usage)
    # the attempt for the outlier books: True served, False the replica failed it,
    # None neither (the client left, or the request could not be sent)
    verdict: bool | None = None
    status: str = "ok"  # ok | error | client_disconnect (the requests metric's outcome)
    retry: str | None = None  # the replica failed before the client saw a byte: why
    certain: bool = False  # retry: the replica is at fault for sure (refused, or cut)
    suspect: str | None = None  # a failure mid-stream: the replica is probed
    ttft: float | None = None  # time.monotonic() of the first byte sent to the client
    # a streamed answer's engine timings for the policy's prices (Router.observe_step):
    # seconds from sending the request to its first byte, and from there to its end
    step: tuple[float, float] | None = None


_LENGTH = struct.Struct("!I")


class Link(asyncio.Protocol):
    """One end of a worker-owner socketpair."""

    def __init__(
        self, on_message: Callable[[tuple[Any, ...]], None], on_lost: Callable[[], None]
    ) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._soon = False  # a flush is scheduled for this loop turn
        self._buffer = b""
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, message: tuple[Any, ...]) -> None:
        """Queue a message for the end of this loop turn (one write carries the turn's)."""
        if self.closed:
            return
        frame = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        self._out.append(_LENGTH.pack(len(frame)))
        self._out.append(frame)
        if not self._soon:
            self._soon = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._soon = False
        out, self._out = self._out, []
        if out and self.transport is not None and not self.closed:
            self.transport.write(b"".join(out))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer + data if self._buffer else data
        at, end = 0, len(buffer)
        while end - at >= 4:
            (size,) = _LENGTH.unpack_from(buffer, at)
            if end - at - 4 < size:
                break
            self.on_message(pickle.loads(buffer[at + 4 : at + 4 + size]))
            at += 4 + size
        self._buffer = buffer[at:]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.on_lost()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class LocalLink:
    """A link whose two ends live in one process (`workers: 1`): a message is handed to
    the other end's handler directly, without pickling or a system call."""

    closed = False

    def __init__(self) -> None:
        self.deliver: Callable[[tuple[Any, ...]], None] = lambda message: None

    def send(self, message: tuple[Any, ...]) -> None:
        self.deliver(message)

    def close(self) -> None:
        self.closed = True


async def connect(sock: Any, link: Link) -> Link:
    """Attach `link` to a connected socket (one end of a socketpair)."""
    await asyncio.get_running_loop().connect_accepted_socket(lambda: link, sock=sock)
    return link
