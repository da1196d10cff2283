"""deploy/k8s, validated offline: each overlay rendered (tests/deploy/kustomize_render,
compared with `kubectl kustomize` where kubectl exists) and every object checked
against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields fail)."""

import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tests.deploy.kustomize_render import UnsupportedKustomization, render
from tools.shipped_probe import CONFIGMAP_NAME, PROBE_FILE

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
OVERLAYS = ["cpu", "gpu", "gpu-multinode"]
KUBERNETES_VERSION = "1.33.0"


def objects(overlay: str) -> dict[tuple[str, str], dict]:
    return {(d["kind"], d["metadata"]["name"]): d for d in render(K8S / "overlays" / overlay)}


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(overlay):
    rendered = render(K8S / "overlays" / overlay)
    assert {d["kind"] for d in rendered} == {
        "ConfigMap", "PersistentVolumeClaim", "Deployment", "Service",
        "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy",
    } | ({"StatefulSet"} if overlay == "gpu-multinode" else set())
    for document in rendered:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def test_the_validator_rejects_a_misplaced_field():
    deployment = objects("cpu")[("Deployment", "undercurrent-router")]
    container(deployment, "router")["livenesProbe"] = {"periodSeconds": 10}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_rendering_matches_kubectl_kustomize(overlay):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the rendering is checked by the other tests only")
    result = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / overlay)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    theirs = sorted((d for d in yaml.safe_load_all(result.stdout) if d), key=yaml.safe_dump)
    ours = sorted(render(K8S / "overlays" / overlay), key=yaml.safe_dump)
    assert ours == theirs


