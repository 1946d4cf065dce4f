"""How large is a client update next to the noise a defense adds? One row per protocol of a grid.

For every protocol of a matrix grid (its base configs, the protocol's overlays, the grid's overrides,
no defense), this builds the text datamodule exactly as the grid's `lti` runs do, computes the
undefended updates of the first `--updates` held-out clients and prints the observed dimension D, the
median update norm ||u|| and its per-coordinate RMS ||u|| / sqrt(D). Then, per noise level sigma:

* Gaussian noise N(0, sigma^2) per coordinate has norm about sigma * sqrt(D): the column gives
  ||u|| / (sigma * sqrt(D)), the update's norm in units of the noise's (FedAvg: both in weight units,
  as the defense acts on the delta).
* DP-SGD (clip C) clips every sequence's gradient to norm <= C and adds N(0, sigma^2 C^2) per
  coordinate, so at every step the signal-to-noise norm ratio is at most 1 / (sigma * sqrt(D)),
  whatever the update's scale: that bound is printed too.

    python -m benchmarks.update_scale --grid configs/matrix/issue5.yaml --sigma 0.01 0.1 0.5

No model is trained; each protocol costs one batch of updates (FedAvg: several local steps).
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time

import torch


def protocol_updates(grid, protocol, updates: int) -> torch.Tensor:
    """The undefended (U, D) updates of the first `updates` held-out clients under `protocol`."""
    from datamodules.text_inversion import TextInversionDataModule
    from lti.matrix import Entry, cell_commands
    from lti.module import InversionModule
    from lti.trainer_cli import LTICLI, trainer_defaults

    no_defense = Entry("none", configs=["configs/defenses/none.yaml"])
    fit_args = cell_commands(grid, protocol, no_defense, Entry("lti"))[0][1:]
    fit_args += ["--data.eval_samples", "null", "--data.batch_size", str(updates)]  # the first batch: U updates
    argv, sys.argv = sys.argv, sys.argv[:1]  # the CLI warns when it sees this script's own arguments too
    try:
        cli = LTICLI(InversionModule, TextInversionDataModule, trainer_defaults=trainer_defaults(), run=False,
                     args=fit_args, save_config_callback=None)
    finally:
        sys.argv = argv
    data = cli.datamodule
    data.prepare_data()
    data.setup("test")
    batch = next(iter(data.test_dataloader()))
    torch.manual_seed(0)  # dropout masks and FedAvg shuffling
    return data.pipeline(data.client_batch(batch), keep_update=True).update


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="configs/matrix/issue5.yaml", help="matrix grid whose protocols to measure")
    parser.add_argument("--protocols", nargs="+", help="only these protocols of the grid")
    parser.add_argument("--sigma", nargs="+", type=float, default=[0.01, 0.1, 0.5], help="noise levels")
    parser.add_argument("--updates", type=int, default=32, help="client updates per protocol")
    args = parser.parse_args(argv)
    if args.updates < 1 or any(not (s > 0 and math.isfinite(s)) for s in args.sigma):
        parser.error("--updates must be >= 1 and every --sigma a finite number > 0")

    import lightning.pytorch  # noqa: F401  (sets its loggers to INFO on import: quiet them after it)

    from lti.matrix import load_grid, select_cells

    for logger in ("lightning.pytorch", "lightning.fabric"):  # no trainer banners between the table rows
        logging.getLogger(logger).setLevel(logging.WARNING)

    grid = load_grid(args.grid, out_dir="/tmp/lti-update-scale")
    protocols = {p.name: p for p, _, _ in select_cells(grid, {"protocol": args.protocols or []})}
    header = ["protocol", "D", "median ‖u‖", "RMS per coordinate"]
    header += [f"‖u‖ / (σ√D), σ={s:g}" for s in args.sigma] + [f"DP-SGD bound, σ={s:g}" for s in args.sigma]
    print(f"grid {args.grid}, {args.updates} held-out client updates per protocol, no defense, torch {torch.__version__}")
    print("| " + " | ".join(header) + " | s |")
    print("|" + "---|" * (len(header) + 1))
    for name, protocol in protocols.items():
        start = time.perf_counter()
        update = protocol_updates(grid, protocol, args.updates).double()
        dim = update.shape[1]
        norm = update.norm(dim=1).median().item()
        cells = [name, f"{dim:,}", f"{norm:.3g}", f"{norm / math.sqrt(dim):.2e}"]
        cells += [f"{norm / (s * math.sqrt(dim)):.3g}" for s in args.sigma]
        cells += [f"{1 / (s * math.sqrt(dim)):.3g}" for s in args.sigma]
        print("| " + " | ".join(cells) + f" | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
