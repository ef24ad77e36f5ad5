"""Placement policies behind one interface (see `router.policy.base.Policy`).

Policies are looked up by name so the router, the simulator and the benchmarks can
take `--policy NAME` and run every comparison through the same harness.

The pure core of MORI: programs and idleness (`program`), tiers, prices and residual tool
time, All-Gather rounds (`rounds`), the MORI engine (`engine`) and the stages its rungs
combine (`ladder`: `ordering`, `placement`, `displacement`, `reservation`, `forecast`,
`timed`, `overload`, `space`, `cachesage`, `tokendance`), the baselines (`continuum`,
`baselines`) and the helpers they share (`types`, `labels`, `stats`). No I/O, an injected
clock: the same code runs in the live router, the simulator and the tests.

May import: nothing of the project outside `router.policy` (the router's shell, the
simulator and the replay all import it; it imports none of them).
"""

from __future__ import annotations

from importlib import import_module

from router.policy.base import Policy, PolicyConfig

# name -> "module:attr", a callable taking a PolicyConfig: MORI's rungs are rows of the
# ladder (router.policy.ladder), the engine with their stages; the baselines are classes
REGISTRY: dict[str, str] = {
    "mori": "router.policy.ladder:MORI",
    "mori-priced": "router.policy.ladder:MORI_PRICED",
    "mori-paper": "router.policy.ladder:MORI_PAPER",
    "mori+cachesage": "router.policy.ladder:MORI_CACHESAGE",
    "mori+space": "router.policy.ladder:MORI_SPACE",
    "mori-priced+space": "router.policy.ladder:MORI_PRICED_SPACE",
    "mori+tokendance": "router.policy.ladder:MORI_TOKENDANCE",
    "continuum": "router.policy.continuum:ContinuumPolicy",
    "ta": "router.policy.baselines:ThunderAgentPolicy",
    "ta+o": "router.policy.baselines:ThunderAgentOffloadPolicy",
    "smg": "router.policy.baselines:SmgPolicy",
}


def policy_names() -> list[str]:
    return list(REGISTRY)


def make_policy(name: str, config: PolicyConfig | None = None) -> Policy:
    """Build a policy by name; a clear error lists the known names."""
    try:
        target = REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(REGISTRY)}") from None
    module, attr = target.split(":")
    return getattr(import_module(module), attr)(config)


__all__ = ["Policy", "PolicyConfig", "make_policy", "policy_names", "REGISTRY"]
