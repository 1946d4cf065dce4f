"""Seconds per inverter loss (forward + backward) for the two logits layouts of the cross-entropy.

The inverter's logits are (U, P, V): U updates, P = sequences per update x sequence length
positions, V tokens. `lti.loss.position_loss` flattens them to (U * P, V) for `cross_entropy`;
the alternative (used before) transposes them to (U, V, P), which puts the class dimension at a
stride of P. Both give the same loss; this prints how long each takes, and the relative difference
of their losses and logit gradients.

    python -m benchmarks.inverter_loss                       # FedAvg cell: U=32, P=64, V=50257
    python -m benchmarks.inverter_loss --positions 16        # FedSGD cell: one 16-token sequence

No model is involved: random logits stand in for the inverter's output.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lti.loss import position_loss


def transposed_loss(logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The (U, V, P) layout: cross_entropy over dimension 1 of the transposed logits."""
    per_position = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
    return (per_position * mask).sum() / mask.sum().clamp_min(1)


LAYOUTS = {"flat (U*P, V)": position_loss, "transposed (U, V, P)": transposed_loss}


def time_layout(loss_fn, logits: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, repeats: int):
    """Median seconds of forward + backward over `repeats` runs (after one warm-up); the last loss and gradient."""
    times = []
    for i in range(repeats + 1):
        logits.grad = None
        start = time.perf_counter()
        loss = loss_fn(logits, target, mask)
        loss.backward()
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), loss.detach(), logits.grad.clone()


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=32, help="U, updates per training batch")
    parser.add_argument("--positions", type=int, default=64, help="P, positions per update")
    parser.add_argument("--vocab", type=int, default=50257, help="V, vocabulary size")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if min(args.updates, args.positions, args.vocab, args.repeats) < 1:
        parser.error("--updates, --positions, --vocab and --repeats must be >= 1")

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(args.updates, args.positions, args.vocab, generator=generator).requires_grad_(True)
    target = torch.randint(0, args.vocab, (args.updates, args.positions), generator=generator)
    mask = torch.ones(args.updates, args.positions)
    print(f"U={args.updates} P={args.positions} V={args.vocab}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| layout | s (fwd + bwd, median) | loss rel. diff | grad max abs diff |")
    print("|---|---|---|---|")
    rows, reference = [], None
    for name, loss_fn in LAYOUTS.items():
        seconds, loss, grad = time_layout(loss_fn, logits, target, mask, args.repeats)
        if reference is None:
            reference = (loss, grad)
        row = {
            "layout": name, "seconds": seconds,
            "loss_rel_diff": ((loss - reference[0]).abs() / reference[0].abs()).item(),
            "grad_max_diff": (grad - reference[1]).abs().max().item(),
        }
        rows.append(row)
        print(f"| {name} | {seconds:.3f} | {row['loss_rel_diff']:.1e} | {row['grad_max_diff']:.1e} |")
    return rows


if __name__ == "__main__":
    main()
