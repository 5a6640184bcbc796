"""Run the benchmark sections and write `bench.json` and `REPORT.md` (what `megarl bench` calls).

Sections (each a script in this folder, run in its own process with its own time limit; a section
that fails or times out is recorded with its error and the others still run):

  e2e         megarl GRPO vs TRL GRPOTrainer, side by side (needs .venv-bench: make_bench_env.sh)
  e2e_25m     the same at ~25M parameters and 64-token responses, with useful-token MFU
  phases      phase breakdown of a megarl step (GRPO, and PPO with critic and reference)
  scaling     1 vs 2 workers; the model doubled twice
  components  the component benchmarks of components.py (engine, reshard, rollout, convert, ...)
  gpu         MFU, vLLM vs HF rollout, weight sync (skipped without CUDA)

`bench.json` keeps the sections of earlier runs that this run did not repeat (each entry has its
own time and load average), so sections can be measured one at a time; `--fresh` starts over. In
the same way `--components a,b` re-runs those components only and keeps the earlier run's others,
each with the time it was measured.

    python benchmarks/run_all.py [--sections e2e,phases] [--quick] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO_ROOT, RESULTS_DIR, load_average, machine_info, utc_now, write_json  # noqa: E402
from components import COMPONENTS  # noqa: E402
from report import render_report, reward_plot_name  # noqa: E402

from megarl.bench import SECTIONS, add_arguments  # noqa: E402  (the command line is megarl's)
# Seconds per section: full sizes / --quick.
TIMEOUTS = {"e2e": (3600, 1200), "e2e_25m": (3600, 1200), "phases": (2400, 900), "scaling": (3600, 1800), "components": (3600, 900),
            "async_modes": (2400, 900), "gpu": (2400, 900)}
SCHEMA_VERSION = 1
USES_WORK_DIR = ("e2e", "e2e_25m", "phases", "scaling", "async_modes")


def parse_sections(text: str) -> list[str]:
    """Comma-separated section names, checked against SECTIONS (ValueError naming the bad ones)."""
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in SECTIONS]
    if unknown or not names:
        raise ValueError(f"--sections: unknown or empty {unknown or text!r}; valid: {','.join(SECTIONS)}")
    return names


def run_section(name: str, out_dir: Path, quick: bool, timeout_s: float, extra_args: Optional[list[str]] = None,
                python: str = sys.executable) -> dict[str, Any]:
    """Run benchmarks/<name>.py in a subprocess; return its bench.json entry.

    status: ok (exit 0 and JSON written) | partial (JSON written, non-zero exit) | failed | timeout.
    """
    out = out_dir / "sections" / f"{name}.json"
    if out.exists():
        out.unlink()
    cmd = [python, str(REPO_ROOT / "benchmarks" / f"{name}.py"), "--out", str(out), *(extra_args or [])]
    if name in USES_WORK_DIR:  # one task dataset for all sections, made once
        cmd += ["--work-dir", str(out_dir / "sections" / "runs")]
    if quick:
        cmd.append("--quick")
    entry: dict[str, Any] = {"quick": quick, "started_utc": utc_now(), "load_average_before": load_average(),
                             "timeout_s": timeout_s}
    start = time.perf_counter()
    log_path = out_dir / "sections" / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                start_new_session=True)
        try:
            code: Optional[int] = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            code = None
    entry.update(seconds=round(time.perf_counter() - start, 1), finished_utc=utc_now(),
                 load_average_after=load_average())
    tail = log_path.read_text(errors="replace")[-4000:]
    if code is None:
        entry.update(status="timeout", error=f"no result within {timeout_s:.0f} s; log tail:\n{tail}")
    elif out.is_file():
        entry["result"] = json.loads(out.read_text())
        entry["status"] = "ok" if code == 0 else "partial"
        if code != 0:
            entry["error"] = f"exit code {code}; log tail:\n{tail}"
    else:
        entry.update(status="failed", error=f"exit code {code}; log tail:\n{tail}")
    return entry


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop a timed-out section and everything it started (its own session: Ray, workers)."""
    import signal

    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def load_existing(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}
    return data if data.get("schema_version") == SCHEMA_VERSION else {}


