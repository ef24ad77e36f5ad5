"""Hardware x model presets: what a replica holds and how fast it computes and copies.

The router's settings take their defaults from one (`router.config`: budgets, prices), and
the simulator's replica cost model (`router.sim.model`) its timings, so the presets stand
below both: they import nothing of the project, and the live router's settings do not
depend on the simulator package.

A preset turns public spec-sheet numbers into the handful of coefficients the cost model
needs: KV bytes per token, the GPU KV budget in tokens, prefill FLOPs per token, decode
bytes read per iteration, and PCIe bandwidth. Every number carries its source or its
derivation so a reader can check (or change) it; efficiencies are estimates, marked so.

Derivations:
  kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes
  gpu_kv_tokens      = (HBM x mem_fraction_static - weights) / kv_bytes_per_token
  prefill_s(n, p)    = 2 x active_params x n / (peak_flops x mfu)      # linear layers
                       + 4 x layers x q_dim x pairs / (peak_flops x mfu x attn_eff)
                       + prefill_overhead_s per forward of chunk_tokens
                       pairs = n x (p + n/2) + prefix_attention x p^2 / 2 (causal attention)
  decode_step_s      = max(weights read / (hbm_bw x bw_eff), batch x 2 x active_params
                       / (peak_flops x mfu)) + KV read / (hbm_bw x bw_eff x kv_read_eff)
                       + step overhead + batch x per-request overhead
  load_s(n)          = n x kv_bytes_per_token / pcie_bytes_s

The GPU presets below are spec sheets times estimated efficiencies. A preset measured on a
live engine (`mori calibrate`, router/calibrate/) is a JSON file read by `get_preset` when
its name is a path (`read_preset`, below): its device carries the fitted effective
rates (efficiencies 1) and `sources` says which price was measured where and when.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True, slots=True)
class GPU:
    """One accelerator; capacities and peaks from the vendor data sheet."""

    name: str
    hbm_bytes: float  # usable HBM as nvidia-smi reports it
    hbm_bytes_s: float  # peak HBM bandwidth
    bf16_flops: float  # dense (non-sparse) BF16 tensor-core peak
    pcie_bytes_s: float  # achieved host<->device copy bandwidth per GPU (pinned memory)
    # Where pcie_bytes_s comes from: "estimate: ..." until bench/kernels.py has timed the
    # KV reload on this GPU; `python bench/kernels.py --write-preset` rewrites both fields.
    pcie_source: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Transformer shape from the model's config.json on Hugging Face."""

    name: str
    total_params: float  # all weights (read every decode step for dense models)
    active_params: float  # weights used per token (MoE: shared + routed top-k experts)
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # BF16 weights and KV cache (SGLang default kv_cache_dtype=auto)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_config(cls, config: dict, name: str) -> ModelSpec:
        """A dense decoder's shape from its Hugging Face config.json (Llama, Qwen2 and
        the like): attention and MLP weights per layer, plus the embedding and LM head."""
        if config.get("num_experts") or config.get("num_local_experts"):
            raise ValueError(f"{name}: a mixture of experts; describe it as a ModelSpec")
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        layers, vocab = config["num_hidden_layers"], config["vocab_size"]
        attention = hidden * head_dim * (2 * heads + 2 * kv_heads)  # q, o and k, v
        per_layer = attention + 3 * hidden * config["intermediate_size"]  # gate, up, down
        tied = config.get("tie_word_embeddings", False)
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
        return cls(
            name=name,
            total_params=layers * per_layer + vocab * hidden * (1 if tied else 2),
            active_params=layers * per_layer + vocab * hidden,  # the LM head, not the lookup
            layers=layers,
            q_heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype_bytes=4 if "32" in dtype else 2,
        )

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class Preset:
    """A replica: `tp` GPUs of one kind serving one model with tensor parallelism."""

    name: str
    gpu: GPU
    model: ModelSpec
    tp: int = 1
    # SGLang sizes its static pool (weights + KV) as this share of HBM; it picks ~0.85-0.9
    # on 80-180 GB GPUs (server_args.py, auto mem_fraction_static). The rest is activations,
    # CUDA graphs and the allocator's slack.
    mem_fraction_static: float = 0.88
    mfu: float = 0.5  # estimate: prefill at 40-60% of BF16 peak in SGLang long-prompt benchmarks
    bw_eff: float = 0.7  # estimate: decode kernels reach ~70% of peak HBM bandwidth
    tp_eff: float = 1.0  # estimate: share of TP scaling left after all-reduce traffic
    step_overhead_s: float = 0.002  # estimate: per-iteration scheduling + CUDA-graph launch
    seq_overhead_s: float = 5e-5  # estimate: per running request (sampling, logits, bookkeeping)
    # Engine terms a calibration showed the FLOP/byte prices alone miss (router/calibrate/);
    # the defaults are what GPU kernels do, so the GPU presets keep their earlier timing.
    attn_eff: float = 1.0  # attention's FLOP rate over the linear layers' (FlashAttention ~ GEMM)
    # Share of a cached prefix's own causal attention that computing new tokens on top of it
    # recomputes: 0 for FlashInfer / FlashAttention (queries of the new tokens only); 1 for
    # SGLang's torch_native backend on CPU, whose extend runs SDPA over the whole sequence
    # with the prefix's queries included (torch_native_backend._run_sdpa_forward_extend).
    prefix_attention: float = 0.0
    prefill_overhead_s: float = 0.0  # per prefill forward (scheduling, launch, sampling)
    # Share of the shorter of (compute, host loads) of a prefill batch that is not hidden under
    # the longer: 0 when HiCache loads layer by layer under the compute (a GPU's copy engine),
    # 1 when the copy and the forward take turns on the same cores.
    load_serial: float = 0.0
    # A decode iteration's KV read rate as a share of `bytes_s`, the weights' read rate: 1
    # where the attention kernel streams paged KV as GEMMs stream weights (GPU decode
    # kernels); less where it gathers each sequence's rows first (SGLang's torch_native
    # decode on CPU: 0.18-0.28, bench/results/2026-11-29-cpu-*.json; the forward log,
    # 2026-11-29-forward-log.md). One rate for both made a calibration's decode line keep
    # the weights-to-KV bytes ratio, too flat for that engine.
    kv_read_eff: float = 1.0
    chunk_tokens: int = 8192  # SGLang's chunked_prefill_size (8192 on 80 GB GPUs)
    kv_tokens: int | None = None  # the device pool a calibrated engine reported (else derived)
    # Where each price comes from, ("flops_s", "measured: ..."); empty: the comments here
    sources: tuple[tuple[str, str], ...] = ()

    @property
    def kv_bytes_per_token(self) -> int:
        """Per replica: KV heads are sharded across TP ranks, the total is the same."""
        return self.model.kv_bytes_per_token

    @property
    def gpu_kv_tokens(self) -> int:
        if self.kv_tokens is not None:
            return self.kv_tokens
        hbm = self.gpu.hbm_bytes * self.tp * self.mem_fraction_static
        return int((hbm - self.model.weight_bytes) / self.kv_bytes_per_token)

    @property
    def flops_s(self) -> float:
        return self.gpu.bf16_flops * self.tp * self.mfu * self.tp_eff

    @property
    def bytes_s(self) -> float:
        return self.gpu.hbm_bytes_s * self.tp * self.bw_eff * self.tp_eff

    @property
    def kv_read_bytes_s(self) -> float:
        """The rate a decode iteration reads its sequences' KV at."""
        return self.bytes_s * self.kv_read_eff

    @property
    def pcie_bytes_s(self) -> float:
        """Each TP rank copies its own KV shard over its own link, in parallel."""
        return self.gpu.pcie_bytes_s * self.tp

    @property
    def attention_tokens(self) -> float:
        """The context length at which a prompt token's attention costs as much compute as
        its pass through the weights: the recompute price per token grows with context
        past it (`router.policy.prices`; the cost model's prefill_s)."""
        m = self.model
        return self.attn_eff * 2 * m.active_params / (4 * m.layers * m.q_heads * m.head_dim)

    def provenance(self) -> dict[str, str]:
        """Where each price comes from: a calibrated preset says which it measured (and
        where, when); a spec-sheet preset's efficiencies and overheads are estimates."""
        kernels = "estimate: what GPU attention kernels and HiCache's layer-wise loads do"
        derived = {
            "flops_s": f"estimate: {self.mfu:.0%} of the data sheet's BF16 peak",
            "bytes_s": f"estimate: {self.bw_eff:.0%} of the data sheet's memory bandwidth",
            "pcie_bytes_s": self.gpu.pcie_source,
            "step_overhead_s": "estimate",
            "seq_overhead_s": "estimate",
            "attn_eff": kernels,
            "prefix_attention": kernels,
            "prefill_overhead_s": kernels,
            "load_serial": kernels,
            "kv_read_eff": kernels,
        }
        return derived | dict(self.sources)

    def host_kv_tokens(self, cpu_ratio: float) -> int:
        """MORI's CPU-to-GPU memory ratio: host DRAM budget for KV = ratio x GPU KV budget."""
        return int(cpu_ratio * self.gpu_kv_tokens)


