"""The batched search's learned scorer: examples collected from a simulated update, the conditional-logit fit
against a per-example reference, and the weights file."""

from __future__ import annotations

import pytest
import torch
from test_batched import tiny_batch  # noqa: E402  (the tiny LoRA Llama of the batched tests)

from exact.batched.scorer import (
    Example,
    ScorerWeights,
    accuracy_at_one,
    examples_by_state,
    extension_examples,
    fit_weights,
    load_scorers,
    save_scorers,
)
from exact.batched.sites import capture_site_inputs


def synthetic(count: int, seed: int) -> list[Example]:
    """Two sites: the second tells the true candidate apart, the first is noise; the prior helps a little."""
    generator = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(count):
        terms = torch.randn(20, 2, generator=generator, dtype=torch.float64)
        prior = torch.randn(20, generator=generator, dtype=torch.float64)
        true = int(torch.randint(0, 20, (1,), generator=generator))
        terms[true, 1] += 2.5
        prior[true] += 0.5
        examples.append(Example(terms, prior, true))
    return examples


def per_example_loss(examples: list[Example], weights: torch.Tensor) -> torch.Tensor:
    """The slow reference: each example's log-softmax in a loop."""
    total = 0
    for e in examples:
        logits = e.terms @ weights[:-1] + weights[-1] * e.prior
        total = total - logits.log_softmax(0)[e.true]
    return total / len(examples)


def test_the_fit_moves_weight_to_the_informative_site_and_is_a_stationary_point_of_the_reference_loss():
    train, held_out = synthetic(300, 0), synthetic(200, 1)
    start = ScorerWeights.hand_set(2, 0.5)
    l2 = 1e-3
    fitted = fit_weights(train, start, l2=l2)
    assert float(fitted.sites[1]) > 3 * abs(float(fitted.sites[0]))
    assert accuracy_at_one(held_out, fitted) > accuracy_at_one(held_out, start) + 0.1
    # The padded, masked loss it minimised is the per-example loop's: its gradient vanishes there.
    w = torch.cat([fitted.sites, torch.tensor([fitted.lm], dtype=torch.float64)]).requires_grad_(True)
    origin = torch.tensor([1.0, 1.0, 0.5], dtype=torch.float64)
    (per_example_loss(train, w) + l2 * (w - origin).pow(2).sum()).backward()
    assert float(w.grad.abs().max()) < 1e-4


