#!/usr/bin/env bash
# Build the benchmark environment: megarl plus TRL (the peer GRPOTrainer), kept apart from the main
# environment so that TRL's dependencies never change what the tests run against.
#
# Usage: benchmarks/make_bench_env.sh [VENV_DIR]     (default: .venv-bench in the repository root)
# Env:   PYTHON (interpreter, default python3.11 or python3), TORCH_VERSION (default 2.13.0),
#        TRL_VERSION (default 1.16.0)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${1:-${repo_root}/.venv-bench}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
torch_version="${TORCH_VERSION:-2.13.0}"
trl_version="${TRL_VERSION:-1.16.0}"

start=$(date +%s)
echo "[bench_env] creating ${venv_dir} with ${python_bin}"
"${python_bin}" -m venv "${venv_dir}"
pip=("${venv_dir}/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

# torch first: a plain `pip install trl` would otherwise resolve to the CUDA build (several GB).
echo "[bench_env] installing torch==${torch_version} (CPU build)"
# TORCH_INDEX_URL (make passes it): the index torch comes from, e.g. PyTorch's CPU wheels.
"${pip[@]}" install --quiet "torch==${torch_version}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}

# One resolver run for megarl and TRL, torch pinned again so that nothing replaces it.
echo "[bench_env] installing megarl and trl==${trl_version}"
"${pip[@]}" install --quiet -e "${repo_root}" "trl==${trl_version}" "torch==${torch_version}" \
    ${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"}

"${pip[@]}" check
"${venv_dir}/bin/python" - <<PY
import torch, transformers, trl
assert torch.__version__.startswith("${torch_version}"), torch.__version__
print(f"[bench_env] torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, trl {trl.__version__}")
PY
echo "[bench_env] done in $(( $(date +%s) - start )) s: ${venv_dir}"
