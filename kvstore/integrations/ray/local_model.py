"""Replicas of a model on local disk start without Ray's per-node download task.

Ray Serve LLM runs `initialize_remote_node` as a task on every node of a replica's placement group
before the engine starts: a fresh Ray worker that imports torch and transformers (about 20 s of CPU
on a small host) only to learn that a local model path needs no download. Where the model is a
directory on this node and no cloud mirror is configured, that task returns the path unchanged, so
skipping it changes nothing but the start time. A hub id, an s3:// or gs:// source, or a mirror
config keeps Ray's download as it is.
"""
from __future__ import annotations

import os

from ray.llm._internal.common.callbacks.base import CallbackBase


class LocalModelCallback(CallbackBase):
    """Ray's default callback, but no node-initialization task for a model already on local disk."""

    async def on_before_node_init(self) -> None:
        engine = self.llm_config.get_engine_config()
        if engine.mirror_config is None and os.path.isdir(engine.actual_hf_model_id):
            self.ctx.run_init_node = False
