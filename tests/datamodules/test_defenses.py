import math

import pytest
import torch

from datamodules.federated import DEFENSES, DPSGD, Defense, GaussianNoise, NoDefense, Sign, TopKPruning
from datamodules.federated.defenses import Compose


def test_registry_lists_all_defenses_and_rejects_unknown_names():
    assert {"none", "sign", "prune", "gaussian", "dpsgd", "compose"} <= set(DEFENSES.names())
    assert isinstance(Defense.create("sign"), Sign)
    with pytest.raises(ValueError, match="unknown defense 'bogus'; allowed: "):
        Defense.create("bogus")


def test_none_and_sign_act_on_the_mean_update():
    g = torch.randn(3, 2, 10)
    torch.testing.assert_close(NoDefense()(g), g.mean(1))
    torch.testing.assert_close(Sign()(g), torch.sign(g.mean(1)))


@pytest.mark.parametrize("alpha", [0.0, 0.5, 0.9, 0.99])
def test_pruning_keeps_the_top_fraction_over_the_whole_vector(alpha):
    update = torch.randn(4, 1, 1000)
    out = TopKPruning(alpha)(update)
    keep = math.ceil((1 - alpha) * 1000 - 1e-9)
    for row_in, row_out in zip(update[:, 0], out):
        order = row_in.abs().argsort(descending=True)  # slow reference: sort everything
        expected = torch.zeros_like(row_in)
        expected[order[:keep]] = row_in[order[:keep]]
        torch.testing.assert_close(row_out, expected)
    assert ((out != 0).sum(1) == keep).all()


@pytest.mark.parametrize("alpha", [-0.1, 1.0, 1.5])
def test_pruning_rejects_fractions_outside_0_1(alpha):
    with pytest.raises(ValueError, match=r"fraction_removed=.* outside \[0, 1\)"):
        TopKPruning(alpha)


def test_gaussian_noise_has_the_requested_std():
    g = torch.zeros(8, 1, 20000)
    noisy = GaussianNoise(0.01)(g, torch.Generator().manual_seed(0))
    assert abs(noisy.std().item() - 0.01) < 3e-4
    assert abs(noisy.mean().item()) < 3e-4


@pytest.mark.parametrize("sigma", [-1.0, float("nan"), float("inf")])
def test_gaussian_noise_rejects_bad_sigma(sigma):
    with pytest.raises(ValueError, match="sigma"):
        GaussianNoise(sigma)


def test_dpsgd_clips_every_sequence_then_adds_noise_to_the_sum():
    g = torch.randn(2, 3, 50) * 10  # norms far above C
    out = DPSGD(clip_norm=1.0, noise_multiplier=0.0)(g)
    clipped = g / g.norm(dim=2, keepdim=True)
    torch.testing.assert_close(out, clipped.mean(1))
    small = torch.full((1, 1, 4), 0.1)  # below C: untouched
    torch.testing.assert_close(DPSGD(1.0, 0.0)(small), small[:, 0])
    noise = DPSGD(clip_norm=2.0, noise_multiplier=0.5)(torch.zeros(4, 2, 20000), torch.Generator().manual_seed(1))
    # N(0, (sigma C)^2) on the sum of m=2 clipped gradients, divided by m
    assert abs(noise.std().item() - 0.5 * 2.0 / 2) < 0.01


@pytest.mark.parametrize("kwargs", [{"clip_norm": 0.0}, {"clip_norm": -1.0}, {"noise_multiplier": -0.1}])
def test_dpsgd_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError, match="DP-SGD"):
        DPSGD(**kwargs)


def test_compose_applies_in_order_and_requires_dpsgd_first():
    g = torch.randn(2, 1, 100)
    out = Compose([TopKPruning(0.9), Sign()])(g)
    assert ((out != 0).sum(1) == 10).all() and set(out.unique().tolist()) <= {-1.0, 0.0, 1.0}
    with pytest.raises(ValueError, match="first"):
        Compose([Sign(), DPSGD()])


@pytest.mark.parametrize("kwargs, message", [
    ({"target_delta": 0.0}, r"DP-SGD target_delta=0.0 must be in \(0, 1\)"),
    ({"accountant": "moments"}, "DP-SGD accountant 'moments' is not allowed; use one of rdp, prv, gdp"),
])
def test_dpsgd_rejects_bad_accounting_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DPSGD(**kwargs)


