"""Expected remaining tool time (mean residual life) and the replicas' learned move prices."""

from __future__ import annotations

import random

import pytest

from router.policy.predictor import MIN_DIST_SAMPLES, DurationPredictor
from router.policy.prices import QuantileTracker, ReplicaPrices
from router.policy.residual import EDGES, DurationDistribution
from router.presets import get_preset
from router.sim.model import CostModel


def filled(samples) -> DurationDistribution:
    dist = DurationDistribution(half_life=100_000)
    for d in samples:
        dist.observe(d)
    return dist


def test_memoryless_durations_have_a_constant_remaining_time():
    rng = random.Random(1)
    dist = filled(rng.expovariate(1 / 10.0) for _ in range(20_000))
    for elapsed in (0.0, 5.0, 10.0, 20.0):
        assert dist.remaining_s(elapsed) == pytest.approx(10.0, rel=0.15)


def test_heavy_tailed_durations_have_a_growing_remaining_time():
    """Pareto(alpha=2): E[D - a | D > a] = a for a past the scale."""
    rng = random.Random(2)
    dist = filled(rng.paretovariate(2.0) for _ in range(50_000))
    assert dist.remaining_s(2.0) == pytest.approx(2.0, rel=0.25)
    assert dist.remaining_s(8.0) == pytest.approx(8.0, rel=0.35)
    assert dist.remaining_s(8.0) > 2.5 * dist.remaining_s(2.0)


def test_fixed_durations_leave_exactly_what_is_left():
    dist = filled([30.0] * 200)
    assert dist.remaining_s(0.0) == pytest.approx(30.0, rel=0.01)
    assert dist.remaining_s(20.0) == pytest.approx(10.0, rel=0.05)


def test_past_every_observation_the_elapsed_time_is_the_estimate():
    dist = filled([1.0] * 50)
    assert dist.remaining_s(500.0) == pytest.approx(500.0)


def test_old_observations_fade():
    dist = DurationDistribution(half_life=20)
    for _ in range(200):
        dist.observe(100.0)
    for _ in range(200):
        dist.observe(1.0)
    assert dist.mean_s() < 2.0


def test_predictor_remaining_time_per_tool_with_cold_start():
    p = DurationPredictor()
    assert p.remaining_s(None, "Bash:pytest", 0.0) == pytest.approx(30.0)  # cold start
    for _ in range(MIN_DIST_SAMPLES):
        p.observe(None, "Bash:pytest", 60.0)
        p.observe(None, "Read", 0.2)
    assert p.remaining_s(None, "Bash:pytest", 20.0) == pytest.approx(40.0, rel=0.05)
    assert p.remaining_s(None, "Read", 0.1) == pytest.approx(0.1, abs=0.05)


def test_predictor_keeps_a_bounded_number_of_keys():
    p = DurationPredictor(max_keys=10)
    for i in range(100):
        p.observe(None, f"tool-{i}", 1.0)
    assert len(p._ewma) <= 10 and len(p._dists) <= 10


def test_quantile_tracker_settles_at_its_quantile():
    rng = random.Random(3)
    tracker = QuantileTracker(50.0, q=0.2, step=0.02)
    for _ in range(20_000):
        tracker.observe(rng.uniform(0.0, 10.0))
    assert tracker.value == pytest.approx(2.0, rel=0.2)


FLAT = 1e15  # attention_tokens at which a prefill costs the same per token at any context


def test_a_large_contexts_recompute_is_priced_from_small_steps():
    """Every sample comes from a small program (2-8k tokens cached, 1k new); the price of
    recomputing a 60k-token context (attention over it is 4x the weights' work on the
    30B-MoE preset) follows the cost model within 10 %; a flat per-token price learnt from
    the same samples is off by more than 2x."""
    preset = get_preset("h200-30b-moe")
    model = CostModel(preset)
    rng = random.Random(7)
    growing = ReplicaPrices.starting(1e-6, 1e-6, attention_tokens=preset.attention_tokens)
    flat = ReplicaPrices.starting(1e-6, 1e-6, attention_tokens=FLAT)
    for _ in range(3000):
        prefix = rng.randint(2000, 8000)
        ttft = model.prefill_s(1000, prefix)
        growing.observe(prefix + 1000, prefix, 0, ttft)
        flat.observe(prefix + 1000, prefix, 0, ttft)
    truth = model.prefill_s(60_000, 0)
    assert growing.recompute_s(60_000) == pytest.approx(truth, rel=0.1)
    assert flat.recompute_s(60_000) < truth / 2


