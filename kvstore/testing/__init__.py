"""Real processes that tests, benchmarks and demos start: a local etcd (`etcd`) and a
`vllm serve` with the kvstore connector (`vllm_server`). Each binds loopback on free ports and
cleans up after itself."""
