"""How much of a batched update's text is lost in *linking*: which of a position's m tokens belongs to which sequence.

The span test (`exact.span_evidence`) scores tokens per position, not per sequence, so an attack built
on it has to link each position's tokens into m sequences. For the first 1,000 WikiText-2 validation
blocks grouped into updates of m (as every attack of docs/batched_updates.md is scored), this prints
the matched token accuracy of:

- `no update`: sequence i repeats the auxiliary text's i-th most frequent token, for every update (what
  matching the m sequences to the true ones gives a guess that reads nothing: more than the
  per-position majority baseline once m > 1);
- `oracle, random links`: each position's m true tokens, put into the m sequences in a random order
  (what a perfect per-position test is worth without any linking);
- `oracle, n-gram links`: the same tokens linked left to right by an n-gram model (`--order`, 3 by
  default) of the server's auxiliary text (each position's tokens assigned to the sequences by the
  Hungarian method, maximising the summed log-probability given each sequence's tokens so far);
- `span test` (with `--defenses`): the span-test attack without learning (each position's m distinct
  best-scoring tokens, in the test's arbitrary order) as in `benchmarks.span_evidence_ranks`, and
  `span test, n-gram links`: the same tokens linked by the n-gram model (an attack: the server has the
  update and its auxiliary text);
- `span test + n-gram, joint`: each position's tokens *chosen and linked* together, left to right,
  among the position's `--candidates` best-scoring tokens: the m distinct candidates and their
  sequences maximising weight * span score + n-gram log-probability (Hungarian at every position).
  The weight is chosen on updates of held-out auxiliary blocks (`--tune-blocks`, the last blocks of
  the auxiliary text, kept out of the n-gram's counts), never on the evaluation blocks.

The n-gram model is interpolated Witten-Bell (no parameter to tune) over the auxiliary blocks of 16
tokens (WikiText-2 test and the embedded Wikipedia/news sample, as the LTI runs), so it never reads the
evaluation text:

    python -m benchmarks.investigations.batched.linking \
        --auxiliary-file ../shared/data/wikitext-2/test.txt --evaluation-file ../shared/data/wikitext-2/valid.txt \
        --defenses none sign --out docs/results/batched_updates/linking.json
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter

import numpy as np
import torch


class NGramModel:
    """log P(token | the previous order - 1 tokens) over token ids, interpolated Witten-Bell (each
    context's estimate mixed with the next shorter context's, in proportion to how many distinct
    tokens followed it), down to an add-one unigram: no parameter to tune, and a distribution over the
    vocabulary for every context."""

    def __init__(self, blocks: torch.Tensor, vocab_size: int, order: int = 3) -> None:
        if order < 1:
            raise ValueError(f"order {order} must be >= 1")
        self.order = order
        unigram = np.bincount(blocks.flatten().numpy(), minlength=vocab_size).astype(np.float64) + 1.0
        self.unigram = unigram / unigram.sum()
        rows = blocks.tolist()
        self.counts: list[Counter] = []  # per context length n >= 1: (context..., token) -> count
        self.totals: list[Counter] = []  # context -> count of anything after it
        self.types: list[Counter] = []  # context -> distinct tokens after it
        for n in range(1, order):
            grams = Counter(tuple(row[i : i + n + 1]) for row in rows for i in range(len(row) - n))
            totals, types = Counter(), Counter()
            for gram, count in grams.items():
                totals[gram[:-1]] += count
                types[gram[:-1]] += 1
            self.counts.append(grams)
            self.totals.append(totals)
            self.types.append(types)

    def log_prob(self, context: tuple[int, ...], token: int) -> float:
        """log P(token | context), the context's last order - 1 tokens used (fewer at a sequence's start)."""
        context = context[len(context) - self.order + 1 :] if self.order > 1 else ()
        prob = self.unigram[token]
        for n in range(1, len(context) + 1):
            past = context[-n:]
            total = self.totals[n - 1].get(past, 0)
            if total == 0:
                break  # a longer context unseen too
            types = self.types[n - 1][past]
            prob = (self.counts[n - 1].get((*past, token), 0) + types * prob) / (total + types)
        return float(np.log(prob))


def link(tokens: np.ndarray, model: NGramModel, beam: int = 1) -> np.ndarray:
    """(m, L) tokens, each position's column in arbitrary order -> the same columns reordered so that
    row i is one sequence, linked by the n-gram model alone (`joint` with each position's m tokens as
    its candidates and no span score)."""
    m, _ = tokens.shape
    return joint(tokens.T, np.zeros(tokens.T.shape), m, model, weight=0.0, beam=beam)


def best_assignments(gain: np.ndarray, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Up to `count` one-to-one assignments of gain's m rows to its K >= m columns, the best first (the
    Hungarian method's, then the best with one of its pairs forbidden: a partial k-best list)."""
    from scipy.optimize import linear_sum_assignment

    rows, cols = linear_sum_assignment(gain, maximize=True)
    found = {tuple(cols): (rows, cols)}
    if count > 1:
        for row, col in zip(rows, cols):
            forbidden = gain.copy()
            forbidden[row, col] = -1e9  # finite: scipy refuses an infeasible matrix
            other = linear_sum_assignment(forbidden, maximize=True)
            if forbidden[other].sum() > -1e8:
                found.setdefault(tuple(other[1]), other)
    return sorted(found.values(), key=lambda pair: -gain[pair].sum())[:count]


