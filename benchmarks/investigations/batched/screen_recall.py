"""Investigation: how often the search's screen keeps the true extension, by screen depth, shortlist and precision.

The search scores every extension (a sequence's prefix and one bag token) by its first `screen_sites` sites and
runs only a shortlist through all of them (`exact.batched.search.grow_sequences`): a true token the screen drops
is lost for that step. Here the true prefixes are given (every sequence's, deflated jointly, as the search's state
would be were it right so far), so what is measured is the screen alone: at each position and sequence, the rank
of the true next token among the bag by the sum of the first k sites' whitened span terms plus the prior (the
global model's log-probability times `--lm-weight`, as the search's screen adds it), for k in `--depths`, in
float32 and through the bfloat16 copy of the model (`search.bfloat16_twin`); and the seconds of the screen's
forward passes at `--screen-sites` in each precision (every extension of every sequence at every position).
One JSON line per update. The auxiliary tail by default: settings are chosen there.

    python -m benchmarks.investigations.batched.screen_recall --batch-size 16 --update 1 \\
        --out docs/results/audit/batched/auxiliary_tail/screen_recall.jsonl
"""

from __future__ import annotations

import argparse
import time

import torch

SHORTLISTS = (16, 32, 64, 128)


def main(argv: list[str] | None = None) -> None:
    from benchmarks.investigations.batched.lora_batch import RowLog, Setup
    from exact.batched import BatchedLoRA, BatchedOptions
    from exact.batched.search import Prefixes, SpanScorer, bfloat16_twin

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--update", type=int, default=1, help="the update's index (its draw's seed), as lora_batch")
    parser.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="auxiliary_tail")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4, 8, 16, 30])
    parser.add_argument("--screen-sites", type=int, default=BatchedOptions.screen_sites)
    parser.add_argument("--lm-weight", type=float, default=BatchedOptions.lm_weight)
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    parser.add_argument("--out", required=True, help="JSONL file: one line per run")
    args = parser.parse_args(argv)

    bench = Setup(args.config, 512, args.whitening_cache)
    batch = args.batch_size
    ids = bench.draw(args.split, batch, args.update)
    _, update = bench.observed(ids, 0.05, seed=7919 * batch + args.update)
    options = BatchedOptions()
    attack = BatchedLoRA(bench.target, bench.names, bench.whitening, options)
    sites = attack.sites
    depths = sorted({min(d, len(sites)) for d in args.depths})
    rows = [site.rows(update).double() for site in sites]
    bag = attack.bag(update, rows, batch, ids.shape[1])
    scorer = SpanScorer(rows, bench.whitening.sites)
    twin = bfloat16_twin(bench.target)
    candidates = torch.tensor(bag)
    where = {t: j for j, t in enumerate(bag)}
    precisions = ("float32", "bfloat16")
    ranks: dict[str, dict[int, list[int]]] = {p: {d: [] for d in depths} for p in precisions}
    seconds = dict.fromkeys(precisions, 0.0)
    missing = 0  # true next tokens the bag lacks (no screen can keep them)
    for position in range(1, ids.shape[1] - 1):  # the last token is a label, never an input
        prefixes = Prefixes(bench.target, sites, ids[:, :position], twin)
        bases = scorer.deflate(scorer.known([h.reshape(-1, h.shape[-1]) for h in prefixes.inputs]))
        owners, tokens = torch.arange(batch).repeat_interleave(len(bag)), candidates.repeat(batch)
        for precision in precisions:
            began = time.perf_counter()
            prefixes.extend(owners, tokens, args.screen_sites, precision)
            seconds[precision] += time.perf_counter() - began
            inputs = prefixes.extend(owners, tokens, depths[-1], precision)
            prior = args.lm_weight * prefixes.logp[owners, tokens].double()
            cumulative = (scorer.terms(inputs, bases, range(depths[-1])).cumsum(1) + prior[:, None]).reshape(
                batch, len(bag), -1)
            for i in range(batch):
                j = where.get(int(ids[i, position]))
                if j is None:
                    missing += precision == precisions[0]
                    continue
                for d in depths:
                    scores = cumulative[i, :, d - 1]
                    ranks[precision][d].append(int((scores > scores[j]).sum()))
        print(f"position {position}: {seconds}", flush=True)
    row = {"B": batch, "L": int(ids.shape[1]), "update": args.update, "split": args.split, "bag": len(bag),
           "cases": len(ranks["float32"][depths[0]]), "true_token_not_in_bag": missing,
           "screen_sites": args.screen_sites, "lm_weight": args.lm_weight,
           "screen_seconds": {p: round(s, 1) for p, s in seconds.items()}, "threads": torch.get_num_threads()}
    for precision in precisions:
        row[precision] = {
            f"{d} sites": {"median_rank": sorted(r)[len(r) // 2], "first": round(sum(x == 0 for x in r) / len(r), 3),
                           **{f"top {k}": round(sum(x < k for x in r) / len(r), 3) for k in SHORTLISTS}}
            for d, r in ranks[precision].items()}
    with RowLog(args.out) as log:
        log.write(row)


if __name__ == "__main__":
    main()
