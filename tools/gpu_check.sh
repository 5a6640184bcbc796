#!/usr/bin/env bash
# One-command GPU validation of megarl from the offline bundle (built by tools/gpu_bundle.sh).
#
# Usage: gpu_check.sh [BUNDLE.tar.xz] --out DIR [options]
#   BUNDLE            the archive. It is unpacked into a private directory (no network, no pip index);
#                     the packages go on PYTHONPATH in front of the image's, and the image's torch is
#                     used. Without BUNDLE the current environment and this script's checkout are checked.
#   --out DIR         results: summary.txt, summary.json, logs/<step>.log, train/run/metrics.jsonl,
#                     bench/gpu.json, gpu-tests.xml
#   --dry-run         CPU machine: no CUDA needed. Runs the CPU-checkable parts (imports, Ray, the unit
#                     tests of the GPU modules, the gpu tier (skips), a 2-step CPU fp32 train, the
#                     benchmark section's skip record)
#   --python PY       the image's interpreter (default: python3)
#   --workdir DIR     unpack here instead; DIR must be new or empty (a non-empty DIR is refused). At exit
#                     (unless --keep) only what the check put there is removed: DIR/site, DIR/src, DIR/bin,
#                     DIR/scratch, DIR/env.sh, DIR/MANIFEST.json, DIR/gpu_check.sh, then DIR itself if the
#                     check created it and it is then empty (an --out inside DIR stays).
#                     Default: a new private directory under ${TMPDIR:-/tmp}, removed whole at exit
#   --keep            keep the unpacked directory
#   --steps N         training steps, a positive whole number (default 5 on GPU, 2 in the dry run)
#   --budget S        whole seconds for the whole check (default 600). A step gets at most what is left
#                     less the 20 s it may take to be killed after its stop signal, so the check ends
#                     inside the budget (plus the summary's second or two)
#   --probs-diff-tol X  largest accepted |rollout - trainer| log-prob gap, a positive number
#                     (default 0.1 bf16 GPU, 1e-3 fp32 CPU)
#   --skip A,B        steps to leave out, from: env deps imports ray unit gpu-tests train bench
#   --unpack-only DIR unpack BUNDLE into DIR, write DIR/env.sh and DIR/bin/{megarl,ray}, and stop
#
# Steps (each one's failure is recorded and the next step runs):
#   env        interpreter matches the bundle, torch imports, CUDA visible (not in the dry run)
#   deps       megarl's requirement graph is satisfied (the image's torch/transformers pins are notes)
#   imports    every megarl module, Ray, Megatron-Core, omegaconf, tensordict, datasets import
#   ray        a local Ray cluster from the bundle: task, placement group, actor (with a GPU on GPU)
#   unit       unit tests of the GPU modules and a few CPU unit tiers
#   gpu-tests  pytest -m gpu tests/gpu
#   train      `megarl train` GRPO on configs/quickstart_cpu.yaml (GPU: cuda, bf16, TP=1), then the
#              run's metrics.jsonl: reward and losses finite, weight sync moved exactly the plan's
#              minimum bytes, rollout vs trainer log-prob gap within tolerance
#   bench      benchmarks/gpu.py (MFU of the train step, rollout tokens/s, weight sync) into bench/;
#              bench/gpu.json is rewritten after each part, so a bench step stopped at its cap keeps
#              the parts finished so far (the others marked not finished) and their bench/gpu/*.json
# Exit status: 0 when every step passed, 1 otherwise (2: a bad option); the summary lists each step,
# and a step of the list above with no recorded outcome counts as failed.
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }

# The steps, in the order they run; --skip names and the summary are checked against this list.
STEPS=(env deps imports ray unit gpu-tests train bench)
# What the check puts into a --workdir DIR, and so all that it removes there.
WORKDIR_ENTRIES=(site src bin scratch env.sh MANIFEST.json gpu_check.sh)
# `timeout -k` sends KILL this long after a step's TERM; the budget keeps it free.
KILL_GRACE_S=20

