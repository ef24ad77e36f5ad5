"""The KV data-path kernels measured: block transfer, diff encode, fused restore, recompute.

    python3 bench/kernels.py                       # on CUDA when there is one, else the CPU
    python3 bench/kernels.py --md bench/results/2026-11-24-kernels-cpu.md --json out/k.json
    python3 bench/kernels.py --write-preset        # CUDA: the measured reload into presets.py

CPU: the kernels run in Triton's interpreter, so the record is correctness (kernel against
its torch reference: bit for bit, or the one-ulp bound for rotated keys) and bytes moved;
the interpreter's times are Python's speed, shown only beside the reference's.
CUDA: GB/s of the block transfer against a pinned `copy_` of the same bytes and against
HiCache's transfer kernels (`sgl_kernel.kvcacheio`, where installed), fused against dense
restore latency, and transfer against recompute for one program of N tokens (Tokencake
Fig. 13). Recompute is measured on a random-weight decoder layer with the model's real
shapes (times its layer count) and modelled by the simulator's FLOP model
(`router.sim.model.CostModel.prefill_s`); the transfer is measured on CUDA and modelled
from the preset's PCIe figure (and its source) everywhere.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.preset_writer import PRESETS as PRESETS_FILE  # noqa: E402
from bench.preset_writer import gpu_constant, rewrite  # noqa: E402
from kernels import costs  # noqa: E402
from kernels.diff import Chunk, apply, block_errors, block_errors_reference, encode  # noqa: E402
from kernels.planes import HOST_LAYOUTS, Planes, device_pool, host_buffer, host_planes  # noqa: E402
from kernels.restore import MirrorRestore, restore, restore_dense  # noqa: E402
from kernels.rope import rope_inv_freq, shift_table  # noqa: E402
from kernels.transfer import PageMove, copy_rows_reference, hint_rows, move, moved_bytes  # noqa: E402
from router.presets import PRESETS, ModelSpec, Preset  # noqa: E402
from router.sim.model import CostModel  # noqa: E402

# config.json intermediate_size and rope_theta of the dense models a decoder layer is built for
INTERMEDIATE = {"Llama-3.1-8B": 14336, "Llama-3.1-70B": 28672}
ROPE_THETA = {"Llama-3.1-8B": 500_000.0, "Llama-3.1-70B": 500_000.0}


@dataclass(frozen=True)
class Setup:
    preset: Preset
    tokens: int  # the program moved, restored and recomputed
    programs: int  # one hint moves `tokens` split over this many programs
    page_size: int
    block_size: int  # diff blocks (TokenDance: 32 tokens)
    compare_tokens: int  # the program of the transfer-vs-recompute comparison
    recompute_tokens: int  # what the random-weight layer stack recomputes
    dtype: torch.dtype
    device: torch.device
    reps: int

    @property
    def model(self) -> ModelSpec:
        return self.preset.model


@dataclass
class Row:
    section: str
    what: str
    seconds: float | None = None
    nbytes: int | None = None
    check: str = ""
    note: str = ""

    @property
    def gb_s(self) -> float | None:
        return self.nbytes / self.seconds / 1e9 if self.nbytes and self.seconds else None


@dataclass
class Record:
    setup: dict
    rows: list[Row] = field(default_factory=list)
    ratios: dict[str, float] = field(default_factory=dict)


def timed(fn: Callable[[], object], setup: Setup) -> float:
    """Median seconds of `fn` over `setup.reps` runs after one warm-up (compile, caches)."""
    fn()
    times = []
    for _ in range(setup.reps):
        if setup.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _random(shape: tuple[int, ...], setup: Setup, seed: int) -> torch.Tensor:
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return values.to(dtype=setup.dtype, device=setup.device)


def _pool(setup: Setup, slots: int) -> Planes:
    m = setup.model
    return device_pool(m.layers, slots, m.kv_heads, m.head_dim, setup.dtype, str(setup.device))


def _verdict(same: bool) -> str:
    return "bit-exact" if same else "MISMATCH"


# --- transfer ----------------------------------------------------------------------------------
def _hint(setup: Setup) -> tuple[list[PageMove], int]:
    """`programs` programs sharing `tokens` tokens on scattered pages; the pool pages needed."""
    pages = setup.tokens // setup.page_size
    generator = torch.Generator().manual_seed(1)
    device_pages = torch.randperm(2 * pages, generator=generator)[:pages]
    host_pages = torch.randperm(pages, generator=generator)
    split = [len(c) for c in torch.arange(pages).chunk(setup.programs)]
    pairs = zip(device_pages.split(split), host_pages.split(split), strict=True)
    return [PageMove(d, h) for d, h in pairs], 2 * pages


Copies = tuple[Callable[[], None], Callable[[], None]]


def _hicache(host: torch.Tensor, layout: str, pool: Planes, planes: Planes, rows) -> Copies | str:
    """HiCache's own offload and load (`sgl_kernel.kvcacheio`), called as SGLang's
    MHATokenToKVPoolHost calls them with io_backend="kernel" when it has no JIT kernel (its
    0.5.23 CUDA default is the JIT `sglang.kernels.ops.kvcache.hicache`, not timed here);
    the reason where not installed."""
    try:
        from sgl_kernel import kvcacheio
    except ImportError as error:
        return f"sgl_kernel not installed ({error.msg})"
    layers, item = pool.layers, pool.row_elements * pool.item_bytes
    device_rows, host_rows = rows

    def pointers(views) -> torch.Tensor:
        return torch.tensor([v.data_ptr() for v in views], dtype=torch.uint64, device="cuda")

    dk, dv = pointers(pool.views[:layers]), pointers(pool.views[layers:])
    hk, hv = pointers(planes.views[:layers]), pointers(planes.views[layers:])
    k, v = pool.views[:layers], pool.views[layers:]
    if layout == "layer_first":

        def down() -> None:
            kvcacheio.transfer_kv_all_layer(dk, hk, dv, hv, device_rows, host_rows, item, layers)

        def up() -> None:
            for i in range(layers):
                src_k, src_v = planes.views[i], planes.views[layers + i]
                kvcacheio.transfer_kv_per_layer(
                    src_k, k[i], src_v, v[i], host_rows, device_rows, item
                )

        return down, up

    def down_pf() -> None:
        kvcacheio.transfer_kv_all_layer_lf_pf(
            dk, host[0], dv, host[1], device_rows, host_rows, item, item * layers, layers
        )

    def up_pf() -> None:
        for i in range(layers):
            kvcacheio.transfer_kv_per_layer_pf_lf(
                host[0], k[i], host[1], v[i], host_rows, device_rows, i, item, item * layers
            )

    return down_pf, up_pf


def _same_pages(pool: Planes, back: Planes, moves: list[PageMove], setup: Setup) -> bool:
    rows, _ = hint_rows(moves, setup.page_size, setup.device)
    return all(torch.equal(a[rows], b[rows]) for a, b in zip(pool.views, back.views, strict=True))


def _layout_rows(setup: Setup, pool: Planes, moves: list[PageMove], layout: str) -> list[Row]:
    """One hint's offload and load in one host layout: kernel, torch reference, HiCache; each
    path's result checked against the reference offload and the original pages."""
    m, size = setup.model, setup.page_size
    pinned = setup.device.type == "cuda"
    shape = (layout, m.layers, setup.tokens, m.kv_heads, m.head_dim, setup.dtype, pinned)
    host, expected = host_buffer(*shape), host_buffer(*shape)
    planes, back = host_planes(host, layout), _pool(setup, pool.rows)
    reference = copy_rows_reference
    nbytes = move(pool, host_planes(expected, layout), moves, size, "offload", reference)
    runs = {
        "offload": lambda: move(pool, planes, moves, size, "offload"),
        "load": lambda: move(back, planes, moves, size, "load"),
        "offload (torch reference)": lambda: move(pool, planes, moves, size, "offload", reference),
        "load (torch reference)": lambda: move(back, planes, moves, size, "load", reference),
    }
    rows = []
    if pinned:
        hicache = _hicache(host, layout, pool, planes, hint_rows(moves, size, setup.device))
        if isinstance(hicache, str):
            rows.append(Row("transfer", f"{layout} HiCache kernels", note=hicache))
        else:
            runs |= {"HiCache offload": hicache[0], "HiCache load": hicache[1]}
    for what, run in runs.items():
        loading = "load" in what.split()  # "load", "HiCache load"; not "offload"
        for view in back.views if loading else [host]:
            view.zero_()  # each path's own result is checked
        seconds = timed(run, setup)
        same = _same_pages(pool, back, moves, setup) if loading else torch.equal(host, expected)
        rows.append(Row("transfer", f"{layout} {what}", seconds, nbytes, _verdict(same)))
    return rows


