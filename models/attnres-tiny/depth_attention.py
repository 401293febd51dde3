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
accumulated, always in the accumulation dtype: its sums are exact to float32 rather than rounded
after every sublayer). A stored source is kept in the bank's dtype (`bank_dtype`): for bfloat16 and
float16 models by default the model's own dtype, each source rounded once when it is stored, as
Llama rounds its residual stream, which halves the bytes every later site reads.

The bank is a buffer for all the sources of the forward pass, allocated once (`empty_bank` with a
capacity) and filled in place, so that storing a block does not copy the ones before it. Under
autograd it grows by concatenation instead: an in-place write would invalidate the views that
earlier sites saved for the backward pass. Callers keep the bank and the partial as locals of
`forward`, never on a module or in the KV cache: depth attention only mixes one token's vectors.

`mix_site` is one pass per site with no branch on shapes or values, so it traces the same way under
torch.compile for every site, the first one (no stored source) included. This module imports torch
only: the transformers model, the vLLM model and the converters all run this code.

`site_boundary` is everything that happens between two sublayers, in the models' order: the last
sublayer's output added into the partial, the site's mix, the block store if the site closes one,
and the next sublayer's RMSNorm of the mix. It is the reference the fused backends
(`depth_attention_cpu`, `depth_attention_triton`) do in one call.
"""

from typing import NamedTuple

import torch
from torch import Tensor

_ACC_DTYPES = (torch.float32, torch.float64)
BANK_DTYPES = ("auto", "float32")


def acc(x: Tensor) -> Tensor:
    """`x` in the accumulation dtype: float32, or float64 for float64 inputs (no-op when already)."""
    return x if x.dtype in _ACC_DTYPES else x.float()


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype for inputs of `dtype`: float64 stays float64, all else is float32."""
    return dtype if dtype in _ACC_DTYPES else torch.float32


