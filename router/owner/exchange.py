"""One proxied inference request as the policy owner sees it: turn, gate, attempts, books.

A data-plane worker (router/plane/relay.py) moves the bytes; the owner decides. For each
request the worker sends a `Ticket`; the owner takes the program's turn, tells the
policy, holds the request at the gate until it is placed, and names a replica; the
worker forwards and reports an `Outcome`; a failure before the first byte is retried on
another replica. The whole life runs inside one `try`/`finally` chain so that every exit
(answer, engine error, gate timeout, client disconnect, cancellation) leaves the policy
consistent: a gated request is `cancel`led and a forwarded one gets its `on_response`.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable

from router.engines.replicas import Replica
from router.owner.controller import Router
from router.owner.gate import GateTimeout, ProgramEnded
from router.policy.door import ERROR_CODE_HEADER, START_DEFERRED
from router.protocol.link import Outcome, Ticket
from router.protocol.segments import as_policy
from router.wire.errors import ApiError

Forward = Callable[[str], Awaitable[Outcome]]


def unreachable(retry_s: float) -> ApiError:
    """No replica is in service (all refuse connections, fail their health checks or are
    drained): the answer at once, not after the gate timeout, so a wrong replica URL or a
    dead fleet does not pass for overload."""
    return ApiError(
        502,
        "no engine replica is reachable: every replica is refusing connections, failing its "
        "health checks or drained; retry later",
        code="no_replica_reachable",
        headers={"retry-after": str(max(1, round(retry_s)))},
    )


def deferred(retry_s: float) -> ApiError:
    """A start the door cannot let in before the gate timeout: come back then (its place
    at the door is kept). `retry-after-ms` too: the SDKs read it first, and a router run
    faster than real time answers in fractions of a second."""
    return ApiError(
        429,
        f"the replicas are full with programs in flight; this program's first request "
        f"cannot start within the gate timeout. Retry in {retry_s:.0f} s: its place in the "
        f"start queue is kept",
        code=START_DEFERRED,
        headers={
            "retry-after": str(max(1, math.ceil(retry_s))),
            "retry-after-ms": str(max(1, round(retry_s * 1000))),
            ERROR_CODE_HEADER: START_DEFERRED,
        },
    )


def standing_by() -> ApiError:
    """This router stepped down (another one took over): the client retries through the
    proxy, which sends it to the active router."""
    return ApiError(
        503,
        "this router is standing by: another router steers the replicas now; retry",
        code="router_standby",
        headers={"retry-after": "1"},
    )


def _time_in_engine(outcome: Outcome) -> float:
    """A streamed step's time in the engine: its own, where it reports one (the emulator's
    `engine_times`), else the data plane's timing from its request to the answer's end,
    which holds the HTTP path both ways (~3 ms of wall a step on the 2-core demo VM,
    bench/emulator_hop.py), so the round trip then counts only the owner's side of it."""
    engine_s = outcome.usage.engine_s
    return engine_s if engine_s is not None else sum(outcome.step or ())


