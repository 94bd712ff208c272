"""Tiny local models are built whole or not at all: a reader never sees a half-written one."""
from __future__ import annotations

import os
import threading
import time

from kvstore.integrations.vllm.tiny_model import _build_once


def _writer(started: threading.Event, release: threading.Event):
    def write(out: str) -> None:
        with open(os.path.join(out, "config.json"), "w") as f:
            f.write("{}")
        started.set()
        release.wait(10)  # the weights are still being written
        with open(os.path.join(out, "model.safetensors"), "w") as f:
            f.write("weights")
    return write


def test_a_model_being_built_is_not_visible_until_its_weights_are_written(tmp_path):
    """Kills building in place (config.json written before the weights, as save_pretrained does):
    a second process checking for config.json, as every builder does, would load a model whose
    weights are missing or half written."""
    path = str(tmp_path / "model")
    started, release = threading.Event(), threading.Event()
    builder = threading.Thread(target=_build_once, args=(path, _writer(started, release)))
    builder.start()
    assert started.wait(10)
    assert not os.path.exists(os.path.join(path, "config.json"))
    release.set()
    builder.join(10)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert [name for name in os.listdir(tmp_path) if name != "model"] == []  # no scratch left


def test_two_builders_of_one_path_both_end_with_the_whole_model(tmp_path):
    """Kills a second builder that fails (or deletes the first one's model) when the first renamed
    its model in first."""
    path = str(tmp_path / "model")
    release = threading.Event()
    errors: list[BaseException] = []

    def build() -> None:
        try:
            _build_once(path, _writer(threading.Event(), release))
        except BaseException as exc:  # noqa: BLE001 - asserted below
            errors.append(exc)
    builders = [threading.Thread(target=build) for _ in range(2)]
    for b in builders:
        b.start()
    release.set()
    for b in builders:
        b.join(10)
    assert errors == []
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert open(os.path.join(path, "model.safetensors")).read() == "weights"
    assert [name for name in os.listdir(tmp_path) if name != "model"] == []


def test_a_directory_the_caller_made_keeps_its_files(tmp_path):
    """Kills replacing (or deleting) an existing directory that holds no model yet."""
    path = tmp_path / "model"
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    _build_once(str(path), _writer(threading.Event(), _set()))
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "notes.txt"]


def _set() -> threading.Event:
    event = threading.Event()
    event.set()
    return event


def test_a_scratch_directory_a_killed_builder_left_is_swept_and_a_live_one_is_not(tmp_path):
    """Kills a builder that never removes the scratch a killed build left (kill -9 skips its
    cleanup), and one that sweeps every scratch directory, another builder's still being written
    included."""
    abandoned, live = tmp_path / ".kvstore-building-abandoned", tmp_path / ".kvstore-building-live"
    for scratch in (abandoned, live):
        scratch.mkdir()
        (scratch / "config.json").write_text("{}")
    hours_ago = time.time() - 2 * 3600
    os.utime(abandoned, (hours_ago, hours_ago))
    _build_once(str(tmp_path / "model"), _writer(threading.Event(), _set()))
    assert sorted(os.listdir(tmp_path)) == [".kvstore-building-live", "model"]
