import pytest
import torch
from rouge_score import rouge_scorer

from datamodules.metrics import RougeScores, TokenAccuracy, rouge_f, token_accuracy
from lti.loss import position_loss


def test_token_accuracy_matches_a_manual_count_with_and_without_mask():
    preds = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    target = torch.tensor([[1, 0, 3, 0], [5, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    metric = TokenAccuracy()
    metric.update(preds, target)
    assert metric.compute().item() == pytest.approx(4 / 8)
    masked = TokenAccuracy()
    masked.update(preds, target, mask)
    assert masked.compute().item() == pytest.approx(4 / 6)
    assert token_accuracy(preds, target, mask).tolist() == pytest.approx([0.5, 1.0])


def test_rouge_matches_rouge_score_with_stemmer():
    pairs = [("the cats were running home", "the cat runs home"), ("completely different", "nothing shared here")]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    metric = RougeScores()
    metric.update([p for p, _ in pairs], [r for _, r in pairs])
    result = metric.compute()
    for name in ("rouge1", "rouge2", "rougeL"):
        expected = sum(scorer.score(r, p)[name].fmeasure for p, r in pairs) / len(pairs)
        assert result[name].item() == pytest.approx(expected, abs=1e-6)
    assert rouge_f("the cat runs", "the cat runs")["rouge2"] == pytest.approx(1.0)


def test_rouge_accepts_precomputed_scores():
    scores = [rouge_f("a b c", "a b d"), rouge_f("x", "y")]
    a, b = RougeScores(), RougeScores()
    a.update(scores=scores)
    b.update(["a b c", "x"], ["a b d", "y"])
    assert a.compute()["rouge1"].item() == pytest.approx(b.compute()["rouge1"].item())
    with pytest.raises(ValueError):
        RougeScores().update(["a"], ["a", "b"])


def test_position_loss_matches_a_per_position_loop_in_float64():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    target = torch.randint(0, 11, (3, 5))
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float64)
    total, count = 0.0, 0.0
    for u in range(3):
        for p in range(5):
            if mask[u, p]:
                total += -torch.log_softmax(logits[u, p], dim=0)[target[u, p]].item()
                count += 1
    assert position_loss(logits, target, mask).item() == pytest.approx(total / count, rel=1e-12)
    # Nothing unmasked: zero, not NaN.
    assert position_loss(logits, target, torch.zeros_like(mask)).item() == 0.0
