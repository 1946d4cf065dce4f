"""FedAvg clients of image/table classifiers, checked against `torch.optim.SGD` on a model copy; SPEAR on their deltas."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
from conftest import observe_images, per_example_images

from datamodules.federated import DPSGD, ClassificationLoss, FedAvgClient, FedSGDClient, Hashing, Sign, UpdatePipeline
from datamodules.targets.vision import FCNN

needs_sklearn = pytest.mark.skipif(importlib.util.find_spec("sklearn") is None, reason="sklearn not installed")


def relative_error(a, b):
    return float((a - b).norm() / b.norm())


def tiny_fcnn(dtype=torch.float64):
    return FCNN(input_shape=(1, 4, 4), num_classes=3, hidden=12, num_layers=3).to(dtype)


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def manual_fedavg(model, inputs, labels, epochs, batch, lr, momentum=0.0, orders=None, clip=None):
    """Reference: one client, a copy of the model, torch.optim.SGD on the mean minibatch loss.
    With `clip`: DP-SGD without noise, each sample's gradient clipped to `clip` (per-sample autograd)."""
    local = copy.deepcopy(model)
    optimiser = torch.optim.SGD(local.parameters(), lr=lr, momentum=momentum)
    start = flat(local).clone()
    n = labels.shape[0]
    for epoch in range(epochs):
        order = torch.arange(n) if orders is None else orders[epoch]
        for s in range(math.ceil(n / batch)):
            index = order[s * batch : (s + 1) * batch]
            optimiser.zero_grad()
            if clip is None:
                torch.nn.functional.cross_entropy(local(inputs[index]), labels[index]).backward()
            else:
                rows = []
                for i in index:
                    grads = torch.autograd.grad(torch.nn.functional.cross_entropy(local(inputs[i : i + 1]), labels[i : i + 1]), list(local.parameters()))
                    g = torch.cat([x.reshape(-1) for x in grads])
                    rows.append(g * min(1.0, clip / g.norm().item()))
                step, offset = torch.stack(rows).mean(0), 0
                for p in local.parameters():
                    p.grad = step[offset : offset + p.numel()].view_as(p).clone()
                    offset += p.numel()
            optimiser.step()
    return start - flat(local)


