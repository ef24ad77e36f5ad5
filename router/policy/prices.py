"""What moving a program's KV costs on one replica, learned from the replica's own answers.

Whether freeing a program's GPU room pays depends on the engine: a 50k-token context
reloads from host DRAM in ~0.1 s on an H100 (PCIe 5) and recomputes in ~2 s, while the
CPU test engine prefills a tiny model faster than it decodes one token of a batch. One
policy must be right on both, so the prices are measured: every answered request reports
(prompt tokens, how many were cached on device and on host, time to first token inside the
engine, decode time), and each price follows a low quantile of its per-token samples.
A low quantile, not the mean: queueing inside the engine inflates a request's time to first
token, never deflates it, so the fast samples are the ones that show the price itself.
Configured values (from the replica preset) are the starting point.

A prefill's cost per token is not one number: each new token attends to every token
before it, so it grows with the context (prefix + half the new tokens). The prefill price
is learned per token *at no context* by dividing each sample by that growth,
1 + context / `attention_tokens` (the context at which attention costs as much as the
weights: a model constant, from the replica preset), and priced back the same way. One
flat price learnt from typical steps, which are mostly small programs, under-priced
recomputing a large context 2-3x (the real Claude Code sample on 30B-MoE replicas).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from numpy.typing import NDArray

MIN_SAMPLE_TOKENS = 256  # shorter prefills and loads are dominated by fixed overheads
PRICE_QUANTILE = 0.2
PRICE_STEP = 0.1  # multiplicative learning rate of the quantile trackers
# a token count, or a numpy array of them: the prices are element-wise arithmetic, and a
# victim pool prices a replica's programs in tool calls at once
Tokens = TypeVar("Tokens", float, NDArray[np.float64])


@dataclass(slots=True)
class QuantileTracker:
    """Stochastic approximation of a quantile: each sample nudges the estimate up or down
    multiplicatively, so it settles where a share `q` of samples falls below it."""

    value: float
    q: float = PRICE_QUANTILE
    step: float = PRICE_STEP
    samples: int = 0

    def observe(self, x: float) -> None:
        if not (x > 0 and math.isfinite(x)):
            return
        self.samples += 1
        below = 1.0 if x < self.value else 0.0
        self.value *= math.exp(self.step * (self.q - below))


@dataclass(slots=True)
class ReplicaPrices:
    """Per-token seconds to recompute (prefill) and to reload (host -> device) KV, and
    the seconds of one decode iteration, on one replica."""

    prefill: QuantileTracker  # per token at no context
    load: QuantileTracker
    decode: QuantileTracker
    attention_tokens: float = 30_000.0
    # the router <-> replica round trip a step spends outside the engine (its median;
    # None before the first sample): `observe_round_trip`
    round_trip: QuantileTracker | None = None

    @classmethod
    def starting(
        cls, prefill_s_per_token: float, load_s_per_token: float, attention_tokens: float
    ) -> ReplicaPrices:
        return cls(
            QuantileTracker(prefill_s_per_token),
            QuantileTracker(load_s_per_token),
            QuantileTracker(0.02, q=0.5),
            attention_tokens,
        )

    def growth(self, new: Tokens, prefix: float) -> Tokens:
        """How much more a token of this prefill costs than one at no context."""
        return 1.0 + (prefix + new / 2) / self.attention_tokens

    def prefill_s(self, new: Tokens, prefix: float = 0) -> Tokens:
        """Seconds to prefill `new` tokens on top of `prefix` cached ones."""
        return new * self.prefill.value * self.growth(new, prefix)

    def recompute_s(self, tokens: Tokens) -> Tokens:
        """Seconds to prefill a whole context of `tokens` again."""
        return self.prefill_s(tokens)

    def reload_s(self, tokens: Tokens) -> Tokens:
        return tokens * self.load.value

    def observe(
        self,
        prompt_tokens: int,
        cached_device: int,
        cached_host: int,
        ttft_s: float,
        output_tokens: int = 0,
        decode_s: float = 0.0,
    ) -> None:
        """One answered request, timed inside the engine (from forwarding, not arrival at
        the router: gate time is the router's, not the engine's)."""
        cached = cached_device + cached_host
        uncached = max(0, prompt_tokens - cached)
        if uncached >= MIN_SAMPLE_TOKENS and cached_host * 4 <= uncached:
            self.prefill.observe(ttft_s / (uncached * self.growth(uncached, cached)))
        if cached_host >= MIN_SAMPLE_TOKENS and uncached * 4 <= cached_host:
            compute = self.prefill_s(uncached, cached)
            self.load.observe(max(0.0, ttft_s - compute) / cached_host)
        if output_tokens > 8 and decode_s > 0:
            self.decode.observe(decode_s / (output_tokens - 1))

    def observe_round_trip(self, seconds: float) -> None:
        """One step's time between the gate letting it in and its answer reaching the
        router, less the engine's part of it. A median, not a low quantile: the hop's
        delays (event loops, the owner-worker link) are part of what every step pays."""
        if self.round_trip is None:
            if seconds > 0 and math.isfinite(seconds):
                self.round_trip = QuantileTracker(seconds, q=0.5)
            return
        self.round_trip.observe(seconds)

    @property
    def round_trip_s(self) -> float:
        """The round trip's median so far; 0 before any was seen (the simulator without a
        modelled hop never sees one: the router sits in the engine)."""
        return 0.0 if self.round_trip is None else self.round_trip.value

    def view(self) -> dict[str, float | int]:
        """For the admin API and reports (the round trip once one was measured)."""
        view: dict[str, float | int] = {
            "prefill_tokens_per_s": round(1.0 / self.prefill.value, 1),
            "load_tokens_per_s": round(1.0 / self.load.value, 1),
            "decode_step_s": round(self.decode.value, 5),
            "samples": self.prefill.samples + self.load.samples,
        }
        if self.round_trip is not None:
            view["round_trip_s"] = round(self.round_trip_s, 5)
        return view
