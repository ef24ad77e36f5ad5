"""TEST SCAFFOLDING: a CPU stand-in for `sgl_kernel` (the real CPU build is not on PyPI and needs
AVX-512/AMX). It registers no torch ops, so SGLang keeps its native-torch CPU paths; it only
satisfies the unconditional `from sgl_kernel import ..._cpu` imports of SGLang's CPU engine."""

import torch

__version__ = "0.0.0+mori-test-shim"


def assign_req_to_token_pool_cpu(
    req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len
):
    """Same semantics as SGLang's Triton kernel `assign_req_to_token_pool`."""
    pos = 0
    for i in range(req_pool_indices.numel()):
        s, e = int(start_offset[i]), int(end_offset[i])
        n = e - s
        row = int(req_pool_indices[i])
        req_to_token[row, s:e] = out_cache_loc[pos : pos + n].to(req_to_token.dtype)
        pos += n


def _unsupported(name):
    def f(*a, **k):
        raise NotImplementedError(f"sgl_kernel test shim: {name} (speculative/kv-copy only)")

    return f


for _n in [
    "copy_all_layer_kv_cache_cpu",
    "assign_extend_cache_locs_cpu",
    "assign_draft_cache_locs_contiguous_cpu",
    "build_tree_kernel_efficient_cpu",
    "verify_tree_greedy_cpu",
    "rotate_input_ids_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "build_draft_decode_metadata_cpu",
]:
    globals()[_n] = _unsupported(_n)

_ = torch
