"""Block-sparse diff encode: block errors bit for bit, the blocks chosen, the error bound."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs the kernels extra: pip install -e '.[kernels]'")
import torch  # noqa: E402

from kernels.diff import Chunk, apply, block_errors, block_errors_reference, encode  # noqa: E402
from tests.kernels_support import DEVICES, DTYPES, MODELS  # noqa: E402

LAYERS = 2


def _master(tokens: int, heads: int, head_dim: int, dtype, device: str) -> Chunk:
    generator = torch.Generator().manual_seed(tokens + heads)
    kv = torch.randn(2, LAYERS, tokens, heads, head_dim, generator=generator)
    return Chunk(kv.to(dtype=dtype, device=device))


def _edited(master: Chunk, edits: list[tuple[int, int, int]]) -> Chunk:
    """The master with +1 at (K/V plane, layer, token) for each edit: a sibling's private spots."""
    kv = master.kv.clone()
    for plane, layer, token in edits:
        kv[plane, layer, token, 0, 0] += 1.0
    return Chunk(kv)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "heads", "head_dim"), MODELS)
@pytest.mark.parametrize(("tokens", "block_size"), [(1, 16), (45, 16), (64, 32), (40, 64)])
def test_block_errors_kernel_matches_reference_bit_for_bit(
    device, dtype, model, heads, head_dim, tokens, block_size
) -> None:
    master = _master(tokens, heads, head_dim, dtype, device)
    noise = torch.randn(master.kv.shape, generator=torch.Generator().manual_seed(7)) * 1e-2
    sibling = Chunk(master.kv + noise.to(dtype=dtype, device=device))
    errors = block_errors(master, sibling, block_size)
    assert errors.shape == (LAYERS, master.blocks(block_size))
    assert torch.equal(errors, block_errors_reference(master, sibling, block_size))
    assert (errors > 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_an_exact_diff_holds_the_touched_blocks_and_rebuilds_the_sibling(device, dtype) -> None:
    """45 tokens in 16-token blocks: the short last block (32-44) is one of the touched ones."""
    master = _master(45, 8, 128, dtype, device)
    sibling = _edited(master, [(0, 0, 3), (0, 0, 5), (1, 1, 17), (1, 0, 44)])
    diff = encode(master, sibling, 16)
    touched = sorted(zip(diff.layers.tolist(), diff.blocks.tolist(), strict=True))
    assert touched == [(0, 0), (0, 2), (1, 1)]
    assert diff.values.shape == (2, 3, 16, 8, 128)
    assert torch.equal(apply(master, diff).kv, sibling.kv)
    reference = encode(master, sibling, 16, errors=block_errors_reference)
    for got, want in zip(
        (diff.layers, diff.blocks, diff.values),
        (reference.layers, reference.blocks, reference.values),
        strict=True,
    ):
        assert torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_k_and_v_share_one_block_list(device) -> None:
    """A block where only V moved is stored once, K and V together (K as the master's)."""
    master = _master(32, 8, 128, torch.bfloat16, device)
    diff = encode(master, _edited(master, [(1, 1, 20)]), 16)
    assert (diff.layers.tolist(), diff.blocks.tolist()) == ([1], [1])
    assert torch.equal(diff.values[0, 0], master.kv[0, 1, 16:32])
    index_bytes = 2 * 1 * 4  # (layer, block) int32 pairs
    assert diff.nbytes == 2 * 16 * 8 * 128 * 2 + index_bytes


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_within_atol_stay_out_and_the_bound_holds(device, dtype) -> None:
    master = _master(64, 8, 128, dtype, device)
    generator = torch.Generator().manual_seed(11)
    noise = (torch.rand(master.kv.shape, generator=generator) - 0.5) * 0.02  # |noise| <= 0.01
    kv = master.kv + noise.to(dtype=dtype, device=device)
    kv[0, 1, 40:48] += 0.5  # one real change, in block 2 of layer 1
    sibling = Chunk(kv)
    atol = 0.05
    diff = encode(master, sibling, 16, atol)
    assert (diff.layers.tolist(), diff.blocks.tolist()) == ([1], [2])
    error = (apply(master, diff).kv.float() - sibling.kv.float()).abs().max().item()
    assert 0 < error <= atol


@pytest.mark.parametrize("device", DEVICES)
def test_identical_caches_give_an_empty_diff(device) -> None:
    master = _master(20, 4, 128, torch.float16, device)
    diff = encode(master, Chunk(master.kv.clone()), 16)
    assert diff.count == 0 and diff.nbytes == 0
    assert torch.equal(apply(master, diff).kv, master.kv)


def test_mismatched_caches_are_refused() -> None:
    master = _master(20, 4, 128, torch.float16, "cpu")
    with pytest.raises(ValueError, match="shape and dtype"):
        encode(master, Chunk(master.kv.bfloat16()), 16)
    with pytest.raises(ValueError, match="block_size"):
        encode(master, master, 0)
    with pytest.raises(ValueError, match="contiguous"):
        Chunk(master.kv[0])
