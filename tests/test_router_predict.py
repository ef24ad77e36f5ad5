"""The live router driving `mori+predict`: copy cost from the config, policy wake-ups,
tool keys and agent roles from responses, and the tool hooks seen in the admin API."""

from __future__ import annotations

import pytest

from router.config import load_config
from router.controller import policy_config
from router.sim.presets import PRESETS


def test_load_time_per_token_comes_from_the_config_as_in_the_simulator():
    preset = PRESETS["h100-8b"]
    default = policy_config(load_config(None, {"replicas": ["http://r:1"]}, env={}))
    assert default.load_s_per_token == pytest.approx(
        preset.kv_bytes_per_token / preset.pcie_bytes_s
    )
    moe = PRESETS["b200-70b-tp2"]
    env = {"MORI_KV_BYTES_PER_TOKEN": str(moe.kv_bytes_per_token), "MORI_PCIE_GBPS": "100"}
    tuned = policy_config(load_config(None, {"replicas": ["http://r:1"]}, env=env))
    assert tuned.load_s_per_token == pytest.approx(moe.kv_bytes_per_token / moe.pcie_bytes_s)
