"""The vLLM KV-connector plugin. Load it with
KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm.connector").
Nothing here imports vLLM until vLLM loads the connector module."""
