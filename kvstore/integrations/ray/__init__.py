"""kvstore on Ray Serve: OpenAI apps built with `ray.serve.llm`, the KV moved by our vLLM connector.

    from ray import serve
    from kvstore.integrations.ray import build_pd_openai_app

    app = build_pd_openai_app({
        "model_loading_config": {"model_id": "my-model", "model_source": "/models/my-model"},
        "engine_kwargs": {"max_model_len": 8192},
        "kvstore": {"metadata": "etcd://etcd:2379"},
    })
    serve.run(app)

or, from a Serve config file, `import_path: kvstore.integrations.ray:build_pd_openai_app` with the
same dict under `args`. What it adds to Ray's own `build_pd_openai_app`:

- the connector on both sides (`kv_connector_module_path`), prefill `kv_producer`, decode
  `kv_consumer`, `PYTHONHASHSEED` fixed in every replica's environment;
- a decode server that survives its prefill: a prefill replica that dies, errs or does not answer
  within `prefill_timeout_s` costs no request — the decode replica computes that prompt itself
  (counted as `local_prefills`);
- no per-node download task for a model already on local disk (a replica starts ~20 s sooner on CPU);
- P/D refused up front where the store cannot serve it (the embedded store is private to one
  process); `build_colocated_openai_app` runs `kv_both` engines, on the embedded store by default.

The cluster secret never goes into a config: every Ray node's environment carries
`KVSTORE_SECRET` (worker processes inherit it), or the file `kvstore serve` reads on that host.
Ray itself is imported only when a builder is called.
"""
from __future__ import annotations

from .app import (CONNECTOR, CONNECTOR_MODULE, build_colocated_openai_app, build_pd_openai_app,
                  colocated_llm_config, pd_serving_args)

__all__ = ["CONNECTOR", "CONNECTOR_MODULE", "build_colocated_openai_app", "build_pd_openai_app",
           "colocated_llm_config", "pd_serving_args"]
