"""Peeling: attack again what the certified sequences leave of a FedSGD update.

A FedSGD update is the mean of its B sequences' own updates (the protocol), and the server can compute
the update any one sequence would give on its own: it holds the model and knows the client's loss. So
once the strict search certifies k of the B sequences but not all, their own updates / B are subtracted,
and the attack runs again on what remains, for the B - k sequences left. Fewer sequences make an
encoder's first layer less blind (the split pins more tokens) and leave the search fewer lengths to
cover, so a round often certifies sequences the previous one could not. Rounds go on while each
certifies something new.

Self-check: every peel must lower the first layer's numerical rank (the certified sequences' token and
position directions leave it). When it does not, the update is not such a mean (another reduction, a
defense, another loss): peeling stops and the result before that round stands, flagged.
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
) -> DagerResult:
    """`first` (the attack on the whole update), completed by peeling rounds.

    `attack_remainder(residual, b)` attacks a residual update that holds b sequences. Returns `first`
    itself when it certified nothing, or everything, or when the first peel fails its self-check.
    """
    certified = _certified(first)
    if not certified or len(certified) >= batch_size:
        return first
    found: list[tuple[list[int], float]] = []  # the sequences peeled so far, with their scores
    residual = dict(update)
    rank = first.diagnostics.get("rank1")
    last, pending = first, certified
    rounds: list[dict] = []
    flags: list[str] = []
    while pending and len(found) + len(pending) < batch_size:
        start = time.perf_counter()
        candidate = dict(residual)
        for seq, _ in pending:
            own = sequence_update(seq)
            if own is None:
                flags.append("peeling stopped: the client's update of a single sequence cannot be simulated")
                break
            for name in candidate:
                if name in own:
                    candidate[name] = candidate[name] - own[name].to(candidate[name]) / batch_size
        else:
            remaining = batch_size - len(found) - len(pending)
            again = attack_remainder(candidate, remaining)
            new_rank = again.diagnostics.get("rank1")
            rounds.append({"batch_size": remaining, "certified": len(_certified(again)), "rank1": new_rank,
                           "seconds": round(time.perf_counter() - start, 2)})
            if rank is None or new_rank is None or new_rank >= rank:
                flags.append(f"peeling stopped: the first-layer rank did not drop ({rank} -> {new_rank}); "
                             f"the update is not the mean of its sequences' own updates")
                break
            found += pending
            residual, rank, last = candidate, new_rank, again
            pending = [(s, sc) for s, sc in _certified(again) if s not in [f for f, _ in found]]
            continue
        break
    if last is first:  # nothing was peeled: the first result stands, with why
        first.diagnostics.setdefault("flags", []).extend(flags)
        if rounds:
            first.diagnostics["peel_rounds"] = rounds
        return first
    return _merged(first, last, found, batch_size, rounds, flags)


def _certified(result: DagerResult) -> list[tuple[list[int], float]]:
    scores = result.scores or [float("nan")] * len(result.sequences)
    return [(list(s), float(sc)) for s, c, sc in zip(result.sequences, result.sequence_exact, scores) if c]


def _merged(first: DagerResult, last: DagerResult, found, batch_size: int, rounds: list[dict],
            flags: list[str]) -> DagerResult:
    """The peeled sequences (certified), then the last round's own sequences (its certified ones, then
    its best effort for the rest). The batch is certified when the last round certified all it held."""
    seqs = [s for s, _ in found]
    scores = [sc for _, sc in found]
    certs = [True] * len(seqs)
    last_scores = last.scores or [float("nan")] * len(last.sequences)
    for seq, cert, score in zip(last.sequences, last.sequence_exact, last_scores):
        if len(seqs) >= batch_size:
            break
        if seq not in seqs:
            seqs.append(list(seq))
            scores.append(float(score))
            certs.append(bool(cert))
    exact = bool(last.exact) and len(seqs) == batch_size and all(certs)
    diag = dict(first.diagnostics)
    diag["peel_rounds"] = rounds
    diag["peeled"] = len(found)
    # The first attempt's flags about a short batch no longer describe the result; say it for the whole batch.
    diag["flags"] = [f for f in diag.get("flags", []) if "best effort" not in f and "distinct sequences" not in f]
    diag["flags"] += flags
    if not exact:
        diag["flags"].append(f"{certs.count(False)} of {len(seqs)} sequences are the relaxed best effort")
    diag["mode"] = "strict" if exact else "strict+relaxed"
    if exact:
        diag.pop("reason", None)
    return DagerResult(seqs, exact, certs, scores, diag)
