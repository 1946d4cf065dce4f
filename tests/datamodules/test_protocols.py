"""Client protocols (FedSGD, FedAvg, LoRA), partial-observation presets and DP accounting.

Every fast path is checked against a plain-torch reference: FedAvg against a `torch.optim.SGD` loop
on a copy of the model (float64), LoRA against autograd on a peft model, DP-SGD-in-FedAvg against a
per-sequence clipping loop.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import observe_text, per_example_text, relative_error

from datamodules.federated import (
    CLIENT_PROTOCOLS,
    DPSGD,
    ClientProtocol,
    FedAvgClient,
    FedSGDClient,
    GaussianNoise,
    LoRAClient,
    NoDefense,
    ParameterSelection,
    Sign,
    TopKPruning,
    UpdatePipeline,
    dp_epsilon,
    preset_patterns,
)
from datamodules.federated.defenses import Compose
from datamodules.federated.engines.next_token import group_gradients, group_gradients_loop, group_gradients_vmap
from datamodules.federated.hashing import Hashing
from datamodules.federated.protocols.base import model_mode
from datamodules.federated.protocols.lora import adapted_modules
from datamodules.targets import HFCausalLM, Transformer3
from datamodules.targets.base import next_token_loss

#: `next_token_loss` computes the cross-entropy in float32 even for float64 logits, so paths that
#: sum in different orders agree to float32 precision only.
TOL = 1e-6


def tiny_t3(dtype=torch.float64, **kwargs) -> Transformer3:
    model = Transformer3(**{"vocab_size": 300, "hidden_size": 16, "num_heads": 2, "ffn_size": 32, "num_layers": 2,
                            "max_positions": 8, **kwargs})
    return model.to(dtype)


def flat(model, names):
    params = dict(model.named_parameters())
    return torch.cat([params[n].detach().reshape(-1) for n in names])


def manual_fedavg(model, observed, trained, ids, epochs, batch, lr, momentum, order=None):
    """Reference: one client, a copy of the model, torch.optim.SGD on the mean minibatch loss."""
    local = copy.deepcopy(model)
    params = dict(local.named_parameters())
    for name, p in params.items():
        p.requires_grad_(name in trained)
    optimiser = torch.optim.SGD([params[n] for n in trained], lr=lr, momentum=momentum)
    start = flat(local, observed).clone()
    n = ids.shape[0]
    for epoch in range(epochs):
        seq = ids if order is None else ids[order[epoch]]
        for s in range(math.ceil(n / batch)):
            chunk = seq[s * batch : (s + 1) * batch]
            optimiser.zero_grad()
            next_token_loss(local(chunk), chunk).mean().backward()
            optimiser.step()
    return start - flat(local, observed)


# ------------------------------------------------------------------------------------------------ registry


def test_registry_lists_protocols_and_rejects_unknown_names():
    assert {"fedsgd", "fedavg", "lora"} <= set(CLIENT_PROTOCOLS.names())
    assert isinstance(ClientProtocol.create("fedavg", minibatch_size=1), FedAvgClient)
    with pytest.raises(ValueError, match="unknown client protocol 'bogus'; allowed: ") as info:
        ClientProtocol.create("bogus")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"local_epochs": 0}, "FedAvg local_epochs=0 must be >= 1"),
    ({"minibatch_size": 0}, "FedAvg minibatch_size=0 must be >= 1"),
    ({"lr": -1.0}, "FedAvg lr=-1.0 must be a finite number > 0"),
    ({"momentum": 1.0}, r"FedAvg momentum=1.0 is outside \[0, 1\)"),
    ({"mode": "inference"}, "client mode 'inference' is not allowed"),
    ({"dtype": "float16"}, "client dtype 'float16' is not allowed; use 'model', 'float32' or 'float64'"),
])
def test_fedavg_rejects_bad_arguments_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        FedAvgClient(**kwargs)
    assert "\n" not in str(info.value)


def test_fedsgd_is_the_default_protocol_and_unchanged(tiny_transformer3):
    pipe = UpdatePipeline(tiny_transformer3, hashing=Hashing(bins=16))
    assert isinstance(pipe.client, FedSGDClient) and pipe.client.name == "fedsgd"
    ids = torch.randint(0, 300, (3, 1, 8))
    expected = per_example_text(pipe.client, tiny_transformer3, pipe.names, ids)[:, 0]
    assert torch.equal(pipe({"input_ids": ids}, keep_update=True).update, expected)


# ------------------------------------------------------------------------------------------------ FedAvg


@pytest.mark.parametrize("preset", [None, "layer1_all"])
def test_group_gradients_match_the_loop_at_client_weights(preset):
    """Both fast paths (transformer3 engine, vmap) against the loop, every group at its own weights."""
    model = tiny_t3(dropout=0.2).eval()
    names = ParameterSelection(preset=preset).resolve(model)
    ids = torch.randint(0, 300, (3, 2, 8))
    mask = torch.ones_like(ids)
    mask[1, 0, 5:] = 0
    dim = sum(dict(model.named_parameters())[n].numel() for n in names)
    weights = flat(model, names).expand(3, -1) + 0.05 * torch.randn(3, dim, dtype=torch.float64)
    slow = group_gradients_loop(model, names, ids, mask, weights)
    assert relative_error(group_gradients(model, names, ids, mask, weights), slow) < TOL  # engine
    assert relative_error(group_gradients_vmap(model, names, ids, mask, weights), slow) < TOL
    assert not torch.allclose(slow[0], group_gradients_loop(model, names, ids[:1], mask[:1], None)[0])


@pytest.mark.parametrize("epochs", [1, 2])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_fedavg_delta_matches_a_manual_sgd_loop(epochs, batch, momentum):
    model = tiny_t3(num_layers=1).eval()
    ids = torch.randint(0, 300, (2, 3, 8))  # 2 clients of n = 3 sequences: B = 2 leaves a short minibatch
    client = FedAvgClient("eval", 3, local_epochs=epochs, minibatch_size=batch, lr=0.05, momentum=momentum, shuffle=False)
    pipe = UpdatePipeline(model, client, hashing=Hashing(bins=16))
    update = pipe({"input_ids": ids}, keep_update=True).update
    for u in range(2):
        expected = manual_fedavg(model, pipe.names, pipe.names, ids[u], epochs, batch, 0.05, momentum)
        assert relative_error(update[u], expected) < TOL


def test_fedavg_loop_implementation_agrees_with_the_fast_path():
    model = tiny_t3().eval()
    ids = torch.randint(0, 300, (2, 2, 8))
    kwargs = dict(mode="eval", samples_per_update=2, local_epochs=2, minibatch_size=1, lr=0.1, shuffle=False)
    names = ParameterSelection().resolve(model)
    fast = observe_text(FedAvgClient(**kwargs), model, names, ids)
    slow = observe_text(FedAvgClient(**kwargs, implementation="loop"), model, names, ids)
    assert relative_error(fast, slow) < TOL


def test_fedavg_one_full_minibatch_is_lr_times_the_fedsgd_gradient():
    model = tiny_t3().eval()
    ids = torch.randint(0, 300, (3, 4, 8))
    names = ParameterSelection().resolve(model)
    fedsgd = observe_text(FedSGDClient("eval", 4), model, names, ids)
    client = FedAvgClient("eval", 4, local_epochs=1, minibatch_size=4, lr=0.3)
    fedavg = observe_text(client, model, names, ids)
    assert relative_error(fedavg, 0.3 * fedsgd) < 1e-12
    # The pseudo-gradient exact attacks use: delta / (steps * lr) is the FedSGD gradient here.
    assert client.local_steps() == 1 and relative_error(fedavg * client.gradient_scale(), fedsgd) < 1e-12


def test_local_steps_and_gradient_scale_per_protocol():
    assert FedSGDClient("eval", 2).local_steps() == 1 and FedSGDClient("eval", 2).gradient_scale() == 1.0
    fedavg = FedAvgClient("train", 5, local_epochs=2, minibatch_size=2, lr=0.05)
    assert fedavg.local_steps() == 2 * 3  # ceil(5 / 2) minibatches per epoch
    assert fedavg.gradient_scale() == pytest.approx(1 / (6 * 0.05))
    lora = LoRAClient(local=fedavg)
    assert lora.local_steps() == 6 and lora.gradient_scale() == fedavg.gradient_scale()


def test_fedavg_trains_unobserved_parameters_when_asked():
    """Observe layer 0 only while the client trains every encoder parameter (the real client)."""
    model = tiny_t3().eval()
    ids = torch.randint(0, 300, (1, 2, 8))
    observed = ParameterSelection(preset="layer0_all").resolve(model)
    client = FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=0.1, trainable=["encoder.*"], shuffle=False)
    trained = client.trained_names(model, observed)
    assert trained[: len(observed)] == observed and any(n.startswith("encoder.layers.1.") for n in trained)
    update = observe_text(client, model, observed, ids)
    assert relative_error(update[0], manual_fedavg(model, observed, trained, ids[0], 2, 1, 0.1, 0.0)) < TOL
    only_observed = observe_text(FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=0.1, shuffle=False), model, observed, ids)
    assert not torch.allclose(update, only_observed)  # layer 1's steps change layer 0's later gradients


def test_fedavg_shuffles_per_client_from_the_generator():
    model = tiny_t3().eval()
    ids = torch.randint(0, 300, (2, 4, 8))
    names = ParameterSelection(preset="layer1_ffn_out").resolve(model)
    client = FedAvgClient("eval", 4, local_epochs=1, minibatch_size=1, lr=0.5, momentum=0.9)
    a = observe_text(client, model, names, ids, generator=torch.Generator().manual_seed(3))
    b = observe_text(client, model, names, ids, generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)
    order = torch.rand(2, 4, generator=torch.Generator().manual_seed(3)).argsort(dim=1)
    for u in range(2):
        expected = manual_fedavg(model, names, names, ids[u], 1, 1, 0.5, 0.9, order=[order[u]])
        assert relative_error(a[u], expected) < TOL


def test_fedavg_on_a_gpt2_target_matches_the_manual_loop(tiny_gpt2):
    model = tiny_gpt2.double().eval()
    names = ParameterSelection(preset=["layer0_attn_qkv", "layer1_ffn_in"]).resolve(model)
    ids = torch.randint(0, 300, (2, 2, 10))
    update = observe_text(FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=0.1, shuffle=False), model, names, ids)
    for u in range(2):
        assert relative_error(update[u], manual_fedavg(model, names, names, ids[u], 2, 1, 0.1, 0.0)) < TOL


def test_fedavg_float64_client_gives_the_exact_delta_of_a_float32_target():
    """dtype=float64 trains a float64 copy: the delta matches a float64 torch.optim.SGD loop to float32
    rounding, while the float32 client's delta has lost ~3 more digits to cancellation."""
    model = tiny_t3(torch.float32, num_layers=1).eval()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 300, (2, 3, 8))
    names = ParameterSelection().resolve(model)
    kwargs = dict(mode="eval", samples_per_update=3, local_epochs=2, minibatch_size=1, lr=0.01, shuffle=False)
    delta32 = observe_text(FedAvgClient(**kwargs), model, names, ids)
    delta64 = observe_text(FedAvgClient(**kwargs, dtype="float64"), model, names, ids)
    reference = copy.deepcopy(model).double()
    exact = torch.stack([manual_fedavg(reference, names, names, ids[u], 2, 1, 0.01, 0.0) for u in range(2)])
    assert delta64.dtype == delta32.dtype == torch.float32  # sent in the target's dtype
    assert relative_error(delta64, exact) < 1e-6
    assert relative_error(delta32, exact) > 100 * relative_error(delta64, exact)
    # The global model is untouched (the client trained a copy) and 'float32' on it is 'model'.
    assert all(p.dtype == torch.float32 and torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert torch.equal(observe_text(FedAvgClient(**kwargs, dtype="float32"), model, names, ids), delta32)


def test_lora_with_a_float64_fedavg_client_matches_a_float64_model():
    ids = torch.randint(0, 300, (2, 2, 8))
    local = dict(mode="eval", samples_per_update=2, local_epochs=2, minibatch_size=1, lr=0.01, shuffle=False)
    model = tiny_t3(torch.float32, num_layers=1).eval()
    lora = LoRAClient(rank=2, init_b_std=0.1, local=FedAvgClient(**local, dtype="float64"))
    pipe = UpdatePipeline(model, lora, hashing=Hashing(bins=16))
    update = pipe({"input_ids": ids}, keep_update=True).update
    # Reference: the same adapted model converted to float64, trained by a client in its own dtype.
    model64 = copy.deepcopy(pipe.target).double()
    adapters = lora.adapter_names(model64)
    expected = observe_text(FedAvgClient(**local), model64, pipe.names, ids, trainable=adapters)
    assert update.dtype == torch.float32 and expected.dtype == torch.float64
    assert relative_error(update.double(), expected) < 1e-6  # a float32 client: ~7e-6 here


def test_fedavg_train_mode_uses_dropout():
    model = tiny_t3(dropout=0.3)
    ids = torch.randint(0, 300, (2, 2, 8))
    names = ParameterSelection(preset="layer0_ffn_in").resolve(model)
    kwargs = dict(samples_per_update=2, minibatch_size=1, lr=0.1, shuffle=False)
    e1, e2 = (observe_text(FedAvgClient("eval", **kwargs), model, names, ids) for _ in range(2))
    assert torch.equal(e1, e2)
    assert not torch.allclose(observe_text(FedAvgClient("train", **kwargs), model, names, ids), e1)


# ------------------------------------------------------------------------------------------------ defenses x FedAvg


def test_dpsgd_in_fedavg_clips_every_sequence_at_every_local_step():
    model = tiny_t3().eval()
    ids = torch.randint(0, 300, (2, 4, 8))
    names = ParameterSelection(preset=["layer0_ffn_in", "layer1_attn_out"]).resolve(model)
    clip, lr = 0.05, 0.5  # far below the gradient norms: every sequence is clipped
    client = FedAvgClient("eval", 4, local_epochs=2, minibatch_size=2, lr=lr, shuffle=False)
    update = observe_text(client, model, names, ids, defense=DPSGD(clip, 0.0))
    for u in range(2):  # reference: per-sequence autograd, clip, mean, SGD by hand
        local = copy.deepcopy(model)
        params = dict(local.named_parameters())
        start = flat(local, names).clone()
        for _ in range(2):
            for s in range(2):
                rows = []
                for seq in ids[u, 2 * s : 2 * s + 2]:
                    loss = next_token_loss(local(seq[None]), seq[None]).sum()
                    grads = torch.autograd.grad(loss, [params[n] for n in names])
                    g = torch.cat([x.reshape(-1) for x in grads])
                    rows.append(g * min(1.0, clip / g.norm().item()))
                step = torch.stack(rows).mean(0)
                with torch.no_grad():
                    offset = 0
                    for n in names:
                        size = params[n].numel()
                        params[n] -= lr * step[offset : offset + size].view_as(params[n])
                        offset += size
        expected = start - flat(local, names)
        assert relative_error(update[u], expected) < TOL
        # each step moves at most lr * C
        assert update[u].norm() <= 4 * lr * clip * (1 + 1e-9)


@pytest.mark.parametrize("kind", ["transformer3", "gpt2"])
def test_dpsgd_in_fedavg_fast_paths_match_the_loop(kind, tiny_gpt2):
    """Per-sequence gradients at per-client weights: the engine (transformer3) / vmap (GPT-2) vs the loop."""
    model = tiny_t3().eval() if kind == "transformer3" else tiny_gpt2.double().eval()
    names = ParameterSelection(preset=["layer0_attn_qkv", "layer1_ffn_out"]).resolve(model)
    ids = torch.randint(0, 300, (2, 4, 8))
    kwargs = dict(mode="eval", samples_per_update=4, local_epochs=1, minibatch_size=2, lr=0.5, shuffle=False)
    fast = observe_text(FedAvgClient(**kwargs), model, names, ids, defense=DPSGD(0.05, 0.0))
    slow = observe_text(FedAvgClient(**kwargs, implementation="loop"), model, names, ids, defense=DPSGD(0.05, 0.0))
    assert relative_error(fast, slow) < TOL


def test_dpsgd_noise_in_fedavg_is_per_step():
    model = tiny_t3().eval()
    names = ParameterSelection(preset="layer0_ffn_out").resolve(model)
    ids = torch.randint(0, 300, (24, 2, 8))
    client = FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=1.0, shuffle=False)
    clean = observe_text(client, model, names, ids, defense=DPSGD(1.0, 0.0))
    noisy = observe_text(client, model, names, ids, defense=DPSGD(1.0, 0.5), generator=torch.Generator().manual_seed(0))
    # 4 steps of N(0, (0.5 * 1)^2 / 1) noise each, lr 1 -> std 0.5 * 2 per coordinate (plus the
    # small drift of later gradients caused by the noise)
    assert abs((noisy - clean).std().item() - 1.0) < 0.1


