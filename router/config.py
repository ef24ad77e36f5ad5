"""Settings of `mori serve`: defaults < YAML file < MORI_<FIELD> env vars < command-line flags.

One pydantic model validates all four sources the same way, so a bad value names its
field and source instead of failing later inside the event loop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from router.policy.base import PolicyConfig
from router.presets import PRESETS

ENV_PREFIX = "MORI_"
# Timers given in trace seconds: `time_scale` divides them (and the KV copy time), so a
# router in front of engines or a replay running X times faster than real time keeps pace.
SCALED_TIMERS = (
    "tick_s",
    "hint_sync_s",
    "lease_s",
    "gate_timeout_s",
    "reconcile_s",
    "hint_ack_timeout_s",
    "aging_s",
    "max_step_wait_s",
    "round_gang_s",
    "start_hold_s",
    "predict_lead_s",
    "predict_grace_s",
    "prefill_s_per_token",  # a price in seconds, like the KV copy time
)
_DEFAULT_PRESET = PRESETS["h100-8b"]  # H100 + Llama-3.1-8B: the replicas MORI was built for
_POLICY = PolicyConfig()


class ConfigError(ValueError):
    """A configuration problem explained in one readable message."""


class ReplicaSpec(BaseModel):
    """One engine replica; token budgets override what `/get_server_info` reports."""

    model_config = ConfigDict(extra="forbid")

    url: str
    gpu_tokens: int | None = Field(default=None, gt=0)
    cpu_tokens: int | None = Field(default=None, ge=0)

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        v = v.strip().rstrip("/")
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"replica url must start with http:// or https://, got {v!r}")
        return v


class RouterConfig(BaseModel):
    """Every knob of the live router (documented in docs/router.md)."""

    model_config = ConfigDict(extra="forbid")

    replicas: list[ReplicaSpec] = Field(default_factory=list)
    # Loopback, like every `mori` server: the router's admin and program APIs need no key
    # until api_keys/admin_key are set. Containers listen on 0.0.0.0 (MORI_HOST in the image).
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    workers: int | None = Field(default=None, ge=1)  # data-plane processes; None: the cores
    policy: str = "mori"
    # Start as a standby: steer nothing until traffic arrives, then take over from the
    # replicas' residency with a fencing epoch (router/owner/leadership.py). Both routers of
    # an active/standby pair run with it (docs/deployment.md).
    standby: bool = False
    # policy knobs: the same names, defaults and meaning as PolicyConfig (docs/policy.md)
    tick_s: float = Field(default=_POLICY.tick_s, gt=0)
    window: int = Field(default=_POLICY.window, ge=1)
    lease_s: float = Field(default=_POLICY.lease_s, gt=0)
    hysteresis: float = Field(default=_POLICY.hysteresis, ge=0, le=1)
    new_program_tokens: int = Field(default=_POLICY.new_program_tokens, gt=0)
    aging_s: float | None = Field(default=_POLICY.aging_s, ge=0)
    displace_margin: float = Field(default=_POLICY.displace_margin, gt=0)
    displace_confidence: float = Field(default=_POLICY.displace_confidence, gt=0, le=1)
    home_wait: float = Field(default=_POLICY.home_wait, ge=0)
    band_waiver_steps: int = Field(default=_POLICY.band_waiver_steps, ge=0)
    max_step_wait_s: float = Field(default=_POLICY.max_step_wait_s, ge=0)
    door_load: float = Field(default=_POLICY.door_load, gt=0)
    door_gain_max: float = Field(default=_POLICY.door_gain_max, ge=1)
    door_gain_min: float = Field(default=_POLICY.door_gain_min, ge=1)
    start_hold_s: float = Field(default=_POLICY.start_hold_s, ge=0)
    critical_ratio: float = Field(default=_POLICY.critical_ratio, ge=0, le=1)
    w_static: float = Field(default=_POLICY.w_static, ge=0)
    gpu_usage_high: float = Field(default=_POLICY.gpu_usage_high, ge=0, le=1)
    gpu_usage_low: float = Field(default=_POLICY.gpu_usage_low, ge=0, le=1)
    reserve_step: float = Field(default=_POLICY.reserve_step, ge=0, le=1)
    reserve_max: float = Field(default=_POLICY.reserve_max, ge=0, le=1)
    round_gang_s: float = Field(default=_POLICY.round_gang_s, ge=0)
    round_yield_x: float = Field(default=_POLICY.round_yield_x, ge=0)
    round_share_min: float = Field(default=_POLICY.round_share_min, ge=0, le=1)
    prefill_s_per_token: float = Field(default=_POLICY.prefill_s_per_token, gt=0)
    attention_tokens: float = Field(default=_DEFAULT_PRESET.attention_tokens, gt=0)
    predict_lead_s: float = Field(default=_POLICY.predict_lead_s, ge=0)
    predict_grace_s: float = Field(default=_POLICY.predict_grace_s, ge=0)
    ewma_alpha: float = Field(default=_POLICY.ewma_alpha, gt=0, le=1)
    hint_alpha: float = Field(default=_POLICY.hint_alpha, ge=0, le=1)
    smg_offload: bool = _POLICY.smg_offload
    # KV copy cost GPU<->host (PolicyConfig.load_s_per_token), the reload price MORI starts
    # from before it has measured the replicas' own
    kv_bytes_per_token: int = Field(default=_DEFAULT_PRESET.kv_bytes_per_token, gt=0)
    pcie_gbps: float = Field(default=_DEFAULT_PRESET.pcie_bytes_s / 1e9, gt=0)  # GB/s, one way
    gate_timeout_s: float = Field(default=_POLICY.gate_timeout_s, gt=0)
    hint_sync_s: float = Field(default=30.0, gt=0)
    hint_ack_timeout_s: float = Field(default=1.0, ge=0)  # a promoted request waits for its hint
    capacity_refresh_s: float = Field(default=60.0, gt=0)
    reconcile_s: float = Field(default=30.0, gt=0)  # tiers checked against /mori/residency
    host_ratio: float = Field(default=2.0, ge=0)  # host tier = ratio x GPU when unreported
    health_interval_s: float = Field(default=5.0, gt=0)
    health_timeout_s: float = Field(default=5.0, gt=0)
    health_failures: int = Field(default=3, ge=1)
    # passive outlier detection (router/engines/outliers.py)
    stall_s: float = Field(default=2.0, gt=0)  # silence with requests in flight -> probe
    probe_timeout_s: float = Field(default=1.5, gt=0)  # the probe's first stage: any answer
    outlier_failures: int = Field(default=5, ge=1)  # failed requests in a row -> eject
    eject_s: float = Field(default=10.0, gt=0)  # first ejection; doubles per repeat
    connect_timeout_s: float = Field(default=5.0, gt=0)
    request_timeout_s: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=2, ge=0)
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)  # whole request body, else 408
    header_timeout_s: float = Field(default=10.0, gt=0)  # a request head, from its first byte
    keepalive_timeout_s: float = Field(default=15.0, gt=0)  # an idle client connection
    worker_parse_bytes: int = Field(default=256 * 1024, ge=0)  # larger bodies: parse process
    api_keys: list[str] = Field(default_factory=list)
    admin_key: str | None = None
    log_level: str = "info"
    time_scale: float = Field(default=1.0, gt=0)  # divides SCALED_TIMERS (set at load)

    @property
    def load_s_per_token(self) -> float:
        """Wall seconds to copy one token's KV one way over PCIe (as the simulator's preset,
        divided by the time scale)."""
        return self.kv_bytes_per_token / (self.pcie_gbps * 1e9) / self.time_scale

    def policy_config(self) -> PolicyConfig:
        """Every PolicyConfig knob, from the field of the same name (load_s_per_token is
        derived from kv_bytes_per_token and pcie_gbps)."""
        knobs = {
            f.name: getattr(self, f.name) for f in fields(PolicyConfig) if f.name in POLICY_KNOBS
        }
        return PolicyConfig(**knobs, load_s_per_token=self.load_s_per_token)

    @field_validator("replicas", mode="before")
    @classmethod
    def _replica_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [u for u in v.split(",") if u.strip()]
        if isinstance(v, list):
            return [{"url": u} if isinstance(u, str) else u for u in v]
        return v

    @field_validator("api_keys", mode="before")
    @classmethod
    def _key_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _scale_timers(self) -> RouterConfig:
        """The timers were given in trace seconds; from here on they are wall seconds."""
        for name in SCALED_TIMERS if self.time_scale != 1 else ():
            value = getattr(self, name)
            if value is not None:  # aging_s None: the policy's default, scaled there
                setattr(self, name, value / self.time_scale)
        return self

    @model_validator(mode="after")
    def _distinct_replicas(self) -> RouterConfig:
        urls = [r.url for r in self.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError("replica urls must be distinct")
        return self


POLICY_KNOBS = {f.name for f in fields(PolicyConfig)} - {"load_s_per_token"}


def _from_file(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of settings")
    return data


def _from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """MORI_<FIELD> for every field; values are YAML scalars/lists, lists also comma-separated."""
    out: dict[str, Any] = {}
    for name in RouterConfig.model_fields:
        raw = env.get(ENV_PREFIX + name.upper())
        if raw is None or raw == "":
            continue
        out[name] = _env_value(name, raw)
    return out


def _env_value(name: str, raw: str) -> Any:
    """A setting's value from text: YAML, except that plain strings stay strings."""
    if name in ("replicas", "api_keys", "admin_key", "host", "policy", "log_level"):
        return raw if not raw.lstrip().startswith(("[", "{")) else yaml.safe_load(raw)
    return yaml.safe_load(raw)


def parse_settings(items: list[str]) -> dict[str, Any]:
    """`--set FIELD=VALUE` flags: values are read as YAML, like MORI_<FIELD> env vars."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep or name not in RouterConfig.model_fields:
            raise ConfigError(f"--set takes FIELD=VALUE with a known setting, got {item!r}")
        out[name] = _env_value(name, raw)
    return out


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> RouterConfig:
    """Merge file, env and overrides (flags; None values ignored) and validate once."""
    merged = _from_file(path)
    merged.update(_from_env(os.environ if env is None else env))
    merged.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        config = RouterConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(_explain(e)) from None
    if not config.replicas:
        raise ConfigError(
            "no replicas configured: pass --replicas URL[,URL...], set MORI_REPLICAS, "
            "or list `replicas:` in the config file"
        )
    return config


def _explain(error: ValidationError) -> str:
    lines = ["invalid router configuration:"]
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown setting" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)
