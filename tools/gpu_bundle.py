"""The offline GPU bundle: which packages it holds, how Ray is pruned, and how the tree is assembled.

`tools/gpu_bundle.sh` is the entry point; it downloads the wheels and compresses the result. This
helper does the rest and only needs the standard library (plus `packaging`, taken from pip when it
is not installed on its own):

    python tools/gpu_bundle.py packages                      # pinned NAME==VERSION lines to download
    python tools/gpu_bundle.py assemble --wheels W --stage S --python-version 3.12 --name N

The target image ("the image") already has Python, torch and the packages in IMAGE_PACKAGES; the
bundle holds megarl and every runtime dependency that the image lacks (BUNDLE_PACKAGES). `assemble`
refuses to finish when a runtime requirement of megarl or of a bundled package is neither bundled,
in the image, nor deliberately left out (LEFT_OUT), so a new dependency cannot go missing silently.

Layout of the bundle (one top-level folder, NAME):
    NAME/site/       third-party packages, unpacked wheels (Ray pruned), and megarl's dist-info
    NAME/src/        megarl's source tree: megarl/, model_specs/, configs/, tests/, benchmarks/, tools/, ...
    NAME/gpu_check.sh   a copy of tools/gpu_check.sh, to take out of the archive first
    NAME/MANIFEST.json  packages and versions, what was pruned, sizes
"""

from __future__ import annotations

import argparse
import email.parser
import fnmatch
import json
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path
from typing import Any, Iterable

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a bare interpreter: pip vendors the same library
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name  # type: ignore[no-redef]

REPO_ROOT = Path(__file__).resolve().parents[1]
SIZE_LIMIT_BYTES = 60 * 1024 * 1024

# Runtime dependencies of megarl that a stock CUDA PyTorch image lacks, pinned to the versions the
# project's environment is tested with (pyproject.toml pins the direct ones; the rest are their
# hard requirements, at the versions that environment resolved).
BUNDLE_PACKAGES: dict[str, str] = {
    # direct dependencies of megarl
    "megatron-core": "0.16.1",
    "ray": "2.60.0",
    "tensordict": "0.15.3",
    "omegaconf": "2.4.0",  # vendors antlr4 (no antlr4-python3-runtime needed since 2.4)
    "datasets": "5.2.0",  # the prompt dataset reads parquet through it (megarl/data/dataset.py)
    # tensordict
    "cloudpickle": "3.1.2",
    "pyvers": "0.2.3",
    # datasets
    "dill": "0.4.1",
    "multiprocess": "0.70.19",
    "xxhash": "4.1.0",
    # ray (core, no extras)
    "msgpack": "1.2.4",
    "protobuf": "7.36.2",
    "jsonschema": "4.26.0",
    "jsonschema-specifications": "2025.9.1",
    "referencing": "0.37.0",
    "rpds-py": "2026.9.1",
    "attrs": "26.1.0",
    "requests": "2.34.2",
    "charset-normalizer": "3.5.2",
    "urllib3": "2.8.0",
    # (aiohttp and its dependencies, which Ray's runtime-env agent uses, ship inside Ray's wheel)
}

# What the reference image has: Python 3.12, torch 2.11 (CUDA 13), transformers 5.17, safetensors,
# numpy, pyarrow, pandas, pyyaml, psutil, matplotlib, tqdm, pytest, hypothesis, and what those
# pull in (as pip resolves them; names only: the image's versions are whatever it ships).
IMAGE_PACKAGES: frozenset[str] = frozenset(canonicalize_name(n) for n in (
    "torch", "transformers", "safetensors", "numpy", "pyarrow", "pandas", "pyyaml", "psutil",
    "matplotlib", "tqdm", "pytest", "hypothesis",
    # torch
    "filelock", "typing-extensions", "sympy", "mpmath", "networkx", "jinja2", "markupsafe", "fsspec",
    "setuptools", "triton",
    # transformers
    "huggingface-hub", "tokenizers", "regex", "packaging", "hf-xet", "httpx", "httpcore", "h11", "anyio",
    "idna", "certifi", "typer", "typer-slim", "click", "shellingham", "rich", "markdown-it-py", "mdurl",
    "pygments", "annotated-doc", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
    # pandas, matplotlib
    "python-dateutil", "six", "tzdata", "pytz", "contourpy", "cycler", "fonttools", "kiwisolver",
    "pillow", "pyparsing",
    # pytest, hypothesis
    "iniconfig", "pluggy", "sortedcontainers",
))

