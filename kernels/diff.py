"""Block-sparse diff: a sibling KV cache stored as the blocks where it leaves a master copy.

TokenDance (sections 4.3, 5) keeps one dense cache per group of agents (the master) and
every other agent's cache (a mirror) as the blocks that differ from it: K and V share one
list of touched blocks, and the mirror is rebuilt on restore (`kernels.restore`). Its
caches differ in 10-20% of positions, clustered in blocks (53 of 500-700 32-token blocks
per mirror on Qwen2.5-7B, its Fig. 12).

Here a block is `block_size` consecutive tokens of one layer, K and V together. A block
enters the diff when any K or V element of the sibling is more than `atol` away from the
master's (0: any difference). The diff holds the sibling's own values for those blocks, not
deltas, so the error bound is exact: rebuilt and sibling differ by at most `atol` in any
element, and are equal when `atol` is 0.

`block_errors` is the kernel (one pass over both caches; fp32 max of |sibling - master| per
block); `block_errors_reference` is the same in torch. Both compute the same fp32 values
and take a max, which is order-free, so they agree bit for bit. Packing the chosen blocks
is torch indexing either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import launch, pow2

MAX_ELEMENTS_PER_STEP = 4096  # a block is scanned this many elements at a time


@dataclass(frozen=True)
class Chunk:
    """One program's dense KV cache: `kv` is (2, layers, tokens, heads, head_dim), K then V."""

    kv: torch.Tensor

    def __post_init__(self) -> None:
        if self.kv.dim() != 5 or self.kv.shape[0] != 2 or not self.kv.is_contiguous():
            raise ValueError(
                f"a chunk is contiguous (2, layers, tokens, heads, dim); {self.kv.shape}"
            )

    @property
    def layers(self) -> int:
        return self.kv.shape[1]

    @property
    def tokens(self) -> int:
        return self.kv.shape[2]

    def blocks(self, block_size: int) -> int:
        """Blocks of `block_size` tokens, the last one possibly short."""
        return triton.cdiv(self.tokens, block_size)

    def blocked(self, block_size: int) -> torch.Tensor:
        """(2, layers, blocks, block_size, heads, dim), the short last block padded with zeros."""
        pad = self.blocks(block_size) * block_size - self.tokens
        kv = torch.nn.functional.pad(self.kv, (0, 0, 0, 0, 0, pad))
        return kv.view(2, self.layers, -1, block_size, *self.kv.shape[3:])


@dataclass(frozen=True)
class BlockDiff:
    """A mirror's blocks that leave the master: where they are and the mirror's values there."""

    layers: torch.Tensor  # int32 (n,): the layer of each diff block
    blocks: torch.Tensor  # int32 (n,): its block index within the layer
    values: torch.Tensor  # (2, n, block_size, heads, head_dim): the mirror's K and V there
    block_size: int
    atol: float  # every element outside the diff is within atol of the master's

    @property
    def count(self) -> int:
        return self.layers.numel()

    @property
    def nbytes(self) -> int:
        """What the diff stores: values plus the shared (layer, block) index list."""
        indices = self.layers.nbytes + self.blocks.nbytes
        return self.values.numel() * self.values.element_size() + indices

    def block_map(self, layers: int, blocks: int) -> torch.Tensor:
        """int32 (layers, blocks): each block's row in `values`, -1 where the master holds."""
        slots = torch.full((layers, blocks), -1, dtype=torch.int32, device=self.values.device)
        rows = torch.arange(self.count, dtype=torch.int32, device=self.values.device)
        slots[self.layers.long(), self.blocks.long()] = rows
        return slots


BlockErrors = Callable[[Chunk, Chunk, int], torch.Tensor]


def _check_pair(master: Chunk, sibling: Chunk, block_size: int) -> None:
    if master.kv.shape != sibling.kv.shape or master.kv.dtype != sibling.kv.dtype:
        raise ValueError("master and sibling need one shape and dtype")
    if block_size < 1:
        raise ValueError(f"block_size must be positive; got {block_size}")


def block_errors_reference(master: Chunk, sibling: Chunk, block_size: int) -> torch.Tensor:
    """fp32 (layers, blocks): the largest |sibling - master| over each block's K and V."""
    _check_pair(master, sibling, block_size)
    gap = (sibling.blocked(block_size).float() - master.blocked(block_size).float()).abs()
    return gap.amax(dim=(0, 3, 4, 5))


@triton.jit
def _block_errors_kernel(
    master,
    sibling,
    errors,
    n_tokens,
    n_blocks,
    n_layers,
    ROW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,
):
    """Program (b, l): block b of layer l is one contiguous run of the chunk in K and one in V
    (tokens x heads x head_dim); both are scanned BLOCK_E elements at a time."""
    b = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)  # chunk offsets pass 2**31 at long contexts
    size = tl.minimum(BLOCK_SIZE, n_tokens - b * BLOCK_SIZE) * ROW  # the last block may be short
    worst = tl.full((BLOCK_E,), 0.0, tl.float32)
    for kv in range(2):
        start = ((kv * n_layers + layer) * n_tokens + b * BLOCK_SIZE) * ROW
        for e0 in range(0, BLOCK_SIZE * ROW, BLOCK_E):
            e = e0 + tl.arange(0, BLOCK_E)
            m = tl.load(master + start + e, mask=e < size, other=0.0).to(tl.float32)
            s = tl.load(sibling + start + e, mask=e < size, other=0.0).to(tl.float32)
            worst = tl.maximum(worst, tl.abs(s - m))
    # tl.max is reduce(_elementwise_max); called as such, the interpreter runs it as np.nanmax.
    tl.store(errors + layer * n_blocks + b, tl.reduce(worst, 0, tl.standard._elementwise_max))


def block_errors(master: Chunk, sibling: Chunk, block_size: int) -> torch.Tensor:
    """`block_errors_reference` as one kernel over every (block, layer)."""
    _check_pair(master, sibling, block_size)
    blocks, row = master.blocks(block_size), master.kv.shape[3] * master.kv.shape[4]
    errors = torch.zeros(master.layers, blocks, dtype=torch.float32, device=master.kv.device)
    launch(
        _block_errors_kernel,
        (blocks, master.layers),
        master.kv.device,
        master.kv,
        sibling.kv,
        errors,
        master.tokens,
        blocks,
        master.layers,
        ROW=row,
        BLOCK_SIZE=block_size,
        BLOCK_E=min(pow2(block_size * row), MAX_ELEMENTS_PER_STEP),
    )
    return errors


def encode(
    master: Chunk,
    sibling: Chunk,
    block_size: int,
    atol: float = 0.0,
    errors: BlockErrors = block_errors,
) -> BlockDiff:
    """The sibling as a diff against the master: its blocks more than `atol` away."""
    layers, blocks = torch.nonzero(errors(master, sibling, block_size) > atol, as_tuple=True)
    values = sibling.blocked(block_size)[:, layers, blocks]
    return BlockDiff(layers.int(), blocks.int(), values.contiguous(), block_size, atol)


def apply(master: Chunk, diff: BlockDiff) -> Chunk:
    """The dense mirror: a copy of the master with the diff's blocks written over it."""
    mirror = master.kv.clone()
    offsets = torch.arange(diff.block_size, device=mirror.device)
    tokens = diff.blocks.long()[:, None] * diff.block_size + offsets  # (n, block_size)
    inside = tokens < master.tokens  # the short last block's padding stays out
    layers = diff.layers.long()[:, None].expand_as(tokens)
    mirror[:, layers[inside], tokens[inside]] = diff.values[:, inside]
    return Chunk(mirror)
