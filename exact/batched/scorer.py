"""The learned scorer of the batched search: how much each site's span test and the global model's prior
count, fitted by the server on updates it simulates from its own auxiliary text.

The hand-set score weighs every site's log-fraction alike and the prior by `lm_weight`. Sites differ:
deep layers' whitened inputs carry more of the sequence but their rows mix more inputs, and how sharp
each test is changes with B. `ScorerWeights` holds one weight per site and one for the prior;
`extension_examples` collects, from a simulated update whose sequences the server knows, every
position's candidates (each site's term and the prior, with the true prefixes known, as the search
knows its own choices), and `fit_weights` maximises the true extension's softmax probability among
them (a conditional logit, L2-tied to the hand-set weights). Plain PyTorch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from datamodules.atomic_files import atomic_writer
from exact.batched.search import Prefixes, SpanScorer, decoder, sequence_inputs
from exact.batched.sites import Site

#: Version 2 holds one set of weights per group of batch sizes (each set fitted on updates of those B); version 1,
#: one set for every B, is still read.
FORMAT = "lti-batched-scorer/2"
FORMATS = ("lti-batched-scorer/1", FORMAT)


@dataclass
class ScorerWeights:
    """One weight per site's span term (S,) and one for the global model's log-probability; `batch_sizes`: the B
    of the updates they were fitted on (empty: any B)."""

    sites: Tensor
    lm: float
    fingerprint: str = ""
    batch_sizes: tuple[int, ...] = ()

    @classmethod
    def hand_set(cls, sites: int, lm_weight: float) -> ScorerWeights:
        return cls(torch.ones(sites, dtype=torch.float64), float(lm_weight))

    def distance(self, batch_size: int) -> float:
        """How far `batch_size` is from the B these weights were fitted on (log2; 0 for weights of any B)."""
        if not self.batch_sizes:
            return 0.0
        return min(abs(math.log2(batch_size) - math.log2(b)) for b in self.batch_sizes)

    def save(self, path: str | Path) -> None:
        """Written atomically (a temporary file in the same folder, then renamed)."""
        save_scorers(path, [self])

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None, sites: int | None = None,
             batch_size: int | None = None) -> ScorerWeights:
        """The weights at `path` for updates of `batch_size` sequences: of the groups the file holds, the one
        fitted nearest it (in log2 B; the first on a tie). Raises ValueError (one line) for an unreadable file,
        another model's weights or another site count, or for a file of several groups without `batch_size`."""
        groups = load_scorers(path, fingerprint, sites)
        if batch_size is None:
            if len(groups) > 1:
                raise ValueError(f"scorer weights {path} hold one set per batch size "
                                 f"({', '.join(describe_batch_sizes(g.batch_sizes) for g in groups)}); name the batch size")
            return groups[0]
        return nearest(groups, batch_size)


