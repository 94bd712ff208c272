"""Names a Ray Serve app and its kvstore parts agree on: the connector vLLM loads, and the prefill
wait's default, and the replicas' start-up callback (by import path: Ray loads it in each replica)."""
from __future__ import annotations

CONNECTOR = "KVStoreConnector"
CONNECTOR_MODULE = "kvstore.integrations.vllm.connector"
DEFAULT_PREFILL_TIMEOUT_S = 30.0
LOCAL_MODEL_CALLBACK = "kvstore.integrations.ray.local_model.LocalModelCallback"
