"""What the benchmark records per fault kind, and how an output is compared with the recomputed one."""
from __future__ import annotations

from dataclasses import dataclass, field

KINDS = ("dram_bitflip", "nvme_bitflip", "wire_bitflip", "torn_nvme_write", "store_failed_record_visible",
         "daemon_killed_mid_load", "wrong_holder", "weights_swapped", "adapter_reloaded")
CONTROL = "none (control)"
WHAT = {
    "dram_bitflip": "one bit flipped in a stored block's bytes in a daemon's DRAM arena",
    "nvme_bitflip": "one bit flipped in a stored block's bytes in a daemon's NVMe tier file",
    "wire_bitflip": "one bit flipped in a daemon's reply stream by a relay on the TCP path",
    "torn_nvme_write": "an NVMe block torn at a 4 KiB boundary: the rest holds zeros or another block's bytes",
    "store_failed_record_visible": "a block's record published, its slot holding zeros or another block's bytes",
    "daemon_killed_mid_load": "SIGKILL of the daemon while its reply to the load is on the wire",
    "wrong_holder": "a block's etcd record moved to another node, to another block's slot, or replaced by "
                    "another block's record",
    "weights_swapped": "the model's safetensors rewritten with other weights, the engine restarted at the same path",
    "adapter_reloaded": "a LoRA adapter's weights rewritten at the same name and path, reloaded in place",
    CONTROL: "requests that carried no fault: first sight, storing a prompt again after a fault",
}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def wrong_tokens(out: dict, baseline: dict, tolerance: float) -> tuple[int, float, bool]:
    """(output tokens that differ from the recomputed output, the largest logprob difference where
    both runs chose the same token, whether they parted at a near-tie).

    A token agrees when it is the same token with a logprob within `tolerance` of the recomputed
    one. Where the two runs choose different tokens, it is a near-tie, not a wrong token, if each
    run ranks the other's token within `tolerance` of its own (two sums of the same numbers in
    another order can pick either); the comparison stops there, since the sequences then go
    separate ways. Otherwise that token and every one after it are wrong."""
    got, want = out["tokens"], baseline["tokens"]
    worst = 0.0
    wrong = 0
    for i, (a, b) in enumerate(zip(got, want)):
        if a == b:
            diff = abs(out["logprobs"][i] - baseline["logprobs"][i])
            worst = max(worst, diff)
            wrong += diff > tolerance
            continue
        theirs = baseline["top"][i].get(str(a))  # the recomputed run's logprob of the token this one chose
        ours = out["top"][i].get(str(b))
        if theirs is not None and ours is not None and baseline["logprobs"][i] - theirs <= tolerance \
                and out["logprobs"][i] - ours <= tolerance:
            return wrong, worst, True
        return wrong + len(want) - i, worst, False
    return wrong + abs(len(got) - len(want)), worst, False


@dataclass
class KindResult:
    """One fault kind over the run. `injected`: faults that happened (a flip the relay made, a
    block whose corruption was checked in place, ...); `recomputed`: those that ended in a
    recompute (the reader refused the block, or it was never offered); `loaded`: those that ended
    in a load from the right place (the client asked the node where the block really is);
    `undetected`: those whose faulty KV was loaded as if nothing happened; `hung`: requests not
    finished within the bound; `recover_p99_ms`: from a faulty request's start to its end."""

    fault: str
    injected: int = 0
    wrong_tokens: int = 0
    recomputed: int = 0
    hung: int = 0
    recover_p99_ms: float | None = None
    requests: int = 0
    loaded: int = 0
    undetected: int = 0
    recover_p50_ms: float | None = None
    recover_max_ms: float | None = None
    index_refused: int = 0  # rewritten records the engine's index refused (not sealed by their node)
    near_ties: int = 0  # requests whose output parted from the recomputed one at a near-tie
    max_logprob_diff: float = 0.0
    models: list[str] = field(default_factory=list)
    what: str = ""
    note: str = ""
    samples_ms: list[float] = field(default_factory=list, repr=False)

    def request(self, model: str, wrong: int, diff: float, seconds: float | None, near_tie: bool = False) -> None:
        self.requests += 1
        self.near_ties += near_tie
        self.wrong_tokens += wrong
        self.max_logprob_diff = max(self.max_logprob_diff, diff)
        if seconds is not None:
            self.samples_ms.append(seconds * 1000)
        if model not in self.models:
            self.models.append(model)

    def finish(self) -> dict:
        self.recover_p99_ms = percentile(self.samples_ms, 99)
        self.recover_p50_ms = percentile(self.samples_ms, 50)
        self.recover_max_ms = max(self.samples_ms) if self.samples_ms else None
        out = {k: v for k, v in self.__dict__.items() if k != "samples_ms"}
        for k in ("recover_p99_ms", "recover_p50_ms", "recover_max_ms", "max_logprob_diff"):
            if out[k] is not None:
                out[k] = round(out[k], 6 if k == "max_logprob_diff" else 1)
        return out
