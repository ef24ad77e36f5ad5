#!/usr/bin/env bash
# The project's one test command (README; .ci/run calls exactly this).
# Installs what the suite needs, then runs it. CPU only; never pulls CUDA torch.
set -euo pipefail
cd "$(dirname "$0")/.."
# The kernels extra: torch==2.13.0 resolves to the CPU wheel on disk (+cpu sorts above PyPI's),
# triton for its CPU interpreter. Fail here, not in the tests, if CUDA torch slipped in.
python3 -m pip install -q -e '.[test,kernels]'
python3 -c 'import torch; assert torch.version.cuda is None, f"CUDA torch: {torch.__version__}"'
# The real engine for the -m sglang tests: MORI_SGLANG_VERSION, default the newest supported line.
[[ "${MORI_SKIP_SGLANG:-0}" == 1 ]] || scripts/install_sglang_cpu.sh
# docker-compose 1.29 (Debian) validates the compose files in tests/test_deploy.py; no engine needed.
command -v docker-compose >/dev/null || docker compose version >/dev/null 2>&1 \
  || { (apt-get update -qq && apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
       || echo "test.sh: docker-compose unavailable; compose config checks will skip"; }
# HAProxy (Debian's) runs the committed proxy configs in tests/test_haproxy.py.
command -v haproxy >/dev/null \
  || { (apt-get update -qq && apt-get install -y -qq haproxy) >/dev/null 2>&1 \
       || echo "test.sh: haproxy unavailable; the proxy tests will skip"; }
python3 -m pytest -q "$@"
# Other supported SGLang lines' real-engine tests, when asked: MORI_SGLANG_ALSO=0.5.17. CI runs
# the newest line only (each line adds a ~2.6 GB venv and ~8 min of tests on 2 cores).
also="${MORI_SGLANG_ALSO:-}"
for version in ${also//,/ }; do
  [[ "${MORI_SKIP_SGLANG:-0}" == 1 ]] && break
  scripts/install_sglang_cpu.sh "$version"
  MORI_SGLANG_VERSION="$version" python3 -m pytest -q -m sglang
done