def test_examples_of_a_tiny_update_hold_the_true_extension_and_the_deflated_terms_of_a_recompute():
    t = tiny_batch(12)
    pipe, ids, sites, bag, scorer = t.pipe, t.ids, t.sites, t.bag, t.scorer
    examples = extension_examples(pipe.target, sites, scorer, bag, ids)
    assert len(examples) == 2 * 3  # positions 1..3 of both sequences (position 4 is a label)
    assert all(bag[e.true] == int(ids[n % 2, 1 + n // 2]) for n, e in enumerate(examples))
    assert accuracy_at_one(examples, ScorerWeights.hand_set(len(sites), 0.0)) == 1.0  # 8 tokens < 16 rows: exact
    # Reference for the last example (sequence 1, position 3): candidates run whole, known inputs recomputed.
    lm = pipe.target.model
    whole = torch.cat([ids[1, :3].repeat(len(bag), 1), torch.tensor(bag)[:, None]], dim=1)
    hidden = [h[:, -1] for h in capture_site_inputs(pipe.target, sites, lambda: lm(whole))]
    truth = capture_site_inputs(pipe.target, sites, lambda: lm(ids))
    known = [torch.cat([h[:, :3].reshape(-1, h.shape[-1]), h[:1, 3]]) for h in truth]
    reference = scorer.terms(hidden, scorer.bases(known))
    assert torch.allclose(examples[-1].terms, reference, atol=1e-3)
    # A refinement pass's state knows sequence 0 whole and sequence 1's prefix: the same candidates, deflated so.
    refining = extension_examples(pipe.target, sites, scorer, bag, ids, state="refine")
    assert [e.true for e in refining] == [e.true for e in examples]
    known = [torch.cat([h[0, :-1], h[1, :3]]) for h in truth]  # the last position is a label, never an input
    assert torch.allclose(refining[-1].terms, scorer.terms(hidden, scorer.bases(known)), atol=1e-3)
    both = examples_by_state(pipe.target, sites, scorer, bag, ids)  # one forward pass for both states
    assert all(torch.equal(a.terms, b.terms) for a, b in zip(both["search"], examples))
    assert all(torch.equal(a.terms, b.terms) for a, b in zip(both["refine"], refining))
    with pytest.raises(ValueError, match="state='guess' is not one of"):
        extension_examples(pipe.target, sites, scorer, bag, ids, state="guess")


def test_the_weights_file_round_trips_and_refuses_another_model_a_wrong_count_and_damage(tmp_path):
    path = tmp_path / "scorer.safetensors"
    weights = ScorerWeights(torch.tensor([1.5, -0.25], dtype=torch.float64), 0.75, "fingerprint-a")
    weights.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["scorer.safetensors"]
    again = ScorerWeights.load(path, "fingerprint-a", 2)
    assert torch.equal(again.sites, weights.sites) and again.lm == 0.75
    with pytest.raises(ValueError, match="another model"):
        ScorerWeights.load(path, "fingerprint-b")
    with pytest.raises(ValueError, match="hold 2 sites; the model has 3"):
        ScorerWeights.load(path, "fingerprint-a", 3)
    path.write_bytes(b"damaged")
    with pytest.raises(ValueError, match="unreadable"):
        ScorerWeights.load(path)
    with pytest.raises(ValueError, match="no examples"):
        fit_weights([], weights)


def test_a_file_of_several_batch_sizes_gives_each_b_the_weights_fitted_nearest_it(tmp_path):
    path = tmp_path / "scorer.safetensors"
    small = ScorerWeights(torch.tensor([1.0, 2.0], dtype=torch.float64), 0.5, "fingerprint-a", (4, 8))
    large = ScorerWeights(torch.tensor([3.0, -1.0], dtype=torch.float64), 0.25, "fingerprint-a", (16,))
    save_scorers(path, [small, large])
    assert [p.name for p in tmp_path.iterdir()] == ["scorer.safetensors"]
    assert [g.batch_sizes for g in load_scorers(path, "fingerprint-a", 2)] == [(4, 8), (16,)]
    # nearest in log2 B: 11 is nearer 8 (0.46) than 16 (0.54), 12 nearer 16; below and above the ends, the end
    for batch, expected in {1: small, 4: small, 8: small, 11: small, 12: large, 16: large, 64: large}.items():
        chosen = ScorerWeights.load(path, "fingerprint-a", 2, batch_size=batch)
        assert torch.equal(chosen.sites, expected.sites) and chosen.lm == expected.lm, batch
    with pytest.raises(ValueError, match=r"one set per batch size \(B = 4/8, B = 16\); name the batch size"):
        ScorerWeights.load(path, "fingerprint-a", 2)
    with pytest.raises(ValueError, match="one model"):
        save_scorers(path, [small, ScorerWeights(large.sites, 0.25, "fingerprint-b", (16,))])
    with pytest.raises(ValueError, match="for any B cannot share a file"):
        save_scorers(path, [small, ScorerWeights(large.sites, 0.25, "fingerprint-a")])
    assert ScorerWeights.load(path, "fingerprint-a", 2, batch_size=16).lm == 0.25  # the refused saves changed nothing


def test_a_damaged_version_2_file_is_refused_in_one_line(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "scorer.safetensors"
    one = {"sites.0": torch.ones(2, dtype=torch.float64), "lm.0": torch.tensor([0.5], dtype=torch.float64)}
    cases = [({}, "[]", "hold no weights"), (one, "[4]", "not a batched-scorer file"),
             (one, "[[4], [8]]", "not a batched-scorer file"),
             ({**one, "lm.0": torch.zeros(0, dtype=torch.float64)}, "[[4]]", "not a batched-scorer file"),
             ({**one, "extra": torch.ones(1)}, "[[4]]", "not a batched-scorer file"),
             ({**one, "sites.1": torch.ones(2, dtype=torch.float64), "lm.1": torch.tensor([0.5], dtype=torch.float64)},
              "[[4], []]", "mix a set for any B")]
    for tensors, batch_sizes, message in cases:
        save_file(tensors, str(path), metadata={"format": "lti-batched-scorer/2", "fingerprint": "f",
                                                "batch_sizes": batch_sizes})
        with pytest.raises(ValueError, match=message) as error:
            ScorerWeights.load(path, "f", 2, batch_size=4)
        assert "\n" not in str(error.value), batch_sizes


def test_a_version_1_file_is_read_as_weights_for_any_batch_size(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "scorer.safetensors"
    save_file({"sites": torch.tensor([1.5, -0.25], dtype=torch.float64), "lm": torch.tensor([0.75], dtype=torch.float64)},
              str(path), metadata={"format": "lti-batched-scorer/1", "fingerprint": "fingerprint-a"})
    for batch in (None, 1, 16):
        weights = ScorerWeights.load(path, "fingerprint-a", 2, batch_size=batch)
        assert weights.sites.tolist() == [1.5, -0.25] and weights.lm == 0.75 and weights.batch_sizes == ()
    save_file({"sites": torch.ones(2, dtype=torch.float64)}, str(path), metadata={"format": "lti-batched-scorer/1"})
    with pytest.raises(ValueError, match="not a batched-scorer file"):
        ScorerWeights.load(path)