bad_option() {  # bad_option MESSAGE: exit 2, as for any other misuse of the command line
    echo "gpu_check: $1" >&2
    exit 2
}
need_value() {  # need_value FLAG NARGS: the flag must be followed by a value
    [ "$2" -ge 2 ] || bad_option "$1 needs a value"
}
positive_int() {  # positive_int FLAG VALUE. At most 9 digits: bash arithmetic on it cannot overflow.
    [[ "$2" =~ ^[1-9][0-9]{0,8}$ ]] ||
        bad_option "$1 must be a positive whole number (at most 9 digits), got '$2'"
}
positive_number() {  # positive_number FLAG VALUE: a decimal, optionally with an exponent, above 0
    [[ "$2" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?$ ]] && [[ "$2" =~ [1-9] ]] ||
        bad_option "$1 must be a positive number such as 0.1 or 1e-3, got '$2'"
}

bundle=""
out=""
dry_run=0
python_bin="python3"
workdir=""
keep=0
steps=""
budget=600
skip=","
unpack_only=""
probs_diff_tol=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out|--python|--workdir|--steps|--budget|--probs-diff-tol|--skip|--unpack-only) need_value "$1" $# ;;&
        --out) out="$2"; shift 2 ;;
        --dry-run) dry_run=1; shift ;;
        --python) python_bin="$2"; shift 2 ;;
        --workdir) workdir="$2"; shift 2 ;;
        --keep) keep=1; shift ;;
        --steps) positive_int --steps "$2"; steps="$2"; shift 2 ;;
        --budget) positive_int --budget "$2"; budget="$2"; shift 2 ;;
        --probs-diff-tol) positive_number --probs-diff-tol "$2"; probs_diff_tol="$2"; shift 2 ;;
        --skip) skip=",$2,"; shift 2 ;;
        --unpack-only) unpack_only="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        -*) echo "gpu_check: unknown option $1" >&2; usage >&2; exit 2 ;;
        *) bundle="$1"; shift ;;
    esac
done
if [ -z "${out}" ] && [ -z "${unpack_only}" ]; then
    echo "gpu_check: --out DIR is required" >&2
    exit 2
fi
IFS=, read -r -a skipped <<<"${skip}"
for name in "${skipped[@]}"; do
    [ -z "${name}" ] && continue
    [[ " ${STEPS[*]} " == *" ${name} "* ]] || bad_option "--skip: unknown step '${name}'; the steps are: ${STEPS[*]}"
done
python_abs="$(command -v "${python_bin}" || true)"
if [ -z "${python_abs}" ]; then
    echo "gpu_check: no interpreter ${python_bin}" >&2
    exit 2
fi
# Absolute: every step runs after a cd into the scratch directory, and env.sh and bin/ name it.
python_abs="$(cd "$(dirname "${python_abs}")" && pwd)/$(basename "${python_abs}")"
# A user's --workdir must be new or empty: the check unpacks over it and cleans up after itself
# there, so anything already in it could be overwritten. Checked before --out is made, which may
# lie inside it.
if [ -n "${workdir}" ] && [ -n "${bundle}" ] && [ -z "${unpack_only}" ] && [ -e "${workdir}" ]; then
    if [ ! -d "${workdir}" ]; then
        bad_option "--workdir ${workdir}: exists and is not a directory"
    elif [ -n "$(ls -A "${workdir}")" ]; then
        bad_option "--workdir ${workdir}: not empty; give a new or empty directory (the check unpacks the bundle there)"
    fi
fi
start_all=$(date +%s)

