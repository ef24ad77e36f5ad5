"""How a kernel runs: compiled for CUDA tensors, Triton's interpreter for CPU tensors.

Triton picks interpretation once, when `@triton.jit` decorates a function, from
TRITON_INTERPRET. One process may need both: the CPU tests run everywhere and the `gpu`
tests run beside them on a CUDA machine. So every kernel here is an ordinary `@triton.jit`
function, and `launch` runs the same source through Triton's interpreter when the tensors
live on the CPU. Kernels therefore call no other `@triton.jit` function (an interpreted
kernel cannot call a compiled helper): each is one self-contained function.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# torch dtype -> Triton element type, for kernels that compute on values (RoPE, diffs).
ELEMENT = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
# Raw words a copy kernel moves, widest first: copies are bit-exact whatever the dtype.
WORDS = ((8, tl.int64), (4, tl.int32), (2, tl.int16), (1, tl.int8))


@cache
def _interpreted(kernel: triton.JITFunction) -> InterpretedFunction:
    """The interpreter's version of a compiled kernel, built once per kernel."""
    return InterpretedFunction(kernel.fn)


def launch(kernel: triton.JITFunction, grid: tuple[int, ...], device: torch.device, *args, **meta):
    """Run `kernel` over `grid` on `device`: compiled on CUDA, interpreted on the CPU.

    Under TRITON_INTERPRET=1 `@triton.jit` already returns an interpreted function, which
    runs as it is on either device.
    """
    if any(size == 0 for size in grid):
        return  # nothing to move; a zero grid is an error for the CUDA launcher
    runnable = kernel
    if device.type == "cpu" and isinstance(kernel, triton.JITFunction):
        runnable = _interpreted(kernel)
    runnable[grid](*args, **meta)


def element_type(dtype: torch.dtype) -> tl.dtype:
    """Triton's element type for `dtype`; a clear error for one the kernels do not compute in."""
    try:
        return ELEMENT[dtype]
    except KeyError:
        raise TypeError(f"kernels compute in {sorted(map(str, ELEMENT))}; got {dtype}") from None


def word_type(*byte_counts: int) -> tuple[int, tl.dtype]:
    """The widest word that divides every size, stride and address a copy touches."""
    return next((s, w) for s, w in WORDS if all(count % s == 0 for count in byte_counts))


def pow2(n: int) -> int:
    """Triton block shapes are powers of two: the smallest one holding `n` (at least 1)."""
    return triton.next_power_of_2(max(n, 1))
