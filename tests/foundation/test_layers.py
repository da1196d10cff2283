"""A package's name says which process runs it, so first-party imports only go
down the floors: each service and the client stand on `common` alone, the probe
lifecycle on the client, and nothing imports a service from outside it. An
import across (the client reaching into the router, say) would ship a
service's code, and its dependencies, to every process that imports it."""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# package -> the first-party packages it may import
MAY_IMPORT = {
    "common": set(),
    "engine_service": {"common"},
    "router_service": {"common"},
    "undercurrent_client": {"common"},
    "probe_lifecycle": {"common", "undercurrent_client"},
}


def first_party_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.partition(".")[0])
    return found & set(MAY_IMPORT)


def test_imports_go_only_down_the_floors():
    crossings = []
    for package, allowed in MAY_IMPORT.items():
        for path in sorted((REPO / package).rglob("*.py")):
            if "undercurrent" in path.relative_to(REPO / package).parts:  # generated stubs
                continue
            for imported in sorted(first_party_imports(path) - allowed - {package}):
                crossings.append(f"{path.relative_to(REPO)} imports {imported}")
    assert crossings == []


def test_the_check_sees_a_crossing(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom router_service.verdict_log import VerdictLog\nfrom . import x\n")
    assert first_party_imports(module) == {"router_service"}
