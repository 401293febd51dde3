"""The depth-attention site as both models call it: fold the site's query, pick a backend, run it.

The mathematics is `depth_attention.py` (torch only, the reference). Other backends are siblings
with the same arguments, held to the same float64 oracle in the tests:

- `depth_attention_cpu.py`: a fused C++ kernel for eager CPU inference (on by default where it
  can be built, see there; its C++ source is `depth_attention_cpu_source.py`).
- `depth_attention_triton.py`: Triton kernels for CUDA inference (whenever Triton is installed).

The transformers model and the vLLM model both call these functions with their own modules'
parameters, so which backend runs, and how the query is folded, is decided here once. `site_boundary`
is a whole sublayer boundary (add, mix, store, the next sublayer's norm) in one call of the fused
backends; `site_mix` / `site_push` are its parts.
"""

import torch
from torch import Tensor

from .depth_attention import (
    DepthBank,
    SiteBoundary,
    bank_dtype,
    empty_bank,
    fold_queries,
    mix_site,
    push_block,
)
from .depth_attention import site_boundary as reference_boundary
from .depth_attention_cpu import cpu_kernel_applies, fused_mix_site, fused_push_source, fused_site_boundary
from .depth_attention_triton import triton_applies, triton_mix_site, triton_push_source, triton_site_boundary


def site_backend(partial: Tensor) -> str:
    """The backend `site_mix` / `site_push` run for `partial`: `"cpu-kernel"`, `"triton"` or
    `"torch"` (the reference, and the only one under autograd). See each sibling's `*_applies`."""
    if cpu_kernel_applies(partial):
        return "cpu-kernel"
    if triton_applies(partial):
        return "triton"
    return "torch"


def site_bank(embeds: Tensor, config, same_on_every_rank: bool = False) -> DepthBank:
    """The empty bank of a forward pass over `embeds [*tokens, d]` (in the model's dtype): room for
    every source `config.depth_sites` stores, kept in the dtype `config.attn_res_bank_dtype` names.

    This is the one place the bank dtype is decided. `"auto"` stores blocks in a bfloat16/float16
    model's dtype wherever a fused reader reads them (compiled graphs, the C++ kernel, GPUs), but keeps
    a float32 bank on the eager torch path on a CPU: there `mix_site` would convert the whole bank to
    float32 at every site, which costs more than the halved bytes save (docs/performance.md). With
    `same_on_every_rank` (vLLM, whose pipeline-parallel ranks must agree on the dtype of the bank they
    hand on before any forward pass runs) the config alone decides, as for a fused reader."""
    choice = config.attn_res_bank_dtype
    fused = (same_on_every_rank or torch.compiler.is_compiling() or embeds.device.type != "cpu"
             or cpu_kernel_applies(embeds))
    dtype = bank_dtype(choice if fused else "float32", embeds.dtype)
    return empty_bank(embeds, config.depth_sites[-1].num_stored, dtype)


def site_mix(bank: DepthBank, partial: Tensor, proj_weight: Tensor, norm_weight: Tensor, eps: float,
             keep_weights: bool = False) -> tuple[Tensor, Tensor | None]:
    """Mix one site from its pseudo-query `proj_weight [1, d]` and key-norm gain `norm_weight [d]`.

    Returns the mix `[*tokens, d]` in the pseudo-query's dtype and, if `keep_weights`, the weights
    `[*tokens, n + 1]` (see `depth_attention.mix_site`).
    """
    # The backends are tested in `site_backend`'s order, inline: in eager decoding this function runs
    # 2 * layers + 1 times per token, and each extra Python call costs as much as the kernel's work.
    if cpu_kernel_applies(partial):                                    # folds the query in C++
        return fused_mix_site(bank, partial, proj_weight, eps, proj_weight.dtype, keep_weights, gain=norm_weight)
    if triton_applies(partial):                                        # folds the query in the kernel
        return triton_mix_site(bank, partial, proj_weight, eps, proj_weight.dtype, keep_weights, gain=norm_weight)
    query = fold_queries(proj_weight, norm_weight[None])[0]            # [d]
    return mix_site(bank, partial, query, eps, proj_weight.dtype, keep_weights)


