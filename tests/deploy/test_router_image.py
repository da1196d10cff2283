"""The router image holds only what deploy/Dockerfile.router copies (no vLLM, no
torch, no engine). Every command run from that image must import from those
files alone: the router, the compose jobs and health checks, and the probe
deployment docs/deployment.md runs in a one-off router container."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile.router"
COMMANDS = [
    ["router_service"],
    ["common.devcerts"],
    ["common.health_probe"],
    ["probe_lifecycle", "deploy"],
]


def copied_sources() -> list[str]:
    """The repository paths Dockerfile.router COPYs into the image."""
    sources = []
    for line in DOCKERFILE.read_text().splitlines():
        if match := re.match(r"COPY\s+(.+)\s+\S+$", line.strip()):
            sources += match.group(1).split()
    return sources


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("router-image")
    for source in copied_sources():
        path = REPO / source
        target = root / source.rstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, target)
    return root


def test_the_dockerfile_copies_the_router_and_no_engine_code():
    sources = copied_sources()
    assert "router_service/" in sources and "probe_lifecycle/" in sources
    assert [s for s in sources if s.startswith("engine_service")] == ["engine_service/__init__.py"]


# Runs a module as `python -m` would, with the repository's editable install
# (pip install -e ., as in the image) pointed at the copied tree, so a module the
# image lacks (say engine_service.link) fails to import here as it does there.
RUN_FROM_TREE = """
import runpy, sys
repo, tree, module, *args = sys.argv[1:]
for name, loaded in list(sys.modules.items()):
    if name.startswith("__editable__") and hasattr(loaded, "MAPPING"):
        loaded.MAPPING = {k: v.replace(repo, tree) for k, v in loaded.MAPPING.items()}
sys.argv = [module, *args]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c))
def test_each_command_of_the_image_runs_from_the_copied_files_alone(image_tree, command):
    result = subprocess.run([sys.executable, "-c", RUN_FROM_TREE, str(REPO), str(image_tree),
                             *command, "--help"], cwd=image_tree,
                            env={"PYTHONPATH": str(image_tree), "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
