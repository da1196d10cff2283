"""The contract lints clean with buf's STANDARD and COMMENTS rules (buf.yaml)."""

import subprocess
from pathlib import Path

import yaml

from tools import node_client
from undercurrent.v1 import admin_pb2, engine_pb2, router_session_pb2, types_pb2

REPO = Path(__file__).resolve().parents[2]


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(node_client.buf()), "lint"], cwd=root, capture_output=True,
                          text=True, timeout=120)


def test_buf_config_uses_standard_and_comment_rules_on_proto():
    config = yaml.safe_load((REPO / "buf.yaml").read_text())
    assert config["version"] == "v2"
    assert config["modules"] == [{"path": "proto"}]
    assert set(config["lint"]["use"]) == {"STANDARD", "COMMENTS"}
    # Only the vendored googleapis files are left out: every file of ours lints.
    assert "except" not in config["lint"] and config["lint"]["ignore"] == ["proto/google"]


def test_contract_lints_clean():
    result = lint(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def test_lint_reports_an_unprefixed_enum_value_and_a_missing_comment(tmp_path):
    """The same config finds what it is meant to find (a lint that cannot fail proves nothing)."""
    (tmp_path / "buf.yaml").write_text((REPO / "buf.yaml").read_text())
    folder = tmp_path / "proto" / "undercurrent" / "v1"
    folder.mkdir(parents=True)
    (folder / "bad.proto").write_text(
        'syntax = "proto3";\n// The package.\npackage undercurrent.v1;\n'
        "// Colours.\nenum Colour {\n  // Unset.\n  COLOUR_UNSPECIFIED = 0;\n  // Red.\n  RED = 1;\n}\n"
        "// A message.\nmessage Thing {\n  string name = 1;\n}\n"
    )
    result = lint(tmp_path)
    assert result.returncode != 0
    assert 'Enum value name "RED" should be prefix' in result.stdout, result.stdout
    assert 'Field "name" should have a non-empty comment' in result.stdout, result.stdout


def test_file_options_name_go_and_java_packages():
    outer_names = set()
    for contract in (admin_pb2, engine_pb2, router_session_pb2, types_pb2):
        options = contract.DESCRIPTOR.GetOptions()
        assert options.go_package.endswith("/gen/go/undercurrent/v1;undercurrentv1")
        assert (options.java_package, options.java_multiple_files) == ("dev.undercurrent.v1", True)
        outer_names.add(options.java_outer_classname)
    assert len(outer_names) == 4  # one Java outer class per file, none clashing