class Exchange:
    """The owner's side of one request: returns the error to answer, or None."""

    def __init__(self, router: Router, ticket: Ticket, forward: Forward) -> None:
        self.router = router
        self.ticket = ticket
        self.forward = forward
        self.status = "ok"
        self.replica: Replica | None = None
        self.failed_on: list[Replica] = []  # replicas an attempt of this request failed on
        self.first_asked: float | None = None  # a start: its program's first attempt

    async def run(self) -> ApiError | None:
        r, pid = self.router, self.ticket.program_id
        self.ticket = r.identify(self.ticket)
        r.in_flight += 1
        try:
            await r.ensure_active()
            deadline = self.ticket.arrival + r.config.gate_timeout_s
            if not r.gate.enter(pid):
                await r.gate.wait_turn(pid, deadline)
            try:
                await self._attempts(deadline)
            finally:
                r.gate.leave(pid)
            return None
        except GateTimeout:
            self.status = "timeout"
            r.metrics.gate_timeouts.inc()
            retry = str(max(1, int(r.config.tick_s)))
            return ApiError(
                503,
                "the program could not be placed on a GPU in time; retry later",
                code="gate_timeout",
                headers={"retry-after": retry},
            )
        except ProgramEnded:
            self.status = "ended"
            message = "the program was ended while this request waited for a GPU"
            return ApiError(409, message, code="program_ended")
        except ApiError as e:
            self.status = "deferred" if e.code == START_DEFERRED else "error"
            return e
        except asyncio.CancelledError:
            self.status = "client_disconnect"
            raise
        finally:
            r.in_flight -= 1
            label = self.replica.url if self.replica else "-"
            r.metrics.count(r.metrics.requests, label, self.status)
            r.metrics.observe(r.metrics.latency, r.clock() - self.ticket.arrival, label)

    async def _attempts(self, deadline: float) -> None:
        r, pid, policy = self.router, self.ticket.program_id, self.router.policy
        tokens = r.estimate_tokens(pid, self.ticket.prompt_chars)
        budget = policy.largest_gpu_budget()
        if budget is not None and tokens > budget:
            raise ApiError(
                400,
                f"the prompt is about {tokens} tokens, more than any replica's GPU KV budget "
                f"({budget} tokens)",
                param="messages",
                code="context_length_exceeded",
            )
        r.observe_request(self.ticket)
        segments = as_policy(self.ticket.segments)
        for _ in range(r.config.max_retries + 1):
            if not r.active:
                raise standing_by()
            policy.on_prompt(pid, segments, self.ticket.round, self.ticket.hints)
            try:
                moves = policy.on_request(pid, r.clock(), tokens)
            except ValueError as e:  # a second request in flight despite the turn lock
                raise ApiError(409, str(e), code="program_busy") from None
            r.apply(moves)
            self.first_asked = policy.first_asked_s(pid)
            url = policy.route(pid)  # placed at once (most requests): nothing to wait for
            if url is None:
                url = await self._gated(deadline)
            else:
                r.metrics.observe(r.metrics.gate_wait, 0.0)
            replica = self.replica = r.replicas[url]
            outcome = Outcome()
            try:
                acked = r.hint_acked(pid)  # its busy hint (load-back) reaches the engine first
                if acked is not None:
                    await acked
                outcome = await self.forward(replica.url)
            finally:
                self._book(replica, outcome)
                now = r.clock()
                if outcome.step is not None:  # the rest of the step was the round trip
                    policy.observe_round_trip(pid, now, _time_in_engine(outcome))
                usage = outcome.usage
                r.apply(policy.on_response(pid, now, usage.context_tokens))
                if usage.tool:
                    r.apply(policy.on_tool_start(pid, now, usage.tool, agent=self.ticket.agent))
                r.step_ended(pid)
            if outcome.retry is None:
                self.status = outcome.status
                return
            r.metrics.count(r.metrics.requests, replica.url, "retried")
            if outcome.certain:
                r.drain(replica, outcome.retry, "connect")
            else:
                await r.confirm(replica, outcome.retry, "failed")
        raise ApiError(502, "no engine replica answered the request", code="upstream_unavailable")

    def _price(self, replica: Replica, outcome: Outcome) -> None:
        """Tell the policy what this step cost inside the engine (its prices follow the
        replica's own timings): prompt and cache split from the usage, the worker's times
        to the first streamed byte and after it. A plain answer's first byte is its last:
        no sample."""
        hits, step = outcome.usage.hits(), outcome.step
        if hits is None or step is None:
            return
        usage = outcome.usage
        self.router.policy.observe_step(
            replica.url, usage.prompt_tokens or 0, hits.device, hits.host, step[0],
            usage.completion_tokens or 0, step[1],
        )  # fmt: skip

    async def _gated(self, deadline: float) -> str:
        """Wait for the program's replica; on any exit but success the request is cancelled."""
        r, pid = self.router, self.ticket.program_id
        held_from = r.clock()

        def route() -> str | None:
            if not r.active:  # stepped down while it waited
                raise standing_by()
            url = r.policy.route(pid)
            if url is None and not r.reachable():  # nothing will place it: say so now
                raise unreachable(r.config.health_interval_s)
            retry_s = r.policy.refusal(pid) if url is None else None
            if retry_s is not None:  # a start the door will not let in before the timeout
                r.metrics.starts_deferred.inc()
                raise deferred(retry_s)
            return url

        try:
            url = await r.gate.until_routed(pid, route, deadline)
        except BaseException:
            r.apply(r.policy.cancel(pid, r.clock()))
            raise
        r.metrics.observe(r.metrics.gate_wait, r.clock() - held_from)
        return url

    def _book(self, replica: Replica, outcome: Outcome) -> None:
        """The attempt in the outlier books, the metrics and the policy's prices."""
        r, usage = self.router, outcome.usage
        # one failure per request and replica: a request that fails on every retry
        # (it may be the cause) adds one to the streak, not max_retries + 1
        verdict = outcome.verdict
        if verdict is False and replica in self.failed_on:
            verdict = None
        elif verdict is False:
            self.failed_on.append(replica)
        if r.outliers.end(replica.url, verdict):
            failures = r.config.outlier_failures
            r.drain(replica, f"{failures} requests in a row failed", "failures")
        if outcome.suspect is not None:
            r.spawn(r.confirm(replica, outcome.suspect, "failed"))
        if outcome.ttft is not None:
            ttft = outcome.ttft - self.ticket.arrival
            r.metrics.observe(r.metrics.ttft, ttft, replica.url)
            start = self.first_asked is not None
            r.metrics.observe(r.metrics.step_ttft, ttft, "start" if start else "inflight")
            if start:
                r.metrics.observe(r.metrics.start_wait, outcome.ttft - self.first_asked)
        if usage.prompt_tokens is not None:
            r.metrics.count(r.metrics.prompt_tokens, replica.url, amount=usage.prompt_tokens)
            r.learn_tokens(self.ticket.program_id, self.ticket.prompt_chars, usage.prompt_tokens)
        if usage.completion_tokens is not None:
            r.metrics.count(r.metrics.output_tokens, replica.url, amount=usage.completion_tokens)
        r.metrics.record_hits(replica.url, usage)
        self._price(replica, outcome)