# PCIe Gen5 x16 is 64 GB/s per direction on paper; pinned-memory cudaMemcpy reaches
# ~50 GB/s (nvbandwidth host_to_device on H100 SXM hosts), which HiCache's kernels approach.
_PCIE5_BYTES_S = 50e9
_PCIE5_SOURCE = (
    "estimate: PCIe Gen5 x16 pinned cudaMemcpy (~50 of 64 GB/s, nvbandwidth host_to_device on "
    "H100 SXM hosts); the KV reload has not been timed on this GPU by bench/kernels.py"
)

H100_80GB = GPU(
    name="H100-SXM-80GB",
    hbm_bytes=81559 * MIB,  # nvidia-smi "81559MiB" on H100 SXM5 80GB
    hbm_bytes_s=3.35e12,  # H100 SXM data sheet: 3.35 TB/s HBM3
    bf16_flops=989e12,  # H100 SXM data sheet: 1979 TFLOPS BF16 with sparsity -> 989 dense
    pcie_bytes_s=_PCIE5_BYTES_S,
    pcie_source=_PCIE5_SOURCE,
)
H200 = GPU(
    name="H200-SXM-141GB",
    hbm_bytes=143771 * MIB,  # nvidia-smi "143771MiB" on H200 SXM 141GB
    hbm_bytes_s=4.8e12,  # H200 data sheet: 4.8 TB/s HBM3e
    bf16_flops=989e12,  # H200 data sheet: same tensor cores as H100 SXM, 989 TFLOPS dense
    pcie_bytes_s=_PCIE5_BYTES_S,
    pcie_source=_PCIE5_SOURCE,
)
B200 = GPU(
    name="B200-180GB",
    hbm_bytes=180e9,  # DGX B200: 1,440 GB HBM3e over 8 GPUs = 180 GB each
    hbm_bytes_s=8e12,  # B200 data sheet: 8 TB/s HBM3e
    bf16_flops=2.25e15,  # HGX B200: 4.5 PFLOPS BF16 with sparsity -> 2.25 dense
    pcie_bytes_s=_PCIE5_BYTES_S,  # DGX B200 hosts (Xeon 8570) link at PCIe Gen5
    pcie_source=_PCIE5_SOURCE,
)

