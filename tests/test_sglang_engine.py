"""The MORI engine patch inside a real SGLang 0.5.17, on CPU (HiCache with a small device pool).

Needs the SGLang venv from scripts/install_sglang_cpu.sh (scripts/test.sh runs it first).
MORI_SKIP_SGLANG=1 skips these tests with that reason; otherwise a missing engine FAILS.
The model is a random-weight 2-layer Qwen2 built at test time (tests/sglang/, scaffolding).
Programs send token-id prompts through the OpenAI SDK with `session_id` = program id; the
engine's own view comes from /generate's cached_tokens_details.
"""

from __future__ import annotations

import json
import random
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.sglang.server import (
    HERE,
    PYTHON,
    REAL_ENGINE,
    REPO,
    Server,
    build_tiny_model,
    installed_version,
    patched_servers,
    server_env,
    tiny_engine,
)

pytestmark = REAL_ENGINE

DEVICE_TOKENS = 256  # --max-total-tokens: a few programs already overflow it
PROMPT_LEN = 24
SERVER_FLAGS = [
    "--max-total-tokens", str(DEVICE_TOKENS),
    "--hicache-ratio", "1.5",  # host pool ~385 tokens: the host tier overflows too
    "--max-running-requests", "4",
    "--chunked-prefill-size", "128",
]  # fmt: skip


def prompt_of(program: str) -> list[int]:
    """A prompt no other program shares (distinct first token), deterministic per program."""
    rng = random.Random(program)
    return [20 + int(program[1:]), *(rng.randrange(30, 300) for _ in range(PROMPT_LEN - 1))]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with tiny_engine(tmp_path_factory.mktemp("sglang"), SERVER_FLAGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def run_step(client: OpenAI, program: str) -> str:
    out = client.completions.create(
        model="tiny",
        prompt=prompt_of(program),
        max_tokens=1,
        temperature=0,
        extra_body={"session_id": program, "ignore_eos": True},
    )
    return out.choices[0].text


def hints(server: Server, epoch: int, types: dict[str, str], full: bool = False) -> dict:
    return server.push_hints({"epoch": epoch, "hints": types, "full": full})


def generate(server: Server, program: str) -> dict:
    return server.generate(program, prompt_of(program))


def device(res: dict, programs: list[str]) -> int:
    return sum(res["programs"].get(p, {}).get("device_tokens", 0) for p in programs)


def host(res: dict, programs: list[str]) -> int:
    return sum(res["programs"].get(p, {}).get("host_tokens", 0) for p in programs)


def names(lo: int, hi: int) -> list[str]:
    return [f"p{i:02d}" for i in range(lo, hi)]


def test_hint_endpoint_validates_and_is_idempotent(server: Server):
    bad = httpx.post(f"{server.url}/mori/hints", json={"epoch": 1, "hints": {"x": "hot"}})
    assert bad.status_code == 400
    assert "unknown type" in bad.json()["error"]["message"]
    assert httpx.post(f"{server.url}/mori/hints", content=b"{nope").status_code == 400
    first = hints(server, 1, {"zz": "inactive"})
    assert first == hints(server, 1, {"zz": "inactive"})
    assert first["residency"] == {"zz": {"device_tokens": 0, "host_tokens": 0}}
    assert hints(server, 0, {"zz": "busy"})["stale"] is True
    assert "zz" not in server.residency()["programs"]  # inactive, holds nothing: forgotten
    hints(server, 2, {"zz": "idle"})
    assert server.residency()["programs"]["zz"]["hint"] == "idle"


def test_typed_eviction_and_offload_under_pressure(server: Server, client: OpenAI):
    busy, inactive, idle = names(0, 4), names(4, 8), names(8, 20)
    # Busy programs run first: plain LRU would evict them first.
    for p in busy + inactive:
        run_step(client, p)
    res = server.residency()
    assert device(res, busy) == len(busy) * PROMPT_LEN, res
    hints(server, 10, {**dict.fromkeys(busy, "busy"), **dict.fromkeys(inactive, "inactive")})
    hints(server, 11, dict.fromkeys(idle, "idle"))
    for p in idle:  # 12 more programs: the device pool (256 tokens) overflows
        run_step(client, p)
    res = server.residency()
    # Device: inactive went first, busy programs kept every token on device.
    assert device(res, busy) == len(busy) * PROMPT_LEN, res
    assert device(res, inactive) == 0, res
    # Host (write-through put everyone there, the host pool overflowed): inactive go first.
    assert host(res, inactive) < host(res, idle[:4]), res
    assert res["device_used_tokens"] <= res["device_capacity_tokens"]

    # Idle transition: the program's device copy is freed at once, its host copy stays.
    survivors = [p for p in idle if res["programs"][p]["device_tokens"] > 0]
    assert survivors, res
    hints(server, 12, dict.fromkeys(survivors, "busy"))
    after = hints(server, 13, dict.fromkeys(survivors, "idle"))  # busy -> idle: offload
    expect = {"device_tokens": 0, "host_tokens": PROMPT_LEN}
    assert after["residency"] == dict.fromkeys(survivors, expect), after
    assert device(server.residency(), survivors) == 0


def test_busy_program_is_loaded_back_and_served_from_device(server: Server):
    program = "p30"
    first = generate(server, program)
    hints(server, 20, {program: "idle"})  # offload: device copy freed, host copy kept
    res = server.residency()["programs"][program]
    assert res == {"hint": "idle", "hinted": True, "device_tokens": 0, "host_tokens": PROMPT_LEN}
    answer = hints(server, 21, {program: "busy"})  # queue load-back for the next prefill
    assert answer["residency"][program] == {"device_tokens": PROMPT_LEN, "host_tokens": PROMPT_LEN}
    again = generate(server, program)
    details = again["meta_info"]["cached_tokens_details"]
    assert details == {"device": PROMPT_LEN - 1, "host": 0}, again["meta_info"]
    assert again["output_ids"] == first["output_ids"]  # the reloaded KV is the same KV


def test_a_swap_in_one_batch_loads_back_into_the_room_its_offload_frees(server: Server):
    """The router lets one program in and another out in one batch: the engine offloads
    first, so the load-back fits in the rows just freed (in the batch's name order the
    load-back would come first, find the pool full and leave the program on host)."""
    comer, fillers = "p60", []  # "p60" sorts before every leaver
    generate(server, comer)
    hints(server, 30, {comer: "idle"})
    for p in names(61, 73):  # until the device pool (256 tokens) is full of their cache
        generate(server, p)
        fillers.append(p)
        res = server.residency()
        if res["device_capacity_tokens"] - res["device_used_tokens"] < PROMPT_LEN:
            break
    assert res["device_capacity_tokens"] - res["device_used_tokens"] < PROMPT_LEN, res
    assert res["programs"][comer]["host_tokens"] == PROMPT_LEN, res
    rows = res["programs"]
    leaver = next(
        p for p in reversed(fillers) if rows[p]["device_tokens"] == rows[p]["host_tokens"] > 0
    )
    answer = hints(server, 31, {comer: "busy", leaver: "idle"})
    assert answer["residency"][leaver] == {"device_tokens": 0, "host_tokens": PROMPT_LEN}, answer
    full = {"device_tokens": PROMPT_LEN, "host_tokens": PROMPT_LEN}
    assert answer["residency"][comer] == full, answer


def test_residency_agrees_with_cached_tokens_details(server: Server):
    """For programs in every state, the next request's device/host hit equals what
    /mori/residency said just before (one token is always recomputed)."""
    for p in names(0, 20):
        nothing = {"device_tokens": 0, "host_tokens": 0}  # an evicted inactive: forgotten
        before = server.residency()["programs"].get(p, nothing)
        path = max(before["device_tokens"], before["host_tokens"])
        meta = generate(server, p)["meta_info"]
        details = meta["cached_tokens_details"] or {"device": 0, "host": 0}
        expect_device = min(before["device_tokens"], max(path - 1, 0))
        assert details["device"] == expect_device, (p, before, meta)
        assert details["device"] + details["host"] == max(path - 1, 0), (p, before, meta)


def test_chat_endpoint_carries_session_id(server: Server, client: OpenAI):
    client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "program chat step one"}],
        max_tokens=2,
        extra_body={"session_id": "chat1"},
    )
    row = server.residency()["programs"]["chat1"]
    assert row["host_tokens"] > 0
    assert row["hint"] == "busy" and row["hinted"] is False  # the default: no router named it


