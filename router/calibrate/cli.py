"""`mori calibrate --endpoint URL --out FILE`: fit the replica cost model to a live replica.

Times the replica with a fixed probe schedule (router/calibrate/probes.py), fits the cost
model's prices to the timings by least squares with the model itself as the forward model
(router/calibrate/fit.py), prints measured against fitted for every probe, plots them, and
writes a preset file (router/presets.py) that `mori sim`, `mori emulate` and `mori
demo` take with `--preset-file FILE`. The file keeps the date, the endpoint's
`/get_server_info`, which prices were measured (and which held at an estimate) and the
residuals of every timed call.

Against `mori emulate`, which runs the cost model of a named preset, the fit should give
back that preset's prices: the table then shows them side by side (the self-check).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
from dataclasses import asdict
from datetime import date
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
from rich.table import Table

from router.calibrate.fit import NAMES, SHARES, FitResult, Prices, fit, observed
from router.calibrate.forwards import Forward, log_line, read_forwards
from router.calibrate.probes import (
    SPAN_CAP,
    SPAN_SHARE,
    Call,
    Endpoint,
    Probe,
    Timing,
    measure,
    schedule,
    span_for,
)
from router.presets import GPU, ModelSpec, Preset, get_preset, write_preset

# fitted price -> the preset term it sets, and its unit as printed
TERMS = {
    "token_s": ("flops_s", "s/token"),
    "pair_s": ("attn_eff", "s/pair"),
    "prefix_attention": ("prefix_attention", "share"),
    "prefill_overhead_s": ("prefill_overhead_s", "s/forward"),
    "kv_s": ("kv_read_eff", "s/token/iteration"),
    "weights_s": ("bytes_s", "s/iteration"),
    "step_overhead_s": ("step_overhead_s", "s/iteration"),
    "seq_overhead_s": ("seq_overhead_s", "s/request/iteration"),
    "load_s": ("pcie_bytes_s", "s/token"),
    "load_serial": ("load_serial", "share"),
}


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint", help="the replica's base URL (default: none; this or --refit)"
    )
    parser.add_argument(
        "--refit",
        type=Path,
        help="fit the probes a preset file recorded again (no endpoint needed): after a change "
        "to the cost model (default: none)",
    )
    parser.add_argument("--out", required=True, type=Path, help="preset file to write (JSON)")
    parser.add_argument("--name", help="the preset's name (default: from the engine and model)")
    parser.add_argument(
        "--span",
        type=int,
        help=f"longest probe prompt in tokens (default: {SPAN_SHARE:g} x the device pool, "
        f"at most {SPAN_CAP})",
    )
    parser.add_argument("--reps", type=int, default=2, help="repetitions of the schedule")
    parser.add_argument(
        "--decode-tokens", type=int, default=32, help="tokens each decode probe generates"
    )
    parser.add_argument(
        "--model-config",
        type=Path,
        help="the model's config.json (default: the one under the engine's model_path)",
    )
    parser.add_argument("--device", help="device name to record (default: from the engine)")
    parser.add_argument(
        "--hold",
        default="",
        help="comma list of prices to keep at the base preset's instead of fitting: "
        + ", ".join(NAMES),
    )
    parser.add_argument("--plot", type=Path, help="measured-vs-fitted plot (default: OUT.png)")
    parser.add_argument(
        "--forward-log",
        type=Path,
        help="the engine's own forward timings over the probes (the MORI_FORWARD_LOG path the "
        "patched engine was started with; read after the probes), fitted beside them "
        "(default: none; with --refit, the forwards the file recorded)",
    )


def run(args: argparse.Namespace) -> int:
    console = Console()
    hold = [h.strip() for h in args.hold.split(",") if h.strip()]
    bad = [h for h in hold if h not in NAMES]
    if (
        bad
        or args.reps < 1
        or args.decode_tokens < 2
        or (args.endpoint is None) == (args.refit is None)
    ):
        why = f"unknown price {bad[0]!r}" if bad else "--reps >= 1 and --decode-tokens >= 2"
        if (args.endpoint is None) == (args.refit is None):
            why = "give --endpoint URL (time a replica) or --refit FILE (its recorded probes)"
        console.print(f"[red]mori calibrate: {why}[/red]")
        return 2
    try:
        if args.refit is not None:
            described, probes, timings, forwards = recorded(args.refit)
        else:
            described, probes, timings = asyncio.run(_measure(args, console))
            forwards = []
        if args.forward_log is not None:
            forwards = read_forwards(args.forward_log)
        base, host_pool = base_preset(described, args)
    except (OSError, ValueError, RuntimeError) as e:  # httpx errors are OSErrors' kin below
        console.print(f"[red]mori calibrate: {escape(str(e))}[/red]")
        return 2
    info = described["server_info"]
    probes, timings = usable(console, probes, timings, client_clock=not info.get("emulated"))
    with console.status("fitting the prices to the probes (least squares, ~1 min on 2 CPUs)"):
        result = fit(probes, timings, base, host_pool, hold, forwards)
    truth = Prices.of(get_preset(str(info["preset"]))) if info.get("emulated") else None
    print_fit(console, probes, result, truth)
    endpoint = args.endpoint or json.loads(args.refit.read_text())["engine"]["endpoint"]
    preset = calibrated_preset(args, described, base, result, endpoint)
    plot = args.plot or args.out.with_suffix(".png")
    plot_fit(plot, probes, result)
    write_preset(
        args.out,
        preset,
        description=f"measured by mori calibrate on {endpoint}",
        date=date.today().isoformat(),
        engine={"endpoint": endpoint, **described},
        fit=fit_record(probes, timings, result),
    )
    console.print(f"wrote {args.out} and {plot}")
    return 0


async def _measure(
    args: argparse.Namespace, console: Console
) -> tuple[dict, list[Probe], list[list[Timing]]]:
    import httpx

    endpoint = Endpoint(args.endpoint)
    try:
        described = await endpoint.describe()
        info = described["server_info"]
        pool = int(described.get("device_capacity_tokens") or info["max_total_num_tokens"])
        host = int(described.get("host_capacity_tokens") or 0) > 0
        span = args.span or span_for(pool)
        probes = schedule(span, pool, args.reps, args.decode_tokens, host)
        columns = ("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn())
        with Progress(*columns, TimeElapsedColumn(), console=console) as progress:
            task = progress.add_task("warming up", total=len(probes))

            def done(i: int, probe: Probe, _: list[Timing]) -> None:
                nxt = probes[i + 1] if i + 1 < len(probes) else None
                text = f"{nxt.kind} {nxt.label}" if nxt else "fitting"
                progress.update(task, advance=1, description=escape(text))

            hints = "host_capacity_tokens" in described
            timings = await measure(endpoint, probes, done, hints)
        return described, probes, timings
    except httpx.HTTPError as e:
        raise RuntimeError(f"{args.endpoint}: {type(e).__name__}: {e}") from None
    finally:
        await endpoint.close()


def usable(
    console: Console, probes: list[Probe], timings: list[list[Timing]], client_clock: bool
) -> tuple[list[Probe], list[list[Timing]]]:
    """The probes that measured something: a decode probe whose calls did not decode
    together (no window in which all of them ran) is left out, and said. Timed on the
    client's clock (a real engine), probes whose calls left after their blocker had
    answered are kept, and said: their HTTP path is in what the fit takes for engine time
    (an emulator's engine clock times arrivals, so there it is not)."""
    keep = [i for i, (p, t) in enumerate(zip(probes, timings, strict=True)) if observed(p, t) > 0]
    for i in sorted(set(range(len(probes))) - set(keep)):
        console.print(
            f"[yellow]left out probe {i} ({probes[i].kind} {probes[i].label}): "
            "its calls never ran together[/yellow]"
        )
    late = [i for i in keep if any(t.sent >= timings[i][0].first for t in timings[i][1:])]
    if late and client_clock:
        console.print(
            f"[yellow]{len(late)} of {len(keep)} probes ({', '.join(map(str, late))}): a call "
            "left after its blocker's first token (a busy machine, or bodies slower to send "
            "than the blocker's prefill); the fit replays the calls as they were sent, but an "
            "engine timed on the client's clock then counts their HTTP path as its own time: "
            "calibrate again on a quieter machine if the residuals are large[/yellow]"
        )
    return [probes[i] for i in keep], [timings[i] for i in keep]


def base_preset(described: dict, args: argparse.Namespace) -> tuple[Preset, int]:
    """The preset the fit starts from: the model's shape, the engine's chunk size and
    pools, and (for prices the probes cannot reach) estimates; and the host pool."""
    info = described["server_info"]
    pool = int(described.get("device_capacity_tokens") or info["max_total_num_tokens"])
    host_pool = int(described.get("host_capacity_tokens") or 0)
    if info.get("emulated"):
        emulated = get_preset(str(info["preset"]))
        return dataclasses.replace(emulated, kv_tokens=pool), host_pool
    config_path = args.model_config or Path(str(info.get("model_path", ""))) / "config.json"
    try:
        config = json.loads(Path(config_path).read_text())
    except OSError as e:
        raise ValueError(
            f"{config_path}: cannot read the model's config ({e.strerror}); pass --model-config"
        ) from None
    model = ModelSpec.from_config(config, Path(str(info.get("model_path", "model"))).name)
    device = GPU(
        name=args.device or device_name(info, args.endpoint or ""),
        hbm_bytes=0.0,
        hbm_bytes_s=100e9,
        bf16_flops=1e12,
        pcie_bytes_s=10e9,
        pcie_source="estimate: a placeholder, held only when the probes cannot time a load",
    )
    chunk = int(info.get("chunked_prefill_size") or 0)
    preset = Preset(
        "calibrating", device, model, mfu=1.0, bw_eff=1.0, kv_tokens=pool,
        chunk_tokens=chunk if chunk > 0 else 1 << 30,
    )  # fmt: skip
    return preset, host_pool


def device_name(info: dict, endpoint: str) -> str:
    """The engine's device; for a CPU engine on this machine, the processor and cores."""
    device = str(info.get("device") or "gpu")
    if device == "cpu" and urlparse(endpoint).hostname in ("127.0.0.1", "localhost"):
        model = next(
            (line.split(":", 1)[1].strip() for line in _cpuinfo() if line.startswith("model name")),
            platform.processor() or "unknown processor",
        )
        return f"cpu: {model}, {os.cpu_count()} cores"
    return device


def _cpuinfo() -> list[str]:
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def calibrated_preset(
    args: argparse.Namespace, described: dict, base: Preset, result: FitResult, endpoint: str
) -> Preset:
    """The fitted prices as a preset, each price's source said."""
    info = described["server_info"]
    engine = "mori emulate" if info.get("emulated") else f"SGLang {info.get('version', '?')}"
    stamp = f"mori calibrate, {engine} at {endpoint}, {date.today().isoformat()}"
    base_sources = dict(base.sources)
    sources = {}
    loose = result.undetermined()
    for name in NAMES:
        term = TERMS[name][0]
        held = base_sources.get(term, "estimate: held at the base preset's value")
        sources[term] = f"measured: {stamp}" if name in result.free else held
        if name in loose:
            sources[term] += "; not pinned down by the probes (large spread)"
    name = args.name or f"{base.model.name}-{info.get('device', 'engine')}-calibrated"
    device = base.gpu.name if not info.get("emulated") else f"{base.gpu.name} (emulated)"
    return result.prices.preset(base, name, device, sources)


def fit_record(probes: list[Probe], timings: list[list[Timing]], result: FitResult) -> dict:
    """What the preset file keeps of the fit: prices, residuals, and every probe with its
    calls' timings, measured and fitted (`--refit` fits them again)."""
    rows = [
        {
            "probe": asdict(probe),
            "label": probe.label,
            "measured_s": round(result.measured[i], 6),
            "fitted_s": round(result.fitted[i], 6),
            "timings": [asdict(t) for t in times],
            "fitted_timings": [asdict(t) for t in model],
        }
        for i, (probe, times, model) in enumerate(zip(probes, timings, result.model, strict=True))
    ]
    return {
        "prices": asdict(result.prices),
        "fitted": list(result.free),
        "spread": result.spread,
        "undetermined": result.undetermined(),
        "residuals": result.residuals(probes),
        "probes": rows,
        "forwards": [log_line(f) for f in result.forwards],  # as the engine logged them
    }


def recorded(path: Path) -> tuple[dict, list[Probe], list[list[Timing]], list[Forward]]:
    """The endpoint description, probes, timings and engine forwards a preset file recorded."""
    doc = json.loads(path.read_text())
    try:
        rows = doc["fit"]["probes"]
        probes = [
            Probe(
                kind=r["probe"]["kind"],
                blocker=Call(**r["probe"]["blocker"]),
                calls=tuple(Call(**c) for c in r["probe"]["calls"]),
                setup=tuple(Call(**c) for c in r["probe"]["setup"]),
                idle=r["probe"]["idle"],
            )
            for r in rows
        ]
        timings = [[Timing(**t) for t in r["timings"]] for r in rows]
        engine = {k: v for k, v in doc["engine"].items() if k != "endpoint"}
        forwards = [Forward.of(line) for line in doc["fit"].get("forwards", [])]
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path}: no recorded probes ({type(e).__name__}: {e})") from None
    return engine, probes, timings, forwards


