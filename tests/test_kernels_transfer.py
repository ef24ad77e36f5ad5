"""Paged block transfer: the kernel against its torch reference and against the page map."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="needs the kernels extra: pip install -e '.[kernels]'")
import torch  # noqa: E402

from kernels.planes import HOST_LAYOUTS, Planes, device_pool, host_buffer, host_planes  # noqa: E402
from kernels.transfer import PageMove, copy_rows, copy_rows_reference, move  # noqa: E402
from tests.kernels_support import DEVICES, DTYPES, MODELS, PAGE_SIZES, random_like  # noqa: E402

LAYERS = 2  # the copy is the same for every layer; two show K/V of layer l land in plane l
DEVICE_PAGES, HOST_PAGES = 12, 10


def _pools(device: str, dtype, heads: int, head_dim: int, page_size: int, layout: str):
    """A device pool full of random KV and an empty host buffer in `layout`."""
    pool = device_pool(LAYERS, DEVICE_PAGES * page_size, heads, head_dim, dtype, device)
    generator = torch.Generator().manual_seed(page_size * 1000 + heads)
    for view in pool.views:
        view.copy_(random_like(view, generator))
    pinned = device == "cuda"
    host = host_buffer(layout, LAYERS, HOST_PAGES * page_size, heads, head_dim, dtype, pinned)
    return pool, host


def _hint() -> list[PageMove]:
    """Three programs in one hint: several pages, one page, none."""
    return [
        PageMove(torch.tensor([7, 2, 11]), torch.tensor([0, 4, 9])),
        PageMove(torch.tensor([5]), torch.tensor([1])),
        PageMove(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64)),
    ]


def _rows(pages: list[int], page_size: int) -> list[int]:
    return [p * page_size + i for p in pages for i in range(page_size)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize(("model", "heads", "head_dim"), MODELS)
def test_offload_gathers_each_program_page_into_its_host_page(
    device, dtype, layout, page_size, model, heads, head_dim
) -> None:
    pool, host = _pools(device, dtype, heads, head_dim, page_size, layout)
    expected = host.clone()
    moved = move(pool, host_planes(host, layout), _hint(), page_size, "offload")
    move(
        pool, host_planes(expected, layout), _hint(), page_size, "offload", copy=copy_rows_reference
    )
    assert torch.equal(host, expected)  # kernel == reference, bit for bit
    planes = host_planes(host, layout)
    for program in _hint():
        dev = _rows(program.device_pages.tolist(), page_size)
        hst = _rows(program.host_pages.tolist(), page_size)
        for source, target in zip(pool.views, planes.views, strict=True):
            assert torch.equal(target[hst], source[dev].cpu())
    untouched = sorted(set(range(HOST_PAGES)) - {0, 4, 9, 1})
    for target in planes.views:
        assert not target[_rows(untouched, page_size)].any()
    assert moved == 4 * page_size * 2 * LAYERS * heads * head_dim * dtype.itemsize


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", HOST_LAYOUTS)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_load_puts_every_page_back_where_it_was(device, layout, page_size) -> None:
    pool, host = _pools(device, torch.bfloat16, 8, 128, page_size, layout)
    move(pool, host_planes(host, layout), _hint(), page_size, "offload")
    empty = device_pool(LAYERS, DEVICE_PAGES * page_size, 8, 128, torch.bfloat16, device)
    reference = device_pool(LAYERS, DEVICE_PAGES * page_size, 8, 128, torch.bfloat16, device)
    move(empty, host_planes(host, layout), _hint(), page_size, "load")
    move(reference, host_planes(host, layout), _hint(), page_size, "load", copy=copy_rows_reference)
    back = _rows([7, 2, 11, 5], page_size)
    rest = _rows(sorted(set(range(DEVICE_PAGES)) - {7, 2, 11, 5}), page_size)
    for got, ref, original in zip(empty.views, reference.views, pool.views, strict=True):
        assert torch.equal(got, ref)
        assert torch.equal(got[back], original[back])
        assert not got[rest].any()


@pytest.mark.parametrize("device", DEVICES)
def test_one_launch_for_a_hint_equals_one_per_program(device) -> None:
    pool, together = _pools(device, torch.float16, 4, 128, 16, "page_first")
    one_by_one = together.clone()
    move(pool, host_planes(together, "page_first"), _hint(), 16, "offload")
    for program in _hint():
        move(pool, host_planes(one_by_one, "page_first"), [program], 16, "offload")
    assert torch.equal(together, one_by_one)


@pytest.mark.parametrize("device", DEVICES)
def test_a_hint_with_nothing_to_move_moves_nothing(device) -> None:
    pool, host = _pools(device, torch.float16, 8, 128, 16, "layer_first")
    nothing = PageMove(torch.tensor([], dtype=torch.int64), torch.tensor([], dtype=torch.int64))
    assert move(pool, host_planes(host, "layer_first"), [], 16, "offload") == 0
    assert move(pool, host_planes(host, "layer_first"), [nothing], 16, "offload") == 0
    assert not host.any()


def test_copy_rows_moves_odd_sized_strided_rows_bit_for_bit() -> None:
    """Rows of 3 x 5 fp16 (30 B) go in 2-byte words into planes whose rows sit 2 rows apart."""
    generator = torch.Generator().manual_seed(3)
    odd = torch.empty(9, 3, 5, dtype=torch.float16)
    source = Planes(tuple(random_like(odd, generator) for _ in range(4)))
    buffer = torch.zeros(4, 9, 2, 3, 5, dtype=torch.float16)
    target = Planes(tuple(buffer[plane, :, 1] for plane in range(4)))
    rows_from, rows_to = torch.tensor([8, 0, 3]), torch.tensor([1, 2, 8])
    copy_rows(source, target, rows_from, rows_to)
    for s, t in zip(source.views, target.views, strict=True):
        assert torch.equal(t[rows_to], s[rows_from])
    assert not buffer[:, :, 0].any()  # the rows in between stay untouched


def test_mismatched_pools_are_refused() -> None:
    pool = device_pool(2, 16, 8, 128, torch.float16, "cpu")
    host = host_planes(host_buffer("layer_first", 2, 16, 8, 128, torch.bfloat16), "layer_first")
    with pytest.raises(ValueError, match="dtype"):
        move(pool, host, [PageMove(torch.tensor([0]), torch.tensor([0]))], 1, "offload")
    with pytest.raises(ValueError, match="one to one"):
        PageMove(torch.tensor([0, 1]), torch.tensor([0]))
    strided = torch.zeros(16, 2, 8, 128, dtype=torch.float16)[:, 0]
    with pytest.raises(ValueError, match="row stride"):
        Planes((pool.views[0], strided))