def test_busy_first_admission_on_the_real_schedule_policy():
    """The plugin, loaded by SGLang's own loader, re-sorts the real waiting queue after the
    scheduling policy: busy (and unhinted) first, then idle, then inactive, FCFS within."""
    hints_ = {"b1": "busy", "b2": "busy", "i1": "idle", "i2": "idle", "x1": "inactive"}
    queue = ["x1", "i1", "b1", None, "i2", "b2"]
    out = subprocess.run(
        [str(PYTHON), str(HERE / "busy_first_probe.py"), json.dumps(hints_), json.dumps(queue)],
        env=server_env(), cwd=REPO, capture_output=True, text=True, timeout=180, check=True,
    )  # fmt: skip
    assert json.loads(out.stdout.splitlines()[-1]) == ["b1", None, "b2", "i1", "i2", "x1"]


def test_kv_hints_program_type_action_sets_the_type(server: Server):
    """0.5.23 carries the versioned `kv_hints` envelope on /generate: the plugin takes MORI's
    `mori.program_type` action from it (docs/hint-protocol.md); others are ignored."""
    if installed_version() == "0.5.17":
        pytest.skip("sglang 0.5.17 has no kv_hints envelope")
    action = {"action_id": "a1", "action_type": "mori.program_type", "action_version": "1"}
    envelope = {
        "protocol_version": "1",
        "message_id": "m1",
        "actions": [
            {**action, "payload": {"program": "kv1", "type": "idle", "epoch": 10**15}},
            {**action, "action_type": "other.retain", "payload": {"program": "kv1"}},
        ],
    }
    body = {
        "input_ids": prompt_of("p40"),
        "session_id": "kv1",
        "kv_hints": envelope,
        "sampling_params": {"max_new_tokens": 1, "temperature": 0},
    }
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert server.residency()["programs"]["kv1"]["hint"] == "idle"


@pytest.mark.slow  # the harness, not MORI: two engine start-ups (~60 s of CI's 15 minutes)
def test_an_engine_whose_port_was_taken_starts_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`free_port` races every other process on the box: a port free when picked may be
    taken before the engine binds it (the engine then lingers ~10 s and exits, seen in a
    full suite on 2 busy cores). The harness starts it again on a fresh port."""
    import socket

    import tests.sglang.server as harness

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = harness.free_port
    monkeypatch.setattr(harness, "free_port", lambda: next(ports, None) or real())
    model = build_tiny_model(tmp_path / "tiny")
    try:
        with patched_servers(1, model, tmp_path, SERVER_FLAGS) as (srv,):
            assert srv.port != taken.getsockname()[1]
            assert httpx.get(f"{srv.url}/model_info", timeout=10).status_code == 200
    finally:
        taken.close()
