"""DAGER against train-mode clients: dropout masks found by pursuit, inputs chained by their query gradients."""

from __future__ import annotations

import torch

from datamodules.federated import FedSGDClient, Hashing, NoDefense, ParameterSelection, UpdatePipeline
from datamodules.targets import HFCausalLM, Transformer3
from exact import Dager, find_layers, span_basis
from exact.dager import Extensions
from exact.dager.dropout import MaskPursuit, chain, masked_vectors, max_dropped, query_gradients, span_residual
from exact.layers import FirstLayerInput

VOCAB = 500


def gpt2(dropout: float = 0.0) -> HFCausalLM:
    return HFCausalLM(architecture="gpt2", config=dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    ))


def train_mode_update(target, ids, mask) -> dict[str, torch.Tensor]:
    """What the server sees of one train-mode client: every parameter's gradient but the token embedding's."""
    pipeline = UpdatePipeline(target, FedSGDClient(mode="train", samples_per_update=ids.shape[0]), NoDefense(),
                              ParameterSelection(), hashing=Hashing(bins=1))
    out = pipeline({"input_ids": ids[None], "attention_mask": mask[None]}, keep_update=True,
                   generator=torch.Generator().manual_seed(0))
    return {name: grads[0] for name, grads in pipeline.split(out.update).items()}


def _layernorm_inputs(d: int = 32, vocab: int = 40, seed: int = 0) -> FirstLayerInput:
    gen = torch.Generator().manual_seed(seed)
    return FirstLayerInput(
        embedding=torch.randn(vocab, d, generator=gen, dtype=torch.float64),
        positions=torch.randn(8, d, generator=gen, dtype=torch.float64) * 0.5,
        norm="layernorm", norm_weight=1 + 0.1 * torch.randn(d, generator=gen, dtype=torch.float64),
        norm_bias=0.1 * torch.randn(d, generator=gen, dtype=torch.float64), eps=1e-5,
    )


def _planted(inputs: FirstLayerInput, pairs, rate: float, seed: int = 1):
    """Masked first-layer inputs of (token, position) pairs, their masks, and the span they make."""
    gen = torch.Generator().manual_seed(seed)
    pre = torch.stack([inputs.pre_norm(torch.tensor([t]), p)[0] for t, p in pairs])
    dropped = torch.rand(pre.shape, generator=gen) < rate
    vectors = masked_vectors(inputs, pre, dropped, rate)
    grad = vectors.T @ torch.randn(len(pairs), 3 * inputs.dim, generator=gen, dtype=torch.float64)
    return pre, dropped, vectors, span_basis(grad)


def _reference_pursuit(basis, inputs: FirstLayerInput, e: torch.Tensor, atoms: int) -> set[int]:
    """The slow, obvious version: greedy over coordinates, a fresh least-squares fit at every step, in
    the explicit model N^T(gamma * C(e - sum_S e_j u_j)) + sigma N^T beta = 0."""
    d = e.shape[0]
    n = basis.complement
    centre = torch.eye(d, dtype=e.dtype) - 1.0 / d
    gamma, beta = inputs.norm_weight, inputs.norm_bias
    target = n.T @ (gamma * (centre @ e))
    columns = torch.stack([n.T @ (gamma * (centre @ (e[j] * torch.eye(d, dtype=e.dtype)[j]))) for j in range(d)], 1)
    support: list[int] = []
    residual = target
    for _ in range(atoms):
        scores = (columns.T @ residual).abs() / columns.norm(dim=0).clamp_min(1e-300)
        scores[support] = -1
        support.append(int(scores.argmax()))
        design = torch.cat([columns[:, support], (n.T @ beta)[:, None]], 1)
        coef = torch.linalg.lstsq(design, target[:, None]).solution
        residual = target - (design @ coef)[:, 0]
        if float(residual.norm()) < 1e-10 * float(target.norm()):
            break
    design = torch.cat([columns[:, support], (n.T @ beta)[:, None]], 1)
    coef = torch.linalg.lstsq(design, target[:, None]).solution[:, 0]
    return {j for j, c in zip(support, coef[: len(support)].tolist()) if c > 0.5}


