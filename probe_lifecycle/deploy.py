"""Load a trained probe into running routers, without a restart.

    python -m probe_lifecycle.deploy --probe PROBE_DIR \
        --routers HOST:PORT[,HOST:PORT...] | dns:NAME:PORT  [--engine HOST:PORT] [--no-replace]

The probe is checked locally first (the router's own loader), then against the
engine's model when --engine is given (hidden size, layers, tensor type: the
router's compatibility rule), then shipped inline through
ProbeAdminService.LoadProbe to every replica. If a replica refuses it, the
replicas that had not held the probe before unload it again, so a failed
deployment does not leave the probe on some replicas only. With --engine the
command returns once the engine's router catalog offers the probe, so a
Generate that binds it by name succeeds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from probe_lifecycle.cli import OneLineParser, fail
from probe_lifecycle import connect
from probe_lifecycle.dataset import MODEL_IDENTITY, model_to_dict
from common.probe_format.manifest import ManifestError
from common.probe_format.files import MANIFEST_FILE, WEIGHTS_FILE, ProbeFileError, load_probe_bytes
from undercurrent.v1 import undercurrent_pb2 as pb
from undercurrent.v1 import undercurrent_pb2_grpc as pb_grpc

PROVENANCE_FILE = "provenance.json"


class DeployError(RuntimeError):
    """A probe that was not deployed; names the replica or field."""


@dataclass
class Deployed:
    address: str
    probe: pb.ProbeInfo
    replaced: bool  # the replica held a probe of this name before


def read_probe(directory: str | Path) -> tuple[str, bytes]:
    directory = Path(directory)
    try:
        manifest_json = (directory / MANIFEST_FILE).read_text()
        weights = (directory / WEIGHTS_FILE).read_bytes()
    except OSError as err:
        raise DeployError(f"--probe {directory}: {err.strerror or err}") from None
    return manifest_json, weights


def check_against_engine(directory: Path, manifest, model: pb.ModelInfo) -> None:
    """The router's compatibility rule, and the model the probe was trained on."""
    reason = manifest.incompatibility(model)
    if reason is not None:
        raise DeployError(f"--probe {directory}: {reason}")
    provenance_path = directory / PROVENANCE_FILE
    if provenance_path.exists():
        trained_on = json.loads(provenance_path.read_text()).get("model", {})
        engine = model_to_dict(model)
        for name in MODEL_IDENTITY:
            if name in trained_on and trained_on[name] != engine.get(name):
                raise DeployError(
                    f"--probe {directory}: {PROVENANCE_FILE} model.{name}: trained on "
                    f"{trained_on[name]!r}, the engine serves {engine.get(name)!r}"
                )


def renamed(manifest_json: str, name: str | None, action: str | None) -> str:
    """The manifest under another name and/or action: e.g. an observe-only shadow copy
    next to the enforcing probe, whose scores stream to clients (the router streams
    scores of observe bindings only)."""
    manifest = json.loads(manifest_json)
    if name:
        manifest["name"] = name
    if action:
        manifest["action"] = action
    return json.dumps(manifest)


async def deploy(probe_dir: str | Path, routers: str, engine: str | None = None,
                 replace: bool = True, wait: float = 60, name: str | None = None,
                 action: str | None = None) -> list[Deployed]:
    probe_dir = Path(probe_dir)
    manifest_json, weights = read_probe(probe_dir)
    try:
        if name or action:
            manifest_json = renamed(manifest_json, name, action)
        probe = load_probe_bytes(manifest_json, weights, source=str(probe_dir))
    except (ManifestError, ProbeFileError, json.JSONDecodeError) as err:
        raise DeployError(f"--probe {probe_dir}: {err}") from None
    name = probe.name
    if engine:
        async with connect.channel(engine) as channel:
            model = await _model_info(pb_grpc.EngineServiceStub(channel), engine)
        check_against_engine(probe_dir, probe.manifest, model)
    try:
        replicas = await connect.router_replicas(routers)
    except ValueError as err:
        raise DeployError(str(err)) from None
    addresses, server_name = replicas.addresses, replicas.server_name
    request = pb.LoadProbeRequest(
        inline=pb.InlineProbe(manifest_json=manifest_json, weights_safetensors=weights),
        replace=replace,
    )
    outcomes = await asyncio.gather(*(_load(a, server_name, name, request) for a in addresses))
    failures = [(a, o) for a, o in zip(addresses, outcomes) if isinstance(o, str)]
    if failures:
        undone = [o.address for o in outcomes if isinstance(o, Deployed) and not o.replaced]
        await asyncio.gather(*(_unload(a, server_name, name) for a in undone))
        details = "; ".join(f"{a}: {message}" for a, message in failures)
        raise DeployError(
            f"probe {name!r} was refused by {len(failures)} of {len(addresses)} replica(s): "
            f"{details}" + (f" (unloaded again from {undone})" if undone else "")
        )
    if engine:
        await wait_until_offered(engine, name, wait)
    return list(outcomes)


