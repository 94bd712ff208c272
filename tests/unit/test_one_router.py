"""Routing is defined once (conductor/routing.py): the /route service and the gateway make the same
choice for the same view of their engines and the same request, and neither front applies a
policy or the SLO admission itself."""
from __future__ import annotations

import ast
import random
from pathlib import Path

from conductor.cost import CostModel
from conductor.gateway.errors import ApiError
from conductor.gateway.pool import Pool
from conductor.gateway.prefix import PrefixTracker
from conductor.gateway.route import Router
from conductor.router import Conductor, InstanceLoad
from kvstore.keys import ModelFingerprint, chain_hashes

FP = ModelFingerprint("m", "bfloat16", 16, 2, 2, 8)
BLOCK = 16
CONDUCTOR = Path(__file__).resolve().parents[2] / "conductor"
POLICIES = ["round_robin", "least_loaded", "cache_local", "cache_global", "affinity", "cache_global+sticky"]


class Mirror:
    """The store pool as both fronts read it: per store node, the leading blocks it holds."""

    stale = False

    def __init__(self) -> None:
        self.held: dict[str, list[bytes]] = {}

    def node_prefix_lengths(self, fingerprint, hashes) -> dict[str, int]:
        out = {}
        for node, held in self.held.items():
            n = next((i for i, (a, b) in enumerate(zip(hashes, held)) if a != b), min(len(hashes), len(held)))
            if n:
                out[node] = n
        return out

    def match(self, fingerprint, hashes):
        return type("Match", (), {"length": max(self.node_prefix_lengths(fingerprint, hashes).values(), default=0),
                                  "stale": self.stale})()


def fronts(policy: str, prefills: int, decodes: int, local_prefill: int, overflow: float = 0.0):
    """The gateway's router and the /route service over the same engines: each engine holds, in its
    own cache, what its store node holds (the service credits an instance with its node's blocks)."""
    pool = Pool([f"http://p{i}" for i in range(prefills)], [f"http://d{i}" for i in range(decodes)])
    mirror, tracker = Mirror(), PrefixTracker()
    gateway = Router(pool, tracker, FP, mirror=mirror, policy=policy, cost=CostModel(), block_tokens=BLOCK,
                     local_prefill_tokens=local_prefill, overflow_kv_share=overflow)
    service = Conductor(mirror, FP, policy=policy, cost=CostModel(), block_tokens=BLOCK,
                        local_prefill_tokens=local_prefill, overflow_kv_share=overflow)
    return pool, mirror, tracker, gateway, service


