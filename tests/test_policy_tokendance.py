"""Rounds and `mori+tokendance` (issue 23): rounds named or inferred from prompts, released
together, placed together when they share enough, served oldest first; without rounds the
policy is `mori`, move for move; the tiers' invariants hold with rounds."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.policy import PolicyConfig, make_policy
from router.policy.rounds import Rounds
from router.policy.runtime import PushScores
from router.policy.types import Placement, ReplicaCapacity, Segment, Tier
from tests.test_policy_properties import check_after_tick, check_tiers, random_load_moves

SYS = Segment("c-sys", "sys", 600)


def seg(chain: str, content: str, tokens: int = 50) -> Segment:
    return Segment(chain, content, tokens)


def prompt(agent: int, rnd: int, system: Segment = SYS) -> tuple[Segment, ...]:
    """An agent's prompt in round `rnd`: the shared system prompt, its own history, then
    the round's gathered answers (the same contents at its own offsets)."""
    head = (system, seg(f"c-p{agent}", f"persona{agent}", 100))
    gathered = tuple(
        seg(f"c-{agent}-{r}-{j}", f"answer{r}/{j}") for r in range(rnd) for j in range(3)
    )
    return head + gathered


def test_rounds_are_named_or_inferred_from_what_prompts_newly_hold():
    rounds = Rounds()
    for a in range(3):  # first prompts: nothing to infer from, unless named
        assert rounds.join(f"a{a}", prompt(a, 0), None, 0.0) is None
    named = rounds.join("b0", prompt(9, 0), "app/r0", 0.0)
    assert named is not None and named.explicit
    for a in range(3):
        rnd = rounds.join(f"a{a}", prompt(a, 1), None, 1.0)
    assert rnd is not None and not rnd.explicit and list(rnd.members) == ["a0", "a1", "a2"]
    exact, gathered = rounds.shared(rnd)
    assert [s.chain for s in exact] == ["c-sys"]  # the same prefix: stored once
    assert {s.content for s in gathered} == {f"answer0/{j}" for j in range(3)}
    nxt = rounds.join("a0", prompt(0, 2), None, 2.0)
    assert nxt is not rnd and rounds.expected(nxt) == {"a0", "a1", "a2"}  # its peers follow
    assert set(rounds.live()) == {rnd.round_id}  # a1, a2 still there; a0 alone in the next
    for a in range(3):
        rounds.forget(f"a{a}")
    rounds.forget("b0")
    assert not rounds.rounds and not rounds.current and not rounds._by_content  # no leak


def policy(name: str = "mori+tokendance", replicas: int = 2, gpu: int = 20_000, **knobs):
    p = make_policy(name, PolicyConfig(tick_s=0.0, **knobs))
    for r in range(replicas):
        p.add_replica(f"r{r}", ReplicaCapacity(gpu, 2 * gpu))
    return p


def arrive(p, pid: str, now: float, segments, round_id: str | None, tokens: int = 2_000):
    p.on_prompt(pid, segments, round_id)
    return p.on_request(pid, now, tokens)


def test_a_round_is_released_together_once_its_agents_are_all_here():
    p = policy()
    for a in range(3):  # round 0: size unknown, so released after the gang wait
        arrive(p, f"a{a}", 0.0, prompt(a, 0), "t/r0")
    assert all(p.route(f"a{a}") is None for a in range(3))
    assert p.next_wakeup(0.0) == 0.1
    p.tick(0.1)
    assert all(p.route(f"a{a}") for a in range(3))
    for a in range(3):
        p.on_response(f"a{a}", 1.0, 2_100)
    arrive(p, "a0", 2.0, prompt(0, 1), "t/r1")
    arrive(p, "a1", 2.0, prompt(1, 1), "t/r1")
    assert p.route("a0") is None and p.route("a1") is None  # a2 is expected
    moves = arrive(p, "a2", 2.0, prompt(2, 1), "t/r1")
    assert all(p.route(f"a{a}") for a in range(3)) and not moves  # all at once, in place


def test_a_round_that_shares_enough_is_placed_on_one_replica():
    big = Segment("c-big", "scenario", 1_600)  # 80 % of each 2k context
    p = policy()
    for a in range(4):
        arrive(p, f"a{a}", 0.0, prompt(a, 0, big), "t/r0")
    p.tick(0.2)
    assert len({p.programs[f"a{a}"].placement.replica for a in range(4)}) == 1
    gpu = p.programs["a0"].placement
    assert p.tiers.used(gpu) == 4 * 2_000 - 3 * 1_600  # the scenario counted once
    # the engines are told to keep the round's shared segments: one group, survival 1.0
    (push,) = p.runtime_actions(0.2)
    assert isinstance(push, PushScores) and push.replica == gpu.replica
    assert len(set(push.agents.values())) == 1 and set(push.scores.values()) == {1.0}


def test_a_round_that_shares_little_is_spread_as_mori_would():
    p = policy()
    for a in range(4):
        arrive(p, f"a{a}", 0.0, prompt(a, 0), "t/r0")  # a 600-token system prompt: 30 %
    p.tick(0.2)
    assert len({p.programs[f"a{a}"].placement.replica for a in range(4)}) == 2


