"""Real processes that tests, benchmarks and demos start: a local etcd (`etcd`) and a
`vllm serve` with the kvstore connector (`vllm_server`). Each binds loopback on free ports and
cleans up after itself; every child runs in a process group of its own and is stopped at exit
whatever fails (`processes`)."""
