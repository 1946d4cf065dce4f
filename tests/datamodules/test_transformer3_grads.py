"""The Transformer3 per-sequence gradient engine against the reference loop (and the vmap path)."""

from __future__ import annotations

import pytest
import torch
from conftest import per_example_text

import datamodules.federated.engines.next_token as client
from datamodules.federated import FedSGDClient
from datamodules.federated.engines.next_token import (
    per_example_gradients,
    per_example_gradients_loop,
    per_example_gradients_vmap,
)
from datamodules.federated.engines.transformer3 import transformer3_per_example_gradients
from datamodules.federated.observed import ParameterSelection
from datamodules.targets.transformer3 import Transformer3

VOCAB, LENGTH = 500, 7


def small(causal: bool = False, dropout: float = 0.0, dtype: torch.dtype = torch.float32, train: bool = False):
    model = Transformer3(
        vocab_size=VOCAB, hidden_size=32, num_heads=4, ffn_size=64, num_layers=2, max_positions=8,
        dropout=dropout, causal=causal,
    ).to(dtype)
    return model.train(train)


def tokens(num: int = 5, length: int = LENGTH, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num, length), generator=torch.Generator().manual_seed(seed))


def observed(model) -> list[str]:
    return ParameterSelection().resolve(model)  # the paper's default: all but embedding / decoder


def all_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters()]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    assert a.shape == b.shape and a.dtype == b.dtype
    return ((a - b).abs().max() / b.abs().max()).item()


# float32 vs the loop; float64 vs the loop, whose loss is computed in float32 by `next_token_loss`
# (so ~1e-7 is its own accuracy); float64 vs a loop with a float64 loss: rounding only.
TOL = {torch.float32: 1e-5, torch.float64: 1e-6}
TOL_EXACT64 = 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout0"])
def test_matches_loop(causal, dtype, train):
    model = small(causal=causal, dtype=dtype, train=train)
    ids, names = tokens(), observed(model)
    fast = transformer3_per_example_gradients(model, names, ids)
    assert fast.shape == (5, sum(dict(model.named_parameters())[n].numel() for n in names))
    assert rel(fast, per_example_gradients_loop(model, names, ids)) < TOL[dtype]


@pytest.mark.parametrize("causal", [False, True])
def test_float64_with_float64_loss_is_exact(causal, monkeypatch):
    """With the reference's loss kept in float64, the two agree to rounding."""

    def loss64(logits, input_ids, attention_mask=None):
        targets = input_ids[:, 1:]
        logits = logits[:, :-1] if logits.shape[1] == input_ids.shape[1] else logits
        flat = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
        return flat.view(targets.shape).mean(dim=1)

    monkeypatch.setattr(client, "next_token_loss", loss64)
    model = small(causal=causal, dtype=torch.float64)
    ids, names = tokens(), all_names(model)
    assert rel(transformer3_per_example_gradients(model, names, ids), per_example_gradients_loop(model, names, ids)) < TOL_EXACT64


