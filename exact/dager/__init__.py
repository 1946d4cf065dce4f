"""DAGER (Petrov et al., NeurIPS 2024): exact recovery of a client's token batch from its gradient.

For a linear layer Y = X W, the weight gradient is X^T dL/dY, so its columns lie in the span of the
layer's inputs X (one row per token). DAGER tests which candidate inputs lie in that span, in four
steps, one module each:

1. `span`: the span of the first attention layer's gradient (SVD, explicit relative rank tolerance)
   and the distance of a vector to it;
2. `span`: token filtering: every vocabulary token at every position whose first-layer input lies in
   that span (`l1_threshold`) is a candidate of that position;
3. sequences whose second-layer inputs (`probe`: block 1 run on the sequence) lie in the span of the
   second attention layer's gradient (`l2_threshold`): a prefix search for causal models (`causal`),
   a bounded beam / coordinate-descent search for bidirectional ones (`encoder`);
4. `last_token`: the last token of each causal sequence (a label only) from the gradient of the final
   normalisation.

`attack.Dager` is the configuration, its options in groups (`options`: `SpanTests`, `Budgets`,
`CausalOptions`, `EncoderOptions`, `RelaxedFill`, `Extensions`); `run.DagerRun` is one attack on one
update (the strict path, the relaxed best effort when it fails, and the certificate that the
recovered sequences explain both gradients), which hands each step the options and state it needs;
`result.DagerResult` is what it returns. `probe.SecondLayerProbe` runs block 1 on candidate
sequences (also what the diagnostics scripts in benchmarks/ measure with).

Plain PyTorch: this package never imports Lightning.
"""

from exact.dager.attack import Dager, dager_attack, local_step_offsets
from exact.dager.options import (
    Budgets,
    CausalOptions,
    DagerOptions,
    EncoderOptions,
    Extensions,
    RelaxedFill,
    SpanTests,
)
from exact.dager.probe import SecondLayerProbe
from exact.dager.result import DagerResult
from exact.dager.run import DagerRun
from exact.dager.span import SpanBasis, span_basis, token_distances

__all__ = [
    "Budgets", "CausalOptions", "Dager", "DagerOptions", "DagerResult", "DagerRun", "EncoderOptions", "Extensions",
    "RelaxedFill", "SecondLayerProbe", "SpanBasis", "SpanTests", "dager_attack", "local_step_offsets", "span_basis",
    "token_distances",
]
