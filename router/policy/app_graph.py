"""Multi-agent applications as graphs (Tokencake §3.1): agent roles and who consumes whose
output, registered by the application or inferred from what the router observes.

An application (Code-Writer, Deep-Research, a RAG pipeline) is a DAG of agent roles: an
edge a -> b says b's work starts from a's result (a reviewer after the programmer). The
space scheduler (`router.policy.space`) ranks a role by its place in the graph: its depth
(the longest path from a source, counting roles: a source is 1) and its out-degree (the
roles that consume its output).

Registered graphs come from the application (`POST /v1/apps`, or the `graph` of a trace's
main program). Without one, the graph of an app is inferred from hand-overs: when a program
of role b sends its first request, the role that handed the work over is its predecessor,
that is its parent program's role when the parent has spoken (a subagent dispatched by
it), else the role that answered last in the same task (a pipeline stage that waited for
the previous one). An inferred edge that would close a cycle is ignored (the first
direction seen wins), so the inferred graph stays a DAG. Only programs of a named app
(`app_id` on the request, or its parent's) are placed: a request that names none is no part
of any graph, and the space scheduler leaves it to MORI.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from graphlib import CycleError, TopologicalSorter

from router.policy.labels import LabelError, check_label

MAX_ROLES = 256  # roles in one app graph (registered or inferred)
MAX_APPS = 1024  # apps whose graphs are kept (registered first, inferred ones after)
MAX_SESSIONS = 65_536  # tasks whose last answering role is remembered for inference

Edges = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Shape:
    """A role's place in its app's graph."""

    depth: int  # longest path from a source, in roles (a source is 1)
    out_degree: int  # roles that consume its output


def check_edges(edges: object, field: str = "edges") -> Edges:
    """Edges as [from, to] pairs of role labels, no self-loop, no cycle, at most
    `MAX_ROLES` roles; ValueError naming what is wrong."""
    if not isinstance(edges, list | tuple):
        raise ValueError(f"{field}: must be a list of [from, to] agent-role pairs")
    out: list[tuple[str, str]] = []
    for i, edge in enumerate(edges):
        if not isinstance(edge, list | tuple) or len(edge) != 2:
            raise ValueError(f"{field}[{i}]: must be a [from, to] pair, got {edge!r:.60}")
        try:
            a, b = (check_label(role, f"{field}[{i}][{k}]") for k, role in enumerate(edge))
        except LabelError as e:
            raise ValueError(str(e)) from None
        if a == b:
            raise ValueError(f"{field}[{i}]: an agent role cannot depend on itself ({a!r})")
        out.append((a, b))
    edges_t = tuple(dict.fromkeys(out))
    if len(roles_of(edges_t)) > MAX_ROLES:
        raise ValueError(f"{field}: more than {MAX_ROLES} agent roles")
    try:
        _order(edges_t)
    except CycleError as e:
        cycle = " -> ".join(e.args[1])
        raise ValueError(f"{field}: the graph has a cycle ({cycle})") from None
    return edges_t


def roles_of(edges: Iterable[tuple[str, str]]) -> list[str]:
    """The graph's roles, in first-mention order."""
    return list(dict.fromkeys(role for edge in edges for role in edge))


def _order(edges: Edges) -> list[str]:
    graph: dict[str, set[str]] = {role: set() for role in roles_of(edges)}
    for a, b in edges:
        graph[b].add(a)
    return list(TopologicalSorter(graph).static_order())


def shapes(edges: Edges) -> dict[str, Shape]:
    """Depth and out-degree of every role of an acyclic graph."""
    depth: dict[str, int] = {}
    preds: dict[str, list[str]] = {}
    out: dict[str, int] = {}
    for a, b in edges:
        preds.setdefault(b, []).append(a)
        out[a] = out.get(a, 0) + 1
    for role in _order(edges):
        depth[role] = 1 + max((depth[p] for p in preds.get(role, ())), default=0)
    return {role: Shape(d, out.get(role, 0)) for role, d in depth.items()}


