"""The first-layer gradient split into token and position rows (exact.dager.position_split), against
per-pair gradients read from the model itself, and its use by DAGER's encoder search."""

from __future__ import annotations

import pytest
import torch

from datamodules.federated import FedSGDClient, NoDefense, ParameterSelection, UpdatePipeline
from datamodules.federated.hashing import Hashing
from datamodules.targets import HFEncoderLM
from datamodules.targets.base import next_token_loss
from exact import Dager, find_layers
from exact.dager import EncoderOptions
from exact.dager.position_split import split_first_layer, split_rows
from exact.layers import find_module_by_name

VOCAB, EOS, CLS = 300, 2, 1


def encoder(width: int = 128) -> HFEncoderLM:
    return HFEncoderLM(architecture="bert", config=dict(
        num_hidden_layers=2, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


def planted(lengths: list[int], seed: int, words: int):
    """[CLS] w ... w [EOS], words from a pool of `words` tokens (so tokens repeat), right padded with 0."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randperm(VOCAB - 3, generator=gen)[:words] + 3
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, 0], ids[i, n - 1] = CLS, EOS
        ids[i, 1 : n - 1] = pool[torch.randint(0, words, (n - 2,), generator=gen)]
        mask[i, :n] = 1
    return ids, mask


def client_update(target, ids, mask):
    observed = ParameterSelection(include=find_layers(target).observed_names())
    pipeline = UpdatePipeline(
        target, FedSGDClient(mode="eval", samples_per_update=ids.shape[0]), NoDefense(), observed, hashing=Hashing(bins=1)
    )
    out = pipeline({"input_ids": ids[None], "attention_mask": mask[None]}, keep_update=True,
                   generator=torch.Generator().manual_seed(0))
    return {name: grads[0] for name, grads in pipeline.split(out.update).items()}


def per_pair_rows(target, ids, mask):
    """Reference: every (sequence, position) pair's first-layer output gradients (query, key, value)
    divided by the first norm's sigma, read with hooks, and the gradient they add up to."""
    layers = find_layers(target)
    target.eval()
    outputs, inputs = {}, {}
    modules = [find_module_by_name(target, b.param_name.rsplit(".", 1)[0]) for b in layers.first.blocks("qkv")]

    def keep(i):
        def hook(module, args, out):
            out.retain_grad()
            outputs[i], inputs[i] = out, args[0]
        return hook

    for p in target.parameters():
        p.requires_grad_(True)
    handles = [m.register_forward_hook(keep(i)) for i, m in enumerate(modules)]
    try:
        loss = next_token_loss(target(ids, mask), ids, mask).mean()
        loss.backward()
    finally:
        for h in handles:
            h.remove()
    dy = torch.cat([outputs[i].grad for i in range(len(modules))], dim=-1).double()  # (B, T, width)
    x = inputs[0].detach().double()
    pre = torch.stack([layers.inputs.pre_norm(ids[:, i], i) for i in range(ids.shape[1])], dim=1)
    sigma = torch.sqrt(pre.var(-1, unbiased=False) + layers.inputs.eps)  # (B, T)
    keep_pairs = mask.bool()
    gradient = torch.einsum("btd,btw->dw", x * keep_pairs[..., None], dy)
    return (dy / sigma[..., None]).detach(), keep_pairs, gradient.detach()


def test_split_rows_equal_per_pair_sums():
    """Token row a = sum of the pairs' e = dy / sigma over a's positions; position row i = sum over
    the tokens at i (padding adds nothing). Checked in float64 against hooks on the model."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([10, 8, 7], seed=1, words=6)
    update = client_update(target, ids, mask)
    layers = find_layers(target)
    g1 = layers.first.input_space(update, "qkv").double()
    e, pairs, gradient = per_pair_rows(target, ids, mask)
    scale = float((g1 * gradient).sum() / gradient.pow(2).sum())  # the client's averaging, whatever it is
    assert float((g1 - scale * gradient).norm() / g1.norm()) < 1e-5  # the hooks read the same gradient
    tokens = torch.unique(ids[pairs])
    words, places, fit = split_rows(g1, layers.inputs, tokens, ids.shape[1])
    assert fit < 1e-5
    for k, t in enumerate(tokens.tolist()):
        want = scale * e[(ids == t) & pairs].sum(0)
        assert torch.allclose(words[k], want, rtol=1e-4, atol=1e-6 * float(want.abs().max())), t
    for i in range(ids.shape[1]):
        want = scale * e[:, i][pairs[:, i]].sum(0)
        assert torch.allclose(places[i], want, rtol=1e-4, atol=1e-6 * float(want.abs().max())), i


def blind_batch():
    """Four planted sequences over a 30-token pool on the tiny encoder: (ids, mask, layers, first-layer gradient)."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([12, 11, 10, 9], seed=3, words=30)
    layers = find_layers(target)
    return ids, mask, layers, layers.first.input_space(client_update(target, ids, mask), "qkv")


def test_pins_are_true_positions_on_a_blind_first_layer():
    """Four sequences over a small pool: more (token, position) pairs than tokens + positions, so every
    pool token passes the first-layer test at every position. Pinned tokens sit where they were pinned;
    candidates shrink; tokens not in the batch have a zero row."""
    ids, mask, layers, g1 = blind_batch()
    batch_tokens = torch.unique(ids[mask.bool()])
    outsiders = torch.tensor([t for t in range(3, 60) if t not in batch_tokens.tolist()][:5])
    split = split_first_layer(g1, layers.inputs, torch.cat([batch_tokens, outsiders]), ids.shape[1])
    assert split is not None and split.fit_residual < 1e-5
    assert sorted(split.absent.tolist()) == sorted(outsiders.tolist())
    assert split.used_positions == 12
    truth = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    pinned = [(i, t) for i, p in enumerate(split.pinned) for t in p.tolist()]
    assert len(pinned) >= 10, pinned
    for i, t in pinned:
        assert any(len(s) > i and s[i] == t for s in truth), (i, t)
    passing = [batch_tokens] * ids.shape[1]
    refined = split.candidates(passing)
    assert sum(c.numel() for c in refined) < 0.8 * sum(c.numel() for c in passing)


def test_split_refuses_gradients_not_of_the_input_form():
    """Noise on the gradient (or a model without learned positions) leaves no exact split: None."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([9, 8], seed=5, words=5)
    layers = find_layers(target)
    g1 = layers.first.input_space(client_update(target, ids, mask), "qkv")
    tokens = torch.unique(ids[mask.bool()])
    assert split_first_layer(g1, layers.inputs, tokens, ids.shape[1]) is not None
    noisy = g1 + 1e-3 * g1.abs().max() * torch.randn(g1.shape, generator=torch.Generator().manual_seed(0))
    assert split_first_layer(noisy, layers.inputs, tokens, ids.shape[1]) is None
    no_positions = type(layers.inputs)(**{**layers.inputs.__dict__, "positions": None})
    assert split_first_layer(g1, no_positions, tokens, ids.shape[1]) is None


def test_blind_encoder_search_uses_the_split_and_fills_the_batch():
    """On a blind first layer the attack splits, searches the pruned candidates, and returns a full
    batch: what the strict search found (certified per sequence), then best-effort sequences, never
    a certified batch. Without the split the same search keeps every candidate."""
    torch.manual_seed(0)
    target = encoder()
    ids, mask = planted([12, 11, 10, 9], seed=3, words=30)
    update = client_update(target, ids, mask)
    truth = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    attack = Dager(encoder=EncoderOptions(eos_token_id=EOS, token_budget=200_000))
    result = attack.attack(target, update, batch_size=4, max_length=ids.shape[1])
    diag = result.diagnostics
    assert "position_split" in diag
    assert sum(diag["candidates_after_split"]) < sum(diag["candidates_per_position"])
    assert len(result.sequences) == 4
    for seq, certified in zip(result.sequences, result.sequence_exact):
        assert not certified or seq in truth  # a per-sequence certificate is never wrong
    if not all(result.sequence_exact):
        assert not result.exact and any("best effort" in f for f in diag["flags"])
    if diag["mode"] == "strict+relaxed":  # the strict attempt's own flags are kept beside the fill's
        assert any("distinct sequences for a batch of 4" in f for f in diag["flags"]), diag["flags"]
        # the fill ranks by the split and searches twice the batch size of candidates per position
        assert max(diag["relaxed_candidates_per_position"]) == 8, diag["relaxed_candidates_per_position"]
    plain = attack.with_options(encoder={"split_positions": False}).attack(target, update, batch_size=4, max_length=ids.shape[1])
    assert "position_split" not in plain.diagnostics


def test_focused_candidates_keep_the_pins_then_the_best_fits():
    """`PositionSplit.focused`: every pinned token, then the best-fitting others up to the width, in the
    order of `candidates()`; a width past every list changes nothing."""
    ids, mask, layers, g1 = blind_batch()
    tokens = torch.unique(ids[mask.bool()])
    split = split_first_layer(g1, layers.inputs, tokens, ids.shape[1])
    refined = split.candidates([tokens] * ids.shape[1])
    focused = split.focused(refined, width=6)
    assert len(focused) == len(refined)
    assert any(len(full) > 6 for full in refined)  # the cut does something here
    for i, (full, cut) in enumerate(zip(refined, focused)):
        pins = split.pinned[i].tolist()
        assert cut[: len(pins)].tolist() == pins  # pins first, all kept
        kept = full[: max(6, len(pins))].tolist()
        assert cut.tolist()[: len(kept)] == kept
        assert set(cut.tolist()[len(kept):]) <= set(split.echoes[i].tolist())  # then echoes cut off by the width
    assert [c.tolist() for c in split.focused(refined, width=10**6)] == [c.tolist() for c in refined]
    plain = split.focused(refined, width=6, echoes=False)  # the relaxed fill's cut: no echoes
    assert [c.tolist() for c in plain] == [full[: max(6, p.numel())].tolist() for full, p in zip(refined, split.pinned)]


def test_split_width_must_be_positive():
    with pytest.raises(ValueError, match="split_width"):
        EncoderOptions(split_width=0)
    assert Dager(encoder=EncoderOptions(split_width=None)).options.encoder.split_width is None


def test_echoes_put_an_over_subtracted_pin_back_where_its_rest_shows():
    """`_echoes`: a token pinned at position 0 whose row also held a part from position 3 leaves -part
    at 0 and +part at 3 unexplained; it becomes a candidate at 3 and nowhere else. Pins whose rows the
    leftover does not show get no echo."""
    from exact.dager.position_split import _echoes

    gen = torch.Generator().manual_seed(0)
    words = torch.randn(5, 40, generator=gen, dtype=torch.float64)
    pinned = [[0], [1], [2], [], []]
    leftover = torch.zeros(5, 40, dtype=torch.float64)
    part = 0.4 * words[0]
    leftover[0], leftover[3] = -part, part
    leftover[4] = 0.05 * torch.randn(40, generator=gen, dtype=torch.float64)  # an open token's unexplained rest
    echoes = _echoes(words, pinned, leftover)
    assert echoes == [[], [], [], [0], []]
    assert _echoes(words, pinned, torch.zeros(5, 40, dtype=torch.float64)) == [[]] * 5
