"""One model's run: an engine, its store (two daemons on this host with DRAM and NVMe tiers, then
one daemon on "another host" behind a relay), a pool of prompts whose recomputed outputs are known,
and the faults, one request after another."""
from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import dataclass

from kvstore.index.records import BlockRecord

from .cluster import Cluster, Held
from .engine import Engine, EngineDied, Hung
from .inject import Injection, corrupt_bytes, rewrite_holder, undo_bytes, undo_holder
from .models import ModelSpec, build, engine_args, prompts, swap_weights, write_adapter
from .relay import Relay
from .tally import CONTROL, KindResult, wrong_tokens

REQUEST_BOUND_S = 30.0  # a request not finished by then is a hung request
SETTLE_S = 5.0  # how long a daemon may take to publish what it stored, or to drop a block reported corrupt
LOCAL, REMOTE = ("local-a", "local-b"), "remote-a"
BLOCK_KINDS = ("dram_bitflip", "nvme_bitflip", "torn_nvme_write", "store_failed_record_visible", "wrong_holder")
REMOTE_KINDS = ("wire_bitflip", "daemon_killed_mid_load")  # injected on the node behind the relay
TIER = {"dram_bitflip": "dram", "nvme_bitflip": "nvme", "torn_nvme_write": "nvme"}
MIB = 1 << 20


@dataclass
class Plan:
    """Faults of each kind per model, and the sizes of the run."""

    targets: dict[str, int]  # kind -> faults to inject (per model; adapters only on models that serve them)
    pool: int  # prompts the local phase injects into
    remote_pool: int  # prompts the remote phase injects into
    max_blocks: int  # corrupted blocks in one request (each detected on its own, each one fault)
    check_baseline: bool = False  # compare the bypassed baselines with an engine that has no connector


