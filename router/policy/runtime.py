"""The agent runtime layer (CacheSage §2): four calls any agent-aware policy plugs into.

The router sits between the agent framework (which knows agent roles and sessions) and the
engine (which sees every cache event but no agents). A *component* hosted here gets:

- `observe(event)`: a request arrived, a step ended, a tool call started or ended, a
  program ended; each event carries the agent identity (the shared coordinate) and the
  session (task) it belongs to;
- `score(item)`: a priority for an item a neighbour ranks (an anchor the engine may evict,
  a program it may offload), or None for items the component has no opinion on;
- `predict(now)`: a forecast of upcoming agent activity (next agent per session, a tool
  call's remaining time per program), keyed by what it forecasts;
- `act(now)`: side effects off the critical path (push scores to an engine, warm an anchor),
  as plain `Action` values the shell carries out; the only call that changes a neighbour.

Components are pure (injected clock, no I/O), like the policies that host them. Two plug
in today: `TypedHints` (MORI's busy / idle / inactive types as program scores) and
CacheSage (`router.policy.cachesage`). `AgentRuntime` fans the calls out to its components.
Tool-call durations are forecast by the policy itself (`router.policy.predictor`, fed by
`on_tool_start` / `on_tool_end` and the next request), not on this layer: a component
observing the same calls would keep a second forecast no decision reads.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import ClassVar, Protocol

from router.policy.base import HINT_OF_TIER
from router.policy.program import Program
from router.policy.types import Hint


class EventKind(StrEnum):
    REQUEST = "request"  # a request arrived at the router
    RESPONSE = "response"  # the engine answered a step
    TOOL_START = "tool_start"  # the agent is about to run a tool
    TOOL_END = "tool_end"  # the client said the tool call finished
    END = "end"  # the program ended


@dataclass(frozen=True, slots=True)
class AgentEvent:
    """Something that happened to a program, tagged with its agent identity."""

    kind: EventKind
    now: float
    program_id: str
    agent: str | None = None  # agent role (explicit, or the hash of its anchor)
    session: str | None = None  # the task the program works on (its root program)
    anchor_tokens: int = 0  # the role's shared prefix (system prompt + tools)
    tool: str | None = None
    parent: str | None = None  # the program this one works for, when the session is unknown
    app: str | None = None  # the application (agent graph) its task runs


class ItemKind(StrEnum):
    ANCHOR = "anchor"  # an agent role's shared prefix on an engine (key: the agent)
    PROGRAM = "program"  # one program's own KV (key: the program id)


@dataclass(frozen=True, slots=True)
class Item:
    kind: ItemKind
    key: str


@dataclass(frozen=True, slots=True)
class PushScores:
    """Survival scores per agent for a replica's eviction order, with the agent of the
    programs newly identified on it (the engine maps its cache nodes to agents by them)."""

    replica: str
    scores: Mapping[str, float]
    agents: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Warm:
    """Bring an agent's anchor to device on a replica before its next request."""

    replica: str
    agent: str
    anchor_tokens: int


@dataclass(frozen=True, slots=True)
class PushPriorities:
    """The space scheduler (Tokencake §5) on a replica: the engine admits busy-typed
    requests by program priority (higher first), and within one type keeps the KV of the
    critical agent types longest. `priorities` and `agents` name programs newly placed
    there; `critical` replaces the set (None: unchanged)."""

    replica: str
    priorities: Mapping[str, float] = field(default_factory=dict)
    agents: Mapping[str, str] = field(default_factory=dict)
    critical: frozenset[str] | None = None


Action = PushScores | Warm | PushPriorities


class RuntimeComponent:
    """One policy on the layer; every call has a neutral default, override those it uses."""

    name: ClassVar[str]

    def observe(self, event: AgentEvent) -> None:
        """Update state from an event (called on the request path: keep it O(1))."""
        return None

    def score(self, item: Item) -> float | None:
        """Priority of `item` (higher = keep / serve first); None: no opinion."""
        return None

    def predict(self, now: float) -> Mapping[str, object]:
        """Forecast of upcoming activity, keyed by what it forecasts."""
        return {}

    def act(self, now: float) -> list[Action]:
        """Side effects due now (drained: each is returned once)."""
        return []


class AgentRuntime:
    """The components a policy hosts, behind the same four calls."""

    def __init__(self, components: Sequence[RuntimeComponent]) -> None:
        self.components = list(components)

    def observe(self, event: AgentEvent) -> None:
        for c in self.components:
            c.observe(event)

    def score(self, item: Item) -> dict[str, float]:
        """Every component's opinion of `item`, by component name."""
        out = {}
        for c in self.components:
            value = c.score(item)
            if value is not None:
                out[c.name] = value
        return out

    def predict(self, now: float) -> dict[str, Mapping[str, object]]:
        return {c.name: c.predict(now) for c in self.components}

    def act(self, now: float) -> list[Action]:
        return [a for c in self.components for a in c.act(now)]


# --- components that existed before the layer ------------------------------------------------
KEEP_RANK = {Hint.INACTIVE: 0.0, Hint.IDLE: 1.0, Hint.BUSY: 2.0}


class HasPrograms(Protocol):
    """What `TypedHints` reads of a policy: its programs (a policy, or an engine as its
    stages see it)."""

    @property
    def programs(self) -> Mapping[str, Program]: ...


class TypedHints(RuntimeComponent):
    """MORI's typed hints as scores: a program's keep rank is its tier's type (inactive 0,
    idle 1, busy 2), the first key of the engine's eviction order. The hints themselves
    still travel through `Policy.hint_updates` (the shells push them after every move)."""

    name = "typed_hints"

    def __init__(self, policy: HasPrograms) -> None:
        self.policy = policy

    def score(self, item: Item) -> float | None:
        if item.kind is not ItemKind.PROGRAM:
            return None
        p = self.policy.programs.get(item.key)
        return None if p is None else KEEP_RANK[HINT_OF_TIER[p.placement.tier]]