def data(updates=2, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(updates, n, 1, 4, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (updates, n), generator=gen)


@pytest.mark.parametrize("epochs, batch, momentum", [(1, 1, 0.0), (2, 2, 0.0), (2, 3, 0.9)])
def test_vision_fedavg_delta_matches_a_manual_sgd_loop(epochs, batch, momentum):
    model = tiny_fcnn()
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    client = FedAvgClient(samples_per_update=4, local_epochs=epochs, minibatch_size=batch, lr=0.3, momentum=momentum, shuffle=False,
                                mode="eval", dtype="float64")
    update = observe_images(client, model, names, inputs, labels)
    assert update.shape == (2, sum(p.numel() for p in model.parameters()))
    for u in range(2):
        assert relative_error(update[u].double(), manual_fedavg(model, inputs[u], labels[u], epochs, batch, 0.3, momentum)) < 1e-6


def test_vision_fedavg_shuffles_per_client_from_the_generator():
    model = tiny_fcnn()
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    client = FedAvgClient(samples_per_update=4, local_epochs=2, minibatch_size=2, lr=0.3, mode="eval", dtype="float64")
    update = observe_images(client, model, names, inputs, labels, generator=torch.Generator().manual_seed(5))
    replay = torch.Generator().manual_seed(5)
    orders = [client.minibatch_order(2, replay, torch.device("cpu")) for _ in range(2)]
    for u in range(2):
        expected = manual_fedavg(model, inputs[u], labels[u], 2, 2, 0.3, orders=[orders[0][u], orders[1][u]])
        assert relative_error(update[u].double(), expected) < 1e-6
    unshuffled = FedAvgClient(samples_per_update=4, local_epochs=2, minibatch_size=2, lr=0.3, mode="eval", dtype="float64", shuffle=False)
    assert relative_error(observe_images(unshuffled, model, names, inputs, labels), update) > 1e-6


def test_one_full_minibatch_is_lr_times_the_fedsgd_gradient_and_gradient_scale_undoes_it():
    model = tiny_fcnn()
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    fedsgd = per_example_images(FedSGDClient(samples_per_update=4, mode="eval"), model, names, inputs, labels).mean(dim=1)
    client = FedAvgClient(samples_per_update=4, local_epochs=1, minibatch_size=4, lr=0.2, mode="eval", dtype="float64")
    update = observe_images(client, model, names, inputs, labels)
    assert client.local_steps() == 1 and client.gradient_scale() == pytest.approx(5.0)
    assert relative_error(update.double() * client.gradient_scale(), fedsgd) < 1e-6
    five = FedAvgClient(samples_per_update=5, local_epochs=3, minibatch_size=2, lr=0.1)
    assert five.local_steps() == 9 and five.privacy_steps() == (9, 0.4)
    assert FedSGDClient().local_steps() == 1 and FedSGDClient().gradient_scale() == 1.0


def test_float32_deltas_lose_digits_to_cancellation_float64_deltas_do_not():
    """w_start - w_end in float32 keeps only the digits |lr x g| has below |w|: the reason the client
    has a dtype (exact attacks that need exact zeros, SPEAR, fail on float32 deltas)."""
    model = tiny_fcnn(torch.float32)
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    exact = manual_fedavg(copy.deepcopy(model).double(), inputs[0], labels[0], 2, 2, 1e-3)  # exact arithmetic
    kwargs = dict(local_epochs=2, minibatch_size=2, lr=1e-3, shuffle=False, mode="eval")
    f64 = observe_images(FedAvgClient(samples_per_update=4, dtype="float64", **kwargs), model, names, inputs.float(), labels)
    f32 = observe_images(FedAvgClient(samples_per_update=4, dtype="float32", **kwargs), model, names, inputs.float(), labels)
    assert f64.dtype == f32.dtype == torch.float32  # the update the server sees is float32 either way
    assert relative_error(f64[0].double(), exact) < 1e-6
    assert relative_error(f32[0].double(), exact) > 1e-5


def test_dpsgd_clips_every_sample_at_every_local_step_and_other_defenses_act_on_the_delta():
    model = tiny_fcnn()
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    client = FedAvgClient(samples_per_update=4, local_epochs=2, minibatch_size=2, lr=0.5, shuffle=False, mode="eval", dtype="float64")
    clipped = observe_images(client, model, names, inputs, labels, defense=DPSGD(0.05, 0.0))
    for u in range(2):
        expected = manual_fedavg(model, inputs[u], labels[u], 2, 2, 0.5, clip=0.05)
        assert relative_error(clipped[u].double(), expected) < 1e-6
    assert DPSGD().privacy(*client.privacy_steps())["steps"] == 4
    raw = observe_images(client, model, names, inputs, labels)
    assert torch.equal(observe_images(client, model, names, inputs, labels, defense=Sign()), torch.sign(raw))


@pytest.mark.parametrize("defense", [None, DPSGD(0.05, 0.0)], ids=["delta", "dpsgd-per-sample"])
def test_vision_fedavg_vmap_engines_match_the_loop_reference(defense):
    """The image/table group engines (vmap over clients; nested vmap for DP-SGD's per-sample
    gradients) against one forward/backward per sample at every client's own weights."""
    model = tiny_fcnn()
    names = [n for n, _ in model.named_parameters()]
    inputs, labels = data()
    kwargs = dict(samples_per_update=4, local_epochs=2, minibatch_size=2, lr=0.3, shuffle=False, mode="eval")
    fast = observe_images(FedAvgClient(**kwargs), model, names, inputs, labels, defense=defense)
    slow = observe_images(FedAvgClient(**kwargs, implementation="loop"), model, names, inputs, labels, defense=defense)
    assert relative_error(fast.double(), slow.double()) < 1e-10


def test_vision_fedavg_rejects_bad_arguments_in_one_line():
    with pytest.raises(ValueError, match="samples_per_update=0 must be >= 1"):
        FedAvgClient(samples_per_update=0)
    with pytest.raises(ValueError, match="FedAvg lr=0.0 must be a finite number > 0"):
        FedAvgClient(lr=0.0)
    with pytest.raises(ValueError, match="client dtype 'float16' is not allowed"):
        FedAvgClient(dtype="float16")
    model = tiny_fcnn()
    inputs, labels = data(n=3)
    with pytest.raises(ValueError, match="batch has 3 samples per update, client expects 4"):
        observe_images(FedAvgClient(samples_per_update=4), model, [n for n, _ in model.named_parameters()], inputs, labels)


def test_pipeline_hashes_the_fedavg_delta_and_names_a_non_finite_parameter():
    model = tiny_fcnn(torch.float32)
    client = FedAvgClient(samples_per_update=4, local_epochs=1, minibatch_size=2, lr=0.1, shuffle=False, mode="eval")
    pipeline = UpdatePipeline(model, client, hashing=Hashing(fraction=0.5), loss=ClassificationLoss())
    inputs, labels = data()
    observed = pipeline({"inputs": inputs.float(), "labels": labels}, keep_update=True)
    torch.testing.assert_close(observed.update, observe_images(client, model, pipeline.names, inputs.float(), labels))
    torch.testing.assert_close(observed.features, pipeline.hasher(observed.update))
    with pytest.raises(FloatingPointError, match="non-finite client update .* in parameter 'layers.0.weight'"):
        pipeline({"inputs": torch.full_like(inputs.float(), float("nan")), "labels": labels})


# ------------------------------------------------------------------------------------------- through the CLI
def _config(tmp_path, client, **data):
    import yaml

    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 2, "logger": False, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path / "run"), "val_check_interval": 2, "num_sanity_val_steps": 0,
                    "enable_model_summary": False},
        "model": {"class_path": "lti.vision_module.ImageInversionModule", "init_args": {
            "inverter": {"class_path": "lti.vision_module.ImageMLPInverter", "init_args": {"hidden": 32}}, "grid_samples": 4}},
        "data": {"class_path": "datamodules.vision_inversion.ImageInversionDataModule", "init_args": {
            "dataset": "digits",
            "target": {"class_path": "datamodules.targets.vision.FCNN", "init_args": {"input_shape": [1, 8, 8], "hidden": 64, "num_layers": 3}},
            "client": {"class_path": "datamodules.federated.FedAvgClient", "init_args": client},
            "batch_size": 4, "train_samples": 64, "eval_samples": 16, **data}},
        "checkpoint": {"dirpath": str(tmp_path / "ckpt")},
        "results": {"print_table": False},
    }
    path = tmp_path / "vision_fedavg.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@needs_sklearn