def nearest(groups: list[ScorerWeights], batch_size: int) -> ScorerWeights:
    """Of a file's sets, the one fitted nearest `batch_size` (in log2 B; the first on a tie)."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    return min(groups, key=lambda g: g.distance(batch_size))


def describe_batch_sizes(batch_sizes: tuple[int, ...]) -> str:
    return "B = " + "/".join(str(b) for b in batch_sizes) if batch_sizes else "any B"


def save_scorers(path: str | Path, groups: list[ScorerWeights]) -> None:
    """Sets of weights of one model, each for its own batch sizes, in one file; written atomically."""
    from safetensors.torch import save

    if not groups:
        raise ValueError("no scorer weights to save")
    if len({g.fingerprint for g in groups}) > 1 or len({g.sites.numel() for g in groups}) > 1:
        raise ValueError("scorer weights of one file must be of one model (one fingerprint, one site count)")
    if len(groups) > 1 and any(not g.batch_sizes for g in groups):
        # a set for any B would be as near every B as a set fitted for it: name the batch sizes of every set
        raise ValueError("a set of scorer weights for any B cannot share a file with others; give its batch sizes")
    tensors = {}
    for n, g in enumerate(groups):
        tensors[f"sites.{n}"] = g.sites.double().contiguous()
        tensors[f"lm.{n}"] = torch.tensor([g.lm], dtype=torch.float64)
    metadata = {"format": FORMAT, "fingerprint": groups[0].fingerprint,
                "batch_sizes": json.dumps([list(g.batch_sizes) for g in groups])}
    with atomic_writer(path, "write scorer weights to") as file:
        file.write(save(tensors, metadata=metadata))


def load_scorers(path: str | Path, fingerprint: str | None = None, sites: int | None = None) -> list[ScorerWeights]:
    """Every set of weights at `path` (`ScorerWeights.load` picks one for a batch size)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:  # safetensors raises several types for a damaged file
        raise ValueError(f"scorer weights {path} are unreadable ({type(error).__name__})") from None
    version = metadata.get("format")
    try:
        if version == FORMATS[0] and set(tensors) == {"sites", "lm"}:
            parts, batch_sizes = [(tensors["sites"], tensors["lm"])], [[]]
        elif version == FORMAT:
            batch_sizes = json.loads(metadata["batch_sizes"])
            if not isinstance(batch_sizes, list) or not all(isinstance(b, list) for b in batch_sizes):
                raise TypeError("batch_sizes")
            parts = [(tensors[f"sites.{n}"], tensors[f"lm.{n}"]) for n in range(len(batch_sizes))]
            if set(tensors) != {f"{kind}.{n}" for n in range(len(batch_sizes)) for kind in ("sites", "lm")}:
                raise KeyError("tensors")
        else:
            raise KeyError("format")
        groups = [ScorerWeights(w.double().reshape(-1), float(lm.reshape(-1)[0]), metadata.get("fingerprint", ""),
                                tuple(int(b) for b in sizes)) for (w, lm), sizes in zip(parts, batch_sizes)]
    except (KeyError, ValueError, TypeError, IndexError, RuntimeError):
        raise ValueError(f"{path} is not a batched-scorer file (format {version!r})") from None
    if not groups:
        raise ValueError(f"scorer weights {path} hold no weights")
    if fingerprint is not None and metadata.get("fingerprint") != fingerprint:
        raise ValueError(f"scorer weights {path} were fitted for another model "
                         f"(fingerprint {metadata.get('fingerprint', '')[:12]}, this model {fingerprint[:12]})")
    if len(groups) > 1 and any(not g.batch_sizes for g in groups):
        raise ValueError(f"scorer weights {path} mix a set for any B with sets for given batch sizes")
    for weights in groups:
        if sites is not None and weights.sites.numel() != sites:
            raise ValueError(f"scorer weights {path} hold {weights.sites.numel()} sites; the model has {sites}")
        if not bool(torch.isfinite(weights.sites).all()) or not math.isfinite(weights.lm):
            raise ValueError(f"scorer weights {path} hold non-finite values")
        if any(b < 1 for b in weights.batch_sizes):
            raise ValueError(f"scorer weights {path} name a batch size below 1")
    return groups


@dataclass
class Example:
    """One extension the search scores: every candidate's site terms (K, S) and prior (K,), the true one's index."""

    terms: Tensor
    prior: Tensor
    true: int


#: What a scored extension's deflation knows: "search", the joint search's (every sequence's positions before p, the
#: sequences before i at p); "refine", a refinement pass's (every other sequence whole, i's positions before p).
STATES = ("search", "refine")


def extension_examples(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int],
                       ids: Tensor, state: str = "search") -> list[Example]:
    """The examples of one simulated update of the sequences `ids` (B, L): for every input position p >= 1
    and sequence i, every bag token as the extension of i's true prefix, scored with the inputs the search
    would know by then deflated (`state`: the joint search's or a refinement pass's, `STATES`). A true
    token missing from the bag gives no example."""
    return examples_by_state(target, sites, scorer, bag, ids, (state,))[state]


@torch.no_grad()
def examples_by_state(target: nn.Module, sites: list[Site], scorer: SpanScorer, bag: list[int], ids: Tensor,
                      states: tuple[str, ...] = STATES) -> dict[str, list[Example]]:
    """`extension_examples` of several states from one forward pass of the candidates."""
    for state in states:
        if state not in STATES:
            raise ValueError(f"state={state!r} is not one of {STATES}")
    _, _, device = decoder(target)
    ids = ids.to(device)
    candidates = torch.tensor(bag, dtype=torch.long, device=device)
    where = {token: k for k, token in enumerate(bag)}
    truth_inputs = sequence_inputs(target, sites, ids)  # (B, L-1, d) per site
    examples: dict[str, list[Example]] = {state: [] for state in states}
    batch = ids.shape[0]
    rows = torch.arange(batch, device=device).repeat_interleave(len(bag))
    for p in range(1, ids.shape[1] - 1):
        run = Prefixes(target, sites, ids[:, :p])
        hidden = run.extend(rows, candidates.repeat(batch))  # every sequence's extensions in one pass
        for i in range(batch):
            true = where.get(int(ids[i, p]))
            if true is None:
                continue
            mine = slice(i * len(bag), (i + 1) * len(bag))
            prior = run.logp[i, candidates].double().cpu()
            for state in states:
                if state == "search":
                    known = [torch.cat([h[:, :p].reshape(-1, h.shape[-1]), h[:i, p]]) for h in truth_inputs]
                else:
                    others = [j for j in range(batch) if j != i]
                    known = [torch.cat([h[others].reshape(-1, h.shape[-1]), h[i, :p]]) for h in truth_inputs]
                examples[state].append(Example(scorer.terms([h[mine] for h in hidden], scorer.bases(known)).cpu(),
                                               prior, true))
    return examples


