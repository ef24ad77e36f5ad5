"""The calibration's probe schedule and how a probe is timed on a live replica.

A probe is a few requests whose timing isolates one part of the cost model:

- `prefill`: one prompt on an idle engine, nothing cached (prefill against new tokens);
- `device-hit`: a prompt that extends one computed just before (prefill on a cached
  prefix: what the extend kernel does with the prefix's attention);
- `host-hit`: the same after an `idle` hint moved the prefix to the host tier (the
  host->device load and how it overlaps the compute);
- `decode`: B prompts sent together, each decoding `decode_tokens` tokens (the iteration
  time against batch size and context).

Every probe's timed calls are sent while a blocker prompt prefills: they wait for it in the
engine's queue, whatever their bodies take to arrive, and enter one prefill batch when it
ends. A probe is timed from the blocker's first token, so the latency of the HTTP path
(parsing, tokenizing, streaming back) cancels out and what is measured is engine time: a
call's first token after the blocker's, a decode probe's window in which its whole batch
decodes (the last first token to the first last token). Chunks are timed on arrival; an
emulator (`mori emulate`, whose wall clock is scaled and whose one event loop also parses
the probe's bodies) is asked for its engine clock's times instead (ENGINE_TIMES_FLAG).

Prompts are token ids (`/v1/completions`, so SGLang and `mori emulate` see the same
tokens); a program's prompts are prefixes of one random sequence, so a longer one extends a
shorter one exactly. Every request is streamed: the first chunk gives the time to first
token, the finishing chunk the end, and the usage the engine's own device / host / computed
split. The schedule is fixed by the span (the longest prompt), the engine's device pool and
the repetitions, so two calibrations of one engine time the same requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from router.protocol.accounting import CACHE_DETAILS_FLAG, ENGINE_TIMES_FLAG, Usage, openai_usage

KINDS = ("prefill", "device-hit", "host-hit", "decode")
TOKEN_IDS = (16, 500)  # ids of prompt tokens (fits the 512-token vocabulary of the test model)
# decode probes: (batch, prompt as a share of the span), each prompt cut to what fits 80 %
# of the pool: iteration time against batch size (1, 8, 32) and context (small, large),
# and a few long sequences (2 and 4 at half and a quarter of the span), where an agent's
# steps decode: with one such probe of five, the fit's KV price was the short sequences'
# (bench/results/2026-11-28-model-vs-engine.md)
DECODES = ((1, 1 / 16), (1, 1.0), (2, 1 / 2), (4, 1 / 4), (8, 1 / 16), (8, 1 / 2), (32, 1 / 64))
# wall seconds between a blocker and the calls it holds: this share of the blocker's own
# time to first token at warm-up, within bounds (long enough for the blocker to reach the
# engine's forward first, short enough that the calls arrive while it runs)
LEAD_SHARE, LEAD_S = 0.25, (0.01, 0.5)
SETTLE_S = 0.1  # pause between probes: the engine finishes its bookkeeping (write-through)
SPAN_CAP = 32768  # longest probe prompt on a large pool: attention already shows at 32k
SPAN_SHARE = 0.75  # ... and at most this share of the device pool


@dataclass(frozen=True, slots=True)
class Call:
    """One request: the first `tokens` ids of `program`'s sequence, `output` tokens out."""

    program: str
    tokens: int
    output: int = 1


@dataclass(frozen=True, slots=True)
class Probe:
    """Timed calls sent together behind a `blocker`, after untimed `setup` calls run one
    by one (and, when `idle`, an idle hint for the setup's programs, which moves their KV
    to the host). Its timings are the blocker's, then the calls'."""

    kind: str
    blocker: Call
    calls: tuple[Call, ...]
    setup: tuple[Call, ...] = ()
    idle: bool = False

    @property
    def sent(self) -> tuple[Call, ...]:
        """Every call sent after the setup, in order: the blocker, then the timed calls."""
        return (self.blocker, *self.calls)

    @property
    def label(self) -> str:
        """What a table row says about it: prompt (prefix + new), batch, output."""
        call, prefix = self.calls[0], self.setup[0].tokens if self.setup else 0
        text = f"{prefix}+{call.tokens - prefix}" if prefix else str(call.tokens)
        if self.kind == "decode":
            text = f"{len(self.calls)} x {text}, {call.output} out"
        return text


