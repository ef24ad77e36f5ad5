"""Shared by the kernel tests: devices, real model shapes, random KV, the rotation tolerance.

Test modules import it after `pytest.importorskip("triton", reason=EXTRA)`, so that without
the `kernels` extra they skip with that reason instead of failing to import.
"""

from __future__ import annotations

import pytest
import torch

# Every kernel test runs on the CPU (Triton's interpreter) and again on CUDA where there is one.
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: no GPU here"),
        ],
    ),
]
DTYPES = [torch.float16, torch.bfloat16]

# (name, KV heads, head_dim) from each model's config.json.
MODELS = [
    ("Llama-3.1-8B", 8, 128),  # num_key_value_heads 8, hidden 4096 / 32 heads
    ("Qwen3-8B", 8, 128),  # num_key_value_heads 8, head_dim 128
    ("Qwen3-30B-A3B", 4, 128),  # num_key_value_heads 4, head_dim 128
]
PAGE_SIZES = [1, 16, 64]  # SGLang's default page size is 1; HiCache deployments use 16-64


def random_like(tensor: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Normal values in `tensor`'s dtype and device (drawn on the CPU: same on every device)."""
    values = torch.randn(tensor.shape, generator=generator)
    return values.to(dtype=tensor.dtype, device=tensor.device)


def assert_within_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Rotated values: at most one unit in the last place of their dtype apart.

    fp32 math then one rounding to fp16/bf16; Triton's interpreter truncates fp32 -> bf16 where
    torch and CUDA round to nearest even, which is less than one unit off.
    """
    eps = torch.finfo(expected.dtype).eps
    tiny = torch.finfo(expected.dtype).tiny
    torch.testing.assert_close(actual.float(), expected.float(), rtol=eps, atol=tiny)
