"""A tiny Llama and a byte-level BPE tokenizer built locally (no hub access), for the demo, the
quick starts and the benchmarks: `layers`/`hidden` scale it up where prefill cost should dominate,
`sliding_window` makes its layers alternate sliding-window and full attention (gpt-oss style,
vLLM's hybrid KV cache groups). The tests' other shapes (MLA, Mamba) are in kvstore_testing."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Callable

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


SCRATCH_PREFIX = ".kvstore-building-"  # ours alone: the sweep below must not touch other tools' scratch
ABANDONED_AFTER_S = 3600.0  # no tiny model takes this long to write: a scratch dir this old lost its builder


def _sweep_abandoned_scratch(parent: str, older_than_s: float = ABANDONED_AFTER_S) -> None:
    """Remove scratch directories a killed builder left in `parent` (its `finally` never ran); one
    touched in the last `older_than_s` may be another builder's, still writing, and is left."""
    now = time.time()
    for name in os.listdir(parent):
        scratch = os.path.join(parent, name)
        try:
            if name.startswith(SCRATCH_PREFIX) and now - os.stat(scratch).st_mtime > older_than_s:
                shutil.rmtree(scratch, ignore_errors=True)
        except OSError:
            pass  # another builder renamed or removed it first


def _build_once(path: str, write: Callable[[str], None]) -> str:
    """Run `write(dir)` into a scratch directory beside `path`, then rename it to `path`: a reader (or
    a second builder, as two benchmarks on a fresh machine) sees no model or a whole one, never a
    config.json whose weights are still being written. Returns `path`."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    _sweep_abandoned_scratch(parent)
    scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
    try:
        write(scratch)
        try:
            os.rename(scratch, path)  # atomic; fails when `path` is a directory with files in it
        except OSError:
            if not os.path.exists(os.path.join(path, "config.json")):  # not another builder's model:
                # files of our own beside the caller's, each renamed in, config.json last
                names = sorted(os.listdir(scratch), key=lambda name: name == "config.json")
                for name in names:
                    os.replace(os.path.join(scratch, name), os.path.join(path, name))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return path


TOKENS = dict(bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)


def build_tiny_model(path: str, *, layers: int = 2, hidden: int = 128, heads: int = 2, vocab: int = 512,
                     seed: int = 0, sliding_window: int | None = None, max_positions: int = 4096) -> str:
    """Write tokenizer + randomly initialised Llama weights to `path` (once); returns `path`.
    With `sliding_window`, even layers attend only that many tokens back and odd layers attend
    everything (gpt-oss's 1:1 pattern, `layer_types` as vLLM's Llama reads it)."""
    return _build_once(path, lambda out: _write_llama(out, layers, hidden, heads, vocab, seed, sliding_window,
                                                      max_positions))


def _write_llama(path: str, layers: int, hidden: int, heads: int, vocab: int, seed: int, sliding_window: int | None,
                 max_positions: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    build_tokenizer(path, vocab)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, head_dim=hidden // heads,
                         max_position_embeddings=max_positions, **TOKENS)
    if sliding_window is not None:
        config.layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
        config.sliding_window = sliding_window
    torch.manual_seed(seed)
    LlamaForCausalLM(config).save_pretrained(path)
