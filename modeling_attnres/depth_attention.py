"""Depth attention: the one implementation of AttnRes mixing, shared by every model in this project.

A *site* (before attention, before the MLP, after the last layer) replaces the residual stream by a
softmax-weighted sum of *sources* (earlier blocks or sublayer outputs) of the same token position:

    mix(sources, w, g) = sum_i softmax_i(w . RMSNorm_g(s_i)) * s_i

Because `w . (g * s / rms(s)) == (w * g) . s / rms(s)`, a site is described by one folded query
`q = w * g` (see `fold_queries`). Scores, softmax and the weighted sum run in float32 (float64
inputs stay float64), over the raw sources, and the result is cast back.

Sources are split into the *stored* ones (completed blocks, `[*tokens, n, d]`) and the running
*partial* (the block being accumulated, `[*tokens, d]`). Callers keep both as locals of `forward`,
never on a module or in the KV cache: depth attention only ever mixes vectors of one token
position. `mix_site` is one fused pass per site with no branch on shapes or values, so it traces
the same way under torch.compile for every site, the first one (no stored source) included.

This module imports torch only, so that the transformers model, the vLLM model and the converters
all run the same code.
"""

from typing import Optional

import torch
from torch import Tensor


def acc(x: Tensor) -> Tensor:
    """`x` in the accumulation dtype: float32, or float64 for float64 inputs."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def fold_queries(proj_weights: Tensor, norm_weights: Tensor) -> Tensor:
    """Fold pseudo-queries `[S, d]` (or `[S, 1, d]`) and key-norm gains `[S, d]` into `[S, d]`."""
    return acc(proj_weights.reshape(norm_weights.shape)) * acc(norm_weights)


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """`1 / sqrt(mean(x^2) + eps)` over the last dim. `[..., d] -> [...]`, accumulation dtype.

    `vector_norm` is one fused reduction; `pow(2).mean()` is two passes and far slower on CPU."""
    x = acc(x)
    return torch.rsqrt(torch.linalg.vector_norm(x, dim=-1).square() / x.shape[-1] + eps)


def source_scores(sources: Tensor, query: Tensor, eps: float) -> Tensor:
    """`q . s / rms(s)` for every source: `[..., d] -> [...]`, accumulation dtype."""
    sources = acc(sources)
    return (sources @ query.to(sources.dtype)) * inverse_rms(sources, eps)


def empty_bank(partial: Tensor) -> Tensor:
    """A bank with no stored source yet, `[*tokens, 0, d]`, for a partial `[*tokens, d]`."""
    return partial.new_empty(*partial.shape[:-1], 0, partial.shape[-1])


def push_source(stored: Tensor, partial: Tensor) -> Tensor:
    """Store the partial as a completed source: `[*tokens, n, d] -> [*tokens, n + 1, d]`."""
    return torch.cat([stored, partial.unsqueeze(-2)], dim=-2)


def mix_site(stored: Tensor, partial: Tensor, query: Tensor, eps: float,
             keep_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Mix one site over `stored [*tokens, n, d]` (n may be 0) and `partial [*tokens, d]`.

    `query [d]` is the site's folded query. Returns the mix `[*tokens, d]` in the partial's dtype
    and, if `keep_weights`, the weights `[*tokens, n + 1]` (the partial's weight last). With n = 0
    the weight is exactly 1; computing it anyway keeps the query in the autograd graph (a zero
    gradient rather than none, which DDP without `find_unused_parameters` needs).

    Token-major storage makes both contractions contiguous batched matmuls over tokens.
    """
    p, src = acc(partial), acc(stored)
    scores = torch.cat([source_scores(src, query, eps), source_scores(p, query, eps)[..., None]], dim=-1)
    weights = torch.softmax(scores, dim=-1)                                     # [*tokens, n + 1]
    mixed = (weights[..., None, :-1] @ src).squeeze(-2) + weights[..., -1:] * p  # [*tokens, d]
    return mixed.to(partial.dtype), (weights if keep_weights else None)
