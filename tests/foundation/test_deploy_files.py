"""compose.yaml and the Kubernetes manifests describe the deployment we test."""

import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


def test_compose_file_is_valid_and_wires_engine_to_router_replicas():
    docker_compose = shutil.which("docker-compose")
    assert docker_compose, ".ci/run installs docker-compose to check compose.yaml"
    result = subprocess.run(
        [docker_compose, "-f", str(REPO / "compose.yaml"), "config"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    services = config["services"]
    assert {"engine", "router", "models"} <= set(services)
    assert services["router"]["deploy"]["replicas"] >= 2
    assert "--router=dns:router:50061" in services["engine"]["command"]


def test_router_service_is_headless_so_every_pod_is_a_replica():
    documents = list(yaml.safe_load_all((REPO / "deploy/k8s/router.yaml").read_text()))
    service = next(d for d in documents if d["kind"] == "Service")
    assert service["spec"]["clusterIP"] == "None"
    engine = next(
        d for d in yaml.safe_load_all((REPO / "deploy/k8s/engine.yaml").read_text())
        if d["kind"] == "Deployment"
    )
    args = engine["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--router=dns:{service['metadata']['name']}:50061" in args
