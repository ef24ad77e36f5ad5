#!/usr/bin/env bash
# Installs one supported SGLang line for the CPU engine tests into its own venv, so that its heavy,
# tightly pinned stack (torch, transformers, openai, ...) never touches the router's environment.
#
#   scripts/install_sglang_cpu.sh [VERSION]         # install or reuse (default: newest supported)
#   scripts/install_sglang_cpu.sh --print-venv [V]  # print the venv path, install nothing
#   MORI_SGLANG_VERSION=X.Y.Z ...                   # the version when none is given
#   MORI_SGLANG_VENV=/path ...                      # use this venv instead of the cached one
#
# Content-addressed: the venv is ~/.cache/mori/venvs/sglang-VERSION-KEY, KEY a hash of everything
# it is built from (version, pins, torch, Python, the CPU shim, the plugin entry point), so several
# checkouts share one venv per content and never reinstall over each other (a lock serialises
# concurrent installs of the same one). Nothing in it points at a checkout: the `mori` plugin entry
# point resolves `engine_patches` from the PYTHONPATH (or working directory) of whoever runs SGLang.
# A second run is a stamp check (well under a second). Size: ~2.6 GB per version (torch alone 1 GB).
#
# Never pulls CUDA: torch==2.13.0 resolves to the local CPU wheel and every later step runs under a
# torch==2.13.0 constraint; the script fails if any nvidia-* package ends up installed. sglang itself
# is installed --no-deps (its metadata pins CUDA torch and the GPU kernels); DEPS_* are the short
# lists the CPU server really imports (docs/engine-patch.md).
set -euo pipefail

SUPPORTED=(0.5.17 0.5.23)
NEWEST=${SUPPORTED[-1]}
TORCH=2.13.0
COMMON=(
  numpy orjson psutil pybase64 requests packaging pillow tqdm msgspec pyzmq ipython pydantic
  aiohttp starlette fastapi uvloop python-multipart setproctitle einops jsonschema
  "soundfile==0.13.1" dill gguf "compressed-tensors==0.18.0" partial-json-parser triton
  "torchvision==0.28.0" httpx prometheus-client
)
DEPS_0_5_17=(uvicorn "transformers==5.12.1" "tokenizers==0.22.2" sentencepiece "openai==2.6.1"
  "xgrammar==0.2.1")
DEPS_0_5_23=("uvicorn>=0.51" "transformers==5.19.0" "tokenizers==0.23.2" "sentencepiece==0.2.1"
  "openai==2.8.0" "xgrammar==0.2.7" xxhash regex python-dateutil)

PRINT_ONLY=0
if [[ "${1:-}" == "--print-venv" ]]; then PRINT_ONLY=1; shift; fi
VERSION="${1:-${MORI_SGLANG_VERSION:-$NEWEST}}"
case " ${SUPPORTED[*]} " in
  *" $VERSION "*) ;;
  *) echo "install_sglang_cpu: sglang $VERSION is not supported (supported: ${SUPPORTED[*]})" >&2
     exit 2 ;;
esac
deps_var="DEPS_${VERSION//./_}[@]"
DEPS=("${COMMON[@]}" "${!deps_var}")

REPO="$(cd "$(dirname "$0")/.." && pwd)"
SHIM="$REPO/tests/sglang/shim"
ENTRY=$'[sglang.srt.plugins]\nmori = engine_patches.plugin:register\n'
KEY=$( { echo "sglang=$VERSION torch=$TORCH"; python3 -c 'import sys; print(sys.version_info[:2])'
         printf '%s\n' "${DEPS[@]}"; printf '%s' "$ENTRY"
         (cd "$SHIM" && find . -name '*.py' | LC_ALL=C sort | xargs sha1sum); } \
       | sha1sum | cut -c1-12)
VENV="${MORI_SGLANG_VENV:-$HOME/.cache/mori/venvs/sglang-$VERSION-$KEY}"
if (( PRINT_ONLY )); then echo "$VENV"; exit 0; fi

