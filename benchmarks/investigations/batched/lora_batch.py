"""Investigation: batched LoRA updates (B sequences averaged) read by whitened bag recovery and the all-site
span search (`exact.batched`), through the float32 weights a Flower client returns.

For each B: `--updates` client updates of B held-out blocks (the evaluation split, or the auxiliary split's
last blocks, which the whitening never reads: the split to choose settings on), each a FedSGD step
w - lr * g returned in float32 and read back as (w - returned) / lr in float64, as the audit's server
does. Reports bag recall (distinct visible tokens found), token accuracy (sequences matched as the
metrics do), ROUGE-1/2, exact sequences and seconds per update; one JSON line per update as it ends.

    python -m benchmarks.investigations.batched.lora_batch --batch-sizes 1 2 4 8 16 --updates 8 \
        --out docs/batched_updates/lora_batch.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml", help="the threat model")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="evaluation")
    parser.add_argument("--lr", type=float, default=0.05, help="the clients' learning rate (the audit's default)")
    parser.add_argument("--lm-weight", type=float, default=0.5)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--refine", type=int, default=1, help="passes of coordinate-wise refinement")
    parser.add_argument("--label-candidates", type=int, default=16,
                        help="last tokens chosen by the least-squares refit among the LM's top k (0: no refit)")
    parser.add_argument("--whitening-blocks", type=int, default=512, help="auxiliary blocks the whitening reads")
    parser.add_argument("--whitening-cache", default="runs/whitening/smollm2_lora.safetensors")
    parser.add_argument("--out", required=True, help="JSONL file: one line per update")
    args = parser.parse_args(argv)

    from datamodules.federated.pipeline import target_fingerprint
    from datamodules.metrics import score_batch
    from exact.batched import BatchedLoRA, BatchedOptions
    from exact.batched.sites import adapter_sites
    from exact.batched.whitening import SiteWhitening
    from lti.audit.attacks import observed_update
    from lti.audit.federation import adapter_state, client_pipeline
    from lti.trainer_cli import instantiate

    _, data = instantiate(args.config, [])
    data.prepare_data()
    data.setup("validate")
    server = data.pipeline
    target = server.target
    aux, _ = data.blocks("auxiliary")
    if args.split == "evaluation":
        held_out, _ = data.blocks("evaluation")
    else:
        held_out = aux[-2048:]
    aux = aux[: min(args.whitening_blocks, aux.shape[0] - 2048)]
    names = list(server.names)
    sites = adapter_sites(names)
    whitening = SiteWhitening.load_or_fit(args.whitening_cache, target, sites, aux, target_fingerprint(target))
    decode = lambda t: data.tokenizer.decode(t)  # noqa: E731
    attack = BatchedLoRA(target, names, whitening, BatchedOptions(lm_weight=args.lm_weight, beam=args.beam,
                                                                  label_candidates=max(1, args.label_candidates),
                                                                  refine=args.refine))

    def simulate(sequences: list[list[int]]) -> torch.Tensor:
        """The update each sequence alone gives (the server's own simulation, one sequence per update)."""
        return server({"input_ids": torch.tensor(sequences)[:, None]}, keep_update=True).update
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as log:
        for batch in args.batch_sizes:
            clients = client_pipeline(server, batch, lr=args.lr)
            sent = adapter_state(clients)
            for k in range(args.updates):
                generator = torch.Generator().manual_seed(7919 * batch + k)
                ids = held_out[torch.randperm(held_out.shape[0], generator=generator)[:batch]]
                gradient = clients({"input_ids": ids[None]}, keep_update=True).update[0]
                returned, start = {}, 0
                for name, shape in clients.spec.parameters:
                    size = int(torch.tensor(shape).prod())
                    returned[name] = (sent[name].float() - args.lr * gradient[start : start + size].view(shape)).float()
                    start += size
                update = observed_update(sent, returned, args.lr, names)
                split = {name: grads[0].double() for name, grads in server.split(update[None]).items()}
                began = time.perf_counter()
                found = attack.attack(split, batch, ids.shape[1], simulate if args.label_candidates > 0 else None,
                                      update)
                sequences, bag = found.sequences, found.bag
                seconds = time.perf_counter() - began
                scores = score_batch(sequences, ids, None, decode)
                visible = set(ids[:, :-1].flatten().tolist())
                row = {"B": batch, "L": ids.shape[1], "update": k, "split": args.split, "lm_weight": args.lm_weight,
                       "beam": args.beam, "bag_size": len(bag), "bag_recall": len(visible & set(bag)) / len(visible),
                       "token_acc": scores["correct"] / scores["tokens"], "rouge1": scores["rouge1"],
                       "rouge2": scores["rouge2"], "exact": scores["exact_fraction"],
                       "seconds": seconds, "residual": found.residual, "certified": found.certified,
                       "label_candidates": args.label_candidates, "refine": args.refine}
                log.write(json.dumps(row) + "\n")
                log.flush()
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
