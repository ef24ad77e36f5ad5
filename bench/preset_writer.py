"""Write a measured host<->device figure into a GPU preset of router/presets.py.

The simulator and the priced policy price a reload at `GPU.pcie_bytes_s`; `pcie_source`
says where that figure comes from. `bench/kernels.py --write-preset` measures the reload on
the GPU it runs on and calls `rewrite` to replace both fields of that GPU's preset, leaving
the rest of the file as it is. Pure text in, text out: no torch, testable anywhere.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

PRESETS = Path(__file__).resolve().parents[1] / "router" / "presets.py"
# torch.cuda.get_device_name() fragment -> the preset constant describing that GPU
GPU_CONSTANTS = {"H100": "H100_80GB", "H200": "H200", "B200": "B200"}
_FIELD = re.compile(r"^    (\w+)=")


def gpu_constant(device_name: str) -> str:
    """The preset constant for a CUDA device name; an error names the GPUs with a preset."""
    for fragment, constant in GPU_CONSTANTS.items():
        if fragment in device_name:
            return constant
    raise ValueError(f"no GPU preset for {device_name!r}; presets: {', '.join(GPU_CONSTANTS)}")


def _fields(block: list[str]) -> list[list[str]]:
    """A `GPU(` call's lines grouped by keyword argument (continuation lines stay with theirs)."""
    groups: list[list[str]] = []
    for line in block:
        if _FIELD.match(line) or not groups:
            groups.append([line])
        else:
            groups[-1].append(line)
    return groups


def _source_lines(source: str) -> list[str]:
    """`pcie_source=` as implicitly joined strings that fit the 100-column limit."""
    parts = textwrap.wrap(source, 80, drop_whitespace=False)
    return ["    pcie_source=(", *(f"        {json.dumps(part)}" for part in parts), "    ),"]


def rewrite(text: str, constant: str, bytes_s: float, source: str) -> str:
    """presets.py `text` with `constant`'s pcie_bytes_s and pcie_source replaced."""
    lines = text.splitlines()
    start = lines.index(f"{constant} = GPU(")
    end = lines.index(")", start)
    kept = [
        line
        for group in _fields(lines[start + 1 : end])
        if _FIELD.match(group[0]).group(1) not in ("pcie_bytes_s", "pcie_source")
        for line in group
    ]
    figure = [f"    pcie_bytes_s={bytes_s / 1e9:.4g}e9,"]
    block = [lines[start], *kept, *figure, *_source_lines(source), ")"]
    return "\n".join([*lines[:start], *block, *lines[end + 1 :]]) + "\n"