STAMP="$VENV/.mori-installed"
cached() {
  [[ -f "$STAMP" && "$(cat "$STAMP")" == "$KEY" ]] && "$VENV/bin/python" -c \
    "import importlib.metadata as m; assert m.version('sglang') == '$VERSION'" 2>/dev/null
}
if cached; then echo "install_sglang_cpu: sglang $VERSION in $VENV (cached)"; exit 0; fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # another checkout may be installing the same venv right now
if cached; then echo "install_sglang_cpu: sglang $VERSION in $VENV (cached)"; exit 0; fi

started=$(date +%s)
echo "install_sglang_cpu: installing sglang $VERSION (CPU) into $VENV"
[[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
PIP=(pip_quiet "$VENV/bin/python" -m pip install -q --disable-pip-version-check)
# Drop expected noise: warnings about empty local index mirrors, and the resolver listing
# sglang's CUDA pins that --no-deps deliberately leaves out.
NOISE="is ignored: it is neither a file nor a directory|^sglang $VERSION requires|dependency resolver does not currently"
pip_quiet() { "$@" 2> >(grep -Ev "$NOISE" >&2); }
CONSTRAINTS="$VENV/mori-constraints.txt"
echo "torch==$TORCH" > "$CONSTRAINTS"

"${PIP[@]}" "torch==$TORCH"
"${PIP[@]}" --no-deps "sglang==$VERSION"
"${PIP[@]}" -c "$CONSTRAINTS" "${DEPS[@]}"

SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# The plugin's entry point alone (no code): SGLang's loader finds `mori`, and imports
# engine_patches from the caller's checkout.
DIST="$SITE/mori_sglang_plugin-0.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: mori-sglang-plugin\nVersion: 0\n' > "$DIST/METADATA"
printf '%s' "$ENTRY" > "$DIST/entry_points.txt"
printf 'mori_sglang_plugin-0.dist-info/METADATA,,\nmori_sglang_plugin-0.dist-info/entry_points.txt,,\nmori_sglang_plugin-0.dist-info/RECORD,,\n' > "$DIST/RECORD"
# The CPU shim (tests/sglang/shim: a CPU sgl_kernel stand-in, HiCache pinning/transfer patches, the
# torchvision op declaration) copied in and put on sys.path, so `python -m engine_patches.launch`
# runs from this venv on a CPU machine with nothing else on PYTHONPATH.
rm -rf "$VENV/mori-cpu-shim" && cp -r "$SHIM" "$VENV/mori-cpu-shim"
find "$VENV/mori-cpu-shim" -name __pycache__ -prune -exec rm -rf {} +
echo "$VENV/mori-cpu-shim" > "$SITE/mori-cpu-shim.pth"

# -P: the check sees the venv alone. Without it the working directory is on sys.path, and in a
# checkout installed with `pip install -e .` its mori.egg-info lists the `mori` entry point a
# second time (the check printed "plugins ['mori', 'mori']"; SGLang keys plugins by name, so
# the server loaded it once either way).
"$VENV/bin/python" -P - <<'EOF'
import importlib.metadata as m
import torch
assert torch.version.cuda is None, f"CUDA torch slipped in: {torch.__version__}"
cuda = sorted(d.metadata["Name"] for d in m.distributions() if d.metadata["Name"].lower().startswith("nvidia"))
assert not cuda, f"CUDA packages slipped in: {cuda}"
eps = [e.name for e in m.entry_points(group="sglang.srt.plugins")]
assert "mori" in eps, f"MORI plugin entry point missing: {eps}"
import torchvision  # the shim's op declaration makes the CUDA build import on CPU torch
print(f"install_sglang_cpu: torch {torch.__version__}, sglang {m.version('sglang')}, plugins {eps}")
EOF

echo "$KEY" > "$STAMP"
echo "install_sglang_cpu: done in $(( $(date +%s) - started )) s ($(du -sh "$VENV" | cut -f1))"
