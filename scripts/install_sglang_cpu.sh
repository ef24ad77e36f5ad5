#!/usr/bin/env bash
# Installs the pinned SGLang (0.5.17) for the CPU engine tests, into its own venv so that its
# heavy, tightly pinned stack (torch, transformers, openai==2.6.1, ...) never touches the router's
# environment. Idempotent and cached: a second run is a stamp check (well under a second).
#
#   scripts/install_sglang_cpu.sh            # install or skip
#   MORI_SGLANG_VENV=/path scripts/...       # choose the venv (default ~/.cache/mori/sglang-0.5.17)
#
# Never pulls CUDA: torch==2.13.0 resolves to the local CPU wheel and every later step runs under a
# torch==2.13.0 constraint; the script fails if any nvidia-* package ends up installed.
# sglang itself is installed --no-deps (its metadata pins CUDA torch 2.11 and the GPU kernels);
# DEPS is the short list the CPU server really imports (see docs/engine-patch.md).
set -euo pipefail

SGLANG_VERSION=0.5.17
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${MORI_SGLANG_VENV:-$HOME/.cache/mori/sglang-$SGLANG_VERSION}"
DEPS=(
  numpy orjson psutil pybase64 requests packaging pillow tqdm msgspec pyzmq ipython pydantic
  aiohttp starlette fastapi uvicorn uvloop python-multipart setproctitle einops jsonschema
  "soundfile==0.13.1" "transformers==5.12.1" "tokenizers==0.22.2" sentencepiece dill gguf
  "compressed-tensors==0.18.0" "openai==2.6.1" partial-json-parser "xgrammar==0.2.1" triton
  "torchvision==0.28.0" httpx prometheus-client
)
WANT="sglang=$SGLANG_VERSION deps=$(printf '%s ' "${DEPS[@]}" | sha1sum | cut -c1-12) repo=$REPO"
STAMP="$VENV/.mori-installed"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] \
  && "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('sglang') == '$SGLANG_VERSION'" 2>/dev/null; then
  echo "install_sglang_cpu: sglang $SGLANG_VERSION already in $VENV (cached)"
  exit 0
fi

started=$(date +%s)
echo "install_sglang_cpu: installing sglang $SGLANG_VERSION (CPU) into $VENV"
mkdir -p "$(dirname "$VENV")"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PIP=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# Drop expected noise: warnings about empty local index mirrors, and the resolver listing
# sglang's CUDA pins that --no-deps deliberately leaves out.
NOISE="is ignored: it is neither a file nor a directory|^sglang $SGLANG_VERSION requires|dependency resolver does not currently"
pip_quiet() { "$@" 2> >(grep -Ev "$NOISE" >&2); }
CONSTRAINTS="$VENV/mori-constraints.txt"
echo "torch==2.13.0" > "$CONSTRAINTS"

"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}"
# The MORI plugin itself, editable, so the sglang.srt.plugins entry point points at this checkout.
"${PIP[@]}" --no-deps --no-build-isolation -e "$REPO"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m
import torch
assert torch.version.cuda is None, f"CUDA torch slipped in: {torch.__version__}"
cuda = sorted(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not cuda, f"CUDA packages slipped in: {cuda}"
eps = [e.name for e in m.entry_points(group="sglang.srt.plugins")]
assert "mori" in eps, f"MORI plugin entry point missing: {eps}"
print(f"install_sglang_cpu: torch {torch.__version__}, sglang {m.version('sglang')}, plugins {eps}")
EOF

echo "$WANT" > "$STAMP"
echo "install_sglang_cpu: done in $(( $(date +%s) - started )) s"
