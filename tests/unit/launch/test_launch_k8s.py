"""The KubeRay manifests carry what KubeRay requires and agree with each other, the pins and the config schema;
the GPU Dockerfile installs torch before everything else.

Required fields follow KubeRay's ray.io/v1 API (RayCluster: headGroupSpec with rayStartParams and a pod
template; workerGroupSpecs with groupName, replicas/minReplicas/maxReplicas, rayStartParams, template;
RayJob: entrypoint, rayClusterSpec, shutdownAfterJobFinishes, ttlSecondsAfterFinished).
rayStartParams is map[string]string in the CRD: a bare YAML number there is rejected by the API server.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "launch" / "k8s"
POOL_KEYS = ("actor_pool", "critic_pool", "ref_pool", "reward_model_pool", "rollout_pool")


def load(name: str) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]
    assert len(docs) == 1, f"{name}: expected one document, found {len(docs)}"
    return docs[0]


def pinned(package: str) -> str:
    """The exact version pyproject.toml pins for ``package`` (e.g. "ray[default]==2.60.0" -> "2.60.0")."""
    text = (REPO / "pyproject.toml").read_text()
    match = re.search(rf'"{re.escape(package)}(\[[^\]]*\])?==([\w.]+)"', text)
    assert match, f"{package} is not pinned with == in pyproject.toml"
    return match.group(2)


def check_pod_template(template: dict[str, Any], where: str) -> dict[str, Any]:
    containers = template["spec"]["containers"]
    assert containers, f"{where}: no containers"
    for c in containers:
        assert c.get("name") and c.get("image"), f"{where}: container needs name and image"
        assert c["resources"]["limits"] and c["resources"]["requests"], f"{where}: set limits and requests"
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    for c in containers:
        for mount in c.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{where}: volumeMount '{mount['name']}' has no volume"
    return containers[0]


def check_start_params(params: Any, where: str) -> None:
    assert isinstance(params, dict), f"{where}.rayStartParams must be a mapping"
    for key, value in params.items():
        assert isinstance(value, str), f"{where}.rayStartParams.{key}={value!r} must be a string"


def shared_claim(template: dict[str, Any], mount_path: str) -> str:
    """The PVC mounted at ``mount_path`` in the first container."""
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["mountPath"] == mount_path)
    return volumes[mount["name"]]["persistentVolumeClaim"]["claimName"]


def check_cluster_spec(spec: dict[str, Any], where: str) -> None:
    assert spec["rayVersion"] == pinned("ray"), f"{where}: rayVersion must equal the ray pinned in pyproject"
    head = spec["headGroupSpec"]
    check_start_params(head["rayStartParams"], f"{where}.headGroupSpec")
    check_pod_template(head["template"], f"{where}.headGroupSpec")
    groups = spec["workerGroupSpecs"]
    assert groups, f"{where}: no worker groups"
    claim = load("pvc.yaml")["metadata"]["name"]
    assert shared_claim(head["template"], "/mnt/shared") == claim
    for g in groups:
        gw = f"{where}.workerGroupSpecs[{g['groupName']}]"
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", g["groupName"]), f"{gw}: groupName must be a DNS label"
        assert 0 <= g["minReplicas"] <= g["replicas"] <= g["maxReplicas"], f"{gw}: need min <= replicas <= max"
        check_start_params(g["rayStartParams"], gw)
        container = check_pod_template(g["template"], gw)
        limits, requests = container["resources"]["limits"], container["resources"]["requests"]
        assert int(limits["nvidia.com/gpu"]) > 0, f"{gw}: GPU workers need nvidia.com/gpu limits"
        # Extended resources cannot be overcommitted: a request, if given, must equal the limit.
        assert str(requests.get("nvidia.com/gpu", limits["nvidia.com/gpu"])) == str(limits["nvidia.com/gpu"])
        assert shared_claim(g["template"], "/mnt/shared") == claim, f"{gw}: mount the shared PVC at /mnt/shared"
        dshm = [v for v in g["template"]["spec"]["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"]
        assert dshm, f"{gw}: NCCL needs a memory-backed /dev/shm"


def test_pvc_is_read_write_many() -> None:
    pvc = load("pvc.yaml")
    assert (pvc["apiVersion"], pvc["kind"]) == ("v1", "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    assert pvc["spec"]["resources"]["requests"]["storage"]


def test_raycluster_required_fields() -> None:
    rc = load("raycluster.yaml")
    assert (rc["apiVersion"], rc["kind"]) == ("ray.io/v1", "RayCluster")
    assert rc["metadata"]["name"]
    check_cluster_spec(rc["spec"], "raycluster.yaml")
    assert rc["spec"]["authOptions"]["mode"] == "token"


def test_rayjob_required_fields_and_same_cluster() -> None:
    job = load("rayjob.yaml")
    assert (job["apiVersion"], job["kind"]) == ("ray.io/v1", "RayJob")
    assert job["metadata"]["name"]
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True
    assert isinstance(spec["ttlSecondsAfterFinished"], int) and spec["ttlSecondsAfterFinished"] >= 0
    check_cluster_spec(spec["rayClusterSpec"], "rayjob.yaml")
    assert spec["rayClusterSpec"] == load("raycluster.yaml")["spec"], "rayjob.yaml and raycluster.yaml diverged"


def entrypoint_overrides(entrypoint: str) -> tuple[str, list[str]]:
    words = shlex.split(entrypoint)
    assert words[:2] == ["megarl", "train"], f"entrypoint must run `megarl train`, got {entrypoint!r}"
    return words[2], words[3:]


def test_rayjob_entrypoint_matches_cluster_and_schema() -> None:
    from megarl.config import load_config

    spec = load("rayjob.yaml")["spec"]
    config, overrides = entrypoint_overrides(spec["entrypoint"])
    assert config.startswith("/mnt/shared/"), "the config must be on the shared volume the head pod mounts"
    cfg = load_config(None, overrides, validate=False)  # unknown keys or bad types raise ConfigError
    assert cfg.resources.ray_address == "auto"
    assert cfg.resources.device == "cuda"
    groups = spec["rayClusterSpec"]["workerGroupSpecs"]
    # Each pool takes whole worker pods: the pools' nodes add up to the replicas.
    pools = [cfg.resources[key] for key in POOL_KEYS if cfg.resources.get(key) is not None]
    assert sum(pool.nnodes for pool in pools) == sum(g["replicas"] for g in groups)
    gpus = {int(g["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]) for g in groups}
    assert gpus == {pool.devices_per_node for pool in pools}
    assert cfg.trainer.default_local_dir.startswith("/mnt/shared/"), "checkpoints must go to the shared volume"


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_manifests_say_how_to_size_the_actor_pool_next_to_other_pools(name: str) -> None:
    """A manifest cannot read the config: its comments say the actor pool gets the pods the other pools leave."""
    header = "\n".join(line for line in (K8S / name).read_text().splitlines() if line.startswith("#"))
    assert "resources.actor_pool.nnodes = worker replicas minus the nnodes of" in " ".join(
        part.lstrip("# ").strip() for part in header.splitlines())
    for key in POOL_KEYS[1:]:
        assert key.split("_pool")[0] in header, f"{name}: the comments should name {key}"
    assert "devices_per_node = nvidia.com/gpu per" in header


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in (K8S / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def test_dockerfile_installs_torch_first_then_gpu_extras() -> None:
    steps = dockerfile_instructions()
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1].strip('"') for word, rest in steps if word == "ARG" and "=" in rest
    }
    assert args["TORCH_VERSION"] == pinned("torch")
    assert "nvidia/cuda" in args["CUDA_IMAGE"] and "devel" in args["CUDA_IMAGE"], "Apex/TE need nvcc: a devel image"
    assert steps[[w for w, _ in steps].index("FROM")][1] == "${CUDA_IMAGE}"
    runs = [rest for word, rest in steps if word == "RUN"]
    pip_installs = [(i, r) for i, r in enumerate(runs) if "pip install" in r]
    torch_step = next(i for i, r in pip_installs if 'torch==${TORCH_VERSION}' in r)
    gpu_step = next(i for i, r in pip_installs if '".[gpu]"' in r)
    assert torch_step < gpu_step
    # Nothing but pip's own tooling may be installed before torch.
    for i, r in pip_installs:
        if i < torch_step:
            tooling = {"--upgrade", "pip", "setuptools", "wheel", "packaging"}
            assert set(shlex.split(r.split("pip install", 1)[1])) <= tooling
    assert "--no-build-isolation" in runs[gpu_step], "TransformerEngine must build against the installed torch"
    apex = next(r for r in runs if "NVIDIA/apex" in r)
    assert "BUILD_APEX" in apex and runs.index(apex) > gpu_step


def test_dockerfile_runs_as_non_root_with_an_entrypoint() -> None:
    steps = dockerfile_instructions()
    words = [w for w, _ in steps]
    user = [rest for w, rest in steps if w == "USER"]
    assert user and user[-1] not in ("root", "0")
    assert words.index("USER") < words.index("ENTRYPOINT")
    assert steps[words.index("ENTRYPOINT")][1] == '["megarl"]'
    copied = {rest.split()[0] for w, rest in steps if w == "COPY"}
    for needed in ("pyproject.toml", "megarl", "configs", "launch"):
        assert needed in copied, f"the image needs {needed}"
        assert (REPO / needed).exists()


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_image_is_the_same_everywhere(name: str) -> None:
    doc = load(name)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec["workerGroupSpecs"]]
    images = {c["image"] for t in templates for c in t["spec"]["containers"]}
    assert len(images) == 1, f"{name}: head and workers must run one image, found {images}"


# Stand-ins for the account tools, acting on a passwd file of our own (the real ones need root, and
# a docker build cannot run here). Exit statuses are those of shadow-utils: useradd 4 = uid in use,
# 9 = name in use; userdel 6 = no such user; getent 2 = not found.
ACCOUNT_TOOLS = {
    "getent": """#!/bin/sh
