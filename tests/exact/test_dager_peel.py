"""Peeling (exact.dager.peel): certified sequences subtracted from a FedSGD update, the rest attacked again.

The round logic against a scripted attack; the server's simulation of one sequence
(`UpdatePipeline.sequence_update`) against the client's own batched update; and the whole attack on a
planted blind encoder batch, where peeling certifies what one round cannot.
"""

from __future__ import annotations

import pytest
import torch
from test_dager_position_split import EOS, client_update, encoder, planted

from datamodules.federated import FedAvgClient, FedSGDClient, NoDefense, ParameterSelection, UpdatePipeline
from datamodules.federated.defenses import GaussianNoise
from datamodules.federated.hashing import Hashing
from exact import Dager, find_layers
from exact.dager import EncoderOptions
from exact.dager.peel import peel
from exact.dager.result import DagerResult


def result(seqs, certs, rank1=9, exact=False):
    return DagerResult([list(s) for s in seqs], exact, list(certs), [0.0] * len(seqs),
                       {"rank1": rank1, "mode": "strict+relaxed", "flags": ["1 of 2 sequences are the relaxed best effort"]})


def magnitudes(update):
    """A stand-in for the second-layer singular values: the coordinates of `w` (rank: those not yet explained)."""
    return update["w"].abs()


#: Sequence i's own update puts B at coordinate i (so the client's mean over B sequences is all ones).
def own(seq):
    w = torch.zeros(4)
    w[seq[0]] = 3.0
    return {"w": w}


def test_peel_subtracts_each_certified_sequence_and_certifies_the_batch_when_nothing_is_left():
    calls = []

    def remainder(residual, remaining):
        calls.append((residual["w"].tolist(), remaining))
        return result([(1,), (9,)], [True, False]) if remaining == 2 else result([(2,)], [True])

    first = result([(0,), (7,), (8,)], [True, False, False])
    update = {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])}
    out = peel(remainder, update, 3, first, own, magnitudes, 1e-9)
    assert calls == [([0.0, 1.0, 1.0, 0.0], 2), ([0.0, 0.0, 1.0, 0.0], 1)]
    assert out.sequences == [[0], [1], [2]] and out.sequence_exact == [True, True, True] and out.exact
    assert out.diagnostics["mode"] == "strict" and out.diagnostics["peeled"] == 3 and out.diagnostics["rank2_left"] == 0
    assert [r["batch_size"] for r in out.diagnostics["peel_rounds"]] == [2, 1]
    assert not any("best effort" in f for f in out.diagnostics["flags"])


def test_peel_keeps_the_last_rounds_best_effort_and_never_certifies_it():
    first = result([(0,), (7,), (8,)], [True, False, False])
    out = peel(lambda residual, b: result([(5,), (6,)], [False, False]), {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])},
               3, first, own, magnitudes, 1e-9)
    assert out.sequences == [[0], [5], [6]] and out.sequence_exact == [True, False, False] and not out.exact
    assert "2 of 3 sequences are the relaxed best effort" in out.diagnostics["flags"]


def test_a_certified_sequence_whose_subtraction_keeps_the_rank_loses_its_certificate():
    """(3,) explains nothing of the update (its coordinate is already 0): a wrong certificate, withdrawn
    once (0,) has shown that the simulation matches the client."""
    first = result([(3,), (0,), (8,)], [True, True, False])
    out = peel(lambda residual, b: result([(5,), (6,)], [False, False]), {"w": torch.tensor([1.0, 1.0, 1.0, 0.0])},
               3, first, own, magnitudes, 1e-9)
    assert out.sequences[0] == [0] and out.sequence_exact == [True, False, False]
    assert [3] not in [s for s, c in zip(out.sequences, out.sequence_exact) if c]
    assert any("certificate withdrawn" in f for f in out.diagnostics["flags"])


def test_peel_leaves_the_first_result_when_no_subtraction_lowers_the_rank():
    """The self-check: an update that is not the mean of its sequences' own updates."""
    first = result([(0,), (7,)], [True, False])
    out = peel(lambda residual, b: pytest.fail("attacked"), {"w": torch.tensor([1.0, 1.0, 0.0, 0.0])}, 2, first,
               lambda seq: {"w": torch.tensor([0.0, 0.0, 5.0, 0.0])}, magnitudes, 1e-9)
    assert out is first and out.sequence_exact == [True, False]
    assert any("no certified sequence lowered" in f for f in out.diagnostics["flags"])


def test_peel_does_nothing_without_a_simulation_or_a_certified_sequence():
    first = result([(0,), (7,)], [True, False])
    assert peel(lambda r, b: pytest.fail("attacked"), {"w": torch.ones(4)}, 2, first, lambda seq: None, magnitudes, 1e-9) is first
    assert any("cannot be simulated" in f for f in first.diagnostics["flags"])
    none = result([(6,), (7,)], [False, False])
    assert peel(lambda r, b: pytest.fail("attacked"), {"w": torch.ones(4)}, 2, none, own, magnitudes, 1e-9) is none


