"""vLLM v1's scheduling, without a model: which tokens each step computes.

Each step has a token budget (`max_num_batched_tokens`) shared by decodes and prefill chunks.
Running requests go first, in order: a decode takes 1 token, an unfinished prefill the rest of
its prompt up to the budget (chunked prefill). A running request that needs a block when none is
free preempts the last running request (its blocks freed, its progress dropped, back to the head
of the waiting queue), itself last. Then, if nothing was preempted, waiting requests are admitted
in FIFO order while the budget, `max_num_seqs` and free blocks allow (the first that does not
fit stops admission): each first looks up its prefix-cache hit (whole blocks, at most n - 1
tokens), then asks the connector for more; a request whose KV the connector loads
asynchronously holds its blocks and waits (skipped by later steps) until the load is done.

As in vLLM 0.32, waiting requests that hold blocks (loading, or loaded and not yet running) are
kept in their own queue, drained before the other: a preempted request (no blocks) at the head of
the waiting queue would otherwise stop admission while the blocks it waits for are held by the
requests behind it, forever. And an async load is started only if its blocks fit in the free
blocks less what the other in-flight prefills still need to finish their prompts, so that the
block holders can always finish once the running requests are gone.

A request's blocks become full as tokens are computed; full blocks get vLLM's hashes and enter
the prefix cache (KV events), and full prompt blocks are handed to the connector to save."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from .hashing import event_extra_keys, external, vllm_block_hashes
from .prefix_cache import BlockPool
from .profile import Chunk, Profile

WAITING, LOADING, RUNNING, FINISHED = "waiting", "loading", "running", "finished"


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    max_tokens: int
    arrival: float  # seconds, the engine clock
    cache_salt: str | None = None
    kv_params: dict | None = None  # kv_transfer_params the request came with
    status: str = WAITING
    num_computed: int = 0
    num_output: int = 0
    block_ids: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # vLLM hashes of the full blocks so far
    num_cached_blocks: int = 0  # blocks whose hashes are in the prefix cache
    local_hit_tokens: int = 0
    arrival_local_tokens: int = 0  # leading prompt tokens in the engine's own prefix cache on arrival
    external_hit_tokens: int = 0
    load_tokens: int = 0  # tokens the connector is loading (async)
    saved_blocks: int = 0  # prompt blocks handed to the connector to save
    tail_saved: bool = False  # the trailing partial prompt block too
    preemptions: int = 0
    first_scheduled: float | None = None  # engine clock
    first_token: float | None = None
    finished_reason: str | None = None
    on_tokens: Callable[["Request", int], None] | None = None  # new output tokens (count) to deliver
    first_admission: bool = True

    @property
    def num_prompt(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.num_output

    def token(self, i: int) -> int:
        """Token i of prompt + output (output ids are made up: a fixed walk from the request id)."""
        if i < len(self.prompt):
            return self.prompt[i]
        return (hash(self.rid) + 7919 * (i - len(self.prompt))) % 32000

    def tokens(self, start: int, end: int) -> list[int]:
        if end <= len(self.prompt):
            return self.prompt[start:end]
        return [self.token(i) for i in range(start, end)]


class Connector(Protocol):
    """What the scheduler asks the KV connector (the store link), as vLLM's scheduler does."""

    def matched_tokens(self, request: Request, local_tokens: int) -> int:
        """Tokens beyond `local_tokens` the connector can provide (loaded asynchronously)."""

    def start_load(self, request: Request, local_tokens: int, tokens: int) -> None: ...

    def save(self, request: Request, start_block: int, end_block: int, tail: bool) -> None: ...


@dataclass
class Step:
    """One step's work: (request, new tokens) in schedule order, and what it cost."""

    scheduled: list[tuple[Request, int]]
    preempted: list[Request]
    admitted: list[Request]
    prefill: list[Chunk]
    decodes: int
    decode_context: int

    @property
    def pure_decode(self) -> bool:
        return not self.prefill and self.decodes > 0


