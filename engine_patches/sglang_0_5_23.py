"""The MORI engine patch for SGLang 0.5.23 (UnifiedRadixCache): its tree's names and hooks.

0.5.23 has no HiRadixCache: HiCache runs on `UnifiedRadixCache`, whose tree lives in a
pluggable tree core (`unified_cache/tree_core_registry.py`, default a compiled Rust core).
The patch uses that extension point instead of hooking private methods: it registers a tree
core "mori" (a subclass of SGLang's Python `UnifiedTreeCore`), which mori-sglang selects with
SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=mori, and which

- stamps radix nodes with the programs (request `session_id`) that inserted, split or
  matched them (`InsertParams.session_id` carries the program on insert);
- marks a node dirty whenever the tree records a KV store or removal on either tier (its
  KV-event recorder sees every tier change, enabled or not), for exact residency;
- ranks eviction victims with the "mori" strategy, (type rank, CacheSage survival, LRU)
  (registered like SGLang's own `priority` strategy; the Rust core accepts only built-in
  policies, the Python core any);
- takes `mori.program_type` actions from a request's `kv_hints` envelope (kv_actions.py).

Everything else (control path, routes, busy-first, typed offload and load-back plans) is the
shared glue in engine_patches/sglang_common.py.
"""

from __future__ import annotations

import functools
from typing import Any

from engine_patches import sglang_common as common
from engine_patches.kv_actions import program_types
from engine_patches.sglang_common import MoriEngine, key_path, length

SGLANG_VERSION = "0.5.23"
TREE_CORE = "mori"
LAUNCH_ENV = {"SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND": TREE_CORE}

_MC = "sglang.srt.mem_cache"
URC = f"{_MC}.unified_radix_cache.UnifiedRadixCache"
CORE = f"{_MC}.unified_cache.unified_tree_core.UnifiedTreeCore"
# Everything the patch hooks or calls; mori-sglang refuses to start if one is missing.
HOOK_TARGETS = (
    f"{URC}.__init__",
    f"{URC}.load_back",
    f"{URC}.writing_check",
    f"{URC}._all_reduce",
    f"{URC}._apply_eviction_result",
    f"{CORE}.match_prefix",
    f"{CORE}.begin_insert",
    f"{CORE}.end_insert",
    f"{CORE}._split_node",
    f"{CORE}.demote",
    f"{CORE}.node_by_id",
    f"{_MC}.unified_cache.tree_core_registry.register_tree_core_backend",
    f"{_MC}.unified_cache.component_type.ComponentType",
    *common.COMMON_TARGETS,
)


def _full(node: Any) -> Any:
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    return node.component_data[ComponentType.FULL]


class UnifiedEngine(MoriEngine):
    """MoriEngine on 0.5.23's UnifiedTreeNode (the FULL component holds the KV)."""

    @property
    def root(self) -> Any:
        return self.cache.root_node

    def node_tiers(self, node: Any) -> tuple[int, int]:
        full = _full(node)
        return length(full.value), length(full.host_value)

    def node_locked(self, node: Any) -> bool:
        full = _full(node)
        return (
            full.lock_ref > 0
            or full.host_lock_ref > 0
            or node.write_through_pending_id is not None
            or node.load_back_pending_id is not None
        )

    def demote(self, node: Any) -> None:
        self.cache._apply_eviction_result(self.cache.tree_core.demote(node.id))

    def load(self, node: Any, quota: int) -> int:
        if not self.cache.load_back(node.id, mem_quota=quota):
            return 0
        return self.node_tiers(node)[0]

    def flush_writes(self) -> None:
        self.cache.writing_check()

    def pools(self) -> tuple[Any, Any]:
        return self.cache.token_to_kv_pool_allocator, self.cache.cache_controller.mem_pool_host


ENGINE = UnifiedEngine()


class _MarkingEvents:
    """The tree core's KV-event recorder, marking every node whose tiers change."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def record_store(self, node: Any, medium: Any = None, **kwargs: Any) -> None:
        ENGINE.mark(node)
        self._inner.record_store(node, medium, **kwargs)

    def record_remove(self, node: Any, medium: Any = None) -> None:
        ENGINE.mark(node)
        self._inner.record_remove(node, medium)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@functools.cache
def _tree_core_class() -> type:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    class MoriTreeCore(UnifiedTreeCore):
        """SGLang's Python tree core, stamping programs and marking tier changes."""

        def __init__(self, params: Any, components: Any) -> None:
            super().__init__(params, components)
            self.kv_events = _MarkingEvents(self.kv_events)
            self._mori_insert: Any = None

        def reset(self) -> None:
            super().reset()
            if ENGINE.cache is not None and ENGINE.cache.tree_core is self:
                ENGINE.attach(ENGINE.cache)  # a flushed cache: every node is new

        def match_prefix(self, params: Any) -> Any:
            result = super().match_prefix(params)
            req = getattr(params, "req", None)
            program = getattr(req, "session_id", None)
            for action in program_types(getattr(req, "kv_hints", None)):
                ENGINE.book.request_type(action.program, action.hint, action.epoch)
            if program and ENGINE.cache is not None and ENGINE.cache.tree_core is self:
                ENGINE.stamp_up(self.node_by_id(result.best_match_node), program)
                ENGINE.stamp_up(self.node_by_id(result.last_device_node), program)
            return result

        def begin_insert(self, params: Any) -> Any:
            self._mori_insert = params
            return super().begin_insert(params)

        def end_insert(self) -> Any:
            actions = super().end_insert()
            params, self._mori_insert = self._mori_insert, None
            if params is not None and params.key is not None and ENGINE.cache is not None:
                for node in key_path(ENGINE, params.key, self.is_eagle):
                    ENGINE.stamp(node, params.session_id)
            return actions

        def _split_node(self, key: Any, child: Any, split_len: int) -> Any:
            new_node, action = super()._split_node(key, child, split_len)
            ENGINE.split(child, new_node)
            return new_node, action

    return MoriTreeCore


def _mori_tree_core(params: Any, components: Any) -> Any:
    return _tree_core_class()(params, components)


def _after_cache_init(result: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    if type(cache.tree_core).__name__ == "MoriTreeCore":
        ENGINE.attach(cache)
    return result


def register() -> None:
    """Called by SGLang's plugin loader in every process (main, schedulers, detokenizer)."""
    from sglang.srt.mem_cache.unified_cache import tree_core_registry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    common.register_common(ENGINE)
    if TREE_CORE not in tree_core_registry.registered_tree_core_backends():
        tree_core_registry.register_tree_core_backend(TREE_CORE, _mori_tree_core)
    HookRegistry.register(f"{URC}.__init__", _after_cache_init, HookType.AFTER)