# Requirements left out on purpose: dependency name (or "name[extra]") -> why.
LEFT_OUT: dict[str, str] = {
    "mlflow": "a tracking backend only (megarl/tracking/mlflow_backend.py, imported when "
              "tracking.backends lists mlflow); the GPU check runs with tracking.backends=[console,jsonl]",
    "ray[default]": "the dashboard, metrics exporters and cluster launcher extras; megarl starts Ray with "
                    "include_dashboard=False and Ray runs without them (its minimal install)",
}

# Pruned from the unpacked packages: pattern (relative to site/, see `path_matches`) -> why. None of
# it is imported on megarl's paths: `gpu_check.sh` imports every megarl module and runs Ray (tasks,
# placement groups, actors, a training run) from the pruned tree.
PRUNE: dict[str, str] = {
    "ray/jars": "Ray's Java worker (megarl has no Java tasks)",
    "ray/dashboard/client": "the dashboard's web front end (megarl starts Ray without the dashboard)",
    "ray/rllib": "RLlib", "ray/tune": "Tune", "ray/serve": "Serve", "ray/data": "Ray Data",
    "ray/train": "Ray Train", "ray/air": "AIR (Train/Tune glue)", "ray/llm": "Ray LLM",
    "ray/workflow": "Ray Workflows",
    "**/tests": "test suites of third-party packages",
    "*.data": "wheel data folders (console scripts of dill; bin/ wrappers are made at unpack)",
}

# Parts of the repository copied into src/ (megarl runs from a source tree: model_specs/ and
# benchmarks/ are found next to the package).
SOURCE_PATHS = ("megarl", "model_specs", "configs", "tests", "benchmarks", "tools", "launch", "mk",
                "pyproject.toml", "README.md", "Makefile")
SOURCE_EXCLUDE = ("benchmarks/results/*", "*/__pycache__/*", "*.pyc", "*.egg-info/*")


def target_environment(python_version: str) -> dict[str, str]:
    """PEP 508 marker environment of the target: CPython `python_version` on x86-64 Linux."""
    env = dict(default_environment())
    env.update(python_version=python_version, python_full_version=f"{python_version}.0",
               implementation_name="cpython", platform_python_implementation="CPython",
               sys_platform="linux", platform_system="Linux", platform_machine="x86_64", os_name="posix")
    return env


def runtime_requirements(requires: Iterable[str], env: dict[str, str], extras: Iterable[str] = ()) -> list[Requirement]:
    """The requirements that apply on the target (markers evaluated; with `extras` requested)."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is None:
            out.append(req)
            continue
        if any(req.marker.evaluate({**env, "extra": extra}) for extra in ("", *extras)):
            out.append(req)
    return out


def requirement_gaps(roots: dict[str, list[str]], available: dict[str, list[str]], image: Iterable[str],
                     left_out: Iterable[str], env: dict[str, str]) -> list[str]:
    """Walk the requirement graph from `roots` (name -> Requires-Dist lines); return a line per
    requirement that is neither `available` (bundled: name -> its Requires-Dist), in `image`, nor
    `left_out` ("name" or "name[extra]"). The bundle installs no extras: a requirement with an extra
    is a gap unless LEFT_OUT names "name[extra]"."""
    image = {canonicalize_name(n) for n in image}
    left_names = {canonicalize_name(n) for n in left_out if "[" not in n}
    left_extras = {(canonicalize_name(n.split("[")[0]), n.split("[")[1].rstrip("]")) for n in left_out if "[" in n}
    graph = {canonicalize_name(k): v for k, v in {**available, **roots}.items()}
    gaps: list[str] = []
    seen: set[str] = set()
    todo = [canonicalize_name(n) for n in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for req in runtime_requirements(graph.get(name, []), env):
            dep = canonicalize_name(req.name)
            if dep in left_names:
                continue
            for extra in sorted(req.extras):
                if (dep, extra) not in left_extras:
                    gaps.append(f"{name} needs {req} (extra [{extra}] is neither bundled nor listed in LEFT_OUT)")
            if dep in graph:
                todo.append(dep)
            elif dep not in image:
                gaps.append(f"{name} needs {req}: not bundled, not in the image, not in LEFT_OUT")
    return gaps


def read_metadata(dist_info: Path) -> email.message.Message:
    return email.parser.Parser().parsestr((dist_info / "METADATA").read_text(encoding="utf-8"))


def _dist_infos(site: Path) -> dict[str, Path]:
    out = {}
    for d in sorted(site.glob("*.dist-info")):
        out[canonicalize_name(read_metadata(d)["Name"])] = d
    return out


def unpack_wheels(wheels: list[Path], site: Path) -> None:
    """Unzip wheels into `site` (what `pip install --target` does, without running anything);
    `.data/purelib` and `.data/platlib` are merged into `site`, other `.data` parts stay for PRUNE."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                dest = site / info.filename
                if not dest.resolve().is_relative_to(site.resolve()):
                    raise SystemExit(f"{wheel.name}: refusing path outside the target: {info.filename}")
                zf.extract(info, site)
                mode = (info.external_attr >> 16) & 0o777
                if mode:
                    os.chmod(dest, mode)
    for data in site.glob("*.data"):
        for part in ("purelib", "platlib"):
            if (data / part).is_dir():
                shutil.copytree(data / part, site, dirs_exist_ok=True)
                shutil.rmtree(data / part)


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def path_matches(rel: str, pattern: str) -> bool:
    """`pattern` against a path relative to site/: segment by segment (`*` stays within one folder
    name); a leading `**/` lets the rest match at any depth."""
    parts, pats = rel.split("/"), pattern.split("/")
    if pats[0] == "**":
        pats = pats[1:]
        parts = parts[-len(pats):] if len(parts) >= len(pats) else []
    return len(parts) == len(pats) and all(fnmatch.fnmatchcase(a, b) for a, b in zip(parts, pats))