# --- unpack ---------------------------------------------------------------------------------
# The archive holds one folder (site/, src/, MANIFEST.json); it is unpacked without it.
unpack() {
    local archive="$1" dest="$2"
    mkdir -p "${dest}" && chmod 700 "${dest}" || return 1
    dest="$(cd "${dest}" && pwd)"  # env.sh and bin/ name it: absolute, so they work from any directory
    if command -v xz >/dev/null 2>&1; then
        tar -xJf "${archive}" -C "${dest}" --strip-components=1 --no-same-owner || return 1
    else  # no xz tool: Python's lzma does the same
        "${python_abs}" - "${archive}" "${dest}" <<'PY' || return 1
import sys, tarfile
with tarfile.open(sys.argv[1], "r:xz") as tar:
    for member in tar.getmembers():
        member.name = member.name.partition("/")[2]
        if member.name:
            tar.extract(member, sys.argv[2], filter="data")
PY
    fi
    # Entry points for the image's interpreter (what `pip install` would put on PATH).
    mkdir -p "${dest}/bin"
    cat >"${dest}/env.sh" <<EOF
# Source this to use the unpacked megarl bundle with ${python_abs}.
export PYTHONPATH="${dest}/src:${dest}/site\${PYTHONPATH:+:\${PYTHONPATH}}"
export PATH="${dest}/bin:\${PATH}"
EOF
    local name module
    for name in megarl ray; do
        module="megarl.cli"
        [ "${name}" = ray ] && module="ray.scripts.scripts"
        cat >"${dest}/bin/${name}" <<EOF
#!/usr/bin/env bash
export PYTHONPATH="${dest}/src:${dest}/site\${PYTHONPATH:+:\${PYTHONPATH}}"
exec "${python_abs}" -m ${module} "\$@"
EOF
        chmod +x "${dest}/bin/${name}"
    done
}

if [ -n "${unpack_only}" ]; then
    [ -n "${bundle}" ] || { echo "gpu_check: --unpack-only needs BUNDLE" >&2; exit 2; }
    unpack "${bundle}" "${unpack_only}" || { echo "gpu_check: unpacking ${bundle} failed" >&2; exit 1; }
    echo "unpacked into ${unpack_only}; use: source ${unpack_only}/env.sh && megarl --help"
    exit 0
fi

# shellcheck disable=SC2329 # run by the EXIT trap
clean_workdir() {  # the user's --workdir: remove only the check's own entries (WORKDIR_ENTRIES)
    local entry
    for entry in "${WORKDIR_ENTRIES[@]}"; do
        rm -rf "${workdir:?}/${entry}"
    done
    if [ "${workdir_created}" = 1 ]; then
        rmdir "${workdir}" 2>/dev/null || true
    fi
}

mkdir -p "${out}/logs" || exit 2
out="$(cd "${out}" && pwd)"
bundle_python=""
if [ -n "${bundle}" ]; then
    bundle="$(cd "$(dirname "${bundle}")" && pwd)/$(basename "${bundle}")"
    workdir_created=0
    if [ -z "${workdir}" ]; then
        workdir="$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check.XXXXXX")" || exit 2
        own_workdir=1  # private to this run: removed whole
    else
        own_workdir=0
        [ -d "${workdir}" ] || workdir_created=1
        mkdir -p "${workdir}" || exit 2
    fi
    # Absolute before src, scratch and check are derived from it: the steps run from scratch/.
    workdir="$(cd "${workdir}" && pwd)"
    if [ "${keep}" = 0 ] && [ "${own_workdir}" = 1 ]; then
        trap 'rm -rf "${workdir}"' EXIT
    elif [ "${keep}" = 0 ]; then
        # The user's directory: only the check's own entries go, and the directory if the check
        # made it and nothing else (an --out inside it, say) is left there.
        trap clean_workdir EXIT
    fi
    echo "[gpu_check] unpacking ${bundle} into ${workdir}"
    if ! unpack "${bundle}" "${workdir}"; then
        echo "[gpu_check] FAILED to unpack ${bundle}" >&2
        exit 1
    fi
    src="${workdir}/src"
    # shellcheck disable=SC1091
    source "${workdir}/env.sh"
    bundle_python="$("${python_abs}" -c 'import json,sys; print(json.load(open(sys.argv[1]))["python"])' \
        "${workdir}/MANIFEST.json" 2>/dev/null || true)"
    scratch="${workdir}/scratch"
else
    src="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    scratch="$(mktemp -d "${TMPDIR:-/tmp}/megarl-gpu-check.XXXXXX")"
    if [ "${keep}" = 0 ]; then
        trap 'rm -rf "${scratch}"' EXIT
    fi
    echo "[gpu_check] no bundle: checking ${src} with ${python_abs} in place"
fi
mkdir -p "${scratch}"