def test_prices_follow_unqueued_requests_not_queued_ones():
    """Queueing only adds to a request's time to first token: the low quantile finds the
    engine's prefill price under a mix of fast and slow samples."""
    prices = ReplicaPrices.starting(1e-3, 1e-3, attention_tokens=FLAT)
    rng = random.Random(4)
    for _ in range(3000):
        queued = rng.random() < 0.7
        ttft = 4000 * 5e-5 + (rng.uniform(1.0, 30.0) if queued else 0.0)
        prices.observe(4000, 0, 0, ttft)
    assert prices.recompute_s(10_000) == pytest.approx(0.5, rel=0.3)


def test_load_price_is_learned_from_host_hits():
    prices = ReplicaPrices.starting(1e-4, 1e-3, attention_tokens=FLAT)
    for _ in range(3000):
        prices.observe(20_000, 1000, 18_000, ttft_s=1000 * 1e-4 + 18_000 * 2e-6)
    assert prices.reload_s(1_000_000) == pytest.approx(2.0, rel=0.3)
    assert prices.view()["samples"] > 0


def test_prices_ignore_samples_that_say_nothing():
    prices = ReplicaPrices.starting(1e-4, 1e-5, attention_tokens=FLAT)
    before = (prices.prefill.value, prices.load.value)
    prices.observe(100, 0, 0, 5.0)  # too short a prefill to price
    prices.observe(5000, 4990, 0, 5.0)  # all cached on device
    prices.observe(5000, 0, 0, float("nan"))
    assert (prices.prefill.value, prices.load.value) == before


def test_survival_is_the_share_of_calls_that_last_longer():
    """Half the calls take 1 s, half 100 s: after 0.5 s, half survive another 10 s; once
    past 1 s, all that remain are long ones; past every observation there is no answer."""
    dist = filled([1.0] * 500 + [100.0] * 500)
    assert dist.survival(0.5, 10.0) == pytest.approx(0.5, abs=0.02)
    assert dist.survival(5.0, 10.0) == pytest.approx(1.0)
    assert dist.survival(0.0, 0.0) == pytest.approx(1.0)
    assert dist.survival(500.0, 1.0) is None


def test_heavy_tails_make_the_mean_residual_a_poor_guide_to_the_typical_call():
    """Pareto(alpha=1.2): the mean residual at 1 s is ~5 s, yet only ~1 call in 10 lasts
    5 s more: a move priced at 5 s is paid back on average, not usually."""
    rng = random.Random(3)
    dist = filled(rng.paretovariate(1.2) for _ in range(50_000))
    assert dist.remaining_s(1.0) > 3.0
    assert dist.survival(1.0, 5.0) == pytest.approx(6.0**-1.2, abs=0.03)


def test_predictor_survival_needs_a_distribution():
    predictor = DurationPredictor()
    assert predictor.stays_p(None, "bash", 0.0, 1.0) is None
    for _ in range(MIN_DIST_SAMPLES):
        predictor.observe(None, "bash", 2.0)
    assert predictor.stays_p(None, "bash", 0.0, 1.0) == pytest.approx(1.0)
    assert predictor.stays_p(None, "bash", 0.0, 5.0) == pytest.approx(0.0)