def site_push(bank: DepthBank, partial: Tensor, closes_block: bool,
              eps: float) -> tuple[DepthBank, Tensor | None]:
    """`depth_attention.push_block` by the backend that `site_mix` would use for this partial."""
    if not closes_block:
        return bank, partial
    if cpu_kernel_applies(partial):
        return fused_push_source(bank, partial, eps), None
    if triton_applies(partial):
        return triton_push_source(bank, partial, eps), None
    return push_block(bank, partial, closes_block, eps)


def site_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, proj_weight: Tensor,
                  gain: Tensor, eps: float, closes_block: bool, norm_weight: Tensor | None = None,
                  norm_eps: float = 0.0, keep_weights: bool = False, keep_mixed: bool = False,
                  reuse_partial: bool = False, consume_output: bool = False, reference: bool = False) -> SiteBoundary:
    """One sublayer boundary (`depth_attention.site_boundary`) by the backend `site_backend` names: the
    previous sublayer's `output` added into `partial` (`output=None` at a first site: `partial` is the
    embedding, or the partial a pipeline stage received), the mix of the site with pseudo-query
    `proj_weight [1, d]` and key-norm gain `gain [d]` (in the pseudo-query's dtype), the block store when
    `closes_block`, and the next sublayer's RMSNorm (`norm_weight [d]`, `norm_eps`) of the mix.

    Returns a `SiteBoundary`: the `bank` and `partial` for the next boundary, `normed` (the sublayer's
    input), `mixed` when `keep_mixed` (or when `norm_weight` is None: then it is the result) and the
    depth `weights [*tokens, n + 1]` when `keep_weights`. One C++ call on a CPU, one Triton kernel on a
    GPU, in inference; the torch reference under autograd and in compiled graphs (unless the kernels are
    enabled for them).

    `reuse_partial=True` says that the caller never reads `partial` again (the models: it came out of an
    earlier boundary that added an output): the CPU kernel then writes the new partial into its memory
    instead of a fresh tensor (the returned `partial` is that tensor, when it is contiguous). The results
    are the same; other backends ignore it. `consume_output=True` says the same of `output` (vLLM's model: a
    sublayer's result that nothing else reads): the CPU kernel then writes the normed mix over it, as
    vLLM's fused add+norm writes Llama's, instead of into fresh memory (`normed` is then `output`, when
    contiguous and of the normed mix's dtype). The transformers model does not: a forward hook may hold it.

    `reference=True` runs the torch reference whatever the backends: for a computation that is replayed
    under autograd (reentrant gradient checkpointing runs a layer's first forward without autograd, and
    its values must be the ones the replay differentiates).
    """
    probe = output if partial is None else partial
    if not reference and cpu_kernel_applies(probe):                    # folds the query in C++
        return fused_site_boundary(bank, partial, output, proj_weight, eps, closes_block, norm_weight, norm_eps,
                                   proj_weight.dtype, keep_weights, keep_mixed, gain=gain, reuse_partial=reuse_partial,
                                   consume_output=consume_output)
    if not reference and triton_applies(probe, in_graphs=True):        # folds the query in the kernel
        return triton_site_boundary(bank, partial, output, proj_weight, eps, closes_block, norm_weight, norm_eps,
                                    proj_weight.dtype, keep_weights, keep_mixed, gain=gain)
    query = fold_queries(proj_weight, gain[None])[0]                   # [d]
    return reference_boundary(bank, partial, output, query, eps, closes_block, norm_weight, norm_eps,
                              proj_weight.dtype, keep_weights, keep_mixed)


__all__ = ["site_backend", "site_bank", "site_boundary", "site_mix", "site_push"]
