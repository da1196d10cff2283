"""Deployment to real router processes (no engine): every replica, and no half deployment."""

from __future__ import annotations

import pytest

from probe_lifecycle.deploy import DeployError, Replicas, deploy, router_replicas
from probe_lifecycle.train import TrainOptions, train_probe
from tests.lifecycle import synthetic
from tools import stack
from undercurrent.v1 import admin_pb2 as admin_pb
from undercurrent.v1 import types_pb2 as types_pb
from undercurrent.v1 import admin_pb2_grpc as admin_pb_grpc


@pytest.fixture
def probe_dir(tmp_path):
    synthetic.write_dataset(tmp_path / "ds", count=20)
    train_probe(tmp_path / "ds", tmp_path / "probe", TrainOptions(name="planted", layer=1))
    return tmp_path / "probe"


@pytest.fixture
async def routers(tmp_path):
    started = []
    for i in range(2):
        (tmp_path / f"probes-{i}").mkdir()
        started.append(stack.router(stack.free_port(), tmp_path / f"probes-{i}").start())
    try:
        for router in started:
            await router.wait_health(want_serving=None, timeout=60)
        yield started
    finally:
        for router in started:
            router.kill()


async def listed(address: str) -> list[tuple[str, int]]:
    async with stack.channel(address) as channel:
        reply = await admin_pb_grpc.ProbeAdminServiceStub(channel).ListProbes(admin_pb.ListProbesRequest())
    return [(p.name, p.action) for p in reply.probes]


async def test_router_replicas_resolve_a_dns_name_to_every_address_and_keep_the_name():
    found = await router_replicas("dns:localhost:50061")
    assert "127.0.0.1:50061" in found.addresses and found.server_name == "localhost"
    listed = await router_replicas("10.0.0.1:1,10.0.0.2:2")
    assert listed == Replicas(["10.0.0.1:1", "10.0.0.2:2"], server_name=None)
    with pytest.raises(ValueError, match="does not resolve"):
        await router_replicas("dns:no-such-host.invalid:50061")


async def test_a_probe_reaches_every_replica_and_a_shadow_copy_observes(routers, probe_dir):
    targets = ",".join(r.address for r in routers)
    deployed = await deploy(probe_dir, targets)
    assert [(d.address, d.probe.name, d.replaced) for d in deployed] == [
        (r.address, "planted", False) for r in routers]
    again = await deploy(probe_dir, targets, name="planted_shadow", action="observe")
    assert all(d.probe.action == types_pb.PROBE_ACTION_OBSERVE for d in again)
    for router in routers:
        assert sorted(await listed(router.address)) == [
            ("planted", types_pb.PROBE_ACTION_ABORT), ("planted_shadow", types_pb.PROBE_ACTION_OBSERVE)]
    assert all(d.replaced for d in await deploy(probe_dir, targets))


async def test_a_replica_that_refuses_undoes_the_others(routers, probe_dir):
    dead = f"127.0.0.1:{stack.free_port()}"
    with pytest.raises(DeployError) as refused:
        await deploy(probe_dir, f"{routers[0].address},{dead}")
    message = str(refused.value)
    assert f"probe 'planted' was refused by 1 of 2 replica(s): {dead}: UNAVAILABLE" in message
    assert f"unloaded again from ['{routers[0].address}']" in message
    assert await listed(routers[0].address) == []
