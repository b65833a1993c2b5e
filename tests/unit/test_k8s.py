"""deploy/k8s/ (the base, the CPU overlay, the tensor-parallel one), checked without a cluster.

Every object validates against the Kubernetes schemas of the oldest and newest release we claim
(vendored in tests/data/kubernetes/, strict: no field the API lacks), and a broken object fails.
The overlay is rendered here the way kustomize renders it (where kubectl is installed, its own
`kubectl kustomize` must agree). Then what only specpair knows: every container runs `specpair
serve <role>` with a command line the real CLI turns into a config, probes go through
grpc.health.v1 on the service's port, the ops token comes from the Secret, models from a
read-only volume, the GPU services hold a GPU, targets reach the drafts through their headless
Service, the controller names every target replica, and the Services reach the right ports.
"""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from specpair.cli import main as cli
from specpair.cli.options import TOKEN_ENV
from specpair.config import ControllerConfig, DraftConfig, TargetConfig, split_address

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = sorted((ROOT / "tests" / "data" / "kubernetes").glob("v*.json"))
ROLES = ("draft", "target", "controller")
GPU_ROLES = ("draft", "target")
SECRET = "specpair"

Doc = dict[str, Any]


# ---- rendering like kustomize --------------------------------------------------------------


def _load(path: Path) -> list[Doc]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


