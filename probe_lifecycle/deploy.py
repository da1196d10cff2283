"""Load a trained probe into running routers, without a restart.

    python -m probe_lifecycle.deploy --probe PROBE_DIR \
        --routers HOST:PORT[,HOST:PORT...] | dns:NAME:PORT  [--engine HOST:PORT] [--no-replace]

The probe is checked locally first (the router's own loader), then against the
engine's model when --engine is given (hidden size, layers, tensor type: the
router's compatibility rule), then shipped inline through
ProbeAdminService.LoadProbe to every replica, with undercurrent_client (TLS and
tokens from the environment, see common.security.client). If a replica refuses
it, the replicas that had not held the probe before unload it again, so a failed
deployment does not leave the probe on some replicas only. With --engine the
command returns once the engine's router catalog offers the probe, so a Generate
that binds it by name succeeds.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.enum_names import short_name
from common.probe_format.files import ProbeFileError, load_probe_bytes
from common.probe_format.manifest import ManifestError
from common.router_targets import DnsTarget, parse_targets, resolve_dns
from probe_lifecycle.cli import OneLineParser, fail
from probe_lifecycle.dataset import MODEL_IDENTITY
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import engine_pb2 as engine_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent_client import AsyncEngineClient, AsyncProbeAdminClient, RpcError
from undercurrent_client.capture_file import model_to_dict
from undercurrent_client.connection import from_env
from undercurrent_client.requests import inline_probe

PROVENANCE_FILE = "provenance.json"
CALL_TIMEOUT = 30


class DeployError(RuntimeError):
    """A probe that was not deployed; names the replica or field."""


@dataclass
class Deployed:
    address: str
    probe: types_pb.ProbeInfo
    replaced: bool  # the replica held a probe of this name before


@dataclass(frozen=True)
class Replicas:
    """The router replicas a --routers value names. `server_name` is the DNS name
    they were resolved from: with TLS each replica's certificate must carry that
    name, not its address, as when the engine dials them."""

    addresses: list[str]
    server_name: str | None = None


async def router_replicas(spec: str) -> Replicas:
    """Every replica of "host:port[,host:port...]" or "dns:NAME:PORT" (resolved now),
    parsed and resolved exactly as the engine finds its routers."""
    target = parse_targets(spec)
    if isinstance(target, DnsTarget):
        try:
            addresses = await resolve_dns(target.host, target.port)
        except OSError as err:
            raise ValueError(f"--routers {spec!r}: {target.host} does not resolve: {err}") from None
        if not addresses:
            raise ValueError(f"--routers {spec!r}: {target.host} resolves to no address")
        return Replicas(addresses, server_name=target.host)
    return Replicas(list(target.addresses))


def check_against_engine(directory: Path, manifest, model: types_pb.ModelInfo) -> None:
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
    try:
        inline = inline_probe(probe_dir)
    except ValueError as err:
        raise DeployError(f"--probe {err}") from None
    try:
        if name or action:
            inline.manifest_json = renamed(inline.manifest_json, name, action)
        probe = load_probe_bytes(inline.manifest_json, inline.weights_safetensors,
                                 source=str(probe_dir))
    except (ManifestError, ProbeFileError, json.JSONDecodeError) as err:
        raise DeployError(f"--probe {probe_dir}: {err}") from None
    name = probe.name
    if engine:
        async with AsyncEngineClient(from_env(engine), timeout=CALL_TIMEOUT) as client:
            try:
                model = await client.model_info()
            except RpcError as err:
                raise DeployError(f"--engine {engine}: {err.code.name}: {err.details}") from None
        check_against_engine(probe_dir, probe.manifest, model)
    try:
        replicas = await router_replicas(routers)
    except ValueError as err:
        raise DeployError(str(err)) from None
    admins = [AsyncProbeAdminClient(from_env(a, admin=True, server_name=replicas.server_name),
                                    timeout=CALL_TIMEOUT) for a in replicas.addresses]
    try:
        outcomes = await asyncio.gather(*(_load(admin, name, inline, replace) for admin in admins))
        failures = [(admin, o) for admin, o in zip(admins, outcomes) if isinstance(o, str)]
        if failures:
            undone = [admin for admin, o in zip(admins, outcomes)
                      if isinstance(o, Deployed) and not o.replaced]
            await asyncio.gather(*(_unload(admin, name) for admin in undone))
            details = "; ".join(f"{admin.connection.target}: {message}" for admin, message in failures)
            raise DeployError(
                f"probe {name!r} was refused by {len(failures)} of {len(admins)} replica(s): "
                f"{details}" + (f" (unloaded again from {[a.connection.target for a in undone]})"
                                if undone else "")
            )
    finally:
        await asyncio.gather(*(admin.close() for admin in admins))
    if engine:
        await wait_until_offered(engine, name, wait)
    return list(outcomes)


async def _load(admin: AsyncProbeAdminClient, name: str, inline: admin_pb.InlineProbe,
                replace: bool) -> Deployed | str:
    try:
        before = await admin.list()
        loaded = await admin.load(inline=inline, replace=replace)
    except RpcError as err:
        return f"{err.code.name}: {err.details}"
    return Deployed(admin.connection.target, loaded, any(p.name == name for p in before))


async def _unload(admin: AsyncProbeAdminClient, name: str) -> None:
    try:
        await admin.unload(name, force=True)
    except RpcError:
        pass  # the failure being reported is the deployment's; this one is best effort


async def wait_until_offered(engine: str, probe: str, timeout: float) -> None:
    """Returns once a Generate binding `probe` is accepted (router catalogs reach the
    engine asynchronously after a load); the check generates one token, observe only."""
    request = engine_pb.GenerateRequest(token_ids=engine_pb.TokenIds(ids=[1, 2, 3]),
                                 sampling=engine_pb.SamplingParams(max_tokens=1, temperature=0))
    request.probes.add(probe=probe, failure_policy=types_pb.FAILURE_POLICY_FAIL_OPEN,
                       action=types_pb.PROBE_ACTION_OBSERVE)
    deadline = time.monotonic() + timeout
    async with AsyncEngineClient(from_env(engine), timeout=CALL_TIMEOUT) as client:
        while True:
            try:
                async for _ in client.generate(request):
                    pass
                return
            except RpcError as err:
                if err.code != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                    raise DeployError(
                        f"--engine {engine}: probe {probe!r} not offered after loading: "
                        f"{err.code.name}: {err.details}"
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
        kind = short_name(types_pb.ProbeKind, p.kind).lower()
        print(f"{'replaced' if item.replaced else 'loaded'} {p.name} (version {p.version}, {kind}, "
              f"threshold {p.threshold:.6g}) on router {item.address}")
    if args.engine:
        print(f"engine {args.engine} offers {deployed[0].probe.name}; bind it by name in Generate")
    return 0


if __name__ == "__main__":
    sys.exit(main())
