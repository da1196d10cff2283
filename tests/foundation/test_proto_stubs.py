"""The checked-in stubs must be exactly what `make proto` generates now."""

from pathlib import Path

from common import protogen


def test_checked_in_stubs_match_the_proto(tmp_path: Path):
    generated = protogen.generate(tmp_path)
    assert generated, "protoc produced no files"
    for fresh in generated:
        relative = fresh.relative_to(tmp_path)
        checked_in = protogen.DEFAULT_OUT / relative
        assert checked_in.exists(), f"{relative} is missing; run `make proto`"
        assert checked_in.read_text() == fresh.read_text(), f"{relative} is stale; run `make proto`"


def test_stubs_import_absolutely_and_define_the_three_services():
    from undercurrent.v1 import undercurrent_pb2 as pb
    from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

    assert pb.DESCRIPTOR.package == "undercurrent.v1"
    assert set(pb.DESCRIPTOR.services_by_name) == {"EngineService", "ProbeRouterService", "ProbeAdminService"}
    for name in ("EngineServiceStub", "ProbeRouterServiceStub", "ProbeAdminServiceStub"):
        assert hasattr(pb_grpc, name)