@pytest.mark.parametrize("defense", [Sign(), TopKPruning(0.9)])
def test_sign_and_pruning_act_on_the_fedavg_delta(defense):
    model = tiny_t3().eval()
    names = ParameterSelection().resolve(model)
    ids = torch.randint(0, 300, (2, 2, 8))
    client = FedAvgClient("eval", 2, local_epochs=1, minibatch_size=1, lr=0.1, shuffle=False)
    raw = observe_text(client, model, names, ids)
    torch.testing.assert_close(observe_text(client, model, names, ids, defense=defense), defense.transform(raw, None))


def test_compose_under_fedavg_splits_per_step_and_delta_parts():
    model = tiny_t3().eval()
    names = ParameterSelection(preset="layer0_ffn_in").resolve(model)
    ids = torch.randint(0, 300, (2, 2, 8))
    client = FedAvgClient("eval", 2, local_epochs=1, minibatch_size=1, lr=0.1, shuffle=False)
    clipped = observe_text(client, model, names, ids, defense=DPSGD(0.01, 0.0))
    both = observe_text(client, model, names, ids, defense=Compose([DPSGD(0.01, 0.0), Sign()]))
    assert Compose([DPSGD(), Sign()]).acts_per_step and not Compose([Sign()]).acts_per_step
    torch.testing.assert_close(both, torch.sign(clipped))


