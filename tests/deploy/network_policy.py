"""Which connections rendered NetworkPolicies allow, by Kubernetes' rules, for
the offline tests (no cluster here).

The subset the shipped manifests use, refusing anything else: pod and
namespace selectors (matchLabels and matchExpressions with In, NotIn, Exists,
DoesNotExist), ports by number or by a container port's name, and the union
semantics: a pod no policy selects for a direction allows everything that
way; a selected pod allows only what some policy's rule admits; a connection
between pods needs the source's egress and the destination's ingress.
"""

from __future__ import annotations

from dataclasses import dataclass, field

NAMESPACE = "default"  # where the manifests are applied (they set none)


class UnsupportedPolicy(ValueError):
    """A NetworkPolicy feature this evaluator does not implement."""


@dataclass(frozen=True)
class Pod:
    """A pod as the policies see it: its labels, namespace and named ports.
    `labels` None: not a pod at all (a client outside the cluster)."""

    name: str
    labels: dict | None
    namespace: str = NAMESPACE
    namespace_labels: dict = field(default_factory=dict)
    ports: dict = field(default_factory=dict)  # container port name -> number


def pods_of(documents: list[dict]) -> dict[str, Pod]:
    """The pods the Deployments and StatefulSets run, by workload name."""
    pods = {}
    for document in documents:
        if document["kind"] in ("Deployment", "StatefulSet"):
            template = document["spec"]["template"]
            ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"]
                     for p in c.get("ports", []) if "name" in p}
            pods[document["metadata"]["name"]] = Pod(document["metadata"]["name"],
                                                     template["metadata"]["labels"], ports=ports)
    return pods


def _matches(selector: dict, labels: dict | None) -> bool:
    if labels is None:
        return False
    unsupported = set(selector) - {"matchLabels", "matchExpressions"}
    if unsupported:
        raise UnsupportedPolicy(f"selector keys {sorted(unsupported)}")
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        present = key in labels
        if operator == "In":
            ok = present and labels[key] in values
        elif operator == "NotIn":
            ok = not present or labels[key] not in values
        elif operator == "Exists":
            ok = present
        elif operator == "DoesNotExist":
            ok = not present
        else:
            raise UnsupportedPolicy(f"selector operator {operator}")
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, other: Pod, policy_namespace: str) -> bool:
    unsupported = set(peer) - {"podSelector", "namespaceSelector"}
    if unsupported:
        raise UnsupportedPolicy(f"peer keys {sorted(unsupported)}")
    if other.labels is None:  # outside the cluster: only an ipBlock could name it
        return False
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": other.namespace,
                                                   **other.namespace_labels}):
            return False
    elif other.namespace != policy_namespace:
        return False
    return _matches(peer.get("podSelector", {}), other.labels)


def _port_admits(ports: list[dict] | None, port: int, protocol: str, destination: Pod) -> bool:
    if not ports:
        return True
    for entry in ports:
        unsupported = set(entry) - {"port", "protocol"}
        if unsupported:
            raise UnsupportedPolicy(f"port keys {sorted(unsupported)}")
        wanted = entry.get("port")
        number = destination.ports.get(wanted) if isinstance(wanted, str) else wanted
        if entry.get("protocol", "TCP") == protocol and (wanted is None or number == port):
            return True
    return False


def _policies(documents: list[dict]) -> list[dict]:
    return [d for d in documents if d["kind"] == "NetworkPolicy"]


def _direction_allows(documents, pod: Pod, direction: str, other: Pod, port: int, protocol: str,
                      destination: Pod) -> bool:
    kind = "Ingress" if direction == "ingress" else "Egress"
    peers_key = "from" if direction == "ingress" else "to"
    selecting = [p for p in _policies(documents)
                 if p["metadata"].get("namespace", NAMESPACE) == pod.namespace
                 and _matches(p["spec"]["podSelector"], pod.labels)
                 and kind in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get(direction, []):
            unsupported = set(rule) - {peers_key, "ports"}
            if unsupported:
                raise UnsupportedPolicy(f"{direction} rule keys {sorted(unsupported)}")
            peers = rule.get(peers_key)
            peer_ok = not peers or any(_peer_admits(peer, other, policy["metadata"].get("namespace", NAMESPACE))
                                       for peer in peers)
            if peer_ok and _port_admits(rule.get("ports"), port, protocol, destination):
                return True
    return False


def allowed(documents: list[dict], source: Pod, destination: Pod, port: int, protocol: str = "TCP") -> bool:
    """Whether `source` may open a connection to `destination` on `port`."""
    egress = source.labels is None or _direction_allows(documents, source, "egress", destination, port,
                                                        protocol, destination)
    return egress and _direction_allows(documents, destination, "ingress", source, port, protocol, destination)
