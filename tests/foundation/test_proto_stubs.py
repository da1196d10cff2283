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


def test_stubs_import_absolutely_and_each_file_defines_its_audience_s_service():
    from undercurrent.v1 import admin_pb2, engine_pb2, router_session_pb2, types_pb2
    from undercurrent.v1 import admin_pb2_grpc, engine_pb2_grpc, router_session_pb2_grpc

    files = {engine_pb2: "EngineService", router_session_pb2: "ProbeRouterService",
             admin_pb2: "ProbeAdminService"}
    for module, service in files.items():
        assert module.DESCRIPTOR.package == "undercurrent.v1"
        assert set(module.DESCRIPTOR.services_by_name) == {service}
        assert [d.name for d in module.DESCRIPTOR.dependencies] == ["undercurrent/v1/types.proto"]
    assert not types_pb2.DESCRIPTOR.services_by_name and not types_pb2.DESCRIPTOR.dependencies
    for module, name in ((engine_pb2_grpc, "EngineServiceStub"),
                         (router_session_pb2_grpc, "ProbeRouterServiceStub"),
                         (admin_pb2_grpc, "ProbeAdminServiceStub")):
        assert hasattr(module, name)
