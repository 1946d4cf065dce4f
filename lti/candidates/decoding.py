"""Turning the pointer's (U, L, K + 1) logits into sequences. Plain PyTorch.

- `argmax`: each position's best candidate on its own.
- `assign`: every candidate at most once (a Hungarian assignment of positions to candidates): an
  update's tokens rarely repeat, and the span names each once.
- `lm`: a beam search over the candidates that adds `weight` times the global model's own next-token
  log-probability to the pointer's: the server holds the pretrained model, a far stronger prior on word
  order than any it can learn from its auxiliary text.
- `second_layer`: the same beam search, every extension also scored by DAGER's second-layer span test
  (`exact.span_evidence.SecondLayerEvidence`, weighted `second_weight`): the server checks each
  prefix against the update itself, where the pointer and the prior only guess.
"""

from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor, nn

from datamodules.federated.protocols.base import model_mode
from datamodules.targets.hf import cache_keyword
from exact.span_evidence import SecondLayerEvidence
from lti.candidates.pointer import predict_tokens

#: The decoding rules, named once for the option checks of the commands on top.
DECODERS = ("argmax", "assign", "lm", "second_layer")


def assign_positions(ids: Tensor, logits: Tensor) -> Tensor:
    """(U, L) tokens: the assignment of positions to distinct candidates of the largest summed log-probability."""
    if ids.shape[1] < logits.shape[1]:
        raise ValueError(f"decoding rule 'assign' puts each of {logits.shape[1]} positions on its own candidate: "
                         f"{ids.shape[1]} candidates are too few (build with --count >= {logits.shape[1]})")
    logp = torch.log_softmax(logits.float(), -1)[..., :-1].cpu()
    columns = [torch.as_tensor(linear_sum_assignment(-logp[u].numpy())[1]) for u in range(logp.shape[0])]
    return ids.gather(1, torch.stack(columns).to(ids.device))


def _next_token_logp(lm: nn.Module, tokens: Tensor, cache) -> tuple[Tensor, object]:
    out = lm(input_ids=tokens, use_cache=True, **({cache_keyword(lm): cache} if cache is not None else {}))
    return torch.log_softmax(out.logits[:, -1].float(), -1), out["cache" if "cache" in out else "past_key_values"]


