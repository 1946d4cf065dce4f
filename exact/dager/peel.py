"""Peeling: attack again what the certified sequences leave of a FedSGD update.

A FedSGD update is the mean of its B sequences' own updates (the protocol), and the server can compute
the update any one sequence would give on its own: it holds the model and knows the client's loss. So
once the strict search certifies k of the B sequences but not all, their own updates / B are subtracted,
and the attack runs again on what remains, for the B - k sequences left. Fewer sequences make an
encoder's first layer less blind (the split pins more tokens) and leave the search fewer lengths to
cover, so a round often certifies sequences the previous one could not. Rounds go on while each
certifies something new.

Each subtraction is also a test of the sequence. A true sequence's second-layer inputs are directions
of the second-layer gradient that no other sequence supplies (while the batch's inputs fit in the
width), so subtracting its own update lowers that gradient's numerical rank, measured against the
whole update's largest singular value. A wrong sequence that passed the span tests (e.g. a permutation
of a true one, on a small model) leaves the rank where it was. Such a sequence is not subtracted and,
once another subtraction has shown that the simulation matches the client, loses its certificate.
When every sequence has been subtracted, the rank left is 0: the sequences explain the whole update.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from exact.dager.result import DagerResult

#: The update one sequence alone would give under the client's protocol (None: cannot be simulated).
SequenceUpdate = Callable[[Sequence[int]], Mapping[str, Tensor] | None]


def peel(
    attack_remainder: Callable[[Mapping[str, Tensor], int], DagerResult],
    update: Mapping[str, Tensor],
    batch_size: int,
    first: DagerResult,
    sequence_update: SequenceUpdate,
    singular_values: Callable[[Mapping[str, Tensor]], Tensor],
    rank_tol: float,
) -> DagerResult:
    """`first` (the attack on the whole update), completed by peeling rounds.

    `attack_remainder(residual, b)` attacks a residual update that holds b sequences;
    `singular_values(update)` are those of an update's second-layer gradient. Ranks count the values above
    `rank_tol` times the whole update's largest one (a fixed scale, so a residual of rounding noise has
    rank 0). Returns `first` itself when it certified nothing or everything, or when no subtraction
    lowered the rank.
    """
    certified = _certified(first)
    if not certified or len(certified) >= batch_size:
        return first
    values = singular_values(update)
    floor = rank_tol * float(values.max())

    def rank(u: Mapping[str, Tensor]) -> int:
        return int((singular_values(u) > floor).sum())

    residual, current = dict(update), int((values > floor).sum())
    found: list[tuple[list[int], float]] = []  # subtracted, with their scores
    rejected: list[list[int]] = []  # certified by a round, but their subtraction left the rank unchanged
    rounds: list[dict] = []
    flags: list[str] = []
    last, pending = first, certified
    while pending:
        added = 0
        for seq, score in pending:
            own = sequence_update(seq)
            if own is None:
                flags.append("peeling stopped: the client's update of a single sequence cannot be simulated")
                added = 0
                break
            trial = without(residual, own, batch_size)
            after = rank(trial)
            if after < current:
                residual, current = trial, after
                found.append((seq, score))
                added += 1
            else:
                rejected.append(seq)
        if added == 0 or len(found) >= batch_size:
            break  # everything is peeled, or this round added nothing
        start = time.perf_counter()
        last = attack_remainder(residual, batch_size - len(found))
        known = [s for s, _ in found] + rejected
        pending = [(s, sc) for s, sc in _certified(last) if s not in known]
        rounds.append({"batch_size": batch_size - len(found), "certified": len(pending), "rank2_before": current,
                       "seconds": round(time.perf_counter() - start, 2)})
    if not found:  # the simulation never matched: the first result stands, with why
        if not flags:
            flags.append("peeling stopped: no certified sequence lowered the second-layer rank when subtracted "
                         "(the update is not the mean of its sequences' own updates, or the certificates are wrong)")
        first.diagnostics.setdefault("flags", []).extend(flags)
        return first
    if rejected:
        flags.append(f"{len(rejected)} certified sequence(s) left the second-layer rank unchanged when subtracted: "
                     f"certificate withdrawn")
    return _merged(first, last, found, rejected, batch_size, current, rounds, flags)


def without(update: Mapping[str, Tensor], own: Mapping[str, Tensor], batch_size: int) -> dict[str, Tensor]:
    """`update` (a mean over `batch_size` sequences) without one sequence's own update `own`."""
    return {name: value - own[name].to(value) / batch_size if name in own else value for name, value in update.items()}


def _certified(result: DagerResult) -> list[tuple[list[int], float]]:
    scores = result.scores or [float("nan")] * len(result.sequences)
    return [(list(s), float(sc)) for s, c, sc in zip(result.sequences, result.sequence_exact, scores) if c]


def _merged(first: DagerResult, last: DagerResult, found, rejected, batch_size: int, left: int,
            rounds: list[dict], flags: list[str]) -> DagerResult:
    """The subtracted sequences (certified), then the last round's other sequences as best effort. The
    batch is certified when all B sequences were subtracted and they leave nothing of the update."""
    seqs = [s for s, _ in found]
    scores = [sc for _, sc in found]
    certs = [True] * len(seqs)
    rest = list(zip(last.sequences, last.scores or [float("nan")] * len(last.sequences)))
    rest += [(s, float("nan")) for s in rejected]  # still plausible guesses (e.g. a true sentence's permutation)
    for seq, score in rest:
        if len(seqs) >= batch_size:
            break
        if list(seq) not in seqs:
            seqs.append(list(seq))
            scores.append(float(score))
            certs.append(False)
    exact = len(found) == batch_size and left == 0
    diag = dict(first.diagnostics)
    diag.update(peel_rounds=rounds, peeled=len(found), rank2_left=left)
    # The first attempt's flags about a short batch no longer describe the result; say it for the whole batch.
    diag["flags"] = [f for f in diag.get("flags", []) if "best effort" not in f and "distinct sequences" not in f]
    diag["flags"] += flags
    if not exact:
        diag["flags"].append(f"{certs.count(False)} of {len(seqs)} sequences are the relaxed best effort")
    diag["mode"] = "strict" if exact else "strict+relaxed"
    if exact:
        diag.pop("reason", None)
    return DagerResult(seqs, exact, certs, scores, diag)