def test_the_route_service_and_the_gateway_choose_alike():
    """Kills: routing defined twice (the /route service choosing its decode engine by running tokens,
    prefilling colocated requests on that engine whatever the policy says, ignoring conditional
    disaggregation's queue check, the KV room check or the decode overflow, or forgetting exclusions),
    or either front diverging from the core."""
    rng = random.Random(7)
    compared = overflowed = 0
    for trial in range(60):
        policy = rng.choice(POLICIES)
        pool, mirror, tracker, gateway, service = fronts(policy, rng.choice([0, 0, 2, 3]), rng.randint(1, 4),
                                                         rng.choice([0, 256]), rng.choice([0.0, 0.5]))
        prompts = [list(range(k * 1000, k * 1000 + BLOCK * rng.randint(2, 30))) for k in range(3)]
        for step in range(20):
            prompt = rng.choice(prompts)[:BLOCK * rng.randint(1, 30)]
            hashes = chain_hashes(FP, prompt)
            for e in pool.engines:
                e.healthy = True
                e.running, e.waiting = rng.randint(0, 12), rng.randint(0, 3)
                e.kv_capacity = rng.choice([None, 20_000, 100_000])
                # (full half the time: decode pools that overflow onto their prefill engines)
                e.inflight_kv = rng.choice([rng.randint(0, e.kv_capacity), e.kv_capacity]) if e.kv_capacity else 0
                e.kv_usage = 0.0  # (the KV load is what the gateway sent there: the service is told it)
                held = hashes[:rng.randint(0, len(hashes))] if rng.random() < 0.5 else []
                mirror.held[e.url] = held
                tracker.clear(e.url)
                tracker.add(e.url, held)
                service.report(InstanceLoad(e.url, e.role, queue_ms=gateway.queue_ms(e), running_requests=e.running,
                                            running_tokens=e.inflight_kv,
                                            free_kv_tokens=e.kv_capacity - e.inflight_kv if e.kv_capacity else None))
            session = rng.choice([None, None, "s"])
            exclude = frozenset(e.url for e in pool.engines if rng.random() < 0.15)
            output = rng.choice([16, 256, 4000])
            try:
                route = gateway.route(hashes, len(prompt), output, session, exclude)
                ours = (route.prefill.url if route.prefill else None, route.decode.url, route.cached_tokens,
                        route.reason, round(route.predicted_ttft_ms, 6))
            except ApiError as exc:
                ours = ("refused", exc.status)
            decision = service.route(hashes, len(prompt), output, session, exclude)
            theirs = (decision.prefill, decision.decode, decision.cached_tokens, decision.route_reason,
                      round(decision.predicted_ttft_ms, 6)) if decision.accepted else \
                ("refused", 503 if "no healthy" in decision.reason else 429)
            assert ours == theirs, (trial, step, policy)
            compared += ours[0] != "refused"
            overflowed += ours[0] != "refused" and ours[3] == "overflow"
    assert compared > 800  # most requests were placed, not refused
    assert overflowed > 10  # and some P/D ones decoded on their prefill engine


def test_no_front_applies_a_policy_itself():
    """Kills: a front (the gateway, the /route service, the CLI) that calls a policy's choose or
    estimate, or the SLO admission, outside the router core: a second definition of routing. The
    simulator (conductor/sim) models a fleet and keeps its own loop."""
    calls = []
    for path in CONDUCTOR.rglob("*.py"):
        relative = path.relative_to(CONDUCTOR)
        if relative.parts[0] == "sim" or relative.name in ("routing.py", "policies.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                owner = node.func.value if isinstance(node.func, ast.Attribute) else None
                if name in ("choose", "estimate") or (name == "admit" and not _is_self_guard(owner)):
                    calls.append(f"{relative}:{node.lineno} {name}")
            if isinstance(node, ast.ImportFrom) and node.module and node.module.endswith("policies"):
                imported = {a.name for a in node.names} & {"admit", "InstanceView", "Choice"}
                calls += [f"{relative}:{node.lineno} imports {n}" for n in sorted(imported)]
    assert calls == [], calls


def _is_self_guard(owner) -> bool:
    """The gateway's connection guard has an `admit` of its own (connections, not routes)."""
    return isinstance(owner, ast.Attribute) and owner.attr == "guard"


def test_exclusions_and_no_engine_read_alike():
    """Kills: a front that retries on the engine a request just failed on, or answers a request
    with no decode engine left by anything but a refusal."""
    pool, mirror, tracker, gateway, service = fronts("round_robin", 0, 2, 0)
    for e in pool.engines:
        e.healthy = True
        service.report(InstanceLoad(e.url, "decode"))
    hashes = chain_hashes(FP, list(range(64)))
    for _ in range(3):
        assert gateway.route(hashes, 64, 16, exclude=frozenset({"http://d0"})).decode.url == "http://d1"
        assert service.route(hashes, 64, 16, exclude=frozenset({"http://d0"})).decode == "http://d1"
    everything = frozenset({"http://d0", "http://d1"})
    try:
        gateway.route(hashes, 64, 16, exclude=everything)
        raise AssertionError("routed with every engine excluded")
    except ApiError as exc:
        assert exc.status == 503
    assert not service.route(hashes, 64, 16, exclude=everything).accepted
    assert gateway.retry_decode(frozenset({"http://d1"})).url == "http://d0"
    assert gateway.retry_decode(everything) is None
