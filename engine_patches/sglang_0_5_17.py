"""The MORI engine patch for SGLang 0.5.17 (HiRadixCache): its tree's names and hooks.

What it installs (through SGLang's plugin hook registry, in every SGLang process), on top of
the shared glue (engine_patches/sglang_common.py: control path, routes, busy-first):
- stamping: radix nodes remember the programs (request `session_id`) that inserted, split or
  matched them; kept in a ResidencyLedger keyed by node id;
- eviction policy "mori" (`--radix-eviction-policy mori`): (type rank, survival, LRU) on
  both tiers (the key and CacheSage's survival scores are the shared glue's);
- residency: every hook that can change a node's tiers marks it dirty.
"""

from __future__ import annotations

import contextvars
from typing import Any

from engine_patches import sglang_common as common
from engine_patches.sglang_common import MoriEngine, key_path, length

SGLANG_VERSION = "0.5.17"
LAUNCH_ENV: dict[str, str] = {}  # what mori-sglang sets for this line

_S = "sglang.srt"
HIRADIX = f"{_S}.mem_cache.hiradix_cache.HiRadixCache"
RADIX = f"{_S}.mem_cache.radix_cache.RadixCache"
EVENTS = f"{_S}.mem_cache.events.KVCacheEventMixin"

# Everything the patch hooks or calls; mori-sglang refuses to start if one is missing.
HOOK_TARGETS = (
    f"{HIRADIX}.__init__",
    f"{HIRADIX}.insert",
    f"{HIRADIX}.match_prefix",
    f"{HIRADIX}._split_node",
    f"{HIRADIX}.write_backup",
    f"{HIRADIX}.reset",
    f"{HIRADIX}._evict_backuped",
    f"{HIRADIX}.load_back",
    f"{HIRADIX}._all_reduce",
    f"{HIRADIX}.writing_check",
    f"{RADIX}.cache_finished_req",
    f"{RADIX}.cache_unfinished_req",
    f"{EVENTS}._record_store_event",
    f"{EVENTS}._record_remove_event",
    *common.COMMON_TARGETS,
)


# The program whose request is being cached right now (set around cache_*_req).
_PROGRAM: contextvars.ContextVar[str | None] = contextvars.ContextVar("mori_program", default=None)


class HiRadixEngine(MoriEngine):
    """MoriEngine on 0.5.17's HiRadixCache TreeNode."""

    @property
    def root(self) -> Any:
        return self.cache.root_node

    def node_tiers(self, node: Any) -> tuple[int, int]:
        return length(node.value), length(node.host_value)

    def node_locked(self, node: Any) -> bool:
        return (
            node.lock_ref > 0
            or node.write_through_pending_id is not None
            or node.host_ref_counter > 0
        )

    def demote(self, node: Any) -> None:
        self.cache._evict_backuped(node)

    def load(self, node: Any, quota: int) -> int:
        return length(self.cache.load_back(node, mem_quota=quota))

    def flush_writes(self) -> None:
        self.cache.writing_check()

    def pools(self) -> tuple[Any, Any]:
        return self.cache.token_to_kv_pool_allocator, self.cache.cache_controller.mem_pool_host


ENGINE = HiRadixEngine()


# --- hooks ------------------------------------------------------------------------------------
def _after_cache_init(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    ENGINE.attach(cache)
    return result


def _after_insert(result: Any, cache: Any, params: Any, *a: Any, **k: Any) -> Any:
    if cache is ENGINE.cache and params.key is not None:
        program = _PROGRAM.get()
        for node in key_path(ENGINE, params.key, cache.is_eagle):
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
        ENGINE.split(child, new_node)
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


# --- registration -----------------------------------------------------------------------------
def register() -> None:
    """Called by SGLang's plugin loader in every process (main, schedulers, detokenizer)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    common.register_common(ENGINE)
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
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)
