"""One SGLang replica as a pure cost model: KV cache tiers, eviction, batching, timing.

Used twice: the discrete-event simulator (`router.sim.simulator`, virtual clock) and the
HTTP replica emulator (`router.sim.emulator`, wall clock). Both drive it the same way; the
engine never reads a clock, every call passes `now` (seconds, non-decreasing):

    engine = ReplicaEngine(preset, EngineMode("typed", True), gpu_tokens, host_tokens)
    engine.submit(rid, program_id, input_tokens, output_tokens, now)   # request arrives
    t = engine.next_event_time()       # when to call advance next (None: nothing scheduled)
    for ev in engine.advance(now):     # FirstToken(rid, t, cached_device, cached_host)
        ...                            # Done(rid, t, ok)
    engine.generated(rid, now)         # tokens decoded so far (streaming)
    engine.abort(rid, now)             # client gone
    engine.apply_hints({pid: Hint.IDLE}, now, full=False) -> {pid: (device, host)}
    engine.residency(pid) -> (device_tokens, host_tokens)
    engine.usage() -> dict             # capacities, used tokens, running / queued counts

Every mutating call first runs the engine up to `now`; events produced on the way are kept
and returned by the next `advance`, so none is lost whatever the calling order.

Cache model (per program, not per radix node): a program's last context (prompt + output)
is the prefix of its next prompt. Its KV is a prefix on device (`dev` tokens) and a prefix
on host DRAM (`host` tokens, HiCache write-through: every finished request's context is
backed up to host). A request hits `min(dev, prompt)` on device, then host tokens beyond
that (loaded over PCIe), and recomputes the rest (prefill). Eviction takes tokens off the
end of a program's prefix, like leaf-first radix eviction. As in HiRadixCache, the host only
evicts host-only tokens (`host - dev`: their device copy is gone); a backup of tokens still
on device is kept, so a full host refuses (the rest of) a write-through, and device tokens
without a backup are dropped when evicted (backup is retried when the program's next
request leaves the batch, as SGLang retries it on the next insert through the node):

- `lru` (stock SGLang): least recently used first on both tiers; hints are ignored.
- `typed` (MORI patch): both tiers evict inactive, then idle, then busy; LRU within a type.
  Hints act at once: `idle` drops the device copy if it is all backed up (a device-only
  suffix pins it, as in the patch), `busy` loads host tokens back to device ahead of the next
  request (costing PCIe time), `inactive` only ranks the program first to go. Busy-typed
  requests are admitted before others.

Timing: prefill batches stall decode (SGLang runs prefill and decode batches in turn, no
mixed chunks by default). A prefill batch lasts max(compute of the new tokens, the PCIe
loads of its host hits), since HiCache loads layer by layer under the compute. Decode is
continuous batching; one iteration costs weights + KV read from HBM (grows with batch and
total context) plus a fixed overhead. Between events the batch is constant, so a run of k
iterations is timed in closed form (arithmetic series) instead of one event per token.

Admission: a request enters the batch when its whole context (prompt + output) fits on
device next to the running requests' reserved contexts, evicting unlocked cache as needed;
otherwise it waits in the engine queue (head-of-line, as SGLang's PrefillAdder stops at the
first request that does not fit). A request larger than the whole device fails at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from router.policy.types import EngineMode, Hint
from router.sim.presets import Preset

# Eviction rank per hint: lower goes first. Unhinted programs rank as busy (stock behaviour
# for programs the router never typed). The host uses the device order, not the paper's
# inactive-busy-idle: host victims are host-only tokens, a program's only copy, and a busy
# program's are the ones its busy hint is loading back (docs/policy.md, "Typed eviction").
_DEVICE_RANK = {Hint.INACTIVE: 0, Hint.IDLE: 1, Hint.BUSY: 2}
_HOST_RANK = _DEVICE_RANK


def _on_device(e: _Entry) -> int:
    return e.dev


def _host_only(e: _Entry) -> int:
    """Host tokens whose device copy is gone: the only host tokens HiCache may evict."""
    return max(0, e.host - e.dev)


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill finished: the first output token exists. Cached tokens are prompt tokens."""

    rid: str
    t: float
    cached_device: int
    cached_host: int