def fit_weights(examples: list[Example], start: ScorerWeights, l2: float = 1e-2, steps: int = 200) -> ScorerWeights:
    """The weights maximising the true extensions' mean log-softmax probability, plus `l2` times the squared
    distance to `start` (few examples must not move weights the data says nothing about)."""
    if not examples:
        raise ValueError("no examples to fit the scorer on (no true token was in its bag)")
    size = max(e.terms.shape[0] for e in examples)
    count = start.sites.numel()
    terms = torch.zeros(len(examples), size, count, dtype=torch.float64)
    prior = torch.zeros(len(examples), size, dtype=torch.float64)
    mask = torch.zeros(len(examples), size, dtype=torch.bool)
    for n, e in enumerate(examples):
        terms[n, : e.terms.shape[0]], prior[n, : e.prior.shape[0]], mask[n, : e.terms.shape[0]] = e.terms, e.prior, True
    true = torch.tensor([e.true for e in examples])
    origin = torch.cat([start.sites.double(), torch.tensor([start.lm], dtype=torch.float64)])
    weights = origin.clone().requires_grad_(True)
    optimizer = torch.optim.LBFGS([weights], max_iter=steps, line_search_fn="strong_wolfe")

    def loss() -> Tensor:
        optimizer.zero_grad()
        logits = (terms @ weights[:count] + prior * weights[count]).masked_fill(~mask, -float("inf"))
        value = -logits.log_softmax(1).gather(1, true[:, None]).mean() + l2 * (weights - origin).pow(2).sum()
        value.backward()
        return value

    optimizer.step(loss)
    fitted = weights.detach()
    return ScorerWeights(fitted[:count].clone(), float(fitted[count]), start.fingerprint)


def accuracy_at_one(examples: list[Example], weights: ScorerWeights) -> float:
    """The fraction of examples whose true extension scores highest (ties count against)."""
    hits = 0
    for e in examples:
        score = e.terms @ weights.sites + weights.lm * e.prior
        hits += int(int((score >= score[e.true]).sum()) == 1)
    return hits / max(1, len(examples))


def describe(weights: ScorerWeights) -> str:
    return json.dumps({"sites": [round(float(w), 3) for w in weights.sites], "lm": round(weights.lm, 3)})


def fit_scorer(target: nn.Module, sites: list[Site], whitening, observe, blocks: Tensor, batch_size: int,
               updates: int, start: ScorerWeights, picks_per_sequence: int | None = None, say=print) -> ScorerWeights:
    """The learned scorer fitted on `updates` updates the server simulates of its own `blocks` (N, L), B of
    them per update, taken in order: `observe(ids)` returns the {name: gradient} the server would read of a
    client sending the update of `ids` (B, L); bag recovery's budget is `exact.batched.bag.pick_budget`'s.
    Raises ValueError when the blocks hold fewer than one update."""
    from exact.batched.bag import pick_budget, somp
    from exact.batched.whitening import vocabulary_inputs

    updates = min(updates, blocks.shape[0] // batch_size)
    if updates < 1:
        raise ValueError(f"the learned scorer needs at least {batch_size} auxiliary blocks beyond the whitening's")
    dictionary = vocabulary_inputs(target) @ whitening.vocabulary
    examples: list[Example] = []
    for k in range(updates):
        ids = blocks[k * batch_size : (k + 1) * batch_size]
        split = observe(ids)
        rows = [site.rows(split).double() for site in sites]
        bag = somp(rows[0] @ whitening.vocabulary, dictionary,
                   pick_budget(batch_size, blocks.shape[1], picks_per_sequence)).tokens
        examples += extension_examples(target, sites, SpanScorer(rows, whitening.sites), bag, ids)
        say(f"learned scorer: simulated update {k + 1}/{updates}, {len(examples)} extensions")
    fitted = fit_weights(examples, start)
    fitted.batch_sizes = (batch_size,)
    return fitted