def prune(site: Path, rules: dict[str, str] = PRUNE) -> list[dict[str, Any]]:
    """Delete what `rules` names (see `path_matches`); return what went, with sizes."""
    removed = []
    for path in sorted(site.rglob("*")):
        if not path.exists() and not path.is_symlink():
            continue  # inside a folder removed already
        rel = path.relative_to(site).as_posix()
        for pattern, why in rules.items():
            if path_matches(rel, pattern):
                size = _tree_size(path)
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
                removed.append({"path": rel, "bytes": size, "why": why})
                break
    return removed


def megarl_metadata(pyproject: Path) -> tuple[str, str, str]:
    """megarl's dist-info files from pyproject.toml: (METADATA, entry_points.txt, version)."""
    import tomllib  # here, not at the top: Python >= 3.11 builds the bundle; gpu_check imports this on any

    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    version = project.get("version") or re.search(
        r'__version__ = "([^"]+)"', (pyproject.parent / "megarl" / "__init__.py").read_text()).group(1)
    lines = ["Metadata-Version: 2.1", f"Name: {project['name']}", f"Version: {version}",
             f"Summary: {project.get('description', '')}", f"Requires-Python: {project.get('requires-python', '')}"]
    lines += [f"Requires-Dist: {r}" for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        lines.append(f"Provides-Extra: {extra}")
        for r in reqs:
            req = Requirement(r)
            marker = f"({req.marker}) and " if req.marker else ""
            req.marker = None
            lines.append(f'Requires-Dist: {req}; {marker}extra == "{extra}"')
    scripts = project.get("scripts", {})
    entry_points = "[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
    return "\n".join(lines) + "\n", entry_points, version


def _source_files(repo: Path) -> list[str]:
    """Repository files for src/: tracked and untracked-but-not-ignored (git), else a folder walk."""
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-co", "--exclude-standard", "-z", "--",
                                 *SOURCE_PATHS], capture_output=True, check=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        listed = []
        for top in SOURCE_PATHS:
            p = repo / top
            listed += [str(f.relative_to(repo)) for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file()]
    return sorted(f for f in listed if f and (repo / f).is_file()
                  and not any(fnmatch.fnmatchcase(f, pat) for pat in SOURCE_EXCLUDE))


