"""Preset files: a cost-model preset measured on a live engine, as JSON.

`mori calibrate` fits the cost model's prices to a replica's timings and writes one; `mori
sim`, `mori emulate` and `mori demo` take it with `--preset-file FILE` (and `get_preset`
reads one whenever a preset name is a path). The file holds what `Preset` needs (the
device's effective rates, the model's shape, the engine terms) and what a reader needs to
trust it: the date, the engine's own `/get_server_info`, which price was measured and which
is an estimate, and the fit's residuals per probe.

    {"format": "mori-preset/1", "name", "description", "date",
     "device": {GPU fields}, "model": {ModelSpec fields}, "preset": {Preset engine terms},
     "sources": {price: "measured: ..." | "estimate: ..."},
     "engine": {"endpoint", "server_info"}, "fit": {...}}
"""

from __future__ import annotations

import dataclasses
import json
from functools import lru_cache
from pathlib import Path

from router.sim.presets import GPU, ModelSpec, Preset

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