def _copy_baseline(setup: Setup, nbytes: int) -> list[Row]:
    """The same bytes as one contiguous pinned copy_ each way: the link's best case."""
    device = torch.empty(nbytes, dtype=torch.uint8, device=setup.device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    down = timed(lambda: host.copy_(device, non_blocking=True), setup)
    up = timed(lambda: device.copy_(host, non_blocking=True), setup)
    return [
        Row("transfer", "pinned copy_ device->host", down, nbytes),
        Row("transfer", "pinned copy_ host->device", up, nbytes),
    ]


def transfer_rows(setup: Setup) -> list[Row]:
    """One hint's offload and load, per host layout, and the pinned copy_ of the same bytes."""
    moves, pool_pages = _hint(setup)
    pool = _pool(setup, pool_pages * setup.page_size)
    for i, view in enumerate(pool.views):
        view.copy_(_random(tuple(view.shape), setup, seed=100 + i))
    rows = [row for layout in HOST_LAYOUTS for row in _layout_rows(setup, pool, moves, layout)]
    if setup.device.type == "cuda":
        rows += _copy_baseline(setup, moved_bytes(pool, setup.tokens))
    return rows


# --- diff and restore --------------------------------------------------------------------------
def _family(setup: Setup) -> tuple[Chunk, Chunk]:
    """A master and a mirror leaving it in MIRROR_DIFF_SHARE of its (layer, block)s."""
    m = setup.model
    master = Chunk(_random((2, m.layers, setup.tokens, m.kv_heads, m.head_dim), setup, seed=7))
    mirror = master.kv.clone()
    blocks = master.blocks(setup.block_size)
    touched = max(1, round(costs.MIRROR_DIFF_SHARE * m.layers * blocks))
    picks = torch.randperm(m.layers * blocks, generator=torch.Generator().manual_seed(3))
    for pick in picks[:touched].tolist():
        layer, block = divmod(pick, blocks)
        mirror[:, layer, block * setup.block_size] += 1.0
    return master, Chunk(mirror)


def diff_rows(setup: Setup) -> list[Row]:
    """Encode a mirror against its master: the kernel's block scan, then the reference's."""
    master, mirror = _family(setup)
    errors = block_errors(master, mirror, setup.block_size)
    diff = encode(master, mirror, setup.block_size)
    exact = torch.equal(errors, block_errors_reference(master, mirror, setup.block_size))
    rebuilt = torch.equal(apply(master, diff).kv, mirror.kv)
    dense = master.kv.numel() * master.kv.element_size()
    note = f"{diff.count} blocks; diff {diff.nbytes / dense:.1%} of the dense cache"
    size = setup.block_size
    kernel = timed(lambda: encode(master, mirror, size), setup)
    reference = timed(lambda: encode(master, mirror, size, errors=block_errors_reference), setup)
    return [
        Row("diff", "encode", kernel, 2 * dense, _verdict(exact and rebuilt), note),
        Row("diff", "encode (torch reference scan)", reference, 2 * dense),
    ]


def _ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest gap between two tensors in units of the last place of `b`'s values."""
    gap = (a.float() - b.float()).abs()
    unit = b.float().abs().clamp_min(torch.finfo(b.dtype).tiny) * torch.finfo(b.dtype).eps
    return (gap / unit).max().item() if gap.numel() else 0.0


def restore_rows(setup: Setup) -> list[Row]:
    """A mirror restored 5,000 positions later into scattered pool rows, fused and dense.

    The angles use the unscaled inv_freq of the model's rope_theta (Llama-3.1 rescales its
    frequencies, which changes the values, not the work)."""
    m = setup.model
    master, mirror = _family(setup)
    diff = encode(master, mirror, setup.block_size)
    old = torch.arange(setup.tokens)
    inv_freq = rope_inv_freq(m.head_dim, ROPE_THETA.get(m.name, 1_000_000.0))
    cos, sin = (t.to(setup.device) for t in shift_table(old, old + 5000, inv_freq))
    fused_pool, dense_pool = _pool(setup, 2 * setup.tokens), _pool(setup, 2 * setup.tokens)
    slots = torch.randperm(2 * setup.tokens, generator=torch.Generator().manual_seed(5))
    slots = slots[: setup.tokens].to(setup.device)
    args = (master, diff, cos, sin, m.head_dim)
    fused = timed(lambda: restore(MirrorRestore(*args, fused_pool, slots)), setup)
    dense = timed(lambda: restore_dense(MirrorRestore(*args, dense_pool, slots)), setup)
    pairs = list(zip(fused_pool.views, dense_pool.views, strict=True))
    v_exact = all(torch.equal(a, b) for a, b in pairs[m.layers :])
    k_gap = max(_ulps(a, b) for a, b in pairs[: m.layers])
    check = f"V bit-exact, K within {k_gap:.0f} ulp" if v_exact else "MISMATCH"
    nbytes = master.kv.numel() * master.kv.element_size()
    per_token = f"{fused / setup.tokens * 1e6:.3f} vs {dense / setup.tokens * 1e6:.3f} us/token"
    return [
        Row("restore", "fused (one kernel)", fused, nbytes, check, per_token),
        Row("restore", "dense (mirror materialised)", dense, nbytes),
    ]


# --- transfer vs recompute ---------------------------------------------------------------------
class DecoderLayer:
    """One Llama-style decoder layer (RMSNorm, GQA attention, SwiGLU) with random weights and
    the model's real shapes: what recomputing a program's KV runs, layer by layer."""

    def __init__(self, model: ModelSpec, inter: int, setup: Setup) -> None:
        hidden = model.q_heads * model.head_dim
        kv = model.kv_heads * model.head_dim
        shapes = {
            "q": (hidden, hidden),
            "k": (kv, hidden),
            "v": (kv, hidden),
            "o": (hidden, hidden),
            "gate": (inter, hidden),
            "up": (inter, hidden),
            "down": (hidden, inter),
        }
        self.w = {n: _random(s, setup, seed=i) * 0.02 for i, (n, s) in enumerate(shapes.items())}
        self.model = model

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        f, m, w = torch.nn.functional, self.model, self.w
        tokens = x.shape[0]

        def heads(h: torch.Tensor, name: str, count: int) -> torch.Tensor:
            return f.linear(h, w[name]).view(tokens, count, m.head_dim).transpose(0, 1)

        h = f.rms_norm(x, (x.shape[-1],))
        q, k, v = heads(h, "q", m.q_heads), heads(h, "k", m.kv_heads), heads(h, "v", m.kv_heads)
        attn = f.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + f.linear(attn.transpose(0, 1).reshape(tokens, -1), w["o"])
        h = f.rms_norm(x, (x.shape[-1],))
        return x + f.linear(f.silu(f.linear(h, w["gate"])) * f.linear(h, w["up"]), w["down"])


def recompute_rows(setup: Setup, transfer: list[Row]) -> tuple[list[Row], dict[str, float]]:
    """One program of `compare_tokens` tokens: move it out and back, or compute its KV again.
    On CUDA the transfer is also measured, when the transfer rows moved that program."""
    m, model, n = setup.model, CostModel(setup.preset), setup.compare_tokens
    moved, computed = 2 * model.load_s(n), model.prefill_s(n, 0)
    out = f"transfer {n} tokens out + back"
    pcie = setup.preset.gpu.pcie_source.split(";")[0]
    rows = [
        Row("vs recompute", f"{out} (PCIe model)", moved, 2 * n * m.kv_bytes_per_token, note=pcie),
        Row(
            "vs recompute",
            f"recompute {n} tokens (FLOP model)",
            computed,
            note=f"preset {setup.preset.name}: BF16 peak x mfu {setup.preset.mfu}",
        ),
    ]
    ratios = {"recompute / transfer (models)": computed / moved}
    if setup.device.type == "cuda" and setup.tokens == n:  # the transfer rows moved this program
        kernel = sum(
            r.seconds for r in transfer if r.what in ("layer_first offload", "layer_first load")
        )
        rows.append(Row("vs recompute", f"{out} (kernel, measured)", kernel))
        ratios["recompute (FLOP model) / transfer (kernel, measured)"] = computed / kernel
    if m.name in INTERMEDIATE:
        x = _random((setup.recompute_tokens, m.q_heads * m.head_dim), setup, seed=9)
        layer = DecoderLayer(m, INTERMEDIATE[m.name], setup)
        seconds = timed(lambda: layer(x), setup) * m.layers
        what = f"recompute {len(x)} tokens (random-weight layer x {m.layers}, measured)"
        rows.append(Row("vs recompute", what, seconds, note=f"on {setup.device}"))
    paper = costs.RECOMPUTE_4096_BLOCKS.seconds / costs.TRANSFER_4096_BLOCKS.seconds
    ratios["recompute / transfer (Tokencake Fig. 13, paper)"] = paper
    return rows, ratios


# --- report ------------------------------------------------------------------------------------
def ratios_of(rows: list[Row]) -> dict[str, float]:
    """Side-by-side ratios of what was timed (above 1: the first is slower)."""
    t = {r.what: r.seconds for r in rows if r.seconds}
    pairs = {"dense / fused restore": ("dense (mirror materialised)", "fused (one kernel)")}
    for layout in HOST_LAYOUTS:
        for d in ("offload", "load"):
            kernel = f"{layout} {d}"
            pairs[f"torch reference / kernel, {kernel}"] = (f"{kernel} (torch reference)", kernel)
            pairs[f"HiCache / kernel, {kernel}"] = (f"{layout} HiCache {d}", kernel)
    for d, link in (("offload", "device->host"), ("load", "host->device")):
        pairs[f"kernel / pinned copy_, layer_first {d}"] = (
            f"layer_first {d}",
            f"pinned copy_ {link}",
        )
    out = {name: t[a] / t[b] for name, (a, b) in pairs.items() if a in t and b in t}
    paper = costs.RESTORE_DENSE_PER_MIRROR.seconds / costs.RESTORE_FUSED_PER_MIRROR.seconds
    out["dense / fused restore (TokenDance Fig. 13, paper)"] = paper
    return out


def _cells(row: Row) -> list[str]:
    ms = f"{row.seconds * 1e3:.3f}" if row.seconds else "-"
    gb = f"{row.gb_s:.2f}" if row.gb_s else "-"
    return [row.section, row.what, ms, gb, row.check, row.note]


HEADER = ["section", "what", "time (ms)", "GB/s", "check", "note"]
CPU_NOTE = (
    "On the CPU the kernels run in Triton's interpreter (Python, one program at a time): their "
    "times and GB/s say nothing about kernel speed and the kernel/reference ratios compare "
    "Python with torch. What this record shows is correctness (check column) and bytes moved. "
    "The `(model)` rows are the simulator's estimates for the preset's GPU, not measurements; "
    "the `measured` recompute row is this CPU."
)


def table(record: Record) -> Table:
    out = Table(title="KV data-path kernels")
    for column in HEADER:
        out.add_column(column)
    for row in record.rows:
        out.add_row(*_cells(row))
    return out


def markdown(record: Record, command: str) -> str:
    """The record with its command, date and `lscpu | head`, as bench/results keeps them."""
    lscpu = subprocess.run("lscpu | head", shell=True, capture_output=True, text=True).stdout
    date = subprocess.run(["date"], capture_output=True, text=True).stdout.strip()
    lines = ["# KV data-path kernels (`bench/kernels.py`)", ""]
    lines += [f"Command: `{command}`  ", f"Date (`date`): `{date}`  "]
    lines += [f"Setup: `{json.dumps(record.setup)}`", "", "```", lscpu.rstrip(), "```", ""]
    if record.setup["device"] == "cpu":
        lines += [CPU_NOTE, ""]
    lines += ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(_cells(row)) + " |" for row in record.rows]
    lines += ["", "| ratio | value |", "|---|---|"]
    lines += [f"| {name} | {value:.2f} |" for name, value in record.ratios.items()]
    return "\n".join(lines) + "\n"