[ "$1" = passwd ] || exit 1
awk -F: -v key="$2" '$1 == key || $3 == key { print; found = 1 } END { exit found ? 0 : 2 }' "$FAKE_PASSWD"
""",
    "userdel": """#!/bin/sh
for name; do :; done
grep -q "^$name:" "$FAKE_PASSWD" || { echo "userdel: user '$name' does not exist" >&2; exit 6; }
grep -v "^$name:" "$FAKE_PASSWD" > "$FAKE_PASSWD.new"; mv "$FAKE_PASSWD.new" "$FAKE_PASSWD"
""",
    "useradd": """#!/bin/sh
uid=""; name=""
while [ $# -gt 0 ]; do
    case "$1" in
        --uid|-u) uid="$2"; shift 2 ;;
        --shell|-s|--home-dir|-d|--gid|-g) shift 2 ;;
        -*) shift ;;
        *) name="$1"; shift ;;
    esac
done
if awk -F: -v uid="$uid" '$3 == uid { found = 1 } END { exit found ? 0 : 1 }' "$FAKE_PASSWD"; then
    echo "useradd: UID $uid is not unique" >&2; exit 4
fi
grep -q "^$name:" "$FAKE_PASSWD" && { echo "useradd: user '$name' already exists" >&2; exit 9; }
echo "$name:x:$uid:$uid::/home/$name:/bin/bash" >> "$FAKE_PASSWD"
""",
}


@pytest.mark.parametrize("base_users", [
    ["root:x:0:0:root:/root:/bin/bash", "ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash"],  # ubuntu24.04
    ["root:x:0:0:root:/root:/bin/bash"],  # ubuntu22.04 and older: uid 1000 is free
], ids=["uid_1000_taken_by_ubuntu", "uid_1000_free"])
def test_dockerfile_user_step_succeeds_on_either_base(tmp_path: Path, base_users: list[str]) -> None:
    """The RUN step that creates the image's user, run as Docker runs it (`/bin/sh -c`), against the
    account tables of the CUDA base images: it must leave user `ray` with uid 1000 and nobody else on it."""
    steps = dockerfile_instructions()
    user_steps = [rest for word, rest in steps if word == "RUN" and "useradd" in rest]
    assert len(user_steps) == 1, user_steps
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in ACCOUNT_TOOLS.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    passwd = tmp_path / "passwd"
    passwd.write_text("\n".join(base_users) + "\n")
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin:/bin", "FAKE_PASSWD": str(passwd)}
    done = subprocess.run(["/bin/sh", "-c", user_steps[0]], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, f"the user step fails on this base (status {done.returncode}): {done.stderr}"
    holders = [line.split(":")[0] for line in passwd.read_text().splitlines() if line.split(":")[2] == "1000"]
    assert holders == ["ray"], passwd.read_text()
    assert [w for w, _ in steps].index("USER") > steps.index(("RUN", user_steps[0]))


def recipe_paths(config: Path) -> list[str]:
    """The absolute paths a recipe reads: data files, tokenizer, model and critic/reward-model checkpoints."""
    from megarl.config import load_config

    cfg = load_config(config, validate=False)
    paths = [*cfg.data.train_files, *(cfg.data.val_files or []), cfg.data.tokenizer, cfg.model.path,
             cfg.critic.model_path, cfg.reward_model.model_path]
    return [str(p) for p in paths if p and str(p).startswith("/")]


@pytest.mark.parametrize("name", ["rayjob.yaml", "raycluster.yaml"])
def test_every_pod_mounts_what_the_gpu_recipes_read(name: str) -> None:
    doc = load(name)
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    templates = [spec["headGroupSpec"]["template"], *(g["template"] for g in spec["workerGroupSpecs"])]
    claim = load("pvc.yaml")["metadata"]["name"]
    recipes = [p for p in sorted((REPO / "configs").glob("*.yaml")) if recipe_paths(p)]
    assert len(recipes) >= 4, recipes  # the GPU recipes name absolute paths; the CPU ones relative ones
    for template in templates:
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        mounts = [m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"]
                  if volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim]
        for recipe in recipes:
            for path in recipe_paths(recipe):
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (
                    f"{name}: {recipe.name} reads {path}, which no mount of the shared volume ({mounts}) holds")


def test_ray_job_stop_gives_the_trainer_time_to_checkpoint() -> None:
    """`ray job stop` is the graceful stop on Kubernetes (tests/integration/launch/test_launch_ray_job_stop.py):
    the job supervisor on the head sends SIGTERM, then SIGKILL after RAY_JOB_STOP_WAIT_TIME_S (3 s by default)."""
    for name in ("rayjob.yaml", "raycluster.yaml"):
        doc = load(name)
        spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
        env = {e["name"]: e["value"] for e in spec["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]}
        assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 300, name
