"""Test scaffolding for the test suite and the benchmarks, kept out of the installed package (it is
in a source checkout only): real processes that tests and benchmarks start, a local etcd (`etcd`,
`etcd_proxy`) and a `vllm serve` with the kvstore connector (`vllm_server`), each on free loopback
ports (`ports`), every child in a process group of its own and stopped at exit whatever fails
(`processes`); fake vLLM engines in front of which the gateway's unit tests put a real gateway
(`fake_engines`); tiny models of the shapes the tests need beside the demo's Llama (`tiny_models`)."""