def joint(candidates: np.ndarray, scores: np.ndarray, m: int, model: NGramModel, weight: float, beam: int = 1) -> np.ndarray:
    """(L, K >= m) candidate tokens of each position with their span scores -> (m, L) sequences: position
    0 takes its m best candidates by weight * score + unigram log-probability, every later position m
    distinct candidates, and the rows they extend, maximising weight * score + log P(candidate | the
    row's tokens so far) summed over the rows; left to right, keeping the `beam` best partial
    reconstructions (1: greedy, exact at each position)."""
    length, _ = candidates.shape
    first = weight * scores[0] + np.log(model.unigram[candidates[0]])
    top = np.argsort(-first, kind="stable")[:m]
    beams = [(float(first[top].sum()), candidates[0][top][:, None])]
    for p in range(1, length):
        grown = []
        for total, so_far in beams:
            gain = weight * scores[p][None, :] + np.array(
                [[model.log_prob(tuple(so_far[i].tolist()), int(t)) for t in candidates[p]] for i in range(m)])
            for rows, cols in best_assignments(gain, beam):
                column = np.empty(m, dtype=np.int64)
                column[rows] = candidates[p][cols]
                grown.append((total + float(gain[rows, cols].sum()), np.concatenate([so_far, column[:, None]], 1)))
        grown.sort(key=lambda item: -item[0])
        beams = grown[:beam]
    return beams[0][1]


def matched_accuracy(preds: torch.Tensor, ids: torch.Tensor) -> float:
    """Token accuracy of (U, m, L) predictions, sequences matched to the true ones (as every attack here)."""
    from benchmarks.span_evidence_ranks import matched_token_accuracy

    return float(matched_token_accuracy(preds, ids).mean())


