"""The MORI engine patch for SGLang 0.5.17 (HiRadixCache). Every SGLang-specific name lives here.

What it installs (through SGLang's plugin hook registry, in every SGLang process):
- stamping: radix nodes remember the programs (request `session_id`) that inserted, split or
  matched them; kept in a ResidencyLedger keyed by node id;
- eviction policy "mori" (`--radix-eviction-policy mori`): (type rank, LRU) on both tiers;
- typed offload on hint transitions: idle -> demote the program's own backed-up device nodes,
  busy -> queue load-back of its host nodes for the next prefill;
- busy-first admission: a stable re-sort after the scheduling policy's own order;
- CacheSage survival scores (engine_patches/anchor_scores.py): nodes shared by several
  programs order by (type rank, survival, LRU) once the router pushes scores;
- control messages + HTTP routes POST /mori/hints and GET /mori/residency (docs/hint-protocol.md).

Residency is exact and cheap: every hook that can change a node's tiers marks it dirty, and a
read reconciles only the dirty nodes (O(changes), never a tree walk).
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import multiprocessing
import pkgutil
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from sglang.srt.managers.io_struct import BaseReq
from sglang.srt.mem_cache.evict_policy import EvictionStrategy

from engine_patches import anchor_scores
from engine_patches.anchor_scores import AnchorScores
from engine_patches.hint_book import HintBatch, HintBook, HintError
from engine_patches.ranking import DEFAULT_HINT, CacheTier, busy_first, victim_key
from engine_patches.residency import ResidencyLedger
from engine_patches.tree_plan import NodeView, load_back_plan, offload_plan
from router.policy.types import Hint

log = logging.getLogger("mori.engine")

SGLANG_VERSION = "0.5.17"
POLICY_NAME = "mori"

_S = "sglang.srt"
HIRADIX = f"{_S}.mem_cache.hiradix_cache.HiRadixCache"
RADIX = f"{_S}.mem_cache.radix_cache.RadixCache"
EVENTS = f"{_S}.mem_cache.events.KVCacheEventMixin"
SCHED_POLICY = f"{_S}.managers.schedule_policy.SchedulePolicy"
SCHEDULER = f"{_S}.managers.scheduler.Scheduler"

# Everything the patch hooks or calls; the launcher refuses to start if one is missing.
HOOK_TARGETS = (
    f"{HIRADIX}.__init__",
    f"{HIRADIX}.insert",
    f"{HIRADIX}.match_prefix",
    f"{HIRADIX}._split_node",
    f"{HIRADIX}.write_backup",
    f"{HIRADIX}.reset",
    f"{HIRADIX}._evict_backuped",
    f"{HIRADIX}.load_back",
    f"{RADIX}.cache_finished_req",
    f"{RADIX}.cache_unfinished_req",
    f"{EVENTS}._record_store_event",
    f"{EVENTS}._record_remove_event",
    f"{SCHED_POLICY}.calc_priority",
    f"{SCHEDULER}.init_request_dispatcher",
)
OTHER_TARGETS = (
    f"{_S}.mem_cache.utils._EVICTION_POLICY_FACTORIES",
    f"{_S}.mem_cache.evict_policy.EvictionStrategy",
    f"{_S}.server_args.add_radix_eviction_policy_choices",
    f"{_S}.managers.tokenizer_control_mixin._COMMUNICATOR_SPECS",
    f"{_S}.managers.io_struct.BaseReq",
    f"{_S}.entrypoints.http_server.app",
    f"{_S}.entrypoints.http_server.get_global_state",
    "sglang.utils.TypeBasedDispatcher",
)


def missing_targets() -> list[str]:
    """Dotted names the patch needs that this SGLang lacks (empty when all resolve)."""
    missing = []
    for target in (*HOOK_TARGETS, *OTHER_TARGETS):
        try:
            pkgutil.resolve_name(target)
        except (ImportError, AttributeError, ValueError):
            missing.append(target)
    return missing


# The program whose request is being cached right now (set around cache_*_req).
_PROGRAM: contextvars.ContextVar[str | None] = contextvars.ContextVar("mori_program", default=None)


def _length(tensor: Any) -> int:
    return 0 if tensor is None else len(tensor)


class MoriEngine:
    """Per-scheduler-process state: hints, node stamps, residency counters, the cache."""

    def __init__(self) -> None:
        self.book = HintBook()
        self.anchors = AnchorScores()
        self.ledger = ResidencyLedger()
        self.nodes: dict[int, Any] = {}  # node id -> TreeNode, for stamped/observed nodes
        self.dirty: dict[int, Any] = {}
        self.cache: Any = None

    # --- tree bookkeeping -------------------------------------------------------------------
    def attach(self, cache: Any) -> None:
        self.cache = cache
        self.ledger, self.nodes, self.dirty = ResidencyLedger(), {}, {}

    def mark(self, node: Any) -> None:
        if node is not None and self.cache is not None and node is not self.cache.root_node:
            self.dirty[node.id] = node

    def stamp(self, node: Any, program: str | None) -> None:
        self.mark(node)
        if program and node is not self.cache.root_node:
            self.nodes[node.id] = node
            self.ledger.stamp(node.id, program)

    def stamp_up(self, node: Any, program: str | None) -> None:
        """Stamp the path from `node` to the root (a match or an insert touched all of it)."""
        while node is not None and node is not self.cache.root_node:
            self.stamp(node, program)
            node = node.parent

    def _attached(self, node: Any) -> bool:
        parent = node.parent
        if parent is None or node.key is None:
            return False
        return parent.children.get(node.key.child_key(self.cache.page_size)) is node

    def reconcile(self) -> None:
        """Fold the dirty nodes' current lengths into the counters."""
        dirty, self.dirty = self.dirty, {}
        for nid, node in dirty.items():
            dev, host = _length(node.value), _length(node.host_value)
            if self._attached(node) and (dev or host):
                self.nodes[nid] = node
                self.ledger.observe(nid, dev, host)
            else:
                self.ledger.forget(nid)
                self.nodes.pop(nid, None)

    # --- eviction order ---------------------------------------------------------------------
    def hints_of(self, node: Any) -> list[Hint]:
        progs = self.ledger.programs_of(node.id)
        return [self.book.hint(p) or DEFAULT_HINT for p in progs]

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
            kids = tuple(c.id for c in node.children.values())
            views.append(
                NodeView(
                    id=nid,
                    depth=depth,
                    programs=self.ledger.programs_of(nid),
                    on_device=node.value is not None,
                    backed_up=node.host_value is not None,
                    locked=node.lock_ref > 0
                    or node.write_through_pending_id is not None
                    or node.host_ref_counter > 0,
                    children=kids,
                    children_on_device=tuple(
                        c.id for c in node.children.values() if c.value is not None
                    ),
                )
            )
        return views

    def offload(self, program: str) -> int:
        """Idle: free the device copy of the program's own backed-up nodes (host copy stays)."""
        freed = 0
        for nid in offload_plan(program, self._views(program)):
            freed += self.cache._evict_backuped(self.nodes[nid])
        return freed

    def load_back(self, program: str) -> int:
        """Busy: queue host -> device for the program's host nodes; the next prefill starts it."""
        queued = 0
        for nid in load_back_plan(program, self._views(program)):
            node = self.nodes[nid]
            if node.value is None:  # an earlier load in this loop may have brought it back
                queued += _length(self.cache.load_back(node))
        return queued

    # --- control messages -------------------------------------------------------------------
    def apply_hints(self, batch: HintBatch) -> dict[str, Any]:
        # Collect finished host backups first: a node whose write is still pending is locked,
        # and an idle program's offload would skip it.
        self.cache.writing_check()
        self.reconcile()
        applied = self.book.apply(batch, known=self.ledger.programs())
        for program, hint in sorted(applied.changed.items()):
            if hint is Hint.IDLE:
                self.offload(program)
            elif hint is Hint.BUSY:
                self.load_back(program)
        self.reconcile()
        return {
            "epoch": self.book.epoch,
            "stale": applied.stale,
            "residency": {p: self.ledger.residency(p).as_json() for p in batch.hints},
        }

    def residency(self) -> dict[str, Any]:
        self.reconcile()
        cache = self.cache
        alloc, host = cache.token_to_kv_pool_allocator, cache.cache_controller.mem_pool_host
        programs = {*self.ledger.programs(), *self.book.types}
        return {
            "device_capacity_tokens": int(alloc.size),
            "host_capacity_tokens": int(host.size),
            "device_used_tokens": int(alloc.size - alloc.available_size()),
            "host_used_tokens": int(host.size - host.available_size()),
            "epoch": self.book.epoch,
            "anchor_scores": dict(self.anchors.scores),
            "programs": {
                p: {"hint": (self.book.hint(p) or DEFAULT_HINT).value}
                | self.ledger.residency(p).as_json()
                for p in sorted(programs)
            },
        }

    def handle(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.cache is None:
            return {"error": "MORI needs HiCache: start with --enable-hierarchical-cache"}
        if op == "hints":
            batch = HintBatch.parse(body)
            self.anchors.apply(body)
            return self.apply_hints(batch)
        return self.residency()


ENGINE = MoriEngine()


# --- SGLang types ----------------------------------------------------------------------------
class MoriTypeStrategy(EvictionStrategy):
    """(type rank, survival, LRU): a device candidate is on device, a host candidate is
    evicted; survival is CacheSage's score of a shared node (0 for the rest)."""

    def get_priority(self, node: Any) -> tuple[int, float, float]:
        tier = CacheTier.HOST if node.value is None else CacheTier.DEVICE
        rank, last_access = victim_key(tier, ENGINE.hints_of(node), node.last_access_time)
        return rank, ENGINE.anchors.survival(ENGINE.ledger.programs_of(node.id)), last_access


class MoriControlReqInput(BaseReq, kw_only=True):
    """HTTP process -> scheduler: op "hints" (body = the hint batch) or "residency"."""

    op: str
    body: str = "{}"


class MoriControlReqOutput(BaseReq, kw_only=True):
    body: str


# --- hooks ------------------------------------------------------------------------------------
def _after_cache_init(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    ENGINE.attach(cache)
    return result


def _key_path(cache: Any, key: Any) -> Iterator[Any]:
    """Nodes along `key` from the root, read-only (insert has already split what it needed)."""
    key, _ = key.maybe_to_bigram_view(cache.is_eagle)
    key = key.page_aligned(cache.page_size)
    node = cache.root_node
    while len(key) > 0:
        child = node.children.get(key.child_key(cache.page_size))
        if child is None:
            return
        yield child
        key = key[len(child.key) :]
        node = child


def _after_insert(result: Any, cache: Any, params: Any, *a: Any, **k: Any) -> Any:
    if cache is ENGINE.cache and params.key is not None:
        program = _PROGRAM.get()
        for node in _key_path(cache, params.key):
            ENGINE.stamp(node, program)
    return result


def _after_match(result: Any, cache: Any, params: Any, *a: Any, **k: Any) -> Any:
    req = getattr(params, "req", None)
    program = getattr(req, "session_id", None)
    if cache is ENGINE.cache and program:
        ENGINE.stamp_up(result.last_device_node, program)
        ENGINE.stamp_up(result.last_host_node, program)
    return result


def _after_split(new_node: Any, cache: Any, key: Any, child: Any, *a: Any, **k: Any) -> Any:
    if cache is ENGINE.cache:
        ENGINE.ledger.copy_programs(child.id, new_node.id)
        ENGINE.nodes[new_node.id] = new_node
        ENGINE.mark(new_node)
        ENGINE.mark(child)
    return new_node


def _after_node_event(result: Any, cache: Any, node: Any, *a: Any, **k: Any) -> Any:
    if cache is ENGINE.cache:
        ENGINE.mark(node)
    return result


def _after_reset(result: Any, cache: Any, *a: Any, **k: Any) -> Any:
    if cache is ENGINE.cache:
        ENGINE.attach(cache)
    return result


def _around_cache_req(original: Any, cache: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    token = _PROGRAM.set(getattr(req, "session_id", None))
    try:
        return original(cache, req, *args, **kwargs)
    finally:
        _PROGRAM.reset(token)


def _after_calc_priority(result: Any, policy: Any, waiting_queue: Any, *a: Any, **k: Any) -> Any:
    busy_first(waiting_queue, lambda req: ENGINE.book.hint(getattr(req, "session_id", None)))
    return result


def _handle_control(req: Any) -> Any:
    try:
        answer = ENGINE.handle(req.op, json.loads(req.body))
    except HintError as exc:
        answer = {"error": str(exc), "status": 400}
    except Exception as exc:  # answered as JSON, never a dead scheduler
        log.exception("MORI control message failed")
        answer = {"error": f"{type(exc).__name__}: {exc}", "status": 500}
    return MoriControlReqOutput(body=json.dumps(answer), rid=req.rid)


def _after_init_dispatcher(result: Any, scheduler: Any, *a: Any, **k: Any) -> Any:
    from sglang.utils import TypeBasedDispatcher

    dispatch = TypeBasedDispatcher([(MoriControlReqInput, _handle_control)])
    scheduler._request_dispatcher += dispatch
    return result


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
        for key in ("device_capacity_tokens", "host_capacity_tokens"):
            if key in merged:
                merged[key] += extra[key]
        for key in ("device_used_tokens", "host_used_tokens"):
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


def _install_http_routes() -> None:
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


# --- registration -----------------------------------------------------------------------------
def register() -> None:
    """Called by SGLang's plugin loader in every process (main, schedulers, detokenizer)."""
    from sglang.srt.mem_cache import utils as cache_utils
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import (
        RADIX_EVICTION_POLICY_CHOICES,
        add_radix_eviction_policy_choices,
    )

    cache_utils._EVICTION_POLICY_FACTORIES[POLICY_NAME] = MoriTypeStrategy
    if POLICY_NAME not in RADIX_EVICTION_POLICY_CHOICES:
        add_radix_eviction_policy_choices([POLICY_NAME])

    after = HookType.AFTER
    hooks = [
        (f"{HIRADIX}.__init__", _after_cache_init, after),
        (f"{HIRADIX}.insert", _after_insert, after),
        (f"{HIRADIX}.match_prefix", _after_match, after),
        (f"{HIRADIX}._split_node", _after_split, after),
        (f"{HIRADIX}.write_backup", _after_node_event, after),
        (f"{HIRADIX}.reset", _after_reset, after),
        (f"{RADIX}.cache_finished_req", _around_cache_req, HookType.AROUND),
        (f"{RADIX}.cache_unfinished_req", _around_cache_req, HookType.AROUND),
        (f"{EVENTS}._record_store_event", _after_node_event, after),
        (f"{EVENTS}._record_remove_event", _after_node_event, after),
        (f"{SCHED_POLICY}.calc_priority", _after_calc_priority, after),
        (f"{SCHEDULER}.init_request_dispatcher", _after_init_dispatcher, after),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
    if multiprocessing.parent_process() is None:
        with contextlib.suppress(ImportError):  # offline Engine without the HTTP extras
            _install_http_routes()
