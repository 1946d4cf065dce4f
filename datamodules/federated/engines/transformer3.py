"""Per-sequence gradients for `Transformer3` from ONE batched forward and ONE batched backward.

Why a specialised engine: the generic fast path (`client.per_example_gradients_vmap`) gives every
sequence its own copy of the body's parameters and lets `torch.func.vmap` differentiate them. That
turns every Linear into many tiny batched matmuls and ends with a large `cat`. But every parameter of
this model enters through an operation whose per-sequence weight gradient is a cheap function of
quantities the ordinary batched backward already has at hand:

* Linear  y = x W^T + b           dW_n = sum_l dy[n, l]^T x[n, l]   (one bmm over the L axis)
                                  db_n = sum_l dy[n, l]
* LayerNorm affine  y = x̂ w + b   dw_n = sum_l dy[n, l] * x̂[n, l],  db_n = sum_l dy[n, l]
* positional rows  h = tok + P[:L]  dP_n[:L] = dh[n]               (rows >= L stay zero)
* tied token embedding / decoder: the head part sum_l dlogits[n, l]^T hidden[n, l] (bmm) plus the
  input part, dh[n, l] * sqrt(d) accumulated into row input_ids[n, l].

So we run the model once on all N·L tokens with the *shared* (detached) weights, so autograd does
the big matmuls for the activation gradients only, and small custom `autograd.Function`s wrap the
Linears and LayerNorm affines: their backward returns the usual input gradient and, as a side
effect, writes the per-sequence weight gradients straight into their slice of one preallocated
(N, D) output. Sequence n's tokens only interact with each other (attention mixes positions within
a sequence, never across), so the summed loss's activation gradients at sequence n's tokens are
exactly sequence n's own, and per-sequence sums of outer products give per-sequence gradients.

The layer code below re-implements `nn.TransformerEncoderLayer` (post-LN, ReLU, batch_first) and the
`nn.MultiheadAttention` math with the same functional ops (packed in-projection, scaled dot-product
attention with attention-probability dropout and the optional causal mask, out-projection), and
`Transformer3.body` (token embedding * sqrt(d) + positions, embedding dropout). In train mode every
dropout draws one mask per element of the batched tensors, so each sequence gets its own masks, as a
client that trains on it alone would. For a single sequence the random draws even happen in the same
order and shapes as in the module, so under the same seed the masks are identical (tests use this).

The head (vocabulary projection, the dominant cost) is differentiated by hand: we only need
dlogits = w_nl (softmax(logits) - onehot(target)), never the loss value, which saves the log-softmax
forward/backward passes autograd would make over the (N·(L-1), V) logits.

Plain PyTorch; no Lightning.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from datamodules.targets.transformer3 import Transformer3

#: Logit elements per chunk of the head (fp32: 16 MiB, cache-sized): bounds the head's memory for large
#: batches while keeping every matmul large.
HEAD_CHUNK_ELEMENTS = 1 << 22


# --------------------------------------------------------------------------------------------------
# Where per-sequence gradients go
# --------------------------------------------------------------------------------------------------


@dataclass
class _Sink:
    """Views (N, *param.shape) into the output for one weight and its bias; None = not observed.

    `weight_value` / `bias_value` (G, *param.shape), if given, are per-group values of the
    parameters (FedAvg: every client at its own local weights; the N sequences are G consecutive
    groups); None = the shared global value.
    """

    weight: Tensor | None = None
    bias: Tensor | None = None
    weight_value: Tensor | None = None
    bias_value: Tensor | None = None

    @property
    def active(self) -> bool:
        return self.weight is not None or self.bias is not None


def _output_views(target: nn.Module, names: Sequence[str], out: Tensor) -> dict[str, Tensor]:
    """{name: out[:, slice].view(N, *shape)}: the observed parameters laid out in the order of `names`."""
    params = dict(target.named_parameters())
    views, start = {}, 0
    for name in names:
        shape = params[name].shape
        size = math.prod(shape)
        views[name] = out[:, start : start + size].view(out.shape[0], *shape)
        start += size
    if start != out.shape[1]:
        raise ValueError(f"output has {out.shape[1]} columns, the observed parameters need {start}")
    return views


# --------------------------------------------------------------------------------------------------
# Per-group parameter values: sequences [i*g, (i+1)*g) use group i's values
# --------------------------------------------------------------------------------------------------


def _grouped(y: Tensor, groups: int) -> Tensor:
    """(N, L, k) -> (G, g*L, k): the rows of each group contiguous (a view)."""
    return y.reshape(groups, -1, y.shape[-1])


def _add(y: Tensor, b: Tensor) -> Tensor:
    """y + b for a shared (k,) or per-group (G, k) b."""
    return y + b if b.dim() == 1 else (_grouped(y, b.shape[0]) + b.unsqueeze(1)).view(y.shape)


def _mul(y: Tensor, w: Tensor) -> Tensor:
    """y * w for a shared (k,) or per-group (G, k) w."""
    return y * w if w.dim() == 1 else (_grouped(y, w.shape[0]) * w.unsqueeze(1)).view(y.shape)


def _matmul_t(x: Tensor, w: Tensor) -> Tensor:
    """x W^T for a shared (out, in) or per-group (G, out, in) W."""
    if w.dim() == 2:
        return F.linear(x, w)
    return torch.bmm(_grouped(x, w.shape[0]), w.transpose(1, 2)).view(*x.shape[:-1], w.shape[1])


def _matmul(g: Tensor, w: Tensor) -> Tensor:
    """g W for a shared (out, in) or per-group (G, out, in) W (the input gradient of a Linear)."""
    if w.dim() == 2:
        return g.matmul(w)
    return torch.bmm(_grouped(g, w.shape[0]), w).view(*g.shape[:-1], w.shape[2])


# --------------------------------------------------------------------------------------------------
# Autograd functions that write per-sequence weight gradients as a side effect of the backward
# --------------------------------------------------------------------------------------------------


class _PerSequenceLinear(torch.autograd.Function):
    """y = x W^T + b on (N, L, in). Backward: dx as usual; dW_n, db_n written into the sink."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, sink: _Sink) -> Tensor:
        ctx.sink = sink
        # x is only needed for dW; don't keep it alive otherwise.
        ctx.save_for_backward(x if sink.weight is not None else None, weight)
        if weight.dim() == 2 and (bias is None or bias.dim() == 1):
            return F.linear(x, weight, bias)  # shared weights (FedSGD): the plain op
        y = _matmul_t(x, weight)
        return y if bias is None else _add(y, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        sink: _Sink = ctx.sink
        if sink.weight is not None:
            # (N, out, L) @ (N, L, in): every sequence's sum over its positions of dy x^T. bmm writes
            # straight into the strided slice of the (N, D) output (no temporary, no final cat).
            torch.bmm(grad.transpose(1, 2), x, out=sink.weight)
        if sink.bias is not None:
            torch.sum(grad, dim=1, out=sink.bias)
        grad_x = _matmul(grad, weight) if ctx.needs_input_grad[0] else None
        return grad_x, None, None, None


class _PerSequenceAffine(torch.autograd.Function):
    """The LayerNorm affine y = x̂ * w + b on normalised x̂ (N, L, d). Backward writes dw_n and db_n."""

    @staticmethod
    def forward(ctx, normed: Tensor, weight: Tensor, bias: Tensor, sink: _Sink) -> Tensor:
        ctx.sink = sink
        ctx.save_for_backward(normed if sink.weight is not None else None, weight)
        if weight.dim() == 1 and bias.dim() == 1:
            return torch.addcmul(bias, normed, weight)
        return _add(_mul(normed, weight), bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        normed, weight = ctx.saved_tensors
        sink: _Sink = ctx.sink
        if sink.weight is not None:
            torch.sum(grad * normed, dim=1, out=sink.weight)
        if sink.bias is not None:
            torch.sum(grad, dim=1, out=sink.bias)
        return (_mul(grad, weight) if ctx.needs_input_grad[0] else None), None, None, None


def _linear(x: Tensor, module_weight: Tensor, module_bias: Tensor | None, sink: _Sink) -> Tensor:
    # Per-group values only exist for observed parameters, whose sink is active.
    weight = module_weight.detach() if sink.weight_value is None else sink.weight_value
    bias = None if module_bias is None else (module_bias.detach() if sink.bias_value is None else sink.bias_value)
    if not sink.active:
        return F.linear(x, weight, bias)  # nothing observed here: plain op, autograd gives dx
    return _PerSequenceLinear.apply(x, weight, bias, sink)


def _layer_norm(x: Tensor, norm: nn.LayerNorm, sink: _Sink) -> Tensor:
    weight = norm.weight.detach() if sink.weight_value is None else sink.weight_value
    bias = norm.bias.detach() if sink.bias_value is None else sink.bias_value
    if not sink.active:
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
    # Normalise without the affine (autograd differentiates it), then the affine that records dw, db.
    normed = F.layer_norm(x, norm.normalized_shape, None, None, norm.eps)
    return _PerSequenceAffine.apply(normed, weight, bias, sink)


# --------------------------------------------------------------------------------------------------
# The model, re-implemented with those functions
# --------------------------------------------------------------------------------------------------


def _check_layer(layer: nn.Module) -> None:
    """The engine reproduces one specific configuration of nn.TransformerEncoderLayer: refuse others."""
    attn = layer.self_attn
    problems = []
    if not isinstance(layer, nn.TransformerEncoderLayer):
        problems.append(f"layer type {type(layer).__name__}")
    else:
        if layer.norm_first:
            problems.append("norm_first=True")
        if layer.activation is not F.relu:
            problems.append(f"activation {layer.activation!r}")
        if not attn.batch_first or not attn._qkv_same_embed_dim or attn.in_proj_bias is None:
            problems.append("attention without batch_first / packed in-projection with bias")
        if attn.bias_k is not None or attn.add_zero_attn:
            problems.append("attention with bias_k/bias_v or add_zero_attn")
    if problems:
        raise ValueError(f"transformer3 gradient engine does not support: {', '.join(problems)}")


def engine_supports(target: Transformer3) -> bool:
    """Whether the engine reproduces `target` exactly: stock torch.nn modules only, in the checked layout.

    Anything else inside (e.g. peft's LoRA layers wrapping `linear1`) would be silently skipped by
    the re-implementation below, so callers fall back to the generic path for it.
    """
    if any(not type(m).__module__.startswith("torch.nn") for name, m in target.named_modules() if name):
        return False
    try:
        for layer in target.encoder.layers:
            _check_layer(layer)
    except ValueError:
        return False
    return target.encoder.norm is None


def _encoder_layer(layer: nn.TransformerEncoderLayer, x: Tensor, causal: bool, training: bool, sinks) -> Tensor:
    """nn.TransformerEncoderLayer.forward (post-LN), with per-sequence gradient capture.

    x = norm1(x + dropout1(self_attn(x)));  x = norm2(x + dropout2(linear2(dropout(relu(linear1(x))))))
    """
    attn = layer.self_attn
    num, length, width = x.shape
    heads = attn.num_heads
    # Attention: packed q/k/v projection, heads split as in F.multi_head_attention_forward.
    qkv = _linear(x, attn.in_proj_weight, attn.in_proj_bias, sinks("self_attn.in_proj_weight", "self_attn.in_proj_bias"))
    q, k, v = qkv.view(num, length, 3, heads, width // heads).permute(2, 0, 3, 1, 4).unbind(0)
    # With need_weights=False and a causal hint, MultiheadAttention drops the explicit mask and calls
    # SDPA with is_causal=True; attention-probability dropout happens inside SDPA.
    mixed = F.scaled_dot_product_attention(q, k, v, dropout_p=attn.dropout if training else 0.0, is_causal=causal)
    mixed = mixed.transpose(1, 2).reshape(num, length, width)
    out_proj = attn.out_proj
    mixed = _linear(mixed, out_proj.weight, out_proj.bias, sinks("self_attn.out_proj.weight", "self_attn.out_proj.bias"))
    x = x + F.dropout(mixed, layer.dropout1.p, training)
    x = _layer_norm(x, layer.norm1, sinks("norm1.weight", "norm1.bias"))
    # Feed-forward.
    inner = _linear(x, layer.linear1.weight, layer.linear1.bias, sinks("linear1.weight", "linear1.bias"))
    inner = F.dropout(F.relu(inner), layer.dropout.p, training)
    ff = _linear(inner, layer.linear2.weight, layer.linear2.bias, sinks("linear2.weight", "linear2.bias"))
    x = x + F.dropout(ff, layer.dropout2.p, training)
    return _layer_norm(x, layer.norm2, sinks("norm2.weight", "norm2.bias"))


def _softmax_(logits: Tensor) -> Tensor:
    """Row softmax over the last dim, in place where that is safe.

    The (rows, V) logits are the biggest tensor of the whole computation; a fresh output doubles the
    memory and, on CPU, costs page faults. The CPU last-dim kernel reads each element before writing
    it (max, then exp into out, then scale), so aliasing out with the input is safe there; elsewhere
    use the out-of-place op.
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return torch.ops.aten._softmax.out(logits, -1, False, out=logits)
    return torch.softmax(logits, dim=-1)


def _head_backward(
    target: Transformer3,
    hidden: Tensor,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    need_hidden_grad: bool,
    decoder_weight_out: Tensor | None,
    decoder_bias_out: Tensor | None,
) -> Tensor | None:
    """Gradient of the summed per-sequence mean next-token losses through the head, by hand.

    `next_token_loss` is sum_l w_nl CE(logits[n, l], ids[n, l+1]) with w_nl = mask/count (or
    1/(L-1)). Its logit gradient is w_nl (softmax - onehot). From that: d hidden = dlogits @ E (the
    head's input gradient), the decoder bias' per-sequence sum, and the decoder weight's
    per-sequence sum of outer products. The last position predicts nothing and is skipped. Rows are
    processed in chunks of whole sequences to bound memory.
    """
    num, length, width = hidden.shape
    steps = length - 1
    weight, bias = target.decoder.weight.detach(), target.decoder.bias.detach()
    targets = input_ids[:, 1:]
    if attention_mask is None:
        row_weight = hidden.new_full((num, steps), 1.0 / steps)
    else:
        valid = attention_mask[:, 1:].to(hidden.dtype)
        row_weight = valid / valid.sum(dim=1, keepdim=True).clamp_min(1.0)
    # Half-precision logits are promoted, as `next_token_loss` does; float64 stays float64.
    head_dtype = torch.float32 if hidden.dtype in (torch.float16, torch.bfloat16) else hidden.dtype
    grad_hidden = torch.zeros_like(hidden) if need_hidden_grad else None
    per_chunk = max(1, HEAD_CHUNK_ELEMENTS // max(1, steps * weight.shape[0]))
    # One logits buffer reused by every chunk: fresh memory costs page faults on CPU on every use.
    buffer = hidden.new_empty(min(num, per_chunk) * steps, weight.shape[0])
    for start in range(0, num, per_chunk):
        stop = min(num, start + per_chunk)
        rows = (stop - start) * steps
        h = hidden[start:stop, :-1].detach().reshape(rows, width)
        probs = _softmax_(torch.addmm(bias, h, weight.t(), out=buffer[:rows]).to(head_dtype))
        # softmax - onehot; the row weights are folded into the small operands below instead of
        # scaling the (rows, V) matrix.
        probs[torch.arange(rows, device=probs.device), targets[start:stop].reshape(rows)] -= 1.0
        probs = probs.to(hidden.dtype)
        w = row_weight[start:stop]
        if grad_hidden is not None:
            g = torch.mm(probs, weight).view(stop - start, steps, width)
            grad_hidden[start:stop, :-1] = g * w.unsqueeze(-1)
        per_seq = probs.view(stop - start, steps, -1)
        if decoder_bias_out is not None:  # (n, 1, steps) @ (n, steps, V)
            torch.bmm(w.unsqueeze(1), per_seq, out=decoder_bias_out[start:stop].unsqueeze(1))
        if decoder_weight_out is not None:  # (n, V, steps) @ (n, steps, d)
            scaled = hidden[start:stop, :-1].detach() * w.unsqueeze(-1)
            torch.bmm(per_seq.transpose(1, 2), scaled, out=decoder_weight_out[start:stop])
    return grad_hidden


# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------


def transformer3_per_example_gradients(
    target: Transformer3,
    names: Sequence[str],
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    out: Tensor | None = None,
    weights: Tensor | None = None,
) -> Tensor:
    """Per-sequence gradients (N, D) of each sequence's own mean next-token loss.

    Same contract as `client.per_example_gradients_loop`: `names` (any subset of
    `target.named_parameters()`, head parameters included) are concatenated in the given order.
    Dropout follows `target.training`. `attention_mask` only weights the loss (the model ignores it,
    as `Transformer3.body` does). `out`, if given, is a preallocated (N, D) tensor to fill.

    `weights` (G, D), if given, are per-group values of the observed parameters (flat in the order
    of `names`): the N sequences form G consecutive groups of N / G, and group i runs with
    `weights[i]` instead of the global values (FedAvg clients at their local weights). The token
    embedding and decoder bias (the head) cannot have per-group values.
    """
    if not isinstance(target, Transformer3):
        raise TypeError(f"transformer3 gradient engine needs a Transformer3, got {type(target).__name__}")
    num, length = input_ids.shape
    target.check_sequence_length(length)
    if length < 2:
        raise ValueError("next-token gradients need sequences of at least 2 tokens")
    params = dict(target.named_parameters())
    unknown = [name for name in names if name not in params]
    if unknown:
        raise ValueError(f"unknown parameter names {unknown}")
    if len(set(names)) != len(names):
        raise ValueError("parameter names are repeated")
    layers = target.encoder.layers
    for layer in layers:
        _check_layer(layer)
    if target.encoder.norm is not None:
        raise ValueError("transformer3 gradient engine does not support a final encoder norm")

    reference = params[names[0]] if names else target.position_embedding.weight
    dimension = sum(params[name].numel() for name in names)
    if out is None:
        # Uninitialised on purpose: every observed coordinate is written exactly once below, and
        # first-touch writes are cheaper than zero-filling ~N * 4 MB first.
        out = torch.empty(num, dimension, dtype=reference.dtype, device=reference.device)
    elif out.shape != (num, dimension):
        raise ValueError(f"out has shape {tuple(out.shape)}, expected {(num, dimension)}")
    views = _output_views(target, names, out)
    values: dict[str, Tensor] = {}
    if weights is not None:
        if weights.dim() != 2 or num % weights.shape[0]:
            raise ValueError(f"weights of shape {tuple(weights.shape)} do not split {num} sequences into equal groups")
        values = _output_views(target, names, weights)
    if not names:
        return out

    # Which stages need the backward: the embedding stage (positions / token embedding), layer i,
    # or only the head (decoder bias). Everything before the first such stage runs without a graph.
    name_of = {id(p): name for name, p in target.named_parameters()}
    token_name = name_of[id(target.token_embedding.weight)]
    position_name = name_of[id(target.position_embedding.weight)]
    decoder_weight_name = name_of[id(target.decoder.weight)]  # == token_name: weights are tied
    decoder_bias_name = name_of[id(target.decoder.bias)]
    if token_name in values or decoder_bias_name in values:
        raise ValueError("per-group values of the token embedding / decoder are not supported by the transformer3 engine")
    observed_layers = [i for i in range(len(layers)) if any(n.startswith(f"encoder.layers.{i}.") for n in names)]
    if token_name in views or position_name in views:
        first_stage = 0
    elif observed_layers:
        first_stage = observed_layers[0] + 1
    else:
        first_stage = None  # only head parameters: no backward through the body at all

    training = target.training
    dtype = reference.dtype
    with torch.enable_grad():
        # Embedding: token rows * sqrt(d) + positional rows, then embedding dropout.
        positions = target.position_embedding.weight.detach()[:length]
        if position_name in values:  # (G, P, d) -> each sequence its group's rows
            positions = values[position_name][:, :length].repeat_interleave(num // weights.shape[0], dim=0)
        tokens = F.embedding(input_ids, target.token_embedding.weight.detach()) * math.sqrt(target.hidden_size)
        x = tokens + positions
        start = None
        if first_stage == 0:
            start = x = x.detach().requires_grad_(True)
        x = F.dropout(x, target.embedding_dropout.p, training)
        for i, layer in enumerate(layers):
            if first_stage == i + 1:
                start = x = x.detach().requires_grad_(True)
            prefix = f"encoder.layers.{i}."

            def sinks(weight: str, bias: str, prefix: str = prefix) -> _Sink:
                weight, bias = prefix + weight, prefix + bias
                return _Sink(views.get(weight), views.get(bias), values.get(weight), values.get(bias))

            x = _encoder_layer(layer, x, target.causal, training, sinks)
        hidden = x

        # Head by hand; it writes the decoder-side per-sequence gradients (if observed) first, so
        # that the embedding part of the tied weight can be accumulated on top below.
        decoder_weight_out, decoder_bias_out = views.get(decoder_weight_name), views.get(decoder_bias_name)
        need_body = start is not None
        grad_hidden = _head_backward(
            target, hidden, input_ids, attention_mask, need_body, decoder_weight_out, decoder_bias_out
        )
        if not need_body:
            return out
        # One batched backward through the body: the custom functions fill their slices of `out`.
        (grad_start,) = torch.autograd.grad(hidden, start, grad_hidden)

    if first_stage == 0:
        grad_start = grad_start.to(dtype)
        if position_name in views:
            rows = views[position_name]
            rows[:, :length] = grad_start
            rows[:, length:] = 0  # rows beyond L never receive gradient
        if token_name in views:
            table = views[token_name]
            if decoder_weight_out is None or decoder_weight_name != token_name:
                table.zero_()  # untied model: nothing from the head was written here
            batch_index = torch.arange(num, device=input_ids.device).unsqueeze(1).expand(num, length)
            table.index_put_(
                (batch_index, input_ids), grad_start * math.sqrt(target.hidden_size), accumulate=True
            )
    return out
