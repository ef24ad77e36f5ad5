"""The idleness histogram is fed by ticks only, so its counts do not follow the scrape rate."""

from prometheus_client.parser import text_string_to_metric_families

from router.owner.metrics import RouterMetrics
from router.policy import make_policy
from router.policy.types import ReplicaCapacity


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
