"""Passive outlier detection: which replicas are failing or not making progress.

Active health checks alone are slow to notice a hung replica (a SIGSTOPped engine still
accepts connections; three missed checks take ~25 s) and blind to a replica that answers
`/health` but fails requests. Alongside them, as Envoy's outlier detection and the SGLang
gateway's circuit breaker do, the router watches its own traffic:

- **connect failures**: a replica that refuses or times out a connection is ejected at
  once (no request can cause that);
- **other transport failures** (a reset, a broken or cut-off answer) may be the request's
  doing (a body the engine's server rejects, a keep-alive race) as much as the replica's:
  the router probes the replica's `/health` and ejects it only if the probe fails, so a
  hostile request cannot drain a healthy replica; `failures` of them in a row with no
  served request in between eject it regardless (a replica that answers `/health` but
  breaks every request); an engine's error answer (4xx, 5xx) is an answer and never counts;
- **silence**: a replica with requests in flight and no byte from any of them for
  `stall_s` is probed (at most once per `stall_s`), and ejected if the probe fails (a long
  prefill is silent too, but its server still answers the probe);
- **ejection**: every in-flight attempt on the replica that has been silent for `stall_s`
  is cut (it fails over to another replica if the client has seen no byte yet, else ends
  with a clear error), and the replica stays out for `eject_s`, doubled for each ejection
  in a row (capped at `MAX_EJECT_S`), before a passing health check may readmit it.

This module only keeps the books. The attempts in flight live with the data-plane worker
that forwards them (`Attempts`: silence, cuts); streaks and ejections live with the policy
owner (`Outliers`), which decides (`Router.drain`, `Router.confirm`, `Router.on_silent`)
and tells every worker about a drain.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MAX_EJECT_S = 300.0


@dataclass(eq=False)
class Attempt:
    """One forward of a request to a replica, watched for progress."""

    replica: str
    last_byte: float  # when the replica last sent a byte for it (its start before any)
    cutoff: Callable[[str], None] | None = None  # ends the attempt at once (set once sent)
    cut_reason: str | None = None

    def cut(self, reason: str) -> None:
        """End the attempt now (once; its reader raises)."""
        if self.cut_reason is None and self.cutoff is not None:
            self.cut_reason = reason
            self.cutoff(reason)


class Attempts:
    """A data-plane worker's attempts in flight, per replica: silence and cuts."""

    def __init__(self, clock: Callable[[], float], stall_s: float) -> None:
        self.clock, self.stall_s = clock, stall_s
        self._by_replica: dict[str, set[Attempt]] = {}

    def begin(self, url: str) -> Attempt:
        attempt = Attempt(url, self.clock())
        self._by_replica.setdefault(url, set()).add(attempt)
        return attempt

    def end(self, attempt: Attempt) -> None:
        self._by_replica[attempt.replica].discard(attempt)

    def in_flight(self, url: str) -> int:
        return len(self._by_replica.get(url, ()))

    def silent(self) -> list[str]:
        """Replicas with attempts in flight and no byte from any of them for `stall_s`."""
        now = self.clock()
        return [
            url
            for url, attempts in self._by_replica.items()
            if attempts and now - max(a.last_byte for a in attempts) >= self.stall_s
        ]

    def cut_silent(self, url: str, reason: str) -> int:
        """Cut every attempt on the replica silent for `stall_s`; how many were cut."""
        now = self.clock()
        silent = [a for a in self._by_replica.get(url, ()) if now - a.last_byte >= self.stall_s]
        for attempt in silent:
            attempt.cut(reason)
        return len(silent)


@dataclass
class _Books:
    failures: int = 0  # requests in a row that failed on the replica
    ejections: int = 0  # ejections in a row (reset by a request served after readmission)
    out_until: float = 0.0  # no readmission before this time
    probed_at: float = float("-inf")  # last probe of the replica for silence


@dataclass
class Outliers:
    """The owner's books per replica: failure streaks and the ejection back-off."""

    clock: Callable[[], float]
    stall_s: float
    failures: int
    eject_s: float
    _books: dict[str, _Books] = field(default_factory=dict)

    def _of(self, url: str) -> _Books:
        books = self._books.get(url)
        if books is None:
            books = self._books[url] = _Books()
        return books

    def end(self, url: str, ok: bool | None) -> bool:
        """Book an attempt's end: `ok` True (served), False (the replica failed it), None
        (neither: the client left, or the request was refused). True when the replica
        has now failed `failures` requests in a row."""
        if ok is None:
            return False
        books = self._of(url)
        if ok:
            books.failures = books.ejections = 0
            return False
        books.failures += 1
        return books.failures >= self.failures

    def due_probe(self, url: str) -> bool:
        """Whether a silent replica may be probed now: once per `stall_s`, so a replica
        busy with long silent work (a long prefill) is probed at that rate, no faster
        (however many workers report its silence)."""
        books, now = self._of(url), self.clock()
        if now - books.probed_at < self.stall_s:
            return False
        books.probed_at = now
        return True

    def eject(self, url: str) -> float:
        """Start (or extend) an ejection; returns how long the replica stays out."""
        books = self._of(url)
        books.ejections += 1
        books.failures = 0
        span = min(MAX_EJECT_S, self.eject_s * 2 ** (books.ejections - 1))
        books.out_until = self.clock() + span
        return span

    def may_rejoin(self, url: str) -> bool:
        return self.clock() >= self._of(url).out_until
