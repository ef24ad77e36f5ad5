"""One replica's KV cache as a radix tree of token segments on two tiers (device, host).

A *node* is a segment of tokens whose content is the same for every program whose context
runs through it; a program's context is a *path* of nodes from the root. Nodes are shared:

- an **anchor** (an agent role's system prompt + tool definitions) is a root segment named by
  its key, so every program of the role starts with the same node;
- a **forked subagent** starts with the first tokens of its parent's path (the parent's node
  is split where the child's prompt leaves it);
- a **named prefix** (a prompt whose blocks the trace names, `SharedPrefix.chain`) is found
  wherever another program's context holds the same blocks from the start, through the
  content-addressed segment index kept with the tree (`SegmentIndex`), when that covers
  more of the prompt than the program's own cached context;
- everything else is private: a program's new tokens extend its own last node in place when
  nobody else uses it, else start a new child node.

Each node holds a prefix of its tokens on device (`dev`) and a prefix on host (`host`).
Eviction is leaf-first on both tiers (a node loses tokens from its end only once no child
holds any there), so along every path the device tokens and the host tokens are each a
prefix: a request hits the device prefix, then the host tokens beyond it, and recomputes the
rest, as in SGLang's HiRadixCache. The tiers follow HiCache (write-through to host, the host
only evicts host-only tokens, see `router.sim.model`); the order of victims is:

- `lru`: least recently used first (stock SGLang);
- `typed` (the MORI patch): a node's type is the most protective hint of the programs using
  it (inactive < idle < busy; nodes nobody uses are inactive), then its *survival* score
  (CacheSage: the probability its agent role runs again soon, pushed by the router; only
  anchors and other shared nodes carry one), then LRU.

Pure and clock-free: every mutating call gets `now`.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field

from router.policy.types import Hint

# Eviction rank per hint: lower goes first, on both tiers (docs/policy.md, "Typed eviction").
RANK = {Hint.INACTIVE: 0, Hint.IDLE: 1, Hint.BUSY: 2}
# A program the router never typed ranks busy (stock behaviour); a node nobody uses, inactive.
_NOBODY = RANK[Hint.INACTIVE]


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Content a program's prompt starts with that other programs share; used when the
    program has no cached path of its own (its first request, or after full eviction).

    anchor: key of an agent role's anchor segment (system prompt + tools), `tokens` long.
    program: a program whose path's first `tokens` tokens the prompt repeats (a fork).
    chain: (chain id, end offset) of each named block the prompt starts with
    (`router.sim.segments`); found in any program's context, and used even when the
    program has a cached path of its own if it covers more of the prompt.
    """

    tokens: int
    anchor: str | None = None
    program: str | None = None
    chain: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.anchor is not None and self.program is not None:
            raise ValueError("a shared prefix names at most one of anchor or program")
        if self.anchor is None and self.program is None and not self.chain:
            raise ValueError("a shared prefix names an anchor, a program or a chain")
        if self.tokens < 0:
            raise ValueError(f"shared prefix tokens must be >= 0, got {self.tokens}")

    @classmethod
    def of_program(
        cls,
        agent: str | None,
        anchor_tokens: int,
        inherit_tokens: int,
        parent: str | None,
        chain: tuple[tuple[str, int], ...] = (),
    ) -> SharedPrefix | None:
        """What a trace program shares (DESIGN.md trace format): its parent's first
        `inherit_tokens` (a fork, `parent` = the parent's program id on the engine), else its
        role's anchor, and the step's named blocks (`chain`); None when it shares nothing."""
        if inherit_tokens and parent is not None:
            return cls(inherit_tokens, program=parent, chain=chain)
        if anchor_tokens:
            return cls(anchor_tokens, anchor=agent or "", chain=chain)
        return cls(0, chain=chain) if chain else None


@dataclass(eq=False, slots=True)
class Node:
    """A segment of `length` tokens; `dev` / `host` tokens of it (a prefix) on each tier."""

    length: int
    parent: Node | None
    anchor: str | None = None  # the anchor key of a named root segment
    children: list[Node] = field(default_factory=list)
    users: set[str] = field(default_factory=set)  # programs whose path runs through it
    ranks: list[int] = field(default_factory=lambda: [0, 0, 0])  # users per hint rank
    agents: Counter[str] = field(default_factory=Counter)  # users per agent role (if named)
    dev: int = 0
    host: int = 0
    lock: int = 0  # running requests (and warm-up prefills) holding it on device
    last_use: float = 0.0
    ready_at: float = 0.0  # a load-back of its tokens lands at this time

    @property
    def shared(self) -> bool:
        return self.anchor is not None or len(self.users) > 1