@dataclass(frozen=True, slots=True)
class Timing:
    """What one timed call measured: seconds from its probe's start, and the engine's
    account of its prompt (device / host hits, the rest computed)."""

    sent: float
    first: float
    done: float
    prompt_tokens: int
    output_tokens: int
    cached_device: int
    cached_host: int

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def decode_s(self) -> float:
        """From the first token to the last: output - 1 decode iterations (0 for one)."""
        return self.done - self.first if self.output_tokens > 1 else 0.0


def span_for(pool: int) -> int:
    """The longest probe prompt for a `pool`-token device."""
    return min(SPAN_CAP, int(SPAN_SHARE * pool))


def schedule(
    span: int, pool: int, reps: int = 2, decode_tokens: int = 32, host: bool = True
) -> list[Probe]:
    """The fixed schedule: prompts up to `span` tokens, decode batches whose whole context
    fits 80 % of a `pool`-token device, `reps` of everything, host hits only with a host
    tier. Program names are unique per probe, so no probe hits another's cache."""
    probes: list[Probe] = []
    names = iter(range(1_000_000))

    def name() -> str:
        return f"cal-{next(names)}"

    def blocker() -> Call:  # a decode probe's is the whole span: B bodies must arrive
        return Call(name(), max(1, span // 2))

    fractions = (1 / 16, 1 / 8, 1 / 4, 1 / 2, 3 / 4, 1)
    for _ in range(reps):
        for f in fractions:
            probes.append(Probe("prefill", blocker(), (Call(name(), max(1, int(span * f))),)))
        for kind in ("device-hit", "host-hit") if host else ("device-hit",):
            for prefix in (span // 4, span // 2, 3 * span // 4):
                for new in (max(1, span // 64), span // 4):
                    pid = name()
                    call, setup = Call(pid, prefix + new), Call(pid, prefix)
                    probes.append(Probe(kind, blocker(), (call,), (setup,), kind == "host-hit"))
        for batch, share in DECODES:
            context = min(int(span * share), int(0.8 * pool / batch) - decode_tokens)
            if context >= 16:
                calls = tuple(Call(name(), context, decode_tokens) for _ in range(batch))
                probes.append(Probe("decode", Call(name(), span), calls))
    return probes


def prompt_ids(program: str, tokens: int) -> list[int]:
    """The first `tokens` ids of the program's sequence (deterministic per name)."""
    rng = random.Random(program)
    return [rng.randrange(*TOKEN_IDS) for _ in range(tokens)]


class Endpoint:
    """An SGLang-compatible replica (SGLang with the MORI patch, or `mori emulate`)."""

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.http = httpx.AsyncClient(timeout=timeout_s)
        self.model = ""
        self.engine_clock = False  # an emulator: times come from its engine clock
        self.lead_s = LEAD_S[0]  # see LEAD_SHARE (set at warm-up)
        self._epoch = int(time.time() * 1000)

    async def close(self) -> None:
        await self.http.aclose()

    async def get(self, path: str) -> dict:
        r = await self.http.get(self.url + path)
        r.raise_for_status()
        return r.json()

    async def describe(self) -> dict:
        """`/get_server_info`, the served model's id, and (with the MORI patch or the
        emulator) the pools of `/mori/residency`; sets the model requests name."""
        info = await self.get("/get_server_info")
        self.engine_clock = bool(info.get("emulated"))
        models = await self.get("/v1/models")
        self.model = models["data"][0]["id"]
        pools: dict = {}
        try:
            res = await self.get("/mori/residency")
            pools = {k: res[k] for k in ("device_capacity_tokens", "host_capacity_tokens")}
        except (httpx.HTTPError, KeyError):
            pass
        return {"server_info": info, "model": self.model, **pools}

    def body(self, call: Call) -> dict:
        """The request of a call (built ahead of its probe's clock: a long prompt takes a
        while to draw, and the blocker's first token must not wait for that)."""
        return {
            "model": self.model,
            "prompt": prompt_ids(call.program, call.tokens),
            "max_tokens": call.output,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            "session_id": call.program,
            CACHE_DETAILS_FLAG: True,
        } | ({ENGINE_TIMES_FLAG: True} if self.engine_clock else {})

    async def call(self, call: Call, t0: float, body: dict | None = None) -> Timing:
        """Stream one request; times in seconds since `t0` (perf_counter), or on the
        emulator's engine clock."""
        body = body or self.body(call)
        usage, first, done, engine = Usage(), None, None, {}
        sent = time.perf_counter() - t0
        async with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{call}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                doc = json.loads(line[5:])
                choices = doc.get("choices") or []
                if choices:
                    first = now if first is None else first
                    if choices[0].get("finish_reason") is not None:
                        done = now
                openai_usage(doc, usage)
                engine = (doc.get("sglext") or {}).get("engine_times") or engine
        hits = usage.hits()
        if first is None or hits is None:
            raise RuntimeError(f"{call}: the stream had no tokens or no usage")
        if engine:
            sent, first, done = engine["arrived"], engine["first"], engine["done"]
        return Timing(
            sent,
            first,
            done if done is not None else first,
            hits.device + hits.host + hits.miss,
            usage.completion_tokens or call.output,
            hits.device,
            hits.host,
        )

    async def hint(self, programs: list[str], kind: str, full: bool = False) -> None:
        """Type the programs (`idle`: the engine drops their device copies, backed up on
        host); a full sync types every other program inactive, first to be evicted."""
        self._epoch += 1
        body = {"epoch": self._epoch, "hints": dict.fromkeys(programs, kind), "full": full}
        r = await self.http.post(self.url + "/mori/hints", json=body)
        r.raise_for_status()

    async def run(self, probe: Probe, hints: bool) -> list[Timing]:
        """The probe's setup one call after another, its hint, then its blocker and, once
        that is in the engine, its timed calls together: the blocker's timing first. With
        `hints`, every earlier probe's programs are typed inactive first, so the engine
        evicts them before this probe's (as the fit's fresh engine per probe has it)."""
        if hints:
            await self.hint([], "inactive", full=True)
        for call in probe.setup:
            await self.call(call, time.perf_counter())
        if probe.idle:
            await asyncio.sleep(SETTLE_S)  # the setup's write-through lands first
            await self.hint(sorted({c.program for c in probe.setup}), "idle")
        bodies = [self.body(c) for c in probe.sent]
        t0 = time.perf_counter()
        blocker = asyncio.create_task(self.call(probe.blocker, t0, bodies[0]))
        await asyncio.sleep(self.lead_s)  # its request reaches the engine's forward first
        calls = await asyncio.gather(
            *(self.call(c, t0, b) for c, b in zip(probe.calls, bodies[1:], strict=True))
        )
        times = [await blocker, *calls]
        at = times[0].sent  # the probe's clock starts when its blocker was sent
        return [
            dataclasses.replace(t, sent=t.sent - at, first=t.first - at, done=t.done - at)
            for t in times
        ]


async def measure(
    endpoint: Endpoint,
    probes: list[Probe],
    on_probe: Callable[[int, Probe, list[Timing]], None] | None = None,
    hints: bool = True,
) -> list[list[Timing]]:
    """Run the warm-up, then every probe in order (`hints`: the endpoint takes MORI hints);
    `on_probe(i, probe, timings)` after each."""
    warm = Call("cal-warmup", 64, 8)
    for _ in range(2):  # first forwards pay one-off costs (allocator, kernels)
        await endpoint.call(warm, time.perf_counter())
    blocker = probes[0].blocker
    waits = [
        (await endpoint.call(Call(f"cal-lead-{i}", blocker.tokens), time.perf_counter())).ttft
        for i in range(2)
    ]
    endpoint.lead_s = min(max(LEAD_SHARE * min(waits), LEAD_S[0]), LEAD_S[1])
    out = []
    for i, probe in enumerate(probes):
        await asyncio.sleep(SETTLE_S)
        out.append(await endpoint.run(probe, hints))
        if on_probe is not None:
            on_probe(i, probe, out[-1])
    return out
