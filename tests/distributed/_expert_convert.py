"""A checkpoint saved by a real expert-parallel training run, through `tessera convert`:
called by `test_moe_pretrain_ep` on the run it already makes (no spawn of its own)."""

from __future__ import annotations

from pathlib import Path

import torch

from tessera.converters.reshard import reshard_checkpoint
from tessera.core.checkpoint import load_checkpoint, read_manifest


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def check_run_converts(run_checkpoint: Path, tmp: Path) -> None:
    """The run's checkpoint (expert banks in ep x etp pieces) converted to ep 1 loads the model
    the run's own checkpoint loads, bit for bit; converted back to the run's ep, etp and dp,
    its expert files are the run's, byte for byte, under the run's manifest layout."""
    run = read_manifest(run_checkpoint).layout
    assert run.ep * run.etp > 1, run
    ep1 = Path(reshard_checkpoint(run_checkpoint, tmp / "ep1", ep=1, progress=False
                                  ).destination)
    assert read_manifest(ep1).layout.ep == 1 and not list(ep1.glob("experts-*"))
    want = load_checkpoint(run_checkpoint).state_dict()
    got = load_checkpoint(ep1).state_dict()
    assert want.keys() == got.keys()
    assert all(_bytes(got[k]) == _bytes(v) for k, v in want.items())
    again = Path(reshard_checkpoint(ep1, tmp / "again", ep=run.ep, etp=run.etp, dp=run.dp,
                                    progress=False).destination)
    pieces = sorted(f.name for f in Path(run_checkpoint).glob("experts-*"))
    assert pieces and pieces == sorted(f.name for f in again.glob("experts-*"))
    for file in pieces:
        assert (again / file).read_bytes() == (Path(run_checkpoint) / file).read_bytes(), file
    assert read_manifest(again).layout == run
