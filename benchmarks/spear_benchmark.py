"""SPEAR on real client updates: transformer3's first FFN, and the FCNN's first layer on digits, MNIST 5k, Adult.

Each row attacks `--batches` client updates (FedSGD, eval-mode client, no defense) computed by the
project's own pipelines (`UpdatePipeline`, with the next-token loss for text and the classification loss for images/tables), observing
only the attacked layer (partial observation by name). Reported per row: updates certified exact by
SPEAR's sparsity-matching certificate, true layer-input rows recovered (best cosine > 0.999), PSNR on
certified image batches (inputs in [0, 1]), discrete accuracy (argmax per one-hot group) and the mean
absolute error of continuous columns in original units for Adult, and seconds per batch.

    OMP_NUM_THREADS=1 python -m benchmarks.spear_benchmark --rows transformer3 digits:10 mnist5k:10 adult:16 \\
        --batches 10 --out benchmarks/results/spear_cpu.md

A row is `name` or `name:B` (B = samples per client update; for transformer3, B = 16-token sequences,
default 1). `--prior` guides SPEAR with the server's auxiliary data (see `exact.spear.prior.guided`).

`--fedavg E:b:lr` makes the image/table clients FedAvg clients (`FedAvgClient` with the classification loss: E local epochs
over their B samples in minibatches of b, SGD with lr, the whole model trained, eval mode); SPEAR
attacks the pseudo-gradient delta / (steps x lr). `--client-dtype float32|float64` sets the
arithmetic of the local training (float32: what clients run; float64: exact deltas).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from datamodules.federated import (
    ClassificationLoss,
    FedAvgClient,
    FedSGDClient,
    Hashing,
    ParameterSelection,
    UpdatePipeline,
)
from exact.spear import Sampling, SearchBudget, Spear, relu_linear_layer


def layer_inputs(model, layer, model_input):
    seen = []
    handle = layer.module.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    model.eval()
    with torch.no_grad():
        model(model_input)
    handle.remove()
    return seen[0].reshape(-1, layer.module.in_features).double()


def match(truth, recovered):
    if recovered.shape[0] == 0:
        return torch.zeros(truth.shape[0], dtype=torch.float64), None
    cos = torch.nn.functional.normalize(truth, dim=1) @ torch.nn.functional.normalize(recovered.double(), dim=1).T
    best, index = cos.max(dim=1)
    return best, recovered.double()[index]


def text_row(args, attack, sequences=1):
    from datamodules.targets import Transformer3

    model = Transformer3()
    name = "encoder.layers.0.linear1"
    layer = relu_linear_layer(model, name)
    pipeline = UpdatePipeline(model, client=FedSGDClient(mode="eval", samples_per_update=sequences),
                              observed=ParameterSelection(include=[f"{name}.*"]), hashing=Hashing(bins=64))
    gen = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(0, model.vocab_size, (args.batches, sequences, 16), generator=gen)  # random 16-token sequences
    parts = pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update)
    # The prior: layer inputs of other random sequences (the client data are random tokens too).
    prior = layer_inputs(model, layer, torch.randint(0, model.vocab_size, (256, 16), generator=gen)) if args.prior else None
    records = []
    for u in range(args.batches):
        truth = layer_inputs(model, layer, ids[u])
        result = attack.attack(parts[layer.weight_name][u], parts[layer.bias_name][u], batch_size=truth.shape[0],
                               weight=layer.module.weight, bias=layer.module.bias, prior=prior)
        best, _ = match(truth, result.inputs)
        records.append({"exact": result.exact, "rows": float((best > 0.999).double().mean()), "seconds": result.diagnostics["seconds"],
                        "samples": result.diagnostics["samples"], "reason": result.reason,
                        "guesses": result.diagnostics.get("prior_guesses", 0)})
    return f"transformer3 `{name}`, {sequences} x 16 tokens", 16 * sequences, records


def vision_row(args, attack, dataset, batch):
    from datamodules.targets.vision import FCNN
    from datamodules.vision import load_vision_dataset

    data = load_vision_dataset(dataset)
    split = data.splits["test"]
    model = FCNN(input_shape=data.input_shape, num_classes=data.num_classes, hidden=args.hidden, num_layers=args.layers)
    name = model.linear_names[0]
    layer = relu_linear_layer(model, name)
    if args.fedavg:
        epochs, minibatch, lr = args.fedavg.split(":")
        client = FedAvgClient(samples_per_update=batch, local_epochs=int(epochs), minibatch_size=int(minibatch), lr=float(lr),
                                    trainable=["*"], mode="eval", dtype=args.client_dtype)
    else:
        client = FedSGDClient(samples_per_update=batch, mode="eval")
    pipeline = UpdatePipeline(model, client, observed=ParameterSelection(include=[f"{name}.*"]), hashing=Hashing(bins=64),
                              loss=ClassificationLoss())
    gen = torch.Generator().manual_seed(args.seed)
    # Disjoint batches while the split allows it, else independent random batches (distinct samples within each).
    if args.batches * batch <= len(split):
        order = torch.randperm(len(split), generator=gen)[: args.batches * batch].view(args.batches, batch)
    else:
        order = torch.stack([torch.randperm(len(split), generator=gen)[:batch] for _ in range(args.batches)])
    inputs, labels = split.inputs[order], split.labels[order]
    # FedSGD: the gradient; FedAvg: the pseudo-gradient delta / (steps x lr), as the exact-attack callbacks do.
    parts = pipeline.split(pipeline({"inputs": inputs, "labels": labels}, keep_update=True).update * client.gradient_scale())
    # The server's auxiliary data (the train split; the attacked updates come from the test split),
    # flattened: the first layer's inputs. Only with --prior.
    prior = data.splits["train"].inputs.reshape(len(data.splits["train"]), -1) if args.prior else None
    records = []
    for u in range(args.batches):
        truth = inputs[u].reshape(batch, -1).double()
        result = attack.attack(parts[layer.weight_name][u], parts[layer.bias_name][u], batch_size=batch,
                               weight=layer.module.weight, bias=layer.module.bias, prior=prior)
        best, matched = match(truth, result.inputs)
        record = {"exact": result.exact, "rows": float((best > 0.999).double().mean()),
                  "seconds": result.diagnostics["seconds"], "samples": result.diagnostics["samples"], "reason": result.reason,
                  "guesses": result.diagnostics.get("prior_guesses", 0)}
        if matched is not None and data.kind == "image":
            mse = ((matched - truth) ** 2).mean(dim=1).clamp_min(1e-30)
            record["psnr"] = float((10 * torch.log10(1.0 / mse)).mean())
        if matched is not None and data.kind == "table":
            correct = total = 0
            errors = []
            raw_true, raw_pred = data.destandardize(truth.float()).double(), data.destandardize(matched.float()).double()
            for column in data.columns:
                if column.kind == "discrete":
                    correct += int((matched[:, column.slice].argmax(1) == truth[:, column.slice].argmax(1)).sum())
                    total += batch
                else:
                    errors.append((raw_pred[:, column.slice] - raw_true[:, column.slice]).abs().mean().item())
            record["discrete_acc"] = correct / total
            record["mae"] = statistics.mean(errors)
        records.append(record)
    protocol = f", FedAvg E={client.local_epochs} b={client.minibatch_size} lr={client.lr} {client.dtype}" if args.fedavg else ""
    return f"FCNN {args.layers}x{args.hidden} `{name}`, {dataset}{protocol}", batch, records


def summarise(label, batch, records):
    exact = [r for r in records if r["exact"]]
    seconds = [r["seconds"] for r in records]
    row = {
        "row": label, "B": batch, "batches": len(records),
        "certified": f"{len(exact)}/{len(records)} ({100 * len(exact) / len(records):.0f}%)",
        "rows_recovered": f"{100 * statistics.mean(r['rows'] for r in records):.1f}%",
        "psnr_exact": "-", "discrete_acc": "-", "mae": "-",
        "s_per_batch": f"{statistics.mean(seconds):.2f} (max {max(seconds):.1f})",
        "samples": f"{statistics.mean(r['samples'] for r in records):,.0f}",
        "prior_guesses": f"{statistics.mean(r['guesses'] for r in records):,.0f}",
    }
    psnr = [r["psnr"] for r in exact if "psnr" in r]
    if psnr:
        row["psnr_exact"] = f"{statistics.mean(psnr):.1f} (min {min(psnr):.1f})"
    if "discrete_acc" in records[0]:
        row["discrete_acc"] = f"{100 * statistics.mean(r['discrete_acc'] for r in records):.2f}%"
        row["mae"] = f"{statistics.mean(r['mae'] for r in records):.3g}"
    reasons = sorted({r["reason"].split(":")[0] for r in records if r["reason"]})
    row["not exact because"] = "; ".join(reasons) or "-"
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="+", default=["transformer3", "digits:10", "mnist5k:10", "adult:16"])
    parser.add_argument("--batches", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=200)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--max-seconds", type=float, default=None, help="per-attack wall-clock budget")
    parser.add_argument("--max-samples", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prior", action="store_true",
                        help="guide SPEAR with the train split as the server's auxiliary data (images/tables)")
    parser.add_argument("--fedavg", metavar="E:b:lr", default=None,
                        help="image/table clients run FedAvg: E local epochs, minibatches of b, learning rate lr")
    parser.add_argument("--client-dtype", choices=["float32", "float64"], default="float32",
                        help="arithmetic of the FedAvg clients' local training")
    parser.add_argument("--out", type=Path, default=None, help="append a markdown table here")
    args = parser.parse_args(argv)
    attack = Spear(SearchBudget(max_samples=args.max_samples, max_seconds=args.max_seconds), Sampling(seed=args.seed))
    rows, skipped = [], []
    for spec in args.rows:
        name, _, size = spec.partition(":")
        start = time.perf_counter()
        try:
            if name == "transformer3":
                label, batch, records = text_row(args, attack, int(size or 1))
            else:
                label, batch, records = vision_row(args, attack, name, int(size or 20))
        except ModuleNotFoundError as error:  # an optional data package: skip the row, keep the others
            print(f"(skipping {spec}: {error})", flush=True)
            skipped.append(spec)
            continue
        rows.append(summarise(label, batch, records))
        print(rows[-1], f"[{time.perf_counter() - start:.0f} s]", flush=True)
    if not rows:
        print(f"no row ran (skipped: {', '.join(skipped)})")
        return
    keys = list(rows[0])
    table = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    table += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    header = (f"\n### {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
              f"`{' '.join(['python', '-m', 'benchmarks.spear_benchmark', *(argv if argv is not None else sys.argv[1:])])}`"
              f" (torch {torch.__version__}, {torch.get_num_threads()} thread(s), {platform.processor() or platform.machine()}, "
              f"{attack!r}, max_seconds={args.max_seconds})\n\n")
    text = header + "\n".join(table) + "\n" + (f"\nSkipped (optional package missing): {', '.join(skipped)}\n" if skipped else "")
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
