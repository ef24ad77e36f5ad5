"""bench/kernels.py on the CPU at a toy size: every section runs and every check holds."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("triton", reason="needs the kernels extra: pip install -e '.[kernels]'")
import torch  # noqa: E402

from bench import kernels as bench  # noqa: E402
from router.presets import H100_80GB, ModelSpec, Preset  # noqa: E402

# A toy model: the sections' logic at a size the interpreter runs in seconds.
TOY = ModelSpec("toy", 1e6, 1e6, layers=2, q_heads=4, kv_heads=2, head_dim=64)


def _setup() -> bench.Setup:
    args = bench.parse_args(["--device", "cpu", "--tokens", "64", "--reps", "1"])
    return dataclasses.replace(bench.setup_of(args), preset=Preset("toy", H100_80GB, TOY))


def test_every_section_checks_out_on_the_cpu() -> None:
    setup = _setup()
    record = bench.Record({"device": "cpu"})
    record.rows = bench.transfer_rows(setup) + bench.diff_rows(setup) + bench.restore_rows(setup)
    rows, ratios = bench.recompute_rows(setup, record.rows)
    record.rows += rows
    record.ratios = bench.ratios_of(record.rows) | ratios
    checks = [row.check for row in record.rows if row.check]
    assert len(checks) == 10 and "MISMATCH" not in " ".join(checks)
    assert all(row.nbytes == 64 * TOY.kv_bytes_per_token for row in record.rows[:8])
    assert "dense / fused restore" in record.ratios
    assert record.ratios["recompute / transfer (Tokencake Fig. 13, paper)"] == 150
    text = bench.markdown(record, "python3 bench/kernels.py")
    assert "Architecture" in text and "interpreter" in text  # lscpu | head, and the CPU caveat


def test_the_decoder_layer_is_causal() -> None:
    """Recompute runs a real causal layer: a token's output ignores the tokens after it."""
    layer = bench.DecoderLayer(TOY, 128, _setup())
    x = torch.randn(6, TOY.q_heads * TOY.head_dim, generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    later = x.clone()
    later[4:] += 1.0
    out, out_later = layer(x), layer(later)
    assert torch.equal(out[:4], out_later[:4]) and not torch.equal(out[4:], out_later[4:])


def test_write_preset_needs_a_gpu(capsys) -> None:
    assert bench.main(["--device", "cpu", "--write-preset"]) == 2
    assert "needs CUDA" in capsys.readouterr().err
