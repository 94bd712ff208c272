"""Text to token ids for the stand-in: the model directory's tokenizer (and chat template) when
given, else a small deterministic one (each word and each run of punctuation one id; a chat
turn `<|role|>` + its content, then `<|assistant|>`), enough for routers that tokenize through
the engine (`/tokenize`, `/render`) to see what the engine computes on."""
from __future__ import annotations

import os
import re
from typing import Any

import xxhash

_WORDS = re.compile(r"\s*\w+|\s*[^\w\s]+|\s+")
VOCAB = 32000
BOS = 1


class Tokenizer:
    def __init__(self, model_dir: str | None = None) -> None:
        self.hf = None
        if model_dir and os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
            from transformers import AutoTokenizer

            self.hf = AutoTokenizer.from_pretrained(model_dir)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.hf is not None:
            return list(self.hf(text, add_special_tokens=add_special_tokens).input_ids)
        ids = [3 + xxhash.xxh32_intdigest(piece.encode()) % (VOCAB - 3) for piece in _WORDS.findall(text)]
        return [BOS] + ids if add_special_tokens else ids

    def chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if self.hf is not None and getattr(self.hf, "chat_template", None):
            ids = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        ids = [BOS]
        for message in messages:
            if not isinstance(message, dict):
                raise ValueError("each message must be an object")
            ids += self.encode(f"<|{message.get('role', 'user')}|>", False)
            ids += self.encode(_text(message.get("content")), False)
        return ids + self.encode("<|assistant|>", False)

    def decode_one(self, token: int) -> str:
        if self.hf is not None:
            return self.hf.decode([token])
        return " tok"


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return ""