class Scheduler:
    def __init__(self, profile: Profile, pool: BlockPool, root_hash: bytes,
                 connector: Connector | None = None, events: bool = True) -> None:
        self.profile, self.pool, self.root_hash, self.connector = profile, pool, root_hash, connector
        self.events = events  # KV events wanted: stored blocks carry their token ids
        self.block_size = profile.block_size
        self.waiting: deque[Request] = deque()
        self.holding: deque[Request] = deque()  # waiting requests that hold blocks (vLLM's kv_holding_waiting)
        self.running: list[Request] = []
        # external_hits: every token the connector provided (vLLM's counter); handoff_hits: of those, a
        # P/D decode's hand-off from its prefill (not a cache hit)
        self.stats = {"queries": 0, "hits": 0, "external_queries": 0, "external_hits": 0, "handoff_hits": 0,
                      "preemptions": 0, "prompt_tokens": 0, "generation_tokens": 0}

    # ------------------------------------------------------------------ requests
    def add(self, request: Request) -> None:
        request.hashes = vllm_block_hashes(request.prompt, self.block_size, None, 0, self.root_hash,
                                           request.cache_salt)
        # What the prefix cache holds of it on arrival: what a router could rightly have credited.
        request.arrival_local_tokens = len(self.pool.longest_hit(request.hashes, (request.num_tokens - 1)
                                                                 // self.block_size)) * self.block_size
        self.waiting.append(request)

    def abort(self, request: Request) -> None:
        if request.status == FINISHED:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        elif request in self.holding:
            self.holding.remove(request)
        self._release(request, "abort")

    def _release(self, request: Request, reason: str) -> None:
        self.pool.free_blocks(request.block_ids)
        request.block_ids = []
        request.status, request.finished_reason = FINISHED, reason

    @property
    def has_work(self) -> bool:
        return bool(self.running) or any(r.status == WAITING for r in (*self.holding, *self.waiting))

    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.holding)

    # ------------------------------------------------------------------ blocks
    def _blocks_needed(self, request: Request, tokens: int) -> int:
        return max(0, -(-tokens // self.block_size) - len(request.block_ids))

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.pool.free_blocks(victim.block_ids)
        victim.block_ids, victim.num_computed, victim.num_cached_blocks = [], 0, 0
        victim.status = WAITING
        victim.preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(victim)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> Step:
        budget = self.profile.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            new = min(request.num_tokens - request.num_computed, budget)
            need = self._blocks_needed(request, request.num_computed + new)
            while not self.pool.can_allocate(need):
                victim = self.running[-1]  # never one scheduled already: those are before `index`
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if request.status != RUNNING:
                break  # it was the last running request and preempted itself
            request.block_ids += self.pool.allocate(need)
            scheduled.append((request, new))
            budget -= new
            index += 1
        admitted: list[Request] = []
        if not preempted:
            admitted = self._admit(scheduled, budget)
        return self._step(scheduled, preempted, admitted)

    def _admit(self, scheduled: list[tuple[Request, int]], budget: int) -> list[Request]:
        skipped: list[Request] = []  # block holders still loading, back at the head of `holding` after
        admitted: list[Request] = []
        while budget > 0 and len(self.running) < self.profile.max_num_seqs:
            queue = self.holding or self.waiting  # block holders first, as vLLM
            if not queue:
                break
            request = queue[0]
            if request.status == LOADING:  # the connector is still loading its KV: later
                skipped.append(queue.popleft())
                continue
            looked_up = request.num_computed == 0 and not request.block_ids
            if looked_up:
                if not self._lookup(request, skipped):
                    break  # its load does not fit yet: it stays at the head
                if request.status == LOADING:
                    skipped.append(queue.popleft())
                    continue
            new = min(request.num_tokens - request.num_computed, budget)
            need = self._blocks_needed(request, request.num_computed + new)
            if not self.pool.can_allocate(need):
                if looked_up and request.block_ids:  # give the hit back: looked up again next time
                    self._give_back(request)
                break  # FIFO: nothing behind it is admitted either
            queue.popleft()
            request.block_ids += self.pool.allocate(need)
            request.status = RUNNING
            self.running.append(request)
            scheduled.append((request, new))
            admitted.append(request)
            budget -= new
        self.holding.extendleft(reversed(skipped))
        return admitted

    def _give_back(self, request: Request) -> None:
        self.pool.free_blocks(request.block_ids)
        request.block_ids, request.num_computed, request.num_cached_blocks = [], 0, 0

    def _reserved_blocks(self, skipped: Sequence[Request] = ()) -> int:
        """Blocks the in-flight prefills (block holders, this step's new loads among `skipped`, running
        prompts) still need for their prompts."""
        prefilling = [r for r in self.running if r.num_computed < max(r.num_prompt, r.num_tokens - 1)]
        return sum(self._blocks_needed(r, r.num_tokens) for r in (*self.holding, *skipped, *prefilling))

    def _lookup(self, request: Request, skipped: Sequence[Request] = ()) -> bool:
        """Take the prefix-cache hit; then ask the connector, which may start an async load. False:
        the load's blocks do not fit beside the in-flight prefills' (the hit is given back)."""
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit = self.pool.longest_hit(request.hashes, max_blocks)
        self.pool.touch(hit)
        request.block_ids = list(hit)
        request.num_computed = len(hit) * self.block_size
        request.num_cached_blocks = len(hit)
        first = request.first_admission
        request.first_admission = False
        if first:  # vLLM counts a preempted request's repeat lookups apart
            request.local_hit_tokens = request.num_computed
            self.stats["queries"] += request.num_tokens
            self.stats["hits"] += request.num_computed
            if self.connector is not None:
                self.stats["external_queries"] += request.num_tokens
        if self.connector is None:
            return True
        extra = self.connector.matched_tokens(request, request.num_computed)
        if extra <= 0:
            return True
        need = self._blocks_needed(request, request.num_computed + extra)
        if not self.pool.can_allocate(need + self._reserved_blocks(skipped)):
            self._give_back(request)
            return False
        request.block_ids += self.pool.allocate(need)  # held while the tokens load
        request.load_tokens = extra
        request.status = LOADING
        self.connector.start_load(request, request.num_computed, extra)
        return True

    def loaded(self, request: Request, tokens: int) -> None:
        """The connector finished loading: `tokens` of the `load_tokens` arrived (the rest is recomputed)."""
        if request.status != LOADING:
            return
        request.num_computed += tokens
        request.external_hit_tokens = tokens
        self.stats["external_hits"] += tokens
        if "kvstore" in (request.kv_params or {}):
            self.stats["handoff_hits"] += tokens
        request.status = WAITING
        full = request.num_computed // self.block_size
        # Blocks that arrived whole are cached like computed ones (vLLM caches loaded blocks too).
        self._cache_full_blocks(request, min(full, len(request.hashes)))

    def _step(self, scheduled: list[tuple[Request, int]], preempted: list[Request],
              admitted: list[Request]) -> Step:
        prefill, decodes, decode_ctx = [], 0, 0
        for request, new in scheduled:
            if new == 1 and request.num_computed >= request.num_prompt:
                decodes += 1
                decode_ctx += request.num_computed
            else:
                prefill.append(Chunk(new, request.num_computed))
        return Step(scheduled, preempted, admitted, prefill, decodes, decode_ctx)

    # ------------------------------------------------------------------ after a step
    def complete(self, step: Step, repeat: int = 1) -> list[Request]:
        """Apply `step` (run `repeat` times: pure decodes only); returns the requests that finished."""
        finished = []
        for request, new in step.scheduled:
            if request.status != RUNNING:
                continue
            if repeat > 1:
                request.num_computed += repeat
                produced = repeat
            else:
                request.num_computed += new
                produced = 1 if request.num_computed >= request.num_tokens else 0
            if produced:
                if request.num_output == 0:
                    self.stats["prompt_tokens"] += request.num_prompt
                request.num_output += produced
                self.stats["generation_tokens"] += produced
            self._after_compute(request)
            if produced and request.on_tokens is not None:
                request.on_tokens(request, produced)
            if request.num_output >= request.max_tokens:
                self.running.remove(request)
                self._release(request, "length")
                finished.append(request)
        return finished

    def _after_compute(self, request: Request) -> None:
        """Blocks that became full: hash them (prompt and output), cache them, save prompt ones."""
        full = request.num_computed // self.block_size
        if full > len(request.hashes):
            start = len(request.hashes)
            parent = request.hashes[-1] if request.hashes else None
            request.hashes += vllm_block_hashes(request.tokens(start * self.block_size, full * self.block_size),
                                                self.block_size, parent, start, self.root_hash, request.cache_salt)
        self._cache_full_blocks(request, min(full, len(request.hashes), len(request.block_ids)))
        if self.connector is not None:
            prompt_full = min(request.num_computed, request.num_prompt) // self.block_size
            tail = request.num_computed >= request.num_prompt and not request.tail_saved
            if prompt_full > request.saved_blocks or tail:
                self.connector.save(request, request.saved_blocks, prompt_full, tail)
                request.saved_blocks = max(request.saved_blocks, prompt_full)
                request.tail_saved = request.tail_saved or tail

    def _cache_full_blocks(self, request: Request, full: int) -> None:
        if full > request.num_cached_blocks:
            start = request.num_cached_blocks
            parent = request.hashes[start - 1] if start else None
            tokens = request.tokens(start * self.block_size, full * self.block_size) if self.events else ()
            self.pool.cache_full(request.block_ids, request.hashes, start, full, parent, tokens,
                                 event_extra_keys(request.cache_salt))
            request.num_cached_blocks = full

    def decode_steps_ahead(self, step: Step) -> int:
        """How many times a pure-decode `step` can repeat unchanged: until a request finishes, with
        the blocks those tokens need taken now (or, when too few are free, until a request needs
        one: its allocation, maybe a preemption, happens at the right step)."""
        k = min(r.max_tokens - r.num_output for r, _ in step.scheduled)
        need = sum(self._blocks_needed(r, r.num_computed + k) for r, _ in step.scheduled)
        if self.pool.can_allocate(need):
            for request, _ in step.scheduled:
                request.block_ids += self.pool.allocate(self._blocks_needed(request, request.num_computed + k))
            return max(1, k)
        for request, _ in step.scheduled:
            k = min(k, self.block_size - request.num_computed % self.block_size)
        return max(1, k)

    def event_hashes(self, hashes: Sequence[bytes]) -> list[int]:
        return [external(h) for h in hashes]
