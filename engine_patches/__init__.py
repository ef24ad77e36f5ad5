"""The engine side: MORI's SGLang plugin and its launcher (`mori-sglang`).

`plugin` (SGLang's plugin entry point; picks the module of the running line:
`sglang_0_5_23`, `sglang_0_5_17`, both on `sglang_common`), `hint_book` and `control`
(the `/mori/hints` and `/mori/residency` endpoints), `ranking` and `tree_plan` (typed
eviction in the HiCache radix tree), `kv_actions` and `residency` (offload, load-back and
what each program holds), `anchor_scores` (CacheSage's anchor scores), `launch`.

May import: SGLang (inside the engine's process only), `router.policy` (the hint types and
labels the router sends) and `kernels`. Never the router's shell: the engine does not run it.
"""