def write_preset(record: Record, setup: Setup) -> str:
    """The measured reload (HiCache's when installed, else the kernel's) into presets.py."""
    loads = {r.what: r for r in record.rows if r.gb_s}
    row = loads.get("layer_first HiCache load") or loads["layer_first load"]
    name = torch.cuda.get_device_name()
    source = (
        f"measured: bench/kernels.py --write-preset on {name}, {time.strftime('%Y-%m-%d')}: "
        f"{row.what}, {setup.model.name} shapes, {setup.tokens} tokens in "
        f"{setup.page_size}-token pages, {setup.dtype}"
    )
    text = rewrite(PRESETS_FILE.read_text(), gpu_constant(name), row.gb_s * 1e9, source)
    PRESETS_FILE.write_text(text)
    return source


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="h100-8b", choices=sorted(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, help="program size (default: CUDA 16384, CPU 256)")
    ap.add_argument("--programs", type=int, default=4, help="programs one hint moves")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=32, help="diff block (TokenDance: 32)")
    ap.add_argument("--compare-tokens", type=int, default=16384, help="transfer vs recompute")
    ap.add_argument("--recompute-tokens", type=int, help="layer stack (CUDA: 16384, CPU: 32)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--reps", type=int, help="timed runs per figure (default: CUDA 20, CPU 3)")
    ap.add_argument("--md", type=Path, help="write the markdown record here")
    ap.add_argument("--json", type=Path, help="write the JSON record here")
    ap.add_argument("--write-preset", action="store_true", help="CUDA: the reload into presets")
    return ap.parse_args(argv)


