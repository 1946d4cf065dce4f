"""SPEAR guided by a prior (the server's auxiliary inputs): planted batches the paper's random sampling
cannot solve within a tiny budget, the deflation sweep, and priors that must not mislead."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from exact.spear import PriorGuidance, Sampling, SearchBudget, Spear


def clustered_layer(b: int, kind: str = "clusters", n: int = 50, m: int = 100, seed: int = 5, prior_size: int = 600):
    """Linear(n, m) + ReLU + head with an MSE loss on b inputs in [0, 1]; the prior is drawn from the same
    distribution as the batch (never the batch itself): around 30 prototypes ("clusters", like images of
    a few classes) or uniform."""
    gen = torch.Generator().manual_seed(seed)
    layer, head = nn.Linear(n, m).double(), nn.Linear(m, 10).double()
    with torch.no_grad():
        for p in (*layer.parameters(), *head.parameters()):
            p.uniform_(-1 / math.sqrt(p.shape[-1]), 1 / math.sqrt(p.shape[-1]), generator=gen)
    prototypes = torch.rand(30, n, generator=gen, dtype=torch.float64)

    def draw(count):
        if kind == "uniform":
            return torch.rand(count, n, generator=gen, dtype=torch.float64)
        which = torch.randint(0, 30, (count,), generator=gen)
        return (prototypes[which] + 0.1 * torch.randn(count, n, generator=gen, dtype=torch.float64)).clamp(0, 1)

    x, prior = draw(b), draw(prior_size)
    target = torch.randn(b, 10, generator=gen, dtype=torch.float64)
    loss = ((head(torch.relu(layer(x))) - target) ** 2).sum(1).mean()
    grad_w, grad_b = torch.autograd.grad(loss, [layer.weight, layer.bias])
    return x, prior, layer, grad_w, grad_b


def rows_matched(x: torch.Tensor, recovered: torch.Tensor) -> torch.Tensor:
    cos = nn.functional.normalize(x, dim=1) @ nn.functional.normalize(recovered.double(), dim=1).T
    return cos.max(dim=1).values


def test_prior_recovers_a_batch_of_20_that_one_random_draw_cannot():
    x, prior, layer, gw, gb = clustered_layer(b=20)
    blind = Spear(SearchBudget(max_samples=1)).attack(gw, gb, batch_size=20, weight=layer.weight, bias=layer.bias)
    assert not blind.exact and "budget" in blind.reason
    guided = Spear(SearchBudget(max_samples=1)).attack(gw, gb, batch_size=20, weight=layer.weight, bias=layer.bias, prior=prior)
    assert guided.exact and guided.agreement == 1.0
    assert guided.diagnostics["prior_guesses"] > 0 and guided.diagnostics["samples"] == 0
    assert rows_matched(x, guided.inputs).min() > 1 - 1e-9
    # Exact means exact: each true input is reproduced to float64 rounding.
    cos = nn.functional.normalize(x, dim=1) @ nn.functional.normalize(guided.inputs, dim=1).T
    assert torch.allclose(guided.inputs[cos.argmax(dim=1)], x, atol=1e-9)


def test_the_sweep_finds_columns_no_prior_input_points_to():
    """Uniform inputs make a weak prior: the first rounds leave a few columns; their p_j lie in the
    complement of the found directions (P Q = I), which the sweep covers."""
    x, prior, layer, gw, gb = clustered_layer(b=12, kind="uniform")
    without = Spear(SearchBudget(max_samples=1), guidance=PriorGuidance(sweep_dims=0)).attack(gw, gb, batch_size=12, weight=layer.weight, bias=layer.bias,
                                                        prior=prior)
    assert not without.exact
    with_sweep = Spear(SearchBudget(max_samples=1)).attack(gw, gb, batch_size=12, weight=layer.weight, bias=layer.bias, prior=prior)
    assert with_sweep.exact and rows_matched(x, with_sweep.inputs).min() > 1 - 1e-9


def test_a_useless_prior_falls_back_to_sampling():
    """All-zero prior inputs name the same neurons for every guess; random sampling must still finish."""
    x, prior, layer, gw, gb = clustered_layer(b=6, m=80, n=40, seed=1)
    zeros = torch.zeros_like(prior)
    stuck = Spear(SearchBudget(max_samples=1)).attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias, prior=zeros)
    assert not stuck.exact and stuck.diagnostics["prior_guesses"] > 0
    result = Spear().attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias, prior=zeros)
    assert result.exact and result.diagnostics["samples"] > 0
    assert rows_matched(x, result.inputs).min() > 1 - 1e-9


def test_prior_needs_the_layer_weights_and_matching_features():
    x, prior, layer, gw, gb = clustered_layer(b=6, m=80, n=40, seed=1)
    # Without weight and bias there is no pre-activation to rank neurons by: the prior is not used.
    result = Spear().attack(gw, gb, batch_size=6, prior=prior)
    assert "prior_guesses" not in result.diagnostics
    with pytest.raises(ValueError, match="prior"):
        Spear().attack(gw, gb, batch_size=6, weight=layer.weight, bias=layer.bias, prior=prior[:, :7])
    for bad in ({"rows": ()}, {"rows": (0.0,)}, {"rounds": -1}, {"max_inputs": 0}, {"sweep_dims": -1}):
        with pytest.raises(ValueError):
            PriorGuidance(**bad)


def test_max_prior_takes_a_seeded_subset():
    x, prior, layer, gw, gb = clustered_layer(b=8, m=80, n=40, seed=2, prior_size=400)
    spear = Spear(SearchBudget(max_samples=1), Sampling(seed=3),
                  guidance=PriorGuidance(rounds=1, max_inputs=100, sweep_dims=0))
    first = spear.attack(gw, gb, batch_size=8, weight=layer.weight, bias=layer.bias, prior=prior)
    again = spear.attack(gw, gb, batch_size=8, weight=layer.weight, bias=layer.bias, prior=prior)
    # Same subset, same search: the same reconstruction (to float64 rounding: threaded BLAS reductions
    # may differ in the last bits from run to run).
    assert first.exact == again.exact and torch.allclose(first.inputs, again.inputs, rtol=0, atol=1e-12)
    # One round of 100 guesses per neuron count k (two k's by default; it may stop after the first).
    assert first.diagnostics["prior_guesses"] == again.diagnostics["prior_guesses"] in (100, 200)