# ------------------------------------------------------------------------------------------------ LoRA


def test_lora_observes_only_adapters_with_a_deterministic_init():
    a = UpdatePipeline(tiny_t3(torch.float32), LoRAClient(rank=2, seed=1), hashing=Hashing(bins=16))
    b = UpdatePipeline(tiny_t3(torch.float32), LoRAClient(rank=2, seed=1), hashing=Hashing(bins=16))
    c = UpdatePipeline(tiny_t3(torch.float32), LoRAClient(rank=2, seed=2), hashing=Hashing(bins=16))
    assert a.names and all(".lora_A." in n or ".lora_B." in n for n in a.names)
    assert {n.split(".lora_")[0] for n in a.names} == {f"encoder.layers.{i}.linear{j}" for i in (0, 1) for j in (1, 2)}
    assert [name for name, _ in a.spec.parameters] == a.names  # the hash spec (and checkpoints) follow
    assert dict(a.spec.parameters)["encoder.layers.0.linear1.lora_A.default.weight"] == (2, 16)
    # the modules the architecture's default adapts, read off the adapters (what the audit's report names)
    assert adapted_modules(a.names) == ["linear1", "linear2"]
    assert adapted_modules(["encoder.layers.0.linear1.weight"]) == []
    assert a.spec.target_fingerprint == b.spec.target_fingerprint != c.spec.target_fingerprint
    update = a({"input_ids": torch.randint(0, 300, (2, 1, 8))}, keep_update=True).update
    assert update.shape == (2, a.observed_dim) and torch.isfinite(update).all()