def test_spear_recovers_images_from_float64_fedavg_deltas_through_the_callback(tmp_path):
    """The FCNN's first layer sees the raw images at every local step, so the FedAvg pseudo-gradient
    delta / (steps x lr) keeps SPEAR's low-rank, ReLU-sparse structure (2 images, E = 2, B = 1)."""
    from lti.cli import main

    client = {"samples_per_update": 2, "local_epochs": 2, "minibatch_size": 1, "lr": 0.01, "dtype": "float64", "mode": "eval"}
    main(["test", "--config", _config(tmp_path, client), "--config", "configs/exact/spear_fcnn.yaml",
          "--trainer.callbacks.init_args.attack.init_args.budget.max_seconds", "5", "--data.init_args.eval_samples", "8"])
    result = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    metrics = result["metrics"]
    assert result["setting"]["client"]["name"] == "fedavg"
    assert (result["setting"]["client"]["samples_per_update"], result["setting"]["client"]["local_epochs"]) == (2, 2)
    assert metrics["test/spear/rows_recovered"] == pytest.approx(1.0)
    assert metrics["test/spear/psnr"] > 100.0


@needs_sklearn
def test_vision_lti_trains_on_fedavg_updates_and_reports_the_dp_epsilon(tmp_path, capsys):
    from lti.cli import main

    client = {"samples_per_update": 4, "local_epochs": 2, "minibatch_size": 2}
    config = _config(tmp_path, client)
    main(["fit", "--config", config, "--config", "configs/defenses/dpsgd.yaml"])
    state = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    privacy = state["lti"]["setting"]["privacy"]
    assert privacy["steps"] == 4 and privacy["sample_rate"] == 0.5
    assert privacy["epsilon"] == pytest.approx(DPSGD().privacy(4, 0.5)["epsilon"])
    # The client carries its own samples per update: a disagreeing (deprecated) datamodule value is one line.
    with pytest.raises(SystemExit), pytest.warns(FutureWarning, match="data.samples_per_update is deprecated"):
        main(["validate", "--config", config, "--data.init_args.samples_per_update", "3"])
    assert "data.samples_per_update=3 disagree with the client" in capsys.readouterr().err