def test_residual_answers_both_questions_exactly_as_each_alone():
    """A victim pool asks the mean residual and the survival of each program at once
    (`residual`): the same floats as the two questions asked apart, past the data too, and
    from the predictor with and without a distribution."""
    rng = random.Random(7)
    dist = filled(rng.paretovariate(1.3) for _ in range(2_000))
    for _ in range(2_000):
        a, more = rng.uniform(-1.0, 2e3), rng.uniform(-1.0, 50.0)
        assert dist.residual(a, more) == (dist.remaining_s(a), dist.survival(a, more))
    predictor = DurationPredictor()
    assert predictor.residual(None, "bash", 3.0, 1.0) == (
        predictor.remaining_s(None, "bash", 3.0),
        None,
    )
    for _ in range(MIN_DIST_SAMPLES):
        predictor.observe(None, "bash", rng.uniform(0.5, 9.0))
    for a in (0.0, 1.0, 4.0, 40.0):
        assert predictor.residual(None, "bash", a, 2.0) == (
            predictor.remaining_s(None, "bash", a),
            predictor.stays_p(None, "bash", a, 2.0),
        )


@pytest.mark.parametrize("shape", ["pareto", "short", "few", "empty", "forgetful"])
def test_residual_many_is_residual_float_for_float(shape: str):
    """A victim pool or an urgent step prices a replica's programs in tool calls at once
    (numpy): every figure must be the float `remaining_s` and `survival` give, inside the
    bins, on their edges, below zero and past the data, or victims change."""
    rng = random.Random(shape)
    samples = {
        "pareto": [rng.paretovariate(1.3) for _ in range(2_000)],
        "short": [rng.uniform(0.0, 3.0) for _ in range(300)],
        "few": [0.0, 2.5, 1e6],
        "empty": [],
        "forgetful": [rng.expovariate(0.01) for _ in range(3_000)],
    }[shape]
    dist = DurationDistribution(half_life=50) if shape == "forgetful" else filled([])
    for d in samples:
        dist.observe(d)
    elapsed = [rng.uniform(-1.0, 5.0) for _ in range(300)] + [
        rng.uniform(0, 3e3) for _ in range(300)
    ]
    elapsed += [0.0, 1e5, 2e5] + [EDGES[rng.randrange(len(EDGES))] for _ in range(60)]
    more = [rng.uniform(-1.0, 50.0) for _ in elapsed]
    assert dist.residual_many(elapsed, more) == (
        [dist.remaining_s(a) for a in elapsed],
        [dist.survival(a, x) for a, x in zip(elapsed, more, strict=True)],
    )


def test_the_predictor_forgets_its_choice_of_distribution_when_it_learns():
    """The distribution a tool's calls are priced by is remembered between observations;
    an observation that gives the tool enough samples switches it at once."""
    predictor = DurationPredictor()
    cold = predictor.residual_many(None, "bash", [0.0, 5.0], [1.0, 1.0])
    assert cold == ([predictor.remaining_s(None, "bash", 0.0)] * 2, [None, None])
    for _ in range(MIN_DIST_SAMPLES):
        predictor.observe(None, "bash", 2.0)
    assert predictor.residual_many(None, "bash", [0.0, 5.0], [1.0, 1.0]) == (
        [predictor.remaining_s(None, "bash", a) for a in (0.0, 5.0)],
        [predictor.stays_p(None, "bash", a, 1.0) for a in (0.0, 5.0)],
    )
    assert predictor.remaining_s(None, "bash", 0.0) == pytest.approx(2.0, rel=0.1)


def test_the_round_trip_is_unknown_until_measured_then_follows_its_median():
    """0 (the router in the engine) until a step's round trip was seen; then the samples'
    median: one slow step in four does not move it far."""
    prices = ReplicaPrices.starting(1e-4, 1e-5, attention_tokens=FLAT)
    assert prices.round_trip_s == 0.0 and "round_trip_s" not in prices.view()
    prices.observe_round_trip(-0.001)  # a clock's noise: no sample
    assert prices.round_trip_s == 0.0
    rng = random.Random(3)
    for _ in range(400):
        prices.observe_round_trip(1.0 if rng.random() < 0.25 else rng.uniform(0.004, 0.006))
    assert 0.004 < prices.round_trip_s < 0.0065
    assert prices.view()["round_trip_s"] == round(prices.round_trip_s, 5)
