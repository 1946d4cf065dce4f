"""The batched LoRA attack: bag recovery, the joint all-site search, and the least-squares check, on one
update of B sequences (`exact.batched`'s parts put together). The same attack reads a full-weight update through
its wide sites (`sites.wide_sites`: GPT-2's MLP down-projections), the bag then from the first layer's span.
Plain PyTorch.

`BatchedLoRA(target, names, whitening).attack(update, batch_size, length)` returns the B sequences, each
token's margin, the bag and, when a `simulate` function is given (the server re-simulating the update of
each recovered sequence alone, (B, D) flat), the check: the update refitted as a combination of the
sequences' own updates by least squares. A relative residual near zero certifies the batch (float32
weights leave about 1e-6); a large one says the reconstruction is not the batch, and each sequence's
coefficient (1/B when it is right) says which are doubtful.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor, nn

from datamodules.federated.protocols.base import model_mode
from exact.batched.bag import pick_budget, somp, span_bag
from exact.batched.search import (
    SCREEN_PRECISIONS,
    ExtensionCache,
    SpanScorer,
    bfloat16_twin,
    decoder,
    grow_sequences,
    likeliest_labels,
    others_inputs,
    refine_sequences,
    sequence_inputs,
)
from exact.batched.sites import Site, adapter_sites, capture_site_inputs
from exact.batched.whitening import SiteWhitening, vocabulary_inputs
from exact.layers import find_layers
from exact.option_group import OptionGroup

#: The largest B whose searches make the first-site cut by default (`BatchedOptions.first_site_shortlist`).
FIRST_SITE_CUT_UP_TO = 4
#: The largest B whose refused regrowths are not followed by restarts by default (`BatchedOptions.restart_first_tokens`).
RESTARTS_ABOVE = 4
#: A refit leaving less than this fraction of the update's norm certifies the batch.
CERTIFY_RESIDUAL = 1e-3


def certifies(residual: float | None) -> bool:
    """Whether a refit residual (None: no refit) certifies the batch."""
    return residual is not None and residual < CERTIFY_RESIDUAL


@dataclass(frozen=True)
class BatchedOptions(OptionGroup):
    """The batched LoRA attack (bag recovery and the all-site span search).

    Args:
        picks_per_sequence: Bag recovery stops after B times this many tokens at most (None: the sequence length L,
            as many as a sequence has tokens; a sequence of L tokens has L - 1 visible ones).
        tolerance: ...or once the residual energy of the first site's rows falls below this fraction.
        lm_weight: Weight of the global model's next-token log-probability in the search.
        beam: Prefixes kept per sequence.
        refine: Passes of refinement at most, after the search and after each regrowth (None: 2B with the server's
            simulation, else B / 2; at least 2): every sequence grown again with the others' inputs known. With the
            server's simulation (the audit), a refined sequence is kept only if it lowers the refit residual, and the
            first pass that keeps none ends them, so the cap only bounds the time: a larger batch has more wrong
            sequences to repair a few at a time (on an auxiliary B = 8 update the passes kept sequences up to the
            tenth, 44% after four, 90% after ten). Without it every pass is kept, so the cap is what runs. A batch
            the refit certifies (its last tokens the LM's guesses) is refined and regrown no further.
        regrow: Attempts at most, after refinement (with the server's simulation, B >= 3; None: B / 4, at least 1):
            the sequences the refit explains least (half the batch, at least 2) grown again jointly with the
            others' inputs known, kept if the refit residual falls, then refined again; the first refused ends them.
            Refinement regrows one sequence against all the others, so a batch with two wrong sequences misleads
            both regrowths; grown together, the doubtful ones are a smaller batch.
        restart_first_tokens: When a regrowth is refused (with the server's simulation, B >= 3), the sequences the refit
            explains least (half the batch, at least 2) are each grown again on their own, the others' inputs known,
            from this many other first tokens (the bag's best by every site's test at position 0 with the others
            known, the current one left out), and each takes the variant of lowest refit residual if that is lower
            than the residual as it stands; if one is taken, refinement runs again (counting as a regrowth attempt).
            None: 4 at B > `RESTARTS_ABOVE`, none at smaller B; 0: none. A search that commits to a wrong first token
            deflates every later choice by it, and refinement rarely leaves that. Chosen on the auxiliary tail: at
            B = 8 restarts took the attack from 58.3% to 76.0% (three updates, in about 1.7 times the time); at B = 4
            they took nothing on four updates already read at 92–97% and cost 23–28 s each.
        refine_beam: Prefixes kept per sequence in refinement (None: `beam`). With the other sequences' inputs known,
            the span test is nearly a membership test, so a narrower beam may keep what a wide one finds.
        refine_shortlist: Extensions per sequence scored by every site in refinement (None: `shortlist`).
        refine_resume: Refinement passes resume each sequence after the prefix the screen confirms (every token ranked
            first among the bag's extensions, the others' inputs known: `search.verified_lengths`) and regrow only the
            sequences not confirmed whole; when such a pass keeps none, a pass from the start follows, and the first of
            those that keeps none ends them (with the server's simulation; without it the passes alternate). Every pass
            counts against `refine`, so the cap may end them before a pass from the start has run. A pass from
            the start trades a right prefix for a wrong one where some others are wrong (on an auxiliary B = 8 update 21
            of 72 proposals went wrong before the sequence itself first did). Not the
            default: on the auxiliary tail at B = 4 it kept the same sequences in every pass, and took longer (little is
            confirmed where the passes work, and the pass that keeps none costs one more).
        refine_in_turn: Each refinement pass regrows the sequences one at a time, each against the others as they
            stand (a sequence the pass kept already known by the ones after it), and keeps it or not before the next
            (with the server's simulation; without it, every regrown sequence is kept). A pass of all at once regrows
            every sequence against the others as the pass found them, so the later ones are still deflated by a
            wrong sequence the pass repairs. The same extensions either way; the sequences run through the model one
            at a time instead of together. Not measured yet.
        refine_scorer: The weights refinement passes score with when the search has a learned scorer: "search" (the
            search's) or "hand_set" (1 per site and `lm_weight`). With every other sequence known, the test is nearly
            one of membership, and there the hand-set weights rank the true extension first more often (auxiliary
            tail, B = 16, the true sequences known: 99.8% against 96.7% with the learned weights, which rank it first
            72% of the time in the joint search against 38% hand-set: `train_scorer`'s two states).
        refine_screen_sites: Sites of refinement's screen (None: `screen_sites`). With the others' inputs known,
            the first sites' test is nearly one of membership too; but on the auxiliary tail (B = 4) a screen of
            2 sites with a shortlist of 32 lost 5 points and was no faster, so the default screens as the search.
        screen_sites: Every extension is first scored by this many sites alone (the forward pass stops there)...
        shortlist: ...and only this many per sequence run through every site (0 with either: every extension
            through every site).
        first_site_shortlist: Before the screen, the extensions per sequence kept by the first site's term alone (plus
            the prior and the prefix's score; None: at B <= `FIRST_SITE_CUT_UP_TO` twice the shortlist, refinement's
            own where it has one, so 128 by default, and none at larger B; 0: none; else more than the shortlists). A
            RoPE model's first site reads the token's normalised embedding whatever its position, so this cut runs no
            forward pass (a model whose first site reads a position, GPT-2's, ignores it). The screen's forward passes
            are then a fixed count per sequence instead of beam times the bag's size, which grows with B. Chosen on
            the auxiliary tail: at B = 4 it read the same in less time; at B = 8 it read 58.3% against 65.9% without
            it (three updates), and at B = 16 20.3% against 23.4% at equal time (one update), where the first site
            alone separates less of a larger bag.
        screen_precision: The screen's forward pass in "float32" or "bfloat16" (a copy of the model with bfloat16
            weights, made once per update: `search.bfloat16_twin`; the full pass, which chooses, stays in the model's
            precision). The screen only shortlists: with the true prefixes given (auxiliary tail, B = 16) the
            bfloat16 screen's shortlists keep the true token as often as the float32 one's, and on a CPU with
            bfloat16 instructions four B = 4 updates read the same in 7% less time. Not the default: the default's
            measurements were made with float32.
        label_candidates: The last token of each sequence (a label, never an input) is chosen among the global
            model's this many likeliest by the least-squares refit of the update (1: the likeliest).
        extension_cache_gib: Memory (GiB, on the model's device) for the site inputs of extensions already computed
            in an attack, reused when a later step extends the same prefix by the same token (`search.ExtensionCache`,
            which says how to size it; 0: none). Refinement regrows every sequence each pass, and the sequences
            already right explore the prefixes they explored the pass before. A reused input may differ from a
            recompute by float rounding. The audit's stored scores do not depend on it.
        second_opinion_above: With the server's simulation and a second scorer (`BatchedLoRA(second_opinion=...)`,
            e.g. the learned one), a result whose refit residual is above this is searched again with that
            scorer, and the result of lower residual is kept (chosen on the auxiliary tail: below about 0.3 a
            B = 4 result is nearly right, above it an early commitment went wrong).
        time_budget: Seconds an update's attack may take before it starts no further refinement pass, regrowth,
            restart or second search (None: no budget). The search, a step already started and the final label refit
            always run, so an update overruns it by up to one step; a result cut short says so
            (`BatchedResult.budget_reached`, counted in the audit's report). A bound on the audit's time for large
            B on a CPU, at the accuracy the trace reached by then; a second search starts only after the first one's
            whole path, so any budget shorter than that path leaves it out.
    """

    picks_per_sequence: int | None = None
    tolerance: float = 1e-6
    lm_weight: float = 0.5
    beam: int = 4
    label_candidates: int = 16
    refine: int | None = None
    refine_beam: int | None = None
    refine_shortlist: int | None = None
    refine_screen_sites: int | None = None
    refine_scorer: Literal["search", "hand_set"] = "search"
    refine_resume: bool = False
    refine_in_turn: bool = False
    regrow: int | None = None
    restart_first_tokens: int | None = None
    screen_sites: int = 8
    shortlist: int = 64
    first_site_shortlist: int | None = None
    screen_precision: Literal["float32", "bfloat16"] = "float32"
    extension_cache_gib: float = 0.0
    second_opinion_above: float = 0.3
    time_budget: float | None = None

    def pick_budget(self, batch_size: int, length: int) -> int:
        """Bag recovery's largest number of picks for B sequences of `length` tokens."""
        return pick_budget(batch_size, length, self.picks_per_sequence)

    def first_site_cut(self, shortlist: int, batch_size: int) -> int:
        """The first-site cut before a screen keeping `shortlist` (the search's or refinement's) in an update of
        `batch_size` sequences (0: none)."""
        if self.first_site_shortlist is not None:
            return self.first_site_shortlist
        return 2 * shortlist if batch_size <= FIRST_SITE_CUT_UP_TO else 0

    def refine_passes(self, batch_size: int, *, checked: bool) -> int:
        """Refinement passes at most for B sequences (none for one); `checked`: with the server's simulation, which
        ends the passes at the first that keeps none."""
        if batch_size < 2:
            return 0
        if self.refine is not None:
            return self.refine
        return max(2, 2 * batch_size if checked else batch_size // 2)

    def restarts(self, batch_size: int) -> int:
        """First tokens tried per doubtful sequence when a regrowth is refused, for B sequences (0: no restarts)."""
        if self.restart_first_tokens is not None:
            return self.restart_first_tokens
        return 4 if batch_size > RESTARTS_ABOVE else 0

    def regrow_attempts(self, batch_size: int) -> int:
        """Regrowth attempts at most for B sequences (with the server's simulation; none below three)."""
        if batch_size < 3:
            return 0
        return max(1, batch_size // 4) if self.regrow is None else self.regrow

    def _check(self) -> None:
        if self.picks_per_sequence is not None and self.picks_per_sequence < 1:
            raise ValueError(f"picks_per_sequence={self.picks_per_sequence} must be >= 1")
        if not (0 < self.tolerance < 1):
            raise ValueError(f"tolerance={self.tolerance} must be in (0, 1)")
        if not (math.isfinite(self.lm_weight) and self.lm_weight >= 0):
            raise ValueError(f"lm_weight={self.lm_weight} must be finite and >= 0")
        if self.beam < 1:
            raise ValueError(f"beam={self.beam} must be >= 1")
        if self.refine is not None and self.refine < 0:
            raise ValueError(f"refine={self.refine} must be >= 0 (or null: 2B with the simulation, else B / 2)")
        if self.restart_first_tokens is not None and self.restart_first_tokens < 0:
            raise ValueError(f"restart_first_tokens={self.restart_first_tokens} must be >= 0 (0: none; null: 4 above "
                             f"B = {RESTARTS_ABOVE})")
        if self.regrow is not None and self.regrow < 0:
            raise ValueError(f"regrow={self.regrow} must be >= 0 (or null: B / 4)")
        if self.refine_beam is not None and self.refine_beam < 1:
            raise ValueError(f"refine_beam={self.refine_beam} must be >= 1 (or null: beam)")
        if self.refine_shortlist is not None and self.refine_shortlist < 0:
            raise ValueError(f"refine_shortlist={self.refine_shortlist} must be >= 0 (or null: shortlist)")
        if self.refine_screen_sites is not None and self.refine_screen_sites < 0:
            raise ValueError(f"refine_screen_sites={self.refine_screen_sites} must be >= 0 (or null: screen_sites)")
        if self.refine_scorer not in ("search", "hand_set"):
            raise ValueError(f"refine_scorer={self.refine_scorer!r} must be search or hand_set")
        if self.refine_in_turn and self.refine_resume:
            raise ValueError("refine_in_turn and refine_resume do not combine: a resumed pass chooses its sequences "
                             "itself")
        if self.screen_sites < 0 or self.shortlist < 0:
            raise ValueError(f"screen_sites={self.screen_sites} and shortlist={self.shortlist} must be >= 0")
        widest = max(self.shortlist, self.refine_shortlist or 0)
        cut = self.first_site_shortlist
        if cut is not None and (cut < 0 or 0 < cut <= widest):
            raise ValueError(f"first_site_shortlist={cut} must be 0 (none), null (twice the shortlist) or more than the "
                             f"shortlists ({widest}: the screen keeps that many of what the cut keeps)")
        if self.screen_precision not in SCREEN_PRECISIONS:
            raise ValueError(f"screen_precision={self.screen_precision!r} must be one of {', '.join(SCREEN_PRECISIONS)}")
        if not (math.isfinite(self.extension_cache_gib) and self.extension_cache_gib >= 0):
            raise ValueError(f"extension_cache_gib={self.extension_cache_gib} must be finite and >= 0 (0: no cache)")
        if self.label_candidates < 1:
            raise ValueError(f"label_candidates={self.label_candidates} must be >= 1")
        if not self.second_opinion_above >= 0:
            raise ValueError(f"second_opinion_above={self.second_opinion_above} must be >= 0")
        if self.time_budget is not None and not (math.isfinite(self.time_budget) and self.time_budget >= 0):
            raise ValueError(f"time_budget={self.time_budget} must be finite and >= 0 seconds (or null: none)")


@dataclass
class BatchedResult:
    sequences: list[list[int]]
    margins: list[list[float]]
    bag: list[int]
    residual: float | None = None  #: the least-squares check's relative residual (None: not checked)
    coefficients: list[float] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  #: each phase's wall time (bag, search, refine, check)
    #: Sequences each refinement pass kept (with the server's simulation; the last pass ran is the first to keep none
    #: unless the passes ran out).
    kept_per_pass: list[int] = field(default_factory=list)
    #: Each regrowth attempt: (the sequences grown again, whether kept).
    regrown: list[tuple[list[int], bool]] = field(default_factory=list)
    #: Each restart from other first tokens (`BatchedOptions.restart_first_tokens`): (the sequences tried, those taken).
    restarted: list[tuple[list[int], list[int]]] = field(default_factory=list)
    #: None: no second search; else whether the second scorer's result was kept.
    second_opinion: bool | None = None
    #: The search's result not kept, when a second search ran (for measurements of the choice).
    other: BatchedResult | None = None
    #: The sequences after each step, as (step, seconds since the attack began, sequences): "search", then each
    #: refinement pass ("refine"), regrowth attempt ("regrow") and restart ("restart"); their last tokens are the LM's
    #: guesses, before the refit chooses the labels. A curve of what each step bought, at what time.
    trace: list[tuple[str, float, list[list[int]]]] = field(default_factory=list)
    #: With an extension cache: the extensions the attack ran through the model ("computed") and those it reused.
    extensions: dict[str, int] = field(default_factory=dict)
    #: Whether a step was left out for `BatchedOptions.time_budget` (the result: the trace's first point at or after the
    #: budget, then the refit's labels).
    budget_reached: bool = False

    @property
    def certified(self) -> bool:
        return certifies(self.residual)


class BatchedLoRA:
    """The attack bound to a global model with LoRA adapters, its observed names and a whitening."""

    def __init__(self, target: nn.Module, names: list[str], whitening: SiteWhitening,
                 options: BatchedOptions = BatchedOptions(), scorer: tuple[Tensor, float] | None = None,
                 second_opinion: tuple[Tensor, float] | None = None, sites: list[Site] | None = None) -> None:
        """`scorer`: (site weights, prior weight) of a learned scorer the search scores with (`exact.batched.scorer`;
        default: 1 per site and `options.lm_weight`; refinement's weights: `options.refine_scorer`).
        `second_opinion`: (site weights, prior weight) of a second scorer for results the refit doubts
        (`BatchedOptions.second_opinion_above`). `sites`: where the update is read (default: the LoRA adapters
        among `names`; `wide_sites` for a full-weight update). A whitening without a vocabulary part (a model with
        a position table) takes the bag from the first attention layer's span (`bag.span_bag`; `names` must hold
        that layer's weight)."""
        self.target, self.names, self.options = target, list(names), options
        for name, given in (("scorer", scorer), ("second_opinion", second_opinion)):
            if given is not None and not (isinstance(given, tuple) and len(given) == 2):
                raise TypeError(f"{name} must be (site weights, prior weight), not {type(given).__name__}")
        self.scorer, self.second_opinion = scorer, second_opinion
        self.sites = adapter_sites(self.names) if sites is None else list(sites)
        if whitening.sites.shape[0] != len(self.sites):
            raise ValueError(f"the whitening holds {whitening.sites.shape[0]} sites; the model has {len(self.sites)}")
        self.whitening = whitening
        self._screen_model: nn.Module | None = None  # a bfloat16 screen's model, during an attack
        self._budget = _Budget(time.perf_counter(), None)  # the time budget of the attack running
        if whitening.vocabulary is not None:
            self.dictionary, self.first_layer = vocabulary_inputs(target) @ whitening.vocabulary, None
        else:
            self.dictionary, self.first_layer = None, find_layers(target)
            missing = [n for n in self.first_layer.first.names() if n not in set(self.names)]
            if missing:
                raise ValueError(f"the bag of a model with a position table is read from its first attention layer; "
                                 f"{missing[0]} is not observed")

    def bag(self, update: dict[str, Tensor], rows: list[Tensor], batch_size: int, length: int) -> list[int]:
        """The batch's distinct input tokens: pursuit over the whitened vocabulary (a RoPE model), or the first attention
        layer's span test of every token at every input position (a model with a position table)."""
        if self.dictionary is not None:
            return somp(rows[0] @ self.whitening.vocabulary, self.dictionary,
                        self.options.pick_budget(batch_size, length), self.options.tolerance).tokens
        layers = self.first_layer
        first = layers.first.input_space(update)
        if first is None:
            raise ValueError(f"the update holds no gradient of the first attention layer ({layers.first.names()[0]}), "
                             "which the bag of a model with a position table is read from")
        return span_bag(first.to(layers.inputs.embedding.device), layers.inputs, length - 1,
                        limit=self.options.pick_budget(batch_size, length)).tokens

    def _screen(self, batch_size: int) -> dict:
        """The screen of searches in an update of `batch_size` sequences."""
        return {"screen_sites": self.options.screen_sites, "shortlist": self.options.shortlist,
                "screen_precision": self.options.screen_precision, "screen_model": self._screen_model,
                "first_site_shortlist": self.options.first_site_cut(self.options.shortlist, batch_size)}

    def _refinement(self, batch_size: int) -> dict:
        """The beam and screen of refinement passes in an update of `batch_size` sequences."""
        o = self.options
        shortlist = o.shortlist if o.refine_shortlist is None else o.refine_shortlist
        return {"beam": o.beam if o.refine_beam is None else o.refine_beam,
                "screen_sites": o.screen_sites if o.refine_screen_sites is None else o.refine_screen_sites,
                "shortlist": shortlist, "screen_precision": o.screen_precision, "screen_model": self._screen_model,
                "first_site_shortlist": o.first_site_cut(shortlist, batch_size)}

    @torch.no_grad()
    def attack(self, update: dict[str, Tensor], batch_size: int, length: int,
               simulate: Callable[[list[list[int]]], Tensor] | None = None, flat: Tensor | None = None,
               on_step: OnStep | None = None) -> BatchedResult:
        """`update`: {name: gradient} of one client (B sequences of `length` tokens averaged). `on_step(step, seconds,
        sequences)` is called at each point of the trace as it is reached, the second search's steps named
        "second_search", "second_refine"... (a long attack's curve, written as it comes)."""
        with model_mode(self.target, "eval"):  # the span tests read the inputs an eval-mode forward computes
            return self._attack(update, batch_size, length, simulate, flat, on_step)

    def _attack(self, update: dict[str, Tensor], batch_size: int, length: int,
                simulate: Callable[[list[list[int]]], Tensor] | None, flat: Tensor | None,
                on_step: OnStep | None) -> BatchedResult:
        clock = _Clock()  # one clock for both searches: the trace's times count from the attack's start
        self._budget = _Budget(clock.began, self.options.time_budget)
        gib = self.options.extension_cache_gib
        cache = ExtensionCache(max(1, int(gib * 2**30))) if gib > 0 else None  # both searches: one model
        # A bfloat16 screen's model, made once for every search of this update (the weights of this round)
        self._screen_model = bfloat16_twin(self.target) if self.options.screen_precision == "bfloat16" else None
        try:
            result = self._both_searches(update, batch_size, length, simulate, flat, on_step, clock, cache)
            result.budget_reached = self._budget.reached
            return result
        finally:
            self._screen_model = None

    def _both_searches(self, update: dict[str, Tensor], batch_size: int, length: int,
                       simulate: Callable[[list[list[int]]], Tensor] | None, flat: Tensor | None,
                       on_step: OnStep | None, clock: _Clock, cache: ExtensionCache | None) -> BatchedResult:
        result = self._search(update, batch_size, length, simulate, flat, self.scorer, _Trace(clock.began, on_step),
                              cache)
        doubtful = result.residual is not None and result.residual > self.options.second_opinion_above
        if self.second_opinion is None or not doubtful or self._budget.spent():
            return _counted(result, cache)
        second = self._search(update, batch_size, length, simulate, flat, self.second_opinion,
                              _Trace(clock.began, on_step, "second_"), cache)
        kept = second if second.residual < result.residual else result
        kept.second_opinion = kept is second
        kept.other = result if kept is second else second
        kept.seconds = {**{k: v for k, v in result.seconds.items()},
                        **{f"second_{k}": v for k, v in second.seconds.items()}}
        return _counted(kept, cache)

    def _search(self, update: dict[str, Tensor], batch_size: int, length: int,
                simulate: Callable[[list[list[int]]], Tensor] | None, flat: Tensor | None,
                weights: tuple[Tensor, float] | None, trace: _Trace, cache: ExtensionCache | None = None) -> BatchedResult:
        """One search under one scorer (`weights`: (site weights, prior weight); None: hand-set), its refinement
        under `options.refine_scorer`'s; `trace` receives its steps; `cache`: the attack's extension cache, if any."""
        clock = _Clock(trace.began)
        rows = [site.rows(update).double() for site in self.sites]
        bag = self.bag(update, rows, batch_size, length)
        clock.lap("bag")
        if not bag:
            return BatchedResult([[0] * length for _ in range(batch_size)], [[0.0] * length] * batch_size, [],
                                 seconds=clock.seconds)
        scorer = SpanScorer(rows, self.whitening.sites, None if weights is None else weights[0])
        lm_weight = self.options.lm_weight if weights is None else weights[1]
        if weights is None or self.options.refine_scorer == "search":
            refining, refine_lm = scorer, lm_weight
        else:  # the same rows and whitening, the hand-set weights
            refining, refine_lm = scorer.reweighed(None), self.options.lm_weight
        labels: list[list[int]] = []
        sequences, margins = grow_sequences(self.target, self.sites, scorer, bag, batch_size, length,
                                            lm_weight, beam=self.options.beam,
                                            label_candidates=self.options.label_candidates, labels=labels,
                                            cache=cache, **self._screen(batch_size))
        clock.lap("search")
        trace.add("search", clock.elapsed, sequences)
        # With the server's simulation at hand, each sequence's refined version is kept only if it lowers the
        # refit residual (last tokens the LM's guesses), one sequence at a time; passes stop at the first that
        # keeps none. Without it, every pass is kept.
        checked = simulate is not None and flat is not None
        passes = self.options.refine_passes(batch_size, checked=checked)
        attempts = self.options.regrow_attempts(batch_size) if checked else 0
        state = _Refit(sequences, labels, simulate(sequences) if checked and (passes or attempts) else None, flat)
        kept_per_pass: list[int] = []
        regrown: list[tuple[list[int], bool]] = []
        restarted: list[tuple[list[int], list[int]]] = []
        for attempt in range(attempts + 1):
            kept_per_pass += self._refine(state, refining, bag, refine_lm, passes, simulate, clock, trace, cache)
            clock.lap("refine")
            if attempt == attempts or state.certified or self._budget.spent():
                break
            doubtful, kept = self._regrow(state, scorer, bag, length, lm_weight, simulate, cache)
            regrown.append((doubtful, kept))
            clock.lap("regrow")
            trace.add("regrow", clock.elapsed, state.sequences)
            if not kept and self.options.restarts(batch_size) and not self._budget.spent():
                tried, taken = self._restart(state, refining, bag, length, refine_lm, simulate, cache)
                restarted.append((tried, taken))
                kept = bool(taken)
                clock.lap("restart")
                trace.add("restart", clock.elapsed, state.sequences)
            if not kept:
                break
        sequences, labels, current = state.sequences, state.labels, state.current
        result = BatchedResult(sequences, margins, bag, seconds=clock.seconds, kept_per_pass=kept_per_pass,
                               regrown=regrown, restarted=restarted, trace=trace.points)
        if checked:
            # `current` (when refinement ran) already holds the simulated updates of `sequences`.
            current = simulate(sequences) if current is None else current
            if self.options.label_candidates > 1 and labels:
                sequences, current = refit_labels(flat, simulate, sequences, labels, current)
                result.sequences = sequences
            result.residual, result.coefficients = least_squares_check(flat, current)
            clock.lap("check")
        return result

    def _refine(self, state: _Refit, scorer: SpanScorer, bag: list[int], lm_weight: float, passes: int,
                simulate: Callable[[list[list[int]]], Tensor] | None, clock: _Clock, trace: _Trace,
                cache: ExtensionCache | None = None) -> list[int]:
        """Refinement passes on `state` (changed in place, each pass's sequences added to `trace`); returns the
        sequences each pass kept. With `options.refine_resume`, passes resume after the confirmed prefixes until one
        keeps none, then one from the start decides whether they go on."""
        kept_per_pass: list[int] = []
        resume = self.options.refine_resume
        for _ in range(passes):
            if state.certified:  # every input and label right: a regrown sequence could only raise the residual
                break
            if self._budget.spent():
                break
            if self.options.refine_in_turn:
                kept = self._refine_in_turn(state, scorer, bag, lm_weight, simulate, cache)
                trace.add("refine", clock.elapsed, state.sequences)
                if state.current is not None:
                    kept_per_pass.append(kept)
                    if not kept:
                        break
                continue
            refined = refine_sequences(self.target, self.sites, scorer, bag, state.sequences, lm_weight,
                                       cache=cache, resume=resume, **self._refinement(len(state.sequences)))
            refined_labels = likeliest_labels(self.target, refined, self.options.label_candidates)
            for sequence, label in zip(refined, refined_labels):
                sequence[-1] = label[0]
            if state.current is None:
                state.sequences, state.labels = refined, refined_labels
                trace.add("refine", clock.elapsed, state.sequences)
                resume = self.options.refine_resume and not resume  # without the refit: alternate
                continue
            trials = simulate(refined)
            kept = 0
            for i in range(len(refined)):
                if refined[i] == state.sequences[i]:
                    continue
                if state.replace({i: refined[i]}, trials[i : i + 1], {i: refined_labels[i]}):
                    kept += 1
            kept_per_pass.append(kept)
            trace.add("refine", clock.elapsed, state.sequences)
            if not kept:
                if not resume:
                    break
                resume = False  # a resumed pass found nothing: one from the start decides
            else:
                resume = self.options.refine_resume
        return kept_per_pass

    def _refine_in_turn(self, state: _Refit, scorer: SpanScorer, bag: list[int], lm_weight: float,
                        simulate: Callable[[list[list[int]]], Tensor] | None,
                        cache: ExtensionCache | None = None) -> int:
        """One refinement pass regrowing the sequences one at a time, each against the others as they stand (`state`,
        changed in place); returns how many it kept (without the simulation: all it changed)."""
        kept = 0
        for i in range(len(state.sequences)):
            if state.certified:
                break
            grown = refine_sequences(self.target, self.sites, scorer, bag, state.sequences, lm_weight, cache=cache,
                                     only=[i], **self._refinement(len(state.sequences)))[i]
            label = likeliest_labels(self.target, [grown], self.options.label_candidates)[0]
            grown[-1] = label[0]
            if grown == state.sequences[i]:
                continue
            if state.current is None:
                state.sequences[i] = grown
                if state.labels:
                    state.labels[i] = label
                kept += 1
            elif state.replace({i: grown}, simulate([grown]), {i: label}):
                kept += 1
        return kept

    def _regrow(self, state: _Refit, scorer: SpanScorer, bag: list[int], length: int, lm_weight: float,
                simulate: Callable[[list[list[int]]], Tensor],
                cache: ExtensionCache | None = None) -> tuple[list[int], bool]:
        """The sequences the refit explains least grown again jointly, the others' inputs known; kept (in `state`)
        if the refit residual falls. Returns (their indices, whether kept)."""
        batch_size = len(state.sequences)
        doubtful = state.least_explained(max(2, batch_size // 2))
        trusted = [state.sequences[i] for i in range(batch_size) if i not in doubtful]
        fixed = [h.reshape(-1, h.shape[-1]) for h in sequence_inputs(self.target, self.sites, trusted)]
        labels: list[list[int]] = []
        grown, _ = grow_sequences(self.target, self.sites, scorer, bag, len(doubtful), length, lm_weight,
                                  beam=self.options.beam, label_candidates=self.options.label_candidates,
                                  labels=labels, fixed=fixed, cache=cache, **self._screen(batch_size))
        kept = state.replace(dict(zip(doubtful, grown)), simulate(grown), dict(zip(doubtful, labels)))
        return doubtful, kept

    def _restart(self, state: _Refit, scorer: SpanScorer, bag: list[int], length: int, lm_weight: float,
                 simulate: Callable[[list[list[int]]], Tensor],
                 cache: ExtensionCache | None = None) -> tuple[list[int], list[int]]:
        """The sequences the refit explains least, each grown again on its own from other first tokens
        (`BatchedOptions.restart_first_tokens`), the others' inputs known; each takes its variant of lowest refit
        residual where that lowers the residual (in `state`). Returns (the sequences tried, those taken)."""
        batch_size = len(state.sequences)
        doubtful = state.least_explained(max(2, batch_size // 2))
        if length < 3:  # a restart keeps a first token and grows the inputs after it: there are none
            return doubtful, []
        others = others_inputs(sequence_inputs(self.target, self.sites, state.sequences))
        lm, _, device = decoder(self.target)
        tokens = torch.tensor(bag, dtype=torch.long, device=device)
        first = [h[:, 0] for h in capture_site_inputs(self.target, self.sites, lambda: lm(tokens[:, None]))]
        owners, starts = [], []
        for i in doubtful:
            ranked = scorer.score(first, scorer.deflate(scorer.known(others[i]))).argsort(descending=True).tolist()
            alternatives = [bag[j] for j in ranked if bag[j] != state.sequences[i][0]][: self.options.restarts(batch_size)]
            owners += [i] * len(alternatives)
            starts += [[t] for t in alternatives]
        if not starts:
            return doubtful, []
        labels: list[list[int]] = []
        grown, _ = grow_sequences(self.target, self.sites, scorer, bag, len(starts), length, lm_weight,
                                  others=[others[i] for i in owners], prefixes=starts,
                                  label_candidates=self.options.label_candidates, labels=labels, cache=cache,
                                  **self._refinement(batch_size))
        simulated = simulate(grown)
        taken = []
        for i in doubtful:
            rows = [r for r, owner in enumerate(owners) if owner == i]
            if not rows:  # the bag held no other first token
                continue
            best = min(rows, key=lambda r: state.trial({i: simulated[r]})[1])
            if state.replace({i: grown[best]}, simulated[best : best + 1], {i: labels[best]}):
                taken.append(i)
        return doubtful, taken


class _Refit:
    """The sequences found so far, their label candidates, their simulated updates (B, D; None without the
    server's simulation) and the refit residual of the update `flat` by them."""

    def __init__(self, sequences: list[list[int]], labels: list[list[int]], current: Tensor | None,
                 flat: Tensor | None) -> None:
        self.sequences, self.labels, self.current, self.flat = sequences, labels, current, flat
        self.residual = least_squares_check(flat, current)[0] if current is not None else None

    @property
    def certified(self) -> bool:
        """Whether the refit certifies the batch as it stands, its last tokens the LM's guesses until the final refit
        picks them (then nothing is searched further: every input and label is right)."""
        return certifies(self.residual)

    def replace(self, sequences: dict[int, list[int]], simulated: Tensor, labels: dict[int, list[int]]) -> bool:
        """Sequences `sequences` {index: tokens} (their simulated updates the rows of `simulated`, in order) put in
        together if that lowers the residual; returns whether they were."""
        trial, after = self.trial({i: simulated[row] for row, i in enumerate(sequences)})
        if not after < self.residual:
            return False
        for i, tokens in sequences.items():
            self.sequences[i] = tokens
            if self.labels and i in labels:
                self.labels[i] = labels[i]
        self.current, self.residual = trial, after
        return True

    def trial(self, rows: dict[int, Tensor]) -> tuple[Tensor, float]:
        """The simulated updates with rows {index: simulated update} put in, and the refit residual by them."""
        trial = self.current.clone()
        for i, row in rows.items():
            trial[i] = row
        return trial, least_squares_check(self.flat, trial)[0]

    def least_explained(self, count: int) -> list[int]:
        """The `count` sequences whose removal from the refit raises the residual least (sorted indices)."""
        rises = []
        for i in range(self.current.shape[0]):
            others = torch.cat([self.current[:i], self.current[i + 1 :]])
            rises.append(least_squares_check(self.flat, others)[0] - self.residual)
        return sorted(sorted(range(len(rises)), key=lambda i: rises[i])[:count])


def _counted(result: BatchedResult, cache: ExtensionCache | None) -> BatchedResult:
    """`result` with the attack's extension counts, when it had a cache."""
    if cache is not None:
        result.extensions = {"computed": cache.computed, "reused": cache.reused}
    return result


#: A callback at each point of an attack's trace: (step, seconds since the attack began, the sequences then).
OnStep = Callable[[str, float, list[list[int]]], None]


class _Trace:
    """One search's trace: its `points` (as `BatchedResult.trace` holds them), each also given to `on_step` as it is
    reached, its step named with `prefix`. `began`: the attack's start (perf_counter)."""

    def __init__(self, began: float, on_step: OnStep | None = None, prefix: str = "") -> None:
        self.began, self.on_step, self.prefix = began, on_step, prefix
        self.points: list[tuple[str, float, list[list[int]]]] = []

    def add(self, step: str, seconds: float, sequences: list[list[int]]) -> None:
        self.points.append((step, seconds, [list(s) for s in sequences]))
        if self.on_step is not None:
            self.on_step(self.prefix + step, seconds, [list(s) for s in sequences])


class _Budget:
    """An attack's time budget (`BatchedOptions.time_budget`; None: none) from `began` (perf_counter): `spent()` says
    whether it is, and `reached` whether a step was left out for it (set by the `spent()` that said so)."""

    def __init__(self, began: float, seconds: float | None) -> None:
        self.began, self.seconds, self.reached = began, seconds, False

    def spent(self) -> bool:
        if self.seconds is None or time.perf_counter() - self.began < self.seconds:
            return False
        self.reached = True
        return True


class _Clock:
    """Each phase's wall time, and the time since `began` (default: now)."""

    def __init__(self, began: float | None = None) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()
        self.began = self._last if began is None else began

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.began

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now


def least_squares_check(update: Tensor, per_sequence: Tensor) -> tuple[float, list[float]]:
    """Fit the flat update (D,) by the sequences' own updates (B, D): (relative residual, coefficients).

    Solved by the normal equations (`_normal_equations`), on every device and size: a QR over D x B is not
    rank-revealing where a result holds two equal sequences (LAPACK's default gelsy on two MKL threads returned a
    wrong fit, relative residual 0.67 for 3e-4, in 2 of 40 tries of the same problem; cuSOLVER's QR assumes full
    rank), and cuSOLVER's refused a GPT-2 12 x 768 update of B = 64 (1.9e9 entries: CUSOLVER_STATUS_INVALID_VALUE
    from ormqr's buffer size)."""
    a = per_sequence.double().T  # (D, B)
    b = update.double().reshape(-1, 1)
    coefficients = _normal_equations(a, b)
    residual = float((a @ coefficients - b).norm() / b.norm().clamp_min(1e-300))
    return residual, coefficients.flatten().tolist()


def _normal_equations(a: Tensor, b: Tensor) -> Tensor:
    """The least-squares solution (B, 1) of a (D, B) x = b (D, 1) from the (B, B) normal equations, solved
    rank-revealing (two equal sequences make them singular), with one step of iterative refinement (the residual's
    correlations solved again), which recovers what squaring the condition number loses. gelsd's default cut merges
    sequences whose updates differ by less than about 1e-7 relative, where a QR would not."""
    gram = (a.T @ a).cpu()

    def solve(right: Tensor) -> Tensor:
        return torch.linalg.lstsq(gram, (a.T @ right).cpu(), driver="gelsd").solution.to(a.device)

    coefficients = solve(b)
    return coefficients + solve(b - a @ coefficients)


def merge_searches(update: Tensor, simulate: Callable[[list[list[int]]], Tensor], kept: list[list[int]],
                   other: list[list[int]]) -> tuple[list[list[int]], float, int]:
    """Two searches' results for one update merged by the refit: the kept search's sequences, with the other's swapped
    in one at a time, each time the (other sequence, slot) pair that lowers the refit residual most, until none does
    or the batch is certified. The two scorers go wrong on different sequences, so each result may hold sequences the
    other lacks. A swapped-in sequence keeps the last token (label) the refit chose in its own search. Returns (the
    sequences, their refit residual, the swaps made).

    Trials are ranked by residuals from the Gram matrix of the 2B simulated updates (a (2B, 2B) solve per trial, not
    one over D); the chosen trial's residual is then confirmed by `least_squares_check`, which decides."""
    count = len(kept)
    chosen = [list(s) for s in kept]
    pool = torch.cat([simulate(kept).double(), simulate(other).double()]).cpu()  # (2B, D)
    target = update.double().reshape(-1).cpu()
    gram, correlation, energy = pool @ pool.T, pool @ target, float(target @ target)
    slots = list(range(count))  # each slot's row in `pool`

    def estimate(rows: list[int]) -> float:
        index = torch.tensor(rows)
        # gelsd: a rank-revealing solve, as two equal sequences make the Gram singular
        fit = torch.linalg.lstsq(gram[index][:, index], correlation[index, None], driver="gelsd").solution[:, 0]
        value = math.sqrt(max(energy - float(correlation[index] @ fit), 0.0) / max(energy, 1e-300))
        return value if math.isfinite(value) else math.inf

    current, swaps = least_squares_check(target, pool[slots])[0], 0
    while current >= CERTIFY_RESIDUAL:
        waiting = [count + j for j, s in enumerate(other) if s not in chosen]
        trials = [(estimate(slots[:i] + [row] + slots[i + 1 :]), row, i) for row in waiting for i in range(count)]
        if not trials:
            break
        _, row, i = min(trials)
        trial = slots[:i] + [row] + slots[i + 1 :]
        after = least_squares_check(target, pool[trial])[0]
        if not after < current:
            break
        slots, current, swaps = trial, after, swaps + 1
        chosen[i] = list(other[row - count])
    return chosen, current, swaps


def refit_labels(update: Tensor, simulate: Callable[[list[list[int]]], Tensor], sequences: list[list[int]],
                 labels: list[list[int]], current: Tensor | None = None) -> tuple[list[list[int]], Tensor]:
    """Each sequence's last token chosen among its candidates `labels[i]` by the least-squares refit: one pass
    over the sequences, each taking the label whose own update leaves the least residual with the others'.
    The label enters the update only through the last position's loss, which no span test sees.
    `current`: the simulated updates of `sequences` (B, D), if the caller has them. Returns the sequences with
    their chosen labels and their simulated updates."""
    chosen = [list(s) for s in sequences]
    trials = [s[:-1] + [c] for s, cands in zip(chosen, labels) for c in cands]
    simulated = simulate(trials).double()  # (sum of candidates, D)
    current = (simulate(chosen) if current is None else current).double().clone()
    offsets = [0]
    for cands in labels:
        offsets.append(offsets[-1] + len(cands))
    for i, cands in enumerate(labels):
        best, best_residual = None, float("inf")
        for j, label in enumerate(cands):
            rows = current.clone()
            rows[i] = simulated[offsets[i] + j]
            residual, _ = least_squares_check(update, rows)
            if residual < best_residual:
                best, best_residual = j, residual
        if best is not None:
            chosen[i][-1] = cands[best]
            current[i] = simulated[offsets[i] + best]
    return chosen, current
