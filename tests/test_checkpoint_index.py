"""A checkpoint is untrusted input (security review 2, F5): the file names of
model.safetensors.index.json stay inside the checkpoint directory, only regular files are opened
(a FIFO would block the load forever), and a tensor whose header does not fit its parameter is
refused before its data is read. Every refusal is a CheckpointError naming the file and entry."""
import json
import os
import re
import shutil
import subprocess
from contextlib import contextmanager

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from models.llama import preset
from models.llama import weights
from models.llama.weights import CheckpointError, load_checkpoint, save_hf_checkpoint
from test_llama import random_state

TINY = preset("tiny")
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    state = random_state(TINY, np.random.default_rng(3))
    return save_hf_checkpoint(state, TINY, tmp_path_factory.mktemp("sharded") / "checkpoint", max_shard_bytes=70_000)


@pytest.fixture
def checkpoint(sharded, tmp_path):
    """A copy of the sharded tiny checkpoint to edit (it loads as it is)."""
    return shutil.copytree(sharded, tmp_path / "checkpoint")


def _weight_map(checkpoint) -> dict:
    return json.loads((checkpoint / INDEX).read_text())["weight_map"]


def _write_index(checkpoint, document) -> None:
    (checkpoint / INDEX).write_text(json.dumps(document))


@pytest.mark.parametrize("where", ["absolute", "parent", "subdirectory"])
def test_index_file_names_must_be_plain_names_in_the_checkpoint(where, checkpoint, tmp_path):
    """The first shard is moved and the index names its new place, where it is still a valid shard:
    only the name's form refuses it (before, absolute paths and .. were read from anywhere)."""
    weight_map = _weight_map(checkpoint)
    first = sorted(set(weight_map.values()))[0]
    folder = checkpoint / "sub" if where == "subdirectory" else tmp_path / "outside"
    folder.mkdir()
    os.replace(checkpoint / first, folder / first)
    name = {"absolute": str(folder / first), "parent": f"../outside/{first}", "subdirectory": f"sub/{first}"}[where]
    tensor = next(t for t, file in weight_map.items() if file == first)
    _write_index(checkpoint, {"weight_map": {t: name if file == first else file for t, file in weight_map.items()}})
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint / INDEX}: weight_map[{tensor!r}] = {name!r}: "
                                                        f"expected the name of a file in {checkpoint}")):
        load_checkpoint(checkpoint, progress=False)


@pytest.mark.parametrize("document, message", [
    ({"weight_map": ["model-00001-of-00002.safetensors"]},
     "weight_map: expected an object of tensor name -> file name, got list"),
    ({"weight_map": {"model.norm.weight": 3}}, "weight_map['model.norm.weight'] = 3: expected the name of a file"),
    ({"weight_map": {"model.norm.weight": ".."}},
     "weight_map['model.norm.weight'] = '..': expected the name of a file"),
    (["weight_map"], "not a safetensors index (TypeError"),
], ids=["list", "number", "dotdot", "not-an-object"])
def test_a_malformed_weight_map_is_refused_naming_the_index(document, message, checkpoint):
    _write_index(checkpoint, document)
    with pytest.raises(CheckpointError, match=re.escape(f"{checkpoint / INDEX}: {message}")):
        load_checkpoint(checkpoint, progress=False)


@contextmanager
def _writer_for(fifo):
    """A regression must fail, not hang: while the body runs, another process waits to open
    ``fifo`` for writing and closes it at once, so a reader blocked in open() gets end of file. (A
    thread cannot: safetensors holds the GIL while it opens the file.)"""
    writer = subprocess.Popen(["sh", "-c", ': > "$1"', "sh", str(fifo)])
    try:
        yield
    finally:
        writer.kill()
        writer.wait()


@pytest.mark.parametrize("indexed", [True, False], ids=["named-by-the-index", "found-by-glob"])
def test_a_fifo_in_place_of_a_shard_is_refused_without_opening_it(indexed, checkpoint):
    first = sorted(set(_weight_map(checkpoint).values()))[0]
    os.remove(checkpoint / first)
    os.mkfifo(checkpoint / first)
    if not indexed:
        os.remove(checkpoint / INDEX)
    where = f"{checkpoint / INDEX}: weight_map file {first!r}" if indexed else str(checkpoint / first)
    with _writer_for(checkpoint / first), pytest.raises(
            CheckpointError, match=re.escape(f"{where}: expected a regular file, got a FIFO")):
        load_checkpoint(checkpoint, progress=False)


@pytest.mark.parametrize("replacement, message", [
    (np.zeros((4 * TINY.vocab_size, TINY.hidden_size), np.float32),
     rf"shape \({4 * TINY.vocab_size}, {TINY.hidden_size}\), expected \({TINY.vocab_size}, {TINY.hidden_size}\)"),
    (np.zeros((TINY.vocab_size, TINY.hidden_size), np.int32), r"dtype int32, expected one of"),
], ids=["shape", "dtype"])
def test_a_tensor_that_does_not_fit_is_refused_before_its_data_is_read(replacement, message, checkpoint, monkeypatch):
    """The header says it all: the tensor's data is never asked for (a huge header costs nothing)."""
    name = "model.embed_tokens.weight"
    path = checkpoint / _weight_map(checkpoint)[name]
    save_file({**load_file(path), name: replacement}, str(path))
    reads, real = [], weights._read_alone
    monkeypatch.setattr(weights, "_read_alone", lambda path, tensor, index=None: (
        reads.append(tensor), real(path, tensor, index))[1])
    with pytest.raises(CheckpointError, match=rf"tensor '{re.escape(name)}' in {path.name}: {message}"):
        load_checkpoint(checkpoint, progress=False)
    assert name not in reads