def test_mask_pursuit_finds_each_planted_mask_as_the_slow_reference_does():
    inputs, rate = _layernorm_inputs(), 0.1
    pairs = [(3, 0), (7, 1), (3, 2), (11, 3), (20, 4)]
    pre, dropped, vectors, basis = _planted(inputs, pairs, rate)
    assert basis.numerical_rank == len(pairs)  # masks make the inputs independent
    pursuit = MaskPursuit(basis, inputs, max_dropped(inputs.dim, rate))
    found, residual = pursuit.run(pre)
    assert torch.equal(found, dropped)
    assert float(residual.max()) < 1e-8
    for i in range(len(pairs)):
        assert _reference_pursuit(basis, inputs, pre[i], pursuit.max_atoms) == set(torch.nonzero(dropped[i]).flatten().tolist())
    # the explicit inputs the masks give are in the span; a pair that is not in the batch is not
    assert float(basis.distance(masked_vectors(inputs, pre, found, rate)).max()) < 1e-9
    wrong = torch.stack([inputs.pre_norm(torch.tensor([t]), p)[0] for t, p in [(3, 1), (8, 0), (11, 2)]])
    wrong_found, _ = pursuit.run(wrong)
    assert float(basis.distance(masked_vectors(inputs, wrong, wrong_found, rate)).min()) > 1e-2


def test_span_residual_matches_a_per_head_least_squares_loop():
    gen = torch.Generator().manual_seed(2)
    heads, size = 4, 8
    keys = torch.randn(3, heads * size, generator=gen, dtype=torch.float64)
    query = torch.randn(heads * size, generator=gen, dtype=torch.float64)
    query[:size] = keys[:, :size].T @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)  # head 0 in the span
    fast = span_residual(query, keys, heads)
    for h in range(heads):
        k, q = keys[:, h * size : (h + 1) * size].T, query[h * size : (h + 1) * size]
        coef = torch.linalg.lstsq(k, q[:, None]).solution
        assert abs(float((k @ coef)[:, 0].sub(q).norm() / q.norm()) - float(fast[h])) < 1e-10
    assert float(fast[0]) < 1e-12 and float(fast[1:].min()) > 1e-2


def test_query_gradients_and_the_chain_recover_planted_prefixes():
    """Query gradients built from keys of each sequence's own prefix: solved back from G_q = X^T dQ
    and linked one-to-one, position by position, into the planted sequences."""
    from exact.dager.dropout import MaskedInput

    gen = torch.Generator().manual_seed(3)
    d, heads = 48, 4
    sequences = [[5, 9, 2, 4], [5, 1, 7], [8, 9, 3, 3]]  # two share their first token
    vectors = torch.randn(11, d, generator=gen, dtype=torch.float64)  # independent inputs
    items, rows = [], {}
    for s, seq in enumerate(sequences):
        for p, t in enumerate(seq):
            rows[(s, p)] = len(items)
            items.append(MaskedInput(t, p, torch.zeros(d, dtype=torch.bool), vectors[len(items)], 0.0))
    keys = vectors @ torch.randn(d, d, generator=gen, dtype=torch.float64)
    dq = torch.zeros(len(items), d, dtype=torch.float64)
    for (s, p), i in rows.items():
        own = [rows[(s, q)] for q in range(p + 1)]
        dq[i] = (torch.randn(len(own), generator=gen, dtype=torch.float64)[:, None] * keys[own]).sum(0) if p else 0
    solved, fit = query_gradients(vectors, vectors.T @ dq)
    assert fit < 1e-10 and torch.allclose(solved, dq, atol=1e-9)
    order = sorted(range(len(items)), key=lambda i: (items[i].position, -i))  # not in sequence order
    found = [items[i] for i in order]
    chained, worst, notes = chain(found, solved[order], keys[order], heads)
    assert sorted(chained) == sorted(sequences) and not notes
    assert max(worst) < 1e-8


def _shared_start_batch():
    ids = torch.randint(1, VOCAB, (3, 10), generator=torch.Generator().manual_seed(21))
    ids[:, 0] = ids[0, 0]  # every sequence starts with the same token: three inputs of one (token, position)
    mask = torch.zeros(3, 10, dtype=torch.long)
    for i, n in enumerate((10, 8, 7)):
        mask[i, :n] = 1
    return ids * mask, mask


def test_train_mode_gpt2_inputs_are_recovered_exactly():
    torch.manual_seed(0)
    target = gpt2(dropout=0.1)
    ids, mask = _shared_start_batch()
    update = train_mode_update(target, ids, mask)
    result = Dager().attack(target, update, batch_size=3, max_length=10)
    diag = result.diagnostics
    assert diag["mode"] == "dropout"
    assert diag["dropout_inputs"] == diag["dropout_inputs_expected"] == diag["rank1"] == 10 + 8 + 7 - 3
    assert diag["dropout_inputs_certified"] and diag["dropout_fit"] < 1e-5
    inputs = sorted(s[:-1] for s in result.sequences)
    assert inputs == sorted(row[m.bool()].tolist()[:-1] for row, m in zip(ids, mask))
    # the last tokens (labels only) come from the final norm's gradient, which dropout deeper in the
    # model perturbs: never certified under dropout
    assert not result.exact


