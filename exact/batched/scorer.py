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
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from exact.batched.search import Prefixes, SpanScorer, decoder, sequence_inputs
from exact.batched.sites import Site

FORMAT = "lti-batched-scorer/1"


@dataclass
class ScorerWeights:
    """One weight per site's span term (S,) and one for the global model's log-probability."""

    sites: Tensor
    lm: float
    fingerprint: str = ""

    @classmethod
    def hand_set(cls, sites: int, lm_weight: float) -> ScorerWeights:
        return cls(torch.ones(sites, dtype=torch.float64), float(lm_weight))

    def save(self, path: str | Path) -> None:
        """Written atomically (a temporary file in the same folder, then renamed)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.close(handle)
        try:
            save_file({"sites": self.sites.double().contiguous(), "lm": torch.tensor([self.lm], dtype=torch.float64)},
                      temporary, metadata={"format": FORMAT, "fingerprint": self.fingerprint})
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, path: str | Path, fingerprint: str | None = None, sites: int | None = None) -> ScorerWeights:
        """Raises ValueError (one line) for an unreadable file, another model's weights or another site count."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt") as f:
                metadata = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as error:  # safetensors raises several types for a damaged file
            raise ValueError(f"scorer weights {path} are unreadable ({type(error).__name__})") from None
        if metadata.get("format") != FORMAT or set(tensors) != {"sites", "lm"}:
            raise ValueError(f"{path} is not a batched-scorer file (format {metadata.get('format')!r})")
        if fingerprint is not None and metadata.get("fingerprint") != fingerprint:
            raise ValueError(f"scorer weights {path} were fitted for another model "
                             f"(fingerprint {metadata.get('fingerprint', '')[:12]}, this model {fingerprint[:12]})")
        weights = cls(tensors["sites"].double(), float(tensors["lm"][0]), metadata.get("fingerprint", ""))
        if sites is not None and weights.sites.numel() != sites:
            raise ValueError(f"scorer weights {path} hold {weights.sites.numel()} sites; the model has {sites}")
        if not bool(torch.isfinite(weights.sites).all()) or not torch.isfinite(torch.tensor(weights.lm)):
            raise ValueError(f"scorer weights {path} hold non-finite values")
        return weights


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
    return fit_weights(examples, start)
