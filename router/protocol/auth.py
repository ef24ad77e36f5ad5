"""Client keys and the admin key.

Clients present a key as `Authorization: Bearer KEY` (OpenAI SDK) or `x-api-key: KEY`
(Anthropic SDK); keys are compared in constant time. Headers are any mapping of
lower-case names to values (the workers' parsed headers, starlette's `Headers`).
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import TYPE_CHECKING

from router.wire.errors import ApiError

if TYPE_CHECKING:
    from router.config import RouterConfig


class Auth:
    """Client keys (Authorization: Bearer, or Anthropic's x-api-key) and the admin key."""

    def __init__(self, config: RouterConfig) -> None:
        self.keys = [k.encode() for k in config.api_keys]
        self.admin_key = config.admin_key.encode() if config.admin_key else None

    @staticmethod
    def _presented(headers: Mapping[str, str]) -> str | None:
        header = headers.get("authorization", "")
        if header[:7].lower() == "bearer ":
            return header[7:].strip()
        return headers.get("x-api-key")

    def client(self, headers: Mapping[str, str]) -> str | None:
        """The caller's client key (None when no keys are configured); 401 otherwise."""
        if not self.keys:
            return None
        key = self._presented(headers)
        if key is not None and any(hmac.compare_digest(key.encode(), k) for k in self.keys):
            return key
        raise ApiError(401, "missing or invalid API key", code="invalid_api_key")

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        if self.admin_key is None:
            return False
        key = self._presented(headers)
        return key is not None and hmac.compare_digest(key.encode(), self.admin_key)

    def admin(self, headers: Mapping[str, str]) -> None:
        """Admin endpoints: the admin key; without one configured, any valid client key."""
        if self.admin_key is None:
            self.client(headers)
            return
        if not self.is_admin(headers):
            raise ApiError(403, "this endpoint needs the admin key", code="admin_only")
