"""The committed HAProxy configs (docker/haproxy/) in front of real routers and emulated
replicas: both parse; the active/standby pair fails over on kill -9 with the program's KV
kept; cells send every request of a program, whichever way it names its id, to one router.

Under load (20 streaming programs, a replay across the kill, a third cell added):
tests/test_ha_proxy_load.py (slow)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from tests.proxy_harness import (
    CELL_HEADER,
    CELLS_CONFIG,
    HA_CONFIG,
    address,
    check_config,
    ha_pair,
    haproxy,
    haproxy_missing,
)
from tests.router_harness import chat, client, emulator, emulators, router, router_process

pytestmark = pytest.mark.skipif(haproxy_missing() is not None, reason=str(haproxy_missing()))


def _health(base: str) -> dict:
    return httpx.get(base + "/health", timeout=5).json()


def test_the_configs_parse():
    ha = check_config(HA_CONFIG, MORI_PRIMARY="127.0.0.1:2", MORI_STANDBY="127.0.0.1:3")
    assert ha.returncode == 0, ha.stdout + ha.stderr
    cells = check_config(CELLS_CONFIG, MORI_CELL_0="127.0.0.1:2", MORI_CELL_1="127.0.0.1:3")
    assert cells.returncode == 0, cells.stdout + cells.stderr


def test_kill_9_of_the_active_router_fails_over_with_the_kv_kept():
    """The primary serves a program; kill -9 takes its whole process group: a stream it was
    relaying raises in the client at once; the next
    request through the proxy is served by the standby within 5 s, on the replica that
    holds the program's KV, with a cache hit. The primary restarted stays the standby:
    traffic does not fail back (each switch is a takeover) and it pushes nothing."""
    with emulators(2, "--time-scale", "20") as urls, ha_pair(urls) as pair:
        c = client(pair.proxy)
        text = "job " + "word " * 600
        first = c.chat.completions.with_raw_response.create(**chat("job", text))
        home = first.headers["x-mori-replica"]
        text += first.parse().choices[0].message.content
        assert _health(pair.primary)["role"] == "active"
        assert _health(pair.standby)["role"] == "standby"

        long = chat("long", "go", max_tokens=4000, extra_body={"ignore_eos": True})
        stream = c.chat.completions.create(**long, stream=True)
        next(iter(stream))  # streaming through the primary
        pair.kill("primary")
        killed = time.monotonic()
        with pytest.raises(openai.APIConnectionError):  # cut: an error, not a silent end
            for _ in stream:
                pass
        assert time.monotonic() - killed < 1.0  # at once, no hang
        details = {"return_cached_tokens_details": True}
        # as an agent's SDK does by default: a request caught in the ~0.2 s before HAProxy
        # marks the router down may fail once, and is retried
        retrying = openai.OpenAI(base_url=pair.proxy + "/v1", api_key="EMPTY", max_retries=2)
        raw = retrying.chat.completions.with_raw_response.create(
            **chat("job", text + " next", extra_body=details)
        )
        assert time.monotonic() - killed < 5
        assert raw.headers["x-mori-replica"] == home
        split = raw.parse().model_extra["sglext"]["cached_tokens_details"]
        assert split["device"] + split["host"] > 500
        assert _health(pair.standby)["role"] == "active"

        port = int(pair.primary.rsplit(":", 1)[1])
        with router_process(urls, port=port, standby=True, workers=1) as (restarted, _):
            time.sleep(1.5)  # HAProxy's checks see it up again (rise 2 x 500 ms)
            again = c.chat.completions.with_raw_response.create(**chat("job", text + " more"))
            assert again.headers["x-mori-replica"] == home
            assert _health(restarted) | {"healthy_replicas": 0} == {
                "status": "ok", "healthy_replicas": 0, "role": "standby", "epoch": 0
            }  # fmt: skip
            assert _health(pair.standby)["role"] == "active"


def test_cells_keep_every_program_in_one_cell():
    """Two cells (a router and a replica each): a program named by the X-Program-Id header,
    by the body's `program_id` or in a program endpoint's path reaches the same cell; a
    conversation without an id reaches one cell with every call."""
    with (
        emulator("--time-scale", "50") as (r0, _),
        emulator("--time-scale", "50") as (r1, _),
        router([r0]) as cell0,
        router([r1]) as cell1,
        haproxy(CELLS_CONFIG, MORI_CELL_0=address(cell0), MORI_CELL_1=address(cell1)) as proxy,
    ):
        c = client(proxy)
        cells = {}
        for i in range(24):
            pid = f"task-{i}"
            by_body = c.chat.completions.with_raw_response.create(**chat(pid, max_tokens=1))
            by_header = c.chat.completions.with_raw_response.create(
                model="default",
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=1,
                extra_headers={"X-Program-Id": pid},
            )
            by_path = httpx.get(f"{proxy}/v1/programs/{pid}", timeout=5)
            assert by_path.status_code == 200  # the router that holds it knows it
            seen = {r.headers[CELL_HEADER] for r in (by_body, by_header, by_path)}
            assert len(seen) == 1, (pid, seen)
            assert by_header.headers["x-mori-program-id"] == pid
            cells[pid] = seen.pop()
        assert set(cells.values()) == {"cell-0", "cell-1"}  # the hash spreads them

        conversation = [{"role": "system", "content": "you review code"},
                        {"role": "user", "content": "review this diff"}]  # fmt: skip
        answers = []
        for turn in range(3):
            raw = c.chat.completions.with_raw_response.create(
                model="default", messages=conversation, max_tokens=4
            )
            answers.append((raw.headers[CELL_HEADER], raw.headers["x-mori-program-id"]))
            answer = raw.parse().choices[0].message.content
            conversation += [{"role": "assistant", "content": answer},
                             {"role": "user", "content": f"and now {turn}"}]  # fmt: skip
        assert len(set(answers)) == 1, answers  # one cell, one derived id
