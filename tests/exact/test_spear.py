"""SPEAR on planted ReLU layers: exact recovery, the certificate, dead neurons and degenerate inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from datamodules.federated.hashing import Hashing
from exact.spear import Sampling, SearchBudget, Spear, SpearResult, relu_linear_layer, sparsity_agreement


def planted(b=8, n=50, m=100, dtype=torch.float64, seed=0, dead=0, positive=False):
    """A Linear(n, m) + ReLU + Linear(m, 10) with an MSE loss on b known inputs X (b, n)."""
    gen = torch.Generator().manual_seed(seed)
    layer = nn.Linear(n, m).to(dtype)
    head = nn.Linear(m, 10).to(dtype)
    with torch.no_grad():
        for p in (*layer.parameters(), *head.parameters()):
            p.uniform_(-1 / math.sqrt(p.shape[-1]), 1 / math.sqrt(p.shape[-1]), generator=gen)
        if dead:
            layer.bias[:dead] = -100.0  # these neurons never fire
    x = torch.rand(b, n, generator=gen, dtype=dtype) if positive else torch.randn(b, n, generator=gen, dtype=dtype)
    target = torch.randn(b, 10, generator=gen, dtype=dtype)
    z = layer(x)
    loss = ((head(torch.relu(z)) - target) ** 2).sum(1).mean()
    grad_w, grad_b, grad_z = torch.autograd.grad(loss, [layer.weight, layer.bias, z])
    return x, layer, grad_w, grad_b, grad_z


def best_match(true: torch.Tensor, recovered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per true row: cosine with and index of the best-matching recovered row."""
    cos = nn.functional.normalize(true.double(), dim=1) @ nn.functional.normalize(recovered.double(), dim=1).T
    best = cos.max(dim=1)
    return best.values, best.indices


def psnr(true: torch.Tensor, recovered: torch.Tensor) -> float:
    mse = ((true.double() - recovered.double()) ** 2).mean().clamp_min(1e-30)
    return float(10 * torch.log10(1.0 / mse))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_planted_batch_is_recovered_exactly_and_certified(dtype):
    x, layer, gw, gb, gz = planted(b=6, dtype=dtype, positive=True)  # all-positive inputs, like images
    result = Spear().attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias)
    assert isinstance(result, SpearResult)
    assert result.exact and result.reason is None and result.agreement == 1.0
    assert result.inputs.shape == (6, 50) and result.inputs.dtype == torch.float64
    cos, match = best_match(x, result.inputs)
    assert cos.min() > 0.999999
    assert sorted(match.tolist()) == list(range(6))  # a permutation
    # PSNR of the inputs (in [0, 1], like images), matched row by row.
    assert psnr(x, result.inputs[match]) > (200 if dtype == torch.float64 else 100)
    d = result.diagnostics
    assert d["rank"] == 6 and d["numerical_rank"] == 6 and d["samples"] > 0 and d["candidates"] >= 5
    assert d["seconds"] > 0 and d["stopped"] == "certified"


def test_recovered_zero_pattern_equals_the_true_relu_pattern():
    """The recovered dL/dZ = L Q (scaled) is the true dL/dZ, up to the sample permutation."""
    x, layer, gw, gb, gz = planted(b=6, m=60, n=30, seed=3)
    result = Spear().attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias)
    assert result.exact
    _, match = best_match(x, result.inputs)
    # dL/dW = dZ^T X, so with X recovered, dZ^T = dL/dW X^+.
    recovered_gz = (gw @ torch.linalg.pinv(result.inputs[match])).T  # (b, m)
    assert torch.allclose(recovered_gz, gz, atol=1e-10)
    assert torch.equal(recovered_gz.abs() <= 1e-12, gz == 0)