def assemble(previous: dict[str, Any], new_sections: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    """bench.json: the new sections over the previous ones, in the canonical section order."""
    merged = dict(previous.get("sections", {}))
    merged.update(new_sections)
    ordered = {name: merged[name] for name in SECTIONS if name in merged}
    ordered.update({k: v for k, v in merged.items() if k not in ordered})
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_utc": utc_now(),
        "machine": machine_info(),
        "quick": quick and all(v.get("quick", False) for v in ordered.values()),
        "sections": ordered,
    }


def merge_components(previous: Optional[dict[str, Any]], new: dict[str, Any]) -> dict[str, Any]:
    """The components section of a run of some components over an earlier run's: the earlier run's
    other components stay, each component with the time it was measured (`measured_utc`; entries
    written before components carried it get their run's start). A new run without a result
    (failed, timed out) replaces nothing; one of every component keeps nothing of the earlier run."""
    if not previous or "result" not in previous or "result" not in new:
        return new
    if set(COMPONENTS) <= set(new["result"]["components"]):
        return new
    kept = {name: {"measured_utc": previous.get("started_utc"), **entry}
            for name, entry in previous["result"].get("components", {}).items()}
    merged = {**kept, **new["result"]["components"]}
    ordered = {name: merged[name] for name in COMPONENTS if name in merged}
    ordered.update({name: entry for name, entry in merged.items() if name not in ordered})
    kept_names = [name for name in ordered if name not in new["result"]["components"]]
    return {**new, "components_kept": kept_names, "result": {**new["result"], "components": ordered}}


def run_all(sections: list[str], out_dir: Path, quick: bool, fresh: bool = False,
            timeout_s: Optional[float] = None, section_args: Optional[dict[str, list[str]]] = None) -> dict[str, Any]:
    """Run `sections`, write bench.json and REPORT.md under `out_dir`; return the bench dictionary."""
    out_dir.mkdir(parents=True, exist_ok=True)
    bench_path = out_dir / "bench.json"
    previous = {} if fresh else load_existing(bench_path)
    done: dict[str, dict[str, Any]] = {}
    for name in sections:
        limit = timeout_s or TIMEOUTS[name][1 if quick else 0]
        print(f"[bench] {name} (limit {limit:.0f} s, load {load_average()}) ...", flush=True)
        done[name] = run_section(name, out_dir, quick, limit, (section_args or {}).get(name))
        if name == "components":
            done[name] = merge_components(previous.get("sections", {}).get(name), done[name])
        print(f"[bench] {name}: {done[name]['status']} in {done[name]['seconds']} s", flush=True)
        # Written after every section, so an interrupted run keeps what it measured.
        bench = assemble(previous, done, quick)
        write_json(bench_path, bench)
        (out_dir / "REPORT.md").write_text(render_report(bench))
    return assemble(previous, done, quick)


def main_from_args(args: argparse.Namespace) -> int:
    try:
        sections = parse_sections(args.sections)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # The rounds of one run on a shared machine differ by more than most changes (REPORT.md shows each).
    rounds = args.e2e_rounds if args.e2e_rounds is not None else (1 if args.quick else 3)
    if rounds < 1:
        print(f"error: --e2e-rounds must be >= 1, got {rounds}", file=sys.stderr)
        return 2
    components = [c.strip() for c in (args.components or "").split(",") if c.strip()]
    unknown = [c for c in components if c not in COMPONENTS]
    if unknown or (components and "components" not in sections):
        problem = f"unknown {unknown}" if unknown else "needs the components section in --sections"
        print(f"error: --components: {problem}; valid: {','.join(COMPONENTS)}", file=sys.stderr)
        return 2
    out_dir = args.out_dir or RESULTS_DIR
    # The plots beside REPORT.md, which names them (results/sections/ is not kept).
    section_args = {"e2e": ["--rounds", str(rounds), "--plot", str(out_dir / reward_plot_name("quickstart")),
                            *(["--steps", str(args.e2e_steps)] if args.e2e_steps else [])],
                    "e2e_25m": ["--plot", str(out_dir / reward_plot_name("25m"))]}
    if components:
        section_args["components"] = ["--components", ",".join(components)]
    bench = run_all(sections, out_dir, args.quick, args.fresh, args.timeout, section_args)
    print(f"[bench] wrote {out_dir / 'bench.json'} and {out_dir / 'REPORT.md'}")
    statuses = {name: bench["sections"][name]["status"] for name in sections}
    return 0 if all(s == "ok" for s in statuses.values()) else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_arguments(parser)
    return main_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
