"""The router's view of its engine replicas: one `Replica` each, all on one `Upstream`.

Everything the policy owner asks a replica goes through here: capacity
(`/get_server_info`), health, hint batches (`/mori/hints`), residency (`/mori/residency`);
a data-plane worker forwards inference and sends aborts (`/abort_request`) on the same
client.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from router.config import ReplicaSpec, RouterConfig
from router.policy.types import Hint, ReplicaCapacity
from router.wire.upstream import Upstream, UpstreamError

log = logging.getLogger("mori.engines")

# Fields under which a server may report its host (DRAM) KV tier in tokens.
HOST_TOKEN_FIELDS = ("max_host_num_tokens", "host_total_num_tokens", "hicache_host_tokens")


# Answers to /mori/hints or /mori/residency from an engine without MORI's hint endpoints
# (501: the plugin is loaded but the engine's configuration takes no hints).
UNSUPPORTED = (404, 405, 501)


class HintsUnsupported(Exception):
    """The replica has no `/mori/hints` (plain SGLang): serve through it without hints."""


@dataclass
class Replica:
    """One engine replica and the router's running knowledge of it."""

    spec: ReplicaSpec
    upstream: Upstream
    health_timeout_s: float
    failures: int = 0  # consecutive failed health checks
    hints_supported: bool = True

    @property
    def url(self) -> str:
        return self.spec.url

    async def abort(self, rid: str) -> None:
        """Tell the engine to stop a request whose client went away (best effort)."""
        try:
            await self.upstream.call_json(
                self.url, b"POST", b"/abort_request", {"rid": rid}, self.health_timeout_s
            )
        except UpstreamError as e:
            log.info("abort of %s on %s failed: %s", rid, self.url, e)

    # capacity and health -----------------------------------------------------------
    async def fetch_capacity(self, host_ratio: float) -> ReplicaCapacity:
        """Token budgets: config overrides, else `/get_server_info`, else an error."""
        gpu, cpu = self.spec.gpu_tokens, self.spec.cpu_tokens
        if gpu is None or cpu is None:
            status, info = await self.upstream.call_json(
                self.url, b"GET", b"/get_server_info", timeout_s=self.health_timeout_s
            )
            if status != 200 or not isinstance(info, dict):
                raise ValueError(f"{self.url}/get_server_info answered {status}")
            if gpu is None:
                gpu = _int_field(info, "max_total_num_tokens")
                if gpu is None:
                    raise ValueError(f"{self.url}/get_server_info has no max_total_num_tokens")
            if cpu is None:
                cpu = _host_tokens(info, gpu, host_ratio)
        return ReplicaCapacity(gpu_tokens=int(gpu), cpu_tokens=int(cpu))

    async def alive(self, timeout_s: float) -> bool:
        """Whether the replica's HTTP server answers at all (any status) within `timeout_s`.
        A stopped or hung process does not; an engine busy with a long prefill does, fast
        (SGLang's HTTP process answers `/v1/models` without its scheduler, whereas its
        `/health` waits for a one-token generation: a second at least)."""
        try:
            await self.upstream.call(self.url, b"GET", b"/v1/models", timeout_s=timeout_s)
        except UpstreamError:
            return False
        return True

    async def healthy(self) -> bool:
        try:
            status, _ = await self.upstream.call(
                self.url, b"GET", b"/health", timeout_s=self.health_timeout_s
            )
        except UpstreamError:
            return False
        return status == 200

    # hints -----------------------------------------------------------------------
    async def push_hints(
        self, epoch: int, hints: dict[str, Hint], full: bool, extra: dict | None = None
    ) -> Any:
        """POST one hint batch (with `extra` fields: CacheSage's `scores` and `agents`) and
        return the decoded answer (`"stale": true`: refused, another router took over);
        raises HintsUnsupported on 404/405/501, UpstreamError or ValueError otherwise."""
        payload = {"epoch": epoch, "full": full, "hints": {p: h.value for p, h in hints.items()}}
        payload.update(extra or {})
        status, answer = await self.upstream.call_json(
            self.url, b"POST", b"/mori/hints", payload, self.health_timeout_s
        )
        if status in UNSUPPORTED:
            raise HintsUnsupported(self.url)
        if status >= 400:
            raise ValueError(f"{self.url}/mori/hints answered {status}")
        return answer

    async def fetch_residency(self) -> Any:
        """The decoded `/mori/residency` answer; raises HintsUnsupported without one,
        UpstreamError or ValueError otherwise."""
        status, doc = await self.upstream.call_json(
            self.url, b"GET", b"/mori/residency", timeout_s=self.health_timeout_s
        )
        if status in UNSUPPORTED:
            raise HintsUnsupported(self.url)
        if status >= 400 or doc is None:
            raise ValueError(f"{self.url}/mori/residency answered {status}")
        return doc


def _int_field(info: dict[str, Any], name: str) -> int | None:
    value = info.get(name)
    if value is None:  # SGLang nests some fields per data-parallel rank
        for state in info.get("internal_states") or []:
            if isinstance(state, dict) and state.get(name) is not None:
                value = state[name]
                break
    return int(value) if isinstance(value, int | float) and value > 0 else None


def _host_tokens(info: dict[str, Any], gpu: int, host_ratio: float) -> int:
    """Host tier size: reported tokens, else HiCache's ratio, else the configured ratio."""
    for name in HOST_TOKEN_FIELDS:
        value = _int_field(info, name)
        if value is not None:
            return value
    if info.get("enable_hierarchical_cache") is False:
        return 0
    ratio = info.get("hicache_ratio")
    if isinstance(ratio, int | float) and ratio > 0:
        return int(gpu * ratio)
    return int(gpu * host_ratio)


def make_replicas(config: RouterConfig, upstream: Upstream) -> dict[str, Replica]:
    """A Replica per configured URL, all on one client."""
    return {
        spec.url: Replica(spec=spec, upstream=upstream, health_timeout_s=config.health_timeout_s)
        for spec in config.replicas
    }


def make_upstream(config: RouterConfig) -> Upstream:
    """The router's client: engine silence bounded by `request_timeout_s`."""
    return Upstream(config.connect_timeout_s, config.request_timeout_s)