# Strategic merge: lists of objects with a merge key merge item by item; the patches here use
# no other kind of list (a patch that does fails `render`, not silently).
MERGE_KEYS = {"containers": "name", "volumes": "name", "volumeMounts": "mountPath"}


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """The strategic-merge rules the overlay relies on: maps merge, null deletes a key, lists
    of primitives (`args`) are replaced, `containers` / `volumes` merge by name,
    `volumeMounts` by mountPath, a patch's new items ahead of the base's."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        if not any(isinstance(v, dict) for v in patch):
            return copy.deepcopy(patch)
        if key not in MERGE_KEYS:
            raise NotImplementedError(f"strategic merge of the list {key!r}")
        merge_key, items = MERGE_KEYS[key], copy.deepcopy(base)
        index = {item[merge_key]: i for i, item in enumerate(items)}
        added = []  # kustomize puts a patch's new items first, in the patch's order
        for item in patch:
            if item[merge_key] in index:
                i = index[item[merge_key]]
                items[i] = strategic_merge(items[i], item, key)
            else:
                added.append(copy.deepcopy(item))
        return added + items
    return copy.deepcopy(patch)


def _containers(doc: Doc) -> list[Doc]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def _set_images(docs: list[Doc], images: list[Doc]) -> None:
    for container in (c for d in docs for c in _containers(d)):
        name, _, tag = container["image"].partition(":")
        for image in images:
            if image["name"] == name:
                name, tag = image.get("newName", name), image.get("newTag", tag)
        container["image"] = f"{name}:{tag}" if tag else name


def render(directory: Path) -> list[Doc]:
    """What `kubectl kustomize DIRECTORY` gives, for the fields our kustomizations use."""
    kustomization = _load(directory / "kustomization.yaml")[0]
    assert set(kustomization) <= {"apiVersion", "kind", "resources", "images", "patches"}
    docs: list[Doc] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        docs += render(path) if path.is_dir() else _load(path)
    for entry in kustomization.get("patches", []):
        assert set(entry) == {"path"}, "only strategic-merge patch files"
        for patch in _load(directory / entry["path"]):
            (i,) = [i for i, d in enumerate(docs) if _ident(d) == _ident(patch)]
            docs[i] = strategic_merge(docs[i], patch)
    _set_images(docs, kustomization.get("images", []))
    return docs


def _ident(doc: Doc) -> tuple[str, str, str]:
    return doc["apiVersion"], doc["kind"], doc["metadata"]["name"]


VARIANTS = {"base": K8S / "base", "cpu": K8S / "cpu", "tp4": K8S / "tp4"}


@pytest.fixture(params=sorted(VARIANTS))
def docs(request: pytest.FixtureRequest) -> list[Doc]:
    return render(VARIANTS[request.param])


def test_the_variants_are_every_kustomization_there_is() -> None:
    assert sorted(K8S.glob("*/kustomization.yaml")) == sorted(
        d / "kustomization.yaml" for d in VARIANTS.values()
    )


# ---- schemas -------------------------------------------------------------------------------


def validator(schema_path: Path) -> Any:
    """validate(doc): raises jsonschema.ValidationError unless `doc` is a valid object of its
    kind in that release."""
    schema = json.loads(schema_path.read_text())

    def validate(doc: Doc) -> None:
        kind = f"{doc['apiVersion']}/{doc['kind']}"
        assert kind in schema["x-kinds"], (
            f"{kind} is not vendored: add it to KINDS in tests/data/kubernetes/vendor.py"
        )
        root = {"$defs": schema["$defs"], "$ref": f"#/$defs/{schema['x-kinds'][kind]}"}
        jsonschema.Draft202012Validator(root).validate(doc)

    return validate


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda p: p.stem)
def test_every_object_matches_the_kubernetes_schema(docs: list[Doc], schema: Path) -> None:
    validate = validator(schema)
    for doc in docs:
        assert doc["metadata"]["name"], doc
        validate(doc)
    assert len({_ident(d) for d in docs}) == len(docs), "two objects of one kind and name"


def test_two_releases_are_vendored() -> None:
    assert [p.stem for p in SCHEMAS] == ["v1.30", "v1.37"]


def _break_replicas(doc: Doc) -> None:
    doc["spec"]["replicas"] = "2"  # an integer in the API


def _break_probe_port(doc: Doc) -> None:
    # gRPC probes take a port number only: a named port is refused (httpGet would take it).
    doc["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"


def _break_field_name(doc: Doc) -> None:
    container = doc["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")  # strict: no unknown fields


def _break_service_port(doc: Doc) -> None:
    doc["spec"]["ports"][0]["port"] = {"number": 50051}


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda p: p.stem)
@pytest.mark.parametrize(
    "kind,breaks",
    [
        ("StatefulSet", _break_replicas),
        ("StatefulSet", _break_probe_port),
        ("Deployment", _break_field_name),
        ("Service", _break_service_port),
    ],
    ids=["replicas-string", "grpc-probe-named-port", "misspelled-field", "port-object"],
)
def test_the_schema_check_rejects_a_broken_object(schema: Path, kind: str, breaks: Any) -> None:
    validate = validator(schema)
    doc = copy.deepcopy(next(d for d in render(K8S / "base") if d["kind"] == kind))
    validate(doc)  # valid as shipped
    breaks(doc)
    with pytest.raises(jsonschema.ValidationError):
        validate(doc)


# ---- the overlay renders as kustomize renders it -------------------------------------------


def test_strategic_merge_follows_the_rules_the_overlay_uses() -> None:
    base = {"c": [{"name": "a", "args": ["x", "y"], "r": {"gpu": 1, "mem": "1"}}], "k": 1}
    patch = {"c": [{"name": "a", "args": ["z"], "r": {"gpu": None, "mem": "2"}}], "k": None}
    assert strategic_merge({"containers": base["c"]}, {"containers": patch["c"]}) == {
        "containers": [{"name": "a", "args": ["z"], "r": {"mem": "2"}}]
    }
    assert strategic_merge({"k": 1, "j": 2}, {"k": None}) == {"j": 2}
    with pytest.raises(NotImplementedError):
        strategic_merge({"ports": [{"name": "a"}]}, {"ports": [{"name": "a", "port": 1}]})


def _kubectl_kustomize(directory: Path) -> list[Doc] | None:
    if shutil.which("kubectl") is None:
        return None
    done = subprocess.run(
        ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d is not None]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_kubectl_kustomize_renders_the_same(variant: str) -> None:
    theirs = _kubectl_kustomize(VARIANTS[variant])
    if theirs is None:
        pytest.skip("kubectl is not installed here; the schema checks use our rendering")
    ours = render(VARIANTS[variant])
    assert {_ident(d): d for d in theirs} == {_ident(d): d for d in ours}


# ---- specpair's side: command lines, probes, secrets, volumes, GPUs ---------------------------


def _role(doc: Doc) -> str:
    return str(doc["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"])


def workloads(docs: list[Doc]) -> dict[str, Doc]:
    """role → its Deployment or StatefulSet."""
    found = {_role(d): d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    assert set(found) == set(ROLES)
    return found


def container(workload: Doc) -> Doc:
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return dict(only)


def config(workload: Doc) -> Any:
    """The service config the container's command line builds, through the real CLI."""
    args = container(workload)["args"]
    try:
        return cli.config_from_args(cli.build_parser().parse_args(args))
    except SystemExit as e:  # argparse has printed why on stderr
        pytest.fail(f"`specpair {' '.join(args)}` rejected ({e})")