def shuffled(ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """(U, m, L) -> each (update, position)'s m tokens in a random order across the m rows."""
    keys = torch.rand(ids.shape, generator=generator)
    return ids.gather(1, keys.argsort(dim=1))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--auxiliary-file", required=True, help="the server's text (e.g. WikiText-2 test.txt)")
    parser.add_argument("--evaluation-file", required=True, help="held-out client text (e.g. WikiText-2 valid.txt)")
    parser.add_argument("--blocks", type=int, default=1000)
    parser.add_argument("--m", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--defenses", nargs="*", default=[], help="also the span-test attack under these defenses")
    parser.add_argument("--chunk", type=int, default=32)
    parser.add_argument("--beam", type=int, default=1, help="partial reconstructions kept while linking (1: greedy)")
    parser.add_argument("--order", type=int, default=3, help="the n-gram model's order (2: bigram)")
    parser.add_argument("--embedded", action=argparse.BooleanOptionalAction, default=True,
                        help="add the embedded Wikipedia/news sample to the auxiliary text (as the LTI runs do)")
    parser.add_argument("--candidates", type=int, default=32, help="candidates per position for the joint decoding")
    parser.add_argument("--tune-blocks", type=int, default=512, help="last auxiliary blocks held out to choose the weight")
    parser.add_argument("--weights", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0])
    parser.add_argument("--out", default=None, help="a JSON file of the rows")
    args = parser.parse_args(argv)
    from datamodules.text import EmbeddedCorpus, LocalCorpus, load_tokenizer, pack_blocks, tokenize_splits

    tokenizer = load_tokenizer("embedded-gpt2")
    extra = [EmbeddedCorpus()] if args.embedded else []
    splits = tokenize_splits(LocalCorpus([args.auxiliary_file], [args.evaluation_file], auxiliary_corpora=extra).load(),
                             tokenizer)
    auxiliary = pack_blocks(splits["auxiliary"], 16)
    tune_blocks = auxiliary[-args.tune_blocks :]
    model = NGramModel(auxiliary[: -args.tune_blocks], len(tokenizer), args.order)
    blocks = pack_blocks(splits["evaluation"], 16)
    generator = torch.Generator().manual_seed(0)
    rows: list[dict] = []

    def record(m: int, attack: str, preds: torch.Tensor, ids: torch.Tensor, seconds: float) -> None:
        accuracy = matched_accuracy(preds, ids)
        rows.append({"m": m, "attack": attack, "updates": ids.shape[0], "token_acc": accuracy, "seconds": seconds})
        print(f"| {m} | {attack} | {ids.shape[0]} | {100 * accuracy:.1f} | {seconds:.1f} |", flush=True)

    print("| m | attack | updates | token acc % | s |\n|---|---|---|---|---|")
    for m in args.m:
        updates = args.blocks // m
        ids = blocks[: updates * m].view(updates, m, 16)
        # what a guess that never reads the update scores once the sequences are matched to the true ones:
        # sequence i repeats the auxiliary text's i-th most frequent token
        frequent = torch.from_numpy(np.argsort(-model.unigram, kind="stable")[:m].copy())
        record(m, "no update: the m most frequent tokens", frequent.view(1, m, 1).expand(updates, m, 16), ids, 0.0)
        start = time.perf_counter()
        oracle = shuffled(ids, generator)
        record(m, "oracle, random links", oracle, ids, time.perf_counter() - start)
        start = time.perf_counter()
        linked = torch.from_numpy(np.stack([link(o.numpy(), model, args.beam) for o in oracle]))
        record(m, f"oracle, {args.order}-gram links", linked, ids, time.perf_counter() - start)
        for name in args.defenses:
            start = time.perf_counter()
            count = max(args.candidates, m)
            tokens, scores = span_candidates(ids, name, count, args.chunk)
            preds = span_test_attack(tokens, m)
            record(m, f"span test, {name}", preds, ids, time.perf_counter() - start)
            start = time.perf_counter()
            linked = torch.from_numpy(np.stack([link(p.numpy(), model, args.beam) for p in preds]))
            record(m, f"span test, {name}, {args.order}-gram links", linked, ids, time.perf_counter() - start)
            # the weight, chosen on updates of held-out auxiliary blocks
            tune_ids = tune_blocks[: len(tune_blocks) // m * m].view(-1, m, 16)
            tune_tokens, tune_scores = span_candidates(tune_ids, name, count, args.chunk)
            tuning = {}
            for weight in args.weights:
                decoded = np.stack([joint(t.numpy(), v.numpy(), m, model, weight, args.beam) for t, v in zip(tune_tokens, tune_scores)])
                tuning[weight] = matched_accuracy(torch.from_numpy(decoded), tune_ids)
            best = max(args.weights, key=lambda w: tuning[w])
            print(f"  weights on {len(tune_ids)} held-out auxiliary updates: "
                  + ", ".join(f"{w:g}: {100 * a:.1f}" for w, a in tuning.items()) + f" -> {best:g}", flush=True)
            start = time.perf_counter()
            decoded = np.stack([joint(t.numpy(), v.numpy(), m, model, best, args.beam) for t, v in zip(tokens, scores)])
            record(m, f"span test + {args.order}-gram, joint, {name} (weight {best:g})", torch.from_numpy(decoded), ids,
                   time.perf_counter() - start)
            rows[-1]["tuning"] = {str(w): a for w, a in tuning.items()}
    if args.out:
        from datamodules.atomic_files import write_text_atomically

        write_text_atomically(args.out, json.dumps({"command": vars(args), "rows": rows}, indent=1) + "\n")
    return rows


def span_candidates(ids_all: torch.Tensor, defense: str, count: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(U, m, L) blocks -> each position's `count` best-scoring tokens under the span test of their
    update (`exact.span_evidence`, as `benchmarks.span_evidence_ranks`): ids (U, L, count) and scores
    (U, L, count), best first."""
    from benchmarks.span_evidence_ranks import transformer3_pipeline
    from exact.span_evidence import EvidenceOptions, SpanEvidence

    updates, m, length = ids_all.shape
    pipeline = transformer3_pipeline(m, defense)
    evidence = SpanEvidence(pipeline.target, list(pipeline.names), m * length, length, EvidenceOptions())
    torch.manual_seed(0)
    tokens, values = [], []
    for first in range(0, updates, chunk):
        ids = ids_all[first : first + chunk]
        scores = evidence(pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update))  # (U, L, V)
        top = scores.topk(count, dim=-1)
        tokens.append(top.indices)
        values.append(top.values.float())
    return torch.cat(tokens), torch.cat(values)


def span_test_attack(candidates: torch.Tensor, m: int) -> torch.Tensor:
    """(U, L, K >= m) candidates, best first -> (U, m, L): each position's m best, in that order (the
    span test's attack without learning; every slot of a position scores alike, so `distinct_slots`
    reduces to this)."""
    return candidates[:, :, :m].transpose(1, 2).contiguous()


if __name__ == "__main__":
    main()
