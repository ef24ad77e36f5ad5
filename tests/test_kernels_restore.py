"""Fused diff restore: the one-pass kernel against the dense restore, and what lands in the pool."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs the kernels extra: pip install -e '.[kernels]'")
import torch  # noqa: E402

from kernels.diff import Chunk, encode  # noqa: E402
from kernels.planes import device_pool  # noqa: E402
from kernels.restore import MirrorRestore, restore, restore_dense  # noqa: E402
from kernels.rope import position_table, rerotate_reference, rope_inv_freq, shift_table  # noqa: E402
from kernels.transfer import page_rows  # noqa: E402
from tests.kernels_support import DEVICES, DTYPES, MODELS, assert_within_ulp  # noqa: E402

LAYERS, POOL_PAGES, PAGE = 2, 8, 16
THETA = 500_000.0  # Llama-3 config.json rope_theta


def _family(tokens: int, heads: int, head_dim: int, dtype, device: str):
    """A master and a mirror that leaves it in a few places (K of layer 0, V of layer 1)."""
    generator = torch.Generator().manual_seed(tokens * heads)
    kv = torch.randn(2, LAYERS, tokens, heads, head_dim, generator=generator)
    master = Chunk(kv.to(dtype=dtype, device=device))
    mirror = master.kv.clone()
    mirror[0, 0, 2:4] += 1.0
    mirror[1, 1, tokens - 1] -= 1.0  # in the last, maybe short, block
    return master, Chunk(mirror)


def _slots(tokens: int, device: str) -> torch.Tensor:
    """The chunk's tokens on scattered pool pages, as a paged cache holds them."""
    pages = torch.randperm(POOL_PAGES, generator=torch.Generator().manual_seed(tokens))
    return page_rows(pages, PAGE)[:tokens].to(device)


def _both(master, diff, cos, sin, rotary, heads, head_dim, dtype, device, slots):
    """The pool after the fused kernel, and after the dense restore."""
    pools = [device_pool(LAYERS, POOL_PAGES * PAGE, heads, head_dim, dtype, device) for _ in "ab"]
    restore(MirrorRestore(master, diff, cos, sin, rotary, pools[0], slots))
    restore_dense(MirrorRestore(master, diff, cos, sin, rotary, pools[1], slots))
    return pools


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("model", "heads", "head_dim"), MODELS)
@pytest.mark.parametrize(("tokens", "block_size", "rotary_share"), [(45, 16, 1), (64, 32, 2)])
def test_fused_restore_matches_the_dense_restore(
    device, dtype, model, heads, head_dim, tokens, block_size, rotary_share
) -> None:
    rotary = head_dim // rotary_share
    master, mirror = _family(tokens, heads, head_dim, dtype, device)
    diff = encode(master, mirror, block_size)
    assert diff.count == 2
    old = torch.arange(tokens) + 100
    cos, sin = (t.to(device) for t in shift_table(old, old + 700, rope_inv_freq(rotary, THETA)))
    slots = _slots(tokens, device)
    fused, dense = _both(master, diff, cos, sin, rotary, heads, head_dim, dtype, device, slots)
    for layer in range(LAYERS):
        k_fused, k_dense = fused.views[layer], dense.views[layer]
        assert_within_ulp(k_fused, k_dense)
        assert torch.equal(k_fused[..., rotary:], k_dense[..., rotary:])
        assert torch.equal(fused.views[LAYERS + layer], dense.views[LAYERS + layer])
    outside = torch.ones(POOL_PAGES * PAGE, dtype=torch.bool, device=device)
    outside[slots] = False
    assert all(not view[outside].any() for view in fused.views)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_pool_holds_the_mirror_as_the_model_caches_it_at_its_positions(device, dtype):
    """Master cached at 0..T-1; the mirror's tokens sit at 5000.. in its own prompt."""
    tokens, rotary = 40, 128
    inv_freq = rope_inv_freq(rotary, THETA)
    generator = torch.Generator().manual_seed(5)
    raw = torch.randn(2, LAYERS, tokens, 8, 128, generator=generator)  # unrotated K, and V
    raw_mirror = raw.clone()
    raw_mirror[:, 1, 8:12] += 0.5  # the mirror's private tokens, layer 1
    old, new = torch.arange(tokens), torch.arange(tokens) + 5000

    def cached(kv: torch.Tensor, positions: torch.Tensor) -> Chunk:
        angles = position_table(positions, inv_freq)
        keys = [rerotate_reference(kv[0, i], angles.cos(), angles.sin(), rotary) for i in (0, 1)]
        return Chunk(torch.stack([torch.stack(keys), kv[1]]).to(dtype=dtype, device=device))

    master, mirror = cached(raw, old), cached(raw_mirror, old)
    diff = encode(master, mirror, 16)
    cos, sin = (t.to(device) for t in shift_table(old, new, inv_freq))
    pool = device_pool(LAYERS, POOL_PAGES * PAGE, 8, 128, dtype, device)
    slots = _slots(tokens, device)
    restore(MirrorRestore(master, diff, cos, sin, rotary, pool, slots))
    expected = cached(raw_mirror, new)
    bound = 3 * torch.finfo(dtype).eps * raw.abs().max().item()
    for layer in range(LAYERS):
        assert torch.equal(pool.views[LAYERS + layer][slots], mirror.kv[1, layer])
        gap = (pool.views[layer][slots].float() - expected.kv[0, layer].float()).abs().max()
        assert gap.item() <= bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [1, 16])
def test_an_empty_diff_restores_the_master(device, tokens) -> None:
    master, _ = _family(tokens, 4, 128, torch.float16, device)
    diff = encode(master, master, 16)
    assert diff.count == 0
    positions = torch.arange(tokens)
    cos, sin = (t.to(device) for t in shift_table(positions, positions, rope_inv_freq(128, THETA)))
    slots = _slots(tokens, device)
    fused, _ = _both(master, diff, cos, sin, 128, 4, 128, torch.float16, device, slots)
    for layer in range(LAYERS):
        assert torch.equal(fused.views[layer][slots], master.kv[0, layer])  # no shift: exact
        assert torch.equal(fused.views[LAYERS + layer][slots], master.kv[1, layer])


def test_a_pool_that_does_not_fit_the_chunk_is_refused() -> None:
    master, mirror = _family(16, 4, 128, torch.float16, "cpu")
    diff = encode(master, mirror, 16)
    cos, sin = shift_table(torch.arange(16), torch.arange(16), rope_inv_freq(128, THETA))
    narrow = device_pool(LAYERS, 64, 8, 128, torch.float16, "cpu")
    with pytest.raises(ValueError, match="heads"):
        MirrorRestore(master, diff, cos, sin, 128, narrow, torch.arange(16))
    pool = device_pool(LAYERS, 64, 4, 128, torch.float16, "cpu")
    with pytest.raises(ValueError, match="slot"):
        MirrorRestore(master, diff, cos, sin, 128, pool, torch.arange(15))
    with pytest.raises(ValueError, match="slot"):
        MirrorRestore(master, diff, cos, sin[:, :32], 128, pool, torch.arange(16))