def test_the_renderer_refuses_features_it_does_not_implement(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: []\nimages: [{name: a, newTag: b}]\n")
    with pytest.raises(UnsupportedKustomization, match="images"):
        render(tmp_path)


TLS_DIR = "/etc/undercurrent/tls"
ROUTER_PROBE = ["python", "-m", "common.health_probe", "--insecure", "127.0.0.1:50062"]


def test_router_liveness_does_not_depend_on_probes_but_readiness_does():
    """Both on the router's plaintext health port on the pod's loopback: the
    checks hold no certificate (a router requires one on its gRPC port)."""
    router = container(objects("cpu")[("Deployment", "undercurrent-router")], "router")
    assert flags(router["args"])["--health-port"] == "50062"
    assert router["readinessProbe"]["exec"]["command"] == ROUTER_PROBE
    assert router["livenessProbe"]["exec"]["command"] == [*ROUTER_PROBE[:3], "--live", *ROUTER_PROBE[3:]]


def flags(args: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_serve_tls_with_tokens_from_secrets(overlay):
    """Both services refuse to start without TLS files or --insecure: the pods
    get them (and the token files) from required Secrets, one certificate per
    service, each service only the Secret of the tokens it checks, and no
    service account token."""
    rendered = objects(overlay)
    for name, tokens_flag, tokens_key in (("engine", "--client-tokens-file", "client-tokens"),
                                          ("router", "--admin-tokens-file", "admin-tokens")):
        deployment = rendered[("Deployment", f"undercurrent-{name}")]
        spec = deployment["spec"]["template"]["spec"]
        service = container(deployment, name)
        assert "--insecure" not in service["args"]
        assert {k: v for k, v in flags(service["args"]).items() if k.startswith("--tls") or k == tokens_flag} == {
            "--tls-cert": f"{TLS_DIR}/tls.crt", "--tls-key": f"{TLS_DIR}/tls.key",
            "--tls-ca": f"{TLS_DIR}/ca.crt", tokens_flag: f"/etc/undercurrent/tokens/{tokens_key}"}
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["tls"]["secret"] == {"secretName": f"undercurrent-{name}-tls"}
        assert volumes["tokens"]["secret"] == {
            "secretName": f"undercurrent-{tokens_key}", "items": [{"key": tokens_key, "path": tokens_key}]}
        assert [v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v] == [
            f"undercurrent-{name}-tls", f"undercurrent-{tokens_key}"]
        assert spec["automountServiceAccountToken"] is False
        mounts = {m["name"]: m for m in service["volumeMounts"]}
        assert mounts["tls"] == {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}
        assert mounts["tokens"] == {"name": "tokens", "mountPath": "/etc/undercurrent/tokens", "readOnly": True}
    engine = container(rendered[("Deployment", "undercurrent-engine")], "engine")
    for probe in ("readinessProbe", "livenessProbe"):
        command = engine[probe]["exec"]["command"]
        assert f"--tls-ca={TLS_DIR}/ca.crt" in command and "--server-name=undercurrent-engine" in command
    # Sessions from the engine's certificate only (its cert-manager dnsNames, docs/security.md).
    router = container(rendered[("Deployment", "undercurrent-router")], "router")
    assert flags(router["args"])["--engine-identities"] == "undercurrent-engine"


def test_routers_are_headless_budgeted_and_autoscaled():
    cpu = objects("cpu")
    service = cpu[("Service", "undercurrent-router")]
    assert service["spec"]["clusterIP"] == "None"
    engine = container(cpu[("Deployment", "undercurrent-engine")], "engine")
    assert f"--router=dns:{service['metadata']['name']}:50061" in engine["args"]
    selector = cpu[("Deployment", "undercurrent-router")]["spec"]["selector"]["matchLabels"]
    assert cpu[("PodDisruptionBudget", "undercurrent-router")]["spec"]["selector"]["matchLabels"] == selector
    assert cpu[("PodDisruptionBudget", "undercurrent-router")]["spec"]["maxUnavailable"] == 1
    hpa = cpu[("HorizontalPodAutoscaler", "undercurrent-router")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "undercurrent-router"}
    assert 2 <= hpa["minReplicas"] < hpa["maxReplicas"]
    # Utilization targets need a CPU request to measure against.
    router = container(cpu[("Deployment", "undercurrent-router")], "router")
    assert router["resources"]["requests"]["cpu"]


def test_referenced_configmap_and_pvc():
    cpu = objects("cpu")
    configmap = cpu[("ConfigMap", CONFIGMAP_NAME)]
    assert set(configmap["binaryData"]) == {PROBE_FILE.name}
    router_volumes = {v["name"]: v for v in cpu[("Deployment", "undercurrent-router")]["spec"]["template"]["spec"]["volumes"]}
    assert router_volumes["probes"]["configMap"]["name"] == CONFIGMAP_NAME
    engine_spec = cpu[("Deployment", "undercurrent-engine")]["spec"]["template"]["spec"]
    engine_volumes = {v["name"]: v for v in engine_spec["volumes"]}
    claim = engine_volumes["models"]["persistentVolumeClaim"]["claimName"]
    assert ("PersistentVolumeClaim", claim) in cpu
    # The CPU overlay writes the embedded model into that claim before the engine starts.
    init = engine_spec["initContainers"][0]
    assert init["command"][:3] == ["python", "-m", "common.embedded_model"]
    assert {"name": "models", "mountPath": "/models"} in init["volumeMounts"]


@pytest.mark.parametrize("overlay,shm", [("cpu", "2Gi"), ("gpu", "16Gi"), ("gpu-multinode", "16Gi")])
def test_engine_has_resources_memory_backed_shm_and_separate_probes(overlay, shm):
    deployment = objects(overlay)[("Deployment", "undercurrent-engine")]
    spec = deployment["spec"]["template"]["spec"]
    engine = container(deployment, "engine")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": shm}
    assert {"name": "dshm", "mountPath": "/dev/shm"} in engine["volumeMounts"]
    assert engine["resources"]["requests"]["cpu"] and engine["resources"]["limits"]["memory"]
    assert engine["readinessProbe"]["exec"]["command"] == [
        "python", "-m", "common.health_probe", f"--tls-ca={TLS_DIR}/ca.crt",
        "--server-name=undercurrent-engine", "127.0.0.1:50051"]
    assert "--live" in engine["livenessProbe"]["exec"]["command"]
    assert "--live" in engine["startupProbe"]["exec"]["command"]
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_gpu_overlay_requests_a_gpu_and_runs_the_cuda_image():
    gpu, cpu = objects("gpu"), objects("cpu")
    engine = container(gpu[("Deployment", "undercurrent-engine")], "engine")
    assert engine["image"] == "undercurrent-engine-gpu:0.1.0"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert {"name": "VLLM_TARGET_DEVICE", "value": "cuda"} in engine["env"]
    assert "nvidia.com/gpu" not in str(container(cpu[("Deployment", "undercurrent-engine")], "engine"))
    # The routers are the same in both overlays: only the engine changes.
    assert gpu[("Deployment", "undercurrent-router")] == cpu[("Deployment", "undercurrent-router")]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_ports_are_named_and_annotated_for_scraping(overlay):
    rendered = objects(overlay)
    for name, port in (("undercurrent-engine", 9400), ("undercurrent-router", 9401)):
        template = rendered[("Deployment", name)]["spec"]["template"]
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port)
        ports = {p["name"]: p["containerPort"] for p in template["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == port
        service_ports = {p["name"]: p["port"] for p in rendered[("Service", name)]["spec"]["ports"]}
        assert service_ports["metrics"] == port


NODE_FLAGS = ("--model", "--pipeline-parallel-size", "--nnodes", "--master-port")


def test_multinode_overlay_runs_node_1_as_a_gpu_worker_pod_that_joins_the_engine():
    multi, gpu = objects("gpu-multinode"), objects("gpu")
    engine_deployment = multi[("Deployment", "undercurrent-engine")]
    engine = container(engine_deployment, "engine")
    engine_flags = flags(engine["args"])
    # Node 0 is the GPU overlay's engine with the node flags added, nothing dropped.
    assert set(container(gpu[("Deployment", "undercurrent-engine")], "engine")["args"]) < set(engine["args"])
    assert (engine_flags["--nnodes"], engine_flags["--node-rank"]) == ("2", "0")
    assert engine_flags["--master-addr"] == "$(POD_IP)"
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in engine["env"]

    workers = multi[("StatefulSet", "undercurrent-engine-worker")]
    spec = workers["spec"]
    worker = container(workers, "worker")
    worker_flags = flags(worker["args"])
    assert worker["command"] == ["python", "-m", "engine_service.worker_node"]
    assert {k: worker_flags[k] for k in NODE_FLAGS} == {k: engine_flags[k] for k in NODE_FLAGS}
    # One pod per further node; its index is its node rank.
    assert spec["replicas"] == int(engine_flags["--nnodes"]) - 1
    assert spec["ordinals"] == {"start": 1}
    assert worker_flags["--node-rank"] == "$(NODE_RANK)"
    assert {"name": "NODE_RANK", "valueFrom": {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}} in worker["env"]
    # The master address is a headless Service of the engine pod, resolvable before it is Ready.
    master = multi[("Service", worker_flags["--master-addr"])]["spec"]
    assert master["clusterIP"] == "None" and master["publishNotReadyAddresses"] is True
    assert master["selector"] == engine_deployment["spec"]["selector"]["matchLabels"]
    assert master["selector"] != spec["selector"]["matchLabels"]
    assert [p["port"] for p in master["ports"]] == [int(engine_flags["--master-port"])]
    # A GPU per node, the same image and device, the model from a claim both pods mount.
    for pod in (engine, worker):
        assert pod["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "VLLM_TARGET_DEVICE", "value": "cuda"} in pod["env"]
    assert worker["image"] == engine["image"]
    claims = {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName") for v in spec["template"]["spec"]["volumes"]}
    assert claims["models"] == "undercurrent-models"
    assert multi[("PersistentVolumeClaim", "undercurrent-models")]["spec"]["accessModes"] == ["ReadWriteMany"]
    assert spec["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