def print_fit(
    console: Console, probes: list[Probe], result: FitResult, truth: Prices | None
) -> None:
    """Measured against fitted for every probe, then the prices (and the emulated
    preset's, with the error, for a self-check)."""
    table = Table(
        title="measured / fitted per probe (first token after the blocker's; decode: s/iteration)"
    )
    for head in ("#", "kind", "prompt", "measured s", "fitted s", "error"):
        table.add_column(head, justify="left" if head in ("kind", "prompt") else "right")
    for i, probe in enumerate(probes):
        per = max(1, probe.calls[0].output - 1) if probe.kind == "decode" else 1
        got, fit_ = result.measured[i] / per, result.fitted[i] / per
        error = f"{100 * (fit_ / got - 1):+.1f}%"
        table.add_row(str(i), probe.kind, probe.label, f"{got:.5f}", f"{fit_:.5f}", error)
    console.print(table)
    prices = Table(title="fitted prices")
    heads = ["price", "unit", "fitted", "+-", "preset term"]
    heads += ["emulated preset's", "error"] if truth is not None else []
    for head in heads:
        left = head in ("price", "unit", "preset term")
        prices.add_column(head, justify="left" if left else "right")
    for name in NAMES:
        value = getattr(result.prices, name)
        term, unit = TERMS[name]
        spread = result.spread.get(name)
        share = name in SHARES or value == 0
        err = "" if spread is None else f"{spread:.2g}" if share else f"{100 * spread:.0f}%"
        cells = [name, unit, f"{value:.4g}" + ("" if name in result.free else " (held)"), err, term]
        if truth is not None:
            true = getattr(truth, name)
            err = f"{100 * (value / true - 1):+.2f}%" if true else f"{value:.2g} abs"
            cells += [f"{true:.4g}", err]
        prices.add_row(*cells)
    console.print(prices)
    res = result.residuals(probes)
    console.print(
        "relative error of the fitted probes: "
        + ", ".join(f"{k} {100 * v:.1f}%" for k, v in res.items())
    )


def plot_fit(path: Path, probes: list[Probe], result: FitResult) -> Path:
    """Measured against fitted, one colour per kind of probe (a decode probe per
    iteration), the diagonal for reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 6))
    for kind in dict.fromkeys(p.kind for p in probes):
        mine = [i for i, p in enumerate(probes) if p.kind == kind]
        per = [max(1, probes[i].calls[0].output - 1) if kind == "decode" else 1 for i in mine]
        ax.scatter(
            [result.measured[i] / n for i, n in zip(mine, per, strict=True)],
            [result.fitted[i] / n for i, n in zip(mine, per, strict=True)],
            label=kind,
            s=16,
        )
    lo, hi = ax.get_xlim()
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8)
    ax.set(xscale="log", yscale="log", xlabel="measured s", ylabel="fitted s")
    ax.set_title("calibration: time to first token, decode s/iteration")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