def test_lora_gradient_matches_autograd_on_the_peft_model():
    from datamodules.federated.engines.transformer3 import engine_supports

    client = LoRAClient(rank=2, alpha=4.0, seed=0, init_b_std=0.1, local=FedSGDClient("eval", 2))
    model = client.prepare(tiny_t3())
    assert not engine_supports(model)  # the engine would skip the adapters: the generic path runs
    names = client.observed_names(model, ParameterSelection())
    ids = torch.randint(0, 300, (2, 2, 8))
    fast = observe_text(client, model, names, ids)
    loop = observe_text(LoRAClient(local=FedSGDClient("eval", 2, implementation="loop")), model, names, ids)
    assert relative_error(fast, loop) < TOL
    params = dict(model.named_parameters())
    for u in range(2):  # reference: plain autograd through the peft layers
        for p in params.values():
            p.grad = None
        for name in names:
            params[name].requires_grad_(True)
        next_token_loss(model(ids[u]), ids[u]).mean().backward()
        expected = torch.cat([params[n].grad.reshape(-1) for n in names])
        assert relative_error(fast[u], expected) < TOL
    for p in params.values():
        p.requires_grad_(False)


def test_lora_with_zero_b_init_has_zero_a_gradient():
    client = LoRAClient(rank=2, local=FedSGDClient("eval"))
    model = client.prepare(tiny_t3())
    names = client.observed_names(model, ParameterSelection())
    update = observe_text(client, model, names, torch.randint(0, 300, (1, 1, 8)))
    parts = dict(zip(names, update[0].split([dict(model.named_parameters())[n].numel() for n in names])))
    assert all(parts[n].abs().max() == 0 for n in names if ".lora_A." in n)
    assert all(parts[n].abs().max() > 0 for n in names if ".lora_B." in n)


