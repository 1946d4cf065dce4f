"""How much of a token's position its span coefficients carry (the candidate pointer's premise, design page §10).

For each one-sequence update of an `lti fit` config's threat model (a RoPE target: SmolLM2 with LoRA),
the first layer's span rows (lora_A gradient rows) are solved by least squares over the update's own
distinct token inputs; each token's coefficients (2r numbers), their log-magnitudes and the log norms of
the query and value parts become features, its position (tokens that occur once) the label. A
gradient-boosted classifier is fitted on updates of the auxiliary split and scored on the evaluation
split's first blocks:

    python -m benchmarks.investigations.candidates.position_signal --threat-model configs/audit/inverter_smollm2_lora.yaml
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from exact.span_evidence import SpanEvidence


def signatures(data, evidence: SpanEvidence, split: str, blocks: int, chunk: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """(n, features) signatures and (n,) positions of the tokens that occur once in their block."""
    pipeline, ids_all = data.pipeline, data.blocks(split)[0][:blocks]
    features, labels = [], []
    for start in range(0, len(ids_all), chunk):
        ids = ids_all[start : start + chunk]
        spaces = evidence.input_spaces(pipeline.split(pipeline({"input_ids": ids[:, None]}, keep_update=True).update))
        for u in range(ids.shape[0]):
            tokens = ids[u, :-1]  # the last token gets no gradient
            unique, inverse, counts = torch.unique(tokens, return_inverse=True, return_counts=True)
            x = evidence.inputs(unique, None)  # (K, d) float64
            a = torch.linalg.lstsq(x.T, spaces[u].double()).solution  # (K, width)
            a = a / a.norm().clamp_min(1e-300)
            half = a.shape[1] // 2
            for k in torch.nonzero(counts == 1).flatten().tolist():
                row = a[k]
                norms = torch.stack([row[:half].norm(), row[half:].norm()]).clamp_min(1e-30).log()
                features.append(torch.cat([row, row.abs().log1p(), norms]).float().numpy())
                labels.append(int(torch.nonzero(inverse == k)[0]))
    return np.stack(features), np.array(labels)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threat-model", required=True, help="an `lti fit` config with a RoPE target and B = 1")
    parser.add_argument("--train-blocks", type=int, default=800)
    parser.add_argument("--eval-blocks", type=int, default=256)
    args = parser.parse_args(argv)
    from sklearn.ensemble import HistGradientBoostingClassifier

    from lti.trainer_cli import instantiate

    torch.manual_seed(0)
    _, data = instantiate(args.threat_model)
    data.setup("fit")
    length = data.seq_len
    evidence = SpanEvidence(data.pipeline.target, list(data.pipeline.names), length, length)
    x_train, y_train = signatures(data, evidence, "auxiliary", args.train_blocks)
    x_eval, y_eval = signatures(data, evidence, "evaluation", args.eval_blocks)
    classifier = HistGradientBoostingClassifier(max_iter=200, random_state=0).fit(x_train, y_train)
    accuracy = float((classifier.predict(x_eval) == y_eval).mean())
    majority = float(np.bincount(y_eval).max() / len(y_eval))
    print(f"position named for {100 * accuracy:.1f}% of {len(y_eval)} held-out tokens "
          f"(the most frequent position: {100 * majority:.1f}%; trained on {len(y_train)} tokens)")
    return {"accuracy": accuracy, "majority": majority, "eval_tokens": len(y_eval), "train_tokens": len(y_train)}


if __name__ == "__main__":
    main()
