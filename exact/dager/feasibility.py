"""Before DAGER spends its budget: can this observation be inverted exactly at all? Plain PyTorch.

DAGER reads the span of the first attention layer's weight gradient: a sum of one outer product per
input token, so its rank is at most min(tokens, width). With as many tokens in an update as the
model is wide, the span is the whole space and every token passes the span check: exact recovery
is impossible (DAGER, Petrov et al., §4: B·L < d). The second layer's inputs are the tokens in
context (one per token, duplicates included), so its span fills up first: at GPT-2 width 768 and
B = 64 WikiText sentences, 1,388 inputs make it rank 767 while the first layer stays at 522
(benchmarks/investigations/dager/notes.md, "Large batches"). The notes read the ranks from the update, as the server can. Defenses that act coordinate-wise (sign, pruning,
noise) leave a matrix that is no longer in the span of the inputs, so exactness is not expected
either. The attack still runs (its best effort is a result); these notes say why it may fall short.
"""

from __future__ import annotations

#: A bidirectional search is blind when a typical position has more than this many candidates per sequence.
_BLIND_FACTOR = 4


def _typical(candidates_per_position: list[int] | None) -> int:
    """The candidate count of the median position (0 without positions)."""
    counts = sorted(candidates_per_position or [])
    return counts[len(counts) // 2] if counts else 0


def first_layer_blind(candidates_per_position: list[int] | None, batch_size: int | None) -> bool:
    """True when the first-layer test passes more than `_BLIND_FACTOR` tokens per sequence at a
    typical (the median) position: it does not tell an encoder's positions apart."""
    return bool(batch_size) and _typical(candidates_per_position) > _BLIND_FACTOR * batch_size


#: Defenses (by their `describe()["name"]`) that break the low-rank structure DAGER relies on.
SPAN_BREAKING = {"sign": "signs every coordinate", "prune": "zeroes all but the largest coordinates",
                 "gaussian": "adds noise to every coordinate", "dpsgd": "clips and adds noise to every coordinate"}


def feasibility_notes(width: int, defense: dict | None = None, rank1: int | None = None, rank2: int | None = None,
                      min_codimension: int = 4, candidates_per_position: list[int] | None = None,
                      batch_size: int | None = None, bidirectional: bool = False) -> list[str]:
    """One sentence per reason exact recovery is impossible or unlikely (empty: nothing stands in the way).

    Reads only what the server has: the model's width, the protocol's defense, and the numerical ranks
    of the update's first- and second-layer gradients (`DagerResult.diagnostics` "rank1"/"rank2"), never
    the client's token count. A first-layer span of full rank lets every token pass; a second-layer span
    within `min_codimension` of full (more second-layer inputs, one per token in context, than the
    width) lets any sequence pass, so no sequence can be told apart or certified. For a bidirectional
    model, first-layer candidates far more numerous than the protocol's batch size at a typical
    position (`candidates_per_position`, read from the update) mean that the first layer does not tell
    positions apart (benchmarks/investigations/dager/notes.md, "Encoders at B = 8"), so its search is a bounded
    best effort.
    """
    notes = []
    if rank1 is not None and rank1 >= width:
        notes.append(f"the first layer's gradient has full rank ({rank1} of width {width}, read from the update): "
                     "every token passes the span test, so exact recovery is impossible (needs fewer tokens than the width)")
    elif rank2 is not None and rank2 > width - min_codimension:
        notes.append(f"the second-layer gradient has rank {rank2} of width {width} (read from the update): more "
                     "tokens in context than the width, so the second-layer test cannot tell sequences apart and "
                     "nothing can be certified; the result is a best effort")
    typical = _typical(candidates_per_position)
    if bidirectional and first_layer_blind(candidates_per_position, batch_size):
        notes.append(f"the first-layer test passes {typical} tokens at a typical position for a batch of {batch_size} "
                     "sequences: it cannot tell positions apart (an encoder's LN(word + position) inputs, once the "
                     "batch's token-position pairs outnumber its tokens plus positions), so the bidirectional search "
                     "over their combinations is a bounded best effort")
    parts = (defense or {}).get("defenses", [defense or {}])  # Compose lists its parts
    for part in parts:
        name = part.get("name") if isinstance(part, dict) else None
        if name in SPAN_BREAKING:
            notes.append(f"the defense {name} {SPAN_BREAKING[name]}, which moves the update off the span of the "
                         "inputs: exact recovery is not expected")
    return notes
