"""NetworkPolicy semantics, offline: whether a connection from one endpoint to another on a port is
allowed by the policies of a rendered overlay (Kubernetes' rules: a pod selected by any policy of a
direction takes only what one of those policies' rules allows in that direction; both the source's
egress and the destination's ingress must allow a connection between pods of the namespace).

Endpoints are pods (labels, namespace, named container ports) or addresses outside the cluster;
ipBlock peers match addresses only (how pod IPs meet ipBlocks is the network plugin's choice, and
these manifests use ipBlocks for outside addresses only)."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    name: str
    namespace: str | None = None  # None: an address outside the cluster
    labels: tuple[tuple[str, str], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()  # named container ports (name, number)
    address: str | None = None

    @property
    def label_map(self) -> dict[str, str]:
        return dict(self.labels)


def pod(name: str, namespace: str, labels: dict[str, str], ports: dict[str, int] | None = None) -> Endpoint:
    return Endpoint(name, namespace, tuple(sorted(labels.items())), tuple(sorted((ports or {}).items())))


def outside(name: str, address: str) -> Endpoint:
    return Endpoint(name, address=address)


@dataclass
class Cluster:
    namespaces: dict[str, dict[str, str]]  # namespace -> its labels
    policies: list[dict] = field(default_factory=list)  # NetworkPolicy objects (with metadata.namespace)

    def namespace_labels(self, name: str) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": name, **self.namespaces.get(name, {})}


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    """A label selector against labels ({} selects everything)."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        value, op = labels.get(expr["key"]), expr["operator"]
        if op == "In" and value not in expr["values"]:
            return False
        if op == "NotIn" and value in expr["values"]:
            return False
        if op == "Exists" and expr["key"] not in labels:
            return False
        if op == "DoesNotExist" and expr["key"] in labels:
            return False
    return True


def _peer_matches(cluster: Cluster, policy: dict, peer: dict, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.address is None:
            return False
        block = peer["ipBlock"]
        address = ipaddress.ip_address(other.address)
        network = ipaddress.ip_network(block["cidr"])
        if address.version != network.version or address not in network:
            return False
        return not any(address in ipaddress.ip_network(e) for e in block.get("except") or []
                       if ipaddress.ip_network(e).version == address.version)
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], cluster.namespace_labels(other.namespace)):
            return False
    elif other.namespace != policy["metadata"]["namespace"]:
        return False  # a podSelector alone: the policy's own namespace
    return selects(peer.get("podSelector"), other.label_map) if "podSelector" in peer else True


def _port_matches(rule_ports: list[dict] | None, target: Endpoint, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for item in rule_ports:
        if item.get("protocol", "TCP") != protocol:
            continue
        want = item.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            if dict(target.ports).get(want) == port:
                return True
        elif want <= port <= item.get("endPort", want):
            return True
    return False


def _direction(cluster: Cluster, subject: Endpoint, other: Endpoint, port: int, protocol: str, port_owner: Endpoint,
               kind: str) -> bool:
    """Whether `subject`'s policies of `kind` (Ingress or Egress) let it talk with `other`."""
    if subject.namespace is None or subject.namespace not in cluster.namespaces:
        return True  # outside the namespaces whose policies we hold: not restricted here
    chosen = [p for p in cluster.policies if p["metadata"]["namespace"] == subject.namespace
              and kind in (p["spec"].get("policyTypes") or ["Ingress"])
              and selects(p["spec"]["podSelector"], subject.label_map)]
    if not chosen:
        return True
    field_name, peers_name = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    for policy in chosen:
        for rule in policy["spec"].get(field_name) or []:
            peers = rule.get(peers_name)
            if peers and not any(_peer_matches(cluster, policy, peer, other) for peer in peers):
                continue
            if _port_matches(rule.get("ports"), port_owner, port, protocol):
                return True
    return False


def allowed(cluster: Cluster, source: Endpoint, target: Endpoint, port: int | str, protocol: str = "TCP") -> bool:
    """Whether `source` may open a connection to `target` on `port` (a number, or one of target's port names)."""
    if isinstance(port, str):
        number = dict(target.ports).get(port)
        if number is None:
            raise ValueError(f"{target.name} has no port {port}")
        port = number
    return (_direction(cluster, source, target, port, protocol, target, "Egress")
            and _direction(cluster, target, source, port, protocol, target, "Ingress"))
