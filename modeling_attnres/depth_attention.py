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

Two ways to run a site, both exact and with no branch on shapes or values (so every site traces the
same way under torch.compile, the first one, with no stored source, included):
- `mix_site`: one pass per site over the bank. Needs only the site's own query, so it suits a model
  whose layers own their parameters (transformers: FSDP shards them per layer).
- The spec's two-phase scheme, for a caller that holds every site's query (vLLM): the sites between
  two block boundaries read the same stored sources, so `summarize_bank` reads the bank once for all
  of them (one matmul for their scores, one for their weighted sums), and `merge_partial` then adds
  each site's running partial with an exact online-softmax step. At block size k that reads the
  bank twice per block instead of twice per site, 2k times less; `site_group` / `group_sites` give
  the schedule.

This module imports torch only: the transformers model, the vLLM model and the converters all run
this code.
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


class BankSummary(NamedTuple):
    """Phase 1 for a group of `S` sites reading the same bank: per site, the log-sum-exp of its scores
    over the stored sources `lse [*tokens, S]` (-inf with none), their softmax-weighted sum
    `mixed [*tokens, S, d]` (zero with none) and the softmax weights `weights [*tokens, n, S]`."""

    lse: Tensor
    mixed: Tensor
    weights: Tensor


def summarize_bank(bank: DepthBank, queries: Tensor) -> BankSummary:
    """Score and mix the stored sources for the folded `queries [S, d]` of a group of sites at once."""
    src = bank.sources                                                         # [*tokens, n, d]
    q = queries if queries.dtype == src.dtype else queries.to(src.dtype)
    scores = (src @ q.T) * bank.inv_rms.unsqueeze(-1)                          # [*tokens, n, S]
    lse = torch.logsumexp(scores, dim=-2)                                      # [*tokens, S]
    weights = torch.exp(scores - lse.unsqueeze(-2))
    return BankSummary(lse, weights.transpose(-1, -2) @ src, weights)          # mixed [*tokens, S, d]


def merge_partial(summary: BankSummary, row: int, partial: Tensor, query: Tensor, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """Phase 2: the mix of site `row` of `summary`, adding the partial `[*tokens, d]` (query `[d]`).

    Online softmax: the stored sources together weigh `sigmoid(lse - s_p)` against the partial's
    score `s_p`, so the mix is `lerp(partial, mixed, sigmoid(lse - s_p))`: exactly the partial when
    no source is stored (lse = -inf), with the query still in the autograd graph.
    """
    p = acc(partial)
    q = query if query.dtype == p.dtype else query.to(p.dtype)
    partial_score = (p @ q) * inverse_rms(p, eps)                              # [*tokens]
    stored_weight = torch.sigmoid(summary.lse[..., row] - partial_score)
    mixed = torch.lerp(p, summary.mixed[..., row, :], stored_weight.unsqueeze(-1))
    return mixed.to(dtype)


def site_group(site: int, sites_per_block: int) -> int:
    """The bank a site reads, as the number of sources stored before it. Site `j` (attention of layer
    `l` is `2l`, its MLP `2l + 1`, the output site `2L`) follows the blocks closed after sites 0,
    `sites_per_block`, `2 * sites_per_block`, ...: `ceil(j / sites_per_block)` of them."""
    return -(-site // sites_per_block)


def group_sites(group: int, sites_per_block: int, num_sites: int) -> range:
    """The sites that read bank `group` (see `site_group`), for `num_sites = 2L + 1` sites."""
    first = 0 if group == 0 else (group - 1) * sites_per_block + 1
    return range(first, min(group * sites_per_block, num_sites - 1) + 1)


def add_to_partial(partial: Optional[Tensor], output: Tensor) -> Tensor:
    """Accumulate a sublayer output into the running partial (`None` right after a block closed)."""
    return acc(output) if partial is None else partial + output
