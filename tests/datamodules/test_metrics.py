import pytest
import torch
from rouge_score import rouge_scorer

from datamodules.metrics import RougeScores, ScoreTotals, TokenAccuracy, rouge_f, score_batch, token_accuracy
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


def test_score_totals_pool_tokens_and_average_sequences_over_updates():
    """Two updates (2 and 1 sequences, the last masked to its first two tokens): token accuracy pooled over
    tokens, ROUGE and exact matches averaged over the three sequences, counted here by hand."""
    decode = lambda t: " ".join(f"w{i}" for i in t)  # noqa: E731
    first = score_batch([[1, 2, 3], [4, 5, 6]], torch.tensor([[1, 2, 3], [4, 9, 9]]), None, decode)
    second = score_batch([[7, 8, 0]], torch.tensor([[7, 0, 0]]), torch.tensor([[1, 1, 0]]), decode)
    totals = ScoreTotals()
    totals.add(first)
    totals.add(second)
    means = totals.means()
    assert totals.sequences == 3 and totals.tokens == 8 and totals.correct == 5
    assert means["token_acc"] == pytest.approx(5 / 8)
    assert means["exact_fraction"] == pytest.approx(1 / 3)  # only [1, 2, 3] is whole
    per_sequence = [rouge_f(decode(p), decode(r))["rouge1"] for p, r in
                    [([1, 2, 3], [1, 2, 3]), ([4, 5, 6], [4, 9, 9]), ([7, 8, 0], [7, 0])]]
    assert means["rouge1"] == pytest.approx(sum(per_sequence) / 3)
    assert ScoreTotals().means()["token_acc"] == 0.0  # nothing scored: no division by zero
