"""Depth attention: the one implementation of AttnRes mixing, shared by every model in this project.

A *site* (before attention, before the MLP, after the last layer) replaces the residual stream by a
softmax-weighted sum of *sources* (earlier blocks or sublayer outputs) of the same token position:

    mix(sources, w, g) = sum_i softmax_i(w . RMSNorm_g(s_i)) * s_i

Because `w . (g * s / rms(s)) == (w * g) . s / rms(s)`, a site is described by one folded query
`q = w * g` (see `fold_queries`), and a source by its inverse RMS, computed once when the source is
stored (`push_source`) rather than at every site that reads it. Scores, softmax and the weighted sum
run in float32 (float64 stays float64) over the raw sources; the mix is cast to the model's dtype.

The sources are the *stored* ones (completed blocks, kept token-major in a `DepthBank` so that both
contractions are contiguous batched matmuls over tokens) and the running *partial* (the block being
accumulated). Both are kept in the accumulation dtype: for bfloat16 models this spares a conversion
of the whole bank at every site, and the partial sums are exact to float32 rather than rounded to
bfloat16 after every sublayer. Callers keep bank and partial as locals of `forward`, never on a
module or in the KV cache: depth attention only ever mixes vectors of one token position.

`mix_site` is one pass per site with no branch on shapes or values, so it traces the same way under
torch.compile for every site, the first one (no stored source) included. This module imports torch
only: the transformers model, the vLLM model and the converters all run this code.
"""

from typing import NamedTuple, Optional

import torch
from torch import Tensor

_ACC_DTYPES = (torch.float32, torch.float64)


def acc(x: Tensor) -> Tensor:
    """`x` in the accumulation dtype: float32, or float64 for float64 inputs (no-op when already)."""
    return x if x.dtype in _ACC_DTYPES else x.float()


def fold_queries(proj_weights: Tensor, norm_weights: Tensor) -> Tensor:
    """Fold pseudo-queries `[S, d]` (or `[S, 1, d]`) and key-norm gains `[S, d]` into `[S, d]`."""
    # One cast: the product type-promotes a low-precision gain and is computed in float32.
    return acc(proj_weights.reshape(norm_weights.shape)) * norm_weights


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """`1 / sqrt(mean(x^2) + eps)` over the last dim. `[..., d] -> [...]`, accumulation dtype."""
    x = acc(x)
    return torch.rsqrt((x * x).mean(-1) + eps)


class DepthBank(NamedTuple):
    """The stored sources of one forward pass, token-major: `sources [*tokens, n, d]` and their
    `inv_rms [*tokens, n]`, both in the accumulation dtype."""

    sources: Tensor
    inv_rms: Tensor


def empty_bank(partial: Tensor) -> DepthBank:
    """A bank with no stored source yet, for a partial `[*tokens, d]`."""
    partial = acc(partial)
    return DepthBank(partial.new_empty(*partial.shape[:-1], 0, partial.shape[-1]),
                     partial.new_empty(*partial.shape[:-1], 0))


def push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """Store the partial as a completed source (normalising it once): n -> n + 1."""
    partial = acc(partial)
    return DepthBank(torch.cat([bank.sources, partial.unsqueeze(-2)], dim=-2),
                     torch.cat([bank.inv_rms, inverse_rms(partial, eps).unsqueeze(-1)], dim=-1))


def push_block(bank: DepthBank, partial: Tensor, closes_block: bool,
               eps: float) -> tuple[DepthBank, Optional[Tensor]]:
    """After a site that closes a block, the partial becomes a stored source and a new partial starts
    empty (`None`); otherwise both pass through. `closes_block` is fixed per site at construction."""
    if not closes_block:
        return bank, partial
    return push_source(bank, partial, eps), None


def mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
             keep_weights: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """Mix one site over the stored sources and the partial `[*tokens, d]`.

    `query [d]` is the site's folded query. Returns the mix `[*tokens, d]` in `dtype` and, if
    `keep_weights`, the weights `[*tokens, n + 1]` (the partial's weight last). With no stored
    source the weight is exactly 1; computing it anyway keeps the query in the autograd graph (a
    zero gradient rather than none, which DDP without `find_unused_parameters` needs).
    """
    p, src = acc(partial), bank.sources
    q = query if query.dtype == p.dtype else query.to(p.dtype)
    stored_scores = (src @ q) * bank.inv_rms                                   # [*tokens, n]
    partial_score = (p @ q) * inverse_rms(p, eps)                              # [*tokens]
    weights = torch.softmax(torch.cat([stored_scores, partial_score.unsqueeze(-1)], dim=-1), dim=-1)
    stored_mix = (weights[..., :-1].unsqueeze(-2) @ src).squeeze(-2)          # [*tokens, d]
    mixed = torch.addcmul(stored_mix, weights[..., -1:], p)
    return mixed.to(dtype), (weights if keep_weights else None)


def add_to_partial(partial: Optional[Tensor], output: Tensor) -> Tensor:
    """Accumulate a sublayer output into the running partial (`None` right after a block closed)."""
    return acc(output) if partial is None else partial + output
