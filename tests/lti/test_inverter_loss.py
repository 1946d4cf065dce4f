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
