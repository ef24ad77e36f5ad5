"""RoPE re-rotation: cached keys moved from one position range to another, without the model.

A key cached at position p holds R(theta_p) k, the raw key rotated by the model's angles.
Reusing it at position q (a shared block that lands elsewhere in a sibling's prompt,
TokenDance section 4.4, or a prefix shifted by an edit) needs R(theta_q) k =
R(theta_q - theta_p) R(theta_p) k: one rotation by the angle difference, no recompute.

Style: **neox** (rotate-half), what Llama and Qwen use (HF `rotate_half`, SGLang
`is_neox_style=True`): dimension i pairs with i + rotary_dim/2 for i < rotary_dim/2.
`rotary_dim` may be below `head_dim` (partial rotary); the dimensions past it are copied.
GPT-J's interleaved style (pairs 2i, 2i+1) is not supported.

Exactness: the angle difference is taken from the model's own angles, computed as SGLang
computes them (`rotary_embedding/base.py`: inv_freq in fp32, angles = positions x inv_freq
in fp32), then subtracted and turned into cos/sin in float64 and rounded once to fp32. So a
shift reproduces what the model would have cached at the new positions up to the fp32
rounding of cos/sin and one rounding to the storage dtype; it never accumulates the fp32
angle error a large shift would give `cos(fp32(delta x inv_freq))`. Models that rescale
frequencies (Llama-3.1's `llama3` rope_scaling) pass their own rescaled `inv_freq`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import launch, pow2

TOKENS_PER_PROGRAM = {"cuda": 16, "cpu": 128}  # as in transfer: few big programs interpreted


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """The model's inverse frequencies, fp32, exactly SGLang's `_compute_inv_freq` (no scaling)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))


def position_table(positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """The model's angles at `positions`, fp32 `(tokens, rotary_dim/2)`, as SGLang caches them."""
    return positions.to(torch.float)[:, None] * inv_freq.to(torch.float)[None, :]


def shift_table(
    old_positions: torch.Tensor, new_positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, fp32 `(tokens, rotary_dim/2)`, of the rotation from old to new positions."""
    delta = position_table(new_positions, inv_freq).double()
    delta -= position_table(old_positions, inv_freq).double()
    return delta.cos().float(), delta.sin().float()


def _check(keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
    if keys.dim() != 3 or not keys.is_contiguous():
        raise ValueError(f"keys are contiguous (tokens, heads, head_dim); got {keys.shape}")
    if rotary_dim % 2 or not 0 < rotary_dim <= keys.shape[2]:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and within head_dim")
    want = (keys.shape[0], rotary_dim // 2)
    if cos.shape != want or sin.shape != want:
        raise ValueError(f"cos/sin tables are (tokens, rotary_dim/2) = {want}; got {cos.shape}")


def rerotate_reference(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """Keys rotated by the angles behind (cos, sin), in fp32, rounded once to their dtype."""
    _check(keys, cos, sin, rotary_dim)
    half = rotary_dim // 2
    x1 = keys[..., :half].float()
    x2 = keys[..., half:rotary_dim].float()
    c, s = cos[:, None, :], sin[:, None, :]
    out = keys.clone()
    out[..., :half] = (x1 * c - x2 * s).to(keys.dtype)
    out[..., half:rotary_dim] = (x2 * c + x1 * s).to(keys.dtype)
    return out


@triton.jit
def _rerotate_kernel(
    keys,
    out,
    cos,
    sin,
    n_tokens,
    ROW: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_DIM: tl.constexpr,
):
    """Program (i, h): tokens [i*BLOCK_T, ...) of head h; dimensions past 2*HALF are copied."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    at = t * ROW + tl.program_id(1) * HEAD_DIM
    i = tl.arange(0, BLOCK_HALF)[None, :]
    pair = (t < n_tokens) & (i < HALF)
    x1 = tl.load(keys + at + i, mask=pair).to(tl.float32)
    x2 = tl.load(keys + at + HALF + i, mask=pair).to(tl.float32)
    c = tl.load(cos + t * HALF + i, mask=pair)
    s = tl.load(sin + t * HALF + i, mask=pair)
    tl.store(out + at + i, (x1 * c - x2 * s).to(out.dtype.element_ty), mask=pair)
    tl.store(out + at + HALF + i, (x2 * c + x1 * s).to(out.dtype.element_ty), mask=pair)
    j = tl.arange(0, BLOCK_DIM)[None, :]
    tail = (t < n_tokens) & (j >= 2 * HALF) & (j < HEAD_DIM)
    tl.store(out + at + j, tl.load(keys + at + j, mask=tail), mask=tail)


def rerotate(
    keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    """`rerotate_reference` as one kernel: every head of every token in one pass."""
    _check(keys, cos, sin, rotary_dim)
    tokens, heads, head_dim = keys.shape
    out = torch.empty_like(keys)
    block = TOKENS_PER_PROGRAM[keys.device.type]
    launch(
        _rerotate_kernel,
        (triton.cdiv(tokens, block), heads),
        keys.device,
        keys,
        out,
        cos.contiguous(),
        sin.contiguous(),
        tokens,
        ROW=heads * head_dim,
        HEAD_DIM=head_dim,
        HALF=rotary_dim // 2,
        BLOCK_T=block,
        BLOCK_HALF=pow2(rotary_dim // 2),
        BLOCK_DIM=pow2(head_dim),
    )
    return out
