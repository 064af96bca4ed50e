"""Regional compilation (`core.regional_compile`): every family's blocks are compiled in place,
parameter names stay the same, and the graphs compiled do not grow with the number of layers.

Graphs are counted with Dynamo's `CompileCounter` backend (it runs each captured graph eagerly:
no Inductor, so these tests stay fast); the losses of the real `--compile` path against eager
are in tests/unit/training/test_loop.py.
"""

from __future__ import annotations

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.testing import CompileCounter

from tessera.core import fused
from tessera.core.config import ModelConfig
from tessera.core.init import build_model
from tessera.core.regional_compile import compile_blocks, layer_stacks


@pytest.fixture(autouse=True)
def _fresh_dynamo(one_thread):
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _model(preset: str, layers: int) -> nn.Module:
    options = {"options": {"num_decoder_layers": layers}} if preset.startswith("t5") else {}
    return build_model(ModelConfig.from_name(preset, num_layers=layers, **options))


def _train_step(model: nn.Module, preset: str) -> torch.Tensor:
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 12), generator=torch.Generator().manual_seed(1))
    if preset.startswith("t5"):
        loss = model(ids, decoder_input_ids=ids[:, :6], labels=ids[:, :6])
    else:
        loss = model(ids, labels=ids)
    loss.backward()
    return loss.detach()


def _graphs_compiled(preset: str, layers: int) -> tuple[int, list[str]]:
    torch._dynamo.reset()
    model = _model(preset, layers)
    counter = CompileCounter()
    blocks = compile_blocks(model, backend=counter)
    for _ in range(2):  # a second step compiles nothing new
        _train_step(model, preset)
    return counter.frame_count, blocks


@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny", "nemotron-tiny", "bert-tiny",
                                    "t5-tiny", "qwen3-moe-tiny"])
def test_graphs_compiled_do_not_grow_with_depth(preset):
    shallow, blocks2 = _graphs_compiled(preset, 2)
    deep, blocks4 = _graphs_compiled(preset, 4)
    stacks = 2 if preset.startswith("t5") else 1
    assert (len(blocks2), len(blocks4)) == (2 * stacks, 4 * stacks)
    assert shallow == deep
    if preset.endswith("moe-tiny"):
        assert shallow > 0  # its routing splits a block into several graphs; depth adds none
    else:
        assert shallow == stacks  # one graph per kind of block (T5: encoder and decoder)


def test_parameter_names_and_values_stay_the_same():
    model = _model("llama-tiny", 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    compile_blocks(model, backend="eager")
    assert [n for n, _ in model.named_parameters()] == names
    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)


def test_compiled_blocks_compute_what_eager_ones_do():
    eager, compiled = _model("llama-tiny", 2), _model("llama-tiny", 2)
    compile_blocks(compiled, backend="eager")
    assert torch.equal(_train_step(compiled, "llama-tiny"), _train_step(eager, "llama-tiny"))
    for (name, a), (_, b) in zip(eager.named_parameters(), compiled.named_parameters()):
        # The traced backward may sum a tensor's gradient contributions in another order.
        torch.testing.assert_close(b.grad, a.grad, msg=name)


def test_stacks_of_each_family_are_found():
    assert list(layer_stacks(_model("llama-tiny", 2))) == ["layers"]
    assert list(layer_stacks(_model("t5-tiny", 2))) == ["encoder.layers", "decoder.layers"]


def test_a_model_without_a_layer_stack_is_refused():
    with pytest.raises(ValueError, match="no layer stack .* named 'layers'"):
        compile_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_reading_the_fused_kernel_mode_does_not_recompile_a_block(monkeypatch):
    """Traced inside a compiled block, a fused kernel must not guard on the mode it reads on its
    first call (that read sets it, so the next layer would fail the guard and recompile)."""
    monkeypatch.setenv("TESSERA_FUSED_KERNELS", "off")
    fused.set_mode(None)  # read again on first use, as at the start of a process
    try:
        shallow, _ = _graphs_compiled("llama-tiny", 2)
    finally:
        fused.set_mode(None)
    assert shallow == 1
