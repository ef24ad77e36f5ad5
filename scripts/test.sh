#!/usr/bin/env bash
# The project's one test command (README; .ci/run calls exactly this).
# Installs what the suite needs, then runs it. CPU only; never pulls CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e '.[test]'
[[ "${MORI_SKIP_SGLANG:-0}" == 1 ]] || scripts/install_sglang_cpu.sh  # real engine for -m sglang tests
python3 -m pytest -q "$@"
