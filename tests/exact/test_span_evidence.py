"""The hybrid's exact evidence (`exact.span_evidence`): the batched fast path against DAGER's per-update
reference (`token_distances`, float64), what the scores say about the batch's tokens, and bad input."""

import pytest
import torch

from datamodules.federated import FedSGDClient, GaussianNoise, ParameterSelection, UpdatePipeline
from datamodules.targets import HFCausalLM, Transformer3
from exact.dager.span import token_distances
from exact.span_evidence import EvidenceOptions, SpanEvidence

L = 4


def _updates(target, m, defense=None, updates=3, observed=None, seed=0):
    torch.manual_seed(seed)
    pipeline = UpdatePipeline(target, FedSGDClient(mode="train", samples_per_update=m), defense, observed)
    ids = torch.randint(target.vocab_size, (updates, m, L))
    observed_updates = pipeline({"input_ids": ids}, keep_update=True)
    return pipeline, ids, pipeline.split(observed_updates.update)


def _target():
    return Transformer3(vocab_size=300, hidden_size=32, num_heads=2, ffn_size=32, num_layers=2, max_positions=8)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_batched_distances_match_the_per_update_float64_reference(m):
    target = _target()
    pipeline, ids, update = _updates(target, m)
    evidence = SpanEvidence(target, list(pipeline.names), m * L, L)
    fast = evidence.distances(update)
    assert fast.shape == (3, L, 300)
    for u, basis in enumerate(evidence.spans(update)):
        reference = token_distances(basis, evidence.inputs, list(range(L)))
        assert torch.allclose(fast[u].double(), reference, atol=2e-4), float((fast[u].double() - reference).abs().max())


def test_without_a_defense_the_batch_tokens_score_far_above_every_other_token():
    target = _target()
    m = 2  # 8 tokens < d = 32: the span test is exact
    pipeline, ids, update = _updates(target, m)
    scores = SpanEvidence(target, list(pipeline.names), m * L, L)(update)  # (U, L, V)
    for u in range(ids.shape[0]):
        for p in range(L):
            present = set(ids[u, :, p].tolist())
            true = scores[u, p, sorted(present)]
            others = scores[u, p, [t for t in range(300) if t not in present]]
            assert float(true.min()) > float(others.max()) + 3.0


def test_under_noise_the_rank_is_capped_and_the_scores_still_rank_the_batch_tokens_high():
    target = _target()
    m = 2
    pipeline, ids, update = _updates(target, m, defense=GaussianNoise(sigma=1e-4))
    evidence = SpanEvidence(target, list(pipeline.names), m * L, L)
    bases = evidence.spans(update)
    assert all(b.numerical_rank == 32 and b.rank == m * L for b in bases)  # noise fills the span; capped at m * L
    scores = evidence(update)
    true = scores.gather(2, ids.transpose(1, 2))  # (U, L, m)
    rank = (scores.unsqueeze(-1) > true.unsqueeze(2)).sum(2)  # tokens scoring above each true one
    assert float(rank.float().median()) < 3  # still near the top of 300


def test_the_span_is_capped_below_the_width_so_large_batches_still_rank():
    target = _target()
    m = 16  # 64 tokens > d = 32
    pipeline, ids, update = _updates(target, m, updates=1)
    evidence = SpanEvidence(target, list(pipeline.names), m * L, L, EvidenceOptions(max_span_fraction=0.75))
    assert evidence.max_rank == 24
    distances = evidence.distances(update)
    assert float(distances.max()) > 0.1  # a complement is left: not every token is "in the span"


def test_models_with_a_first_layer_norm_use_the_reference_path():
    target = HFCausalLM(architecture="gpt2", config=dict(n_layer=2, n_embd=32, n_head=2, vocab_size=300, n_positions=16,
                                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    pipeline, ids, update = _updates(target, 1, updates=2)
    evidence = SpanEvidence(target, list(pipeline.names), L, L)
    assert evidence.inputs.norm != "none"
    scores = evidence(update)
    assert scores.shape == (2, L, 300)
    # Causal next-token training: the last token reaches no loss, so only the others are in the span.
    assert all(int(scores[u, p].argmax()) == int(ids[u, 0, p]) for u in range(2) for p in range(L - 1))


def test_a_first_layer_the_server_does_not_observe_is_refused_in_one_line():
    target = _target()
    pipeline, _, _ = _updates(target, 1, observed=ParameterSelection(preset="layer0_ffn_in"), updates=1)
    with pytest.raises(ValueError, match="does not observe under data.observed"):
        SpanEvidence(target, list(pipeline.names), L, L)


@pytest.mark.parametrize("options, message", [
    (dict(max_span_fraction=1.0), "max_span_fraction"), (dict(blocks="kv"), "blocks"), (dict(rank_tol=0.0), "rank_tol"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message):
        EvidenceOptions(**options)


def test_the_batched_span_projects_like_dagers_svd_basis():
    from exact.dager.span import span_basis

    target = _target()
    m = 2
    pipeline, ids, update = _updates(target, m, defense=GaussianNoise(sigma=1e-4))
    evidence = SpanEvidence(target, list(pipeline.names), m * L, L)
    for u, basis in enumerate(evidence.spans(update)):
        space = evidence.first.input_space({n: update[n][u] for n in evidence.first.names()})
        reference = span_basis(space, max_rank=m * L)
        assert basis.rank == reference.rank
        assert torch.allclose(basis.range @ basis.range.T, reference.range @ reference.range.T, atol=1e-8)