# TokenDance's testbed (§6.1): A100 80 GB, on PCIe Gen4.
A100_80GB = GPU(
    name="A100-SXM-80GB",
    hbm_bytes=81920 * MIB,  # nvidia-smi "81920MiB" on A100 SXM4 80GB
    hbm_bytes_s=2.039e12,  # A100 80GB SXM data sheet: 2,039 GB/s HBM2e
    bf16_flops=312e12,  # A100 data sheet: 312 TFLOPS BF16 dense (624 with sparsity)
    pcie_bytes_s=25e9,
    pcie_source=(
        "estimate: PCIe Gen4 x16 pinned cudaMemcpy (~25 of 32 GB/s, nvbandwidth "
        "host_to_device on A100 SXM hosts); not timed on this GPU by bench/kernels.py"
    ),
)

LLAMA_31_8B = ModelSpec(
    name="Llama-3.1-8B",
    total_params=8.03e9,  # model card: 8.03B parameters
    active_params=8.03e9,  # dense
    layers=32,  # config.json num_hidden_layers
    q_heads=32,  # num_attention_heads
    kv_heads=8,  # num_key_value_heads (GQA)
    head_dim=128,  # hidden_size 4096 / 32 heads
)  # KV: 2 x 32 x 8 x 128 x 2 B = 131,072 B/token (128 KiB)
QWEN3_30B_A3B = ModelSpec(
    name="Qwen3-30B-A3B",
    total_params=30.5e9,  # model card: 30.5B total
    active_params=3.3e9,  # model card: 3.3B activated (8 of 128 experts per token)
    layers=48,  # config.json num_hidden_layers
    q_heads=32,  # num_attention_heads
    kv_heads=4,  # num_key_value_heads
    head_dim=128,  # config.json head_dim
)  # KV: 2 x 48 x 4 x 128 x 2 B = 98,304 B/token (96 KiB)
LLAMA_31_70B = ModelSpec(
    name="Llama-3.1-70B",
    total_params=70.6e9,  # model card: 70.6B parameters
    active_params=70.6e9,  # dense
    layers=80,  # config.json num_hidden_layers
    q_heads=64,  # num_attention_heads
    kv_heads=8,  # num_key_value_heads (GQA)
    head_dim=128,  # hidden_size 8192 / 64 heads
)  # KV: 2 x 80 x 8 x 128 x 2 B = 327,680 B/token (320 KiB)