class AppGraphs:
    """Registered app graphs, graphs inferred from hand-overs, and each role's shape."""

    def __init__(self) -> None:
        self.registered: dict[str, Edges] = {}
        self.inferred: dict[str, dict[tuple[str, str], None]] = {}
        self._shapes: dict[str, dict[str, Shape]] = {}  # app -> shapes, dropped on change
        self._role: dict[str, str] = {}  # live program -> its role
        self._app: dict[str, str] = {}  # live program -> its app
        self._session: dict[str, str] = {}  # live program -> its task (root program)
        self._last: dict[str, str] = {}  # task -> the role that answered last in it

    # registration ---------------------------------------------------------------------
    def register(self, app: str, edges: Edges) -> dict[str, Shape]:
        """Set an app's graph (checked by `check_edges`); replaces any earlier one."""
        if app not in self.registered and len(self.registered) >= MAX_APPS:
            raise ValueError(f"at most {MAX_APPS} applications can be registered")
        self.registered[app] = edges
        self.inferred.pop(app, None)
        self._shapes.pop(app, None)
        return self.shapes_of(app)

    def unregister(self, app: str) -> bool:
        self._shapes.pop(app, None)
        return self.registered.pop(app, None) is not None

    def edges_of(self, app: str) -> Edges:
        if app in self.registered:
            return self.registered[app]
        return tuple(self.inferred.get(app, {}))

    def shapes_of(self, app: str) -> dict[str, Shape]:
        cached = self._shapes.get(app)
        if cached is None:
            cached = self._shapes[app] = shapes(self.edges_of(app))
        return cached

    def shape(self, program_id: str) -> Shape | None:
        """The shape of a live program's role in its app (None: not placed in a graph)."""
        role = self._role.get(program_id)
        if role is None:
            return None
        return self.shapes_of(self._app[program_id]).get(role)

    def role(self, program_id: str) -> str | None:
        return self._role.get(program_id)

    def agent_type(self, program_id: str) -> str | None:
        """The key of the program's agent type: its app and role (`app/role`)."""
        role = self._role.get(program_id)
        return None if role is None else f"{self._app[program_id]}/{role}"

    # observation ------------------------------------------------------------------------
    def observe_request(
        self,
        program_id: str,
        role: str | None,
        app: str | None,
        session: str | None,
        parent: str | None,
    ) -> None:
        """A request of `program_id`; its first one places the role in its app's graph
        (inferred unless registered)."""
        if role is None or program_id in self._role:
            return
        if app is None and parent is not None:
            app = self._app.get(parent)
        if app is None:
            return
        if parent is not None and session is None:
            session = self._session.get(parent, parent)
        session = session or program_id
        self._role[program_id], self._app[program_id] = role, app
        self._session[program_id] = session
        if app in self.registered:
            return
        before = self._role.get(parent) if parent is not None else None
        if before is None or before == role:
            before = self._last.get(session)
        if before is not None and before != role:
            self._infer(app, before, role)

    def observe_response(self, program_id: str) -> None:
        """A step of `program_id` ended: its role answered last in its task."""
        role, session = self._role.get(program_id), self._session.get(program_id)
        if role is not None and session is not None:
            self._last[session] = role
            if len(self._last) > MAX_SESSIONS:
                del self._last[next(iter(self._last))]

    def forget(self, program_id: str) -> None:
        """The program ended (its task too, if it was the root)."""
        self._role.pop(program_id, None)
        self._app.pop(program_id, None)
        if self._session.pop(program_id, None) == program_id:
            self._last.pop(program_id, None)

    def _infer(self, app: str, a: str, b: str) -> None:
        edges = self.inferred.get(app)
        if edges is None:
            if len(self.inferred) + len(self.registered) >= MAX_APPS:
                return
            edges = self.inferred[app] = {}
        if (a, b) in edges or len(roles_of(edges)) >= MAX_ROLES or _reaches(edges, b, a):
            return
        edges[(a, b)] = None
        self._shapes.pop(app, None)


def _reaches(edges: Iterable[tuple[str, str]], start: str, goal: str) -> bool:
    """Whether `goal` is reachable from `start` (an edge start -> goal would close a cycle)."""
    succ: dict[str, list[str]] = {}
    for a, b in edges:
        succ.setdefault(a, []).append(b)
    seen, stack = {start}, [start]
    while stack:
        node = stack.pop()
        if node == goal:
            return True
        for nxt in succ.get(node, ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return False
