"""The priced pass's queue of held requests (`HeldQueue`): an event takes the first few.

`top` answers from its last call while nothing was pushed; these pin that it answers as
popping the heap would once a request left, moved between classes, or a new one came.
"""

from __future__ import annotations

from router.policy.displacement import HeldQueue
from router.policy.ordering import held_class
from router.policy.program import Program
from router.policy.types import Placement, Tier


def held(pid: str, tokens: int, steps: int = 1) -> Program:
    p = Program(pid, created_s=0.0, context_tokens=tokens, steps=steps)
    p.arrive(1.0)
    return p


def rank(p: Program) -> tuple:
    """Class first, then the smallest first: enough of a rank to order a queue."""
    return (held_class(p), p.context_tokens)


def no_rerank():
    raise AssertionError("nothing changed class")


def test_the_first_requests_come_in_rank_order_and_stay_queued():
    queue = HeldQueue()
    programs = [held(f"p{t}", t) for t in (300, 100, 200)]
    for p in programs:
        queue.push(p, rank)
    assert [p.program_id for p in queue.top(2, no_rerank)] == ["p100", "p200"]
    assert [p.program_id for p in queue.top(2, no_rerank)] == ["p100", "p200"]
    assert [p.program_id for p in queue.top(5, no_rerank)] == ["p100", "p200", "p300"]


def test_a_request_that_left_gives_its_place_to_the_next():
    queue = HeldQueue()
    a, b, c = held("a", 100), held("b", 200), held("c", 300)
    for p in (a, b, c):
        queue.push(p, rank)
    assert queue.top(2, no_rerank) == [a, b]
    a.start_reasoning(2.0)  # let through
    assert queue.top(2, no_rerank) == [b, c]
    b.arrive(3.0)  # answered and asked again: its entry is an old request's
    assert queue.top(2, no_rerank) == [c]


def test_a_request_placed_on_a_gpu_tier_leaves_the_queue():
    queue = HeldQueue()
    a, b = held("a", 100), held("b", 200)
    for p in (a, b):
        queue.push(p, rank)
    assert queue.top(1, no_rerank) == [a]
    a.placement = Placement(Tier.GPU, "r0")
    assert queue.top(1, no_rerank) == [b]


def test_a_request_that_changed_class_is_ranked_again():
    queue = HeldQueue()
    a, b = held("a", 100), held("b", 200)  # both returning (class 1)
    for p in (a, b):
        queue.push(p, rank)
    assert queue.top(1, no_rerank) == [a]
    b.placement = Placement(Tier.CPU, "r0")  # class 0 now, its entry still class 1's
    assert queue.top(1, no_rerank) == [a]  # b's entry is not reached: a is first
    assert queue.top(2, lambda: rank) == [a, b]  # reached, b is ranked again ...
    assert queue.top(1, no_rerank) == [b]  # ... and goes ahead of a


def test_a_new_request_ahead_of_the_first_is_seen():
    queue = HeldQueue()
    a, b = held("a", 100), held("b", 200)
    for p in (a, b):
        queue.push(p, rank)
    assert queue.top(2, no_rerank) == [a, b]
    c = held("c", 50)
    queue.push(c, rank)
    assert queue.top(2, no_rerank) == [c, a]
