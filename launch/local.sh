#!/usr/bin/env bash
# megarl on one machine: the trainer starts a local Ray cluster itself (resources.ray_address: null).
#
#   launch/local.sh [CONFIG] [OVERRIDES...]        # CONFIG defaults to configs/quickstart_cpu.yaml
#   launch/local.sh --dry-run CONFIG ...           # print the command and its environment only
#
# Threads: OMP_NUM_THREADS (default: the machine's cores divided by MEGARL_LOCAL_WORKERS, else the GPU
# count, else 2; at least 1) is the driver's. Each Ray worker runs resources.num_cpus_per_worker threads.
# Environment knobs: MEGARL_ENTRYPOINT (default: megarl train, with megarl from PATH, else this checkout's
# .venv/bin/megarl; words split at spaces), MEGARL_LOCAL_WORKERS, MEGARL_DRY_RUN=1,
# and anything the trainer reads (RAY_AUTH_MODE, CUDA_VISIBLE_DEVICES, ...).

set -euo pipefail

dry_run="${MEGARL_DRY_RUN:-0}"
if [[ "${1:-}" == "--dry-run" ]]; then
    dry_run=1
    shift
fi
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then
    sed -n '2,11p' "$0"
    exit 0
fi

config="${1:-configs/quickstart_cpu.yaml}"
if [[ $# -gt 0 ]]; then
    shift
fi

# The CPUs this process may run on (nproc honours the affinity mask; without the OMP_* variables,
# which it would report instead).
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null \
    || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)"
gpus=0
if command -v nvidia-smi >/dev/null 2>&1; then
    gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
workers="${MEGARL_LOCAL_WORKERS:-}"
if [[ -z "$workers" ]]; then
    if [[ "$gpus" -gt 0 ]]; then workers="$gpus"; else workers=2; fi
fi
if ! [[ "$workers" =~ ^[1-9][0-9]*$ ]]; then
    echo "error: MEGARL_LOCAL_WORKERS='$workers' must be a positive integer" >&2
    exit 2
fi
threads=$((cores / workers))
if [[ "$threads" -lt 1 ]]; then threads=1; fi

export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$threads}"
export MKL_NUM_THREADS="${MKL_NUM_THREADS:-$OMP_NUM_THREADS}"
export TOKENIZERS_PARALLELISM="${TOKENIZERS_PARALLELISM:-false}"
export PYTHONUNBUFFERED=1

read -r -a entrypoint <<< "${MEGARL_ENTRYPOINT:-megarl train}"
# `megarl` from PATH (an activated environment), else from this checkout's .venv (what `make install`
# makes). Only a regular file counts: in the repository root, with "." or an empty entry in PATH,
# bash would otherwise find the package directory megarl/ and fail with "Is a directory".
if [[ "${entrypoint[0]:-}" == "megarl" ]]; then
    found="$(type -P megarl || true)"
    if [[ -z "$found" || ! -f "$found" || ! -x "$found" ]]; then
        repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
        if [[ -f "$repo/.venv/bin/megarl" && -x "$repo/.venv/bin/megarl" ]]; then
            entrypoint[0]="$repo/.venv/bin/megarl"
        else
            echo "error: megarl is not on PATH and $repo/.venv/bin/megarl does not exist; run \`make install\`" \
                "in $repo (or activate the environment that has megarl, or set MEGARL_ENTRYPOINT)" >&2
            exit 127
        fi
    fi
fi
cmd=("${entrypoint[@]}" "$config" "$@")

if [[ "$dry_run" != "0" ]]; then
    echo "# $cores cores, $gpus GPUs, $workers workers"
    echo "OMP_NUM_THREADS=$OMP_NUM_THREADS MKL_NUM_THREADS=$MKL_NUM_THREADS TOKENIZERS_PARALLELISM=$TOKENIZERS_PARALLELISM"
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
fi
exec "${cmd[@]}"