def test_lora_with_fedavg_matches_a_manual_sgd_loop_and_trains_all_adapters():
    client = LoRAClient(rank=2, seed=0, init_b_std=0.1, local=FedAvgClient("eval", 2, local_epochs=2, minibatch_size=1, lr=0.2, shuffle=False))
    model = client.prepare(tiny_t3())
    names = client.observed_names(model, ParameterSelection(preset="layer0_ffn_in"))  # one layer's adapters
    assert len(names) == 2
    ids = torch.randint(0, 300, (2, 2, 8))
    update = observe_text(client, model, names, ids)
    adapters = client.adapter_names(model)
    for u in range(2):
        assert relative_error(update[u], manual_fedavg(model, names, adapters, ids[u], 2, 1, 0.2, 0.0)) < TOL


def test_lora_on_a_gpt2_target(tiny_gpt2):
    client = LoRAClient(rank=2, init_b_std=0.1, local=FedSGDClient("eval"))
    pipe = UpdatePipeline(tiny_gpt2, client, hashing=Hashing(bins=16))
    assert {n.split(".lora_")[0].rsplit(".", 1)[1] for n in pipe.names} == {"c_attn", "c_proj", "c_fc"}
    ids = torch.randint(0, 300, (2, 1, 10))
    fast = pipe({"input_ids": ids}, keep_update=True).update
    loop = observe_text(LoRAClient(local=FedSGDClient("eval", implementation="loop")), pipe.target, pipe.names, ids)
    assert relative_error(fast, loop) < 1e-5


