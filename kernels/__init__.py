"""The KV data-path kernels: moving and rebuilding a program's KV blocks (docs/kernels.md).

What lives here, one module per concept:

- `planes`: a KV pool seen as 2 x layers row planes behind a pointer table, the way SGLang's
  HiCache transfer kernels see the device pool and its host pool (layer-first, page-first);
- `transfer`: gather the pages of a set of programs from the device pool into the host pool
  and scatter them back, batched over every program one hint moves;
- `diff`: a sibling cache as a block-sparse diff against a master copy (TokenDance);
- `rope`: re-rotation of cached keys from one position range to another (neox style);
- `restore`: a mirror rebuilt from master + diff + RoPE shift straight into the paged pool in
  one kernel, beside the dense multi-pass restore it replaces;
- `costs`: the restore and transfer costs the simulator may price, with their sources
  (pure Python: importable without torch);
- `launch`: how a kernel runs: compiled on CUDA tensors, Triton's interpreter on CPU ones.

Every kernel has a torch reference next to it; the tests hold the two together.

Imports: torch, triton, numpy (the `kernels` extra), and nothing from `router/`. This is the
lowest layer of the engine side: `engine_patches/` and `bench/` may import it. This file
imports nothing, so `kernels.costs` stays importable where torch is not installed.
"""