@pytest.mark.parametrize("defense", [NoDefense(), Sign(), TopKPruning(0.5), GaussianNoise(0.1)])
def test_multi_step_hooks_average_each_step_and_defend_the_sent_delta(defense):
    """FedAvg convention: only DP-SGD acts per local step; the others transform the delta sent."""
    per_example = torch.randn(3, 4, 50)
    assert not defense.acts_per_step
    torch.testing.assert_close(defense.local_step(per_example), per_example.mean(1))
    delta = torch.randn(3, 50)
    torch.testing.assert_close(defense.on_delta(delta, torch.Generator().manual_seed(0)),
                               defense.transform(delta, torch.Generator().manual_seed(0)))


def test_dpsgd_acts_per_step_and_leaves_the_delta_alone():
    dp = DPSGD(clip_norm=1.0, noise_multiplier=0.0)
    per_example = torch.randn(2, 3, 40) * 10
    assert dp.acts_per_step
    torch.testing.assert_close(dp.local_step(per_example), dp(per_example))
    delta = torch.randn(2, 40)
    assert torch.equal(dp.on_delta(delta), delta)


# What each defense declares about itself (the observation cache and a server simulating a client read it).
PROPERTIES = [  # defense, deterministic, linear, split_noise() as (describe of the deterministic part, std) or None
    (NoDefense(), True, True, ({"name": "none"}, 0.0)),
    (Sign(), True, False, ({"name": "sign"}, 0.0)),
    (TopKPruning(0.9), True, False, ({"name": "prune", "fraction_removed": 0.9}, 0.0)),
    (GaussianNoise(0.05), False, False, ({"name": "none"}, 0.05)),
    (GaussianNoise(0.0), False, False, ({"name": "none"}, 0.0)),  # still a draw, though a zero one
    (DPSGD(), False, False, None),
    (Compose([TopKPruning(0.9), Sign()]), True, False,
     ({"name": "compose", "defenses": [{"name": "prune", "fraction_removed": 0.9}, {"name": "sign"}]}, 0.0)),
    (Compose([NoDefense(), NoDefense()]), True, True, ({"name": "compose", "defenses": [{"name": "none"}] * 2}, 0.0)),
    (Compose([TopKPruning(0.9), GaussianNoise(0.1)]), False, False,
     ({"name": "compose", "defenses": [{"name": "prune", "fraction_removed": 0.9}, {"name": "none"}]}, 0.1)),
    (Compose([GaussianNoise(0.1), Sign()]), False, False, None),  # the sign of noise is not additive noise
    (Compose([DPSGD(), TopKPruning(0.9)]), False, False, None),
]


@pytest.mark.parametrize("defense, deterministic, linear, split", PROPERTIES, ids=lambda x: repr(x)[:40])
def test_each_defense_declares_what_reusing_its_output_needs(defense, deterministic, linear, split):
    assert defense.deterministic is deterministic and defense.linear is linear
    answer = defense.split_noise()
    assert (None if answer is None else (answer[0].describe(), answer[1])) == split
    g = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(0))
    if deterministic:  # no draws: the same output whatever the generator
        first = defense(g, torch.Generator().manual_seed(1))
        torch.testing.assert_close(defense(g, torch.Generator().manual_seed(2)), first, rtol=0, atol=0)
    if linear:  # the defended mean is the mean of the defended updates, and scales commute
        per_sample = torch.stack([defense(g[:, i : i + 1]) for i in range(2)], dim=1)
        torch.testing.assert_close(defense(g), per_sample.mean(dim=1))
        torch.testing.assert_close(defense(3.0 * g), 3.0 * defense(g))
    if split is not None:  # the deterministic part, then N(0, std^2) per coordinate: the same distribution
        part, std = answer
        big = torch.randn(1, 1, 20000, generator=torch.Generator().manual_seed(3))
        residual = defense(big, torch.Generator().manual_seed(4)) - part(big)
        assert abs(residual.std().item() - std) < 0.02 * max(std, 1e-3) + 1e-6
