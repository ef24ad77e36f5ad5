"""Closed-loop live replay of an agent trace against an OpenAI or Anthropic endpoint (MORI 6.1).

`concurrency` clients each replay one program over HTTP with the OpenAI SDK (chat
completions) or the Anthropic SDK (Messages, `api="anthropic"`; router/replay/apis.py): send a step,
wait for the whole (streamed) answer, sleep the step's `tool_s`, send the next step; then
take the next program of the corpus (shuffled once by the seed, cycled). A program's
subagents run as extra clients from their `start_s`. Prompts are synthesised by
`router.replay.prompts` so each step repeats the previous call as its prefix.

It measures what `mori sim` measures, as `StepRecord`s reduced by `summarize`: TTFT is
taken at the first content chunk on the client side (so router gating counts), cached
tokens come from the answer: each request asks for SGLang's device/host split
(`return_cached_tokens_details`) and reads it the way router.protocol.accounting does for the
router. Times are on the *trace* clock, wall seconds times `time_scale` (a replay at
--time-scale 10 against emulators started with --time-scale 10 reports the same numbers
as one run in real time), so results compare with `mori sim`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple
from urllib.parse import quote

import httpx
import openai

from router.protocol.identity import namespace
from router.replay.apis import API_NAMES, Answer, Call, Send, errors, sender
from router.replay.corpus import ClosedLoopCorpus
from router.replay.prompts import Conversation, TokenDrift
from router.replay.records import RunResult, StepRecord, summarize
from router.replay.retries import (
    ERROR_CODE_HEADER,
    START_DEFERRED,
    ClientRetries,
    retried,
    retry_after_s,
)
from router.replay.trace import TraceProgram, TraceStep

UTIL_SAMPLE_S = 1.0  # wall seconds between GPU-utilisation samples
RETRIES = ClientRetries()  # the SDKs' defaults (the SDK's own retries are off: max_retries=0)
# How requests name their program (`--identity`): `program-id` in the body (and the parent
# in X-Parent-Id), `none` not at all (the router fingerprints), or as a harness does: its
# session header, the root program's value shared by its subagents, nothing in the body.
SESSION_HEADERS = {
    "claude-code": "X-Claude-Code-Session-Id",
    "codex": "session-id",
    "opencode": "x-opencode-session",
}
IDENTITIES = ("program-id", "none", *SESSION_HEADERS)


@dataclass(frozen=True)
class ReplayConfig:
    """One live run. `duration_s` is wall time; everything reported is on the trace clock."""

    endpoint: str  # base URL of the API (with or without /v1)
    api: str = "openai"  # the wire API: "openai" (chat completions) or "anthropic" (Messages)
    concurrency: int = 8
    duration_s: float = 60.0
    time_scale: float = 1.0
    token_scale: float = 1.0
    seed: int = 0
    policy_label: str | None = None  # labels the result row; None: ask the endpoint
    cpu_ratio: float | None = None  # labels the result row; None: ask the endpoint
    model: str | None = None  # None: the endpoint's first model
    api_key: str = "none"
    start_jitter_s: float = 5.0  # trace seconds over which clients start
    request_timeout_s: float = 600.0
    programs: int | None = None  # stop early once this many main programs have finished
    identity: str = "program-id"  # how requests name their program (IDENTITIES)

    def __post_init__(self) -> None:
        if self.identity not in IDENTITIES:
            raise ValueError(f"identity must be one of {', '.join(IDENTITIES)}: {self.identity}")
        checks = {
            "concurrency": self.concurrency >= 1,
            "duration_s": self.duration_s > 0,
            "time_scale": self.time_scale > 0,
            "token_scale": self.token_scale > 0,
            "start_jitter_s": self.start_jitter_s >= 0,
            "programs": self.programs is None or self.programs >= 1,
            "api": self.api in API_NAMES,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")

    @property
    def base_url(self) -> str:
        """The server root (no /v1)."""
        url = self.endpoint.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


SLOTS_PER_LANE = 4  # slots whose programs share one HTTP client (see `Lane`)


class Lane(NamedTuple):
    """An HTTP client with its SDK client and `Send`. httpcore's pool scans its idle
    connections once per idle connection whenever a request starts or ends: one pool for
    24 slots spent 13 of a demo's 53 profiled seconds there, 2 with a pool per 4 slots (on
    a 2-core box a busy client delays the steps it times)."""

    http: httpx.AsyncClient
    api: openai.AsyncOpenAI
    send: Send


@dataclass
class _Instance:
    """One replay of a trace program: its request id, task and conversation."""

    pid: str
    program: TraceProgram
    parent: _Instance | None = None
    conversation: Conversation = field(init=False)
    routed: str | None = None  # the program id the router answered with (x-mori-program-id)
    lane: Lane = field(init=False)  # the HTTP client its requests go on (its root's)

    @property
    def session(self) -> str:
        """The task: the pid of the root program it runs under."""
        return self.parent.session if self.parent else self.pid

    def headers(self, identity: str) -> dict[str, str]:
        """The agent role and the app, for a router's agent runtime layer (CacheSage;
        engines ignore them), and the program's identity as `identity` has it sent: with
        `program-id` the program (`X-Program-Id` too: a proxy in front hashes it without
        reading the body, docs/deployment.md) and its parent (X-Parent-Id), as a harness
        its session header."""
        out = {"X-Program-Id": self.pid} if identity == "program-id" else {}
        if self.program.agent:
            out["X-Agent-Role"] = self.program.agent
        if identity == "program-id" and self.parent is not None:
            out["X-Parent-Id"] = self.parent.pid
        elif identity in SESSION_HEADERS:
            out[SESSION_HEADERS[identity]] = self.session
        if self.program.app:
            out["X-App-Id"] = self.program.app
        return out


@dataclass
class _Tries:
    """One step's attempts: when it first asked, how often it was retried or deferred."""

    first_arrival: float
    first: bool  # the program's first step (a start)
    retries: int = 0
    refusals: int = 0

    def fields(self) -> dict:
        """The StepRecord fields they fill."""
        return {
            "first": self.first,
            "first_arrival_s": self.first_arrival,
            "retries": self.retries,
            "refusals": self.refusals,
        }


