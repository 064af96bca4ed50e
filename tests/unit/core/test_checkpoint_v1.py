"""Checkpoints written before the manifest's format version 2 still load, to the same logits.

`tests/fixtures/checkpoint-v1` was written once by the version-1 writer (see
`tests/fixtures/make_checkpoint_v1.py`): a tiny Llama-style model resharded to tp 2 x pp 2, with
the logits of a fixed input recorded from the model before it was saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tessera.core.checkpoint import CheckpointReader, load_checkpoint, read_manifest
from tessera.core.config import Layout
from tessera.core.parallel.sharding import shard_tensor

FIXTURE = Path(__file__).parents[2] / "fixtures" / "checkpoint-v1"


def test_the_fixture_is_a_version_1_checkpoint():
    raw = json.loads((FIXTURE / "manifest.json").read_text())
    assert raw["format_version"] == 1
    assert raw["layout"] == {"tp": 2, "pp": 2, "virtual_stages": 1}


def test_a_version_1_checkpoint_loads_to_the_recorded_logits():
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    model = load_checkpoint(FIXTURE)
    with torch.no_grad():
        logits = model(expected["input_ids"])
    # The same weights through the same ops: equal on the machine that recorded them; a CPU
    # with other vector units may reorder a reduction, hence a tolerance of a few ulps.
    torch.testing.assert_close(logits, expected["logits"], rtol=1e-6, atol=1e-6)


def test_a_version_1_checkpoint_reads_its_own_shards_and_layout():
    manifest = read_manifest(FIXTURE)
    assert manifest.layout == Layout(tp=2, pp=2, virtual_stages=1, placement="looped")
    assert manifest.step == 3
    reader = CheckpointReader(FIXTURE)
    for name in reader.names():
        full = reader.global_tensor(name)
        for t in range(2):
            assert torch.equal(reader.shard(name, t, 2), shard_tensor(name, full,
                                                                      manifest.model, t, 2))
