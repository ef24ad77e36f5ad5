"""CacheSage on the agent runtime layer: transition learning, survival scores with LRU
fallback, warm-ups, hand-over room, and the layer's other components."""

from __future__ import annotations

import pytest

from router.policy import make_policy
from router.policy.cachesage import MIN_TRANSITIONS, CacheSage
from router.policy.engine import MoriEngine
from router.policy.runtime import (
    AgentEvent,
    AgentRuntime,
    EventKind,
    Item,
    ItemKind,
    PushScores,
    TypedHints,
    Warm,
)
from router.policy.transitions import TransitionLearner
from router.policy.types import ReplicaCapacity, Tier
from router.replay.generators import generate, load_preset
from router.sim.simulator import SimConfig, Simulation

CHAIN = ["A", "B", "C"]
CHAIN6 = ["A", "B", "C", "D", "E", "F"]


def play(learner: TransitionLearner, session: str, agents: list[str], loop: int = 1) -> None:
    """A supervisor session: the root hands over, then each agent's program speaks
    (`loop` requests per turn, a tool loop)."""
    for agent in agents:
        learner.observe(session, session, "selector")
        for _ in range(loop):
            learner.observe(session, f"{session}.{agent}", agent)


def test_turns_are_hand_overs_and_tool_loops_are_one_turn():
    learner = TransitionLearner()
    play(learner, "t1", ["A", "B", "A", "C"], loop=3)
    assert learner.transitions == 3
    assert learner.row("A") == {"B": 0.5, "C": 0.5}
    assert learner.row("B") == {"A": 1.0}
    # without a root, a change of program starts a turn; the same program continues it
    learner.observe("t2", "t2.x", "X")
    learner.observe("t2", "t2.x", "X")
    learner.observe("t2", "t2.y", "Y")
    assert learner.row("X") == {"Y": 1.0}


def test_r_separates_a_chain_from_noise_and_the_window_forgets():
    chain = TransitionLearner(window=60)
    for s in range(10):
        play(chain, f"s{s}", CHAIN * 3)
    assert chain.r() > 0.8 and chain.r_in_sample() > 0.95
    assert chain.transitions == len(chain.losses) == 60  # the window holds the last 60
    noise = TransitionLearner()
    for s in range(40):  # next agent independent of the current one
        play(noise, f"n{s}", ["A", "A", "B", "B", "C", "C", "A", "C", "B", "A"][s % 3 :])
    assert noise.r() < 0.1  # out of sample, noise is no structure
    assert noise.r() < chain.r() - 0.5


def test_reach_is_the_probability_to_speak_within_the_horizon():
    learner = TransitionLearner()
    for s in range(5):
        play(learner, f"s{s}", CHAIN * 4)
    index, one = learner.reach(1)
    _, two = learner.reach(2)
    a, b, c = (index[x] for x in CHAIN)
    assert one[a, b] == pytest.approx(1.0) and one[a, c] == pytest.approx(0.0)
    assert two[a, c] == pytest.approx(1.0)  # A -> B -> C


def test_state_is_bounded():
    learner = TransitionLearner(window=100, max_agents=4, max_sessions=10)
    for s in range(50):
        play(learner, f"s{s}", [f"agent{(s + i) % 9}" for i in range(6)])
    assert len(learner.sessions) <= 10
    assert len(learner.rows.keys() | learner.nexts.keys()) <= 4
    assert learner.transitions <= 100
    assert learner.state_bytes() < 20_000


def request(pid: str, session: str, agent: str | None, now: float, anchor: int = 0):
    return AgentEvent(EventKind.REQUEST, now, pid, agent, session, anchor)


def cachesage_on(replica: str = "r0") -> CacheSage:
    return CacheSage(lambda pid: replica, lambda: [replica])


def feed(cs: CacheSage, sessions: int, agents: list[str], laps: int = 3) -> float:
    now = 0.0
    for s in range(sessions):
        for agent in agents * laps:
            now += 1
            cs.observe(request(f"t{s}", f"t{s}", "selector", now))
            cs.observe(request(f"t{s}.{agent}", f"t{s}", agent, now, anchor=1000))
    return now


def test_no_scores_and_no_warm_ups_before_the_structure_is_learnt():
    cs = cachesage_on()
    feed(cs, 1, CHAIN, laps=2)
    assert cs.learner.transitions < MIN_TRANSITIONS
    assert cs.survival() == {}
    actions = cs.act(10.0)
    assert all(isinstance(a, PushScores) and a.scores == {} for a in actions)
    assert not [a for a in actions if isinstance(a, Warm)]


