"""Bad input never crashes the router: config errors are explained, bad requests get an
OpenAI-style 4xx, and a fuzz of thousands of requests against a live router finds no 5xx."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.config import (
    POLICY_KNOBS,
    SCALED_TIMERS,
    ConfigError,
    RouterConfig,
    load_config,
    parse_settings,
)
from router.policy import REGISTRY, PolicyConfig
from router.policy.labels import LabelError
from router.protocol.accounting import OpenAIStream
from router.protocol.identity import (
    SESSION_HEADERS,
    fingerprint,
    namespace,
    resolve,
    session_headers,
)
from router.protocol.intake import Hints, Intake, prepare
from router.wire.errors import ApiError
from tests.router_harness import assert_clean, emulators, router
from tests.servers import mori

REPO = Path(__file__).resolve().parents[1]

# --- configuration -----------------------------------------------------------------------


def test_flags_beat_env_beat_file(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("replicas: [http://a:1]\nport: 9000\ntick_s: 3\nwindow: 6\n")
    env = {"MORI_PORT": "9001", "MORI_TICK_S": "2.5", "MORI_API_KEYS": "k1,k2"}
    config = load_config(path, {"port": 9002, "policy": None}, env=env)
    assert config.port == 9002  # flag
    assert config.tick_s == 2.5  # env over file
    assert config.window == 6  # file over default
    assert config.api_keys == ["k1", "k2"]
    assert [r.url for r in config.replicas] == ["http://a:1"]


def test_time_scale_divides_the_trace_timers(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("replicas: [http://a:1]\ntick_s: 5\nlease_s: 900\nhealth_interval_s: 5\n")
    plain = load_config(path, env={})
    fast = load_config(path, {"time_scale": 10}, env={"MORI_GATE_TIMEOUT_S": "300"})
    assert (fast.tick_s, fast.lease_s, fast.gate_timeout_s) == (0.5, 90, 30)
    assert fast.hint_sync_s == plain.hint_sync_s / 10
    assert fast.load_s_per_token == pytest.approx(plain.load_s_per_token / 10)
    assert fast.health_interval_s == 5  # wall-clock concerns keep their value
    with pytest.raises(ConfigError, match="time_scale"):
        load_config(path, env={"MORI_TIME_SCALE": "0"})


def test_every_policy_knob_is_settable_on_the_router_as_in_the_simulator(tmp_path):
    """Each PolicyConfig field is a router setting of the same name, reachable from the file,
    MORI_<KNOB> and `--set KNOB=VALUE` (load_s_per_token: derived from the KV size and PCIe)."""
    knobs = {f.name for f in dataclasses.fields(PolicyConfig)} - {"load_s_per_token"}
    assert knobs == POLICY_KNOBS and knobs <= set(RouterConfig.model_fields)
    values = {k: v for k, v in vars(PolicyConfig()).items() if k in knobs}

    def other(v):  # a valid value different from the default
        if isinstance(v, bool):
            return not v
        return v / 2 if v and v <= 1 else (v or 1) * 3

    changed = {k: other(v) for k, v in values.items()}
    base = {"replicas": ["http://a:1"]}
    path = tmp_path / "r.yaml"
    path.write_text(json.dumps({**base, **changed}))
    from_file = load_config(path, env={}).policy_config()
    env = {f"MORI_{k.upper()}": json.dumps(v) for k, v in changed.items()}
    from_env = load_config(None, base, env=env).policy_config()
    from_flags = load_config(
        None, {**base, **parse_settings([f"{k}={v}" for k, v in changed.items()])}, env={}
    ).policy_config()  # noqa: E501
    scale = changed["time_scale"]  # the trace timers come divided by it (the test above)
    want = {k: v / scale if k in SCALED_TIMERS else v for k, v in changed.items()}
    for config in (from_file, from_env, from_flags):
        assert {k: getattr(config, k) for k in knobs} == pytest.approx(want)


def test_the_example_config_and_the_docs_say_what_the_code_does():
    """configs/router.yaml sets every setting it names to the code's default (loading it
    changes nothing but the replicas it lists: its round_share_min was 0.25 against 0.5),
    it, docs/router.md and docs/policy.md's table name every registered policy, and the
    docs name every timer `time_scale` divides."""
    example = yaml.safe_load((REPO / "configs/router.yaml").read_text())
    fields = RouterConfig.model_fields
    differ = {
        k: (v, fields[k].default)
        for k, v in example.items()
        if k not in ("replicas", "api_keys") and v != fields[k].default
    }
    assert differ == {}
    docs = (REPO / "docs/router.md").read_text()
    policy_row = next(line for line in docs.splitlines() if line.startswith("| `policy` |"))
    example_text = (REPO / "configs/router.yaml").read_text()
    comment = example_text[example_text.index("policy: mori") :].split("\nlog_level")[0]
    listed = set(comment.replace("|", " ").split())
    table = [line for line in (REPO / "docs/policy.md").read_text().splitlines() if "|" in line]
    for name in REGISTRY:
        assert f"`{name}`" in policy_row and name in listed, name
        assert any(line.startswith(f"| `{name}`") for line in table), name
    scale_row = next(line for line in docs.splitlines() if line.startswith("| `time_scale` |"))
    assert [t for t in SCALED_TIMERS if f"`{t}`" not in scale_row] == []


def test_replicas_from_env_accept_overrides():
    env = {"MORI_REPLICAS": '[{"url": "http://a:1/", "gpu_tokens": 500}, "http://b:2"]'}
    config = load_config(None, env=env)
    assert config.replicas[0].url == "http://a:1" and config.replicas[0].gpu_tokens == 500
    assert config.replicas[1].gpu_tokens is None


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        ("replicas: [http://a:1]\ntick_s: -1\n", {}, "tick_s"),
        ("replicas: [ftp://a]\n", {}, "http://"),
        ("replicas: [http://a:1]\nbogus: 1\n", {}, "bogus: unknown setting"),
        ("replicas: [http://a:1, http://a:1]\n", {}, "distinct"),
        ("port: 80\n", {}, "no replicas configured"),
        ("replicas: [http://a:1]\n", {"MORI_WINDOW": "zero"}, "window"),
        ("- just\n- a list\n", {}, "mapping"),
        ("replicas: [http://a:1\n", {}, "not valid YAML"),
    ],
)
def test_bad_config_is_explained(tmp_path, text, env, needle):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=None) as err:
        load_config(path, env=env)
    assert needle in str(err.value)


def test_config_errors_never_echo_secrets(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("replicas: [http://a:1]\nadmin_key: [sekrit-admin]\napi_keys: 7\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert "sekrit" not in str(err.value) and "admin_key" in str(err.value)


# --- identity and accounting ------------------------------------------------------------


def test_program_id_sources_in_order():
    body = {"program_id": "a", "extra_body": {"program_id": "b"}, "metadata": {"user_id": "d"}}
    assert resolve(body, "c", "") == ("a", "program_id", None, ())
    assert resolve({"extra_body": {"program_id": "b"}}, "c", "").program_id == "b"
    assert resolve({"metadata": {"user_id": "d"}}, "c", "").program_id == "c"
    assert resolve({"metadata": {"user_id": "d"}}, None, "").source == "metadata.user_id"
    assert resolve({"program_id": "a"}, None, namespace("key1")) != resolve(
        {"program_id": "a"}, None, namespace("key2")
    )
    with pytest.raises(LabelError):
        resolve({"program_id": {"nested": 1}}, None, "")
    with pytest.raises(LabelError):
        resolve({"program_id": "x" * 1000}, None, "")


def test_session_headers_come_after_explicit_ids_and_before_user_id():
    """The harness headers in Dynamo's order, each naming a session whose programs are its
    conversations; an unusable value is skipped (and reported), never an error."""
    convo = {"messages": [{"role": "user", "content": "fix it"}], "metadata": {"user_id": "u"}}
    fp = fingerprint(convo)
    every = {
        "x-opencode-session": "oc",
        "session_id": "old",
        "session-id": "cx",
        "x-claude-code-session-id": "cc",
        "x-dynamo-session-id": "dyn",
    }
    order = []
    while every:
        who = resolve(convo, None, "k/", session_headers(every))
        order.append(who.source)
        assert who.program_id == f"{who.session}/{fp}" and who.session.startswith("k/")
        del every[who.source.lower()]
    assert order == [name for _, name in SESSION_HEADERS]
    assert resolve(convo, "x", "", session_headers({"session-id": "cx"})).program_id == "x"
    bad = {"x-claude-code-session-id": "a\x00b", "session-id": " ok ", "session_id": "no"}
    who = resolve(convo, None, "", session_headers(bad))
    assert (who.session, who.ignored) == ("ok", ("X-Claude-Code-Session-Id",))
    latin = {"x-dynamo-session-id": "\xff\xfe", "session-id": "x" * 300}
    who = resolve(convo, None, "", session_headers(latin))
    assert (who.program_id, who.ignored) == ("u", ("X-Dynamo-Session-ID", "session-id"))
    assert resolve({"messages": convo["messages"]}, None, "").source == "fingerprint"


async def test_large_bodies_are_prepared_in_the_worker_process():
    """Above the threshold `prepare` runs in another process: same result, same errors."""
    intake = Intake(inline_bytes=0)
    body = {"messages": [{"role": "user", "content": "hi"}], "program_id": "big", "stream": True}
    try:
        here = prepare("chat", json.dumps(body).encode(), Hints())
        there = await intake.prepare("chat", json.dumps(body).encode(), Hints())
        assert (there.program_id, there.stream, there.rid != here.rid) == ("big", True, True)
        assert json.loads(there.content)["session_id"] == "big"
        bad = json.dumps({**body, "metadata": {"user_id": "x"}, "program_id": "\ud800"})
        with pytest.raises(ApiError) as err:
            await intake.prepare("chat", bad.encode(), Hints())
        assert (err.value.status, err.value.param) == (400, "program_id")
    finally:
        intake.close()


def test_fingerprint_follows_the_stable_start():
    start = [{"role": "system", "content": "you are an agent"}, {"role": "user", "content": "fix"}]
    later = [*start, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    other = [start[0], {"role": "user", "content": "another task"}]
    assert fingerprint({"messages": start}) == fingerprint({"messages": later})
    assert fingerprint({"messages": start}) != fingerprint({"messages": other})


def test_deeply_nested_body_is_refused_not_fatal():
    """A parser that recursed without bound would crash the process serving the port
    (orjson before 3.9.15 did, at about 100 000 levels): run in a child to see a crash."""
    deep = b'{"model": "m", "deep": ' + b'{"k":' * 100_000 + b"1" + b"}" * 100_000 + b"}"
    script = (
        "import sys; from router.protocol.intake import Hints, prepare\n"
        "from router.wire.errors import ApiError\n"
        "try: prepare('chat', sys.stdin.buffer.read(), Hints())\n"
        "except ApiError as e: print(e.status, e.code)"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], input=deep, capture_output=True, timeout=60
    )
    assert (run.returncode, run.stdout.strip()) == (0, b"400 invalid_json"), run.stderr[-500:]


def _sse(doc) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def test_forced_usage_chunk_is_dropped_but_counted():
    content = {"choices": [{"index": 0, "delta": {"content": "hi"}}], "usage": None}
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}
    raw = _sse(content) + _sse(usage) + b"data: [DONE]\n\n"
    for wants in (False, True):
        stream = OpenAIStream(client_wants_usage=wants)
        out = b"".join(stream.feed(raw[i : i + 5]) for i in range(0, len(raw), 5)) + stream.flush()
        assert (b'"prompt_tokens"' in out) is wants
        assert b"[DONE]" in out and b'"hi"' in out
        assert stream.finish().context_tokens == 9


def test_tool_call_deltas_name_the_tool():
    calls = [
        {"index": 0, "id": "c1", "function": {"name": "bash", "arguments": '{"comm'}},
        {"index": 0, "function": {"arguments": 'and": "pytest -x tests"}'}},
    ]
    stream = OpenAIStream(client_wants_usage=False)
    for call in calls:
        stream.feed(_sse({"choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}))
    assert stream.finish().tool == "bash:pytest"  # the predictor's key (tool_key_of_calls)


# --- requests against the app ------------------------------------------------------------


@pytest.fixture(scope="module")
def replica_url():
    with emulators(1) as urls:
        yield urls[0]


def _router(replica_url: str, **settings):
    """A live `mori serve` (its data-plane workers and policy owner) for one test."""
    return router([replica_url], **{"gate_timeout_s": 5, "max_body_bytes": 4096, **settings})


async def _with_router(replica_url: str, fn, **settings):
    with _router(replica_url, **settings) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            return await fn(c)


def _is_openai_error(r: httpx.Response) -> bool:
    body = r.json()
    return set(body["error"]) == {"message", "type", "param", "code"}


def _is_api_error(r: httpx.Response, path: str) -> bool:
    """OpenAI-shaped, or Anthropic-shaped on /v1/messages."""
    if not path.startswith("/v1/messages"):
        return _is_openai_error(r)
    body = r.json()
    return body["type"] == "error" and set(body["error"]) == {"type", "message"}


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", 400),
    ("/v1/chat/completions", b"", 400),
    ("/v1/chat/completions", b"[1, 2]", 400),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400),
    ("/v1/chat/completions", b'{"messages": []}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": 3}]}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": -5}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "max_tokens": "9"}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "stream": "yes"}', 400),
    ("/v1/chat/completions", b'{"messages": [{"role": "user"}], "program_id": [1]}', 400),
    ("/v1/completions", b'{"prompt": 5}', 400),
    ("/v1/messages", b'{"messages": [{"role": "user", "content": "x"}]}', 400),
    (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "' + b"x" * 5000 + b'"}]}',
        413,
    ),
    ("/v1/programs/nobody/end", b"", 404),
    ("/v1/programs/nobody/tool_start", b'{"tool": "pytest"}', 404),
    ("/v1/programs/nobody/tool_start", b'{"tool": 5}', 400),
    ("/v1/no/such/route", b"{}", 404),
]


async def test_bad_requests_get_openai_errors(replica_url):
    async def run(c):
        for path, body, status in BAD_REQUESTS:
            r = await c.post(path, content=body, headers={"content-type": "application/json"})
            assert r.status_code == status, (path, body[:60], r.text)
            assert _is_api_error(r, path)
            assert "Traceback" not in r.text
        r = await c.get("/v1/programs/nobody")
        assert r.status_code == 404 and _is_openai_error(r)

    await _with_router(replica_url, run)


async def test_keys_guard_clients_and_admin(replica_url):
    message = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "program_id": "p"}

    async def run(c):
        r = await c.post("/v1/chat/completions", json=message)
        assert r.status_code == 401 and _is_openai_error(r)
        r = await c.post("/v1/chat/completions", json=message, headers={"x-api-key": "wrong"})
        assert r.status_code == 401 and "wrong" not in r.text
        ok = {"authorization": "Bearer client-key"}
        r = await c.post("/v1/chat/completions", json=message, headers=ok)
        assert r.status_code == 200, r.text
        pid = r.headers["x-mori-program-id"]
        assert pid.endswith("/p") and "client-key" not in pid
        assert (await c.get("/v1/programs", headers=ok)).status_code == 403
        admin = {"authorization": "Bearer admin-key"}
        listing = (await c.get("/v1/programs", headers=admin)).json()
        assert [p["program_id"] for p in listing["data"]] == [pid]
        r = await c.post("/v1/programs/p/end", headers=ok)  # the client names its own id
        assert r.status_code == 200 and r.json()["program_id"] == pid
        assert (await c.get("/v1/programs", headers=admin)).json()["data"] == []

    await _with_router(replica_url, run, api_keys=["client-key"], admin_key="admin-key")


@pytest.mark.parametrize(
    ("keys", "unkeyed"), [({}, 200), ({"api_keys": ["client-key"]}, 401)], ids=["none", "client"]
)
async def test_without_an_admin_key_the_admin_endpoints_take_what_clients_take(
    replica_url, keys, unkeyed
):
    """docs/router.md: with no `admin_key`, a valid client key opens /v1/programs and
    /v1/replicas, and with no `api_keys` either they answer without a key; /health and
    /metrics never ask for one."""

    async def run(c):
        for path in ("/v1/programs", "/v1/replicas"):
            assert (await c.get(path)).status_code == unkeyed, path
            if keys:
                r = await c.get(path, headers={"authorization": "Bearer client-key"})
                assert r.status_code == 200, path
        assert (await c.get("/metrics")).status_code == 200
        assert (await c.get("/health")).status_code == 200

    await _with_router(replica_url, run, **keys)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | json_values},
    optional={"content": st.text(max_size=40) | json_values},
)
chat_body = st.fixed_dictionaries(
    {},
    optional={
        "messages": st.lists(message, max_size=3) | json_values,
        "max_tokens": st.integers(-3, 6) | json_values,
        "stream": st.booleans() | json_values,
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | json_values,
        "program_id": st.text(max_size=10) | json_values,
        "temperature": st.floats(0, 2) | json_values,
        "model": st.just("default") | json_values,
        "prompt": st.text(max_size=30) | json_values,
        "n": st.integers(0, 2) | json_values,
    },
)
# well-formed for all three paths (each reads its own fields and ignores the others'): without
# it a run of wild bodies may never get past the validator, and the engine path goes unfuzzed
well_formed_body = st.fixed_dictionaries(
    {
        "model": st.just("default"),
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=40)}),
            min_size=1,
            max_size=3,
        ),
        "prompt": st.text(max_size=30),
        "max_tokens": st.integers(1, 6),
    },
    optional={"stream": st.booleans(), "temperature": st.floats(0, 2)},
)
fuzz_request = st.tuples(
    st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages"]),
    st.one_of(
        (well_formed_body | chat_body).map(lambda b: json.dumps(b, allow_nan=True).encode()),
        st.binary(max_size=64),
    ),
)


@pytest.fixture(scope="module")
def fast_replica_url():
    """An emulated replica 20x faster than real time: what the fuzz tries is the router's
    intake, and its ~1,000 engine answers took ~23 ms each at real time (~4 ms here)."""
    with emulators(1, "--time-scale", "20") as urls:
        yield urls[0]


def test_fuzz_never_answers_5xx(fast_replica_url):
    """2000+ generated requests through a live router: every answer is < 500."""
    statuses: list[int] = []
    with (
        _router(fast_replica_url, max_body_bytes=1 << 20) as base,
        httpx.Client(base_url=base, timeout=10) as c,
    ):

        @settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
        @given(fuzz_request)
        def probe(request):
            path, body = request
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            assert r.status_code < 500, (path, body[:200], r.text[:300])
            if r.status_code >= 400:
                assert _is_api_error(r, path)

        probe()
        # the data plane reports a request's outcome to the owner after its last byte
        # reached the client: the books settle a moment after the last answer
        assert_clean(base)
    assert len(statuses) >= 2000
    # the fuzz reaches the engine, not only the validator
    assert statuses.count(200) >= 100, collections.Counter(statuses)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--port", "8123"], "no replicas configured"),
        (["--replicas", "ftp://nowhere"], "http://"),
        (["--replicas", "http://a:1", "--policy", "nope"], "unknown policy"),
    ],
)
def test_serve_refuses_a_bad_config(argv, needle):
    done = subprocess.run(
        mori("serve", *argv), capture_output=True, text=True, timeout=30, env=_no_mori_env()
    )
    assert done.returncode == 2 and needle in done.stderr
    assert "Traceback" not in done.stderr


def _no_mori_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("MORI_")}
