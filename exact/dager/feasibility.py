"""Before DAGER spends its budget: can this observation be inverted exactly at all? Plain PyTorch.

DAGER reads the span of the first attention layer's weight gradient: a sum of one outer product per
input token, so its rank is at most min(tokens, width). With as many tokens in an update as the
model is wide, the span is the whole space and every token passes the span check: exact recovery
is impossible (DAGER, Petrov et al., §4: B·L < d). Defenses that act coordinate-wise (sign, pruning,
noise) leave a matrix that is no longer in the span of the inputs, so exactness is not expected
either. The attack still runs (its best effort is a result); these notes say why it may fall short.
"""

from __future__ import annotations

#: Defenses (by their `describe()["name"]`) that break the low-rank structure DAGER relies on.
SPAN_BREAKING = {"sign": "signs every coordinate", "prune": "zeroes all but the largest coordinates",
                 "gaussian": "adds noise to every coordinate", "dpsgd": "clips and adds noise to every coordinate"}


def feasibility_notes(tokens_per_update: int, width: int, defense: dict | None = None) -> list[str]:
    """One sentence per reason exact recovery is impossible or unlikely (empty: nothing stands in the way)."""
    notes = []
    if tokens_per_update >= width:
        notes.append(f"an update holds {tokens_per_update} tokens but the model is {width} wide: the first layer's "
                     f"gradient has full rank, so exact recovery is impossible (needs fewer tokens than the width)")
    parts = (defense or {}).get("defenses", [defense or {}])  # Compose lists its parts
    for part in parts:
        name = part.get("name") if isinstance(part, dict) else None
        if name in SPAN_BREAKING:
            notes.append(f"the defense {name} {SPAN_BREAKING[name]}, which moves the update off the span of the "
                         "inputs: exact recovery is not expected")
    return notes