# Offline, and nothing written outside the private directory and --out.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_HOME="${scratch}/hf-home"
export PYTHONNOUSERSITE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false MPLBACKEND=Agg
export PIP_NO_INDEX=1

if [ "${dry_run}" = 1 ]; then
    mode="dry-run (CPU)"
    device=cpu
    steps="${steps:-2}"
    probs_diff_tol="${probs_diff_tol:-1e-3}"  # fp32: HF rollout and Megatron trainer agree to ~5e-7 here
    cuda_flag=""
    gpus=0
else
    mode="gpu"
    device=cuda
    steps="${steps:-5}"
    probs_diff_tol="${probs_diff_tol:-0.1}"   # bf16: ~0.009 measured on CPU; GPU kernels differ more
    cuda_flag="--cuda"
    gpus=1
fi
check="${src}/tools/gpu_check.py"
# The train and bench steps are functions run under `timeout` in a child bash: export what they use.
export python_abs src scratch out device steps probs_diff_tol cuda_flag check

# --- steps ------------------------------------------------------------------------------------
names=()
statuses=()
seconds=()

run_step() {  # run_step NAME TIMEOUT_S -- COMMAND...: logs to logs/NAME.log, records the outcome
    local name="$1" limit="$2"
    shift 3
    local log="${out}/logs/${name}.log" left status t0 rc
    if [[ "${skip}" == *",${name},"* ]]; then
        names+=("${name}"); statuses+=("skipped"); seconds+=(0)
        echo "[gpu_check] ${name}: skipped (--skip)"
        return
    fi
    # What is left of the budget, less the kill grace: a step that ignores its TERM is killed by then.
    left=$(( budget - ($(date +%s) - start_all) - KILL_GRACE_S ))
    if [ "${left}" -lt 10 ]; then
        names+=("${name}"); statuses+=("FAILED (no time left of the ${budget} s budget)"); seconds+=(0)
        echo "[gpu_check] ${name}: not run, the ${budget} s budget is spent"
        return
    fi
    [ "${limit}" -gt "${left}" ] && limit="${left}"
    echo "[gpu_check] ${name} (at most ${limit} s) ..."
    t0=$(date +%s)
    # timeout signals its whole process group, so a step's children (Ray, workers) get it too.
    (cd "${scratch}" && timeout -k "${KILL_GRACE_S}" "${limit}" bash -c '"$@"' step "$@") >"${log}" 2>&1
    rc=$?
    if [ "${rc}" = 0 ]; then
        status="passed"
    elif [ "${rc}" = 124 ] || [ "${rc}" = 137 ]; then
        status="FAILED (timed out after ${limit} s)"
    else
        status="FAILED (exit ${rc})"
    fi
    names+=("${name}"); statuses+=("${status}"); seconds+=($(( $(date +%s) - t0 )))
    echo "[gpu_check] ${name}: ${status} in $(( $(date +%s) - t0 )) s (log: ${log})"
    if [ "${rc}" != 0 ]; then
        tail -n 25 "${log}" | sed 's/^/    | /'
    fi
}

# shellcheck disable=SC2329 # run by run_step
step_train() {
    local data="${scratch}/data" run="${out}/train/run"
    rm -rf "${run}"
    "${python_abs}" -m megarl.cli data make arithmetic --out "${data}" --tokenizer-out "${data}/tokenizer" \
        --num-operands 2 --min-value 0 --max-value 4 --operators + --train-size 400 --val-size 32 || return 1
    local overrides=()
    mapfile -t overrides < <("${python_abs}" "${check}" train-overrides --device "${device}" --data "${data}" \
        --run-dir "${run}" --steps "${steps}" --devices 1)
    [ "${#overrides[@]}" -gt 0 ] || return 1
    echo "megarl train ${src}/configs/quickstart_cpu.yaml ${overrides[*]}"
    "${python_abs}" -m megarl.cli train "${src}/configs/quickstart_cpu.yaml" "${overrides[@]}" || return 1
    # shellcheck disable=SC2086 # cuda_flag is empty or one word; with it the colocated peak ratio is required
    "${python_abs}" "${check}" metrics "${run}" --steps "${steps}" --probs-diff-tol "${probs_diff_tol}" \
        --memory-out "${out}/bench/memory_phases.json" ${cuda_flag}
}