@dataclass
class Progress:
    """Running totals a progress bar can show."""

    steps: int = 0
    failed: int = 0
    deferred: int = 0  # starts told to come back (they do: not failures)
    output_tokens: int = 0
    programs_done: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class Replay:
    """One live run; `await run()` returns (RunResult, records)."""

    def __init__(self, corpus: list[TraceProgram], config: ReplayConfig) -> None:
        self.config = config
        self.corpus = ClosedLoopCorpus(corpus, config.token_scale, config.seed)
        self.rng = self.corpus.rng
        self._retry_rng = random.Random(f"retries-{config.seed}")  # the corpus' stream stays
        self.run_tag = uuid.uuid4().hex[:6]  # program ids never collide with an earlier run
        self.records: list[StepRecord] = []
        self.progress = Progress()
        self._t0 = 0.0
        self._util: list[float] = []
        self._tasks: set[asyncio.Task] = set()
        self._live: dict[str, _Instance] = {}  # programs started and not ended
        # per replayed program: the program ids the router answered with, and its parent's
        # pid (how the router's view of programs is checked against the trace's)
        self.routed: dict[str, set[str]] = {}
        self.parents: dict[str, str | None] = {}
        self._handoffs: dict[tuple[str, str, int], asyncio.Event] = {}  # steps that ended
        self._apps: set[str] = set()  # app graphs registered with the router
        self.drift = TokenDrift()  # how the engine's token counts part from the prompts'
        self._crash: BaseException | None = None
        self.labels = (config.policy_label or "unknown", config.cpu_ratio or 0.0)
        self._claimed = 0  # main programs started
        self._wall = config.duration_s  # wall seconds the run lasted

    # clock ------------------------------------------------------------------------------
    def now(self) -> float:
        """Trace seconds since the start of the run."""
        return (time.monotonic() - self._t0) * self.config.time_scale

    async def _sleep_trace(self, seconds: float) -> None:
        if seconds > 0:
            await asyncio.sleep(seconds / self.config.time_scale)

    # run --------------------------------------------------------------------------------
    async def run(self, on_tick: Callable[[float], None] | None = None) -> RunResult:
        """Replay for `duration_s` wall seconds (or until `programs` programs are done, with
        nothing left in flight); `on_tick(fraction)` about once a second."""
        cfg = self.config
        async with contextlib.AsyncExitStack() as lanes:
            count = -(-cfg.concurrency // SLOTS_PER_LANE)
            self.lanes = [await lanes.enter_async_context(self._lane()) for _ in range(count)]
            self.http, self.api, _ = self.lanes[0]
            self.model = cfg.model or await self._first_model()
            self.labels = await self._labels()
            self._t0 = time.monotonic()
            for _ in range(cfg.concurrency):
                self._spawn(self._slot(self.rng.uniform(0, cfg.start_jitter_s)))
            sampler = asyncio.create_task(self._sample_util())
            try:
                while (elapsed := time.monotonic() - self._t0) < cfg.duration_s:
                    if self._crash is not None:
                        raise RuntimeError("a replay client crashed") from self._crash
                    if cfg.programs is not None and not self._tasks:
                        break
                    if on_tick is not None:
                        on_tick(elapsed / cfg.duration_s)
                    await asyncio.sleep(min(0.2, cfg.duration_s - elapsed))
                self._wall = min(elapsed, cfg.duration_s)
            finally:
                sampler.cancel()
                await self._cancel_all()
        if on_tick is not None:
            on_tick(1.0)
        return self.result()

    def result(self) -> RunResult:
        cfg = self.config
        trace_duration = self._wall * cfg.time_scale
        util = sum(self._util) / len(self._util) if self._util else 0.0
        extra = {
            "endpoint": cfg.endpoint,
            "mode": "live",
            "token_scale": cfg.token_scale,
            "time_scale": cfg.time_scale,
            "duration_s": trace_duration,
            "wall_s": self._wall,
            "seed": cfg.seed,
        }
        return summarize(
            self.records,
            trace_duration,
            policy=self.labels[0],
            concurrency=cfg.concurrency,
            cpu_ratio=self.labels[1],
            gpu_util=util,
            extra=extra,
        )

    @contextlib.asynccontextmanager
    async def _lane(self) -> AsyncIterator[Lane]:
        """One HTTP client and the SDK client on it, for a few slots' programs."""
        cfg = self.config
        timeout = httpx.Timeout(cfg.request_timeout_s, connect=10.0)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with (
            httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http,
            openai.AsyncOpenAI(
                base_url=cfg.base_url + "/v1", api_key=cfg.api_key, http_client=http, max_retries=0
            ) as api,
            sender(cfg.api, api, cfg.api_key, cfg.request_timeout_s, self.now) as send,
        ):
            yield Lane(http, api, send)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._reap)

    def _reap(self, task: asyncio.Task) -> None:
        """A client that crashed (a bug, not a failed request) stops the run loudly."""
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None and self._crash is None:
            self._crash = task.exception()

    async def _cancel_all(self) -> None:
        """Stop every client, then end the programs they left half-way."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ends = (self._tell(me, "end") for me in self._live.values())
        await asyncio.gather(*ends, return_exceptions=True)

    async def _first_model(self) -> str:
        try:
            models = await self.api.models.list()
        except openai.OpenAIError as e:
            raise ConnectionError(f"cannot list models at {self.config.endpoint}: {e}") from e
        if not models.data:
            raise ConnectionError(f"{self.config.endpoint}/v1/models lists no model")
        return models.data[0].id

    # clients ----------------------------------------------------------------------------
    async def _slot(self, delay: float) -> None:
        """One closed-loop client: programs back to back for the whole run (or until the
        run's `programs` have all been started)."""
        await self._sleep_trace(delay)
        while self.config.programs is None or self._claimed < self.config.programs:
            self._claimed += 1
            await self._program(self.corpus.next_main())

    async def _program(self, program: TraceProgram, parent: _Instance | None = None) -> None:
        pid = f"{self.run_tag}-{program.program_id}.{self.corpus.next_instance()}"
        me = _Instance(pid, program, parent)
        me.lane = parent.lane if parent is not None else self.lanes[self._claimed % len(self.lanes)]
        self.parents[pid] = parent.pid if parent is not None else None
        if program.graph and program.app not in self._apps:
            self._apps.add(program.app)  # type: ignore[arg-type]
            await self._register(program.app, program.graph)  # type: ignore[arg-type]
        for child in self.corpus.subagents(program):
            self._spawn(self._subagent(child, me))
        inherited = parent.conversation.messages if parent and program.inherit_tokens else ()
        blocks: list[tuple[str, int]] = []  # named blocks of the current prompt
        me.conversation = Conversation(
            pid,
            program.agent,
            program.anchor_tokens,
            self.config.seed,
            program.inherit_tokens,
            self.drift,
        )
        me.conversation.inherit(inherited)
        self._live[pid] = me
        for i, step in enumerate(program.steps):
            await self._hand_over(me, step)
            reused = step.reused_tokens if i else 0
            blocks = blocks[: step.segments_kept] + [
                (sid if sid.startswith("@") else f"{me.session}/{sid}", n)
                for sid, n in step.segments
            ]
            messages = me.conversation.next_messages(step.input_tokens, reused, blocks)
            me.conversation.record_answer(await self._step(me, step, messages))
            self._handoff_event(me.session, program.program_id, i).set()
            await self._run_tool(
                me, step, program.steps[i + 1] if i + 1 < len(program.steps) else None
            )
        if parent is None:
            self._handoffs = {k: v for k, v in self._handoffs.items() if k[0] != me.session}
        self._spawn(self._end(me))
        self.progress.programs_done += 1

    async def _run_tool(self, me: _Instance, step: TraceStep, after: TraceStep | None) -> None:
        """The tool call between `step` and the next one (`after`): the router is told it
        started while it runs, as an agent's harness tells it and runs the tool at once;
        told first and then run, every call also lasted the notice's round trip, which the
        simulator's tool times do not. The next request still waits for the notice's
        answer, so the router sees them in order. A hand-over (`after.after`) is waited
        for, not slept."""
        calls = []
        if after is not None and step.tool:
            headers = me.headers(self.config.identity)
            calls.append(self._tell(me, "tool_start", {"tool": step.tool}, headers))
        if not (after is not None and after.after):
            calls.append(self._sleep_trace(step.tool_s))
        await asyncio.gather(*calls)

    async def _end(self, me: _Instance) -> None:
        """Tell the router the program ended; it stays live until told, so a run that
        stops first (cancelling this) ends it in `_cancel_all`."""
        await self._tell(me, "end")
        self._live.pop(me.pid, None)

    async def _subagent(self, program: TraceProgram, parent: _Instance) -> None:
        if not program.steps[0].after:  # starts on a hand-over, not at a nominal time
            await self._sleep_trace(program.start_s)
        await self._program(program, parent)

    def _handoff_event(self, session: str, program_id: str, step: int) -> asyncio.Event:
        return self._handoffs.setdefault((session, program_id, step), asyncio.Event())

    async def _hand_over(self, me: _Instance, step: TraceStep) -> None:
        """Wait until the steps this one waits for (`after`) have ended in this task."""
        for program_id, index in step.after:
            await self._handoff_event(me.session, program_id, index).wait()

    @property
    def _auth(self) -> dict[str, str]:
        """The API key for the router's own endpoints (the SDK sends it for inference)."""
        return {"authorization": f"Bearer {self.config.api_key}"}

    async def _register(self, app: str, edges: tuple[tuple[str, str], ...]) -> None:
        """Register the app's agent graph with a graph-aware router (`POST /v1/apps`);
        other routers and engines refuse it, and the requests still carry the app."""
        body = {"app_id": app, "edges": [list(e) for e in edges]}
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(
                f"{self.config.base_url}/v1/apps", json=body, headers=self._auth, timeout=5.0
            )

    async def _tell(
        self, me: _Instance, action: str, body: dict | None = None, headers: dict | None = None
    ) -> None:
        """Tell a router what the agent does next: the tool call a step ends in (a real
        agent's answer names it in `tool_calls`; the replayed answer cannot, so the trace's
        tool is told the way an agent without tool calls would), or the program's end.
        Skipped for an engine itself; a failure is ignored (the router's lease covers it).
        With the API key: a router that checks keys refused these before. Without a
        `program_id` in the body the program is the one the router answered with, less the
        key's namespace (the router adds it to the ids a client names)."""
        pid = me.pid
        if self.config.identity != "program-id":
            pid = (me.routed or "").removeprefix(namespace(self.config.api_key))
        if self.labels[0] == "direct" or not pid:
            return
        url = f"{self.config.base_url}/v1/programs/{quote(pid, safe='')}/{action}"
        headers = {**(headers or {}), **self._auth}
        with contextlib.suppress(httpx.HTTPError):
            await me.lane.http.post(url, json=body or {}, headers=headers, timeout=5.0)

    async def _step(self, me: _Instance, step: TraceStep, messages: list[dict]) -> str:
        """Send one step as the SDKs would (`router.replay.retries`: a start told to come
        back comes back, any other error is retried twice), stream the answer, record it;
        returns the answer's text."""
        pid = me.pid
        tries = _Tries(self.now(), first=step is me.program.steps[0])
        call = Call(
            self.model,
            messages,
            max(1, step.output_tokens),
            pid if self.config.identity == "program-id" else None,
            {**me.headers(self.config.identity), **self._round(me, step)},
        )
        while True:
            arrival = self.now()
            answer = Answer()
            try:
                await me.lane.send(answer, call)
            except errors() as e:
                self._note_routed(me, answer)
                delay = None if answer.first is not None else self._again_in(e, tries)
                if delay is None:  # the SDKs give up (or the answer broke off mid-stream)
                    self._fail(pid, step, arrival, answer.replica, e, tries)
                    return "".join(answer.parts)
                await self._sleep_trace(delay)
                continue
            break
        self._note_routed(me, answer)
        finish = self.now()
        usage, hits = answer.usage, answer.usage.hits()
        self.records.append(
            StepRecord(
                program_id=pid,
                replica=answer.replica,
                arrival_s=arrival,
                first_token_s=answer.first if answer.first is not None else finish,
                finish_s=finish,
                input_tokens=_or(usage.prompt_tokens, step.input_tokens),
                output_tokens=_or(usage.completion_tokens, len(answer.parts)),
                cached_device=hits.device if hits else 0,
                cached_host=hits.host if hits else 0,
                session=me.session,
                agent=me.program.agent,
                last=step is me.program.steps[-1],
                round=f"{me.session}/{step.round}" if step.round else None,
                **tries.fields(),
            )
        )
        if usage.prompt_tokens:
            me.conversation.record_usage(usage.prompt_tokens)
        self.progress.steps += 1
        self.progress.output_tokens += self.records[-1].output_tokens
        return "".join(answer.parts)

    def _note_routed(self, me: _Instance, answer: Answer) -> None:
        """The program the router filed the step under (its `x-mori-program-id`)."""
        me.routed = answer.routed or me.routed
        if me.routed is not None:
            self.routed.setdefault(me.pid, set()).add(me.routed)

    def _again_in(self, error: Exception, tries: _Tries) -> float | None:
        """Trace seconds until the next attempt after `error`, or None: the step fails. A
        start the router's door deferred comes back when told, however often; anything
        else is retried as the SDKs retry (their Retry-After is in wall seconds)."""
        response = getattr(error, "response", None)
        headers = response.headers if response is not None else {}
        after = retry_after_s(headers)
        after = None if after is None else after * self.config.time_scale
        code = getattr(error, "code", None) or headers.get(ERROR_CODE_HEADER)
        if code == START_DEFERRED:
            tries.refusals += 1
            self.progress.deferred += 1
            return after if after is not None else 1.0
        if not retried(getattr(error, "status_code", None)):
            return None
        delay = RETRIES.delay_s(tries.retries, after, self._retry_rng)
        tries.retries += delay is not None
        return delay

    @staticmethod
    def _round(me: _Instance, step: TraceStep) -> dict[str, str]:
        """The step's All-Gather round, for a round-aware router (engines ignore it)."""
        return {"X-Round-Id": f"{me.session}/{step.round}"} if step.round else {}

    def _fail(
        self, pid: str, step: TraceStep, arrival: float, replica, error: Exception, tries: _Tries
    ) -> None:
        now = self.now()
        self.records.append(
            StepRecord(
                pid, replica, arrival, now, now, step.input_tokens, 0, ok=False, **tries.fields()
            )
        )
        kind = type(error).__name__
        status = getattr(error, "status_code", None)
        key = f"{kind} {status}" if status else kind
        self.progress.failed += 1
        self.progress.errors[key] = self.progress.errors.get(key, 0) + 1

    # GPU utilisation ----------------------------------------------------------------------
    async def _sample_util(self) -> None:
        """GPU KV utilisation as `mori sim` reports it: the time-average share of device KV
        held by running requests, read from each replica's /mori/residency (replicas found
        through the router's /v1/replicas, or the endpoint is itself a replica). Emulators
        report the exact integral (`device_active_token_seconds`); otherwise instantaneous
        samples are averaged. No source: 0."""
        urls = await self._replica_urls()
        first: dict | None = None
        while urls:
            sample = await self._util_sample(urls)
            if sample is not None:
                first = first or sample
                self._util = _utilisation(first, sample, self._util)
            await asyncio.sleep(UTIL_SAMPLE_S)

    async def _labels(self) -> tuple[str, float]:
        """The policy and CPU ratio the result row carries: as configured, else asked of
        the endpoint. A MORI router names its policy and its replicas' tier budgets
        (`/v1/replicas`); an engine itself (SGLang, `mori emulate`) is `direct`, its ratio
        from `/get_server_info`; anything else stays `unknown`, 0."""
        cfg = self.config
        policy, ratio = cfg.policy_label, cfg.cpu_ratio
        if policy is not None and ratio is not None:
            return policy, ratio
        found: tuple[str, float] = ("unknown", 0.0)
        router = await self._get_json("/v1/replicas")
        info = None if router else await self._get_json("/get_server_info")
        with contextlib.suppress(KeyError, TypeError, ValueError, ZeroDivisionError):
            if router:
                gpu = sum(row["gpu"]["budget_tokens"] for row in router["data"])
                cpu = sum(row["cpu"]["budget_tokens"] for row in router["data"])
                found = (str(router.get("policy", "unknown")), cpu / gpu)
            elif info:
                gpu, cpu = info["max_total_num_tokens"], info.get("hicache_host_tokens", 0)
                found = ("direct", float(cpu) / gpu)
        return (
            policy if policy is not None else found[0],
            ratio if ratio is not None else round(found[1], 3),
        )

    async def _get_json(self, path: str) -> dict | None:
        """GET a JSON object from the endpoint's root (with the API key); None on failure."""
        headers = self._auth
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = await self.http.get(self.config.base_url + path, headers=headers, timeout=5.0)
            if r.status_code == 200 and isinstance(doc := r.json(), dict):
                return doc
        return None

    async def _replica_urls(self) -> list[str]:
        base = self.config.base_url
        replicas = await self._get_json("/v1/replicas")
        with contextlib.suppress(ValueError, KeyError, TypeError):
            if replicas is not None:
                return [row["url"].rstrip("/") for row in replicas["data"]]
        with contextlib.suppress(httpx.HTTPError):
            r = await self.http.get(base + "/mori/residency", timeout=5.0)
            if r.status_code == 200:
                return [base]
        return []

    async def _util_sample(self, urls: list[str]) -> dict | None:
        """Per replica: (active token-seconds or None, engine time, active, capacity)."""
        rows = {}
        for url in urls:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                doc = (await self.http.get(url + "/mori/residency", timeout=5.0)).json()
                active = int(doc.get("device_active_tokens", doc["device_used_tokens"]))
                area = doc.get("device_active_token_seconds")
                rows[url] = (
                    area,
                    doc.get("engine_time_s"),
                    active,
                    int(doc["device_capacity_tokens"]),
                )
        return rows or None


def _utilisation(first: dict, last: dict, samples: list[float]) -> list[float]:
    """Exact share from the integrals when every replica reports one, else one more
    instantaneous sample appended to `samples`."""
    if all(r[0] is not None for r in last.values()) and set(first) == set(last):
        area = sum(last[u][0] - first[u][0] for u in last)
        span = sum((last[u][1] - first[u][1]) * last[u][3] for u in last)
        return [area / span] if span > 0 else samples
    capacity = sum(r[3] for r in last.values())
    return [*samples, sum(r[2] for r in last.values()) / capacity] if capacity else samples


def _or(reported: int | None, fallback: int) -> int:
    return fallback if reported is None else reported


async def replay(
    corpus: list[TraceProgram],
    config: ReplayConfig,
    on_tick: Callable[[float], None] | None = None,
) -> tuple[RunResult, list[StepRecord], Progress]:
    """Run one live replay; the records and running totals come back with the result."""
    run = Replay(corpus, config)
    result = await run.run(on_tick)
    return result, run.records, run.progress