def _port(address: str) -> int:
    return split_address(address)[1]


def _ports(c: Doc) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def services(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}


def test_every_container_serves_its_role_beyond_loopback(docs: list[Doc]) -> None:
    kinds: dict[str, type[DraftConfig | TargetConfig | ControllerConfig]] = {
        "draft": DraftConfig,
        "target": TargetConfig,
        "controller": ControllerConfig,
    }
    for role, workload in workloads(docs).items():
        c = container(workload)
        assert "command" not in c, "the image's ENTRYPOINT (specpair) must run"
        assert c["args"][:2] == ["serve", role]
        cfg = config(workload)
        assert isinstance(cfg, kinds[role])
        assert cfg.server.address.startswith("0.0.0.0:"), "a pod must listen beyond loopback"
        assert cfg.server.metrics_address.startswith("0.0.0.0:")
        assert _ports(c) == {
            "grpc": _port(cfg.server.address),
            "metrics": _port(cfg.server.metrics_address),
            **({"http": _port(cfg.http_address)} if isinstance(cfg, TargetConfig) else {}),
        }
        assert c["image"].partition(":")[0] == "specpair"
        sec = workload["spec"]["template"]["spec"]["securityContext"]
        assert sec["runAsNonRoot"] and sec["runAsUser"] == 10001  # the Dockerfile's user
    assert config(workloads(docs)["target"]).http_address.startswith("0.0.0.0:")


def test_probes_ask_grpc_health_on_the_service_port(docs: list[Doc]) -> None:
    """The kubelet's gRPC probe asks grpc.health.v1 for the whole server (service ""), which our
    servers answer NOT_SERVING until the model and every tier are built
    (tests/service/test_readiness.py), so ready means loaded."""
    for role, workload in workloads(docs).items():
        c, port = container(workload), _port(config(workload).server.address)
        probes = {k: v for k, v in c.items() if k.endswith("Probe")}
        want = {"readinessProbe", "livenessProbe"} | (
            {"startupProbe"} if role in GPU_ROLES else set()
        )
        assert set(probes) == want, role
        for name, probe in probes.items():
            assert probe["grpc"] == {"port": port}, (role, name)
            assert probe["timeoutSeconds"] >= 5, "a loaded CPU answers late; 1 s is the default"
        if role in GPU_ROLES:  # loading may take minutes: the startup probe allows ten
            startup = probes["startupProbe"]
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, role


def test_the_ops_token_comes_from_the_secret(docs: list[Doc]) -> None:
    for role, workload in workloads(docs).items():
        env = {e["name"]: e for e in container(workload)["env"]}
        assert env[TOKEN_ENV]["valueFrom"] == {
            "secretKeyRef": {"name": SECRET, "key": "ops-token"}
        }, role
        assert "--ops-token-env" not in " ".join(container(workload)["args"])  # the default
        assert not any("value" in e for e in env.values()), "no secret written in a manifest"
    target_env = {e["name"]: e for e in container(workloads(docs)["target"])["env"]}
    assert target_env["SPECPAIR_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": SECRET,
        "key": "api-key",
        "optional": True,
    }