@pytest.mark.parametrize(
    "include",
    [
        ["encoder.layers.0.self_attn.*"],  # layer 0 attention only
        ["encoder.layers.1.linear2.*", "encoder.layers.1.norm2.weight"],  # last layer only: shorter backward
        ["encoder.layers.1.self_attn.in_proj_bias", "encoder.layers.0.norm1.*"],  # biases and affines only
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_partial_selection(include, dtype):
    model = small(dtype=dtype)
    ids, names = tokens(), ParameterSelection(include).resolve(model)
    assert rel(transformer3_per_example_gradients(model, names, ids), per_example_gradients_loop(model, names, ids)) < TOL[dtype]


def test_follows_the_order_of_names():
    model = small()
    ids, names = tokens(), observed(model)
    forward = transformer3_per_example_gradients(model, names, ids)
    backward = transformer3_per_example_gradients(model, names[::-1], ids)
    params = dict(model.named_parameters())
    sizes = [params[n].numel() for n in names]
    parts = forward.split(sizes, dim=1)
    assert torch.equal(backward, torch.cat(parts[::-1], dim=1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_positional_embedding(causal, dtype):
    model = small(causal=causal, dtype=dtype)
    ids, names = tokens(length=5), ["position_embedding.weight"]  # 5 of the 8 rows are used
    # A dirty output buffer: the engine must write every coordinate, unused rows included.
    out = torch.full((5, 8 * 32), float("nan"), dtype=dtype)
    fast = transformer3_per_example_gradients(model, names, ids, out=out)
    assert fast.data_ptr() == out.data_ptr()
    rows = fast.view(5, 8, 32)
    assert torch.equal(rows[:, 5:], torch.zeros_like(rows[:, 5:]))
    # (Causal: the last used row only feeds the last position, which predicts nothing.)
    assert rows[:, :4].abs().amin(dim=2).gt(0).all()
    assert rel(fast, per_example_gradients_loop(model, names, ids)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_head_parameters_and_padding_mask(dtype):
    """Tied token embedding (head + input parts) and decoder bias; a padding mask weights the loss."""
    model = small(dtype=dtype)
    ids, names = tokens(), all_names(model)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[1, 2:] = 0
    out = torch.full((5, sum(p.numel() for p in model.parameters())), float("nan"), dtype=dtype)
    fast = transformer3_per_example_gradients(model, names, ids, mask, out=out)
    assert rel(fast, per_example_gradients_loop(model, names, ids, mask)) < TOL[dtype]
    only_head = ["decoder.bias", "token_embedding.weight"]
    assert rel(
        transformer3_per_example_gradients(model, only_head, ids), per_example_gradients_loop(model, only_head, ids)
    ) < TOL[dtype]


def test_matches_vmap_path_in_eval_mode():
    model = small()
    ids, names = tokens(), observed(model)
    fast = transformer3_per_example_gradients(model, names, ids)
    assert rel(fast, per_example_gradients_vmap(model, names, ids)) < 1e-5


def test_per_example_gradients_dispatches_to_the_engine():
    model = small()
    ids, names = tokens(), observed(model)
    assert torch.equal(per_example_gradients(model, names, ids), transformer3_per_example_gradients(model, names, ids))


def test_client_vmap_and_loop_agree():
    model = small()
    ids = tokens(num=6).view(3, 2, LENGTH)
    names = observed(model)
    fast = per_example_text(FedSGDClient(mode="eval", samples_per_update=2), model, names, ids)
    slow = per_example_text(FedSGDClient(mode="eval", samples_per_update=2, implementation="loop"), model, names, ids)
    assert rel(fast, slow) < 1e-5


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_seeded_and_differs_from_eval(causal):
    model = small(causal=causal, dropout=0.2, train=True)
    ids, names = tokens(), observed(model)
    torch.manual_seed(1)
    first = transformer3_per_example_gradients(model, names, ids)
    torch.manual_seed(1)
    again = transformer3_per_example_gradients(model, names, ids)
    torch.manual_seed(2)
    other = transformer3_per_example_gradients(model, names, ids)
    evaluated = transformer3_per_example_gradients(model.eval(), names, ids)
    assert torch.isfinite(first).all()
    assert torch.equal(first, again)
    assert rel(first, other) > 1e-3
    assert rel(first, evaluated) > 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_dropout_single_sequence_matches_loop_under_the_same_seed(causal):
    """For one sequence the engine draws its dropout masks (embedding, attention probabilities,
    residual branches, FFN) in the module's order and shapes, so the same seed gives the same masks:
    this checks the dropout math exactly, not just that it runs."""
    model = small(causal=causal, dropout=0.3, train=True)
    names = all_names(model)
    for seed in range(3):
        ids = tokens(num=1, length=8, seed=seed)
        torch.manual_seed(seed)
        fast = transformer3_per_example_gradients(model, names, ids)
        torch.manual_seed(seed)
        assert rel(fast, per_example_gradients_loop(model, names, ids)) < 1e-5


def test_default_size_model():
    model = Transformer3().eval()  # the paper's target: V 50257, d 96, 3 layers, FFN 1536
    ids = torch.randint(0, model.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    names = observed(model)
    fast = transformer3_per_example_gradients(model, names, ids)
    assert fast.shape == (3, 1_004_064)
    assert rel(fast, per_example_gradients_loop(model, names, ids)) < 1e-5


def test_rejects_bad_input():
    model = small()
    with pytest.raises(ValueError, match="unknown parameter"):
        transformer3_per_example_gradients(model, ["nope"], tokens())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        transformer3_per_example_gradients(model, observed(model), tokens(length=1))
    with pytest.raises(ValueError, match="exceeds"):
        transformer3_per_example_gradients(model, observed(model), tokens(length=9))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_matches_loop(causal):
    model = small(causal=causal).cuda()
    ids, names = tokens().cuda(), all_names(model)
    fast = transformer3_per_example_gradients(model, names, ids)
    assert rel(fast, per_example_gradients_loop(model, names, ids)) < 1e-4  # GPU kernels reduce in other orders
