"""Depth attention: the one implementation of AttnRes mixing, shared by every model in this project.

A *site* (before attention, before the MLP, after the last layer) replaces the residual stream by a
softmax-weighted sum of *sources* (earlier blocks or sublayer outputs) of the same token position:

    mix(sources, w, g) = sum_i softmax_i(w . RMSNorm_g(s_i)) * s_i

Because `w . (g * s / rms(s)) == (w * g) . s / rms(s)`, a site is described by one folded query
`q = w * g` (see `fold_queries`). Scores, softmax and the weighted sum run in float32 (float64
inputs stay float64).

Sources are split into *stored* ones (completed blocks, fixed between two block boundaries) and the
running *partial* (the block being accumulated). All sites between two boundaries share the stored
set, so they are scored together in one pass (`score_stored`), and each site then merges its own
partial exactly with an online-softmax step (`merge_partial`); `mix_site` does both for one site.
Callers keep the stored sources and the partial as locals of `forward`, never on a module or in
the KV cache: depth attention only ever mixes vectors of one token position.

This module imports torch only, so that the transformers model, the vLLM model and the converters
all run the same code.
"""

from dataclasses import dataclass
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
    """`1 / sqrt(mean(x^2) + eps)` over the last dim, in the accumulation dtype. `[..., d] -> [...]`."""
    x = acc(x)
    return torch.rsqrt(x.pow(2).mean(-1) + eps)


def source_scores(sources: Tensor, queries: Tensor, eps: float) -> Tensor:
    """Scores of every source for every query.

    sources: `[n, *tokens, d]`; queries: `[s, d]` (folded). Returns `[s, n, *tokens]` in the
    accumulation dtype.
    """
    n, d = sources.shape[0], sources.shape[-1]
    flat = acc(sources.reshape(n, -1, d))                              # [n, T, d]
    dots = torch.einsum("ntd,sd->snt", flat, queries.to(flat.dtype))   # [s, n, T]
    scores = dots * inverse_rms(flat, eps)                             # [s, n, T]
    return scores.reshape(queries.shape[0], *sources.shape[:-1])


@dataclass
class StoredMix:
    """What `score_stored` leaves for each site of a group: `out [s, *tokens, d]` (weighted
    sum of the stored sources), `lse [s, *tokens]` (their log-sum-exp) and, when asked for,
    `scores [s, n, *tokens]`."""

    out: Tensor
    lse: Tensor
    scores: Optional[Tensor] = None


def score_stored(stored: Tensor, queries: Tensor, eps: float, keep_scores: bool = False) -> StoredMix:
    """Phase 1: mix the stored sources `[n, *tokens, d]` for all `s` sites of a group at once."""
    scores = source_scores(stored, queries, eps)                       # [s, n, *tokens]
    lse = torch.logsumexp(scores, dim=1)                               # [s, *tokens]
    probs = torch.exp(scores - lse.unsqueeze(1))                       # [s, n, *tokens]
    out = torch.einsum("sn...,n...d->s...d", probs, acc(stored))       # [s, *tokens, d]
    return StoredMix(out, lse, scores if keep_scores else None)


def merge_partial(out: Tensor, lse: Tensor, partial: Tensor, query: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Phase 2: merge one site's stored mix (`out [*tokens, d]`, `lse [*tokens]`) with its partial.

    Exact online softmax: with `s_p` the partial's score, the partial's weight is
    `sigmoid(s_p - lse)` and the stored mix keeps `sigmoid(lse - s_p)`. Returns the mixed state in
    the partial's dtype and the partial's score `[*tokens]` (float32).
    """
    p = acc(partial)
    s_p = (p @ query.to(p.dtype)) * inverse_rms(p, eps)                # [*tokens]
    w_p = torch.sigmoid(s_p - lse).unsqueeze(-1)                       # [*tokens, 1]
    mixed = out + w_p * (p - out)                                      # == (1-w_p)*o + w_p*p
    return mixed.to(partial.dtype), s_p


def depth_mix(sources: Tensor, query: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """One site in one pass: `sources [n, *tokens, d]`, folded `query [d]`.

    Returns the mix `[*tokens, d]` in the sources' dtype and the weights `[*tokens, n]`.
    """
    scores = source_scores(sources, query[None], eps)[0]               # [n, *tokens]
    probs = torch.softmax(scores, dim=0)
    out = torch.einsum("n...,n...d->...d", probs, acc(sources))
    return out.to(sources.dtype), probs.movedim(0, -1)


def mix_site(stored: Tensor, partial: Tensor, query: Tensor, eps: float,
             keep_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """One site: mix `stored [n, *tokens, d]` (n may be 0) and `partial [*tokens, d]` with the folded
    `query [d]`. Returns the mix in the partial's dtype and, if `keep_weights`, the weights
    `[*tokens, n + 1]` (the partial's weight last)."""
    if stored.shape[0] == 0:
        # One source: the weight is exactly 1, but computing it keeps the query in the graph, so it
        # gets a zero gradient rather than none (DDP without find_unused_parameters needs that).
        p = acc(partial)
        weight = torch.softmax(((p @ query.to(p.dtype)) * inverse_rms(p, eps))[None], dim=0)[0]
        return (weight[..., None] * p).to(partial.dtype), (weight[..., None] if keep_weights else None)
    group = score_stored(stored, query[None], eps, keep_scores=keep_weights)
    mixed, s_p = merge_partial(group.out[0], group.lse[0], partial, query, eps)
    if not keep_weights:
        return mixed, None
    scores = torch.cat([group.scores[0], s_p[None]], dim=0)           # [n + 1, *tokens]
    return mixed, torch.softmax(scores, dim=0).movedim(0, -1)