async def _model_info(stub: pb_grpc.EngineServiceStub, address: str) -> pb.ModelInfo:
    try:
        return (await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)).model
    except grpc.aio.AioRpcError as err:
        raise DeployError(f"--engine {address}: {err.code().name}: {err.details()}") from None


async def _load(address: str, server_name: str | None, name: str,
                request: pb.LoadProbeRequest) -> Deployed | str:
    async with connect.channel(address, server_name) as channel:
        admin = pb_grpc.ProbeAdminServiceStub(channel)
        try:
            before = await admin.ListProbes(pb.ListProbesRequest(), timeout=30)
            reply = await admin.LoadProbe(request, timeout=30)
        except grpc.aio.AioRpcError as err:
            return f"{err.code().name}: {err.details()}"
    return Deployed(address, reply.probe, any(p.name == name for p in before.probes))


async def _unload(address: str, server_name: str | None, name: str) -> None:
    async with connect.channel(address, server_name) as channel:
        admin = pb_grpc.ProbeAdminServiceStub(channel)
        try:
            await admin.UnloadProbe(pb.UnloadProbeRequest(name=name, force=True), timeout=30)
        except grpc.aio.AioRpcError:
            pass  # the failure being reported is the deployment's; this one is best effort


async def wait_until_offered(engine: str, probe: str, timeout: float) -> None:
    """Returns once a Generate binding `probe` is accepted (router catalogs reach the
    engine asynchronously after a load); the check generates one token, observe only."""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 sampling=pb.SamplingParams(max_tokens=1, temperature=0))
    request.probes.add(probe=probe, failure_policy=pb.FAILURE_POLICY_FAIL_OPEN,
                       action=pb.PROBE_ACTION_OBSERVE)
    deadline = time.monotonic() + timeout
    async with connect.channel(engine) as channel:
        stub = pb_grpc.EngineServiceStub(channel)
        while True:
            try:
                async for _ in stub.Generate(request, timeout=30):
                    pass
                return
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise DeployError(
                        f"--engine {engine}: probe {probe!r} not offered after loading: "
                        f"{err.code().name}: {err.details()}"
                    ) from None
            await asyncio.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="probe_lifecycle.deploy", description=__doc__.splitlines()[0])
    parser.add_argument("--probe", required=True, help="probe directory (manifest + weights)")
    parser.add_argument("--routers", required=True,
                        help="HOST:PORT[,HOST:PORT...] or dns:NAME:PORT (every replica)")
    parser.add_argument("--engine", default=None,
                        help="HOST:PORT: check the probe against its model, wait until offered")
    parser.add_argument("--no-replace", action="store_true",
                        help="refuse if a replica already holds a probe of this name")
    parser.add_argument("--wait", type=float, default=60, help="seconds to wait for the engine")
    parser.add_argument("--name", default=None, help="load under this name instead")
    parser.add_argument("--action", choices=("abort", "observe"), default=None,
                        help="override the manifest's action (observe: a shadow copy)")
    args = parser.parse_args(argv)
    try:
        deployed = asyncio.run(deploy(args.probe, args.routers, args.engine,
                                      replace=not args.no_replace, wait=args.wait,
                                      name=args.name, action=args.action))
    except DeployError as err:
        fail("probe_lifecycle.deploy", str(err))
    for item in deployed:
        p = item.probe
        print(f"{'replaced' if item.replaced else 'loaded'} {p.name} (version {p.version}, {p.kind}, "
              f"threshold {p.threshold:.6g}) on router {item.address}")
    if args.engine:
        print(f"engine {args.engine} offers {deployed[0].probe.name}; bind it by name in Generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
