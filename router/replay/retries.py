"""How an agent's client retries a step the router answered with an error: the model the
simulator runs and the live replay client follows, so both count the same failures.

Agents call through the OpenAI and Anthropic SDKs with their defaults (openai 3.57 and
anthropic alike, `_constants`): two retries after a 408, 409, 429, 5xx or a broken
connection; the wait is the answer's `Retry-After` (`retry-after-ms` first) when it is
at most two minutes, else 0.5 s doubling up to 8 s, less up to a quarter at random; a
`Retry-After` over two minutes is not retried at all. A step whose last attempt fails is
a failed step: the agent sees an error.

A start refused at the router's door (`START_DEFERRED`, router.policy.door) is not a
failed step: an orchestrator that starts agents comes back when told, however often, and
its wait counts as the start's (`StepRecord.first_arrival_s`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from router.policy.door import ERROR_CODE_HEADER, START_DEFERRED

MAX_RETRIES = 2  # the SDKs' DEFAULT_MAX_RETRIES
INITIAL_RETRY_DELAY = 0.5  # ... INITIAL_RETRY_DELAY (s)
MAX_RETRY_DELAY = 8.0  # ... MAX_RETRY_DELAY (s)
MAX_RETRY_AFTER_DELAY = 120.0  # ... the longest Retry-After they wait for (s)
RETRIED_STATUS = frozenset({408, 409, 429})  # and every 5xx
__all__ = ["ERROR_CODE_HEADER", "START_DEFERRED", "ClientRetries", "retried", "retry_after_s"]


def retried(status: int | None) -> bool:
    """Whether the SDKs retry an answer with this status (None: no answer, a broken
    connection)."""
    return status is None or status in RETRIED_STATUS or status >= 500


def retry_after_s(headers: Mapping[str, str]) -> float | None:
    """The server's `retry-after-ms` or `retry-after` (delay-seconds form), in seconds."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            value = float(raw) * scale
        except ValueError:
            continue
        if value >= 0:
            return value
    return None


@dataclass(frozen=True)
class ClientRetries:
    """The SDKs' retry rule, with their default retry count unless told otherwise."""

    max_retries: int = MAX_RETRIES

    def delay_s(
        self, retries_done: int, retry_after: float | None, rng: random.Random
    ) -> float | None:
        """Seconds before attempt `retries_done + 2`, or None: the step fails."""
        if retries_done >= self.max_retries:
            return None
        if retry_after is not None and retry_after > MAX_RETRY_AFTER_DELAY:
            return None
        if retry_after is not None and retry_after > 0:
            return retry_after
        backoff = min(INITIAL_RETRY_DELAY * 2.0**retries_done, MAX_RETRY_DELAY)
        return backoff * (1 - 0.25 * rng.random())
