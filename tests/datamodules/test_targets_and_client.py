import pytest
import torch
from conftest import per_example_text, relative_error

from datamodules.federated import FedSGDClient, Hashing, ParameterSelection, UpdatePipeline
from datamodules.federated.defenses import Sign
from datamodules.federated.engines.next_token import per_example_gradients, per_example_gradients_loop
from datamodules.targets import Transformer3


def test_transformer3_matches_the_paper_shapes():
    model = Transformer3()
    params = dict(model.named_parameters())
    assert params["token_embedding.weight"].shape == (50257, 96)
    assert model.decoder.weight is model.token_embedding.weight  # tied
    assert params["token_embedding.weight"].abs().max() <= 0.1
    layer = model.encoder.layers[0]
    assert layer.linear1.weight.shape == (1536, 96) and layer.self_attn.num_heads == 8
    assert layer.norm_first is False and len(model.encoder.layers) == 3
    names = ParameterSelection().resolve(model)
    assert "token_embedding.weight" not in names and "decoder.bias" not in names
    assert sum(params[n].numel() for n in names) == 1_004_064  # ~1.1M with 1024 position rows


def test_transformer3_is_bidirectional_unless_causal(tiny_transformer3):
    ids = torch.randint(0, 300, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 300
    for causal, first_changes in ((False, True), (True, False)):
        model = Transformer3(vocab_size=300, hidden_size=16, num_heads=2, ffn_size=32, num_layers=2, max_positions=8, causal=causal).eval()
        a, b = model(ids), model(changed)
        assert (not torch.allclose(a[0, 0], b[0, 0])) == first_changes


def test_same_init_seed_gives_the_same_global_model():
    a, b = Transformer3(vocab_size=100, hidden_size=16, num_heads=2, ffn_size=16, num_layers=1), Transformer3(vocab_size=100, hidden_size=16, num_heads=2, ffn_size=16, num_layers=1)
    for (_, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q)


def test_sequence_longer_than_positions_is_rejected(tiny_transformer3):
    with pytest.raises(ValueError, match="exceeds the target model's 8 positions"):
        tiny_transformer3(torch.zeros(1, 9, dtype=torch.long))


def test_parameter_selection_by_name_and_errors(tiny_transformer3):
    names = ParameterSelection(["encoder.layers.0.self_attn.*"]).resolve(tiny_transformer3)
    assert names == ["encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.0.self_attn.in_proj_bias",
                     "encoder.layers.0.self_attn.out_proj.weight", "encoder.layers.0.self_attn.out_proj.bias"]
    with pytest.raises(ValueError, match="matches no parameter"):
        ParameterSelection(["nope.*"]).resolve(tiny_transformer3)
    with pytest.raises(ValueError, match="selects no parameter"):
        ParameterSelection(["decoder.bias"]).resolve(tiny_transformer3)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_vmap_path_matches_loop_on_a_gpt2_target(tiny_gpt2, mode):
    """Generic fast path (HF models): same gradients as the per-sequence loop (dropout is 0)."""
    tiny_gpt2.train(mode == "train")
    names = ParameterSelection().resolve(tiny_gpt2)
    assert not any("wte" in n for n in names)
    ids = torch.randint(0, 300, (5, 12))
    fast = per_example_gradients(tiny_gpt2, names, ids)
    slow = per_example_gradients_loop(tiny_gpt2, names, ids)
    assert fast.shape == (5, sum(dict(tiny_gpt2.named_parameters())[n].numel() for n in names))
    assert relative_error(fast, slow) < 1e-5


def test_vmap_path_matches_loop_with_padding(tiny_gpt2):
    tiny_gpt2.eval()
    names = ParameterSelection(["model.transformer.h.0.*"]).resolve(tiny_gpt2)
    ids = torch.randint(0, 300, (3, 10))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    mask[2, 3:] = 0
    assert relative_error(per_example_gradients(tiny_gpt2, names, ids, mask), per_example_gradients_loop(tiny_gpt2, names, ids, mask)) < 1e-5


def test_client_modes_and_sequences_per_update(tiny_gpt2):
    from datamodules.targets import HFCausalLM

    dropout_model = HFCausalLM(architecture="gpt2", config=dict(n_layer=1, n_embd=32, n_head=2, vocab_size=300, n_positions=16, resid_pdrop=0.3))
    dropout_model.eval()
    names = ParameterSelection().resolve(dropout_model)
    ids = torch.randint(0, 300, (2, 3, 10))
    eval_client, train_client = FedSGDClient("eval", 3), FedSGDClient("train", 3)
    e1, e2 = per_example_text(eval_client, dropout_model, names, ids), per_example_text(eval_client, dropout_model, names, ids)
    assert e1.shape[:2] == (2, 3) and torch.equal(e1, e2)  # eval: deterministic
    t1 = per_example_text(train_client, dropout_model, names, ids)
    assert not torch.allclose(t1, e1)  # train mode: the client's own dropout masks
    assert dropout_model.training is False  # the client restores the model's mode
    with pytest.raises(ValueError, match="samples per update"):
        per_example_text(FedSGDClient("eval", 2), dropout_model, names, ids)
    with pytest.raises(ValueError, match="client mode"):
        FedSGDClient("inference")


def test_pipeline_observes_defended_hashed_updates(tiny_transformer3):
    pipe = UpdatePipeline(tiny_transformer3, FedSGDClient("eval"), Sign(), hashing=Hashing(bins=64))
    ids = torch.randint(0, 300, (3, 1, 8))
    out = pipe({"input_ids": ids}, keep_update=True)
    assert out.features.shape == (3, 64) and out.update.shape == (3, pipe.observed_dim)
    assert set(out.update.unique().tolist()) <= {-1.0, 0.0, 1.0}
    parts = pipe.split(out.update)
    assert list(parts) == pipe.names and parts[pipe.names[0]].shape[0] == 3
    torch.testing.assert_close(out.features, pipe.hasher(out.update))


def test_pipeline_rejects_non_finite_updates(tiny_transformer3):
    with torch.no_grad():
        tiny_transformer3.encoder.layers[0].linear1.weight[0, 0] = float("nan")
    pipe = UpdatePipeline(tiny_transformer3, FedSGDClient("eval"), hashing=Hashing(bins=16))
    with pytest.raises(FloatingPointError, match="non-finite client update"):
        pipe({"input_ids": torch.randint(0, 300, (2, 1, 8))})


def test_pipeline_works_under_inference_mode(tiny_transformer3):
    """Lightning validates under torch.inference_mode(); the pipeline must still get gradients."""
    pipe = UpdatePipeline(tiny_transformer3, FedSGDClient("eval"), hashing=Hashing(bins=16))
    ids = torch.randint(0, 300, (2, 1, 8))
    expected = pipe({"input_ids": ids}).features
    with torch.inference_mode():
        torch.testing.assert_close(pipe({"input_ids": ids}).features, expected)