QWEN25_7B = ModelSpec(
    name="Qwen2.5-7B-Instruct",
    total_params=7.61e9,  # model card: 7.61B parameters
    active_params=7.61e9,  # dense
    layers=28,  # config.json num_hidden_layers
    q_heads=28,  # num_attention_heads
    kv_heads=4,  # num_key_value_heads (GQA)
    head_dim=128,  # hidden_size 3584 / 28 heads
)  # KV: 2 x 28 x 4 x 128 x 2 B = 57,344 B/token (56 KiB)
QWEN25_14B = ModelSpec(
    name="Qwen2.5-14B-Instruct",
    total_params=14.7e9,  # model card: 14.7B parameters
    active_params=14.7e9,  # dense
    layers=48,  # config.json num_hidden_layers
    q_heads=40,  # num_attention_heads
    kv_heads=8,  # num_key_value_heads (GQA)
    head_dim=128,  # hidden_size 5120 / 40 heads
)  # KV: 2 x 48 x 8 x 128 x 2 B = 196,608 B/token (192 KiB)

PRESETS: dict[str, Preset] = {
    # MORI Table 1 row 1 ("H200 (80 GB)" emulating H100 + a 7B/8B dense model).
    # KV budget: 79.6 GiB x 0.88 - 16.1 GB = 59.2 GB -> ~451k tokens.
    "h100-8b": Preset("h100-8b", H100_80GB, LLAMA_31_8B),
    # MORI Table 1 row 2 (H200 + 30B MoE). KV: 140.4 GiB x 0.88 - 61 GB -> ~728k tokens.
    "h200-30b-moe": Preset("h200-30b-moe", H200, QWEN3_30B_A3B),
    # MORI Table 1 row 3 (B200 + 70B, TP=2). KV: 2 x 180 GB x 0.88 - 141 GB -> ~536k tokens.
    # tp_eff 0.85: estimate for NVLink all-reduce cost per layer at TP=2.
    "b200-70b-tp2": Preset("b200-70b-tp2", B200, LLAMA_31_70B, tp=2, tp_eff=0.85),
    # TokenDance §6.1 (A100 80 GB + Qwen2.5-7B / 14B). 14B: 80 GiB x 0.88 - 29.4 GB ->
    # ~235k tokens (42.9 GiB; TokenDance Fig. 2 measures a 41.8 GiB pool on it).
    "a100-qwen7b": Preset("a100-qwen7b", A100_80GB, QWEN25_7B),
    "a100-qwen14b": Preset("a100-qwen14b", A100_80GB, QWEN25_14B),
}


def price_summary(preset: Preset) -> str:
    """One sentence for a reader of results: which of the preset's prices were measured
    (where, when) and which are estimates."""
    measured: dict[str, list[str]] = {}
    estimated = []
    for term, source in preset.provenance().items():
        if source.startswith("measured"):
            measured.setdefault(source.removeprefix("measured: "), []).append(term)
        else:
            estimated.append(term)
    said = [f"{', '.join(terms)} measured ({where})" for where, terms in measured.items()]
    said.append(f"{', '.join(estimated)} estimated" if estimated else "nothing estimated")
    return "; ".join(said if measured else ["no price measured", *said])


