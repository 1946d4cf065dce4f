"""Investigation: the batched LoRA attack's accuracy-against-B curve on another machine (a GPU), without the
corpus packages, Lightning or Flower: `export` writes the threat model's token blocks here; `run` rebuilds the
threat model from the SmolLM2 GGUF file and those blocks there and measures as `lora_batch` does (the same
draws: update k of batch size B takes the blocks `randperm(seed 7919 B + k)[:B]` of the split; a FedSGD
step at lr returned in float32 and read back in float64; the whitening on the first `--whitening-blocks`
auxiliary blocks; settings chosen on the auxiliary tail).

    python -m benchmarks.investigations.batched.device_curve export --out blocks.safetensors
    python -m benchmarks.investigations.batched.device_curve run --gguf-folder DIR --blocks blocks.safetensors \
        --device cuda --batch-sizes 8 16 --updates 8 --out curve.jsonl

`run --device cpu` on the same update reproduces `lora_batch`'s row (the check before trusting a device's rows).
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TAIL = 2048


def export(out: str, config: str) -> None:
    from safetensors.torch import save_file

    from benchmarks.investigations.batched.lora_batch import Setup

    bench = Setup(config, 512, "runs/whitening/smollm2_lora.safetensors")
    aux, _ = bench.data.blocks("auxiliary")
    tensors = {"evaluation": bench.evaluation.to(torch.int32).contiguous(),
               "auxiliary_whitening": aux[:512].to(torch.int32).contiguous(),
               "auxiliary_tail": bench.tail.to(torch.int32).contiguous()}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata={"fingerprint": bench.fingerprint, "config": config})
    print({k: tuple(v.shape) for k, v in tensors.items()}, bench.fingerprint)


def run(args) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    from benchmarks.investigations.batched.lora_batch import RowLog, result_row
    from datamodules.federated import FedSGDClient, LoRAClient, UpdatePipeline
    from datamodules.federated.pipeline import target_fingerprint
    from datamodules.targets import HFCausalLM
    from datamodules.threat_model import weight_update
    from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, adapter_sites
    from exact.batched.scorer import ScorerWeights

    device = torch.device(args.device)
    blocks = {k: v.long() for k, v in load_file(args.blocks).items()}
    with safe_open(args.blocks, "pt") as f:
        expected = f.metadata()["fingerprint"]
    started = time.perf_counter()
    target = HFCausalLM(pretrained=args.gguf_folder, gguf_file=GGUF, cache_dir=args.cache_dir)
    lora = LoRAClient(rank=8, alpha=16.0, target_modules=["q_proj", "v_proj"], seed=0, init_b_std=0.02,
                      local=FedSGDClient("train", 1))
    server = UpdatePipeline(target, client=lora)
    fingerprint = target_fingerprint(server.target)
    if fingerprint != expected:
        raise SystemExit(f"the model here has fingerprint {fingerprint}, the blocks' threat model {expected}")
    server.to(device)  # the model and the hasher's buffers
    names = list(server.names)
    sites = adapter_sites(names)
    whitening = SiteWhitening.fit(server.target, sites, blocks["auxiliary_whitening"][: args.whitening_blocks].to(device))
    whitening.vocabulary, whitening.sites = whitening.vocabulary.to(device), whitening.sites.to(device)
    print(f"model, adapters and whitening in {time.perf_counter() - started:.0f} s on {device}", flush=True)
    options = BatchedOptions(lm_weight=args.lm_weight, beam=args.beam, refine=args.refine,
                             screen_sites=args.screen_sites, shortlist=args.shortlist)

    def attack_for(batch: int) -> tuple[BatchedLoRA, ScorerWeights | None]:
        """The attack of updates of `batch` sequences and the scorer file's set it uses (fitted nearest it)."""
        weights = ScorerWeights.load(args.scorer, fingerprint, len(sites), batch) if args.scorer else None
        return BatchedLoRA(server.target, names, whitening, options,
                           scorer=(weights.sites.to(device), weights.lm) if weights else None), weights

    decode = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
        decode = lambda t: tokenizer.decode(t)  # noqa: E731

    def simulate(sequences):
        ids = torch.tensor(sequences, dtype=torch.long, device=device)[:, None]
        return server({"input_ids": ids}, keep_update=True).update

    held_out = blocks[args.split]
    sent = {n: p.detach().float().clone() for n, p in server.target.named_parameters() if n in set(names)}
    with RowLog(args.out, device) as log:
        for batch in args.batch_sizes:
            attack, weights = attack_for(batch)
            batched_client = copy.copy(server.client)  # the prepared adapters, B sequences per update
            batched_client.local = FedSGDClient("train", batch)
            client = server.with_client(batched_client)
            for k in range(args.first_update, args.first_update + args.updates):
                generator = torch.Generator().manual_seed(7919 * batch + k)
                ids = held_out[torch.randperm(held_out.shape[0], generator=generator)[:batch]]
                gradient = client({"input_ids": ids[None].to(device)}, keep_update=True).update[0]
                split = server.split(gradient[None])
                returned = {n: (sent[n] - args.lr * split[n][0]).float() for n in names}
                flat = weight_update(sent, returned, args.lr, names)
                update = {n: g[0].double() for n, g in server.split(flat[None]).items()}
                if device.type == "cuda":
                    torch.cuda.synchronize()
                began = time.perf_counter()
                found = attack.attack(update, batch, ids.shape[1], simulate, flat)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds = time.perf_counter() - began
                row = {"B": batch, "L": ids.shape[1], "update": k, "split": args.split, "device": str(device),
                       **result_row(found, ids, decode, seconds), "scorer": args.scorer,
                       "scorer_batch_sizes": list(weights.batch_sizes) if weights else None, "beam": args.beam,
                       "refine": args.refine, "lm_weight": weights.lm if weights else options.lm_weight,
                       "screen_sites": args.screen_sites,
                       "shortlist": args.shortlist}
                log.write(row)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="write the threat model's token blocks (here)")
    ex.add_argument("--config", default="configs/audit/inverter_smollm2_lora.yaml")
    ex.add_argument("--out", required=True)
    go = sub.add_parser("run", help="measure on this machine from the GGUF file and the exported blocks")
    go.add_argument("--gguf-folder", required=True, help=f"a folder holding {GGUF}")
    go.add_argument("--blocks", required=True)
    go.add_argument("--cache-dir", default=None, help="where the dequantised copy of the model goes")
    go.add_argument("--tokenizer", default=None, help="a tokenizer folder, for ROUGE on text (else on ids)")
    go.add_argument("--device", default="cpu")
    go.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 16])
    go.add_argument("--updates", type=int, default=8)
    go.add_argument("--first-update", type=int, default=0)
    go.add_argument("--split", choices=["evaluation", "auxiliary_tail"], default="evaluation")
    go.add_argument("--lr", type=float, default=0.05)
    go.add_argument("--lm-weight", type=float, default=0.5)
    go.add_argument("--beam", type=int, default=4)
    go.add_argument("--refine", type=int, default=2)
    go.add_argument("--screen-sites", type=int, default=8)
    go.add_argument("--shortlist", type=int, default=64)
    go.add_argument("--scorer", default=None)
    go.add_argument("--whitening-blocks", type=int, default=512)
    go.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.out, args.config)
    else:
        run(args)


if __name__ == "__main__":
    main()
