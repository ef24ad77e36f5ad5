"""JSON on the hot path: orjson where it can, the standard library's behaviour always.

Every inference request is decoded and re-encoded once by the router (router/protocol/intake.py)
and its usage chunk decoded once (router/protocol/accounting.py); with the standard library that
was ~10 % of the router's CPU per request. orjson does the common case several times
faster. Where it refuses a document (integers past 64 bits, numbers past a double,
lone surrogates, nesting past 1024) the standard library decides, so what the router
accepts, refuses and forwards is exactly what it was. orjson before 3.9.15 had no depth
limit and crashed the process on a body nested ~100 000 deep: pyproject asks for 3.11.6+.
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def _reject_constant(name: str) -> Any:
    """NaN and Infinity are not JSON; engines choke on them."""
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)  # one, not one per request


def loads(data: bytes) -> Any:
    """Decode JSON; raises ValueError (or RecursionError) as `json.loads` would."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return _DECODER.decode(data.decode())


def dumps(doc: Any) -> bytes:
    """Compact JSON bytes (UTF-8; the standard library's for what orjson refuses)."""
    try:
        return orjson.dumps(doc)
    except TypeError:  # e.g. a string with a lone surrogate, an integer past 64 bits
        return json.dumps(doc, separators=(",", ":")).encode()
