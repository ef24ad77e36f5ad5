"""TEST SCAFFOLDING: one program's offload and load-back through the router, its requests
sent over chat completions (OpenAI SDK) or Anthropic Messages (Anthropic SDK).

The same cycle runs against the emulator (tests/test_anthropic.py) and real SGLang
(tests/test_sglang_messages.py), so a Messages program can be checked to move exactly as
the same program over chat does: program `a` holds the GPU tier, starts a long tool call,
and `b` arrives needing the room, so the router moves `a` to its CPU tier (hint `idle`: the
engine drops the device copy, keeps the host copy); `b` ends, `a` sends its next step and
goes back (hint `busy`: the engine loads it back), and ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import openai

from router.protocol.accounting import CACHE_DETAILS_FLAG
from tests.servers import wait_for

LONG_TOOL = {"tool": "bash:pytest", "predict_time": 600}  # worth moving off the GPU


@dataclass(frozen=True)
class Cycle:
    """What the engine held of `a` and reported to it along the cycle."""

    offloaded: dict[str, Any]  # `a`'s residency row once the router moved it to CPU
    cached: int  # prompt tokens `a`'s next step found in KV (device + host)
    back: dict[str, Any]  # `a`'s residency row after that step


def sender(base: str, api: str, max_tokens: int) -> Callable[[str, str], tuple[str, dict]]:
    """`send(program, text)`: one request of `text` as the only user message, through the
    router at `base`; the answer's text and its device/host split."""
    extra = {"ignore_eos": True, CACHE_DETAILS_FLAG: True}
    if api == "chat":
        chat = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)

        def send(program: str, text: str) -> tuple[str, dict]:
            out = chat.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": text}],
                max_tokens=max_tokens,
                temperature=0,
                extra_body={**extra, "program_id": program},
            )
            return out.choices[0].message.content or "", _split(out.model_extra)

        return send
    messages = anthropic.Anthropic(base_url=base, api_key="none", max_retries=0, timeout=120)

    def send(program: str, text: str) -> tuple[str, dict]:
        out = messages.messages.create(
            model="m",
            messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens,
            metadata={"user_id": program},
            extra_body={**extra, "temperature": 0},  # (this SDK has no temperature argument)
        )
        return "".join(b.text for b in out.content if b.type == "text"), _split(out.model_extra)

    return send


def _split(extra: dict | None) -> dict:
    return ((extra or {}).get("sglext") or {}).get("cached_tokens_details") or {}


def residency(replica: str) -> dict[str, Any]:
    return httpx.get(replica + "/mori/residency", timeout=30).json()["programs"]


def run_cycle(
    base: str, replica: str, send: Callable[[str, str], tuple[str, dict]], a: str, b: str,
    a_text: str, b_text: str, timeout_s: float = 20.0,
) -> Cycle:  # fmt: skip
    """The cycle of the module docstring; `a_text` must fit the router's GPU tier, not with
    `b_text` beside it."""
    answer, _ = send(a, a_text)
    httpx.post(f"{base}/v1/programs/{a}/tool_start", json=LONG_TOOL, timeout=5).raise_for_status()
    send(b, b_text)  # a is moved off the GPU tier to make room
    offloaded = wait_for(
        lambda: (row := residency(replica).get(a)) and row["hint"] == "idle" and row,
        timeout_s,
        f"{a} hinted idle",
    )
    httpx.post(f"{base}/v1/programs/{b}/end", timeout=5).raise_for_status()
    httpx.post(f"{base}/v1/programs/{a}/tool_end", timeout=5).raise_for_status()
    _, split = send(a, f"{a_text}{answer} tool result")
    back = residency(replica)[a]
    httpx.post(f"{base}/v1/programs/{a}/end", timeout=5).raise_for_status()
    return Cycle(offloaded, split.get("device", 0) + split.get("host", 0), back)
