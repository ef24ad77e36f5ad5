"""TEST SCAFFOLDING: post-import patches that let SGLang 0.5.17's HiCache run on a CPU-only box.

- HiCache pins its host pool with cudaHostRegister: a no-op without CUDA.
- The `direct` IO backend imports `transfer_kv_direct` from sgl_kernel only on CUDA/HIP: inject a
  torch version (per layer `dst[dst_idx] = src[src_idx]`).
- PyPI's torchvision is a CUDA build; declare the two ops its Python side registers fakes for,
  so `import torchvision` works with CPU torch (nms itself is never called here).
Loaded because shim/ is first on the server's PYTHONPATH; the production plugin needs none of it.
"""

import contextlib
import importlib.abc
import importlib.machinery
import sys


def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size=1):
    src_i, dst_i = src_indices.cpu(), dst_indices.cpu()
    for s, d in zip(src_layers, dst_layers, strict=True):
        d[dst_i] = s[src_i].to(d.device)


def _noop(*_a, **_k):
    return None


def _patch_host_common(mod):
    import torch

    if not torch.cuda.is_available():
        mod._cuda_host_register = _noop
        mod._cuda_host_unregister = _noop


def _patch_direct(mod):
    if not hasattr(mod, "transfer_kv_direct"):
        mod.transfer_kv_direct = transfer_kv_direct


def _define_torchvision_ops(_name):
    import torch

    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already defined
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )


_AFTER = {
    "sglang.srt.mem_cache.pool_host.common": _patch_host_common,
    "sglang.srt.mem_cache.pool_host.mha": _patch_direct,
    "sglang.srt.mem_cache.memory_pool_host": _patch_direct,
}
_BEFORE = {"torchvision": _define_torchvision_ops}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _AFTER and name not in _BEFORE:
            return None
        if name in _BEFORE:
            _BEFORE.pop(name)(name)
            if name not in _AFTER:
                return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, after = spec.loader, _AFTER.pop(name)

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return loader.create_module(s)

            def exec_module(self, module):
                loader.exec_module(module)
                after(module)

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _Finder())