def test_sequence_updates_average_to_the_clients_update():
    """Reference: the client's own batched update of padded sequences equals the mean of the simulated
    one-sequence updates (unpadded)."""
    torch.manual_seed(0)
    target = encoder(64)
    ids, mask = planted([9, 7, 6], seed=1, words=20)
    observed = ParameterSelection(include=find_layers(target).observed_names())
    pipeline = UpdatePipeline(target, FedSGDClient(mode="eval", samples_per_update=3), NoDefense(), observed,
                              hashing=Hashing(bins=1))
    batch = client_update(target, ids, mask)
    mean = None
    for row, m in zip(ids, mask):
        own = pipeline.sequence_update(row[m.bool()].tolist())
        mean = own if mean is None else {n: mean[n] + own[n] for n in own}
    assert set(mean) == set(batch)
    for name in batch:
        torch.testing.assert_close(mean[name] / 3, batch[name], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("pipeline_args", [
    dict(client=FedSGDClient(mode="train", samples_per_update=2)),
    dict(client=FedSGDClient(mode="eval", samples_per_update=2), defense=GaussianNoise(sigma=0.01)),
    dict(client=FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=1e-3)),
])
def test_sequence_update_is_none_where_the_server_cannot_simulate_the_client(pipeline_args):
    target = encoder(64)
    pipeline = UpdatePipeline(target, hashing=Hashing(bins=1), **pipeline_args)
    assert pipeline.sequence_update([1, 5, 6, EOS]) is None


def test_peeling_certifies_what_one_round_of_a_blind_encoder_search_cannot():
    """A planted blind batch whose first round certifies only some sentences: with the client simulated,
    the rounds certify them all, each certificate true; without it, the attack stays short (today's code)."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([12, 11, 10, 9], seed=3, words=30)
    truth = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    update = client_update(target, ids, mask)
    observed = ParameterSelection(include=find_layers(target).observed_names())
    pipeline = UpdatePipeline(target, FedSGDClient(mode="eval", samples_per_update=len(truth)), NoDefense(), observed,
                              hashing=Hashing(bins=1))
    attack = Dager(encoder=EncoderOptions(eos_token_id=EOS, token_budget=200_000))
    once = attack.attack(target, update, batch_size=len(truth), max_length=ids.shape[1])
    assert 0 < sum(once.sequence_exact) < len(truth)
    peeled = attack.attack(target, update, batch_size=len(truth), max_length=ids.shape[1],
                           sequence_update=pipeline.sequence_update)
    assert sum(peeled.sequence_exact) > sum(once.sequence_exact)
    for seq, certified in zip(peeled.sequences, peeled.sequence_exact):
        assert not certified or seq in truth
    assert peeled.exact and sorted(peeled.sequences) == sorted(truth)  # this batch: every sentence, nothing left
    assert peeled.diagnostics["rank2_left"] == 0
    ranks = [r["rank2_before"] for r in peeled.diagnostics["peel_rounds"]]
    assert ranks == sorted(ranks, reverse=True)
    off = attack.with_options(extensions={"peel": False}).attack(target, update, batch_size=len(truth), max_length=ids.shape[1],
                                                 sequence_update=pipeline.sequence_update)
    assert off.sequence_exact == once.sequence_exact and "peel_rounds" not in off.diagnostics


def test_peeling_withdraws_a_false_certificate_of_a_small_encoder():
    """On this planted batch the span tests certify a permutation of a true sentence (a 128-wide
    two-layer encoder); its subtraction does not lower the second-layer rank, so it loses its certificate,
    and every certificate left is true."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([12, 11, 10, 9, 8, 7], seed=1, words=25)
    truth = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    update = client_update(target, ids, mask)
    pipeline = UpdatePipeline(target, FedSGDClient(mode="eval", samples_per_update=6), NoDefense(),
                              ParameterSelection(include=find_layers(target).observed_names()), hashing=Hashing(bins=1))
    attack = Dager(encoder=EncoderOptions(eos_token_id=EOS, token_budget=200_000))
    once = attack.attack(target, update, batch_size=6, max_length=ids.shape[1])
    assert any(c and s not in truth for s, c in zip(once.sequences, once.sequence_exact))  # today's false claim
    peeled = attack.attack(target, update, batch_size=6, max_length=ids.shape[1], sequence_update=pipeline.sequence_update)
    assert any(peeled.sequence_exact)
    assert all(s in truth for s, c in zip(peeled.sequences, peeled.sequence_exact) if c)
    assert any("certificate withdrawn" in f for f in peeled.diagnostics["flags"])
