"""The LoRA adapter directory: round trip, merge arithmetic, and what it refuses."""

import json

import pytest
import torch

from tessera.core.lora_format import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterConfig,
    AdapterError,
    check_base,
    load_adapter,
    merge_into,
    read_adapter_config,
    save_adapter,
)


def _adapter(rank=2):
    g = torch.Generator().manual_seed(0)
    config = AdapterConfig(rank=rank, alpha=8.0, modules=("layers.0.attention.wqkv",),
                           targets=("wqkv",), base_fingerprint="ab" * 32)
    tensors = {"layers.0.attention.wqkv.lora_A.weight": torch.randn(rank, 4, generator=g),
               "layers.0.attention.wqkv.lora_B.weight": torch.randn(6, rank, generator=g)}
    return config, tensors


def test_round_trip_and_merge(tmp_path):
    config, tensors = _adapter()
    save_adapter(tmp_path / "a", config, tensors)
    loaded_config, loaded = load_adapter(tmp_path / "a")
    assert loaded_config == config and loaded_config.scaling == 4.0
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
    w = torch.randn(6, 4)
    merged = merge_into({"layers.0.attention.wqkv.weight": w}, config, tensors)
    a, b = tensors.values()
    x = torch.randn(3, 4)
    # The merged layer equals base + scaling * B A x, computed the unmerged way.
    torch.testing.assert_close(x @ merged["layers.0.attention.wqkv.weight"].T,
                               x @ w.T + 4.0 * (x @ a.T) @ b.T)


def test_refuses_damage_bad_shapes_and_other_bases(tmp_path):
    config, tensors = _adapter()
    with pytest.raises(AdapterError, match="rank must be positive"):
        AdapterConfig(rank=0, alpha=1.0, modules=())
    bad = dict(tensors, **{"layers.0.attention.wqkv.lora_B.weight": torch.zeros(6, 3)})
    with pytest.raises(AdapterError, match=r"\(r, in\) and \(out, r\)"):
        save_adapter(tmp_path / "bad", config, bad)
    assert not (tmp_path / "bad").exists()  # nothing half-written
    save_adapter(tmp_path / "a", config, tensors)
    with pytest.raises(AdapterError, match="different weights"):
        check_base(read_adapter_config(tmp_path / "a"), "cd" * 32, "base-dir")
    (tmp_path / "a" / WEIGHTS_FILE).write_bytes((tmp_path / "a" / WEIGHTS_FILE).read_bytes()[:-1]
                                                + b" ")
    with pytest.raises(AdapterError, match="damaged"):
        load_adapter(tmp_path / "a")
    manifest = json.loads((tmp_path / "a" / CONFIG_FILE).read_text())
    (tmp_path / "a" / CONFIG_FILE).write_text(json.dumps(dict(manifest, format="peft")))
    with pytest.raises(AdapterError, match="not a tessera-lora"):
        read_adapter_config(tmp_path / "a")
    with pytest.raises(AdapterError, match="no adapter.json"):
        read_adapter_config(tmp_path)
