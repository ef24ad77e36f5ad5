"""TEST SCAFFOLDING for the real-SGLang tests (tests/test_sglang_*.py).

Nothing here is part of the MORI engine patch: the production plugin (engine_patches/) never
imports it. It exists only so that SGLang (0.5.17, 0.5.23) runs on a CPU-only CI machine:
- shim/: a CPU stand-in for sgl_kernel, no-op host memory pinning, a torch transfer_kv_direct,
  a torchvision op declaration (shim/sitecustomize.py); scripts/install_sglang_cpu.sh copies it
  into the test venv and puts it on the venv's path;
- tiny_model.py: a random-weight 2-layer Qwen2 and a byte-level BPE tokenizer, built at test time;
- server.py: start / stop a patched SGLang server with its log in a file.
"""