def test_lora_refuses_multihead_attention_and_double_injection():
    with pytest.raises(ValueError, match="nn.MultiheadAttention .* is not supported"):
        LoRAClient(target_modules=["self_attn"]).prepare(tiny_t3())
    with pytest.raises(ValueError, match="nn.MultiheadAttention"):
        LoRAClient(target_modules=["out_proj"]).prepare(tiny_t3())
    model = LoRAClient().prepare(tiny_t3())
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        LoRAClient().prepare(model)
    with pytest.raises(ValueError, match="selects no LoRA adapter"):
        LoRAClient().observed_names(model, ParameterSelection(preset="layer0_norms"))


# ------------------------------------------------------------------------------------------------ presets


def test_presets_resolve_by_name_on_transformer3(tiny_transformer3):
    resolve = lambda preset: ParameterSelection(preset=preset).resolve(tiny_transformer3)  # noqa: E731
    assert resolve("layer0_attn_qkv") == ["encoder.layers.0.self_attn.in_proj_weight", "encoder.layers.0.self_attn.in_proj_bias"]
    assert resolve("layer1_attn_out") == ["encoder.layers.1.self_attn.out_proj.weight", "encoder.layers.1.self_attn.out_proj.bias"]
    assert resolve("layer0_ffn_in") == ["encoder.layers.0.linear1.weight", "encoder.layers.0.linear1.bias"]
    assert resolve("layer1_ffn_out") == ["encoder.layers.1.linear2.weight", "encoder.layers.1.linear2.bias"]
    assert resolve(["layer0_ffn_in", "layer0_ffn_out"]) == resolve("layer0_ffn")
    with pytest.raises(ValueError, match="fuses query/key/value in self_attn.in_proj_weight.*use 'attn_qkv'"):
        resolve("layer0_query")
    with pytest.raises(ValueError, match="matches no parameter"):
        resolve("layer7_ffn_in")
    with pytest.raises(ValueError, match="not of the form layer<i>_<part>"):
        resolve("ffn")
    with pytest.raises(ValueError, match="preset part 'mlp' is unknown"):
        resolve("layer0_mlp")
    with pytest.raises(ValueError, match="not both"):
        ParameterSelection(include=["encoder.*"], preset="layer0_ffn_in")