def test_models_come_from_a_read_only_volume(docs: list[Doc]) -> None:
    for role in GPU_ROLES:
        workload = workloads(docs)[role]
        mounts = {m["mountPath"]: m for m in container(workload)["volumeMounts"]}
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        model = config(workload).model_path
        (mount,) = [m for path, m in mounts.items() if model.is_relative_to(path)]
        assert mount["readOnly"] is True, role
        volume = volumes[mount["name"]]
        assert ("persistentVolumeClaim" in volume) != ("hostPath" in volume), role
        if "persistentVolumeClaim" in volume:
            assert volume["persistentVolumeClaim"] == {
                "claimName": "specpair-models",
                "readOnly": True,
            }
        assert model.name == role


def test_the_gpu_services_hold_a_gpu_per_rank_except_on_the_cpu() -> None:
    for name, directory in VARIANTS.items():
        found = workloads(render(directory))
        for role, workload in found.items():
            limits = container(workload)["resources"].get("limits", {})
            cfg = config(workload)
            if name != "cpu" and role in GPU_ROLES:
                ranks = cfg.tensor_parallel if role == "target" else 1
                assert limits["nvidia.com/gpu"] == ranks, (name, role)
                assert cfg.device == "cuda", role
                if role == "target":  # the pod sees cuda:0 … its count - 1
                    cfg.check_gpus(limits["nvidia.com/gpu"])
            else:
                assert "nvidia.com/gpu" not in limits, (name, role)
                assert getattr(cfg, "device", "cpu") == "cpu", (name, role)


def test_threads_fit_the_cpus_requested(docs: list[Doc]) -> None:
    """A container's os.cpu_count() is the node's, so `--threads 0` (half the cores) would
    oversubscribe the pod's CPUs: the model services say theirs (each rank of a tensor-parallel
    target takes --threads)."""
    for role in GPU_ROLES:
        workload = workloads(docs)[role]
        requested = int(container(workload)["resources"]["requests"]["cpu"])
        cfg = config(workload)
        assert cfg.threads * getattr(cfg, "tensor_parallel", 1) == requested, role


def test_the_cpu_overlay_changes_only_the_device_and_threads() -> None:
    base, cpu = workloads(render(K8S / "base")), workloads(render(K8S / "cpu"))
    changed = ("--device=", "--threads=")
    for role in ROLES:
        same_base = [a for a in container(base[role])["args"] if not a.startswith(changed)]
        same_cpu = [a for a in container(cpu[role])["args"] if not a.startswith(changed)]
        assert same_cpu == same_base, role
        assert container(cpu[role])["image"] == "specpair:cpu"
        assert container(base[role])["image"] == "specpair:cuda"