@dataclass(slots=True)
class Entry:
    """One program's cached context on this replica."""

    path: list[Node] = field(default_factory=list)
    hint: Hint = Hint.BUSY
    hinted: bool = False  # a router named the program in a hint (busy above is the default)
    agent: str | None = None  # agent role, as the router named it (scores key on it)
    running: str | None = None  # rid of the request holding the path on device


@dataclass(slots=True)
class Match:
    """What a request finds cached, before it is admitted (nothing changed yet)."""

    base: list[Node]  # nodes the new path starts with (the last one maybe partly)
    cut: int  # prompt tokens the base covers; new tokens start here
    anchor: tuple[str, int] | None  # an anchor segment to create (first of its role here)
    dev: int  # prompt tokens hit on device
    host: int  # prompt tokens hit on host beyond the device hit
    reclaim: int  # device tokens of the program's stale tail that admission frees
    own: bool  # the base comes from the program's own path
    chain: tuple[tuple[str, int], ...] = ()  # named blocks to index once admitted


class KVTree:
    """The nodes, the programs' paths, the tier budgets and the eviction orders."""

    def __init__(self, gpu_tokens: int, host_tokens: int, typed: bool) -> None:
        self.gpu_tokens = gpu_tokens
        self.host_tokens = host_tokens
        self.typed = typed
        self.dev_used = 0
        self.host_used = 0
        self.entries: dict[str, Entry] = {}
        self.anchors: dict[tuple[str, int], Node] = {}  # (key, tokens) -> root segment
        # every node, in creation order: victims that tie on their key go in this order, so a
        # run is deterministic (a set would order them by memory address)
        self.nodes: dict[Node, None] = {}
        self.scores: dict[str, float] = {}  # agent role -> survival in [0, 1]
        self.critical: frozenset[str] = frozenset()  # agent types kept longest in a type
        self.locked_tokens = 0  # distinct tokens held by running requests (and warm-ups)
        self.index = SegmentIndex()  # named prefixes -> where they end in the tree
        self._tie = itertools.count()  # heap tie-breaker (nodes do not compare)

    # reading ------------------------------------------------------------------------
    def residency(self, pid: str) -> tuple[int, int]:
        """(device, host) tokens of the program's context; shared nodes count for each user."""
        e = self.entries.get(pid)
        if e is None:
            return 0, 0
        return sum(n.dev for n in e.path), sum(n.host for n in e.path)

    def hint(self, pid: str) -> Hint:
        e = self.entries.get(pid)
        return e.hint if e else Hint.BUSY

    def entry(self, pid: str) -> Entry:
        e = self.entries.get(pid)
        if e is None:
            e = self.entries[pid] = Entry()
        return e

    def set_hint(self, pid: str, hint: Hint) -> Entry:
        """Type a program (its segments' ranks follow)."""
        e = self.entry(pid)
        e.hinted = True
        if hint is not e.hint:
            old, new = RANK[e.hint], RANK[hint]
            for node in e.path:
                node.ranks[old] -= 1
                node.ranks[new] += 1
            e.hint = hint
        return e

    def set_agent(self, pid: str, agent: str) -> None:
        """Name a program's agent role (survival scores key on it)."""
        e = self.entries.get(pid)
        if e is None or e.agent == agent:
            return
        for node in e.path:
            self._count_agent(node, e.agent, -1)
            self._count_agent(node, agent, 1)
        e.agent = agent

    @staticmethod
    def _count_agent(node: Node, agent: str | None, n: int) -> None:
        if agent is not None:
            node.agents[agent] += n
            if node.agents[agent] <= 0:
                del node.agents[agent]

    def _join(self, node: Node, pid: str) -> None:
        if pid not in node.users:
            e = self.entries[pid]
            node.users.add(pid)
            node.ranks[RANK[e.hint]] += 1
            self._count_agent(node, e.agent, 1)

    def _part(self, node: Node, pid: str) -> None:
        if pid in node.users:
            e = self.entries[pid]
            node.users.discard(pid)
            node.ranks[RANK[e.hint]] -= 1
            self._count_agent(node, e.agent, -1)

    # matching and admission -----------------------------------------------------------
    def match(
        self, pid: str, reuse: int, prompt: int, prefix: SharedPrefix | None, host_tier: bool
    ) -> Match:
        """What a prompt of `prompt` tokens finds: the program's own path up to `reuse`
        tokens or, with no path, the shared prefix. Hits are contiguous from the start."""
        e = self.entries.get(pid)
        own = e is not None and bool(e.path)
        anchor = None
        if own:
            path, limit = e.path, min(reuse, prompt)  # type: ignore[union-attr]
        else:
            path, limit, anchor = self._prefix_path(prefix, prompt)
        chain = prefix.chain if prefix is not None else ()
        named = self.index.longest(chain, prompt) if chain else None
        stale = 0
        if named is not None and named[1] > (limit if own or not anchor else anchor[1]):
            path, limit = named  # another context holds more of this prompt than its own
            anchor = None
            stale = self._unshared_dev(e.path, path, pid) if own else 0  # type: ignore[union-attr]
            own = False
        base, cut = self._cut(path, limit)
        dev = host = 0
        on_dev = on_host = True
        pos = 0
        for node in base:
            span = min(node.length, cut - pos)
            if on_dev:
                d = min(node.dev, span)
                dev += d
                on_dev = d == node.length
            if on_host:
                h = min(node.host, span)
                host += h
                on_host = h == node.length
            pos += span
        host_hit = max(0, host - dev) if host_tier else 0
        reclaim = self._stale_dev(e.path, base, cut, pid) if own else stale  # type: ignore[union-attr]
        cut = anchor[1] if anchor else cut
        return Match(base, cut, anchor, dev, host_hit, reclaim, own, chain)

    @staticmethod
    def _unshared_dev(path: list[Node], base: list[Node], pid: str) -> int:
        """Device tokens of the program's own path that a base from elsewhere drops."""
        keep = set(base)
        return sum(n.dev for n in path if n not in keep and n.users == {pid} and n.anchor is None)

    def _prefix_path(
        self, prefix: SharedPrefix | None, prompt: int
    ) -> tuple[list[Node], int, tuple[str, int] | None]:
        """The shared path a program without its own starts from, the tokens it may cover,
        and the anchor segment to create when the role has none cached here yet."""
        if prefix is None or not 0 < prefix.tokens <= prompt:
            return [], 0, None
        if prefix.anchor is not None:
            key = (prefix.anchor, prefix.tokens)
            node = self.anchors.get(key)
            return ([node], prefix.tokens, None) if node else ([], 0, key)
        source = self.entries.get(prefix.program)  # type: ignore[arg-type]
        return (list(source.path) if source else []), prefix.tokens, None

    @staticmethod
    def _cut(path: list[Node], limit: int) -> tuple[list[Node], int]:
        """The nodes covering the first `limit` tokens of `path`. A cut inside an anchor
        rounds down to its start (anchors are never split); elsewhere the last node may be
        covered in part (it is shrunk or split on admission)."""
        base, pos = [], 0
        for node in path:
            if pos >= limit:
                break
            if pos + node.length > limit and node.anchor is not None:
                break
            base.append(node)
            pos += min(node.length, limit - pos)
        return base, pos

    @staticmethod
    def _stale_dev(path: list[Node], base: list[Node], cut: int, pid: str) -> int:
        """Device tokens of the program's own path beyond the cut that nobody else uses."""
        stale, pos = 0, 0
        for i, node in enumerate(path):
            own = node.users == {pid} and node.anchor is None
            if i < len(base) - 1:
                pos += node.length
                continue
            if i == len(base) - 1:
                keep = cut - pos
                stale += max(0, node.dev - keep) if own else 0
            elif own:
                stale += node.dev
            pos += node.length
        return stale

    def admit(self, pid: str, m: Match, tokens: int, rid: str, now: float) -> list[Node]:
        """Make the program's path the matched base + `tokens - cut` new tokens, all on
        device and locked (the request's whole context, prompt and output)."""
        e = self.entry(pid)
        base = self._settle_base(pid, e, m)
        if m.anchor is not None:
            base = [self.anchor_node(*m.anchor)]
        new = tokens - m.cut
        last = base[-1] if base else None
        private = last is not None and last.users == {pid} and last.anchor is None
        if private and m.own and not last.children:  # type: ignore[union-attr]
            last.length += new  # type: ignore[union-attr]
        elif new > 0:
            base.append(self._attach(Node(new, last)))
        for node in base:
            self._join(node, pid)
            self._set_dev(node, node.length)
            self.hold(node)
            node.last_use = now
        e.path = base
        e.running = rid
        if m.chain:
            self.index.register(m.chain, base)
        return base

    def _settle_base(self, pid: str, e: Entry, m: Match) -> list[Node]:
        """Drop the program's stale tail, and make the base end exactly at the cut."""
        base = list(m.base)
        pos = sum(n.length for n in base[:-1])
        if base and pos + base[-1].length > m.cut:
            node, keep = base[-1], m.cut - pos
            if m.own and node.users == {pid} and not node.children:
                self._shrink(node, keep)
            else:
                base[-1] = self._split(node, keep)
        keep_nodes = set(base)
        for node in reversed(e.path):
            if node not in keep_nodes:
                self._leave(node, pid)
        return base

    def release(self, pid: str, context: int, now: float) -> None:
        """The request left the batch: unlock its path, trim what an abort never computed."""
        e = self.entries.get(pid)
        if e is None:
            return
        e.running = None
        for node in e.path:
            self.unhold(node)
            node.last_use = now
        extra = sum(n.length for n in e.path) - context
        if extra > 0 and e.path and e.path[-1].users == {pid}:
            last = e.path[-1]
            self._shrink(last, max(0, last.length - extra))

    def hold(self, node: Node) -> None:
        """Lock a node on device (it is all there: a running request or warm-up uses it)."""
        node.lock += 1
        if node.lock == 1:
            self.locked_tokens += node.length

    def unhold(self, node: Node) -> None:
        if node.lock == 1:
            self.locked_tokens -= node.length
        node.lock -= 1

    # tree surgery ---------------------------------------------------------------------
    def _attach(self, node: Node) -> Node:
        if node.parent is not None:
            node.parent.children.append(node)
        self.nodes[node] = None
        return node

    def anchor_node(self, key: str, tokens: int) -> Node:
        """The anchor segment `key` of `tokens` tokens (created empty if absent)."""
        node = self.anchors.get((key, tokens))
        if node is None:
            node = self.anchors[key, tokens] = self._attach(Node(tokens, None, anchor=key))
        return node

    def _split(self, node: Node, at: int) -> Node:
        """Cut `node` after `at` tokens: a new parent takes the first part, `node` keeps the
        rest (its users and children stay; the parent is used by all of them)."""
        head = Node(at, node.parent, users=set(node.users), lock=node.lock)
        head.ranks, head.agents = list(node.ranks), Counter(node.agents)
        head.dev, head.host = min(node.dev, at), min(node.host, at)
        head.last_use, head.ready_at = node.last_use, node.ready_at
        if node.parent is not None:
            siblings = node.parent.children
            siblings[siblings.index(node)] = head
        self.nodes[head] = None
        node.parent = head
        head.children.append(node)
        node.length -= at
        node.dev, node.host = max(0, node.dev - at), max(0, node.host - at)
        for pid in head.users:
            path = self.entries[pid].path
            path.insert(path.index(node), head)
        return head

    def _shrink(self, node: Node, length: int) -> None:
        """Drop tokens off the end of a node nobody else needs (stale or never computed)."""
        node.length = length
        self._set_dev(node, min(node.dev, length))
        self._set_host(node, min(node.host, length))

    def _leave(self, node: Node, pid: str) -> None:
        """`pid`'s path no longer runs through `node`: free it if nobody else holds it."""
        self._part(node, pid)
        if not node.users and node.anchor is None and not node.children and not node.lock:
            self._set_dev(node, 0)
            self._set_host(node, 0)
            self._remove(node)

    def _remove(self, node: Node) -> None:
        """A node with nothing on either tier and no children leaves the tree; it ends the
        path of every user, and a program left with no path and no request is forgotten."""
        if node.parent is not None:
            node.parent.children.remove(node)
        self.nodes.pop(node, None)
        self.index.drop(node)
        if node.anchor is not None and self.anchors.get((node.anchor, node.length)) is node:
            del self.anchors[node.anchor, node.length]
        for pid in node.users:
            e = self.entries[pid]
            if e.path and e.path[-1] is node:
                e.path.pop()
            if not e.path and e.running is None:
                del self.entries[pid]
        node.users.clear()
        node.ranks, node.agents = [0, 0, 0], Counter()

    def _set_dev(self, node: Node, tokens: int) -> None:
        self.dev_used += tokens - node.dev
        node.dev = tokens

    def _set_host(self, node: Node, tokens: int) -> None:
        self.host_used += tokens - node.host
        node.host = tokens

    def stored_tokens(self, live: Container[str]) -> int:
        """Distinct tokens of `live` programs' contexts held on either tier (a token on
        device and host counts once, a segment they share once)."""
        return sum(max(n.dev, n.host) for n in self.nodes if any(u in live for u in n.users))

    # ranking --------------------------------------------------------------------------
    def rank(self, node: Node) -> int:
        """The most protective hint of the node's users (a shared prefix stays while any
        user needs it); a node nobody uses is inactive."""
        ranks = node.ranks
        return 2 if ranks[2] else 1 if ranks[1] else _NOBODY

    def survival(self, node: Node) -> float:
        """CacheSage: the best score of the agent roles that share the node (0 if private)."""
        if not self.scores or not node.shared:
            return 0.0
        scores = self.scores
        best = scores.get(node.anchor, 0.0) if node.anchor is not None else 0.0
        return max(best, max((scores.get(a, 0.0) for a in node.agents), default=0.0))

    def is_critical(self, node: Node) -> bool:
        """Space scheduler: a program of a critical agent type uses the node."""
        critical = self.critical
        return bool(critical) and any(a in critical for a in node.agents)

    def victim_key(self, node: Node) -> tuple:
        """Smallest goes first: (type, critical, survival, LRU) when typed, LRU otherwise."""
        if not self.typed:
            return (node.last_use,)
        return (self.rank(node), self.is_critical(node), self.survival(node), node.last_use)

    # eviction -------------------------------------------------------------------------
    def evict_device(
        self, tokens: int, keep: set[Node], allowed: Callable[[Node], bool] | None = None
    ) -> bool:
        """Free `tokens` device tokens, leaf-first in victim order; False (and nothing
        freed) if the unlocked, allowed nodes cannot free that much. Tokens without a host
        copy are dropped."""
        kept = sum(n.dev for n in keep if not n.lock)
        if self.dev_used - self.locked_tokens - kept < tokens:
            return False  # cheap bound: locked and kept tokens never go
        free = self._device_freeable(keep, allowed)
        if sum(n.dev for n in free) < tokens:
            return False
        heap = [self._heap_item(n) for n in free if not any(c.dev for c in n.children)]
        heapq.heapify(heap)
        while tokens > 0 and heap:
            node = heapq.heappop(heap)[-1]
            take = min(tokens, node.dev)
            self._set_dev(node, node.dev - take)
            tokens -= take
            if node.dev:
                continue
            parent = node.parent
            if not node.host:
                self._remove(node)
            if parent in free and not any(c.dev for c in parent.children):
                heapq.heappush(heap, self._heap_item(parent))
        return True

    def _device_freeable(self, keep: set[Node], allowed) -> dict[Node, None]:
        """Nodes whose device tokens may go: unlocked, not kept, allowed, and every child
        still on device freeable too (leaf-first)."""
        memo: dict[Node, bool] = {}

        def ok(node: Node) -> bool:
            done = memo.get(node)
            if done is None:
                done = node.dev > 0 and not node.lock and node not in keep
                done = done and (allowed is None or allowed(node))
                done = done and all(ok(c) for c in node.children if c.dev)
                memo[node] = done
            return done

        return {n: None for n in self.nodes if n.dev and ok(n)}

    def evict_host(self, tokens: int, keep: set[Node]) -> None:
        """Free up to `tokens` host tokens from host-only copies (HiRadixCache.evict_host
        skips nodes still on device), host-leaf-first in victim order."""

        def candidate(node: Node) -> bool:
            return (
                node.host > node.dev
                and not node.lock
                and node not in keep
                and not any(c.host for c in node.children)
            )

        heap = [self._heap_item(n) for n in self.nodes if candidate(n)]
        heapq.heapify(heap)
        while tokens > 0 and heap:
            node = heapq.heappop(heap)[-1]
            take = min(tokens, node.host - node.dev)
            self._set_host(node, node.host - take)
            tokens -= take
            if node.host or node.dev:
                continue
            parent = node.parent
            self._remove(node)
            if parent is not None and candidate(parent):
                heapq.heappush(heap, self._heap_item(parent))

    def _heap_item(self, node: Node) -> tuple:
        return (*self.victim_key(node), next(self._tie), node)

    # host tier --------------------------------------------------------------------------
    def write_through(self, path: list[Node]) -> None:
        """Back the path's device tokens up to host, in path order (the host copy stays a
        prefix). Like HiRadixCache.write_backup: evict host-only copies to make room, back
        up only what then fits; the rest stays device-only until the next try."""
        keep = set(path)
        for node in path:
            if node.host < node.dev:
                need = node.dev - node.host
                short = need - (self.host_tokens - self.host_used)
                if short > 0:
                    self.evict_host(short, keep)
                room = self.host_tokens - self.host_used
                self._set_host(node, node.host + min(need, max(0, room)))
            if node.host < node.length:
                return

    def offload(self, path: list[Node], pid: str) -> None:
        """Idle: drop the device copy of the program's own backed-up nodes, tail first. A
        node that is shared, locked, or has a device-only suffix stops it (it pins its
        ancestors on device, as the patch's offload plan does)."""
        for node in reversed(path):
            own = node.users == {pid} and node.anchor is None and not node.lock
            if not own or node.host < node.dev or any(c.dev for c in node.children):
                return
            self._set_dev(node, 0)

    def host_extra(self, path: Iterable[Node]) -> list[tuple[Node, int]]:
        """(node, tokens) on host beyond the device prefix of `path`: what a load-back
        brings to device (contiguous from the device prefix's end)."""
        out: list[tuple[Node, int]] = []
        for node in path:
            if node.host > node.dev:
                out.append((node, node.host - node.dev))
            if node.host < node.length or node.dev > node.host:
                break
        return out

    def fill(self, node: Node) -> None:
        """All of the node on device (a warm-up prefill computes what was missing)."""
        self._set_dev(node, node.length)

    def load(self, parts: list[tuple[Node, int]], ready_at: float) -> None:
        """Bring host tokens to device (the caller made room). A request that finds them
        there counts them as device hits, as SGLang does (its split is taken when the
        request is matched: a loaded-back node is on device by then)."""
        for node, tokens in parts:
            self._set_dev(node, node.dev + tokens)
            node.ready_at = max(node.ready_at, ready_at)


