"""Why does DAGER recover only part of an eval-mode FedAvg update, and does the client's float32 matter?

For the first updates of an evaluation batch in the issue-5 setting (transformer3, dropout 0.1 in the model but an
eval()-mode FedAvg client, n = 4 sequences of 16 tokens, lr 0.01), once with a float32 client and
once with a float64 one (`FedAvgClient(dtype="float64")`), this prints per update:

* the first-layer span distance of the true tokens on the pseudo-gradient delta / (steps * lr): the
  largest over the update's 64 tokens (DAGER keeps a token when it is below the threshold, 1e-2
  for multi-step clients), and the median distance of the vocabulary (how far a random token is);
* the second-layer distance of the true sequences (their block-1 inputs at the global weights
  against the span of the second layer's gradient): how many of the 4 pass DAGER's threshold;
* DAGER's result with the matrix's settings (`exact.Dager()`, thresholds 1e-2): sequences recovered
  exactly, the mode and reason, the first-layer candidates per position and its flags.

Offline (the embedded corpus and tokenizer); on one CPU thread under a minute per update
(benchmarks/investigations/dager/fedavg_dager_diagnostics.md):
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.fedavg_dager_diagnostics --updates 4
"""

from __future__ import annotations

import argparse

import torch

from datamodules.federated import FedAvgClient, Hashing
from datamodules.targets import Transformer3
from datamodules.text_inversion import TextInversionDataModule
from exact import Dager
from exact.dager import EncoderOptions, SecondLayerProbe, SpanTests, local_step_offsets, span_basis, token_distances


def observed_batch(dtype: str, epochs: int, minibatch: int, seed: int):
    """The issue-5 evaluation batch under an eval-mode FedAvg client of the given arithmetic."""
    torch.manual_seed(seed)
    client = FedAvgClient("eval", 4, local_epochs=epochs, minibatch_size=minibatch, lr=0.01, dtype=dtype)
    data = TextInversionDataModule(
        target=Transformer3(dropout=0.1), client=client, hashing=Hashing(fraction=0.02), batch_size=32, eval_samples=32,
    )
    data.setup("test")
    torch.manual_seed(seed)
    batch = data.on_after_batch_transfer(next(iter(data.test_dataloader())), 0)
    return data.pipeline, batch


def capped_basis(attack: Dager, gradient: torch.Tensor, ids: torch.Tensor):
    """The span basis DAGER tests against: its numerical rank, capped at B x L directions as it does."""
    basis = span_basis(gradient, attack.options.span.rank_tol, None, attack.options.span.torch_dtype)
    return basis.with_rank(min(basis.numerical_rank, ids.numel()))


def true_token_distances(attack: Dager, target, update: dict, ids: torch.Tensor) -> tuple[float, float]:
    """(largest first-layer distance of the update's true tokens, median distance of the vocabulary)."""
    layers = attack.layers(target)
    basis = capped_basis(attack, layers.first.input_space(update, attack.options.span.blocks), ids)
    dist = token_distances(basis, layers.inputs, list(range(ids.shape[-1])), dtype=attack.options.span.torch_dtype)  # (L, V)
    true = dist.gather(1, ids.T.to(dist.device))  # (L, n): position p, sequence s
    return float(true.max()), float(dist.median())


def true_sequence_distances(attack: Dager, target, update: dict, ids: torch.Tensor, trajectory=()) -> torch.Tensor:
    """(n,) largest second-layer distance over each true sequence's positions (DAGER's second test,
    with its probe: block-1 inputs at the global weights, or the least over the trajectory's points,
    against the layer-2 span, capped at B x L)."""
    layers = attack.layers(target)
    basis = capped_basis(attack, layers.second.input_space(update, attack.options.span.blocks), ids)
    with torch.no_grad():
        return SecondLayerProbe(target, layers, basis, attack.options.budgets.probe_tokens, update, trajectory).full(ids).max(dim=1).values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=4, help="client updates per arithmetic")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--minibatch", type=int, default=2)
    parser.add_argument("--threshold", type=float, default=1e-2, help="DAGER's l1/l2 thresholds (the matrix: 1e-2)")
    parser.add_argument("--encoder-token-budget", type=int, default=EncoderOptions().token_budget,
                        help="tokens DAGER's bidirectional search may run through block 1 per update")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "float64"], default=["float32", "float64"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trajectory", action="store_true",
                        help="second-layer test also at the weights of each local step (Dager.attack(trajectory=...))")
    args = parser.parse_args()
    attack = Dager(span=SpanTests(l1_threshold=args.threshold, l2_threshold=args.threshold),
                   encoder=EncoderOptions(token_budget=args.encoder_token_budget))
    print(f"# eval-mode FedAvg E = {args.epochs}, B = {args.minibatch}, n = 4, lr 0.01; DAGER thresholds {args.threshold:g}, "
          f"search budget {args.encoder_token_budget:,} tokens; second-layer test "
          f"{'along the local trajectory' if args.trajectory else 'at the global weights'}")
    print("| client | update | true tokens: max l1 distance | vocabulary: median | true sequences passing l2 (max distance) | exact sequences | mode | candidates per position | reason / flags | seconds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes:
        pipeline, batch = observed_batch(dtype, args.epochs, args.minibatch, args.seed)
        update = batch["update"] * pipeline.client.gradient_scale()
        split = pipeline.split(update)
        ids = batch["input_ids"].view(update.shape[0], 4, -1)
        target = pipeline.target.eval()
        client = pipeline.client
        trajectory = local_step_offsets(client) if args.trajectory else ()
        for u in range(min(args.updates, update.shape[0])):
            one = {name: grads[u] for name, grads in split.items()}
            worst, median = true_token_distances(attack, target, one, ids[u])
            second = true_sequence_distances(attack, target, one, ids[u], trajectory)
            passing = int((second < args.threshold).sum())
            result = attack.attack(target, one, batch_size=4, max_length=ids.shape[-1], trajectory=trajectory)
            truth = {tuple(s) for s in ids[u].tolist()}
            exact = sum(tuple(s) in truth for s in result.sequences)
            diag = result.diagnostics
            cands = diag.get("candidates_per_position", [])
            spread = f"{min(cands)}-{max(cands)}" if cands else "-"
            notes = "; ".join([diag.get("reason", "")] + list(diag.get("flags", []))).strip("; ")
            print(f"| {dtype} | {u} | {worst:.2e} | {median:.2e} | {passing}/4 ({float(second.max()):.1e}) | {exact}/4 | {diag.get('mode')} | {spread} | {notes or '-'} | {diag['seconds']:.0f} |",
                  flush=True)
    print(f"\n# {torch.__version__}, {torch.get_num_threads()} threads; median over the vocabulary at all positions")


if __name__ == "__main__":
    main()
