"""The contract lints clean with buf's STANDARD and COMMENTS rules (buf.yaml),
and breaks nothing the released contract (proto/released/) promised."""

import shutil
from pathlib import Path

import yaml
from google.protobuf import descriptor_pb2

from tools.contract import RELEASED, breaking, lint
from undercurrent.v1 import admin_pb2, engine_pb2, router_session_pb2, types_pb2

REPO = Path(__file__).resolve().parents[2]


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


def test_released_image_holds_the_v1_contract():
    released = descriptor_pb2.FileDescriptorSet.FromString(RELEASED.read_bytes())
    assert sorted(f.name for f in released.file) == [
        "google/rpc/code.proto", "undercurrent/v1/admin.proto", "undercurrent/v1/engine.proto",
        "undercurrent/v1/router_session.proto", "undercurrent/v1/types.proto"]
    services = {s.name for f in released.file for s in f.service}
    assert services == {"EngineService", "ProbeAdminService", "ProbeRouterService"}


def test_contract_breaks_nothing_the_released_one_promised():
    result = breaking(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout == ""


def edited_contract(tmp_path: Path, path: str, old: str, new: str) -> Path:
    """A copy of the workspace with one edit to one proto file."""
    shutil.copy(REPO / "buf.yaml", tmp_path / "buf.yaml")
    shutil.copytree(REPO / "proto", tmp_path / "proto", ignore=shutil.ignore_patterns("released"))
    proto = tmp_path / "proto" / path
    text = proto.read_text()
    assert old in text
    proto.write_text(text.replace(old, new))
    return tmp_path


def test_breaking_reports_a_removed_field(tmp_path):
    """The check bites: deleting a released field fails it, naming the field."""
    root = edited_contract(tmp_path, "undercurrent/v1/engine.proto", "  int64 unprobed_tokens = 5;\n", "")
    assert lint(root).returncode == 0  # still a well-formed, commented contract
    result = breaking(root)
    assert result.returncode != 0
    assert ('Previously present field "5" with name "unprobed_tokens" on message "GenerateFinished" '
            "was deleted.") in result.stdout, result.stdout


def test_breaking_reports_a_renamed_field_and_its_json_name(tmp_path):
    """A rename keeps the binary wire format but not JSON or generated code."""
    root = edited_contract(tmp_path, "undercurrent/v1/engine.proto", "int32 generated_tokens = 4;",
                           "int32 tokens_generated = 4;")
    result = breaking(root)
    assert result.returncode != 0
    assert 'changed option "json_name" from "generatedTokens" to "tokensGenerated"' in result.stdout
    assert 'changed name from "generated_tokens" to "tokens_generated"' in result.stdout


def test_breaking_lets_an_added_field_pass(tmp_path):
    root = edited_contract(tmp_path, "undercurrent/v1/engine.proto", "  int64 unprobed_tokens = 5;\n",
                           "  int64 unprobed_tokens = 5;\n  // A new count.\n  int64 new_count = 99;\n")
    result = breaking(root)
    assert result.returncode == 0, result.stdout + result.stderr
