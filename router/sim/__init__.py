"""Replicas without a GPU: the cost model, the discrete-event simulator and the emulator.

`kv_tree` and `model` (one replica's radix cache, tiers and batch timing, from the
hardware x model timings of `router.presets`), `simulator` (`mori sim`: policies on a
virtual clock over a trace), `emulator` and `anthropic` (`mori emulate`: an HTTP replica
that speaks SGLang's API with the model's timing), `cli`.

May import: `router.policy` (the same policy code the router runs), `router.presets` (the
hardware x model timings the router's settings share), `router.replay` (traces, corpora,
reports), and from the shell only what an engine speaks
(`router.protocol.accounting`'s request flags, `router.wire.errors`), and `kernels.costs`
(torch-free: what restoring KV costs). Never `owner` or `plane`: the simulator drives the
policy directly.
"""