def pinned_wheels(wheels_dir: Path, wanted: dict[str, str]) -> dict[str, Path]:
    """For each canonical name in `wanted`, the wheel in `wheels_dir` whose filename version is the pin.
    A reused cache keeps the wheels of earlier pins beside the current one, so the version decides,
    not the order of the names ("2026.9.1" sorts after "2026.10.0")."""
    found: dict[str, dict[str, Path]] = {}
    for w in sorted(wheels_dir.glob("*.whl")):
        name, version = w.name.split("-")[:2]
        found.setdefault(canonicalize_name(name), {})[version] = w
    missing = sorted(set(wanted) - set(found))
    if missing:
        raise SystemExit(f"no wheel for {missing} in {wheels_dir}")
    wrong = [f"{n}: expected version {v}, found {sorted(found[n])}" for n, v in sorted(wanted.items())
             if v not in found[n]]
    if wrong:
        raise SystemExit(f"no wheel of the pinned version in {wheels_dir}:\n  " + "\n  ".join(wrong))
    return {n: found[n][v] for n, v in wanted.items()}


def assemble(wheels_dir: Path, stage: Path, python_version: str, name: str, repo: Path = REPO_ROOT) -> dict[str, Any]:
    root = stage / name
    if root.exists():
        shutil.rmtree(root)
    site = root / "site"
    site.mkdir(parents=True)
    wanted = {canonicalize_name(n): v for n, v in BUNDLE_PACKAGES.items()}
    by_name = pinned_wheels(wheels_dir, wanted)
    chosen = [by_name[n] for n in sorted(wanted)]
    unpack_wheels(chosen, site)
    size_before_prune = _tree_size(site)
    removed = prune(site)

    metadata, entry_points, version = megarl_metadata(repo / "pyproject.toml")
    dist = site / f"megarl-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(metadata)
    (dist / "entry_points.txt").write_text(entry_points)
    (dist / "INSTALLER").write_text("megarl-gpu-bundle\n")

    src = root / "src"
    files = _source_files(repo)
    for rel in files:
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, src / rel)
    shutil.copy2(repo / "tools" / "gpu_check.sh", root / "gpu_check.sh")

    # Every runtime requirement must be bundled, in the image, or left out on purpose.
    infos = _dist_infos(site)
    requires = {n: read_metadata(d).get_all("Requires-Dist") or [] for n, d in infos.items()}
    env = target_environment(python_version)
    gaps = requirement_gaps({"megarl": requires.pop("megarl")}, requires, IMAGE_PACKAGES, LEFT_OUT, env)
    if gaps:
        raise SystemExit("requirements the bundle does not cover:\n  " + "\n  ".join(gaps))
    unused = sorted(set(requires) - _reachable(["megarl"], infos, env))
    if unused:
        raise SystemExit(f"bundled but required by nothing megarl needs: {unused}")

    packages = {}
    for n, d in sorted(infos.items()):
        packages[n] = {"version": read_metadata(d)["Version"],
                       "wheel": by_name[n].name if n in by_name else None}
    manifest = {
        "name": name,
        "python": python_version,
        "platform": "manylinux x86_64",
        "packages": packages,
        "image_packages": sorted(IMAGE_PACKAGES),
        "left_out": LEFT_OUT,
        "pruned": removed,
        "pruned_bytes": sum(r["bytes"] for r in removed),
        "site_bytes_unpacked": _tree_size(site),
        "site_bytes_before_prune": size_before_prune,
        "src_files": len(files),
        "src_bytes": _tree_size(src),
    }
    (root / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _reachable(roots: list[str], infos: dict[str, Path], env: dict[str, str]) -> set[str]:
    """Names of the installed distributions that `roots` require, directly or not."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in seen or name not in infos:
            continue
        seen.add(name)
        reqs = read_metadata(infos[name]).get_all("Requires-Dist") or []
        todo += [canonicalize_name(r.name) for r in runtime_requirements(reqs, env)]
    return seen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("packages", help="print NAME==VERSION for every bundled third-party package")
    a = sub.add_parser("assemble", help="unpack, prune and check the bundle tree")
    a.add_argument("--wheels", type=Path, required=True)
    a.add_argument("--stage", type=Path, required=True)
    a.add_argument("--python-version", required=True)
    a.add_argument("--name", required=True)
    args = p.parse_args(argv)
    if args.cmd == "packages":
        print("\n".join(f"{n}=={v}" for n, v in BUNDLE_PACKAGES.items()))
        return 0
    manifest = assemble(args.wheels, args.stage, args.python_version, args.name)
    print(f"[gpu_bundle] {len(manifest['packages'])} packages, {manifest['src_files']} source files; "
          f"pruned {manifest['pruned_bytes'] / 2**20:.1f} MiB in {len(manifest['pruned'])} paths; "
          f"site {manifest['site_bytes_unpacked'] / 2**20:.1f} MiB unpacked")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
