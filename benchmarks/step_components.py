"""Seconds per training step by component: client updates (+ defense), hashing, reading cached
features, inverter forward + loss, backward, optimizer step; for the old and the new training path.

    python -m benchmarks.step_components --repeats 5
    python -m benchmarks.step_components --variants mlp embedding:bf16 embedding-sampled:bf16:fused --defense sign

Builds the text DataModule on the embedded corpus (step cost does not depend on the text), draws one
batch of `--batch` auxiliary blocks, and times each component separately (median of `--repeats`
after one warm-up), single process, on the CPU by default. `update` is the client protocol's
gradients of the batch with the defense (it acts on per-example gradients inside the protocol);
`hash` is the FeatureHasher on them; `cached features` reads a batch of random rows from a float16
memmap in the page cache (what the observation cache costs instead of update + hash).

A variant is `inverter[:bf16][:fused]`: `mlp` (the paper's MLP inverter), `embedding` (the
embedding-scored head), `embedding-sampled` (the same head, scoring the batch's tokens plus 4,096
sampled negatives in training, lti.loss); `bf16` autocast; `fused` the fused Adam kernel with
gradients zeroed in place (without it: torch's default multi-tensor Adam, gradients freed). The
old path is `mlp` (paper config) and `embedding` (quickstart); the new one
`embedding-sampled:bf16:fused` (configs/reproduction/).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(fn, repeats: int) -> tuple[float, object]:
    fn()  # warm-up (allocations, oneDNN primitive creation)
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def cache_read_seconds(rows: int, bins: int, batch: int, repeats: int) -> float:
    """Seconds to read `batch` random rows of a (rows, bins) float16 memmap and scale them to float32."""
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as folder:
        table = np.lib.format.open_memmap(f"{folder}/features.npy", mode="w+", dtype=np.float16, shape=(rows, bins))
        table[:] = 1.0
        table.flush()
        cached = np.load(f"{folder}/features.npy", mmap_mode="r")
        scales = torch.ones(rows)
        generator = torch.Generator().manual_seed(0)

        def read():
            index = torch.randint(rows, (batch,), generator=generator)
            return torch.from_numpy(np.ascontiguousarray(cached[index.numpy()])).float() * scales[index][:, None]

        seconds, _ = timed(read, repeats)
        cached = table = None  # release the memmaps before the folder is removed
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--hash-fraction", type=float, default=0.1)
    parser.add_argument("--defense", default="none", help="none, sign, prune or gauss")
    parser.add_argument("--variants", nargs="+", default=["mlp", "embedding", "embedding-sampled:bf16:fused"],
                        help="inverter[:bf16][:fused]: mlp (the paper's), embedding, embedding-sampled (4,096 sampled "
                             "negatives); bf16 autocast; fused = fused Adam + gradients zeroed in place")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--cache-rows", type=int, default=4096,
                        help="rows of the float16 memmap used to time reading cached features (warm page cache)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from datamodules.federated import GaussianNoise, Hashing, NoDefense, Sign, TopKPruning
    from datamodules.text_inversion import TextInversionDataModule
    from lti.inverters import build_inverter
    from lti.loss import InverterLoss

    defenses = {"none": NoDefense(), "sign": Sign(), "prune": TopKPruning(0.99), "gauss": GaussianNoise(0.01)}
    data = TextInversionDataModule(defense=defenses[args.defense], hashing=Hashing(fraction=args.hash_fraction),
                                   batch_size=args.batch)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    fields = data.client_batch(batch)
    pipeline = data.pipeline
    spec = data.inversion_spec

    rows = []
    t_total, observed = timed(lambda: pipeline(fields, keep_update=True), args.repeats)
    t_hash, features = timed(lambda: pipeline.hasher(observed.update), args.repeats)
    rows.append(("update (+ defense)", t_total - t_hash))
    rows.append(("hash", t_hash))
    rows.append(("cached features (float16 memmap read)", cache_read_seconds(args.cache_rows, spec.num_features, args.batch, args.repeats)))
    targets = batch["input_ids"].reshape(args.batch, -1)
    mask = torch.ones_like(targets)

    import os

    print(f"CPU threads {torch.get_num_threads()}, batch {args.batch}, k = {spec.num_features}, defense {args.defense}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '0')}")
    print(f"{'component':<40} {'seconds':>8}")
    for name, seconds in rows:
        print(f"{name:<40} {seconds:8.3f}")
    for variant in args.variants:
        name, *flags = variant.split(":")
        precision = "bf16" if "bf16" in flags else "fp32"
        fused = "fused" in flags
        kind = {"mlp": "mlp", "embedding": "embedding", "embedding-sampled": "embedding"}[name]
        torch.manual_seed(0)
        inverter = build_inverter(kind)
        inverter.bind(spec)
        loss_fn = InverterLoss(negatives=4096 if name == "embedding-sampled" else None)
        optimizer = torch.optim.Adam(inverter.parameters(), lr=1e-4, fused=fused)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

        def forward():
            with autocast:
                return loss_fn(inverter, features, targets, mask, training=True)[0]

        def backward():
            optimizer.zero_grad(set_to_none=not fused)
            forward().backward()

        t_fwd, _ = timed(forward, args.repeats)
        t_fwdbwd, _ = timed(backward, args.repeats)
        t_opt, _ = timed(optimizer.step, args.repeats)
        params = sum(p.numel() for p in inverter.parameters())
        print(f"{variant} ({params / 1e6:.1f}M parameters)")
        print(f"  {'inverter forward + loss':<38} {t_fwd:8.3f}")
        print(f"  {'backward':<38} {t_fwdbwd - t_fwd:8.3f}")
        print(f"  {'optimizer (Adam)':<38} {t_opt:8.3f}")
        total = t_total + t_fwdbwd + t_opt
        print(f"  {'step total (on-the-fly updates)':<38} {total:8.3f}")
        print(f"  {'step total (cached features)':<38} {rows[2][1] + t_fwdbwd + t_opt:8.3f}")


if __name__ == "__main__":
    main()