def test_presets_resolve_on_gpt2_llama_and_bert(tiny_gpt2):
    from datamodules.targets.hf_encoder import HFEncoderLM

    assert ParameterSelection(preset="layer1_attn_qkv").resolve(tiny_gpt2) == [
        "model.transformer.h.1.attn.c_attn.weight", "model.transformer.h.1.attn.c_attn.bias"]
    assert ParameterSelection(preset="layer0_ffn_out").resolve(tiny_gpt2) == [
        "model.transformer.h.0.mlp.c_proj.weight", "model.transformer.h.0.mlp.c_proj.bias"]
    with pytest.raises(ValueError, match="GPT-2 fuses"):
        preset_patterns(tiny_gpt2, "layer0_key")
    llama = HFCausalLM(architecture="llama", config=dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, num_key_value_heads=2, vocab_size=300, max_position_embeddings=16))
    assert ParameterSelection(preset="layer0_key").resolve(llama) == ["model.model.layers.0.self_attn.k_proj.weight"]
    assert ParameterSelection(preset="layer0_ffn_in").resolve(llama) == [
        "model.model.layers.0.mlp.gate_proj.weight", "model.model.layers.0.mlp.up_proj.weight"]
    bert = HFEncoderLM(architecture="bert", config=dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32,
                       num_attention_heads=2, vocab_size=300, max_position_embeddings=16))
    assert ParameterSelection(preset="layer0_query").resolve(bert) == [
        "model.encoder.layer.0.attention.self.query.weight", "model.encoder.layer.0.attention.self.query.bias"]
    assert ParameterSelection(preset="layer0_ffn_out").resolve(bert) == [
        "model.encoder.layer.0.output.dense.weight", "model.encoder.layer.0.output.dense.bias"]


# ------------------------------------------------------------------------------------------------ DP accounting


