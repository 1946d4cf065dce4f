"""How much the span evidence alone says about an update's tokens, per sequences per update m and defense.

    python -m benchmarks.span_evidence_ranks --evaluation-file ../shared/data/wikitext-2/valid.txt

For each m and defense, the first 1,000 (`--blocks`) 16-token WikiText blocks grouped into updates of m, against
transformer3 (dropout 0, FedSGD, train mode), the server's scores (`exact.span_evidence`), and per true
(position, token): its rank among the V tokens at that position (0: the top). Prints the share of true
tokens ranked among the top m of their position (where a perfect test puts all of them; m tokens can
share a position), the share within the top 100, and the median rank. No learning is involved: this is
the evidence the hybrid inverter starts from. The last column is an attack without learning: each
position's m slots take the m distinct best-scoring tokens (`lti.decoding.distinct_slots`), in an
arbitrary slot order, scored like every attack here (sequences matched to the true ones). "bag": the share
of an update's distinct true tokens among the m * L tokens whose best score over the positions is highest
(what the test says without saying where: a RoPE model's first-layer inputs carry no position, so there
every position scores alike).

    python -m benchmarks.span_evidence_ranks --threat-model configs/audit/inverter_smollm2_lora.yaml --blocks 256

measures the same on the updates of an `lti fit` config's threat model (its target, client, observed
parameters and defense; m from its client; the first blocks of its evaluation split), e.g. the audit's
LoRA updates of SmolLM2-135M.
"""

from __future__ import annotations

import argparse
import time

import torch

from datamodules.federated import FedSGDClient, GaussianNoise, NoDefense, Sign, TopKPruning, UpdatePipeline
from datamodules.metrics import match_sequences, reorder_sequences, token_accuracy
from datamodules.targets import Transformer3
from datamodules.text import LocalCorpus, load_tokenizer, pack_blocks, tokenize_splits
from exact.span_evidence import EvidenceOptions, SpanEvidence
from lti.decoding import distinct_slots

DEFENSES = {"none": NoDefense, "sign": Sign, "prune": lambda: TopKPruning(fraction_removed=0.99),
            "gauss": lambda: GaussianNoise(sigma=0.01)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evaluation-file", help="held-out text (e.g. WikiText-2 valid.txt), for transformer3")
    parser.add_argument("--threat-model", help="an `lti fit` config: measure on its threat model instead (see above)")
    parser.add_argument("--updates", type=int, default=None, help="updates per m (default: --blocks / m)")
    parser.add_argument("--blocks", type=int, default=1000, help="the first this many blocks, grouped into updates of m")
    parser.add_argument("--chunk", type=int, default=32, help="updates scored at a time")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--defenses", nargs="+", default=list(DEFENSES), choices=list(DEFENSES))
    parser.add_argument("--max-span-fraction", type=float, default=EvidenceOptions().max_span_fraction)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    if (args.evaluation_file is None) == (args.threat_model is None):
        parser.error("give --evaluation-file (transformer3) or --threat-model (an lti fit config)")
    print("| m | defense | updates | true tokens in top m % | in top 100 % | median rank | bag % "
          "| evidence-only token acc % | s/update |")
    print("|---|---|---|---|---|---|---|---|---|")
    if args.threat_model:
        from lti.trainer_cli import instantiate

        _, data = instantiate(args.threat_model)
        data.setup("fit")
        pipeline, m, length = data.pipeline.to(args.device), data.samples_per_update, data.seq_len
        blocks = data.blocks("evaluation")[0]
        updates = args.updates if args.updates else args.blocks // m
        ids = blocks[: updates * m].view(updates, m, length).to(args.device)
        return [measure(pipeline, ids, "as configured", args)]
    tokenizer = load_tokenizer("embedded-gpt2")
    corpus = LocalCorpus([args.evaluation_file], [args.evaluation_file])
    blocks = pack_blocks(tokenize_splits(corpus.load(), tokenizer)["evaluation"], 16)
    rows = []
    for m in args.m:
        updates = args.updates if args.updates else args.blocks // m
        ids = blocks[: updates * m].view(updates, m, 16).to(args.device)
        for name in args.defenses:
            rows.append(measure(transformer3_pipeline(m, name).to(args.device), ids, name, args))
    return rows


def transformer3_pipeline(m: int, defense: str) -> UpdatePipeline:
    """The page's threat model: transformer3 (dropout 0), FedSGD in train mode over m sequences, `defense`."""
    return UpdatePipeline(Transformer3(dropout=0.0), FedSGDClient(mode="train", samples_per_update=m), DEFENSES[defense]())


def matched_token_accuracy(preds: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per update, the token accuracy of (U, m, L) predictions with their sequences matched to the true
    ones (an update has no order), as every attack of docs/batched_updates.md is scored."""
    count = ids.shape[0]
    order = match_sequences(preds, ids, torch.ones_like(ids))
    (matched,) = reorder_sequences(order, ids.reshape(count, -1))
    return token_accuracy(preds.reshape(count, -1), matched)


def measure(pipeline: UpdatePipeline, ids_all: torch.Tensor, name: str, args: argparse.Namespace) -> dict:
    """One table row, printed and returned: the span evidence of the updates of `ids_all` (U, m, L) under `pipeline`."""
    updates, m, length = ids_all.shape
    evidence = SpanEvidence(pipeline.target, list(pipeline.names), m * length, length,
                            EvidenceOptions(max_span_fraction=args.max_span_fraction))
    torch.manual_seed(0)
    ranks, correct, bags, start = [], [], [], time.perf_counter()
    for first in range(0, updates, args.chunk):  # chunks bound the (U, L, V) score tensors' memory
        ids = ids_all[first : first + args.chunk]
        count = ids.shape[0]
        scores = evidence(pipeline.split(pipeline({"input_ids": ids}, keep_update=True).update))  # (U, L, V)
        true = scores.gather(2, ids.transpose(1, 2))  # (U, L, m)
        ranks.append((scores.unsqueeze(-1) > true.unsqueeze(2)).sum(2).flatten())  # tokens scoring above each
        top = scores.amax(1).topk(m * length, dim=1).indices  # (U, m L): the tokens the test puts in the update
        for u in range(count):
            truth = set(ids[u].flatten().tolist())
            bags.append(len(truth & set(top[u].tolist())) / len(truth))
        slots = scores.unsqueeze(1).expand(-1, m, -1, -1).reshape(count, m * length, -1)
        preds = distinct_slots(slots, m).view(count, m, length)
        correct.append(matched_token_accuracy(preds, ids))
    seconds = (time.perf_counter() - start) / updates
    rank, accuracy, bag = torch.cat(ranks).float(), torch.cat(correct).mean(), sum(bags) / len(bags)
    print(f"| {m} | {name} | {updates} | {100 * (rank < m).float().mean():.1f} | {100 * (rank < 100).float().mean():.1f} "
          f"| {int(rank.median())} | {100 * bag:.1f} | {100 * accuracy:.1f} | {seconds:.2f} |", flush=True)
    return {"m": m, "defense": name, "updates": updates, "top_m": float((rank < m).float().mean()),
            "top_100": float((rank < 100).float().mean()), "median_rank": int(rank.median()), "bag": bag,
            "bags": bags, "token_acc": float(accuracy), "seconds_per_update": seconds}


if __name__ == "__main__":
    main()