@dataclass(frozen=True, slots=True)
class Done:
    rid: str
    t: float
    ok: bool = True


EngineEvent = FirstToken | Done


class CostModel:
    """Seconds for prefill, one decode iteration and a host->device copy, from a preset."""

    def __init__(self, preset: Preset) -> None:
        m = preset.model
        self.preset = preset
        self._linear_flops = 2 * m.active_params  # per token through the weights
        self._attn_flops = 4 * m.layers * m.q_heads * m.head_dim  # per (query, key) pair
        self._kv_s = preset.kv_bytes_per_token / preset.bytes_s  # read one token's KV
        self._load_s = preset.kv_bytes_per_token / preset.pcie_bytes_s
        self._dense = m.active_params == m.total_params

    def prefill_s(self, new_tokens: int, prefix_tokens: int) -> float:
        """Compute `new_tokens` of prompt on top of `prefix_tokens` already in KV."""
        if new_tokens <= 0:
            return 0.0
        attn = self._attn_flops * new_tokens * (prefix_tokens + new_tokens / 2)
        return (self._linear_flops * new_tokens + attn) / self.preset.flops_s

    def weights_read_s(self, batch: int) -> float:
        """Dense models read all weights per iteration; an MoE reads the experts its batch
        routes to (bounded by all of them; assumes distinct experts per token)."""
        m = self.preset.model
        params = m.total_params if self._dense else min(m.total_params, m.active_params * batch)
        return params * m.dtype_bytes / self.preset.bytes_s

    def step_coeffs(self, batch: int) -> tuple[float, float]:
        """Iteration time = a + b x total_context: (a, b) for a batch of `batch` requests."""
        p = self.preset
        linear = max(self.weights_read_s(batch), batch * self._linear_flops / p.flops_s)
        return linear + p.step_overhead_s + batch * p.seq_overhead_s, self._kv_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        a, b = self.step_coeffs(batch)
        return a + b * context_tokens

    def load_s(self, tokens: int) -> float:
        """Host DRAM -> HBM over PCIe."""
        return tokens * self._load_s


@dataclass(slots=True)
class _Entry:
    """Cached KV of one program on this replica."""

    dev: int = 0
    host: int = 0
    hint: Hint = Hint.BUSY
    last_use: float = 0.0
    running: str | None = None  # rid of the request holding it (locked on device)
    ready_at: float = 0.0  # a hint-driven load-back lands at this time
    prefetched: int = 0  # device tokens that came from host by a busy hint, not yet used


@dataclass(slots=True)
class _Request:
    rid: str
    program_id: str
    input_tokens: int
    output_tokens: int
    arrival: float
    reused_limit: int | None
    generated: int = 0
    dev_hit: int = 0  # prefix found on device at admission
    host_hit: int = 0  # prefix loaded from host at admission
    cached: tuple[int, int] = (0, 0)  # reported (device, host): prefetched tokens count as host
    aborted: bool = False


@dataclass(slots=True)
class _Decode:
    """A run of `n` decode iterations with a constant batch, starting at `start`."""

    start: float
    n: int
    a: float
    b: float
    context: int  # total context of the batch at the first iteration
    batch: int

    def elapsed(self, k: int) -> float:
        """Time of the first k iterations; context grows by `batch` per iteration."""
        return k * (self.a + self.b * self.context) + self.b * self.batch * k * (k - 1) / 2

    def done_by(self, t: float) -> int:
        """Iterations finished by time t (0..n)."""
        dt = t - self.start
        if dt <= 0:
            return 0
        qa, qb = self.b * self.batch / 2, self.a + self.b * self.context - self.b * self.batch / 2
        k = int(dt / qb) if qa == 0 else int((-qb + math.sqrt(qb * qb + 4 * qa * dt)) / (2 * qa))
        k = max(0, min(self.n, k))
        while k < self.n and self.elapsed(k + 1) <= dt:
            k += 1
        while k > 0 and self.elapsed(k) > dt:
            k -= 1
        return k

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.n)