def test_dp_epsilon_matches_opacus_and_is_monotone_in_sigma():
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.step(noise_multiplier=1.1, sample_rate=0.25)
    for _ in range(7):
        accountant.step(noise_multiplier=1.1, sample_rate=0.25)
    assert dp_epsilon(1.1, 0.25, 8, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    epsilons = [dp_epsilon(s, 0.5, 4, 1e-5) for s in (0.3, 0.5, 1.0, 2.0, 4.0)]
    assert all(a > b for a, b in zip(epsilons, epsilons[1:]))
    assert dp_epsilon(0.0, 1.0, 1, 1e-5) == math.inf
    with pytest.raises(ValueError, match="accountant 'moments' is not allowed"):
        dp_epsilon(1.0, 0.5, 4, 1e-5, "moments")


def test_protocols_report_their_dp_steps():
    assert FedSGDClient(samples_per_update=4).privacy_steps() == (1, 1.0)
    assert FedAvgClient(samples_per_update=5, local_epochs=3, minibatch_size=2).privacy_steps() == (9, 0.4)
    assert LoRAClient(local=FedAvgClient(samples_per_update=4, minibatch_size=4)).privacy_steps() == (1, 1.0)
    privacy = DPSGD(1.0, 1.0, target_delta=1e-6).privacy(*FedAvgClient(samples_per_update=4, minibatch_size=1).privacy_steps())
    assert privacy["epsilon"] == pytest.approx(dp_epsilon(1.0, 0.25, 4, 1e-6)) and privacy["steps"] == 4
    assert NoDefense().privacy(1, 1.0) is None and GaussianNoise(0.1).privacy(1, 1.0) is None
    assert Compose([DPSGD(1.0, 0.0), Sign()]).privacy(1, 1.0)["epsilon"] == "inf"


# ------------------------------------------------------------------------------------------------ CLI


@pytest.mark.parametrize("overlays, client", [
    (["protocols/fedavg.yaml", "defenses/dpsgd.yaml"], "fedavg"),
    (["protocols/lora.yaml"], "lora"),
])
def test_tiny_fit_with_protocol_overlays(make_config, tmp_path, overlays, client):
    from conftest import REPO

    from lti.cli import main

    overrides = {"trainer.max_steps": 2, "trainer.val_check_interval": 2, "data.eval_samples": 8}
    if client == "fedavg":  # partial observation by preset, from the config
        overrides["data.observed"] = {"class_path": "datamodules.federated.ParameterSelection",
                                      "init_args": {"preset": ["layer0_ffn_in", "layer0_attn_out"]}}
    config = make_config(**overrides)
    args = ["fit", "--config", str(config)]
    for overlay in overlays:
        args += ["--config", str(REPO / "configs" / overlay)]
    main(args)
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    setting, spec = state["lti"]["setting"], state["lti"]["hash_spec"]
    assert setting["client"]["name"] == client
    names = [name for name, _ in spec["parameters"]]
    if client == "lora":
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert setting["client"]["local"]["name"] == "fedsgd"
    else:
        assert setting["samples_per_update"] == 4
        assert names == ["encoder.layers.0.self_attn.out_proj.weight", "encoder.layers.0.self_attn.out_proj.bias",
                         "encoder.layers.0.linear1.weight", "encoder.layers.0.linear1.bias"]
        # DP-SGD over FedAvg: E * ceil(n / B) = 2 noisy steps at sample rate B / n = 0.5
        privacy = setting["privacy"]
        assert (privacy["steps"], privacy["sample_rate"]) == (2, 0.5)
        assert privacy["epsilon"] == pytest.approx(dp_epsilon(0.1, 0.5, 2, 1e-5))


def test_model_mode_restores_each_module_s_own_mode_also_on_an_error():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5), torch.nn.Sequential(torch.nn.Dropout()))
    model.train()
    model[1].eval()  # a part the caller keeps in eval: `model.train(was_training)` would switch it back on
    modes = [m.training for m in model.modules()]
    with model_mode(model, "eval"):
        assert not any(m.training for m in model.modules())
    assert [m.training for m in model.modules()] == modes
    with pytest.raises(RuntimeError, match="inside"), model_mode(model, "train"):
        assert all(m.training for m in model.modules())
        raise RuntimeError("inside")
    assert [m.training for m in model.modules()] == modes
    with pytest.raises(ValueError, match="must be 'train' or 'eval'"), model_mode(model, "test"):
        pass
