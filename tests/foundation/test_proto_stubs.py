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
    imports = {engine_pb2: ["undercurrent/v1/types.proto"], admin_pb2: ["undercurrent/v1/types.proto"],
               router_session_pb2: ["google/rpc/code.proto", "undercurrent/v1/types.proto"]}
    for module, service in files.items():
        assert module.DESCRIPTOR.package == "undercurrent.v1"
        assert set(module.DESCRIPTOR.services_by_name) == {service}
        assert [d.name for d in module.DESCRIPTOR.dependencies] == imports[module]
    assert not types_pb2.DESCRIPTOR.services_by_name and not types_pb2.DESCRIPTOR.dependencies
    for module, name in ((engine_pb2_grpc, "EngineServiceStub"),
                         (router_session_pb2_grpc, "ProbeRouterServiceStub"),
                         (admin_pb2_grpc, "ProbeAdminServiceStub")):
        assert hasattr(module, name)


def _messages_reachable(service) -> set:
    """Every message type a service's calls send or receive, with those they nest."""
    seen, todo = set(), [t for m in service.methods for t in (m.input_type, m.output_type)]
    while todo:
        message = todo.pop()
        if message.full_name in seen:
            continue
        seen.add(message.full_name)
        todo += [f.message_type for f in message.fields if f.message_type is not None]
    return seen


def test_the_run_incarnation_stays_on_the_router_session():
    """Clients and operators never see the engine's run number: no message their
    services reach has it; the session's scores and aborts carry it beside them."""
    from google.protobuf import descriptor_pool
    from undercurrent.v1 import admin_pb2, engine_pb2, router_session_pb2

    pool = descriptor_pool.Default()
    public = set()
    for module, service in ((engine_pb2, "EngineService"), (admin_pb2, "ProbeAdminService")):
        public |= _messages_reachable(module.DESCRIPTOR.services_by_name[service])
    assert {"undercurrent.v1.ProbeScores", "undercurrent.v1.Verdict"} <= public
    carrying = {name for name in public if "incarnation" in pool.FindMessageTypeByName(name).fields_by_name}
    assert carrying == set()
    session = _messages_reachable(router_session_pb2.DESCRIPTOR.services_by_name["ProbeRouterService"])
    run_scoped = {name for name in session if "incarnation" in pool.FindMessageTypeByName(name).fields_by_name}
    assert run_scoped == {f"undercurrent.v1.{name}" for name in (
        "RequestStart", "RequestEnd", "RequestError", "SessionScores", "SessionAbort")}


def test_request_errors_carry_google_rpc_codes_from_the_vendored_code_proto_the_package_ships():
    """RequestError.code is google.rpc.Code. protoc and buf read the vendored
    proto/google/rpc/code.proto; at run time its module comes from the pinned
    googleapis-common-protos, so the two must be the same file."""
    from importlib import resources

    from google.rpc import code_pb2
    from undercurrent.v1 import router_session_pb2

    code = router_session_pb2.RequestError.DESCRIPTOR.fields_by_name["code"]
    assert code.enum_type is code_pb2.Code.DESCRIPTOR
    vendored = protogen.PROTO_ROOT / "google" / "rpc" / "code.proto"
    assert vendored.read_text() == (resources.files("google.rpc") / "code.proto").read_text()
    assert vendored.read_text().startswith("// Copyright") and "Apache License, Version 2.0" in vendored.read_text()
    assert protogen.proto_files() == [
        "undercurrent/v1/admin.proto", "undercurrent/v1/engine.proto",
        "undercurrent/v1/router_session.proto", "undercurrent/v1/types.proto"]  # no google/ stubs of ours
