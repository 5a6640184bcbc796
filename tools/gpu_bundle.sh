#!/usr/bin/env bash
# Build the offline GPU bundle: one archive (at most 60 MiB) with megarl and every Python package it
# needs that a stock CUDA PyTorch image lacks (Ray pruned to what megarl runs, Megatron-Core,
# omegaconf, tensordict, datasets and their requirements), for CPython on x86-64 Linux.
# tools/gpu_check.sh unpacks it on the GPU machine and validates megarl there.
#
# Usage: tools/gpu_bundle.sh [--python 3.12] [--out DIR] [--level 9e]
#   --python X.Y   target CPython (default 3.12, the reference image's; 3.11 for a dry run here)
#   --out DIR      output folder (default dist/gpu-bundle in the repository): the archive
#                  megarl-gpu-bundle-cpXY.tar.xz, its CONTENTS.txt, and the wheel cache wheels-cpXY/
#   --level L      xz preset (default 9e: smallest, ~2 min on one core; 1 is ~10x faster and larger)
# Needs: python3 (>= 3.11) with pip, tar, xz, and a package index (or a warm pip cache).
# Package list, pruning and layout: tools/gpu_bundle.py.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python_version="3.12"
out_dir="${repo_root}/dist/gpu-bundle"
level="9e"
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python_version="$2"; shift 2 ;;
        --out) out_dir="$2"; shift 2 ;;
        --level) level="$2"; shift 2 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_bundle: unknown argument $1" >&2; exit 2 ;;
    esac
done
if ! [[ "${python_version}" =~ ^3\.[0-9]+$ ]]; then
    echo "gpu_bundle: --python takes X.Y, got ${python_version}" >&2
    exit 2
fi
host_python="${PYTHON:-python3}"
tag="cp${python_version/./}"
name="megarl-gpu-bundle-${tag}"
limit_bytes=$(( 60 * 1024 * 1024 ))
start=$(date +%s)

mkdir -p "${out_dir}"
out_dir="$(cd "${out_dir}" && pwd)"
wheels="${out_dir}/wheels-${tag}"
stage="${out_dir}/stage-${tag}"
archive="${out_dir}/${name}.tar.xz"
mkdir -p "${wheels}"

# 1. Wheels for the target interpreter, no dependency resolution (the list is complete and pinned;
#    assemble checks that). Already downloaded ones are reused; pip's cache serves the rest offline.
mapfile -t packages < <("${host_python}" "${repo_root}/tools/gpu_bundle.py" packages)
echo "[gpu_bundle] downloading ${#packages[@]} wheels for CPython ${python_version} (x86-64 manylinux)"
"${host_python}" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "${python_version}" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "${wheels}" "${packages[@]}"

# 2. Unpack, prune Ray, add megarl's source tree, check the requirement graph (tools/gpu_bundle.py).
"${host_python}" "${repo_root}/tools/gpu_bundle.py" assemble --wheels "${wheels}" --stage "${stage}" \
    --python-version "${python_version}" --name "${name}"

# 3. One archive. A single xz block: Ray's three large binaries share much code, which one
#    dictionary over the whole stream finds (two blocks cost ~15%).
echo "[gpu_bundle] compressing (xz -${level})"
tar -C "${stage}" --sort=name --owner=0 --group=0 --numeric-owner -cf - "${name}" \
    | xz "-${level}" -T1 -c >"${archive}.part"
mv "${archive}.part" "${archive}"
rm -rf "${stage}"

# 4. What it holds, and its size against the limit.
size=$(stat -c %s "${archive}")
"${host_python}" - "${archive}" "${size}" "${limit_bytes}" >"${out_dir}/${name}.CONTENTS.txt" <<'PY'
import collections, sys, tarfile, json
archive, size, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
top = collections.Counter()
count = collections.Counter()
manifest = None
with tarfile.open(archive, "r:xz") as tar:
    for m in tar:
        parts = m.name.split("/")
        if m.name.endswith("/MANIFEST.json") and len(parts) == 2:
            manifest = json.load(tar.extractfile(m))
        if m.isfile() and len(parts) >= 3:
            key = "/".join(parts[1:4 if parts[2] == "ray" and len(parts) > 4 else 3])
            top[key] += m.size
            count[key] += 1
print(f"{archive}: {size / 2**20:.1f} MiB (limit {limit / 2**20:.0f} MiB), CPython {manifest['python']}")
print("packages (site/):")
for n, info in manifest["packages"].items():
    print(f"  {n} {info['version']}")
print("largest entries (unpacked):")
for key, b in top.most_common(15):
    print(f"  {b / 2**20:8.1f} MiB  {count[key]:6d} files  {key}")
print(f"pruned ({manifest['pruned_bytes'] / 2**20:.1f} MiB unpacked):")
for r in manifest["pruned"]:
    print(f"  {r['bytes'] / 2**20:7.2f} MiB  {r['path']}  ({r['why']})")
print("left out on purpose:")
for n, why in manifest["left_out"].items():
    print(f"  {n}: {why}")
print(f"src/: {manifest['src_files']} files of megarl's source tree ({manifest['src_bytes'] / 2**20:.1f} MiB)")
PY
cat "${out_dir}/${name}.CONTENTS.txt"
echo "[gpu_bundle] ${archive}: ${size} bytes ($(awk "BEGIN {printf \"%.1f\", ${size} / 1048576}") MiB) in $(( $(date +%s) - start )) s"
if [ "${size}" -gt "${limit_bytes}" ]; then
    echo "[gpu_bundle] FAILED: larger than the 60 MiB limit" >&2
    exit 1
fi
