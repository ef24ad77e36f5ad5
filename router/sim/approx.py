"""TokenDance's approximate reuse, as a model (off by default; every figure it gives is modelled).

Exact sharing (what SGLang does, and the segment index models) needs the same prefix. An
All-Gather round's gathered answers sit at a different offset in every agent's prompt, so
their exact KV differs at every layer. TokenDance reuses them approximately (CacheBlend's
selective recompute behind a collective step, §4.2) and stores the near-identical results
as one dense Master plus block-sparse diffs (§4.3). Nothing like it exists in SGLang; this
module only prices it, so the benchmark can show what it would buy:

- a *gathered block* of a request (a named block after the part of the prompt the program
  reuses from its own context) is reusable when some other live program's context on the
  same replica holds the same content (its author's answer, or an agent that computed it);
- such tokens are stored at `diff_share` of their size (the engine is handed a prompt that
  much shorter, and the program's later prompts follow), and prefilled at `recompute_share`
  (the share above `diff_share` is compute the engine is charged without storing it);
- and restored from their Master: the fused diff restore's cost per token, from the
  kernels' cost model (`kernels.costs.restore_cost`: passes of the KV bytes over the
  replica's HBM bandwidth; TokenDance's 0.43 ms "per Mirror" does not divide into a
  per-token cost, see that module), times `restore_scale`.

What the model leaves out (so it flatters approximate reuse): a running Mirror is restored
dense (its decode reads and its memory while it runs are those of its full context; here
they stay compressed), a Master evicted under its Mirrors is not charged, nor is any loss of
accuracy. The constants below are the defaults; `bench/allgather.py` sweeps each +-2x.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kernels.costs import MIRROR_DIFF_SHARE
from router.policy.types import Segment

# TokenDance §6.4 (via kernels.costs): 53.2 of 500-700 32-token blocks differ per Mirror,
# "roughly 9% the size of a full cache" (Fig. 12: 11.2x compression for Qwen2.5-7B, 17.5x
# for 14B; the conservative one).
DIFF_SHARE = MIRROR_DIFF_SHARE
# CacheBlend (TokenDance's PIC backend, §4.2) recomputes ~15% of a reused block's tokens.
RECOMPUTE_SHARE = 0.15
# kernels.costs' fused restore model as it is (no GPU has measured it yet, docs/kernels.md).
RESTORE_SCALE = 1.0


@dataclass(frozen=True)
class ApproxReuse:
    """The constants of approximate reuse (see the module docstring)."""

    diff_share: float = DIFF_SHARE
    recompute_share: float = RECOMPUTE_SHARE
    restore_scale: float = RESTORE_SCALE

    def __post_init__(self) -> None:
        if not 0 < self.diff_share <= 1 or not 0 < self.recompute_share <= 1:
            raise ValueError("diff_share and recompute_share must be in (0, 1]")
        if self.restore_scale < 0:
            raise ValueError("restore_scale must be >= 0")


@dataclass
class _Context:
    replica: str | None = None
    saved: int = 0  # tokens of its context stored as diffs (the engine holds fewer)
    exact: int = 1 << 62  # offsets up to here are the engine's too (before the first diff)
    contents: set[str] = field(default_factory=set)


class ApproxStore:
    """Which contents each replica holds in some live program's context, and how much of
    each program's context is stored compressed."""

    def __init__(self, reuse: ApproxReuse, restore_s_per_token: float) -> None:
        self.reuse = reuse
        self.restore_s_per_token = restore_s_per_token * reuse.restore_scale
        self._programs: dict[str, _Context] = {}
        self._holders: dict[tuple[str, str], set[str]] = {}  # (replica, content) -> programs
        self.mirrored_tokens = 0  # gathered tokens reused approximately (for reports)

    def forward(
        self,
        pid: str,
        replica: str,
        blocks: tuple[Segment, ...],
        input_tokens: int,
        reused_tokens: int,
    ) -> tuple[int, int, int, int]:
        """A request of `pid` goes to `replica`: (prompt, reused, recompute-only tokens,
        restored tokens) in the engine's compressed terms. Its blocks are then held there."""
        ctx = self._programs.setdefault(pid, _Context())
        if ctx.replica != replica:  # its context is recomputed there in full
            self._drop(pid, ctx)
            ctx.replica, ctx.saved, ctx.exact = replica, 0, 1 << 62
        reusable, pos = 0, 0
        for block in blocks:
            start, pos = pos, pos + block.tokens
            if start >= reused_tokens and self._held_by_other(replica, block.content, pid):
                reusable += block.tokens
                ctx.exact = min(ctx.exact, start)
        stored = round(reusable * self.reuse.diff_share)
        recompute = max(0, round(reusable * self.reuse.recompute_share) - stored)
        prompt = input_tokens - ctx.saved - (reusable - stored)
        reused = max(0, min(reused_tokens - ctx.saved, prompt))
        ctx.saved += reusable - stored
        self.mirrored_tokens += reusable
        for block in blocks:
            if block.content not in ctx.contents:
                ctx.contents.add(block.content)
                self._holders.setdefault((replica, block.content), set()).add(pid)
        return max(1, prompt), reused, recompute, reusable

    def arrive(self, pid: str, blocks: tuple[Segment, ...], reused_tokens: int) -> None:
        """A request of `pid` arrived: the blocks of its own context it reuses (its last
        answer among them) are held where that context is, from now on (so a round whose
        requests are released together finds every author's answer)."""
        ctx = self._programs.get(pid)
        if ctx is None or ctx.replica is None:
            return
        pos = 0
        for block in blocks:
            pos += block.tokens
            if pos > reused_tokens:
                return
            if block.content not in ctx.contents:
                ctx.contents.add(block.content)
                self._holders.setdefault((ctx.replica, block.content), set()).add(pid)

    def exact_until(self, pid: str) -> int:
        """Prompt offsets up to which the engine's tokens are the prompt's (named blocks
        ending later sit elsewhere in the compressed context: not matched by others)."""
        ctx = self._programs.get(pid)
        return ctx.exact if ctx is not None else 1 << 62

    def restore_s(self, restored: int) -> float:
        """The fused restore of `restored` tokens from their Master."""
        return restored * self.restore_s_per_token

    def forget(self, pid: str) -> None:
        ctx = self._programs.pop(pid, None)
        if ctx is not None:
            self._drop(pid, ctx)

    def _held_by_other(self, replica: str, content: str, pid: str) -> bool:
        holders = self._holders.get((replica, content))
        return bool(holders) and (len(holders) > 1 or pid not in holders)

    def _drop(self, pid: str, ctx: _Context) -> None:
        for content in ctx.contents:
            holders = self._holders.get((ctx.replica, content))  # type: ignore[arg-type]
            if holders is not None:
                holders.discard(pid)
                if not holders:
                    del self._holders[(ctx.replica, content)]  # type: ignore[arg-type]
        ctx.contents = set()