def test_sparsity_agreement_matches_a_plain_loop():
    gen = torch.Generator().manual_seed(1)
    grad_z = torch.randn(40, 7, generator=gen, dtype=torch.float64)
    grad_z[torch.rand(40, 7, generator=gen) < 0.5] = 0.0
    grad_z[3] = 1e-20  # a dead row, numerically
    pre = torch.randn(40, 7, generator=gen, dtype=torch.float64)
    zero_tol, dead_tol = 1e-9, 1e-12
    top = max(math.sqrt(sum(float(v) ** 2 for v in row)) for row in grad_z)
    agree = 0
    for i in range(40):
        norm = math.sqrt(sum(float(v) ** 2 for v in grad_z[i]))
        for j in range(7):
            is_zero = abs(float(grad_z[i, j])) <= zero_tol * norm or norm <= dead_tol * top
            agree += is_zero == (float(pre[i, j]) <= 0)
    assert sparsity_agreement(grad_z, pre, zero_tol, dead_tol) == pytest.approx(agree / 280, abs=1e-15)
    # The true pattern agrees everywhere.
    assert sparsity_agreement(grad_z, torch.where(grad_z != 0, 1.0, -1.0).double(), zero_tol, dead_tol) < 1.0  # row 3
    pattern = torch.where(grad_z.abs() > 1e-15, 1.0, -1.0).double()
    assert sparsity_agreement(grad_z, pattern, zero_tol, dead_tol) == 1.0


def test_dead_neurons_are_dropped():
    x, layer, gw, gb, _ = planted(b=8, m=120, dead=30, seed=2)
    assert int((gw.norm(dim=1) == 0).sum()) >= 30
    result = Spear().attack(gw, gb, batch_size=8, weight=layer.weight, bias=layer.bias)
    assert result.exact
    assert result.diagnostics["live_rows"] <= 90
    assert best_match(x, result.inputs)[0].min() > 0.999999


def test_batch_size_is_estimated_from_the_numerical_rank():
    x, layer, gw, gb, _ = planted(b=7, seed=4)
    result = Spear().attack(gw, gb, batch_size=None, weight=layer.weight, bias=layer.bias)
    assert result.exact and result.diagnostics["rank"] == 7 and result.inputs.shape[0] == 7


def test_same_seed_same_result_and_different_seed_same_inputs():
    x, layer, gw, gb, _ = planted(b=8, seed=5)
    a = Spear(SearchBudget(batch_samples=512), Sampling(seed=11)).attack(gw, gb, 8, layer.weight, layer.bias)
    b = Spear(SearchBudget(batch_samples=512), Sampling(seed=11)).attack(gw, gb, 8, layer.weight, layer.bias)
    c = Spear(SearchBudget(batch_samples=512), Sampling(seed=12)).attack(gw, gb, 8, layer.weight, layer.bias)
    # Same draws and same selection; the linear algebra may differ in the last bits (BLAS/LAPACK paths).
    assert a.diagnostics["samples"] == b.diagnostics["samples"]
    assert a.diagnostics["selected_zeros"] == b.diagnostics["selected_zeros"]
    assert torch.allclose(a.inputs, b.inputs, rtol=0, atol=1e-12)
    assert a.exact and c.exact
    assert best_match(a.inputs, c.inputs)[0].min() > 0.999999


def test_without_weight_and_bias_inputs_are_found_but_not_certified():
    x, _, gw, gb, _ = planted(b=6, seed=6)
    result = Spear().attack(gw, gb, batch_size=6)
    assert not result.exact and "not certified" in result.reason and result.agreement is None
    assert best_match(x, result.inputs)[0].min() > 0.999999


def test_missing_bias_gradient_gives_directions_only():
    x, layer, gw, _, _ = planted(b=6, seed=7)
    result = Spear().attack(gw, None, batch_size=6, weight=layer.weight, bias=layer.bias)
    assert not result.exact and "bias" in result.reason
    assert torch.allclose(result.inputs.norm(dim=1), torch.ones(6, dtype=torch.float64))
    cos = (nn.functional.normalize(x, dim=1) @ result.inputs.T).abs().max(dim=1).values
    assert cos.min() > 0.999999  # right directions, scale and sign unknown