def test_scores_scored_before_the_push_still_go_out():
    """The policy may score an item (a placement, a hint ranking) between the learner's
    move and `act`: the engine must still get the new scores at that push."""
    cs = cachesage_on()
    now = 0.0
    for s in [*range(20), "live"]:  # no anchors: no warm-ups to push either
        for agent in CHAIN6 * (3 if s != "live" else 1):
            now += 1
            cs.observe(request(f"t{s}", f"t{s}", "selector", now))
            cs.observe(request(f"t{s}.{agent}", f"t{s}", agent, now))
    cs.act(now)  # drained: every program's agent and the scores went out
    cs.observe(request("tlive", "tlive", "selector", now + 1))
    cs.observe(request("tlive.A", "tlive", "A", now + 1))  # A's turn again: scores move
    cs.score(Item(ItemKind.ANCHOR, "E"))
    pushed = [a for a in cs.act(now + 1) if isinstance(a, PushScores)]
    assert pushed and pushed[0].scores == cs.survival()


def test_weak_structure_falls_back_to_lru():
    cs = cachesage_on()
    noise = ["A", "A", "B", "B", "C", "C", "A", "C", "B", "A", "B", "C"]
    now = 0.0
    for s in range(20):
        for agent in noise[s % 4 :] + noise[: s % 4]:
            now += 1
            cs.observe(request(f"t{s}", f"t{s}", "selector", now))
            cs.observe(request(f"t{s}.{agent}{now}", f"t{s}", agent, now, anchor=1000))
    assert cs.learner.transitions >= MIN_TRANSITIONS
    assert not cs.active and cs.survival() == {}


def test_scores_rank_the_predicted_next_agent_and_warm_ups_target_it():
    cs = cachesage_on()
    now = feed(cs, 20, CHAIN6)
    cs.act(now)  # drain
    cs.observe(request("live", "live", "selector", now + 1))
    cs.observe(request("live.A", "live", "A", now + 1, anchor=1000))
    actions = cs.act(now + 1)
    scores = next(a for a in actions if isinstance(a, PushScores)).scores
    assert scores["B"] > 0.9 and scores["E"] < 0.1  # one live session, in A's turn: B next
    warms = [a for a in actions if isinstance(a, Warm)]
    assert warms == [Warm("r0", "B", 1000)]
    assert cs.act(now + 2) == []  # nothing new: nothing pushed again
    assert cs.score(Item(ItemKind.ANCHOR, "B")) == scores["B"]
    assert cs.turn_odds("live.A") == 1.0  # its turn
    cs.observe(request("live.F", "live", "F", now + 1))  # F spoke earlier in this task...
    assert cs.predict(now)["live"] == ("A", 1.0)  # ...and F hands to A


def test_typed_hints_plug_into_the_layer():
    policy = make_policy("mori")
    policy.add_replica("r0", ReplicaCapacity(10_000, 10_000))
    policy.on_request("p", 0.0, 1_000)
    assert policy.programs["p"].placement.tier is Tier.GPU
    runtime = AgentRuntime([TypedHints(policy)])
    assert runtime.score(Item(ItemKind.PROGRAM, "p")) == {"typed_hints": 2.0}  # busy
    assert runtime.score(Item(ItemKind.ANCHOR, "coder")) == {}  # no opinion on anchors


def run_chain(policy: str, mix: float = 0.05, duration: float = 900.0) -> Simulation:
    preset = load_preset("multiagent-chain").model_copy(update={"mix": mix})
    corpus = list(generate(preset, 20, seed=1))
    config = SimConfig(policy=policy, concurrency=4, gpu_tokens=30_000, duration_s=duration)
    sim = Simulation(corpus, config)
    sim.result = sim.run()
    return sim


def test_mori_cachesage_learns_the_chain_pushes_scores_and_warms_anchors():
    sim = run_chain("mori+cachesage")
    policy = sim.policy
    assert isinstance(policy, MoriEngine)
    assert policy.handover.cachesage.active and policy.handover.cachesage.learner.r() > 0.6
    tree = sim.engines["r0"].tree
    assert tree.scores and max(tree.scores.values()) > 0.5
    assert sim.warms["loaded"] + sim.warms["queued"] + sim.warms["resident"] > 10
    assert sim.result.steps_s > 0.5  # hand-overs flow (no program waits on a held turn)


def test_noise_keeps_the_engine_on_plain_typed_lru():
    sim = run_chain("mori+cachesage", mix=1.0, duration=600.0)
    assert not sim.policy.handover.cachesage.active
    assert sim.engines["r0"].tree.scores == {}
    assert sim.result.extra["warm_loaded_tokens"] == sim.result.extra["warm_prefill_tokens"] == 0
