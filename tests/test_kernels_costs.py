"""The costs the simulator may price, and where the presets' PCIe figure comes from (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bench.preset_writer import PRESETS, gpu_constant, rewrite
from kernels.costs import (
    RESTORE_DENSE_PER_MIRROR,
    RESTORE_FUSED_PER_MIRROR,
    RestorePasses,
    restore_cost,
)
from router.presets import LLAMA_31_8B
from router.presets import PRESETS as HARDWARE


def test_costs_import_without_torch() -> None:
    code = "import sys, kernels.costs; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_restore_model_is_passes_of_kv_bytes_over_hbm() -> None:
    preset = HARDWARE["h100-8b"]
    cost = restore_cost(preset.kv_bytes_per_token, preset.bytes_s)
    per_pass = LLAMA_31_8B.kv_bytes_per_token / preset.bytes_s  # 128 KiB at 2.345 TB/s
    assert cost.fused_s_per_token == pytest.approx(per_pass * 2.09)
    assert cost.dense_s_per_token == pytest.approx(per_pass * 5.18)
    assert cost.mirror_s(1000) == pytest.approx(1000 * cost.fused_s_per_token)
    assert cost.mirror_s(1000, fused=False) == pytest.approx(1000 * cost.dense_s_per_token)
    assert cost.source.startswith("model:")


def test_model_speedup_sits_in_the_papers_measured_range() -> None:
    """TokenDance measured fused restore 1.3-2.6x faster than dense (0.59 / 0.43 = 1.37 in the
    figure it quotes); the pass model at its 9% diff share must land in that range."""
    passes = RestorePasses()
    assert 1.3 <= passes.dense / passes.fused <= 2.6
    paper = RESTORE_DENSE_PER_MIRROR.seconds / RESTORE_FUSED_PER_MIRROR.seconds
    assert 1.3 <= paper <= 2.6
    assert RESTORE_FUSED_PER_MIRROR.source.startswith("paper:")
    assert RestorePasses(diff_share=0).dense / RestorePasses(diff_share=0).fused == 2.5


def test_every_gpu_preset_names_the_source_of_its_pcie_figure() -> None:
    for preset in HARDWARE.values():
        assert preset.gpu.pcie_source.startswith(("estimate:", "measured:")), preset.name


def test_write_preset_replaces_one_gpus_figure_and_nothing_else() -> None:
    text = PRESETS.read_text()
    source = "measured: bench/kernels.py on NVIDIA H100 80GB HBM3, 2026-12-01, reload " * 2
    new = rewrite(text, "H100_80GB", 52.25e9, source)
    before, after = {}, {}
    exec(compile(text, "presets", "exec"), before)  # the repository's own file, as it is
    exec(compile(new, "presets", "exec"), after)  # and rewritten
    assert after["H100_80GB"].pcie_bytes_s == 52.25e9
    assert after["H100_80GB"].pcie_source == source
    assert after["H100_80GB"].hbm_bytes_s == before["H100_80GB"].hbm_bytes_s
    assert repr(after["H200"]) == repr(before["H200"])  # two modules: compare by value
    assert repr(after["B200"]) == repr(before["B200"])
    formatted = [sys.executable, "-m", "ruff", "format", "--check", "--stdin-filename", "p.py", "-"]
    subprocess.run(formatted, input=new, text=True, check=True)  # as ruff would write it
    assert rewrite(new, "H100_80GB", 52.25e9, source) == new  # idempotent


def test_gpu_constant_from_device_name() -> None:
    assert gpu_constant("NVIDIA H100 80GB HBM3") == "H100_80GB"
    assert gpu_constant("NVIDIA H200") == "H200"
    with pytest.raises(ValueError, match="no GPU preset"):
        gpu_constant("NVIDIA A100-SXM4-80GB")