# shellcheck disable=SC2329 # run by run_step
step_bench() {
    "${python_abs}" "${src}/benchmarks/gpu.py" --out "${out}/bench/gpu.json" --timeout 150 || return 1
    # shellcheck disable=SC2086 # cuda_flag is empty or one word
    "${python_abs}" "${check}" bench-result "${out}/bench/gpu.json" ${cuda_flag}
}
export -f step_train step_bench

# Unit tests run from src/ so that pyproject.toml's pytest settings (markers) apply.
pytest_cmd=("${python_abs}" -m pytest -p no:cacheprovider --rootdir "${src}" -c "${src}/pyproject.toml" -q)

echo "[gpu_check] mode: ${mode}; python ${python_abs}; results in ${out}"
# shellcheck disable=SC2086 # cuda_flag is empty or one word
run_step env 120 -- "${python_abs}" "${check}" env ${cuda_flag} ${bundle_python:+--bundle-python "${bundle_python}"}
run_step deps 60 -- "${python_abs}" "${check}" deps
run_step imports 300 -- "${python_abs}" "${check}" imports
run_step ray 180 -- "${python_abs}" "${check}" ray --gpus "${gpus}"
run_step unit 300 -- "${pytest_cmd[@]}" -m "not gpu" "${src}/tests/unit/gpu_modules" "${src}/tests/unit/config" \
    "${src}/tests/unit/algorithms"
run_step gpu-tests 300 -- "${pytest_cmd[@]}" -m gpu -rs --junitxml "${out}/gpu-tests.xml" "${src}/tests/gpu"
run_step train 300 -- step_train
run_step bench 360 -- step_bench

# --- summary ----------------------------------------------------------------------------------
# Every step of the list must have an outcome: one aborted inside run_step (a shell error) left none,
# and must not read as passed.
for name in "${STEPS[@]}"; do
    if [[ " ${names[*]} " != *" ${name} "* ]]; then
        names+=("${name}"); statuses+=("FAILED (no outcome recorded: the step was aborted)"); seconds+=(0)
        echo "[gpu_check] ${name}: FAILED, no outcome was recorded" >&2
    fi
done
failed=0
for status in "${statuses[@]}"; do
    [[ "${status}" == FAILED* ]] && failed=1
done
{
    echo "megarl GPU check: ${mode}, $(( $(date +%s) - start_all )) s in all"
    echo "bundle: ${bundle:-none (in place)}; python: ${python_abs}"
    for i in "${!names[@]}"; do
        printf '  %-10s %-45s %5s s\n' "${names[$i]}" "${statuses[$i]}" "${seconds[$i]}"
    done
    echo "memory phases: the train step runs colocated with every actor offload key on; with CUDA its" \
        "perf/colocated_peak_ratio must be <= 1.1 (per-phase peaks: ${out}/bench/memory_phases.json)"
    echo "logs: ${out}/logs; benchmark JSON: ${out}/bench; training metrics: ${out}/train/run/metrics.jsonl"
    if [ "${failed}" = 1 ]; then echo "RESULT: FAILED"; else echo "RESULT: passed"; fi
} | tee "${out}/summary.txt"
"${python_abs}" - "${out}/summary.json" "${mode}" "${bundle}" "$(( $(date +%s) - start_all ))" \
    "${names[@]}" -- "${statuses[@]}" -- "${seconds[@]}" <<'PY'
import json, sys
path, mode, bundle, total, *rest = sys.argv[1:]
names = rest[:rest.index("--")]
rest = rest[len(names) + 1:]
statuses, seconds = rest[:len(names)], rest[len(names) + 1:]
steps = [{"name": n, "status": s, "seconds": int(t)} for n, s, t in zip(names, statuses, seconds)]
json.dump({"mode": mode, "bundle": bundle or None, "seconds": int(total), "steps": steps,
           "passed": not any(s["status"].startswith("FAILED") for s in steps),
           "not_covered": [] if mode != "dry-run (CPU)" else ["colocated peak ratio: device memory needs CUDA"]},
          open(path, "w"), indent=1)
PY
exit "${failed}"
