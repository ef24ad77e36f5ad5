"""Paged block transfer: a hint's programs, gathered from the device pool to host and back.

Tokencake (sections 4.3, 6) offloads a stalled agent's whole KV cache at a tool call and
uploads it before the call ends, asynchronously and for many blocks at once. Here one hint
may move several programs: `hint_rows` concatenates their pages into one row list, so a
single launch moves every page of every program, K and V of every layer, in the host pool
layout HiCache uses (`planes.HOST_LAYOUTS`). On CUDA the launch is asynchronous on the
current stream (run it under `torch.cuda.stream(...)` to overlap compute); host planes must
be pinned so the kernel reaches them directly.

`copy_rows` is the kernel (raw words: bit-exact for any dtype); `copy_rows_reference` is the
same copy in torch indexing. `move` (offload or load) takes either.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl

from kernels.launch import launch, pow2, word_type
from kernels.planes import Planes

# Rows one program copies. On CUDA a few rows of every plane keep many programs in flight;
# the interpreter runs programs one after another in Python, so it gets fewer, bigger ones.
ROWS_PER_PROGRAM = {"cuda": 4, "cpu": 64}
MAX_WORDS_PER_STEP = 512  # a row wider than this is copied in steps (registers per program)


@dataclass(frozen=True)
class PageMove:
    """One program's pages: device page `i` goes to (or comes back from) host page `i`."""

    device_pages: torch.Tensor
    host_pages: torch.Tensor

    def __post_init__(self) -> None:
        if self.device_pages.shape != self.host_pages.shape or self.device_pages.dim() != 1:
            raise ValueError("device and host pages pair up one to one (1-D, same length)")


RowCopy = Callable[[Planes, Planes, torch.Tensor, torch.Tensor], None]
Direction = Literal["offload", "load"]


def page_rows(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """The token rows of `pages`, page after page (a page is `page_size` consecutive rows)."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=pages.device)
    return (pages.to(torch.int64)[:, None] * page_size + offsets).reshape(-1)


def hint_rows(
    moves: Sequence[PageMove], page_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Device rows and host rows of every program one hint moves, for one launch."""
    empty = torch.empty(0, dtype=torch.int64)
    device_pages = torch.cat([empty, *(m.device_pages.cpu() for m in moves)])
    host_pages = torch.cat([empty, *(m.host_pages.cpu() for m in moves)])
    return (
        page_rows(device_pages, page_size).to(device),
        page_rows(host_pages, page_size).to(device),
    )


@triton.jit
def _copy_rows_kernel(
    src_table,
    dst_table,
    src_rows,
    dst_rows,
    n_rows,
    src_stride,
    dst_stride,
    ROW_WORDS: tl.constexpr,
    WORD: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
):
    """Program (i, p): rows [i*BLOCK_ROWS, ...) of the row lists, in plane p (K or V of a layer)."""
    plane = tl.program_id(1)
    src = tl.load(src_table + plane).to(tl.pointer_type(WORD))
    dst = tl.load(dst_table + plane).to(tl.pointer_type(WORD))
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    live = r < n_rows
    s = tl.load(src_rows + r, mask=live, other=0)[:, None] * src_stride
    d = tl.load(dst_rows + r, mask=live, other=0)[:, None] * dst_stride
    for w0 in range(0, ROW_WORDS, BLOCK_WORDS):
        w = w0 + tl.arange(0, BLOCK_WORDS)[None, :]
        mask = live[:, None] & (w < ROW_WORDS)
        tl.store(dst + d + w, tl.load(src + s + w, mask=mask), mask=mask)


def _kernel_device(src: Planes, dst: Planes) -> torch.device:
    """A copy runs on the GPU whenever either side lives there (host pinned planes or not)."""
    return dst.device if dst.device.type == "cuda" else src.device


def _check_pair(src: Planes, dst: Planes, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    if src.views[0].shape[1:] != dst.views[0].shape[1:] or src.dtype != dst.dtype:
        raise ValueError("source and destination planes differ in (heads, head_dim) or dtype")
    if len(src.views) != len(dst.views):
        raise ValueError(f"{src.layers} source layers but {dst.layers} destination layers")
    if src_rows.shape != dst_rows.shape:
        raise ValueError("source and destination rows pair up one to one")


def copy_rows(src: Planes, dst: Planes, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
    """Copy row `src_rows[i]` of every source plane to row `dst_rows[i]` of the same plane."""
    _check_pair(src, dst, src_rows, dst_rows)
    device = _kernel_device(src, dst)
    item = src.item_bytes
    addresses = [v.data_ptr() for v in (*src.views, *dst.views)]
    size, word = word_type(
        src.row_elements * item, src.row_stride * item, dst.row_stride * item, *addresses
    )
    row_words = src.row_elements * item // size
    rows_per_program = ROWS_PER_PROGRAM[device.type]
    grid = (triton.cdiv(src_rows.numel(), rows_per_program), len(src.views))
    launch(
        _copy_rows_kernel,
        grid,
        device,
        src.table(device),
        dst.table(device),
        src_rows.to(device),
        dst_rows.to(device),
        src_rows.numel(),
        src.row_stride * item // size,
        dst.row_stride * item // size,
        ROW_WORDS=row_words,
        WORD=word,
        BLOCK_ROWS=rows_per_program,
        BLOCK_WORDS=min(pow2(row_words), MAX_WORDS_PER_STEP),
    )


def copy_rows_reference(
    src: Planes, dst: Planes, src_rows: torch.Tensor, dst_rows: torch.Tensor
) -> None:
    """`copy_rows` in torch indexing: one gather and one scatter per plane."""
    _check_pair(src, dst, src_rows, dst_rows)
    for s, d in zip(src.views, dst.views, strict=True):
        d[dst_rows.to(d.device)] = s[src_rows.to(s.device)].to(d.device)


def moved_bytes(planes: Planes, rows: int) -> int:
    """Bytes a copy of `rows` rows moves: K and V of every layer."""
    return rows * len(planes.views) * planes.row_elements * planes.item_bytes


def move(
    device: Planes,
    host: Planes,
    moves: Sequence[PageMove],
    page_size: int,
    direction: Direction,
    copy: RowCopy = copy_rows,
) -> int:
    """Offload (gather the programs' device pages into their host pages) or load (scatter them
    back), every program of the hint in one copy; the bytes moved."""
    device_rows, host_rows = hint_rows(moves, page_size, device.device)
    if direction == "offload":
        copy(device, host, device_rows, host_rows)
    else:
        copy(host, device, host_rows, device_rows)
    return moved_bytes(device, device_rows.numel())