def setup_of(args: argparse.Namespace) -> Setup:
    cuda = args.device == "cuda"
    tokens = args.tokens or (16384 if cuda else 256)
    return Setup(
        preset=PRESETS[args.preset],
        tokens=tokens,
        programs=args.programs,
        page_size=args.page_size,
        block_size=args.block_size,
        compare_tokens=args.compare_tokens,
        recompute_tokens=args.recompute_tokens or (args.compare_tokens if cuda else 32),
        dtype=getattr(torch, args.dtype),
        device=torch.device(args.device),
        reps=args.reps or (20 if cuda else 3),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = setup_of(args)
    if args.write_preset and setup.device.type != "cuda":
        print("bench/kernels.py: --write-preset needs CUDA (a measured reload)", file=sys.stderr)
        return 2
    described = {k: str(v) for k, v in asdict(setup).items() if k != "preset"}
    record = Record({"preset": setup.preset.name, "model": setup.model.name, **described})
    record.rows += transfer_rows(setup) + diff_rows(setup) + restore_rows(setup)
    rows, ratios = recompute_rows(setup, record.rows)
    record.rows += rows
    record.ratios = ratios_of(record.rows) | ratios
    console = Console()
    console.print(table(record))
    for name, value in record.ratios.items():
        console.print(f"{name}: {value:.2f}")
    command = " ".join(["python3 bench/kernels.py", *(argv if argv is not None else sys.argv[1:])])
    if args.md:
        args.md.write_text(markdown(record, command))
    if args.json:
        rows_json = [asdict(r) | {"gb_s": r.gb_s} for r in record.rows]
        payload = {"setup": record.setup, "rows": rows_json, "ratios": record.ratios}
        args.json.write_text(json.dumps(payload, indent=1))
    if args.write_preset:
        console.print(f"router/presets.py: {write_preset(record, setup)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
