"""What the simulator predicts for a real-engine A/B cell, set beside what the engine did.

`bench/real_engine_ab.py --predict` calibrates the fresh engine (`mori calibrate`, or takes
`--preset-file`), then runs `mori sim`'s simulator on the same cell: the trace, token
scale, closed-loop programs, device and host tokens, tick and the variant's settings, wall
duration and seed. This module builds that simulation and the comparison: real beside
predicted per policy, the error of each metric against the bound the calibration issue
set (output tok/s within 10 %, miss share within 5 points, mean TTFT within 25 %, the
mori/smg ratio within 0.05), and the JSON cells `--json` writes.
"""

from __future__ import annotations

import statistics
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml
from rich.markup import escape
from rich.table import Table

from router.replay.trace import load_trace
from router.sim.simulator import SimConfig, simulate

# engine_tok_s: every output token the engine computed in the window, steps still running
# at its end included (real: the engine's forward log; predicted: the simulated engine). The
# answered steps' output_tok_s of a 60-second cell moves by a tenth with one long step
# finishing before the cut or after it; this does not.
ENGINE_TOK_S = "engine_tok_s"
METRICS = ("output_tok_s", ENGINE_TOK_S, "steps_s", "ttft_mean_s", "ttft_p99_s", "hit_device")
METRICS += ("hit_host", "miss")
# the gateway baseline is smg's placement behind another binary: simulated as smg
SIMULATED_AS = {"smg-gateway": "smg"}
TOK_S_BOUND, MISS_POINTS, TTFT_BOUND, RATIO_BOUND = 0.10, 5.0, 0.25, 0.05


def sim_config(name: str, settings: list[str], preset: Path, budget: int, cell: dict) -> SimConfig:
    """The simulated twin of one real run: `cell` holds concurrency, duration_s,
    token_scale, seed, tick_s and cpu_ratio (the engine's --hicache-ratio)."""
    # the real engine keeps its host tier whatever the policy (smg's twin too)
    knobs = {"tick_s": cell["tick_s"], "smg_offload": True}
    for kv in settings:
        key, _, raw = kv.partition("=")
        knobs[key.strip()] = yaml.safe_load(raw)
    return SimConfig(
        policy=SIMULATED_AS.get(name, name),
        preset=str(preset),
        concurrency=cell["concurrency"],
        cpu_ratio=cell["cpu_ratio"],
        duration_s=cell["duration_s"],
        token_scale=cell["token_scale"],
        seed=cell["seed"],
        policy_config=knobs,
        gpu_tokens=budget,
    )


def _simulate(trace: str, config: SimConfig) -> dict:
    result = simulate(load_trace(trace), config)
    extra = result.extra
    return {m: extra[m] if m == ENGINE_TOK_S else getattr(result, m) for m in METRICS} | {
        # the real side samples SGLang's `num_running_reqs`, the decode batch alone
        "running_mean": extra["decoding_mean"]
    }


def predict(trace: Path, configs: dict[str, SimConfig], jobs: int = 2) -> dict[str, dict]:
    """Each policy's simulated metrics (cells in `jobs` processes, niced by the caller)."""
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        futures = {label: pool.submit(_simulate, str(trace), c) for label, c in configs.items()}
        return {label: f.result() for label, f in futures.items()}


def mean_row(runs: list[dict]) -> dict:
    """The real runs' mean of every metric."""
    return {m: statistics.fmean(r[m] for r in runs) for m in METRICS}


def _err(metric: str, real: float, predicted: float) -> tuple[str, bool | None]:
    """The prediction's error as printed, and whether it is within its bound (None:
    the issue sets none for this metric)."""
    if metric in ("hit_device", "hit_host", "miss"):
        points = 100 * (predicted - real)
        return f"{points:+.1f} pt", abs(points) <= MISS_POINTS if metric == "miss" else None
    rel = predicted / real - 1 if real else float("inf")
    bound = {"output_tok_s": TOK_S_BOUND, ENGINE_TOK_S: TOK_S_BOUND, "ttft_mean_s": TTFT_BOUND}.get(
        metric
    )
    return f"{100 * rel:+.0f}%", abs(rel) <= bound if bound is not None else None


def _mark(text: str, ok: bool | None) -> str:
    return text if ok is None else f"{text} {'ok' if ok else 'MISS'}"


def compare(
    title: str, real: dict[str, list[dict]], predicted: dict[str, dict]
) -> tuple[Table, list[str], list[dict]]:
    """Real (mean of runs) beside predicted per policy; the mori/smg ratios; the table,
    its Markdown and the JSON cells (without device_tokens and model_shape)."""
    heads = ["policy", "out tok/s", "engine tok/s", "steps/s", "TTFT mean s", "TTFT p99 s"]
    heads += ["device %", "host %", "miss %"]
    table = Table(title=f"{escape(title)}: real / predicted (error)")
    for h in heads:
        table.add_column(h, justify="left" if h == "policy" else "right")
    md = ["| " + " | ".join(heads) + " |", "|---|" + "---:|" * (len(heads) - 1)]
    cells = []
    for label, runs in real.items():
        got, pred = mean_row(runs), predicted[label]
        row = []
        for m in METRICS:
            scale = 100 if m in ("hit_device", "hit_host", "miss") else 1
            digits = 2 if m in ("steps_s", "ttft_mean_s") else 1
            err, ok = _err(m, got[m], pred[m])
            row.append(
                _mark(f"{scale * got[m]:.{digits}f} / {scale * pred[m]:.{digits}f} ({err})", ok)
            )
        table.add_row(escape(label), *row)
        md.append("| " + " | ".join([label, *row]) + " |")
        cells.append({"policy": label, "real": got, "predicted": pred, "real_runs": runs})
    lines = []
    for base in (b for b in real if b != "mori" and "mori" in real):
        for metric, name in (("output_tok_s", "output tok/s"), (ENGINE_TOK_S, "engine tok/s")):
            ratio_real = mean_row(real["mori"])[metric] / mean_row(real[base])[metric]
            ratio_pred = predicted["mori"][metric] / predicted[base][metric]
            ok = abs(ratio_pred - ratio_real) <= RATIO_BOUND
            lines.append(
                f"mori / {base} {name}: real {ratio_real:.3f}, predicted {ratio_pred:.3f} "
                f"(difference {ratio_pred - ratio_real:+.3f}, {'ok' if ok else 'MISS'})"
            )
            mori = next(c for c in cells if c["policy"] == "mori")
            kind = "ratios" if metric == "output_tok_s" else "engine_ratios"
            mori.setdefault(kind, {})[base] = {"real": ratio_real, "predicted": ratio_pred}
    return table, [*md, "", *(f"- {line}" for line in lines), ""], cells
