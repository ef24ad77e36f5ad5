"""The engine patch's SGLang glue that every supported line shares (0.5.17 and 0.5.23 alike).

- `MoriEngine`: per-scheduler state (hints, node stamps, residency counters) and the hint
  actions (typed offload, load-back), written against a few node operations each version
  module supplies (`node_tiers`, `node_locked`, `demote`, `load`, `flush_writes`, ...);
- the control message (`MoriControlReqInput/Output`) through SGLang's communicator and
  request dispatcher, applied alike on every TP rank (engine_patches/control.py);
- busy-first admission after `SchedulePolicy.calc_priority`;
- CacheSage survival scores (engine_patches/anchor_scores.py): once the router pushes them
  with the hints, nodes shared by several programs order by (type rank, survival, LRU);
- the HTTP routes POST /mori/hints and GET /mori/residency (docs/hint-protocol.md);
- SGLang's Anthropic entrypoint carrying the program id (engine_patches/messages.py).

Residency is exact and cheap: every hook that can change a node's tiers marks it dirty, and
a read reconciles only the dirty nodes (O(changes), never a tree walk).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from sglang.srt.managers.io_struct import BaseReq
from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from engine_patches import anchor_scores, messages
from engine_patches.anchor_scores import AnchorScores
from engine_patches.control import ControlPath
from engine_patches.hint_book import HintBatch, HintBook, HintError
from engine_patches.plugin import STRICT_ENV
from engine_patches.ranking import DEFAULT_HINT, CacheTier, busy_first, victim_key
from engine_patches.residency import ResidencyLedger
from engine_patches.tree_plan import NodeView, load_back_plan, offload_plan
from router.policy.types import Hint, freeing_first

log = logging.getLogger("mori.engine")

POLICY_NAME = "mori"
_S = "sglang.srt"
SCHED_POLICY = f"{_S}.managers.schedule_policy.SchedulePolicy"
SCHEDULER = f"{_S}.managers.scheduler.Scheduler"
# What the shared glue hooks or calls, in every supported line.
COMMON_TARGETS = (
    f"{SCHED_POLICY}.calc_priority",
    f"{SCHEDULER}.init_request_dispatcher",
    f"{_S}.managers.schedule_policy.CLIP_MAX_NEW_TOKENS",
    f"{_S}.mem_cache.utils._EVICTION_POLICY_FACTORIES",
    f"{_S}.mem_cache.evict_policy.EvictionStrategy",
    f"{_S}.server_args.add_radix_eviction_policy_choices",
    f"{_S}.managers.tokenizer_control_mixin._COMMUNICATOR_SPECS",
    f"{_S}.managers.io_struct.BaseReq",
    f"{_S}.entrypoints.http_server.app",
    f"{_S}.entrypoints.http_server.get_global_state",
    f"{_S}.plugins.hook_registry.HookRegistry",
    "sglang.utils.TypeBasedDispatcher",
    *messages.TARGETS,
)


def length(tensor: Any) -> int:
    return 0 if tensor is None else len(tensor)


class MoriEngine(ABC):
    """Per-scheduler-process state: hints, node stamps, residency counters, the cache."""

    def __init__(self) -> None:
        self.book = HintBook()
        self.anchors = AnchorScores()
        self.ledger = ResidencyLedger()
        self.nodes: dict[int, Any] = {}  # node id -> tree node, for stamped/observed nodes
        self.dirty: dict[int, Any] = {}
        self.cache: Any = None
        self.scheduler: Any = None  # for the running requests' reserve
        self.control = ControlPath()

    # --- what each tree differs in ------------------------------------------------------------
    @property
    @abstractmethod
    def root(self) -> Any:
        """The tree's root node."""

    @abstractmethod
    def node_tiers(self, node: Any) -> tuple[int, int]:
        """(device tokens, host tokens) the node holds."""

    @abstractmethod
    def node_locked(self, node: Any) -> bool:
        """A running request, a pending write or a pending load holds the node."""

    @abstractmethod
    def demote(self, node: Any) -> None:
        """Free the node's device copy (it has a host copy)."""

    @abstractmethod
    def load(self, node: Any, quota: int) -> int:
        """Queue host -> device for the node (and its evicted ancestors) within `quota`
        device rows; the tokens queued (0 when it did not fit)."""

    @abstractmethod
    def flush_writes(self) -> None:
        """Collect finished host backups (a collective across TP ranks)."""

    @abstractmethod
    def pools(self) -> tuple[Any, Any]:
        """(device token allocator, host KV pool)."""

    def attached(self, node: Any) -> bool:
        """The node is still in the tree (not split off, not deleted)."""
        parent = node.parent
        if parent is None or node.key is None:
            return False
        return parent.children.get(node.key.child_key(self.cache.page_size)) is node

    # --- tree bookkeeping -------------------------------------------------------------------
    def attach(self, cache: Any) -> None:
        self.cache = cache
        self.ledger, self.nodes, self.dirty = ResidencyLedger(), {}, {}
        self.control.agree = self._agree

    def _agree(self, ok: bool) -> bool:
        """All TP (and PP) ranks' `ok`, through the cache's own collective."""
        import torch

        flag = torch.tensor([int(ok)], dtype=torch.int32)
        self.cache._all_reduce(flag, torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def mark(self, node: Any) -> None:
        if node is not None and self.cache is not None and node is not self.root:
            self.dirty[node.id] = node

    def stamp(self, node: Any, program: str | None) -> None:
        self.mark(node)
        if program and node is not self.root:
            self.nodes[node.id] = node
            self.ledger.stamp(node.id, program)

    def stamp_up(self, node: Any, program: str | None) -> None:
        """Stamp the path from `node` to the root (a match or an insert touched all of it)."""
        while node is not None and node is not self.root:
            self.stamp(node, program)
            node = node.parent

    def split(self, child: Any, new_parent: Any) -> None:
        """A split: the new parent is used by everyone who used the child."""
        self.ledger.copy_programs(child.id, new_parent.id)
        self.nodes[new_parent.id] = new_parent
        self.mark(new_parent)
        self.mark(child)

    def reconcile(self) -> None:
        """Fold the dirty nodes' current lengths into the counters."""
        dirty, self.dirty = self.dirty, {}
        for nid, node in dirty.items():
            dev, host = self.node_tiers(node)
            if self.attached(node) and (dev or host):
                self.nodes[nid] = node
                self.ledger.observe(nid, dev, host)
            else:
                self.ledger.forget(nid)
                self.nodes.pop(nid, None)

    # --- eviction order ---------------------------------------------------------------------
    def victim_key(self, node: Any) -> tuple[int, float, float]:
        """(type rank, survival, LRU): a device candidate is on device, a host candidate is
        evicted; survival is CacheSage's score of a node shared by several programs (0 for
        the rest, and for every node until the router pushes scores)."""
        tier = CacheTier.DEVICE if self.node_tiers(node)[0] else CacheTier.HOST
        programs = self.ledger.programs_of(node.id)
        hints = [self.book.hint(p) or DEFAULT_HINT for p in programs]
        rank, last_access = victim_key(tier, hints, node.last_access_time)
        return rank, self.anchors.survival(programs), last_access

    # --- typed offload ----------------------------------------------------------------------
    def _views(self, program: str) -> list[NodeView]:
        views = []
        for nid in self.ledger.nodes_of(program):
            node = self.nodes.get(nid)
            if node is None:
                continue
            depth, p = 0, node
            while p.parent is not None:
                depth, p = depth + 1, p.parent
            dev, host = self.node_tiers(node)
            kids = list(node.children.values())
            views.append(
                NodeView(
                    id=nid,
                    depth=depth,
                    programs=self.ledger.programs_of(nid),
                    on_device=dev > 0,
                    backed_up=host > 0,
                    locked=self.node_locked(node),
                    children=tuple(c.id for c in kids),
                    children_on_device=tuple(c.id for c in kids if self.node_tiers(c)[0]),
                )
            )
        return views

    def offload(self, program: str) -> None:
        """Idle: free the device copy of the program's own backed-up nodes (host copy stays)."""
        for nid in offload_plan(program, self._views(program)):
            self.demote(self.nodes[nid])

    def load_back(self, program: str) -> int:
        """Busy: queue host -> device for the program's host nodes; the next prefill starts it.
        Each load takes only device rows that are free now beyond the running requests'
        reserve (as the scheduler reserves them), so it never evicts and never squeezes a
        running decode; what does not fit stays on host and loads with its request."""
        queued = 0
        for nid in load_back_plan(program, self._views(program)):
            node = self.nodes[nid]
            if not self.node_tiers(node)[0]:  # an earlier load may have brought it back
                queued += self.load(node, self.free_rows())
        return queued

    def free_rows(self) -> int:
        """Free device KV rows minus what running requests may still decode into."""
        available = int(self.pools()[0].available_size())
        return max(0, available - running_reserve(self.scheduler))

    # --- control messages -------------------------------------------------------------------
    def apply_hints(
        self,
        batch: HintBatch,
        scores: dict[str, float] | None = None,
        agents: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Apply a validated batch and its CacheSage fields (a stale batch changes nothing,
        its scores included)."""
        # Collect finished host backups first: a node whose write is still pending is locked,
        # and an idle program's offload would skip it.
        self.flush_writes()
        self.reconcile()
        applied = self.book.apply(batch, known=self.ledger.programs())
        if not applied.stale:
            self.anchors.apply(scores, agents or {})
        for program, hint in freeing_first(applied.changed):
            if hint is Hint.IDLE:
                self.offload(program)
            elif hint is Hint.BUSY:
                self.load_back(program)
        self.reconcile()
        self.forget_ended()
        return {
            "epoch": self.book.epoch,
            "stale": applied.stale,
            "residency": {p: self.ledger.residency(p).as_json() for p in batch.hints},
        }

    def forget_ended(self) -> None:
        """Forget inactive programs that hold nothing any more, their roles with them."""
        self.anchors.forget(self.book.forget_ended(self.ledger.holds))

    def residency(self) -> dict[str, Any]:
        self.reconcile()
        self.forget_ended()
        device, host = self.pools()
        programs = {*self.ledger.programs(), *self.book.types}
        return {
            "device_capacity_tokens": int(device.size),
            "host_capacity_tokens": int(host.size),
            "device_used_tokens": int(device.size - device.available_size()),
            "host_used_tokens": int(host.size - host.available_size()),
            "epoch": self.book.epoch,
            "state": {
                **self.ledger.size(),
                "hinted": len(self.book.types),
                "agents": len(self.anchors.agents),
            },
            "anchor_scores": dict(self.anchors.scores),
            "programs": {p: self._row(p) for p in sorted(programs)},
        }

    def _row(self, program: str) -> dict[str, Any]:
        """One program's residency: its hint (`hinted`: a router named it, so the hint is
        not just the default) and its tokens on each tier."""
        hint = self.book.hint(program)
        head = {"hint": (hint or DEFAULT_HINT).value, "hinted": hint is not None}
        return head | self.ledger.residency(program).as_json()

    def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.cache is None:
            return {"error": UNSUPPORTED, "status": 501}
        return self.control.run(op, body, self._dispatch)

    def _dispatch(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if op == "hints":  # everything is validated before anything changes (TP-safe)
            batch = HintBatch.parse(body)
            return self.apply_hints(batch, *anchor_scores.parse(body))
        return self.residency()


UNSUPPORTED = (
    "hints unsupported: this SGLang runs without the MORI-patched HiCache tree "
    "(start it with mori-sglang)"
)
TREES_SUPPORTED = (
    "the patch supports HiCache on a full-attention (MHA/MLA) model only "
    "(docs/engine-patch.md, supported configurations)"
)
ENGINE: MoriEngine | None = None  # this process's engine, set by the version module


def running_reserve(scheduler: Any) -> int:
    """KV rows the running requests may still need: each one's remaining new tokens (capped
    as SGLang's PrefillAdder caps them) times the scheduler's current new-token ratio."""
    if scheduler is None:
        return 0
    from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS

    ratio = scheduler.new_token_ratio_tracker.current
    remaining = (
        min(r.sampling_params.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS)
        for r in scheduler.running_batch.reqs
    )
    return int(sum(remaining) * ratio)


def key_path(engine: MoriEngine, key: Any, is_eagle: bool) -> Iterator[Any]:
    """Nodes along `key` from the root, read-only (insert has already split what it needed)."""
    page = engine.cache.page_size
    key, _ = key.maybe_to_bigram_view(is_eagle)
    key = key.page_aligned(page)
    node = engine.root
    while len(key) > 0:
        child = node.children.get(key.child_key(page))
        if child is None:
            return
        yield child
        key = key[len(child.key) :]
        node = child


# --- SGLang types ----------------------------------------------------------------------------
class MoriTypeStrategy(EvictionStrategy):
    """`--radix-eviction-policy mori`: (type rank, survival, LRU) on both tiers."""

    def get_priority(self, node: Any) -> tuple[int, float, float]:
        assert ENGINE is not None, "the mori eviction policy runs only with the MORI plugin"
        return ENGINE.victim_key(node)


class MoriControlReqInput(BaseReq, kw_only=True):
    """HTTP process -> scheduler: op "hints" (body = the hint batch) or "residency"."""

    op: str
    body: str = "{}"


class MoriControlReqOutput(BaseReq, kw_only=True):
    body: str


# --- hooks every line shares --------------------------------------------------------------------
def after_calc_priority(result: Any, policy: Any, waiting_queue: Any, *a: Any, **k: Any) -> Any:
    if ENGINE is not None:
        busy_first(waiting_queue, lambda req: ENGINE.book.hint(getattr(req, "session_id", None)))
    return result


def _handle_control(req: Any) -> Any:
    if ENGINE is None:
        answer = {"error": UNSUPPORTED, "status": 501}
    else:
        answer = ENGINE.handle(req.op, json.loads(req.body))
    return MoriControlReqOutput(body=json.dumps(answer), rid=req.rid)


def after_init_dispatcher(result: Any, scheduler: Any, *a: Any, **k: Any) -> Any:
    """The control path into this scheduler. Started by mori-sglang (STRICT_ENV), a scheduler
    whose tree the patch did not attach to (a model or flags that take another cache) stops
    here with one clear reason instead of serving with plain LRU; a plain SGLang that merely
    has the plugin installed keeps serving and answers the hint routes with 501."""
    from sglang.utils import TypeBasedDispatcher

    if ENGINE is not None:
        ENGINE.scheduler = scheduler
    if os.environ.get(STRICT_ENV) == "1" and (ENGINE is None or ENGINE.cache is None):
        kind = type(getattr(scheduler, "tree_cache", None)).__name__
        raise RuntimeError(f"MORI cannot hint this server: it runs {kind}, {TREES_SUPPORTED}")
    scheduler._request_dispatcher += TypeBasedDispatcher([(MoriControlReqInput, _handle_control)])
    return result


def register_common(engine: MoriEngine) -> None:
    """This process's engine, the eviction policy name, busy-first admission and the control
    path (every process); the HTTP routes in the main process only."""
    import multiprocessing

    from sglang.srt.mem_cache import utils as cache_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import (
        RADIX_EVICTION_POLICY_CHOICES,
        add_radix_eviction_policy_choices,
    )

    global ENGINE
    ENGINE = engine
    cache_utils._EVICTION_POLICY_FACTORIES[POLICY_NAME] = MoriTypeStrategy
    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])
    HookRegistry.register(f"{SCHED_POLICY}.calc_priority", after_calc_priority, HookType.AFTER)
    HookRegistry.register(
        f"{SCHEDULER}.init_request_dispatcher", after_init_dispatcher, HookType.AFTER
    )
    if multiprocessing.parent_process() is None:
        with contextlib.suppress(ImportError):  # offline Engine without the HTTP extras
            install_http_routes()
            messages.register()


# --- HTTP side (main process only) ------------------------------------------------------------
def _error(message: str, status: int) -> Any:
    from fastapi.responses import ORJSONResponse

    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": status}}
    return ORJSONResponse(body, status_code=status)


def _merge(answers: list[dict[str, Any]]) -> dict[str, Any]:
    """One answer per data-parallel rank: token counts add up."""
    merged = answers[0]
    for extra in answers[1:]:
        for key in (
            "device_capacity_tokens",
            "host_capacity_tokens",
            "device_used_tokens",
            "host_used_tokens",
        ):
            if key in merged:
                merged[key] += extra[key]
        field = "residency" if "residency" in merged else "programs"
        for prog, res in extra.get(field, {}).items():
            mine = merged[field].setdefault(prog, dict(res))
            if mine is not res:
                mine["device_tokens"] += res["device_tokens"]
                mine["host_tokens"] += res["host_tokens"]
    return merged


async def _ask_scheduler(op: str, body: dict[str, Any]) -> Any:
    from fastapi.responses import ORJSONResponse
    from sglang.srt.entrypoints.http_server import get_global_state

    manager = get_global_state().tokenizer_manager
    manager.auto_create_handle_loop()
    outputs = await manager.mori_communicator(MoriControlReqInput(op=op, body=json.dumps(body)))
    answers = [json.loads(o.body) for o in outputs]
    failed = next((a for a in answers if "error" in a), None)
    if failed:
        return _error(failed["error"], failed.get("status", 500))
    return ORJSONResponse(_merge(answers))


def install_http_routes() -> None:
    from sglang.srt.entrypoints.http_server import app
    from sglang.srt.managers import tokenizer_control_mixin

    specs = tokenizer_control_mixin._COMMUNICATOR_SPECS
    if not any(spec[0] == "mori" for spec in specs):
        specs.append(("mori", MoriControlReqOutput))

    async def post_hints(request: Request) -> Any:
        try:
            body = await request.json()
        except ValueError:
            return _error("body is not valid JSON", 400)
        try:
            HintBatch.parse(body)
            anchor_scores.parse(body)
        except HintError as exc:
            return _error(str(exc), 400)
        return await _ask_scheduler("hints", body)

    async def get_residency() -> Any:
        return await _ask_scheduler("residency", {})

    if not any(getattr(r, "path", None) == "/mori/hints" for r in app.routes):
        app.add_api_route("/mori/hints", post_hints, methods=["POST"])
        app.add_api_route("/mori/residency", get_residency, methods=["GET"])
