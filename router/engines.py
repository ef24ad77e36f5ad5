"""The router's view of its engine replicas: one pooled httpx client, one `Replica` each.

Everything a replica is asked goes through here: inference (streamed), capacity
(`/get_server_info`), health, hint batches (`/mori/hints`), residency (`/mori/residency`)
and aborts (`/abort_request`).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

import httpx

from router.config import ReplicaSpec, RouterConfig
from router.policy.types import Hint, ReplicaCapacity

log = logging.getLogger("mori.engines")

# Fields under which a server may report its host (DRAM) KV tier in tokens.
HOST_TOKEN_FIELDS = ("max_host_num_tokens", "host_total_num_tokens", "hicache_host_tokens")


POOL_SHARDS = 64  # connection pools the inference requests rotate over


class HintsUnsupported(Exception):
    """The replica has no `/mori/hints` (plain SGLang): serve through it without hints."""


@dataclass
class Replica:
    """One engine replica and the router's running knowledge of it."""

    spec: ReplicaSpec
    client: httpx.AsyncClient
    pools: list[httpx.AsyncBaseTransport]
    health_timeout_s: float
    failures: int = 0  # consecutive failed health checks
    hints_supported: bool = True
    _turn: int = 0
    _urls: dict[str, httpx.URL] = field(default_factory=dict)  # parsed once per path

    def __post_init__(self) -> None:
        self._ext = {"timeout": self.client.timeout.as_dict()}

    @property
    def url(self) -> str:
        return self.spec.url

    # inference ----------------------------------------------------------------------
    async def open(self, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
        """Send an inference request; the caller reads (and must close) the body stream.

        Goes straight to a pooled transport with a pre-parsed URL: the client's URL
        merging, auth, redirect and cookie layers cost ~15% of the router's CPU per
        request and do nothing for an engine.
        Requests rotate over several small pools: httpcore scans every connection of a
        pool on each request, which at hundreds of streams cost most of the router's CPU.
        """
        url = self._urls.get(path)
        if url is None:
            url = self._urls[path] = httpx.URL(self.url + path)
        request = httpx.Request("POST", url, content=body, headers=headers, extensions=self._ext)
        self._turn += 1
        return await self.pools[self._turn % len(self.pools)].handle_async_request(request)

    async def abort(self, rid: str) -> None:
        """Tell the engine to stop a request whose client went away (best effort)."""
        try:
            await self.client.post(
                self.url + "/abort_request", json={"rid": rid}, timeout=self.health_timeout_s
            )
        except httpx.HTTPError as e:
            log.info("abort of %s on %s failed: %s", rid, self.url, e)

    # capacity and health -----------------------------------------------------------
    async def fetch_capacity(self, host_ratio: float) -> ReplicaCapacity:
        """Token budgets: config overrides, else `/get_server_info`, else an error."""
        gpu, cpu = self.spec.gpu_tokens, self.spec.cpu_tokens
        if gpu is None or cpu is None:
            r = await self.client.get(self.url + "/get_server_info", timeout=self.health_timeout_s)
            r.raise_for_status()
            info = r.json()
            if gpu is None:
                gpu = _int_field(info, "max_total_num_tokens")
                if gpu is None:
                    raise ValueError(f"{self.url}/get_server_info has no max_total_num_tokens")
            if cpu is None:
                cpu = _host_tokens(info, gpu, host_ratio)
        return ReplicaCapacity(gpu_tokens=int(gpu), cpu_tokens=int(cpu))

    async def healthy(self) -> bool:
        try:
            r = await self.client.get(self.url + "/health", timeout=self.health_timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    # hints -----------------------------------------------------------------------
    async def push_hints(
        self, epoch: int, hints: dict[str, Hint], full: bool, extra: dict | None = None
    ) -> None:
        """POST one hint batch (with `extra` fields: CacheSage's `scores` and `agents`);
        raises HintsUnsupported on 404/405, httpx errors otherwise."""
        payload = {"epoch": epoch, "full": full, "hints": {p: h.value for p, h in hints.items()}}
        payload.update(extra or {})
        r = await self.client.post(
            self.url + "/mori/hints", json=payload, timeout=self.health_timeout_s
        )
        if r.status_code in (404, 405, 501):  # 501: the engine's configuration takes none
            raise HintsUnsupported(self.url)
        r.raise_for_status()

    async def fetch_residency(self) -> Any:
        """The decoded `/mori/residency` answer; raises HintsUnsupported without one."""
        r = await self.client.get(self.url + "/mori/residency", timeout=self.health_timeout_s)
        if r.status_code in (404, 405, 501):
            raise HintsUnsupported(self.url)
        r.raise_for_status()
        return r.json()


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


def make_replicas(
    config: RouterConfig,
) -> tuple[httpx.AsyncClient, list[httpx.AsyncBaseTransport], dict[str, Replica]]:
    """Shared keep-alive pools to every replica, a client for control calls, a Replica per URL."""
    pools: list[httpx.AsyncBaseTransport] = [
        httpx.AsyncHTTPTransport(
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=128),
            # Small writes (request head, then body) must not wait for the peer's ACK.
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )
        for _ in range(POOL_SHARDS)
    ]
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(
            config.request_timeout_s, connect=config.connect_timeout_s, pool=config.gate_timeout_s
        ),
        trust_env=False,
    )
    replicas = {
        spec.url: Replica(
            spec=spec, client=client, pools=pools, health_timeout_s=config.health_timeout_s
        )
        for spec in config.replicas
    }
    return client, pools, replicas
