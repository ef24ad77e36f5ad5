"""TEST SCAFFOLDING for the real-SGLang tests (tests/test_sglang_engine.py).

Nothing here is part of the MORI engine patch: the production plugin (engine_patches/) never
imports it. It exists only so that SGLang 0.5.17 runs on a CPU-only CI machine:
- shim/: put on PYTHONPATH of the server process only (a CPU stand-in for sgl_kernel, no-op host
  memory pinning, a torch transfer_kv_direct; see shim/sitecustomize.py);
- tiny_model.py: a random-weight 2-layer Qwen2 and a byte-level BPE tokenizer, built at test time;
- server.py: start / stop a patched SGLang server with its log in a file.
"""