def answer(p, pids: list[str], now: float, tokens: int = 2_000) -> None:
    """The engine answers; each agent waits at the round's barrier (the "gather" gap)."""
    for pid in pids:
        p.on_response(pid, now, tokens)
        p.on_tool_start(pid, now, "gather")


def test_the_oldest_round_keeps_the_room_and_younger_rounds_yield_it():
    """Priced displacement off (margin 100: no move pays): only a round that waited longer
    than the mean round takes room from another round."""
    p = policy(replicas=1, gpu=10_000, displace_margin=100.0)
    team = [f"a{a}" for a in range(4)]
    for a, pid in enumerate(team):  # round A: 4 x 2k, the system prompt once: 6.2k of 10k
        arrive(p, pid, 0.0, prompt(a, 0), "A/r0")
    p.tick(0.2)
    answer(p, team, 1.0)
    for a, pid in enumerate(team):  # A's next round at once: resident, it runs
        arrive(p, pid, 1.0, prompt(a, 1), "A/r1")
    assert all(p.route(pid) for pid in team)
    for b in range(2):  # round B needs 2 x 2.4k (its system prompt is there), 3.8k free
        arrive(p, f"b{b}", 1.5, prompt(10 + b, 0), "B/r0", tokens=3_000)
    p.tick(1.7)
    assert p.route("b0") and p.route("b1") is None  # as many as fit; the room left is B's
    answer(p, team, 2.2)
    for a, pid in enumerate(team):  # B waited less than a round's service time: A goes on
        arrive(p, pid, 2.2, prompt(a, 2), "A/r2")
    assert all(p.route(pid) for pid in team) and p.route("b1") is None
    answer(p, team, 4.0)
    for a, pid in enumerate(team):  # now B waited longer than the mean round: A gives way
        arrive(p, pid, 4.0, prompt(a, 3), "A/r3")
    assert p.route("b1")
    moved = [pid for pid in team if p.programs[pid].placement.tier is Tier.CPU]
    assert moved and all(p.route(pid) is None for pid in moved)  # host KV kept, back later
    assert p.gangs.collective["yielded"] + p.gangs.collective["displaced"] == len(moved)
    check_tiers_fit(p)


def check_tiers_fit(p) -> None:
    for r in p.tiers.replicas():
        gpu = Placement(Tier.GPU, r)
        assert p.tiers.used(gpu) <= p.tiers.budget(gpu)


NAMES = ("mori", "mori+tokendance")


def test_without_rounds_the_moves_are_moris():
    """The same random load (no rounds, no segments) through both: identical moves (mori
    without its overload rules, which rounds replace: its rung has no wait bound)."""
    runs = [
        random_load_moves(policy(name, replicas=2, gpu=3_000, max_step_wait_s=0.0), 3)
        for name in NAMES
    ]
    assert runs[0] == runs[1] and len(runs[0]) > 50


# invariants with rounds ------------------------------------------------------------------------
act = st.tuples(st.integers(0, 5), st.integers(0, 400), st.integers(0, 2))
events = st.lists(st.one_of(act, act, act, st.just(("tick",))), min_size=20, max_size=80)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(events=events, gpu=st.integers(1_500, 6_000))
def test_invariants_hold_with_rounds(events, gpu):
    """Six agents in two groups, requests named by round (`k` counts each agent's rounds):
    the tiers' sums stay exact and within budget after every tick, and nothing leaks."""
    p = policy(replicas=3, gpu=gpu)  # the replicas `check_after_tick` looks at
    rounds: dict[str, int] = {}
    now = 0.0
    for ev in events:
        now += 0.3
        if ev == ("tick",):
            p.tick(now)
            check_after_tick_rounds(p, now)
            continue
        agent, grow, shared = ev
        pid = f"g{agent % 2}a{agent}"
        prog = p.programs.get(pid)
        if prog is not None and prog.status.value == "reasoning":
            p.on_response(pid, now, prog.context_tokens + grow // 4)
        elif prog is None or prog.status.value == "acting":
            k = rounds[pid] = rounds.get(pid, -1) + 1
            system = Segment(f"s{shared}", f"sys{shared}", 100 * shared + 1)
            arrive(p, pid, now, prompt(agent, k, system), f"{pid[:2]}/r{k}", 300 + grow)
        check_tiers(p)
    p.tick(now + 1.0)
    check_after_tick_rounds(p, now + 1.0)
    for pid in list(p.programs):
        p.end(pid, now + 2.0)
    assert not p.gangs.gang and not p.gangs._held_rounds and not p.rounds.rounds


def check_after_tick_rounds(p, now: float) -> None:
    """`check_after_tick` less its fairness part, which rounds waive on purpose: a held
    request of a round may fit while it waits for its peers or an older round."""
    held = {pid for pid, q in p.programs.items() if q.pending}
    for pid in held:
        p.programs[pid].pending = False
    try:
        check_after_tick(p, now)
    finally:
        for pid in held:
            p.programs[pid].pending = True
