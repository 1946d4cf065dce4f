"""DAGER on multi-step (FedAvg) updates of a tiny transformer3, with and without the trajectory probe.

For lr in {0.01, 0.05, 0.1}, seeds 0-2, thresholds {1e-3, 1e-2}: one eval-mode FedAvg update (n = 4
random 12-token sequences, E = 2 epochs of minibatches of 2 = 4 local steps) of the d = 64 model of
tests/exact/test_dager.py, attacked as its pseudo-gradient with the second-layer test at the
global weights only, then also at the weights of every local step (`Dager.attack(trajectory=...)`).
Prints the exact sequences recovered. Seconds on one CPU thread:
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.dager_trajectory_sweep
"""

from __future__ import annotations

import time

import torch

from datamodules.federated import FedAvgClient, ParameterSelection, UpdatePipeline
from datamodules.federated.hashing import Hashing
from datamodules.targets import Transformer3
from exact import Dager, find_layers
from exact.dager import SpanTests, local_step_offsets

VOCAB = 500


def main() -> None:
    print("| lr | seed | threshold | exact at the global weights | exact along the trajectory | seconds (global / trajectory) |")
    print("|---|---|---|---|---|---|")
    for lr in (0.01, 0.05, 0.1):
        for seed in range(3):
            torch.manual_seed(seed)
            target = Transformer3(vocab_size=VOCAB, hidden_size=64, num_heads=4, ffn_size=128, num_layers=2,
                                  max_positions=16, dropout=0.0)
            client = FedAvgClient(mode="eval", samples_per_update=4, local_epochs=2, minibatch_size=2, lr=lr)
            pipeline = UpdatePipeline(target, client=client, hashing=Hashing(bins=1),
                                      observed=ParameterSelection(include=find_layers(target).observed_names()))
            ids = torch.randint(0, VOCAB, (1, 4, 12), generator=torch.Generator().manual_seed(seed))
            update = pipeline({"input_ids": ids}, keep_update=True).update * client.gradient_scale()
            one = {name: grads[0] for name, grads in pipeline.split(update).items()}
            truth = {tuple(s) for s in ids[0].tolist()}
            trajectory = local_step_offsets(client)
            for threshold in (1e-3, 1e-2):
                attack = Dager(span=SpanTests(l1_threshold=threshold, l2_threshold=threshold))
                row = []
                for points in ((), trajectory):
                    start = time.perf_counter()
                    result = attack.attack(target.eval(), one, batch_size=4, max_length=12, trajectory=points)
                    row.append((sum(tuple(s) in truth for s in result.sequences), time.perf_counter() - start))
                print(f"| {lr:g} | {seed} | {threshold:g} | {row[0][0]}/4 | {row[1][0]}/4 | {row[0][1]:.1f} / {row[1][1]:.1f} |",
                      flush=True)
    print(f"\n# {torch.__version__}, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