def test_without_the_dropout_search_train_mode_falls_back_to_the_relaxed_best_effort():
    target = gpt2(dropout=0.1)
    ids, mask = _shared_start_batch()
    update = train_mode_update(target, ids, mask)
    result = Dager(extensions=Extensions(dropout_search=False)).attack(target, update, batch_size=3, max_length=10)
    assert result.diagnostics["mode"] == "relaxed" and not result.exact


def test_layers_know_the_embedding_dropout_and_the_first_heads():
    layers = find_layers(gpt2(dropout=0.1))
    assert layers.embedding_dropout == 0.1 and layers.first_heads == 4
    assert find_layers(gpt2()).embedding_dropout == 0.0
    t3 = find_layers(Transformer3(vocab_size=VOCAB, hidden_size=64, num_heads=4, ffn_size=128, num_layers=2,
                                  max_positions=16, dropout=0.2))
    assert t3.embedding_dropout == 0.2 and t3.first_heads == 4


def test_a_missing_first_input_is_recovered_from_its_childs_query_gradient():
    """Drop one of the three position-0 copies the pursuit found: the chain leaves its child orphaned, and
    the child's query gradient (in span{k_0, k_1} per head) gives back the plane holding the missing input,
    from which the token and its mask are recovered exactly."""
    from exact.dager import dropout as D

    torch.manual_seed(0)
    target = gpt2(dropout=0.1)
    ids, mask = _shared_start_batch()
    update = train_mode_update(target, ids, mask)
    layers = find_layers(target)
    basis = span_basis(layers.first.input_space(update, "qkv"))
    basis = basis.with_rank(basis.numerical_rank)
    tokens = torch.arange(VOCAB)
    found, _ = D.find_masked_inputs(basis, layers.inputs, tokens, list(range(9)), 0.1, 1e-3, expected=basis.rank)
    assert len(found) == basis.rank == 22
    removed = [m for m in found if m.position == 0][-1]
    found = [m for m in found if m is not removed]
    vectors = torch.stack([m.vector for m in found])
    query = layers.first.query.input_space(update[layers.first.query.param_name])
    dq, _ = D.query_gradients(vectors, query)
    block = layers.first.key_value[0]
    params = dict(target.named_parameters())
    weight = block.input_space(params[block.param_name].detach().double())
    bias = params[block.param_name.replace("weight", "bias")].detach().double()[block.start : block.stop]
    keys = vectors @ weight + bias
    orphans: list[int] = []
    D.chain(found, dq, keys, 4, orphans)
    assert [found[i].position for i in orphans] == [1]
    plane = D.first_input_plane(dq[orphans[0]], keys[orphans[0]], basis, weight, bias, 4)
    inside = removed.vector - plane @ (plane.T @ removed.vector)
    assert float(inside.norm() / removed.vector.norm()) < 1e-5
    item = D._identify(basis, layers.inputs, plane, vectors[orphans[0]], tokens, 0.1, 1e-3)
    assert item is not None and item.token == removed.token and torch.equal(item.dropped, removed.dropped)


def test_a_train_mode_lora_client_falls_back_to_the_best_effort():
    """A LoRA client sends adapter gradients only: no query-weight gradient to solve the query
    gradients from, so the dropout search steps aside (no crash) and the relaxed best effort runs."""
    from datamodules.federated import LoRAClient

    torch.manual_seed(0)
    target = gpt2(dropout=0.1)
    pipeline = UpdatePipeline(target, client=LoRAClient(rank=16, init_b_std=0.02, local=FedSGDClient(mode="train")),
                              hashing=Hashing(bins=16))
    ids = torch.randint(3, VOCAB - 3, (1, 1, 8), generator=torch.Generator().manual_seed(1))
    parts = pipeline.split(pipeline({"input_ids": ids}, keep_update=True, generator=torch.Generator().manual_seed(0)).update)
    result = Dager().attack(pipeline.target, {n: g[0] for n, g in parts.items()}, batch_size=1, max_length=8)
    assert result.diagnostics["mode"] == "relaxed" and not result.exact
