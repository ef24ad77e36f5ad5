"""DAG multi-agent apps: the generator's presets, the application metrics (end-to-end
latency, abnormal agents) and their replay in the simulator under `mori+space`."""

from __future__ import annotations

import json

import pytest

from router.replay.generators import generate, load_preset
from router.replay.records import StepRecord, app_stats
from router.replay.trace import parse_program, program_to_dict
from router.sim.simulator import SimConfig, simulate


@pytest.mark.parametrize("name", ["dag-code-writer", "dag-deep-research"])
def test_dag_presets_make_tasks_that_follow_the_graph(name):
    preset = load_preset(name)
    programs = list(generate(preset, 3, seed=1))
    mains = [p for p in programs if p.parent_id is None]
    assert len(mains) == 3 and all(p.graph == preset.edges and p.app == preset.app for p in mains)
    assert all(p.agent == preset.sink for p in mains)
    ids = {p.program_id for p in programs}
    for p in programs:
        assert p.parent_id is None or p.parent_id in ids
        for program_id, _ in p.steps[0].after:  # waits only for earlier roles of its task
            assert program_id in ids and program_id.split(".")[0] == p.program_id.split(".")[0]
        assert (
            parse_program(json.loads(json.dumps(program_to_dict(p)))) == p
        )  # the JSONL round trip keeps the graph
    fan = [p for p in programs if len(p.steps[0].after) > 1]
    assert fan  # some role waits for several instances: a fan-in


def rec(pid: str, start: float, end: float, agent: str, session: str, last: bool = True):
    return StepRecord(
        pid, "r0", start, start + 0.1, end, 100, 10, session=session, agent=agent, last=last
    )


def test_app_stats_end_to_end_and_abnormal_agents():
    records = [
        rec("t1", 0.0, 1.0, "lead", "t1", last=False),
        rec("t1.a", 1.0, 3.0, "worker", "t1"),
        rec("t1", 3.0, 10.0, "lead", "t1"),
        rec("t2", 5.0, 9.0, "lead", "t2"),
        rec("t2.a", 5.0, 6.0, "worker", "t2"),
        rec("t2.b", 5.0, 6.0, "worker", "t2"),
        rec("t2.c", 5.0, 6.0, "worker", "t2"),
        rec("t3", 50.0, 99.0, "lead", "t3"),  # answered after the run's end: not counted
    ]
    stats = app_stats(records, duration_s=60.0)
    assert sorted(stats.e2e_s) == [4.0, 10.0]
    assert stats.agents_done == 6
    # worker mean (2 + 1 + 1 + 1) / 4 = 1.25: t1.a took 2.0 > 1.5 x 1.25; lead mean 7
    assert stats.abnormal == 1 and stats.agent_latency_s == {"lead": 7.0, "worker": 1.25}


def test_dag_apps_replay_in_the_simulator_under_the_space_scheduler():
    corpus = list(generate(load_preset("dag-deep-research"), 40, seed=0))
    config = SimConfig(
        policy="mori+space",
        preset="h100-8b",
        gpu_tokens=30_000,
        duration_s=600,
        arrival_rate=0.03,
        policy_config={"tick_s": 5.0, "gpu_usage_high": 0.5},
    )
    result = simulate(corpus, config)
    assert result.apps_done >= 15 and result.app_e2e_p99_s >= result.app_e2e_mean_s > 0
    assert result.agents_done > result.apps_done > 0 and result.abnormal_agents < result.agents_done
    assert result.extra["tasks_unfinished"] == 0  # the open loop drains every task
    assert set(result.agent_latency_s) == set(load_preset("dag-deep-research").agents)
