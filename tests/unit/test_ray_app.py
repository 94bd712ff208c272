"""kvstore.integrations.ray's builders without a Ray cluster: what they hand ray.serve.llm, what
they refuse, and that the decode deployment of the P/D app is ours (the e2e test, on a real Ray
Serve, is tests/e2e/test_ray_serve.py)."""
from __future__ import annotations

import pytest

from kvstore.errors import UnsupportedDeployment
from kvstore.integrations.ray import CONNECTOR_MODULE, colocated_llm_config, pd_serving_args

BASE = {"model_loading_config": {"model_id": "m", "model_source": "/models/m"},
        "engine_kwargs": {"max_model_len": 2048},
        "runtime_env": {"env_vars": {"A": "1"}},
        "kvstore": {"metadata": "etcd://etcd:2379", "cluster": "c1", "prefill_timeout_s": 12, "sync_load_blocks": 8}}


def test_pd_args_put_the_connector_on_both_sides():
    args = pd_serving_args(BASE)
    for side, role in (("prefill_config", "kv_producer"), ("decode_config", "kv_consumer")):
        config = args[side]
        kv = config["engine_kwargs"]["kv_transfer_config"]
        assert kv["kv_connector"] == "KVStoreConnector" and kv["kv_connector_module_path"] == CONNECTOR_MODULE
        assert kv["kv_role"] == role and kv["kv_load_failure_policy"] == "recompute"
        assert kv["kv_connector_extra_config"] == {"metadata": "etcd://etcd:2379", "cluster": "c1", "sync_load_blocks": 8}
        assert config["runtime_env"]["env_vars"] == {"A": "1", "PYTHONHASHSEED": "0"}
        assert config["engine_kwargs"]["max_model_len"] == 2048
        assert config["model_loading_config"]["model_id"] == "m"
    assert args["decode_config"]["experimental_configs"]["kvstore_prefill_timeout_s"] == 12
    assert "kvstore" not in args["prefill_config"] and "kvstore" not in args["decode_config"]
    assert BASE["engine_kwargs"] == {"max_model_len": 2048}  # the caller's dict is left alone


def test_per_side_configs_merge_over_the_shared_keys():
    args = pd_serving_args({**BASE, "prefill_config": {"engine_kwargs": {"max_num_batched_tokens": 8192}},
                            "decode_config": {"deployment_config": {"num_replicas": 3}}})
    assert args["prefill_config"]["engine_kwargs"]["max_num_batched_tokens"] == 8192
    assert args["prefill_config"]["engine_kwargs"]["max_model_len"] == 2048
    assert "max_num_batched_tokens" not in args["decode_config"]["engine_kwargs"]
    assert args["decode_config"]["deployment_config"] == {"num_replicas": 3}


@pytest.mark.parametrize("metadata", ["embedded", "memory://x"])
def test_pd_refuses_a_store_private_to_one_process(metadata):
    with pytest.raises(UnsupportedDeployment, match="processes of their own"):
        pd_serving_args({**BASE, "kvstore": {"metadata": metadata}})
    with pytest.raises(UnsupportedDeployment):
        pd_serving_args({k: v for k, v in BASE.items() if k != "kvstore"})  # no metadata: embedded


def test_the_secret_stays_out_of_the_app_config():
    with pytest.raises(UnsupportedDeployment, match="KVSTORE_SECRET"):
        pd_serving_args({**BASE, "kvstore": {**BASE["kvstore"], "secret": "s"}})


def test_another_connector_is_refused():
    config = {**BASE, "engine_kwargs": {"kv_transfer_config": {"kv_connector": "NixlConnector"}}}
    with pytest.raises(UnsupportedDeployment, match="NixlConnector"):
        pd_serving_args(config)


def test_bad_timeout_is_refused():
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        pd_serving_args({**BASE, "kvstore": {**BASE["kvstore"], "prefill_timeout_s": 0}})


def test_colocated_defaults_to_the_embedded_store():
    config = colocated_llm_config({k: v for k, v in BASE.items() if k != "kvstore"})
    kv = config["engine_kwargs"]["kv_transfer_config"]
    assert kv["kv_role"] == "kv_both" and kv["kv_connector_extra_config"] == {"metadata": "embedded"}
    assert config["runtime_env"]["env_vars"]["PYTHONHASHSEED"] == "0"


def test_the_pd_app_decodes_on_our_server():
    """Ray's own builder, its decode deployment of KVStorePDDecodeServer, prefill of Ray's class."""
    pytest.importorskip("ray.serve.llm", reason="the ray extra is part of the test install")
    from ray.llm._internal.serve.serving_patterns.prefill_decode import builder
    from ray.llm._internal.serve.serving_patterns.prefill_decode.pd_server import PDPrefillServer

    from kvstore.integrations.ray import build_pd_openai_app
    from kvstore.integrations.ray.server import KVStorePDDecodeServer, decode_deployment_class
    from kvstore.integrations.vllm.tiny_model import build_tiny_model

    import tempfile

    model = build_tiny_model(tempfile.mkdtemp() + "/model")
    app = build_pd_openai_app({**BASE, "model_loading_config": {"model_id": "m", "model_source": model}})
    assert decode_deployment_class(app) is KVStorePDDecodeServer
    decode = list(app._bound_deployment.init_kwargs["llm_deployments"].values())[0]._bound_deployment
    assert decode.init_kwargs["prefill_server"]._bound_deployment.func_or_class is PDPrefillServer
    assert builder.PDDecodeServer.__name__ == "PDDecodeServer"  # Ray's module is left as it was


def test_a_model_on_local_disk_skips_rays_download_task(tmp_path):
    """Kills: a callback that skips Ray's node initialization for a hub id or a cloud mirror (the
    model would never be downloaded), and a builder that drops the user's own callback."""
    import asyncio
    import importlib

    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

    from kvstore.integrations.ray.local_model import LocalModelCallback

    config = pd_serving_args(BASE)["decode_config"]
    module, _, name = config["callback_config"]["callback_class"].rpartition(".")
    assert getattr(importlib.import_module(module), name) is LocalModelCallback  # the path Ray loads resolves
    mine = {"callback_class": "my.Callback", "callback_kwargs": {"x": 1}}
    assert colocated_llm_config({**BASE, "callback_config": mine})["callback_config"] == mine

    def runs_init(source: str) -> bool:
        llm = LLMConfig(model_loading_config={"model_id": "m", "model_source": source})
        callback = LocalModelCallback(llm)
        asyncio.run(callback.run_callback("on_before_node_init"))
        return callback.ctx.run_init_node

    assert runs_init(str(tmp_path)) is False
    assert runs_init("org/model") is True  # a hub id: Ray downloads it
    assert runs_init(str(tmp_path / "absent")) is True
    assert runs_init("s3://bucket/model") is True
