"""The policy's value types."""

import copy
import pickle

import pytest

from router.policy.types import Placement, Tier

GPU0 = Placement(Tier.GPU, "r0")


def test_a_placement_is_one_interned_immutable_value():
    """The policy looks placements up by identity (one instance per tier and replica):
    built again, copied or pickled across the owner link, it is the same object, equal to
    itself only, and cannot be changed in place."""
    again = Placement(Tier.GPU, "r0")
    assert again is GPU0 and hash(again) == hash(GPU0)
    assert pickle.loads(pickle.dumps(GPU0)) is GPU0 and copy.deepcopy(GPU0) is GPU0
    assert Placement(Tier.CPU, "r0") != GPU0 and Placement(Tier.GPU, "r1") != GPU0
    assert Placement("gpu", "r0") is GPU0  # a tier by its value, as config and hints name it
    assert Placement("waiting") is Placement(Tier.WAITING)
    assert {GPU0: 1}[Placement(Tier.GPU, "r0")] == 1
    with pytest.raises(AttributeError):
        GPU0.replica = "r1"  # type: ignore[misc]
    with pytest.raises(ValueError):
        Placement(Tier.GPU)  # a GPU tier needs its replica
    with pytest.raises(ValueError):
        Placement(Tier.WAITING, "r0")
    with pytest.raises(ValueError):
        Placement("waiting", "r0")  # by value too
    assert str(GPU0) == "gpu(r0)" and str(Placement(Tier.WAITING)) == "waiting"