@dataclass(slots=True)
class _Prefill:
    end: float
    batch: list[_Request] = field(default_factory=list)


class ReplicaEngine:
    """One replica. Pure: no clock, no I/O; see the module docstring for the protocol."""

    def __init__(self, preset: Preset, mode: EngineMode, gpu_tokens: int, host_tokens: int):
        if mode.eviction not in ("lru", "typed"):
            raise ValueError(f"unknown eviction {mode.eviction!r}; use 'lru' or 'typed'")
        self.cost = CostModel(preset)
        self.mode = mode
        self.gpu_tokens = int(gpu_tokens)
        self.host_tokens = int(host_tokens) if mode.host_tier else 0
        self._entries: dict[str, _Entry] = {}
        self._requests: dict[str, _Request] = {}
        self._queue: list[_Request] = []
        self._running: list[_Request] = []
        self._phase: _Prefill | _Decode | None = None
        self._t = 0.0  # engine clock: where the current phase starts or the last one ended
        self._events: list[EngineEvent] = []
        self._dev_used = 0
        self._host_used = 0
        self._active = 0  # device tokens reserved by running requests
        self._pcie_free_at = 0.0
        self._protected: str | None = None  # program being admitted: its hits are locked
        self.stats = {"prefill_s": 0.0, "decode_s": 0.0, "prefill_tokens": 0, "loaded_tokens": 0}

    # protocol ---------------------------------------------------------------------------
    def submit(
        self,
        rid: str,
        program_id: str,
        input_tokens: int,
        output_tokens: int,
        now: float,
        reused_tokens: int | None = None,
    ) -> None:
        """Queue a request. `reused_tokens` (optional) caps the prefix it may reuse, for
        traces whose prompt shares less than the whole previous context."""
        if rid in self._requests:
            raise ValueError(f"request {rid!r} already submitted")
        self._run(now)
        req = _Request(rid, program_id, int(input_tokens), int(output_tokens), now, reused_tokens)
        self._requests[rid] = req
        if req.input_tokens + req.output_tokens > self.gpu_tokens:
            self._finish(req, now, ok=False)
            return
        self._queue.append(req)
        self._kick(now)

    def advance(self, now: float) -> list[EngineEvent]:
        """Run the engine up to `now`; events in time order (including buffered ones)."""
        self._run(now)
        out, self._events = self._events, []
        return out

    def next_event_time(self) -> float | None:
        """When the current prefill or decode run ends (an event may or may not follow)."""
        if self._events:
            return self._t
        if isinstance(self._phase, _Prefill):
            return self._phase.end
        if isinstance(self._phase, _Decode):
            return self._phase.end
        return None

    def generated(self, rid: str, now: float | None = None) -> int:
        """Output tokens produced so far (first token included)."""
        req = self._requests.get(rid)
        if req is None:
            return 0
        if now is not None and isinstance(self._phase, _Decode) and req in self._running:
            return req.generated + self._phase.done_by(now)
        return req.generated

    def abort(self, rid: str, now: float) -> None:
        """Drop a request (client gone). Like SGLang, a request in the batch leaves at the
        next iteration boundary; what it computed stays cached, unlocked."""
        self._run(now)
        req = self._requests.pop(rid, None)
        if req is None:
            return
        if req in self._queue:
            self._queue.remove(req)
        else:
            req.aborted = True
            self._interrupt(now)

    def apply_hints(
        self, hints: dict[str, Hint], now: float, full: bool = False
    ) -> dict[str, tuple[int, int]]:
        """Type programs (typed mode acts on them; lru mode only records residency)."""
        self._run(now)
        if self.mode.eviction == "typed":
            if full:
                for pid, e in self._entries.items():
                    if pid not in hints:
                        e.hint = Hint.INACTIVE
            for pid, hint in hints.items():
                self._apply_hint(pid, Hint(hint), now)
            self._interrupt(now)
            self._kick(now)
        return {pid: self.residency(pid) for pid in hints}

    def residency(self, program_id: str) -> tuple[int, int]:
        e = self._entries.get(program_id)
        return (e.dev, e.host) if e else (0, 0)

    def usage(self) -> dict:
        """Capacities and occupancy now; `stats` holds cumulative busy times and tokens."""
        return {
            "device_capacity_tokens": self.gpu_tokens,
            "host_capacity_tokens": self.host_tokens,
            "device_used_tokens": self._dev_used,
            "host_used_tokens": self._host_used,
            "device_active_tokens": self._active,
            "running": len(self._running) + (len(self._phase.batch) if self._prefilling else 0),
            "queued": len(self._queue),
        }

    def programs(self) -> dict[str, dict]:
        """Residency and hint of every program with KV here (for /mori/residency)."""
        return {
            pid: {"hint": e.hint.value, "device_tokens": e.dev, "host_tokens": e.host}
            for pid, e in self._entries.items()
        }

    # engine loop ------------------------------------------------------------------------
    @property
    def _prefilling(self) -> bool:
        return isinstance(self._phase, _Prefill)

    def _run(self, now: float) -> None:
        """Finish every phase that ends by `now`, starting the next one each time."""
        while self._phase is not None and self._phase_end() <= now:
            if isinstance(self._phase, _Prefill):
                self._end_prefill(self._phase)
            else:
                self._end_decode(self._phase)
            self._phase = None
            self._kick(self._t)

    def _phase_end(self) -> float:
        return self._phase.end  # type: ignore[union-attr]

    def _kick(self, now: float) -> None:
        """Idle engine: start a prefill batch if anything fits, else a decode run."""
        if self._phase is not None:
            return
        self._t = max(self._t, now)
        batch = self._admit(self._t)
        if batch:
            self._phase = _Prefill(self._prefill_end(batch, self._t), batch)
            self.stats["prefill_s"] += self._phase.end - self._t
        elif self._running:
            batch_n = len(self._running)
            a, b = self.cost.step_coeffs(batch_n)
            context = sum(r.input_tokens + r.generated for r in self._running)
            n = min(r.output_tokens - r.generated for r in self._running)
            self._phase = _Decode(self._t, n, a, b, context, batch_n)

    def _interrupt(self, now: float) -> None:
        """Something changed (arrival, freed memory): end the decode run at the iteration
        boundary after `now` so the scheduler looks again, as SGLang does every iteration."""
        if isinstance(self._phase, _Decode):
            k = min(self._phase.n, self._phase.done_by(now) + 1)
            if k < self._phase.n:
                self._phase.n = k

    def _end_prefill(self, phase: _Prefill) -> None:
        self._t = phase.end
        for req in phase.batch:
            if req.aborted:
                self._release(req, req.dev_hit + req.host_hit, phase.end)
                continue
            self._events.append(FirstToken(req.rid, phase.end, *req.cached))
            req.generated = min(1, req.output_tokens)
            if req.generated >= req.output_tokens:
                self._finish(req, phase.end)
            else:
                self._running.append(req)

    def _end_decode(self, phase: _Decode) -> None:
        self.stats["decode_s"] += phase.end - self._t
        self._t = phase.end
        still = []
        for req in self._running:
            req.generated += phase.n
            if req.aborted:
                self._release(req, req.input_tokens + req.generated, phase.end)
            elif req.generated >= req.output_tokens:
                self._finish(req, phase.end)
            else:
                still.append(req)
        self._running = still

    def _finish(self, req: _Request, t: float, ok: bool = True) -> None:
        if ok:
            self._release(req, req.input_tokens + req.output_tokens, t)
        self._requests.pop(req.rid, None)
        self._events.append(Done(req.rid, t, ok))

    # admission and prefill timing -------------------------------------------------------------
    def _order(self) -> list[_Request]:
        if self.mode.eviction != "typed":
            return self._queue
        busy = [r for r in self._queue if self._hint(r.program_id) is Hint.BUSY]
        return busy + [r for r in self._queue if self._hint(r.program_id) is not Hint.BUSY]

    def _hint(self, pid: str) -> Hint:
        e = self._entries.get(pid)
        return e.hint if e else Hint.BUSY

    def _admit(self, now: float) -> list[_Request]:
        batch = []
        for req in self._order():
            e = self._entries.get(req.program_id)
            if e is not None and e.running is not None:
                continue  # one request per program at a time; the next waits its turn
            if not self._reserve(req, now):
                break
            batch.append(req)
        for req in batch:
            self._queue.remove(req)
        return batch

    def _reserve(self, req: _Request, now: float) -> bool:
        """Lock the request's whole context on device, evicting cache if needed."""
        e = self._entries.setdefault(req.program_id, _Entry(last_use=now))
        limit = req.input_tokens if req.reused_limit is None else req.reused_limit
        limit = min(limit, req.input_tokens)
        dev_hit = min(e.dev, limit)
        host_hit = max(0, min(e.host, limit) - dev_hit) if self.mode.host_tier else 0
        need = req.input_tokens + req.output_tokens - dev_hit
        room = self.gpu_tokens - self._dev_used + (e.dev - dev_hit)
        if need > room:
            self._protected = req.program_id  # write-backs must not evict its host hit
            try:
                if not self._evict_device(need - room, keep=req.program_id):
                    return False
            finally:
                self._protected = None
        self._set_dev(e, req.input_tokens + req.output_tokens)
        from_prefetch = min(e.prefetched, dev_hit)
        req.dev_hit, req.host_hit = dev_hit, host_hit
        req.cached = (dev_hit - from_prefetch, host_hit + from_prefetch)
        e.prefetched = 0
        e.running = req.rid
        e.last_use = now
        self._active += req.input_tokens + req.output_tokens
        return True

    def _prefill_end(self, batch: list[_Request], now: float) -> float:
        """Compute of the new tokens, overlapped with the PCIe loads of host hits."""
        compute = 0.0
        ready = now
        for req in batch:
            prefix = req.dev_hit + req.host_hit
            compute += self.cost.prefill_s(req.input_tokens - prefix, prefix)
            self.stats["prefill_tokens"] += req.input_tokens - prefix
            self.stats["loaded_tokens"] += req.host_hit
            ready = max(ready, self._entries[req.program_id].ready_at)
            if req.host_hit:
                self._pcie_free_at = max(self._pcie_free_at, now) + self.cost.load_s(req.host_hit)
                ready = max(ready, self._pcie_free_at)
        return max(now + compute, ready)

    def _release(self, req: _Request, context: int, now: float) -> None:
        """The request left the batch: unlock its program's KV and back it up to host."""
        e = self._entries.get(req.program_id)
        self._active -= req.input_tokens + req.output_tokens
        if e is None or e.running != req.rid:
            return
        e.running = None
        e.last_use = now
        self._set_dev(e, min(e.dev, context))
        if self.mode.host_tier:
            self._write_host(req.program_id, e, e.dev, now)
        if e.hint is Hint.IDLE and self.mode.eviction == "typed":
            self._offload(e)  # idle hint arrived while it ran: act on it now

    # cache tiers -----------------------------------------------------------------------------
    def _set_dev(self, e: _Entry, tokens: int) -> None:
        self._dev_used += tokens - e.dev
        e.dev = tokens

    def _set_host(self, e: _Entry, tokens: int) -> None:
        self._host_used += tokens - e.host
        e.host = tokens

    def _write_host(self, pid: str, e: _Entry, tokens: int, now: float) -> None:
        """Back up a device prefix to host (write-through); D2H runs off the critical path.

        Like HiRadixCache.write_backup: evict host-only copies to make room, and back up only
        what then fits. The rest stays device-only (dropped if the device evicts it) until the
        program's next request leaves the batch and tries again.
        """
        if tokens <= e.host:
            return
        short = tokens - e.host - (self.host_tokens - self._host_used)
        if short > 0:
            self._evict_host(short, now, keep=pid)
        self._set_host(e, min(tokens, e.host + self.host_tokens - self._host_used))

    def _offload(self, e: _Entry) -> None:
        """Idle: drop the device copy if it is all backed up. A device-only suffix pins its
        prefix (HiCache evicts children first, and the patch demotes only backed-up nodes)."""
        if e.host >= e.dev:
            self._set_dev(e, 0)
            e.prefetched = 0

    def _victims(self, ranks: dict[Hint, int], keep: str, evictable):
        """Unlocked programs with `evictable(entry) > 0` tokens, first to go first."""
        typed = self.mode.eviction == "typed"
        cands = [
            (pid, e)
            for pid, e in self._entries.items()
            if pid not in (keep, self._protected) and e.running is None and evictable(e) > 0
        ]
        cands.sort(key=lambda c: (ranks[c[1].hint] if typed else 0, c[1].last_use))
        return cands

    def _evict_device(self, tokens: int, keep: str, max_rank: int = 99) -> bool:
        """Free `tokens` device tokens from unlocked programs; False if it cannot."""
        victims = self._victims(_DEVICE_RANK, keep, _on_device)
        if self.mode.eviction == "typed":
            victims = [(p, e) for p, e in victims if _DEVICE_RANK[e.hint] <= max_rank]
        if sum(e.dev for _, e in victims) < tokens:
            return False
        for _, e in victims:
            take = min(tokens, e.dev)
            self._set_dev(e, e.dev - take)  # tokens beyond e.host had no backup: dropped
            e.prefetched = min(e.prefetched, e.dev)
            tokens -= take
            if tokens <= 0:
                break
        return True

    def _evict_host(self, tokens: int, now: float, keep: str) -> None:
        """Free host tokens from host-only copies (HiRadixCache.evict_host skips nodes still on
        device): a program's backup of tokens it holds on device is never a victim."""
        for pid, e in self._victims(_HOST_RANK, keep, _host_only):
            take = min(tokens, _host_only(e))
            self._set_host(e, e.host - take)
            tokens -= take
            if e.dev == 0 and e.host == 0 and e.running is None:
                del self._entries[pid]
            if tokens <= 0:
                return

    def _apply_hint(self, pid: str, hint: Hint, now: float) -> None:
        e = self._entries.get(pid)
        if e is None:
            if hint is Hint.INACTIVE:
                return
            e = self._entries[pid] = _Entry(last_use=now)
        e.hint = hint
        if e.running is not None:
            return  # applied when the request leaves the batch (see _release)
        if hint is Hint.IDLE and self.mode.host_tier and e.dev:
            self._offload(e)
        elif hint is Hint.BUSY and self.mode.host_tier and e.host > e.dev:
            self._load_back(pid, e, now)

    def _load_back(self, pid: str, e: _Entry, now: float) -> None:
        """Prefetch host tokens to device, evicting only inactive or idle programs for it."""
        tokens = e.host - e.dev
        free = self.gpu_tokens - self._dev_used
        if tokens > free and not self._evict_device(
            tokens - free, keep=pid, max_rank=_DEVICE_RANK[Hint.IDLE]
        ):
            return
        self._pcie_free_at = max(self._pcie_free_at, now) + self.cost.load_s(tokens)
        self.stats["loaded_tokens"] += tokens
        e.ready_at = self._pcie_free_at
        e.prefetched += tokens
        self._set_dev(e, e.host)
