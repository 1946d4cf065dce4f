"""The sampled-softmax training loss against the full softmax it approximates (float64 references)."""

import pytest
import torch

from datamodules.inversion_spec import InversionSpec
from lti.inverters import EmbeddingInverter, MLPInverter, build_inverter
from lti.loss import InverterLoss, position_loss

V, P, K, D = 40, 3, 24, 8


def _spec():
    torch.manual_seed(0)
    return InversionSpec(num_features=K, num_positions=P, vocab_size=V, embedding=torch.randn(V, D),
                         token_counts=torch.arange(V).double())


@pytest.mark.parametrize("kind", [EmbeddingInverter, MLPInverter])
def test_scoring_a_token_subset_equals_the_full_scores_columns(kind):
    inverter = kind(hidden=16, **({"position_width": 12} if kind is MLPInverter else {})).double()
    inverter.bind(_spec())
    inverter.double()
    features = torch.randn(5, K, dtype=torch.float64)
    hidden = inverter.represent(features)
    tokens = torch.tensor([3, 0, 17, 39])
    assert torch.allclose(inverter.decode(hidden, tokens), inverter(features)[..., tokens], rtol=1e-12, atol=1e-12)


def test_sampled_loss_with_every_token_a_candidate_is_the_full_loss():
    inverter = EmbeddingInverter(hidden=16)
    inverter.bind(_spec())
    inverter.double()
    features = torch.randn(6, K, dtype=torch.float64)
    targets = torch.randint(V, (6, P))
    mask = torch.ones(6, P)
    full, logits = InverterLoss()(inverter, features, targets, mask, training=True)
    assert logits is not None and full.item() == pytest.approx(position_loss(inverter(features), targets, mask).item())
    # With many uniform draws every token is drawn: the candidate set is the whole vocabulary.
    sampled, none = InverterLoss(negatives=5000)(inverter, features, targets, mask, training=True,
                                                 generator=torch.Generator().manual_seed(0))
    assert none is None and sampled.item() == pytest.approx(full.item(), rel=1e-12)
    # With few, the loss is over a subset: never larger than the full softmax loss (fewer competitors).
    few, _ = InverterLoss(negatives=3)(inverter, features, targets, mask, training=True, generator=torch.Generator().manual_seed(0))
    assert few.item() < full.item()
    # Evaluation is always the full softmax.
    evaluated, logits = InverterLoss(negatives=3)(inverter, features, targets, mask, training=False)
    assert logits is not None and evaluated.item() == pytest.approx(full.item())


def test_bad_loss_and_inverter_arguments_are_refused():
    with pytest.raises(ValueError, match="negatives=0"):
        InverterLoss(negatives=0)
    with pytest.raises(ValueError, match="inverter 'cnn' is not known"):
        build_inverter("cnn")


# ---------------------------------------------------------------- m > 1 sequences per update: a set, not a list
M, L = 3, 2  # three sequences of two tokens per update: P = 6 positions


def _multi_sequence_inverter():
    torch.manual_seed(1)
    spec = InversionSpec(num_features=K, num_positions=M * L, vocab_size=V, embedding=torch.randn(V, D),
                         token_counts=torch.arange(V).double())
    inverter = EmbeddingInverter(hidden=16)
    inverter.bind(spec)
    return inverter.double()


def test_matched_loss_is_the_least_loss_over_every_order_of_the_true_sequences():
    from itertools import permutations

    from lti.loss import matched_targets

    updates = 5
    logits = torch.randn(updates, M * L, V, dtype=torch.float64)
    targets = torch.randint(V, (updates, M * L))
    mask = (torch.rand(updates, M * L) > 0.2).double()
    matched = position_loss(logits, *matched_targets(logits, targets, mask, M))
    # Slow reference: every update tries all m! orders of its true sequences and keeps the best.
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), reduction="none")
    total = 0.0
    for u in range(updates):
        best = None
        for order in permutations(range(M)):
            ids = targets[u].view(M, L)[list(order)].reshape(-1)
            weights = mask[u].view(M, L)[list(order)].reshape(-1)
            value = (torch.nn.functional.cross_entropy(logits[u], ids, reduction="none") * weights).sum().item()
            best = value if best is None else min(best, value)
        total += best
    assert matched.item() == pytest.approx(total / mask.sum().item(), rel=1e-12)
    # ... and never above the loss of the order the sequences happened to arrive in.
    assert matched.item() <= (per_token.view(updates, -1) * mask).sum().item() / mask.sum().item() + 1e-12


@pytest.mark.parametrize("negatives", [None, 7])
def test_the_loss_of_a_multi_sequence_update_does_not_depend_on_the_order_of_its_sequences(negatives):
    inverter = _multi_sequence_inverter()
    features = torch.randn(4, K, dtype=torch.float64)
    targets = torch.randint(V, (4, M * L))
    mask = torch.ones(4, M * L)
    shuffled = targets.view(4, M, L)[:, [2, 0, 1]].reshape(4, -1)
    loss = InverterLoss(negatives)
    first, _ = loss(inverter, features, targets, mask, training=True, generator=torch.Generator().manual_seed(0), sequences=M)
    second, _ = loss(inverter, features, shuffled, mask, training=True, generator=torch.Generator().manual_seed(0), sequences=M)
    assert first.item() == pytest.approx(second.item(), rel=1e-12)
    # With one "sequence" of m*L positions the order matters: the matched loss is the one that ignores it.
    ordered, _ = loss(inverter, features, shuffled, mask, training=True, generator=torch.Generator().manual_seed(0))
    assert ordered.item() != pytest.approx(first.item(), rel=1e-6)


def test_predicted_sequences_are_scored_against_the_true_sequences_they_match():
    from datamodules.metrics import match_sequences, reorder, token_accuracy

    targets = torch.tensor([[[1, 2, 3], [4, 5, 6], [7, 8, 9]]])
    preds = targets[:, [1, 2, 0]].clone()
    preds[0, 0, 0] = 0  # one wrong token
    mask = torch.ones_like(targets)
    order = match_sequences(preds, targets, mask)
    assert order.tolist() == [[1, 2, 0]]
    aligned = reorder(targets, order)
    assert token_accuracy(preds.view(1, -1), aligned.view(1, -1)).item() == pytest.approx(8 / 9)


def test_a_module_that_recovers_every_sequence_in_another_order_scores_full_accuracy():
    from types import SimpleNamespace

    from lti.module import InversionModule

    targets = torch.tensor([[5, 6, 7, 1, 2, 3], [9, 9, 8, 4, 4, 0]])  # 2 updates of 2 sequences of 3 tokens
    swapped = targets.view(2, 2, 3)[:, [1, 0]].reshape(2, 6)
    data = SimpleNamespace(samples_per_update=2, seed=0, majority_tokens=torch.zeros(6, dtype=torch.long),
                           decode=lambda ids, mask=None: [" ".join(map(str, row.tolist())) for row in ids])

    class Recovers(torch.nn.Module):  # predicts the true sequences, the update's two in swapped order
        def forward(self, features):
            return torch.nn.functional.one_hot(swapped, V).double() * 10

    class Module(InversionModule):
        data = property(lambda self: data)

    module = Module()
    module.inverter = Recovers()
    module.on_test_epoch_start()
    module._step({"features": torch.zeros(2, K), "input_ids": targets, "attention_mask": torch.ones_like(targets),
                  "index": torch.arange(2)}, "test")
    assert module.test_token_acc.compute().item() == 1.0
    assert [sample["lti_token_acc"] for sample in module.samples] == [1.0, 1.0]