@torch.no_grad()
def lm_beam_search(ids: Tensor, logits: Tensor, lm: nn.Module, weight: float, beam: int = 8, chunk: int = 64,
                   second: SecondLayerEvidence | None = None, spaces: Tensor | None = None,
                   second_weight: float = 1.0) -> Tensor:
    """(U, L) tokens maximising sum_p log p_pointer(c_p | p) + weight * log p_lm(c_p | c_<p)
    [+ second_weight * s(c_<=p) for the positions the second-layer test reads] over candidate
    sequences, by a beam search of width `beam` (exact when beam >= K^(L-1)). `lm` is a Hugging Face
    causal LM (called with `input_ids`, `use_cache` and its cache); `second` scores prefixes against
    each update's second-layer span, given as the updates' `spaces` (U, d, width)."""
    check = second is not None and second_weight != 0.0
    if check and (spaces is None or spaces.shape[0] != ids.shape[0]):
        raise ValueError("the second-layer test needs each update's second-layer gradient (spaces)")
    with model_mode(lm, "eval"):  # the prior without dropout, whatever mode the clients' code left it in
        logp = torch.log_softmax(logits.float(), -1)[..., :-1]
        if not check:
            return _beam_search(ids, logp, lm, weight, beam, chunk, None, None, 0.0)
        # each step runs block 0 on beam x K extensions per update: fewer updates at once
        return _beam_search(ids, logp, lm, weight, beam, max(1, chunk // 4), second, spaces, second_weight)


def _beam_search(ids: Tensor, logp: Tensor, lm: nn.Module, weight: float, beam: int, chunk: int,
                 second: SecondLayerEvidence | None, spaces: Tensor | None, second_weight: float) -> Tensor:
    """`lm_beam_search` over the candidates' log-probabilities `logp` (U, L, K) ("none" left out)."""
    out = []
    for start in range(0, ids.shape[0], chunk):
        cand, lp = ids[start : start + chunk], logp[start : start + chunk]
        count, length, k = lp.shape
        width = min(beam, k)
        ranges = None if second is None else second.ranges(spaces[start : start + chunk])  # (n, d, r)
        visible = 0 if ranges is None else second.visible  # positions the second-layer test reads
        first = lp[:, 0]
        if visible > 0:
            span_score, kv = second.extend(cand.flatten(), 0, ranges, None)  # (n, K)
            first = first + second_weight * span_score.to(first.device)
        top = first.topk(width, dim=1)
        scores, seqs = top.values, cand.gather(1, top.indices)[..., None]  # (n, W), (n, W, 1)
        if visible > 0:
            kv = _rows(kv, (torch.arange(count)[:, None] * k + top.indices.cpu()).flatten())
        lm_logp, cache = _next_token_logp(lm, seqs.reshape(-1, 1), None)  # (n W, V)
        for p in range(1, length):
            cand_lm = lm_logp.view(count, width, -1).gather(2, cand[:, None].expand(-1, width, -1))  # (n, W, K)
            total = scores[..., None] + lp[:, p, None] + weight * cand_lm
            if p < visible:
                parents = _rows(kv, torch.arange(count * width).repeat_interleave(k))
                tokens = cand[:, None, :].expand(-1, width, -1).flatten()
                span_score, kv = second.extend(tokens, p, ranges, parents)  # (n, W K)
                total = total + second_weight * span_score.view(count, width, k).to(total.device)
            grown = min(beam, width * k)  # the beam widens until it holds `beam` prefixes
            top = total.view(count, -1).topk(grown, dim=1)
            parent, column = top.indices // k, top.indices % k
            rows = (torch.arange(count, device=ids.device)[:, None] * width + parent).flatten()
            token = cand.gather(1, column)  # (n, W')
            seqs = torch.cat([seqs.view(count * width, -1)[rows].view(count, grown, -1), token[..., None]], dim=2)
            scores = top.values
            if p < visible:
                kv = _rows(kv, (torch.arange(count)[:, None] * width * k + top.indices.cpu()).flatten())
            width = grown
            if p < length - 1:
                cache.reorder_cache(rows)
                lm_logp, cache = _next_token_logp(lm, token.reshape(-1, 1), cache)
        out.append(seqs[torch.arange(count), scores.argmax(1)])
    return torch.cat(out)


def _rows(kv: tuple[Tensor, Tensor], index: Tensor) -> tuple[Tensor, Tensor]:
    """The key/value cache rows `index`."""
    return kv[0][index.to(kv[0].device)], kv[1][index.to(kv[1].device)]


def decode_candidates(ids: Tensor, logits: Tensor, rule: str, lm: nn.Module | None = None, weight: float = 0.0,
                      beam: int = 8, second: SecondLayerEvidence | None = None, spaces: Tensor | None = None,
                      second_weight: float = 1.0) -> Tensor:
    if rule == "argmax":
        return predict_tokens(ids, logits)
    if rule == "assign":
        return assign_positions(ids, logits)
    if rule in ("lm", "second_layer"):
        if lm is None:
            raise ValueError(f"decoding rule {rule!r} needs the global model")
        if rule == "lm":
            return lm_beam_search(ids, logits, lm, weight, beam)
        if second is None:
            raise ValueError("decoding rule 'second_layer' needs the second-layer test of the update")
        return lm_beam_search(ids, logits, lm, weight, beam, second=second, spaces=spaces, second_weight=second_weight)
    raise ValueError(f"decoding rule {rule!r} is not known; choose one of {', '.join(DECODERS)}")
