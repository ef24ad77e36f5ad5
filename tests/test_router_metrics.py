"""The idleness histogram is fed by ticks only, so its counts do not follow the scrape rate;
the request path's tallied histograms export what the client's own would."""

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from router.owner.metrics import LATENCY_BUCKETS, RouterMetrics
from router.policy import make_policy
from router.policy.types import ReplicaCapacity
from tests.router_harness import ScriptedReplica, metric, router, serve


def _idleness_count(metrics: RouterMetrics) -> float:
    for family in text_string_to_metric_families(metrics.render().decode()):
        for sample in family.samples:
            if sample.name == "mori_program_idleness_count":
                return sample.value
    raise AssertionError("mori_program_idleness not exported")


def test_scrapes_do_not_add_idleness_samples_ticks_do():
    policy = make_policy("mori")
    policy.add_replica("r0", ReplicaCapacity(gpu_tokens=10_000, cpu_tokens=10_000))
    for pid in ("a", "b", "c"):
        policy.on_request(pid, 0.0, 100)
    metrics = RouterMetrics()
    for _ in range(5):  # what every GET /metrics does
        metrics.refresh_tiers(policy)
    assert _idleness_count(metrics) == 0
    metrics.observe_idleness(policy, 1.0)  # what every tick does
    assert _idleness_count(metrics) == 3


def _samples(metrics: RouterMetrics, name: str) -> dict:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        if family.name == name
        for s in family.samples
        if not s.name.endswith("_created")
    }


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["r0", "r1"]),
            st.one_of(st.sampled_from(LATENCY_BUCKETS), st.floats(0, 400, allow_nan=False)),
        ),
        max_size=40,
    ),
    st.integers(0, 40),
)
def test_tallied_observations_export_what_direct_observations_do(values, scrape_at):
    """The request path tallies its histogram observations (a bisect, no lock) and a
    scrape applies them: the exported buckets, counts and sums are the client's own,
    bounds included (a value equal to a bound falls in that bound's bucket), also for
    observations made between two scrapes."""
    tallied, direct = RouterMetrics(), RouterMetrics()
    for i, (replica, value) in enumerate(values):
        if i == scrape_at:
            tallied.render()
        tallied.observe(tallied.ttft, value, replica)
        direct.ttft.labels(replica).observe(value)
        tallied.observe(tallied.gate_wait, value)
        direct.gate_wait.observe(value)
    for name in ("mori_ttft_seconds", "mori_gate_wait_seconds"):
        got, want = _samples(tallied, name), _samples(direct, name)
        assert got.keys() == want.keys()
        for key, value in want.items():
            assert got[key] == pytest.approx(value), key


def test_the_router_samples_its_event_loop_lag():
    """A live router reports how late its loop runs timers (the gate and the door act on
    that clock): samples arrive every 0.25 s, and an idle router's loop is not late."""
    with serve(ScriptedReplica()) as url, router([{"url": url}]) as base:
        deadline = time.monotonic() + 10
        while metric(base, "mori_event_loop_lag_seconds_count") < 3:
            assert time.monotonic() < deadline, "no event-loop lag samples after 10 s"
            time.sleep(0.1)
        count = metric(base, "mori_event_loop_lag_seconds_count")
        assert metric(base, "mori_event_loop_lag_seconds_sum") / count < 0.1
