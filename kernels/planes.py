"""A KV pool as row planes behind a pointer table, the way HiCache's transfer kernels see it.

SGLang 0.5.23 keeps a model's KV cache in two pools (read from its source, not guessed):

- device (`sglang/srt/mem_cache/memory_pool.py`, `MHATokenToKVPool._create_buffers_normal`):
  one allocation per layer, `(2, slots, head_num, head_dim)`, K = `[0]`, V = `[1]`; the
  pool hands the kernels `k_buffer[layer]` and `v_buffer[layer]`, each `(slots, heads,
  head_dim)` with packed rows, through per-layer pointer tables (`k_data_ptrs`);
- host (`sglang/srt/mem_cache/pool_host/mha.py`, `MHATokenToKVPoolHost.init_kv_buffer`): one
  pinned buffer, `(2, layers, slots, heads, head_dim)` when `layout="layer_first"` and
  `(2, slots, layers, heads, head_dim)` when `layout="page_first"`; its per-layer views
  (`k_data_refs`) are `buffer[0][layer]` and `buffer[0][:, layer]`, so a host row is one
  token of one layer, `heads x head_dim` elements, rows `head_dim x heads` (layer_first) or
  `layers x heads x head_dim` (page_first) elements apart.

Slot indices are token rows in both pools; a page of `page_size` tokens is `page_size`
consecutive rows. `Planes` is that shared view: 2 x layers planes (K of every layer, then V
of every layer), each `(rows, heads, head_dim)` with one row stride, plus the table of their
addresses a kernel reads. Host addresses are pinned memory, which CUDA's unified addressing
lets a kernel read and write directly (SGLang builds the same tables from raw host
pointers: `pool_host/common.py`, `make_kernel_ptr_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

HostLayout = Literal["layer_first", "page_first"]
HOST_LAYOUTS: tuple[HostLayout, ...] = ("layer_first", "page_first")


@dataclass(frozen=True)
class Planes:
    """K of every layer, then V of every layer: `(rows, heads, head_dim)` views, one row stride."""

    views: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        first = self.views[0]
        if len(self.views) % 2:
            raise ValueError(f"planes come as K and V per layer; got {len(self.views)}")
        for view in self.views:
            same = view.shape == first.shape and view.dtype == first.dtype
            if not same or view.stride() != first.stride() or view.device != first.device:
                raise ValueError("every plane needs one shape, dtype, device and row stride")
        if first.dim() != 3 or first.stride(2) != 1 or first.stride(1) != first.shape[2]:
            raise ValueError(f"a plane is (rows, heads, head_dim) with packed rows; {first.shape}")

    @property
    def layers(self) -> int:
        return len(self.views) // 2

    @property
    def rows(self) -> int:
        return self.views[0].shape[0]

    @property
    def row_elements(self) -> int:
        """heads x head_dim: what one token of one layer holds in K (or V)."""
        return self.views[0].shape[1] * self.views[0].shape[2]

    @property
    def row_stride(self) -> int:
        """Elements from one row to the next in a plane."""
        return self.views[0].stride(0)

    @property
    def dtype(self) -> torch.dtype:
        return self.views[0].dtype

    @property
    def device(self) -> torch.device:
        return self.views[0].device

    @property
    def item_bytes(self) -> int:
        return self.views[0].element_size()

    def table(self, device: torch.device) -> torch.Tensor:
        """The planes' addresses, int64, on the device whose kernel reads them."""
        return torch.tensor([v.data_ptr() for v in self.views], dtype=torch.int64, device=device)


def device_planes(k: Sequence[torch.Tensor], v: Sequence[torch.Tensor]) -> Planes:
    """The device pool as SGLang holds it: `MHATokenToKVPool.k_buffer` and `.v_buffer`."""
    if len(k) != len(v):
        raise ValueError(f"{len(k)} K layers but {len(v)} V layers")
    return Planes((*k, *v))


def device_pool(
    layers: int, slots: int, heads: int, head_dim: int, dtype: torch.dtype, device: str
) -> Planes:
    """A device pool allocated as SGLang allocates it: one `(2, slots, ...)` block per layer."""
    blocks = [
        torch.zeros(2, slots, heads, head_dim, dtype=dtype, device=device) for _ in range(layers)
    ]
    return device_planes([b[0] for b in blocks], [b[1] for b in blocks])


def host_buffer(
    layout: HostLayout,
    layers: int,
    slots: int,
    heads: int,
    head_dim: int,
    dtype: torch.dtype,
    pin_memory: bool = False,
) -> torch.Tensor:
    """A host pool buffer in `layout`, shaped as `MHATokenToKVPoolHost.init_kv_buffer` shapes it."""
    dims = {
        "layer_first": (2, layers, slots, heads, head_dim),
        "page_first": (2, slots, layers, heads, head_dim),
    }
    if layout not in dims:
        raise ValueError(f"host layouts: {', '.join(HOST_LAYOUTS)}; got {layout!r}")
    return torch.zeros(dims[layout], dtype=dtype, pin_memory=pin_memory)


def host_planes(buffer: torch.Tensor, layout: HostLayout) -> Planes:
    """The per-layer views HiCache's kernels address (`k_data_refs`, `v_data_refs`)."""
    if layout == "layer_first":
        layers = buffer.shape[1]
        return Planes(tuple(buffer[c][layer] for c in (0, 1) for layer in range(layers)))
    if layout == "page_first":
        layers = buffer.shape[2]
        return Planes(tuple(buffer[c][:, layer] for c in (0, 1) for layer in range(layers)))
    raise ValueError(f"host layouts: {', '.join(HOST_LAYOUTS)}; got {layout!r}")
