"""SPEAR (Dimitrov et al., NeurIPS 2024): exact recovery of a batch from a ReLU layer's gradient.

For a linear layer Z = W X + b (W: m x n, one column of X per sample, batch size b < min(m, n))
followed by a ReLU, the weight gradient dL/dW = (dL/dZ) X^T has rank b. SPEAR factors it and uses
the sparsity that the ReLU puts into dL/dZ:

1. **Low-rank factorisation.** The truncated SVD dL/dW = L R (L: m x b, R: b x n, float64 by
   default) determines everything up to an unknown invertible Q (b x b): dL/dZ = L Q and
   X^T = Q^-1 R. The rank b is the batch size when it is given, else the numerical rank (singular
   values above `rank_tol` times the largest).
2. **Dead neurons.** Rows of L that are (numerically) zero belong to neurons that are inactive for the
   whole batch; they carry no information and are dropped before sampling.
3. **Sampling.** Where sample j's neuron i is inactive, (dL/dZ)_ij = L_i q_j = 0. If b - 1 rows of L
   all lie in column j's zero set, q_j spans the kernel of that (b-1) x b submatrix. Submatrices are
   drawn at random, `batch_samples` at a time (vectorised: one batched solve); a cheap pre-filter on
   a random subset of rows discards the vast majority of kernels before the full sparsity test.
4. **Filter, refine, merge.** A kernel direction q is a candidate when L q has at least
   max(tau * live rows, b) zeros (relative to the row norms, `zero_tol`); it is then refined as the
   least-squares kernel of all its zero rows, and duplicates (|cos| ~ 1) are merged. Most sparse
   kernels are *mixtures*: b-2 sampled rows from the intersection of two columns' zero sets plus one
   arbitrary row give a direction in span(q_j, q_k) with ~m/4 zeros. Their zero set needs that one
   row for its rank (a row of leverage 1, tested batched in `sampling.pivotal`); such "pivotal"
   candidates are kept only as a bounded fallback (`max_pivotal`), ranked after all others, because
   a true column whose zero set is nearly contained in another's is pivotal too.
5. **Greedy selection and the certificate.** The b sparsest linearly independent candidates form
   Q_hat; the scale and sign of each column come from the bias gradient, dL/db = (dL/dZ) 1 = L Q 1,
   so s = Q_hat^-1 L^+ dL/db and Q = Q_hat diag(s). The reconstruction is X = (Q^-1 R)^T. With the
   layer's weight and bias, the *sparsity-matching certificate* compares the zero pattern of
   dL/dZ = L Q with the ReLU pattern of W X_hat + b: full agreement certifies the recovery as exact
   (a wrong reconstruction would have to reproduce m * b activation signs by chance). When it fails
   and spare candidates exist, a local search over single swaps (best swap per slot, least sparse
   slots first, `max_swaps` certificate evaluations) runs while the agreement improves. Sampling stops
   as soon as the selection is certified (or, without weight and bias, once b independent candidates
   exist), or when the sample budget (`max_samples`, optionally `max_seconds`) is spent.

Expected samples grow like 2^(b-1) ln b (each column needs b - 1 rows from its zero set, about half
the live rows); the paper reports B = 20 in 1.4-2.6 min per batch on a GPU.

Degenerate inputs (rank 0, b >= min(m, n), no bias gradient, fewer live neurons than b, exhausted
budget) never raise: a best-effort result is returned with `exact=False` and the reason in `reason`.

Modules, by step: `layer` (find the attacked Linear by name), `sampling` (steps 3-4: kernels, the
sparsity filter, refinement, the pivotal pool), `prior` (prior-guided directions from plausible
layer inputs), `selection` (step 5: selection, swap search, scale and the certificate), `options`
(the option groups: `SearchBudget`, `Sampling`, `Tolerances`, `Selection`, `PriorGuidance`), `attack`
(the `Spear` configuration and `SpearRun`, one attack call from factorisation to result, which hands
each step the options and search state it needs).

Plain PyTorch: this package never imports Lightning.
"""

from exact.spear.attack import Spear, SpearResult
from exact.spear.layer import ReluLinear, relu_linear_layer
from exact.spear.options import PriorGuidance, Sampling, SearchBudget, Selection, SpearOptions, Tolerances
from exact.spear.selection import sparsity_agreement

__all__ = [
    "PriorGuidance", "ReluLinear", "Sampling", "SearchBudget", "Selection", "Spear", "SpearOptions", "SpearResult",
    "Tolerances", "relu_linear_layer", "sparsity_agreement",
]
