"""Builders of Ray Serve LLM apps with the kvstore connector (see the package docstring).

Args are what Ray's own builders take, plus a `kvstore` mapping:

    {"model_loading_config": {...}, "engine_kwargs": {...}, ...   # shared by prefill and decode
     "prefill_config": {...}, "decode_config": {...},              # optional, merged over the shared keys
     "ingress_cls_config": {...}, "ingress_deployment_config": {...},
     "kvstore": {"metadata": "etcd://host:2379", "cluster": "default", "prefill_timeout_s": 30,
                 ...any other kv_connector_extra_config key (docs/vllm-connector.md)}}

Everything but `kvstore` is handed to `ray.serve.llm` unchanged.
"""
from __future__ import annotations

import copy
from typing import Any

from ...errors import UnsupportedDeployment
from .names import CONNECTOR, CONNECTOR_MODULE, DEFAULT_PREFILL_TIMEOUT_S, LOCAL_MODEL_CALLBACK

HASH_SEED = "0"  # vLLM's own block hashes are seeded per process unless PYTHONHASHSEED is fixed
PD_KEYS = ("prefill_config", "decode_config", "ingress_cls_config", "ingress_deployment_config")
# Keys of the `kvstore` mapping that are ours, not the connector's.
OWN_KEYS = ("prefill_timeout_s",)


def _split(args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the kvstore mapping, the rest), both copies; refuses what must not be in a config."""
    if not isinstance(args, dict):
        raise TypeError(f"args must be a dict, not {type(args).__name__}")
    rest = copy.deepcopy(args)
    ours = rest.pop("kvstore", None) or {}
    if not isinstance(ours, dict):
        raise TypeError("args['kvstore'] must be a mapping of kv_connector_extra_config keys")
    if "secret" in ours:
        raise UnsupportedDeployment(
            "args['kvstore']['secret']: a Serve config is visible to anyone who can read the app's status; give "
            "every Ray node KVSTORE_SECRET in its environment instead (worker processes inherit it)")
    return ours, rest


def _with_connector(config: dict[str, Any], role: str, extra: dict[str, Any]) -> dict[str, Any]:
    """An LLMConfig dict with our connector in `role` (a kv_transfer_config already there is kept, as
    long as it names our connector), PYTHONHASHSEED fixed in its replicas' environment, and no download
    task for a model on local disk unless the config names a callback of its own (local_model.py)."""
    config = copy.deepcopy(config)
    engine = config.setdefault("engine_kwargs", {})
    kv = engine.get("kv_transfer_config")
    if kv is None:
        kv = engine["kv_transfer_config"] = {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                                             "kv_role": role, "kv_load_failure_policy": "recompute"}
    elif kv.get("kv_connector") != CONNECTOR:
        raise UnsupportedDeployment(f"engine_kwargs.kv_transfer_config names {kv.get('kv_connector')!r}; "
                                    f"kvstore.integrations.ray builds apps with {CONNECTOR}")
    kv.setdefault("kv_connector_module_path", CONNECTOR_MODULE)
    kv.setdefault("kv_role", role)
    kv.setdefault("kv_load_failure_policy", "recompute")
    kv["kv_connector_extra_config"] = {**extra, **(kv.get("kv_connector_extra_config") or {})}
    # The import path only: Ray loads the callback in each replica, and this module stays Ray-free.
    config.setdefault("callback_config", {"callback_class": LOCAL_MODEL_CALLBACK})
    runtime_env = config.get("runtime_env") or {}
    env_vars = runtime_env.setdefault("env_vars", {})
    env_vars.setdefault("PYTHONHASHSEED", HASH_SEED)
    config["runtime_env"] = runtime_env
    return config


def _merge(shared: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any]:
    """`own` over `shared`, one level of mappings deep (engine_kwargs, runtime_env, ...)."""
    out = copy.deepcopy(shared)
    for key, value in (own or {}).items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **copy.deepcopy(value)}
        else:
            out[key] = copy.deepcopy(value)
    return out


def pd_serving_args(args: dict[str, Any]) -> dict[str, Any]:
    """Ray's PDServingArgs (as a dict) for `args`: prefill `kv_producer`, decode `kv_consumer`, both
    on the store named by `args['kvstore']['metadata']`, which must be a cluster (etcd://...)."""
    ours, rest = _split(args)
    metadata = str(ours.get("metadata", "embedded"))
    if metadata == "embedded" or metadata.startswith("memory://"):
        raise UnsupportedDeployment(
            f"kvstore.metadata={metadata!r} is a store private to one process, but Ray runs the prefill and decode "
            "replicas in processes of their own: run `kvstore serve` daemons and etcd (deploy/k8s, or "
            "docs/operations.md) and set kvstore.metadata to etcd://HOST:PORT")
    extra = {k: v for k, v in ours.items() if k not in OWN_KEYS}
    timeout = float(ours.get("prefill_timeout_s", DEFAULT_PREFILL_TIMEOUT_S))
    if not timeout > 0:
        raise ValueError(f"kvstore.prefill_timeout_s must be above 0, not {timeout}")
    shared = {k: v for k, v in rest.items() if k not in PD_KEYS}
    prefill = _with_connector(_merge(shared, rest.get("prefill_config")), "kv_producer", extra)
    decode = _with_connector(_merge(shared, rest.get("decode_config")), "kv_consumer", extra)
    decode.setdefault("experimental_configs", {})["kvstore_prefill_timeout_s"] = timeout
    out = {"prefill_config": prefill, "decode_config": decode}
    for key in ("ingress_cls_config", "ingress_deployment_config"):
        if key in rest:
            out[key] = rest[key]
    return out


def build_pd_openai_app(args: dict[str, Any]):
    """A P/D OpenAI app: Ray's `build_pd_openai_app` on `pd_serving_args(args)`, its decode
    deployment our KVStorePDDecodeServer (it computes a prompt itself when its prefill fails)."""
    serving_args = pd_serving_args(args)
    from .server import build_with_kvstore_decode, register_backend

    register_backend()
    return build_with_kvstore_decode(serving_args)


def colocated_llm_config(args: dict[str, Any]) -> dict[str, Any]:
    """An LLMConfig dict with the connector as `kv_both` (prefix sharing and offload); the embedded
    store by default (each replica its own), a cluster's with `kvstore.metadata: etcd://...`."""
    ours, rest = _split(args)
    extra = {k: v for k, v in ours.items() if k not in OWN_KEYS}
    extra.setdefault("metadata", "embedded")
    return _with_connector(rest, "kv_both", extra)


def build_colocated_openai_app(args: dict[str, Any]):
    """Ray's `build_openai_app` for one model whose replicas share prefixes through the store."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [colocated_llm_config(args)]})
