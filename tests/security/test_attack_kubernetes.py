"""Attack: from a pod of the cluster (or a compromised Undercurrent pod), reach
what only the engine's nodes or the engine should reach.

The multi-node overlay published vLLM's inter-node port (unauthenticated by
vLLM's own account) through a Service, with no NetworkPolicy anywhere: any pod
could talk to it, and to the routers and the metrics. The base now denies
everything to and from Undercurrent pods but the paths the services need.

No cluster runs here: every connection is judged from the rendered manifests
by Kubernetes' NetworkPolicy rules (tests/deploy/network_policy.py), for the
pods the manifests run and the attackers below. Whether a cluster enforces
them depends on its network plugin (docs/deployment.md).
"""

from __future__ import annotations

import pytest

from tests.deploy.kustomize_render import render
from tests.deploy.network_policy import Pod, allowed, pods_of
from tests.deploy.test_kubernetes import K8S, OVERLAYS

ENGINE_GRPC, ENGINE_METRICS, ROUTER_GRPC, ROUTER_METRICS, ROUTER_HEALTH, MASTER = 50051, 9400, 50061, 9401, 50062, 29501
OUTSIDE = Pod("a client outside the cluster", None)
STRANGER = Pod("any pod of the cluster", {"app": "something-else"}, namespace="other")
NEIGHBOUR = Pod("a pod of the same namespace", {"app": "something-else"})
OPERATOR = Pod("a probe-admin pod", {"undercurrent.io/probe-admin": "true"})
SCRAPER = Pod("a metrics scraper", {"undercurrent.io/metrics-scraper": "true"}, namespace="monitoring")
DNS = Pod("kube-dns", {"k8s-app": "kube-dns"}, namespace="kube-system")


def cluster(overlay: str):
    documents = render(K8S / "overlays" / overlay)
    return documents, pods_of(documents)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_the_engine_and_operators_reach_the_routers(overlay):
    documents, pods = cluster(overlay)
    engine, router = pods["undercurrent-engine"], pods["undercurrent-router"]
    reach = {source.name: allowed(documents, source, router, ROUTER_GRPC)
             for source in (engine, OPERATOR, NEIGHBOUR, STRANGER, OUTSIDE, router)}
    assert reach == {engine.name: True, OPERATOR.name: True, NEIGHBOUR.name: False, STRANGER.name: False,
                     OUTSIDE.name: False, router.name: False}
    # The router's plaintext health port is for the pod's own loopback only.
    assert not any(allowed(documents, source, router, ROUTER_HEALTH) for source in (engine, OPERATOR, STRANGER))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_clients_reach_the_engines_api_and_nothing_else_of_it(overlay):
    documents, pods = cluster(overlay)
    engine = pods["undercurrent-engine"]
    for client in (OUTSIDE, STRANGER, NEIGHBOUR):
        assert allowed(documents, client, engine, ENGINE_GRPC), client
        assert not allowed(documents, client, engine, ENGINE_METRICS), client
        assert not allowed(documents, client, engine, MASTER), client


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_metrics_reach_only_scrapers(overlay):
    documents, pods = cluster(overlay)
    engine, router = pods["undercurrent-engine"], pods["undercurrent-router"]
    assert allowed(documents, SCRAPER, engine, ENGINE_METRICS) and allowed(documents, SCRAPER, router, ROUTER_METRICS)
    assert not allowed(documents, engine, router, ROUTER_METRICS)
    assert not allowed(documents, STRANGER, router, ROUTER_METRICS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_compromised_router_reaches_nothing(overlay):
    documents, pods = cluster(overlay)
    router = pods["undercurrent-router"]
    targets = [(pods["undercurrent-engine"], port) for port in (ENGINE_GRPC, ENGINE_METRICS, MASTER)]
    targets += [(STRANGER, 443), (DNS, 53)]
    if "undercurrent-engine-worker" in pods:
        targets.append((pods["undercurrent-engine-worker"], MASTER))
    assert [t.name for t, port in targets if allowed(documents, router, t, port)] == []


def test_vllms_inter_node_ports_are_open_between_the_engines_nodes_only():
    documents, pods = cluster("gpu-multinode")
    engine, worker = pods["undercurrent-engine"], pods["undercurrent-engine-worker"]
    for port in (MASTER, 40000, 50000):  # the master port and ports vLLM picks at run time
        assert allowed(documents, worker, engine, port) and allowed(documents, engine, worker, port), port
        for attacker in (pods["undercurrent-router"], OPERATOR, NEIGHBOUR, STRANGER, OUTSIDE, SCRAPER):
            assert not allowed(documents, attacker, engine, port) or port == ENGINE_GRPC, (attacker, port)
            assert not allowed(documents, attacker, worker, port), (attacker, port)
    # A compromised worker reaches the engine's nodes and DNS, nothing else.
    assert allowed(documents, worker, DNS, 53)
    assert not allowed(documents, worker, pods["undercurrent-router"], ROUTER_GRPC)
    assert not allowed(documents, worker, STRANGER, 443)
