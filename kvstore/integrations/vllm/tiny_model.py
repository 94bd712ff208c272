"""A tiny Llama and byte-level BPE tokenizer built locally (no hub access), for tests and the demo.
`layers`/`hidden` scale it up for benchmarks where prefill cost should dominate."""
from __future__ import annotations

import os

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "KV caches move from prefill workers to decode workers.",
    "A shared prefix is loaded instead of recomputed.",
    "Disaggregated serving separates prefill and decode pools.",
    "Mooncake keeps KV blocks in a cluster-wide pool of DRAM and NVMe.",
]


def build_tokenizer(path: str, vocab: int = 512) -> str:
    """Write only the byte-level BPE tokenizer to `path` (a model directory's tokenizer files)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)
    return path


def build_tiny_model(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 2, vocab: int = 512,
                     seed: int = 0) -> str:
    """Write tokenizer + randomly initialised Llama weights to `path` (once); returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(path, vocab)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                         max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                         pad_token_id=2)
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
    return path
