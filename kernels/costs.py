"""What moving and rebuilding KV costs, for the simulator and the policy: pure Python, no torch.

Every figure carries its source. Nothing here is measured yet: no GPU has run
`bench/kernels.py` for this project (docs/kernels.md says how a run replaces these).

Restore (TokenDance's mirror restore, `kernels.restore`). The paper's figures are per mirror:
0.43 ms fused, 0.59 ms dense (section 6.5, Fig. 13: GenerativeAgents, Qwen2.5-7B on an
A100-80GB, 10 agents at 1 QPS). Its mirrors hold 500-700 blocks of 32 tokens (section 6.4)
of 57,344 B/token (Qwen2.5-7B: 2 x 28 layers x 4 KV heads x 128 x 2 B), about 1.1 GB;
writing that alone takes 0.54 ms at the A100's 2.04 TB/s, so the paper's "per mirror" cannot
be a whole cache, and its figures do not divide into a per-token cost. Use them for the
ratio (fused / dense = 0.73 there; 1.3-2.6x across its runs). The per-token cost is a
memory-traffic model instead: restore is a copy, bounded by HBM bandwidth, and a pass count
says how many times each byte crosses it (`RestorePasses`).

Transfer vs recompute (Tokencake section 7.4, Fig. 13): about 60 ms to move 4,096 blocks
(offload + upload) against about 9,000 ms to recompute them. `bench/kernels.py` prints
these beside its own measurement or model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Figure:
    """One published or measured number, with its unit of work and where it comes from."""

    seconds: float
    per: str
    source: str


TOKENDANCE = "TokenDance section 6.5 Fig. 13 (Qwen2.5-7B, A100-80GB, 10 agents, 1 QPS)"
RESTORE_FUSED_PER_MIRROR = Figure(0.43e-3, "mirror", f"paper: {TOKENDANCE}")
RESTORE_DENSE_PER_MIRROR = Figure(0.59e-3, "mirror", f"paper: {TOKENDANCE}")

TOKENCAKE = "Tokencake section 7.4 Fig. 13 (Qwen2.5, A100/H200; block size not stated)"
TRANSFER_4096_BLOCKS = Figure(0.060, "4,096 blocks, offload + upload", f"paper: {TOKENCAKE}")
RECOMPUTE_4096_BLOCKS = Figure(9.0, "4,096 blocks", f"paper: {TOKENCAKE}")

# TokenDance section 6.4: 53.2 of 500-700 32-token blocks differ per mirror (Qwen2.5-7B),
# "roughly 9% the size of a full cache".
MIRROR_DIFF_SHARE = 0.09


@dataclass(frozen=True, slots=True)
class RestorePasses:
    """How many times a restore moves each byte of the mirror through HBM.

    Fused (`kernels.restore.restore`): read the master, read the diff's share, write the
    pool: 2 + d. Dense (`restore_dense`, TokenDance's baseline): copy the master into a
    mirror (read + write), write the diff's blocks over it (read + write d), re-rotate K
    (read + write half), scatter K and V into the pool (read + write): 5 + 2d, leaving out
    the fp32 temporaries a torch re-rotation adds.
    """

    diff_share: float = MIRROR_DIFF_SHARE

    @property
    def fused(self) -> float:
        return 2 + self.diff_share

    @property
    def dense(self) -> float:
        return 5 + 2 * self.diff_share


@dataclass(frozen=True, slots=True)
class RestoreCost:
    """Seconds to restore one token of a mirror into the paged pool, fused and dense."""

    fused_s_per_token: float
    dense_s_per_token: float
    source: str

    def mirror_s(self, tokens: int, fused: bool = True) -> float:
        """A whole mirror of `tokens` tokens."""
        return tokens * (self.fused_s_per_token if fused else self.dense_s_per_token)


def restore_cost(
    kv_bytes_per_token: float, hbm_bytes_s: float, passes: RestorePasses | None = None
) -> RestoreCost:
    """The traffic model: passes x a token's KV bytes over the achieved HBM bandwidth.

    `hbm_bytes_s` is what the copy achieves (router.presets' `Preset.bytes_s`: peak x
    bw_eff), not the data-sheet peak.
    """
    passes = passes or RestorePasses()
    per_pass = kv_bytes_per_token / hbm_bytes_s
    source = (
        f"model: {passes.fused:.2f} (fused) and {passes.dense:.2f} (dense) passes of "
        f"{kv_bytes_per_token:.0f} B/token at {hbm_bytes_s / 1e9:.0f} GB/s, diff share "
        f"{passes.diff_share:.2f}; not measured"
    )
    return RestoreCost(per_pass * passes.fused, per_pass * passes.dense, source)