def test_degenerate_inputs_return_flagged_results():
    x, layer, gw, gb, _ = planted(b=6, m=20, n=5, seed=8)  # b >= n
    result = Spear().attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias)
    assert not result.exact and "min(m, n)" in result.reason and result.inputs.shape[1] == 5

    zero = Spear().attack(torch.zeros(30, 10), torch.zeros(30), batch_size=None)
    assert not zero.exact and "rank 0" in zero.reason and zero.inputs.shape == (0, 10)

    x, layer, gw, gb, _ = planted(b=10, seed=9)
    starved = Spear(SearchBudget(max_samples=8, batch_samples=4)).attack(gw, gb, batch_size=10, weight=layer.weight, bias=layer.bias)
    assert not starved.exact and "budget" in starved.reason and starved.diagnostics["samples"] == 8

    with pytest.raises(ValueError):
        Spear().attack(torch.zeros(3), None)
    with pytest.raises(ValueError):
        Sampling(tau=0.0)


def test_max_seconds_bounds_the_search():
    x, layer, gw, gb, _ = planted(b=24, m=60, n=40, seed=10)  # 2^23 expected samples: hopeless
    result = Spear(SearchBudget(max_seconds=0.5, batch_samples=1024)).attack(gw, gb, 24, layer.weight, layer.bias)
    assert not result.exact and result.diagnostics["stopped"] == "max_seconds"
    assert result.diagnostics["seconds"] < 5


def test_relu_linear_layer_finds_layers_by_name():
    from datamodules.targets import Transformer3

    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    assert relu_linear_layer(mlp, "0").followed_by_relu is True
    assert relu_linear_layer(mlp, "2").followed_by_relu is False
    assert relu_linear_layer(mlp, "0").weight_name == "0.weight"
    model = Transformer3(vocab_size=50, hidden_size=16, num_heads=2, ffn_size=32, num_layers=2, max_positions=8)
    found = relu_linear_layer(model, "encoder.layers.1.linear1")
    assert found.followed_by_relu is True and found.module is model.encoder.layers[1].linear1
    assert relu_linear_layer(model, "encoder.layers.0.linear2").followed_by_relu is None
    with pytest.raises(KeyError):
        relu_linear_layer(model, "encoder.layers.7.linear1")
    with pytest.raises(TypeError):
        relu_linear_layer(model, "encoder.layers.0")


def test_transformer3_ffn_inputs_are_recovered_from_a_real_client_update():
    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.targets import Transformer3

    model = Transformer3(vocab_size=200, hidden_size=32, num_heads=2, ffn_size=128, num_layers=2, max_positions=8)
    pipeline = UpdatePipeline(model, client=FedSGDClient(mode="eval"), hashing=Hashing(bins=16))
    ids = torch.randint(0, 200, (1, 1, 8), generator=torch.Generator().manual_seed(0))
    update = pipeline({"input_ids": ids}, keep_update=True).update
    parts = pipeline.split(update)
    layer = relu_linear_layer(model, "encoder.layers.0.linear1")
    seen = []
    handle = layer.module.register_forward_hook(lambda m, inp, out: seen.append(inp[0].detach()))
    model.eval()
    with torch.no_grad():
        model(ids[0])
    handle.remove()
    truth = seen[0].reshape(-1, 32)  # 8 tokens -> 8 rows
    result = Spear().attack(parts[layer.weight_name][0], parts[layer.bias_name][0], batch_size=8,
                            weight=layer.module.weight, bias=layer.module.bias)
    assert result.exact
    assert best_match(truth, result.inputs)[0].min() > 0.999


def test_spear_does_not_import_lightning():
    import subprocess
    import sys

    code = (
        "import sys\nimport exact.spear\nfrom exact import Spear, SpearResult\n"
        "bad = [m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_line_search_sampler_recovers_the_planted_batch():
    x, layer, gw, gb, _ = planted(b=10, m=120, n=40, seed=12)
    result = Spear(SearchBudget(batch_samples=512), Sampling(line_search=True)).attack(gw, gb, 10, layer.weight, layer.bias)
    assert result.exact
    assert best_match(x, result.inputs)[0].min() > 0.999999


def test_float32_gradients_cast_to_float64_keep_the_float32_tolerance():
    x, layer, gw, gb, _ = planted(b=8, dtype=torch.float32, seed=13)
    result = Spear().attack(gw.double(), gb.double(), 8, layer.weight, layer.bias)
    assert result.diagnostics["zero_tol"] == 1e-6
    assert result.exact and best_match(x, result.inputs)[0].min() > 0.999999
