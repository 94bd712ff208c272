"""Stand-in vLLM engines: everything a router or the store can see of `vllm serve` (its HTTP API,
`/metrics`, KV events over ZMQ, its prefix cache and continuous batching, the kvstore connector's
loads and saves), with the GPU's compute replaced by a cost model on a simulated clock.

    python -m conductor.sim.engine --engines 12 --base-port 8100 --profile h100-llama3-8b --time-scale 2

Modules, one concept each: `profile` (the cost model and its profiles), `hashing` (vLLM's block
hashes and the store's keys), `prefix_cache` (the paged KV cache), `scheduler` (vLLM v1's
scheduling), `events` (KV events on the wire), `store_link` (the connector's store traffic),
`metrics` (`/metrics`), `http_front` (the OpenAI API), `engine` (one engine on the clock, its
faults), `fleet` (many engines in one process)."""