class SegmentIndex:
    """Chain id -> (node, end): where a prefix of that chain ends in one replica's tree.

    A *chain* id names a prompt up to one of its named blocks (`router.sim.segments`), so a
    request whose prompt starts with a prefix another program computed finds it even though
    its own cached path does not hold it (the shared-first layout of an All-Gather round:
    the gathered outputs first, then the private history). Kept lazily: an entry whose node
    left the tree, or was cut short, is dead and dropped when met."""

    def __init__(self) -> None:
        self._at: dict[str, tuple[Node, int]] = {}
        self._of_node: dict[Node, list[str]] = {}

    def __len__(self) -> int:
        return len(self._at)

    def longest(self, chain: tuple[tuple[str, int], ...], limit: int) -> tuple[list, int] | None:
        """The path to the longest prefix of `chain` (ending at most at `limit`) held in the
        tree, with its end: (nodes from the root, end offset), or None."""
        for chain_id, end in reversed(chain):
            if end > limit:
                continue
            entry = self._at.get(chain_id)
            if entry is None:
                continue
            path = _path_to(entry[0], end)
            if path is not None:
                return path, end
            self._drop_entry(chain_id)
        return None

    def register(self, chain: tuple[tuple[str, int], ...], path: list) -> None:
        """Note where each prefix of `chain` ends along `path` (the nodes of a context
        that starts with it); entries still alive are kept."""
        starts, pos = [], 0
        for node in path:
            starts.append(pos)
            pos += node.length
        i = 0
        for chain_id, end in chain:
            if end > pos:
                return
            entry = self._at.get(chain_id)
            if entry is not None and _path_to(entry[0], end) is not None:
                continue
            while starts[i] + path[i].length < end:
                i += 1
            node = path[i]
            self._at[chain_id] = (node, end)
            self._of_node.setdefault(node, []).append(chain_id)

    def drop(self, node: Node) -> None:
        """`node` left the tree: prefixes that ended in it are gone."""
        for chain_id in self._of_node.pop(node, ()):
            entry = self._at.get(chain_id)
            if entry is not None and entry[0] is node:
                del self._at[chain_id]

    def _drop_entry(self, chain_id: str) -> None:
        node, _ = self._at.pop(chain_id)
        ids = self._of_node.get(node)
        if ids is not None and chain_id in ids:
            ids.remove(chain_id)


def _path_to(node: Node, end: int) -> list | None:
    """The nodes from the root to the one holding offset `end` (the prefix ends inside or
    at the end of it), walking up from `node` (a split moves a prefix's end into an
    ancestor); None if the tree no longer holds that many tokens there."""
    chain = [node]
    while chain[-1].parent is not None:
        chain.append(chain[-1].parent)
    chain.reverse()
    pos = 0
    for i, n in enumerate(chain):
        if pos < end <= pos + n.length:
            return chain[: i + 1]
        pos += n.length
    return None