class ModelRun:
    def __init__(self, spec: ModelSpec, plan: Plan, cluster: Cluster, results: dict[str, KindResult],
                 workdir: str, rng: random.Random, say) -> None:
        self.spec, self.plan, self.cluster, self.results = spec, plan, cluster, results
        self.workdir, self.rng, self.say = workdir, rng, say
        self.path = build(spec, os.path.join(workdir, f"model-{spec.name}"), seed=0)
        self.weights = 0  # the seed of the weights at self.path
        self.engine: Engine | None = None
        self.next_engine: Engine | None = None  # started on the next weights, waiting for the swap
        self.pool = prompts(spec, plan.pool, seed=1000)
        self.baselines: dict[tuple[int, int], dict] = {}
        self.keys_cache: dict[tuple[int, str], dict] = {}
        self.turn = 0
        self.relay: Relay | None = None
        self.remote_lease = 0
        self.adapter_dir = os.path.join(workdir, f"adapter-{spec.name}")
        self.adapter_seed = 0
        self.adapter_prompts = 0
        self.starts = 0
        self.baseline_check: dict | None = None
        self.spent: dict[str, float] = {}  # seconds by what they went to (requests by kind, etcd reads, waits)

    # --- the engine ---------------------------------------------------------------------------------
    def spawn_engine(self) -> Engine:
        """An engine process at the model's path (it reads the weights there as it starts)."""
        extra = {"metadata": self.cluster.url, "cluster": self.cluster.name}
        self.starts += 1
        return Engine(self.path, extra, engine_args(self.spec),
                      os.path.join(self.workdir, f"engine-{self.spec.name}-{self.starts}.log"), self.cluster.secret)

    def use_engine(self, engine: Engine) -> None:
        """Make `engine` the one requests go to, once it is up and warm: a fresh engine's first
        requests pay vLLM's own warm-up (seconds on CPU), taken here on a prompt of its own, so that
        recovery times measure the faults, not the engine start."""
        self.engine = engine.wait_ready()
        warm = prompts(self.spec, 1, seed=90_000 + self.starts)[0]
        for bypass in (True, False):
            engine.call("run", timeout=REQUEST_BOUND_S * 4, tokens=warm, max_tokens=8, bypass=bypass)

    def start_engine(self) -> None:
        self.use_engine(self.spawn_engine())

    def restart_engine(self) -> None:
        """After a hung request: the engine killed and started again. One already started on the
        next weights (a weights swap under way) takes over: the path holds those weights now."""
        if self.engine is not None:
            self.engine.close()
        if self.next_engine is not None:
            engine, self.next_engine = self.next_engine, None
            self.weights += 1
            self.use_engine(engine)
            return
        self.start_engine()

    def prepare_swap(self) -> None:
        """The next weights written at the model's path while this engine keeps serving from the
        weights it loaded (a checkpoint redeployed in place), and an engine started there: it takes
        over at the swap."""
        swap_weights(self.spec, self.path, seed=self.weights + 1)
        self.next_engine = self.spawn_engine()

    @property
    def groups(self) -> list[dict]:
        return self.engine.info["groups"]

    def spend(self, what: str, since: float) -> None:
        self.spent[what] = self.spent.get(what, 0.0) + time.monotonic() - since

    def request(self, tokens: list[int], kind: str, lora: dict | None = None, bypass: bool = False) -> dict | None:
        """One request; None when it did not finish within the bound (counted as hung for `kind`,
        and the engine is started again)."""
        started = time.monotonic()
        try:
            return self.engine.call("run", timeout=REQUEST_BOUND_S, tokens=tokens, max_tokens=8, lora=lora,
                                    bypass=bypass)
        except (Hung, EngineDied) as exc:
            self.results[kind].hung += 1
            self.results[kind].note = (self.results[kind].note + f" {type(exc).__name__}: {exc};")[-500:]
            self.say(f"  {kind}: a request did not finish ({exc}); the engine starts again")
            self.restart_engine()
            return None
        finally:
            self.spend(f"requests {'baseline' if bypass else kind}", started)

    def baseline(self, i: int) -> dict:
        """The recomputed output of pool prompt `i` on the weights loaded now (the same engine with
        the connector bypassed: nothing loaded, nothing saved)."""
        key = (i, self.weights)
        if key not in self.baselines:
            out = None
            while out is None:
                out = self.request(self.pool[i], CONTROL, bypass=True)
            self.baselines[key] = out
        return self.baselines[key]

    def check(self, kind: str, out: dict, baseline: dict) -> int:
        wrong, diff, tie = wrong_tokens(out, baseline, self.spec.tolerance)
        self.results[kind].request(self.spec.name, wrong, diff, out["seconds"], tie)
        if wrong:
            self.say(f"  {kind}: {wrong} wrong tokens ({self.spec.name}): {out['tokens']} vs {baseline['tokens']}")
        return wrong

    def keys(self, i: int) -> dict:
        key = (i, self.engine.info["chain"])
        if key not in self.keys_cache:
            self.keys_cache[key] = self.engine.call("keys", tokens=self.pool[i])
        return self.keys_cache[key]

    def full_hit(self, i: int) -> int:
        return len(self.pool[i]) - 1  # every prompt token but the last, which vLLM computes

    # --- the store ----------------------------------------------------------------------------------
    def prompt_bytes(self) -> int:
        keys = -(-(self.spec.prompt_tokens - 1) // self.engine.info["block_size"])
        return sum(keys * g["block_bytes"] for g in self.groups)

    def snapshot(self) -> tuple[dict[tuple[str, bytes], dict[str, Held]], int]:
        started = time.monotonic()
        try:
            return self.cluster.etcd.blocks(self.cluster.layout, [g["fingerprint"] for g in self.groups])
        finally:
            self.spend("etcd reads", started)

    def loaded_keys(self, i: int) -> list[tuple[str, bytes]]:
        """(fingerprint, hash) of every block a whole-prompt hit of prompt `i` loads."""
        return [(g["fingerprint"], bytes.fromhex(g["keys"][j])) for g in self.keys(i)["groups"] for j in g["loaded"]]

    def healthy(self, i: int, blocks: dict) -> bool:
        return all(blocks.get(k) for k in self.loaded_keys(i))

    def heal(self, i: int) -> bool:
        """Store prompt `i` whole again (a request that loads what is stored and saves the rest);
        True once every block a whole hit loads is published."""
        out = self.request(self.pool[i], CONTROL)
        if out is not None:
            self.check(CONTROL, out, self.baseline(i))
        deadline = time.monotonic() + SETTLE_S
        while time.monotonic() < deadline:
            blocks, _ = self.snapshot()
            if self.healthy(i, blocks):
                return True
            time.sleep(0.02)
        return False

    def pick(self, tier: str | None, count: int) -> tuple[int, list[tuple[str, bytes, Held]], dict, int] | None:
        """A pool prompt stored whole, and up to `count` of the blocks a hit loads whose copy is on
        `tier` (any: None): (prompt, [(fingerprint, hash, copy)], every block record, revision)."""
        order = list(range(len(self.pool)))
        start = self.turn % len(order)
        self.turn += 1
        for i in order[start:] + order[:start]:
            blocks, revision = self.snapshot()
            if not self.healthy(i, blocks):
                if not self.heal(i):
                    continue
                blocks, revision = self.snapshot()
            found = []
            for fp, h in self.loaded_keys(i):
                copies = blocks.get((fp, h), {})
                if len(copies) != 1:
                    continue  # one copy: the reader has nowhere else to go, so a fault must be caught
                (held,) = copies.values()
                if (tier is None or held.record.tier == tier) and held.node in self.cluster.daemons:
                    found.append((fp, h, held))
            if found:
                return i, self.rng.sample(found, min(count, len(found))), blocks, revision
        return None

    # --- faults in stored blocks --------------------------------------------------------------------
    def block_fault(self, kind: str, count: int) -> int:
        """`count` blocks of one prompt corrupted the `kind` way, then the prompt requested: each block
        is checked on its own by the reader, so each is one fault when the connector reports it failed."""
        picked = self.pick(TIER.get(kind), count)
        if picked is None:
            return 0
        i, targets, blocks, revision = picked
        others = [held for copies in blocks.values() for held in copies.values()]
        injections: list[Injection] = []
        for fp, h, held in targets:
            if kind == "wrong_holder":
                done = rewrite_holder(self.cluster, self.rng, fp, h, held, [o for o in others if o.key != held.key])
                if done is not None:
                    injections.append(done[0])
                    revision = max(revision, done[1])
            else:
                injection = corrupt_bytes(self.cluster, self.rng, kind, fp, h, held, others)
                if injection is not None:
                    injections.append(injection)
        if not injections:
            return 0
        self.engine.call("revision", revision=revision)  # the engine's index has seen every rewrite
        index = self.engine.call("lookup", blocks=[[x.fingerprint, x.block_hash.hex()] for x in injections])["records"]
        out = self.request(self.pool[i], kind)
        # The store put back as it was before the next fault: the rewritten records undone, the
        # corrupted bytes restored. No put can have reused a slot meanwhile (the request stored
        # nothing: its blocks were all listed), so a slot its node has dropped is free and the
        # restore lands nowhere; one not dropped yet is whole again when its node re-checks it.
        for injection in injections:
            (undo_holder if kind == "wrong_holder" else undo_bytes)(self.cluster, injection)
        result = self.results[kind]
        if out is None:
            return 0
        result.injected += len(injections)
        if self.check(kind, out, self.baseline(i)):
            self.say(f"  {kind}: the faults of that request: {'; '.join(x.detail for x in injections)}; "
                     f"stats {out['stats']}")
        failures = out["stats"]["load_failures"]
        if kind == "wrong_holder":
            # A rewritten record the engine's index refused (its node's seal does not match) is never
            # read: the block is recomputed, or read where its own record says when that one stayed.
            absent = 0
            for injection, listed in zip(injections, index):
                fake = injection.fake
                if not (fake.node in listed and BlockRecord.decode(bytes.fromhex(listed[fake.node])) == fake.record):
                    result.index_refused += 1
                absent += not listed
            caught = min(len(injections) - absent, failures)
            result.recomputed += absent + caught
            result.loaded += len(injections) - absent - caught  # read from where the block really is
            return len(injections)
        caught = min(len(injections), failures)
        result.recomputed += caught
        result.undetected += len(injections) - caught
        if caught < len(injections):
            self.say(f"  {kind}: {len(injections) - caught} corrupted blocks loaded: "
                     + "; ".join(x.detail for x in injections))
        return len(injections)

    # --- an adapter reloaded in place ---------------------------------------------------------------
    def adapter_fault(self) -> int:
        """A fresh prompt with the adapter (its KV stored, and loaded once to prove it can be), the
        adapter's weights rewritten at the same name and path, the prompt again with vLLM told to
        reload the adapter in place: compared with the same engine recomputing it with the new weights."""
        kind = "adapter_reloaded"
        self.adapter_prompts += 1
        tokens = prompts(self.spec, 1, seed=50_000 + self.adapter_prompts)[0]
        lora = {"name": f"wrong-kv-{self.spec.name}", "id": 1, "path": self.adapter_dir}
        if self.adapter_seed == 0:
            self.adapter_seed = 1
            write_adapter(self.spec, self.adapter_dir, self.path, self.adapter_seed)
        first = self.request(tokens, kind, lora=lora)
        again = self.request(tokens, kind, lora=lora) if first is not None else None
        if again is None:
            return 0
        self.check(CONTROL, again, first)
        if again["stats"]["hit_tokens"] == 0:
            self.say("  adapter_reloaded: the adapter's KV was not loaded before the reload; not counted")
            return 0
        self.adapter_seed += 1
        write_adapter(self.spec, self.adapter_dir, self.path, self.adapter_seed)
        out = self.request(tokens, kind, lora={**lora, "inplace": True})
        if out is None:
            return 0
        baseline = self.request(tokens, CONTROL, lora=lora, bypass=True)
        if baseline is None:
            return 0
        result = self.results[kind]
        result.injected += 1
        self.check(kind, out, baseline)
        if out["stats"]["hit_tokens"] == 0:
            result.recomputed += 1
        else:
            result.undetected += 1
        return 1

    # --- weights swapped at the model's path --------------------------------------------------------
    def weights_fault(self, prepare_next: bool = False) -> int:
        """Every pool prompt stored whole with the weights this engine loaded; the engine started on
        the new weights at the same path (prepare_swap) takes over; each prompt compared with the new
        engine recomputing it."""
        kind = "weights_swapped"
        if self.next_engine is None:
            self.prepare_swap()
        blocks, _ = self.snapshot()
        stored = [i for i in range(len(self.pool)) if self.healthy(i, blocks) or self.heal(i)]
        old, engine, self.next_engine = self.engine, self.next_engine, None
        old.close()
        self.weights += 1
        self.use_engine(engine)
        if prepare_next:  # the swap after this one: its engine starts while this one is checked
            self.prepare_swap()
        result = self.results[kind]
        loaded = 0
        for i in stored:
            out = self.request(self.pool[i], kind)
            if out is None:
                continue
            self.check(kind, out, self.baseline(i))
            loaded += out["stats"]["hit_tokens"] > 0
        result.injected += 1
        if loaded:
            result.undetected += 1
            self.say(f"  weights_swapped: {loaded} of {len(stored)} prompts loaded KV of the old weights")
        else:
            result.recomputed += 1
        return 1

    # --- the remote node: the wire and a kill mid-load ----------------------------------------------
    def start_remote(self) -> None:
        """A daemon on "another host" (clients reach it over TCP), its published engine address
        pointed at the relay, and the remote pool stored there."""
        size = max(8 * MIB, 3 * self.plan.remote_pool * self.prompt_bytes())
        self.cluster.spawn(REMOTE, size, remote=True)
        key = self.cluster.layout.segment_key(REMOTE)
        kv = self.cluster.etcd.get(key)
        import json

        segment = json.loads(kv.value)
        if self.relay is None:
            self.relay = Relay((segment["host"], segment["port"]))
        self.relay.upstream = (segment["host"], segment["port"])
        segment["host"], segment["port"] = self.relay.address
        revision = self.cluster.etcd.put(key, json.dumps(segment, separators=(",", ":")).encode(), kv.lease)
        self.remote_lease = kv.lease
        self.engine.call("revision", revision=revision)

    def remote_prompt(self) -> tuple[int, int] | None:
        """A remote-pool prompt stored whole on the remote node: (prompt, bytes a hit reads)."""
        for _ in range(self.plan.remote_pool):
            i = self.turn % self.plan.remote_pool
            self.turn += 1
            blocks, revision = self.snapshot()
            if not self.healthy(i, blocks) and not self.heal(i):
                continue
            blocks, revision = self.snapshot()
            self.engine.call("revision", revision=revision)
            size = sum(held.record.size for k in self.loaded_keys(i) for held in blocks[k].values())
            return i, size
        return None

    def wire_fault(self) -> int:
        kind = "wire_bitflip"
        picked = self.remote_prompt()
        if picked is None:
            return 0
        i, size = picked
        self.relay.arm_flip(self.rng.randrange(max(1, int(size * 0.95))), self.rng.randrange(8))
        out = self.request(self.pool[i], kind)
        fired = self.relay.disarm()  # (the connections stay up: the client reconnects on its own)
        if out is None or not fired:
            return 0
        return self.tally_one(kind, i, out)

    def tally_one(self, kind: str, i: int, out: dict) -> int:
        """A fault that fails a whole load (a stream broken, a node gone): caught when the connector
        reported a failed load or loaded less than the whole prompt."""
        result = self.results[kind]
        result.injected += 1
        self.check(kind, out, self.baseline(i))
        if out["stats"]["load_failures"] or out["stats"]["hit_tokens"] < self.full_hit(i):
            result.recomputed += 1
        else:
            result.undetected += 1
        return 1

    def kill_fault(self) -> int:
        kind = "daemon_killed_mid_load"
        picked = self.remote_prompt()
        if picked is None:
            return 0
        i, _ = picked
        pid = self.cluster.daemons[REMOTE].proc.pid
        # SIGKILL only: the relay cuts the connections as the kernel closes the dead daemon's sockets.
        self.relay.arm_kill(lambda: os.kill(pid, signal.SIGKILL))
        out = self.request(self.pool[i], kind)
        fired = self.relay.disarm()
        self.relay.cut()
        if fired:
            self.cluster.kill(REMOTE)  # reaped
            # Its records would go with its lease after --lease-ttl; gone now, so that the next fault
            # starts from a store that holds only what it says.
            self.cluster.etcd.revoke(self.remote_lease)
            self.start_remote()
        if out is None or not fired:
            return 0
        return self.tally_one(kind, i, out)

    # --- the whole run ------------------------------------------------------------------------------
    def run(self) -> None:
        spec, plan = self.spec, self.plan
        started = time.monotonic()
        self.start_engine()
        self.say(f"{spec.name}: engine up in {time.monotonic() - started:.0f} s; groups "
                 + ", ".join(f"{g['kind']} ({g['block_bytes'] >> 10} KiB blocks)" for g in self.groups))
        if plan.check_baseline:
            self.check_baselines()
        if plan.targets.get("weights_swapped"):
            self.prepare_swap()  # the next engine starts beside this one's faults, on the next weights
        if any(plan.targets.get(k) for k in REMOTE_KINDS):
            self.remote_phase()
            self.say(f"{spec.name}: remote faults done at {time.monotonic() - started:.0f} s")
        if any(n for k, n in plan.targets.items() if k not in REMOTE_KINDS):
            self.local_phase()
        self.say(f"{spec.name}: done in {time.monotonic() - started:.0f} s; "
                 + ", ".join(f"{k} {v:.0f} s" for k, v in sorted(self.spent.items(), key=lambda kv: -kv[1])))

    def loop(self, kinds: dict) -> None:
        """Faults of `kinds` (kind -> injector), in random order, until each has its target (or
        could not be injected 20 times in a row)."""
        plan = self.plan
        done = {k: 0 for k in kinds}
        misses = {k: 0 for k in kinds}
        while True:
            left = [k for k in kinds if done[k] < plan.targets.get(k, 0) and misses[k] < 20]
            if not left:
                break
            kind = self.rng.choices(left, weights=[plan.targets[k] - done[k] for k in left])[0]
            got = kinds[kind](kind, plan.targets[kind] - done[kind])
            done[kind] += got
            misses[kind] = 0 if got else misses[kind] + 1
            total = sum(done.values())
            if got and total // 250 != (total - got) // 250:
                self.say(f"  {self.spec.name}: {total} of {sum(plan.targets.get(k, 0) for k in kinds)} faults "
                         f"({', '.join(f'{k} {v}' for k, v in done.items())}); load average {os.getloadavg()[0]:.1f}")
        for kind in kinds:
            if done[kind] < plan.targets.get(kind, 0):
                self.results[kind].note += f" {self.spec.name}: {done[kind]} of {plan.targets[kind]} injected;"

    def remote_phase(self) -> None:
        """One daemon "on another host", behind the relay: wire flips and kills mid-load."""
        self.start_remote()
        self.loop({"wire_bitflip": lambda kind, left: self.wire_fault(),
                   "daemon_killed_mid_load": lambda kind, left: self.kill_fault()})
        self.cluster.stop(REMOTE)

    def local_phase(self) -> None:
        """Two daemons on this host (DRAM and NVMe): faults in stored blocks and their records,
        adapters reloaded; the weights swapped last (the next engine starts meanwhile)."""
        spec, plan = self.spec, self.plan
        pool_bytes = plan.pool * self.prompt_bytes()
        dram = max(2 * MIB, pool_bytes // 4 // MIB * MIB)
        disk = max(64 * MIB, (4 * pool_bytes + 2 * plan.targets.get("adapter_reloaded", 0) * self.prompt_bytes())
                   // MIB * MIB)
        for name in LOCAL:
            self.cluster.spawn(name, dram, disk)
        for i, tokens in enumerate(self.pool):  # first sight: computed and stored
            base = self.baseline(i)
            out = self.request(tokens, CONTROL)
            if out is not None:
                self.check(CONTROL, out, base)
        kinds = {k: (lambda kind, left: self.block_fault(kind, self.rng.randint(1, min(plan.max_blocks, left))))
                 for k in BLOCK_KINDS}
        if spec.lora:
            kinds["adapter_reloaded"] = lambda kind, left: self.adapter_fault()
        self.loop(kinds)
        swaps = plan.targets.get("weights_swapped", 0)
        for n in range(swaps):
            self.weights_fault(prepare_next=n + 1 < swaps)
        for name in LOCAL:
            self.cluster.stop(name)

    def check_baselines(self) -> None:
        """The baselines (this engine, the connector bypassed) against an engine without any
        connector, in a process of its own: the same tokens, cumulative logprobs within tolerance."""

        from kvstore_testing.engine_fork import engine_forks, result_of

        from .engine import ROOT

        spec = {"model": self.path, "connector": None, "prompts": self.pool, "max_tokens": 8,
                "engine": {k: v for k, v in engine_args(self.spec).items() if "lora" not in k}}
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1")
        done = engine_forks().run(spec, env=env, cwd=ROOT, timeout=900)  # a fork: vLLM's import paid once
        plain = result_of(done, "the engine without a connector")["results"]
        same, worst = 0, 0.0
        for i, other in enumerate(plain):
            mine = self.baseline(i)
            diff = abs(sum(mine["logprobs"]) - other["logprob"])
            worst = max(worst, diff)
            same += mine["tokens"] == other["tokens"] and diff <= self.spec.tolerance * len(mine["tokens"])
        self.baseline_check = {"prompts": len(plain), "same": same, "max_cumulative_logprob_diff": worst}
        self.say(f"{self.spec.name}: baselines vs an engine without a connector: {same} of {len(plain)} the same "
                 f"(cumulative logprobs within {worst:.2g})")

    def close(self) -> None:
        for engine in (self.engine, self.next_engine):
            if engine is not None:
                engine.close()
        if self.relay is not None:
            self.relay.close()
        for name in list(self.cluster.daemons):
            self.cluster.kill(name)