def test_the_tp4_overlay_changes_only_the_targets_ranks_and_gives_nccl_shared_memory() -> None:
    base, tp = workloads(render(K8S / "base")), workloads(render(K8S / "tp4"))
    for role in ("draft", "controller"):
        assert tp[role] == base[role], role
    changed = ("--tensor-parallel=", "--threads=")
    same = [a for a in container(tp["target"])["args"] if not a.startswith(changed)]
    assert same == [a for a in container(base["target"])["args"] if not a.startswith(changed)]
    assert config(tp["target"]).tensor_parallel == 4
    pod = tp["target"]["spec"]["template"]["spec"]
    (shm,) = [m for m in container(tp["target"])["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == shm["name"]]
    assert volume["emptyDir"]["medium"] == "Memory" and not shm.get("readOnly")
    # the base's mounts are kept beside it (merged by mountPath, not replaced)
    assert len(container(tp["target"])["volumeMounts"]) == 1 + len(
        container(base["target"])["volumeMounts"]
    )


def test_targets_reach_the_drafts_through_their_headless_service(docs: list[Doc]) -> None:
    found, svc = workloads(docs), services(docs)
    host, port = split_address(config(found["target"]).draft_address)
    drafts = svc[host]
    assert drafts["spec"]["clusterIP"] == "None", "headless: every ready draft, not one VIP"
    assert drafts["spec"]["selector"] == found["draft"]["spec"]["selector"]["matchLabels"]
    (p,) = drafts["spec"]["ports"]
    assert p["port"] == port == _port(config(found["draft"]).server.address)
    assert _ports(container(found["draft"]))[p["targetPort"]] == port
    assert found["draft"]["kind"] == "Deployment" and found["draft"]["spec"]["replicas"] >= 2


def test_the_controller_names_every_target_replica(docs: list[Doc]) -> None:
    found, svc = workloads(docs), services(docs)
    targets = found["target"]
    assert targets["kind"] == "StatefulSet"
    name, governing = targets["metadata"]["name"], targets["spec"]["serviceName"]
    assert svc[governing]["spec"]["clusterIP"] == "None"
    assert svc[governing]["spec"]["selector"] == targets["spec"]["selector"]["matchLabels"]
    port = _port(config(targets).server.address)
    want = [f"{name}-{i}.{governing}:{port}" for i in range(targets["spec"]["replicas"])]
    assert list(config(found["controller"]).targets) == want
    controller = found["controller"]
    assert controller["spec"]["replicas"] == 1 and controller["spec"]["strategy"]["type"] == (
        "Recreate"
    )
    state = config(controller).state_file
    mounts = [m["mountPath"] for m in container(controller)["volumeMounts"]]
    assert any(state.is_relative_to(m) for m in mounts), "the state file on a writable volume"


def test_services_select_their_pods_and_reach_named_ports(docs: list[Doc]) -> None:
    found = workloads(docs)
    for workload in found.values():
        labels = workload["spec"]["template"]["metadata"]["labels"]
        selector = workload["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels.items()
    for name, svc in services(docs).items():
        (role,) = [r for r, w in found.items() if svc["spec"]["selector"] == _pod_labels(w)]
        ports = _ports(container(found[role]))
        for p in svc["spec"]["ports"]:
            assert ports[p["targetPort"]] == p["port"], (name, p)
            assert p["name"] == p["targetPort"]


def _pod_labels(workload: Doc) -> dict[str, str]:
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def test_clients_get_grpc_and_http_from_one_service(docs: list[Doc]) -> None:
    target = config(workloads(docs)["target"])
    clients = services(docs)["specpair"]
    assert clients["spec"].get("clusterIP") != "None"
    assert {p["name"]: p["port"] for p in clients["spec"]["ports"]} == {
        "grpc": _port(target.server.address),
        "http": _port(target.http_address),
    }
    assert services(docs)["specpair-controller"]["spec"]["ports"][0]["port"] == _port(
        config(workloads(docs)["controller"]).server.address
    )


def test_the_gpu_kernels_compiled_at_start_up_outlive_the_pod() -> None:
    # The base mounts the PVC specpair-kernel-cache (an emptyDir would go with every pod) where
    # the image keeps flashinfer's and Triton's caches, writable by the image's user; the CPU
    # overlay, which compiles nothing, an emptyDir.
    from tests.unit.test_compose import kernel_caches

    caches = kernel_caches()
    for variant, expected in (
        ("base", {"persistentVolumeClaim": {"claimName": "specpair-kernel-cache"}}),
        ("tp4", {"persistentVolumeClaim": {"claimName": "specpair-kernel-cache"}}),
        ("cpu", {"emptyDir": {}}),
    ):
        for role in GPU_ROLES:
            workload = workloads(render(K8S / variant))[role]
            pod = workload["spec"]["template"]["spec"]
            mounts = container(workload)["volumeMounts"]
            (mount,) = [
                m
                for m in mounts
                if all(Path(c).is_relative_to(m["mountPath"]) for c in caches.values())
            ]
            assert not mount.get("readOnly"), (variant, role)
            (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            assert {k: v for k, v in volume.items() if k != "name"} == expected, (variant, role)
            assert pod["securityContext"]["fsGroup"] == 10001, (variant, role)