def at_speed(preset: Preset, slowdown: float) -> Preset:
    """`preset` on a machine that runs every forward `slowdown` times as long (1.3: 30 %
    slower): its rates divided by it, its per-forward, per-iteration and per-request
    overheads multiplied, so each time the cost model prices (prefill, decode iteration,
    host load) is `slowdown` times the preset's. A shared machine's speed moves by tens of
    percent within an hour (bench/results/2026-12-02-engine-prediction.md): a prediction
    priced at the speed measured just before its run (`router.calibrate.speed`) is
    priced at the machine it runs on."""
    if not slowdown > 0:
        raise ValueError(f"a slowdown is a positive factor, not {slowdown!r}")
    gpu = preset.gpu
    return dataclasses.replace(
        preset,
        gpu=dataclasses.replace(
            gpu,
            hbm_bytes_s=gpu.hbm_bytes_s / slowdown,
            bf16_flops=gpu.bf16_flops / slowdown,
            pcie_bytes_s=gpu.pcie_bytes_s / slowdown,
        ),
        step_overhead_s=preset.step_overhead_s * slowdown,
        seq_overhead_s=preset.seq_overhead_s * slowdown,
        prefill_overhead_s=preset.prefill_overhead_s * slowdown,
    )


def get_preset(name: str) -> Preset:
    """Look a preset up by name, or read a preset file (`mori calibrate --out`) when the
    name is a path to one; a clear error lists the known ones."""
    if name in PRESETS:
        return PRESETS[name]
    if name.endswith(".json") or Path(name).is_file():
        return read_preset(name)
    raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (or a preset file)")


# preset files ---------------------------------------------------------------------------
# A cost-model preset measured on a live engine, as JSON. `mori calibrate` fits the cost
# model's prices to a replica's timings and writes one; `mori sim`, `mori emulate` and
# `mori demo` take it with `--preset-file FILE` (and `get_preset` reads one whenever a
# preset name is a path). The file holds what `Preset` needs (the device's effective rates,
# the model's shape, the engine terms) and what a reader needs to trust it: the date, the
# engine's own `/get_server_info`, which price was measured and which is an estimate, and
# the fit's residuals per probe:
#     {"format": "mori-preset/1", "name", "description", "date",
#      "device": {GPU fields}, "model": {ModelSpec fields}, "preset": {Preset engine terms},
#      "sources": {price: "measured: ..." | "estimate: ..."},
#      "engine": {"endpoint", "server_info"}, "fit": {...}}
FORMAT = "mori-preset/1"
# Preset fields a file sets besides its name, device and model
ENGINE_TERMS = tuple(
    f.name for f in dataclasses.fields(Preset) if f.name not in ("name", "gpu", "model", "sources")
)


def preset_document(preset: Preset, **extra: object) -> dict:
    """The JSON document of `preset` (its sources as a mapping), with `extra` keys after."""
    return {
        "format": FORMAT,
        "name": preset.name,
        "device": dataclasses.asdict(preset.gpu),
        "model": dataclasses.asdict(preset.model),
        "preset": {name: getattr(preset, name) for name in ENGINE_TERMS},
        "sources": dict(preset.sources),
        **extra,
    }


def write_preset(path: str | Path, preset: Preset, **extra: object) -> Path:
    """Write `preset` (and `extra`: date, engine, fit) as a preset file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(preset_document(preset, **extra), indent=1) + "\n")
    read_preset.cache_clear()
    return path


def preset_from_document(doc: dict, where: str = "preset file") -> Preset:
    """The `Preset` a document describes; ValueError names what is missing or wrong."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not a {FORMAT} document")
    try:
        terms = {k: v for k, v in doc["preset"].items() if k in ENGINE_TERMS}
        return Preset(
            name=str(doc["name"]),
            gpu=GPU(**doc["device"]),
            model=ModelSpec(**doc["model"]),
            sources=tuple((str(k), str(v)) for k, v in doc.get("sources", {}).items()),
            **terms,
        )
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{where}: {type(e).__name__}: {e}") from None


@lru_cache(maxsize=16)
def read_preset(path: str | Path) -> Preset:
    """Read a preset file; ValueError says why it cannot be used."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path}: cannot read preset file: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    return preset_from_document(doc, str(path))
