"""The workbench's defenses as Flower client mods: what reaches the strategy is the global weights minus the
defended weight change of what the client's own code returned (checked against the defense applied by hand)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("flwr")

from test_audit import federate, tiny_pipeline  # noqa: E402

from datamodules.federated import DPSGD, GaussianNoise, Sign, TopKPruning  # noqa: E402
from lti.audit.mods import defense_mod  # noqa: E402


@pytest.mark.parametrize("defense", [Sign(), TopKPruning(0.9)], ids=["sign", "prune"])
def test_a_deterministic_defense_mod_sends_the_defended_weight_change(defense):
    sent, seen, globals_ = federate(tiny_pipeline(), rounds=1, clients=2, mods=[defense_mod(defense)])
    for (client, round_), reply in seen.items():
        global_state = globals_[round_].to_torch_state_dict()
        own = sent[(client, round_)].to_torch_state_dict()  # what the client's code returned, before the mod
        delta = torch.cat([(global_state[n].double() - own[n].double()).flatten() for n in own])
        expected = defense.on_delta(delta[None].float())[0].double()
        got_state = reply.to_torch_state_dict()
        got = torch.cat([(global_state[n].double() - got_state[n].double()).flatten() for n in own])
        assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(got, delta, rtol=1e-3, atol=0)  # the mod changed what was sent


def test_noise_is_drawn_per_client_and_repeats_on_a_rerun():
    runs = [federate(tiny_pipeline(), rounds=1, clients=2, mods=[defense_mod(GaussianNoise(0.01))])[1] for _ in range(2)]
    first = {key: reply.to_torch_state_dict() for key, reply in runs[0].items()}
    again = {key: reply.to_torch_state_dict() for key, reply in runs[1].items()}
    name = next(iter(first[(0, 1)]))
    assert torch.equal(first[(0, 1)][name], again[(0, 1)][name])
    noise0 = first[(0, 1)][name] - first[(1, 1)][name]
    assert noise0.abs().max() > 1e-3  # different clients, different draws (and different data)


def test_dp_sgd_is_refused_as_a_mod():
    with pytest.raises(ValueError, match="every local step"):
        defense_mod(DPSGD())
