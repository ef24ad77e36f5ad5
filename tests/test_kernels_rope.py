"""RoPE re-rotation: the kernel against its reference, and the shift against the model's RoPE."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs the kernels extra: pip install -e '.[kernels]'")
import torch  # noqa: E402

from kernels.rope import (  # noqa: E402
    position_table,
    rerotate,
    rerotate_reference,
    rope_inv_freq,
    shift_table,
)
from tests.kernels_support import DEVICES, DTYPES, MODELS, assert_within_ulp  # noqa: E402

QWEN3_THETA = 1_000_000.0  # Qwen3 config.json rope_theta


def _keys(tokens: int, heads: int, head_dim: int, dtype, device: str, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, head_dim, generator=generator).to(dtype=dtype, device=device)


def _hf_rope(keys: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Hugging Face's Llama/Qwen RoPE (neox): x * cos + rotate_half(x) * sin, all in fp32."""
    freqs = position_table(positions, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    x = keys.float()
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * emb.cos() + rotated * emb.sin()).to(keys.dtype)


def _model_keys(raw: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, rotary: int):
    """What the model caches at `positions`: its own fp32 cos/sin table applied to raw keys."""
    angles = position_table(positions, inv_freq)
    return rerotate_reference(raw, angles.cos(), angles.sin(), rotary)


def test_reference_is_hugging_face_neox_rope() -> None:
    raw = _keys(9, 4, 128, torch.float32, "cpu")
    positions = torch.arange(9) * 1000
    inv_freq = rope_inv_freq(128, QWEN3_THETA)
    expected = _hf_rope(raw, positions, inv_freq)
    torch.testing.assert_close(_model_keys(raw, positions, inv_freq, 128), expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "heads", "head_dim"), MODELS)
@pytest.mark.parametrize("rotary_share", [1, 2])  # full rotary, and half (partial) rotary
@pytest.mark.parametrize("tokens", [1, 37])
def test_kernel_matches_reference(device, dtype, model, heads, head_dim, rotary_share, tokens):
    rotary = head_dim // rotary_share
    keys = _keys(tokens, heads, head_dim, dtype, device)
    old = torch.arange(tokens) + 17
    cos, sin = shift_table(old, old + 4096, rope_inv_freq(rotary, QWEN3_THETA))
    cos, sin = cos.to(device), sin.to(device)
    out = rerotate(keys, cos, sin, rotary)
    expected = rerotate_reference(keys, cos, sin, rotary)
    assert_within_ulp(out, expected)
    assert torch.equal(out[..., rotary:], keys[..., rotary:])  # past rotary_dim: copied
    assert not torch.equal(out[..., :rotary], keys[..., :rotary])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shift", [1, 4096, 100_000])
def test_shift_gives_the_keys_the_model_caches_at_the_new_positions(device, dtype, shift):
    """A far shift too: the angle difference comes from the model's own fp32 angles."""
    inv_freq = rope_inv_freq(128, QWEN3_THETA)
    raw = _keys(33, 8, 128, torch.float32, "cpu", seed=1)
    old = torch.arange(33) * 3 + 50  # not contiguous: positions are per token
    new = old + shift
    cached = _model_keys(raw, old, inv_freq, 128).to(dtype)
    cos, sin = shift_table(old, new, inv_freq)
    moved = rerotate(cached.to(device), cos.to(device), sin.to(device), 128)
    fresh = _model_keys(raw, new, inv_freq, 128)
    # one rounding of the cached keys, one of the result, plus the interpreter's truncation
    bound = 3 * torch.finfo(dtype).eps * raw.abs().max().item()
    assert (moved.cpu().float() - fresh).abs().max().item() <= bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_no_shift_leaves_keys_bit_for_bit(device, dtype) -> None:
    keys = _keys(20, 8, 128, dtype, device)
    positions = torch.arange(20) + 9
    cos, sin = shift_table(positions, positions, rope_inv_freq(128, QWEN3_THETA))
    assert torch.equal(rerotate(keys, cos.to(device), sin.to(device), 128), keys)


def test_empty_and_malformed_inputs() -> None:
    keys = torch.empty(0, 8, 128, dtype=torch.float16)
    cos, sin = shift_table(torch.arange(0), torch.arange(0), rope_inv_freq(128, QWEN3_THETA))
    assert rerotate(keys, cos, sin, 128).shape == (0, 8, 128)
    keys = _keys(4, 8, 128, torch.float16, "cpu")
    cos, sin = shift_table(torch.arange(4), torch.arange(4) + 1, rope_inv_freq(128, QWEN3_THETA))
    with pytest.raises(ValueError, match="even"):
        rerotate(keys, cos, sin, 127)
    with pytest.raises(ValueError, match="tables"):
        rerotate(keys, cos, sin, 64)  # a 64-dim rotation needs 32-wide tables