def bank_dtype(choice: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype stored sources are kept in (`AttnResConfig.attn_res_bank_dtype`): `"auto"` is the
    model's dtype for bfloat16/float16 models and the accumulation dtype otherwise; `"float32"` is
    always the accumulation dtype (float64 for float64 models)."""
    if choice not in BANK_DTYPES:
        raise ValueError(f"bank dtype must be one of {BANK_DTYPES}, got {choice!r}.")
    low_precision = model_dtype in (torch.bfloat16, torch.float16)
    return model_dtype if choice == "auto" and low_precision else acc_dtype(model_dtype)


def fold_queries(proj_weights: Tensor, norm_weights: Tensor) -> Tensor:
    """Fold pseudo-queries `[S, d]` (or `[S, 1, d]`) and key-norm gains `[S, d]` into `[S, d]`."""
    # One cast: the product type-promotes a low-precision gain and is computed in float32.
    return acc(proj_weights.reshape(norm_weights.shape)) * norm_weights


def inverse_rms(x: Tensor, eps: float) -> Tensor:
    """`1 / sqrt(mean(x^2) + eps)` over the last dim, and 0 where that sum is 0 (an all-zero row with `eps=0`:
    its key is 0 and scores 0, as with any eps > 0; docs/spec.md). `[..., d] -> [...]`, accumulation dtype."""
    x = acc(x)
    squares = (x * x).mean(-1)
    if eps > 0:
        return torch.rsqrt(squares + eps)
    # With eps = 0 a padded position's zero attention output, starting a new partial, would score 0 * inf = NaN,
    # which attention then spreads to every token. The select keeps gradients finite (no rsqrt(0) in the graph).
    nonzero = squares > 0
    return torch.rsqrt(torch.where(nonzero, squares, 1.0)) * nonzero


class DepthBank(NamedTuple):
    """The stored sources of one forward pass, token-major: the first `num_stored` rows of `storage
    [*tokens, capacity, d]` (the bank's dtype) and of `inv_storage [*tokens, capacity]` (their inverse
    RMS, accumulation dtype). Rows past `num_stored` are not yet written."""

    storage: Tensor
    inv_storage: Tensor
    num_stored: int = 0

    @property
    def sources(self) -> Tensor:
        """The stored sources `[*tokens, n, d]` (a view)."""
        return self.storage[..., : self.num_stored, :]

    @property
    def inv_rms(self) -> Tensor:
        """Their inverse RMS `[*tokens, n]` (a view)."""
        return self.inv_storage[..., : self.num_stored]


def empty_bank(partial: Tensor, capacity: int = 0, dtype: torch.dtype | None = None) -> DepthBank:
    """A bank with no stored source yet for `[*tokens, d]` inputs, room for `capacity` sources (see
    `AttnResConfig.num_depth_sources`) and sources kept in `dtype` (default: the accumulation dtype).
    With autograd recording, the room is not used: the bank grows by concatenation."""
    dtype = dtype or acc_dtype(partial.dtype)
    capacity = 0 if torch.is_grad_enabled() else capacity
    tokens, d = partial.shape[:-1], partial.shape[-1]
    return DepthBank(partial.new_empty(*tokens, capacity, d, dtype=dtype),
                     partial.new_empty(*tokens, capacity, dtype=acc_dtype(partial.dtype)))


def push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """Store the partial as a completed source (rounded to the bank's dtype, then normalised once):
    n -> n + 1, in place while the bank has room, by concatenation otherwise."""
    source = partial.to(bank.storage.dtype)
    inv = inverse_rms(source, eps).to(bank.inv_storage.dtype)
    n = bank.num_stored
    if n < bank.storage.shape[-2]:
        bank.storage[..., n, :] = source
        bank.inv_storage[..., n] = inv
        return DepthBank(bank.storage, bank.inv_storage, n + 1)
    return DepthBank(torch.cat([bank.sources, source.unsqueeze(-2)], dim=-2),
                     torch.cat([bank.inv_rms, inv.unsqueeze(-1)], dim=-1), n + 1)


def push_block(bank: DepthBank, partial: Tensor, closes_block: bool,
               eps: float) -> tuple[DepthBank, Tensor | None]:
    """After a site that closes a block, the partial becomes a stored source and a new partial starts
    empty (`None`); otherwise both pass through. `closes_block` is fixed per site at construction."""
    if not closes_block:
        return bank, partial
    return push_source(bank, partial, eps), None


def mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
             keep_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Mix one site over the stored sources and the partial `[*tokens, d]`.

    `query [d]` is the site's folded query. Returns the mix `[*tokens, d]` in `dtype` and, if
    `keep_weights`, the weights `[*tokens, n + 1]` (the partial's weight last). With no stored
    source the weight is exactly 1; computing it anyway keeps the query in the autograd graph (a
    zero gradient rather than none, which DDP without `find_unused_parameters` needs).
    """
    p = acc(partial)
    src = bank.sources if bank.storage.dtype == p.dtype else bank.sources.to(p.dtype)  # fused when compiled
    q = query if query.dtype == p.dtype else query.to(p.dtype)
    stored_scores = (src @ q) * bank.inv_rms                                   # [*tokens, n]
    partial_score = (p @ q) * inverse_rms(p, eps)                              # [*tokens]
    weights = torch.softmax(torch.cat([stored_scores, partial_score.unsqueeze(-1)], dim=-1), dim=-1)
    stored_mix = (weights[..., :-1].unsqueeze(-2) @ src).squeeze(-2)          # [*tokens, d]
    mixed = torch.addcmul(stored_mix, weights[..., -1:], p)
    return mixed.to(dtype), (weights if keep_weights else None)


def add_to_partial(partial: Tensor | None, output: Tensor) -> Tensor:
    """Accumulate a sublayer output into the running partial (`None` right after a block closed)."""
    return acc(output) if partial is None else partial + output


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' `LlamaRMSNorm` exactly (the same operations in the same order): statistics in float32,
    the normalised value cast back to `x`'s dtype, then times `weight` (result in the promoted dtype).
    vLLM's native `RMSNorm` computes the same bits when its weight has `x`'s dtype (it always does in
    both models: the norms and the pseudo-queries share the model's dtype)."""
    hidden = x.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + eps)
    return weight * hidden.to(x.dtype)


class SiteBoundary(NamedTuple):
    """What a sublayer boundary (`site_boundary`) hands on.

    `bank` and `partial` are the depth history for the next boundary (`partial` is `None` right after
    the site closed a block); `mixed` is the site's mix in the model's dtype (`None` unless asked for,
    or when no norm was given: then it is the result); `normed` is the next sublayer's input, the
    RMSNorm of the mix (`None` without a norm); `weights [*tokens, n + 1]` the site's depth weights
    when kept."""

    bank: DepthBank
    partial: Tensor | None
    mixed: Tensor | None
    normed: Tensor | None
    weights: Tensor | None = None


def site_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor, eps: float,
                  closes_block: bool, norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype,
                  keep_weights: bool = False, keep_mixed: bool = False) -> SiteBoundary:
    """One sublayer boundary, as the models run it between two sublayers (docs/spec.md, section 3):

    1. `partial = add_to_partial(partial, output)`: the previous sublayer's output joins the partial
       (`output=None` at the first site of the model or of a pipeline stage: `partial` is then the
       embedding or the received partial, taken in the accumulation dtype);
    2. the mix of this site (`mix_site`, folded `query [d]`, result in `dtype`) over the stored sources
       and that partial, which it reads *before* it becomes a stored block;
    3. `push_block`: if the site closes a block, the partial is stored and a new one starts (`None`);
    4. the next sublayer's RMSNorm of the mix (`rms_norm` with `norm_weight`, `norm_eps`; skipped when
       `norm_weight` is `None`, and then `mixed` is returned whatever `keep_mixed` says).
    """
    partial = acc(partial) if output is None else add_to_partial(partial, output)
    mixed, weights = mix_site(bank, partial, query, eps, dtype, keep_weights)
    bank, partial = push_block(bank, partial, closes_block, eps)
    if norm_weight is None:
        return SiteBoundary(bank, partial, mixed, None, weights)
    return SiteBoundary(bank, partial, mixed if keep_mixed else None, rms_norm(mixed, norm_weight, norm_eps), weights)
