"""Triton kernels for `depth_attention.mix_site` and `push_source`: a site in one pass on GPUs.

In eager PyTorch a site is about twenty small kernels (two matmuls, a norm, a softmax, a cat...),
each launched separately and each reading its inputs from memory again. Here a site is one kernel:
one program per token row streams the row's stored sources once, keeping an online softmax
(running maximum, running sum and running weighted sum, as flash attention does over keys), and
writes the mix. Scores, softmax and the sum run in float32 (float64 for float64 inputs) whatever the
dtype of the bank (float32, bfloat16 or float16), of the partial and of the output. Storing a block
(`push_source`) is a second kernel: copy, append and inverse RMS in one pass.

A whole sublayer boundary (`depth_attention.site_boundary`: the sublayer output added into the
partial, the mix, the block store, the next sublayer's RMSNorm) is one kernel too, `_boundary_row`,
registered as the ops `attnres::triton_site_boundary` / `attnres::triton_site_boundary_store`
(`torch.library.triton_op`), so that torch.compile and CUDA graphs can take it into a graph
(Inductor sees the kernel itself). Rows wider than 16384 take the separate kernels.

These are siblings of the torch functions, not a second definition: `depth_attention` stays the
reference (the tests hold these kernels to it and to the float64 oracle) and the only path under
autograd. `depth_attention_ops` sends CUDA tensors here when Triton is installed and no gradient is
recorded (`triton_applies`); compiled graphs keep the torch code (Inductor fuses it) unless
`enable_triton_kernel(compiled=True)` / `ATTNRES_TRITON_KERNEL=compiled` puts the boundary op in
them. `enable_triton_kernel(False)` or `ATTNRES_TRITON_KERNEL=0` keeps everything on the torch path.
Triton's own switch for running kernels on the CPU, `TRITON_INTERPRET=1`, sends CPU tensors here
too: that is how the tests run these kernels without a GPU (slowly).

Triton is imported at the first kernel call, never at import time: remote-code users without it
(CPU machines, Apple silicon) load this file without error and run the torch path.
"""

from __future__ import annotations  # the kernels' `tl.constexpr` annotations stay strings until Triton reads them

import functools
import importlib.util
import logging
import os
from types import SimpleNamespace

import torch
from torch import Tensor

from .depth_attention import (
    DepthBank,
    SiteBoundary,
    acc,
    add_to_partial,
    fold_queries,
    push_source,
    rms_norm,
    site_boundary,
)

# Largest power-of-two row width a program holds in registers at once (hidden 16384 and below: one
# pass over the bank). Wider rows take the chunked kernel, which reads the bank twice.
_MAX_BLOCK_D = 16384
_CHUNK_D = 4096
_kernels = None
tl = None  # `triton.language`, set at the first kernel call; the kernels read it as a global


def _interpreting() -> bool:
    """Whether Triton runs kernels on the CPU (`TRITON_INTERPRET=1`, read as Triton reads it)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a kernel writes for a result in `dtype`. Triton's interpreter converts float32 to
    bfloat16 by truncation where GPUs (and torch) round to nearest even: under it, the kernel writes
    float32 and torch rounds."""
    return torch.float32 if dtype == torch.bfloat16 and _interpreting() else dtype


_AVAILABLE = importlib.util.find_spec("triton") is not None
_ENV = os.environ.get("ATTNRES_TRITON_KERNEL", "1").strip().lower()
_enabled = _ENV not in ("0", "false", "no", "off")
if _ENV not in ("0", "false", "no", "off", "1", "true", "yes", "on", "auto", "compiled"):
    logging.getLogger(__name__).warning(
        "AttnRes: ATTNRES_TRITON_KERNEL=%r is not a known value (0 or off: the kernels off; compiled: also inside "
        "torch.compile graphs; 1: the default); using the default, on.", _ENV)
_in_graphs = _ENV == "compiled"                    # the boundary op also inside torch.compile graphs


def enable_triton_kernel(enabled: bool = True, compiled: bool = False) -> None:
    """Run depth attention on the Triton kernels where they apply (the default when Triton is
    installed); `compiled=True` also puts the boundary op into torch.compile graphs;
    `enable_triton_kernel(False)` keeps every site on the torch path."""
    global _enabled, _in_graphs
    _enabled, _in_graphs = enabled, enabled and compiled


def triton_applies(partial: Tensor, in_graphs: bool = False) -> bool:
    """Whether a site mixing `partial` runs the Triton kernels: they are enabled and Triton is
    installed, the tensors are on a CUDA device (or on the CPU under `TRITON_INTERPRET=1`), no
    gradient is being recorded and torch.compile is not tracing (it fuses the torch code itself),
    unless the caller can run as an op in graphs (`in_graphs`, the boundary) and they are enabled there."""
    if torch.is_grad_enabled() or not (_enabled and _AVAILABLE):
        return False
    if torch.compiler.is_compiling() and not (in_graphs and _in_graphs):
        return False
    return partial.device.type == "cuda" or (partial.device.type == "cpu" and _interpreting())


def _inverse_rms(squares, d, eps):
    """`1 / sqrt(squares / d + eps)` of a row, and 0 where that is 1 / 0: an all-zero row with eps = 0 scores 0,
    as in `depth_attention.inverse_rms`."""
    v = squares / d + eps
    return tl.where(v > 0, tl.rsqrt(v), 0.0)


def _online_mix(src_row, inv_row, p, q, n, d, eps, offs, mask, src_stride_n, inv_stride_n,
                KEEP: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr):
    """The online softmax of one token row: the partial `p`'s score starts it and each of the `n` stored
    sources updates it. Returns `(acc, z, m, scores)`: the running weighted sum, sum of exp and max, and
    (with `KEEP`) every score, the partial's at index `n`."""
    m = tl.sum(p * q, axis=0) * _inverse_rms(tl.sum(p * p, axis=0), d, eps)
    z = tl.exp(m - m)                                # 1, in the accumulation dtype
    acc = p
    offs_n = tl.arange(0, BLOCK_N)
    scores = tl.where(offs_n == n, m, float("-inf"))  # read only with KEEP
    for i in range(n):
        x = tl.load(src_row + i * src_stride_n + offs, mask=mask, other=0.0).to(ACC)
        s = tl.sum(x * q, axis=0) * tl.load(inv_row + i * inv_stride_n).to(ACC)
        m_new = tl.maximum(m, s)
        alpha, beta = tl.exp(m - m_new), tl.exp(s - m_new)
        acc = acc * alpha + x * beta
        z = z * alpha + beta
        m = m_new
        if KEEP:
            scores = tl.where(offs_n == i, s, scores)
    return acc, z, m, scores


def _mix_row(src_ptr, inv_ptr, part_ptr, q_ptr, gain_ptr, out_ptr, w_ptr, n, d, eps,
             src_stride_t, src_stride_n, inv_stride_t, inv_stride_n, part_stride_t,
             HAS_GAIN: tl.constexpr, KEEP: tl.constexpr, ACC: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One token row, one pass: the partial's score starts an online softmax that each stored
    source then updates (`m` running max, `z` running sum of exp, `acc` running weighted sum)."""
    row = tl.program_id(0).to(tl.int64)              # int64 offsets: banks pass 2**31 elements
    offs = tl.arange(0, BLOCK_D)
    mask = offs < d
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(ACC)
    if HAS_GAIN:
        q = q * tl.load(gain_ptr + offs, mask=mask, other=0.0).to(ACC)
    p = tl.load(part_ptr + row * part_stride_t + offs, mask=mask, other=0.0).to(ACC)
    src_row = src_ptr + row * src_stride_t
    offs_n = tl.arange(0, BLOCK_N)
    acc, z, m, scores = _online_mix(src_row, inv_ptr + row * inv_stride_t, p, q, n, d, eps, offs, mask, src_stride_n,
                                    inv_stride_n, KEEP, ACC, BLOCK_N)
    tl.store(out_ptr + row * d + offs, (acc / z).to(out_ptr.dtype.element_ty), mask=mask)
    if KEEP:
        tl.store(w_ptr + row * (n + 1) + offs_n, tl.exp(scores - m) / z, mask=offs_n <= n)


def _mix_row_chunked(src_ptr, inv_ptr, part_ptr, q_ptr, gain_ptr, out_ptr, w_ptr, n, d, eps,
                     src_stride_t, src_stride_n, inv_stride_t, inv_stride_n, part_stride_t,
                     HAS_GAIN: tl.constexpr, KEEP: tl.constexpr, ACC: tl.constexpr,
                     BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One token row wider than a program's registers: the dot products chunk by chunk, the
    softmax over the `n + 1` scores (held in a `BLOCK_N` vector), then the sum chunk by chunk."""
    row = tl.program_id(0).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    src_row, part_row = src_ptr + row * src_stride_t, part_ptr + row * part_stride_t
    dots = tl.zeros([BLOCK_N], ACC)
    squares = tl.sum(dots, axis=0)                   # 0, the partial's sum of squares
    for start in range(0, d, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < d
        q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(ACC)
        if HAS_GAIN:
            q = q * tl.load(gain_ptr + offs, mask=mask, other=0.0).to(ACC)
        p = tl.load(part_row + offs, mask=mask, other=0.0).to(ACC)
        squares += tl.sum(p * p, axis=0)
        dots = tl.where(offs_n == n, dots + tl.sum(p * q, axis=0), dots)
        for i in range(n):
            x = tl.load(src_row + i * src_stride_n + offs, mask=mask, other=0.0).to(ACC)
            dots = tl.where(offs_n == i, dots + tl.sum(x * q, axis=0), dots)
    inv = tl.load(inv_ptr + row * inv_stride_t + offs_n * inv_stride_n, mask=offs_n < n, other=0.0).to(ACC)
    inv = tl.where(offs_n == n, _inverse_rms(squares, d, eps), inv)
    scores = tl.where(offs_n <= n, dots * inv, float("-inf"))
    e = tl.exp(scores - tl.max(scores, axis=0))
    weights = e / tl.sum(e, axis=0)
    w_partial = tl.sum(tl.where(offs_n == n, weights, 0.0), axis=0)
    for start in range(0, d, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < d
        acc = tl.load(part_row + offs, mask=mask, other=0.0).to(ACC) * w_partial
        for i in range(n):
            x = tl.load(src_row + i * src_stride_n + offs, mask=mask, other=0.0).to(ACC)
            acc += x * tl.sum(tl.where(offs_n == i, weights, 0.0), axis=0)
        tl.store(out_ptr + row * d + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    if KEEP:
        tl.store(w_ptr + row * (n + 1) + offs_n, weights, mask=offs_n <= n)


def _push_row(part_ptr, storage_ptr, inv_storage_ptr, n, d, eps, part_stride_t, storage_stride_t,
              inv_stride_t, ACC: tl.constexpr, BLOCK_D: tl.constexpr):
    """One token row of `push_source`, in place: the partial written to row `n` of the bank in the
    bank's dtype (rounded once, here) and its inverse RMS, taken of the value as stored."""
    row = tl.program_id(0).to(tl.int64)
    part_row, stored_row = part_ptr + row * part_stride_t, storage_ptr + row * storage_stride_t + n * d
    squares = tl.sum(tl.zeros([BLOCK_D], ACC), axis=0)
    for start in range(0, d, BLOCK_D):
        offs = start + tl.arange(0, BLOCK_D)
        mask = offs < d
        stored = tl.load(part_row + offs, mask=mask, other=0.0).to(storage_ptr.dtype.element_ty)
        tl.store(stored_row + offs, stored, mask=mask)
        squares += tl.sum(stored.to(ACC) * stored.to(ACC), axis=0)
    tl.store(inv_storage_ptr + row * inv_stride_t + n, _inverse_rms(squares, d, eps).to(
        inv_storage_ptr.dtype.element_ty))


def _round_bf16(x):
    """float32 `x` rounded to the nearest bfloat16 (ties to even), kept in float32: by hand, because
    Triton's interpreter truncates where GPUs (and torch) round, so both agree bit for bit."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


def _boundary_row(src_ptr, inv_ptr, part_ptr, out_ptr, q_ptr, gain_ptr, new_ptr, mix_ptr, normed_ptr, nw_ptr,
                  w_ptr, n, d, eps, norm_eps, src_stride_t, src_stride_n, inv_stride_t, inv_stride_n,
                  part_stride_t, out_stride_t, HAS_PARTIAL: tl.constexpr, HAS_OUTPUT: tl.constexpr,
                  HAS_GAIN: tl.constexpr, NEW_PARTIAL: tl.constexpr, CLOSES: tl.constexpr, WRITE_MIX: tl.constexpr,
                  HAS_NORM: tl.constexpr, KEEP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """One token row of `site_boundary`: p = partial + output; the online-softmax mix of `_mix_row`;
    row `n` of the bank <- p (rounded to the bank's dtype) with its inverse RMS when the site closes a
    block; the mix rounded to `mix_ptr`'s dtype and, with a norm, `LlamaRMSNorm` of it (float32
    statistics, the normalised value rounded to the mix's dtype, times the weight in the promoted dtype
    of `normed_ptr`). The accumulation dtype is `inv_ptr`'s; unused pointers are never read or written."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < d
    ACC = inv_ptr.dtype.element_ty
    q = tl.load(q_ptr + offs, mask=mask, other=0.0).to(ACC)
    if HAS_GAIN:
        q = q * tl.load(gain_ptr + offs, mask=mask, other=0.0).to(ACC)
    if HAS_PARTIAL:
        p = tl.load(part_ptr + row * part_stride_t + offs, mask=mask, other=0.0).to(ACC)
        if HAS_OUTPUT:
            p = p + tl.load(out_ptr + row * out_stride_t + offs, mask=mask, other=0.0).to(ACC)
    else:
        p = tl.load(out_ptr + row * out_stride_t + offs, mask=mask, other=0.0).to(ACC)
    if NEW_PARTIAL:
        tl.store(new_ptr + row * d + offs, p, mask=mask)
    src_row = src_ptr + row * src_stride_t
    offs_n = tl.arange(0, BLOCK_N)
    acc, z, m, scores = _online_mix(src_row, inv_ptr + row * inv_stride_t, p, q, n, d, eps, offs, mask, src_stride_n,
                                    inv_stride_n, KEEP, ACC, BLOCK_N)
    if CLOSES:
        SRC = src_ptr.dtype.element_ty
        if SRC == tl.bfloat16:
            stored = _round_bf16(p.to(tl.float32)).to(ACC)
        else:
            stored = p.to(SRC).to(ACC)
        tl.store(src_row + n * src_stride_n + offs, stored.to(SRC), mask=mask)
        tl.store(inv_ptr + row * inv_stride_t + n * inv_stride_n, _inverse_rms(tl.sum(stored * stored, axis=0), d, eps))
    mixed = acc / z
    MIX = mix_ptr.dtype.element_ty
    if MIX == tl.bfloat16:
        mixed = _round_bf16(mixed.to(tl.float32))
    elif MIX != tl.float64:
        mixed = mixed.to(MIX).to(tl.float32)
    if WRITE_MIX:
        tl.store(mix_ptr + row * d + offs, mixed.to(MIX), mask=mask)
    if HAS_NORM:
        x = mixed.to(tl.float32)
        y = x * tl.rsqrt(tl.sum(x * x, axis=0) / d + norm_eps)
        if MIX == tl.bfloat16:
            y = _round_bf16(y)
        elif MIX != tl.float64:
            y = y.to(MIX).to(tl.float32)
        NORM = normed_ptr.dtype.element_ty
        if NORM == tl.float64:
            normed = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float64) * y.to(tl.float64)
        else:
            normed = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32) * y
            if NORM == tl.bfloat16:
                normed = _round_bf16(normed)
        tl.store(normed_ptr + row * d + offs, normed.to(NORM), mask=mask)
    if KEEP:
        tl.store(w_ptr + row * (n + 1) + offs_n, tl.exp(scores - m) / z, mask=offs_n <= n)


def _load_kernels() -> SimpleNamespace:
    """Import Triton and compile-wrap the kernels (once). A clear error when Triton is missing."""
    global _kernels, tl
    if _kernels is None:
        try:  # (transformers' remote-code import check skips imports inside `try`)
            import triton
            import triton.language as language
        except ImportError as error:
            raise RuntimeError(
                "The AttnRes Triton kernels need Triton (pip install triton; it comes with PyTorch's CUDA "
                "wheels). Without it, run the torch path: `depth_attention.mix_site` / `push_source`."
            ) from error
        tl = language
        global _round_bf16, _online_mix, _inverse_rms  # helpers the kernels call: Triton functions too
        _round_bf16, _online_mix, _inverse_rms = triton.jit(_round_bf16), triton.jit(_online_mix), triton.jit(
            _inverse_rms)
        # One compiled variant for every number of stored sources (Triton would specialise n == 1).
        jit = functools.partial(triton.jit, do_not_specialize=["n"])
        _kernels = SimpleNamespace(mix=jit(_mix_row), mix_chunked=jit(_mix_row_chunked), push=jit(_push_row),
                                   boundary=jit(_boundary_row), next_power_of_2=triton.next_power_of_2)
    return _kernels


def _acc_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _check_bank(bank: DepthBank, partial: Tensor, where: str) -> tuple[int, int, int]:
    """`(tokens, n, d)` of a bank and partial that fit together, or a ValueError naming the shapes."""
    sources, inv_rms = bank.sources, bank.inv_rms
    d = partial.shape[-1]
    if (sources.dim() != partial.dim() + 1 or sources.shape[:-2] != partial.shape[:-1] or sources.shape[-1] != d
            or inv_rms.shape != sources.shape[:-1]):
        raise ValueError(f"{where}: bank sources {tuple(sources.shape)} / inv_rms {tuple(inv_rms.shape)} do not match "
                         f"partial {tuple(partial.shape)}; expected sources [*tokens, n, d] and inv_rms "
                         "[*tokens, n] for a partial [*tokens, d] (build the bank with `empty_bank(partial)`).")
    if not (sources.device == inv_rms.device == partial.device):
        raise ValueError(f"{where}: bank on {sources.device} / {inv_rms.device}, partial on {partial.device}; "
                         "move them to one device.")
    if d == 0:
        raise ValueError(f"{where}: hidden size 0 (partial {tuple(partial.shape)}); expected d >= 1.")
    return partial.numel() // d, sources.shape[-2], d


def _rows(bank: DepthBank, partial: Tensor, tokens: int, n: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Flat `[tokens, n, d]`, `[tokens, n]`, `[tokens, d]` views (copies only when the last dim is
    strided); with no stored source, the partial stands in for the empty bank (never read)."""
    part = partial.reshape(tokens, d)
    part = part if part.stride(-1) == 1 else part.contiguous()
    if n == 0:
        return part.unsqueeze(1), part[:, :1], part
    src = bank.sources.reshape(tokens, n, d)
    return (src if src.stride(-1) == 1 else src.contiguous()), bank.inv_rms.reshape(tokens, n), part


def _launch(kernel, tokens: int, device: torch.device, *args, **meta) -> None:
    """Launch one program per token row on `device` (Triton launches on the current CUDA device)."""
    if device.type == "cuda" and device.index not in (None, torch.cuda.current_device()):
        with torch.cuda.device(device):
            kernel[(tokens,)](*args, **meta)
    else:
        kernel[(tokens,)](*args, **meta)


def triton_mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
                    keep_weights: bool = False, gain: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`depth_attention.mix_site` (same arguments, same results up to float rounding) in one kernel.

    The bank's sources may be float32, bfloat16 or float16, as may the partial and `dtype`; all are
    upcast inside the kernel. With `gain` (the site's key-norm weight), `query` is the raw
    pseudo-query and the two are folded in the kernel, as `fold_queries` would. Forward only: call
    it where `triton_applies`.
    """
    tokens, n, d = _check_bank(bank, partial, "triton_mix_site")
    if query.numel() != d or (gain is not None and gain.numel() != d):
        raise ValueError(f"triton_mix_site: query {tuple(query.shape)} and gain "
                         f"{None if gain is None else tuple(gain.shape)} must have {d} elements (the hidden size "
                         f"of partial {tuple(partial.shape)}).")
    acc_dtype = _acc_dtype(partial)
    out = torch.empty(partial.shape, dtype=_kernel_dtype(dtype), device=partial.device)
    weights = (torch.empty(*partial.shape[:-1], n + 1, dtype=acc_dtype, device=partial.device)
               if keep_weights else None)
    if tokens == 0:
        return out.to(dtype), weights
    k = _load_kernels()
    src, inv, part = _rows(bank, partial, tokens, n, d)
    q = query.reshape(d).contiguous()
    block_d = k.next_power_of_2(d)
    kernel, block_d = (k.mix, block_d) if block_d <= _MAX_BLOCK_D else (k.mix_chunked, _CHUNK_D)
    # the one-pass kernel holds scores only for the weights: without them, one variant for every n
    block_n = k.next_power_of_2(n + 1) if keep_weights or kernel is k.mix_chunked else 1
    _launch(kernel, tokens, partial.device, src, inv, part, q, q if gain is None else gain.reshape(d).contiguous(),
            out, out if weights is None else weights, n, d, eps, src.stride(0), src.stride(1), inv.stride(0),
            inv.stride(1), part.stride(0), HAS_GAIN=gain is not None, KEEP=keep_weights,
            ACC=tl.float64 if acc_dtype == torch.float64 else tl.float32, BLOCK_D=block_d,
            BLOCK_N=block_n, num_warps=max(1, min(16, block_d // 512)))
    return out.to(dtype), weights


def triton_push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """`depth_attention.push_source` in one kernel: the partial stored in place in the bank's dtype
    and its inverse RMS (of the stored value), n -> n + 1. A bank with no room left grows by
    concatenation, as in the torch function. Forward only: call it where `triton_applies`."""
    tokens, n, d = _check_bank(bank, partial, "triton_push_source")
    storage, inv_storage = bank.storage, bank.inv_storage
    if n >= storage.shape[-2] or not (storage.is_contiguous() and inv_storage.is_contiguous()):
        return push_source(bank, partial, eps)
    if tokens > 0:
        k = _load_kernels()
        part = partial.reshape(tokens, d)
        part = part if part.stride(-1) == 1 else part.contiguous()
        part = part if _kernel_dtype(storage.dtype) == storage.dtype else part.to(storage.dtype)
        block_d = min(k.next_power_of_2(d), _CHUNK_D)
        _launch(k.push, tokens, partial.device, part, storage, inv_storage, n, d, eps, part.stride(0),
                storage.shape[-2] * d, inv_storage.shape[-1],
                ACC=tl.float64 if inv_storage.dtype == torch.float64 else tl.float32, BLOCK_D=block_d,
                num_warps=max(1, min(8, block_d // 512)))
    return DepthBank(storage, inv_storage, n + 1)


# The boundary's results `(new partial, mix, normed, weights)`: a tuple, not a list (functionalization
# does not take a list from an op that writes to its inputs).
Results = tuple[Tensor, Tensor, Tensor, Tensor]


def _boundary_outputs(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor | None,
                      output: Tensor | None, query: Tensor, gain: Tensor | None, eps: float, closes_block: bool,
                      norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype, keep_mixed: bool,
                      keep_weights: bool) -> Results:
    """The boundary's results, allocated: `[new partial, mix, normed, weights]`, each `[0]` where not
    produced (also the op's fake implementation where it is a plain custom op)."""
    ref = partial if output is None else output
    acc_dtype = inv_storage.dtype
    new_partial, write_mix = output is not None and not closes_block, keep_mixed or norm_weight is None
    norm_dtype = dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, dtype)
    return (ref.new_empty(ref.shape if new_partial else (0,), dtype=acc_dtype),
            ref.new_empty(ref.shape if write_mix else (0,), dtype=dtype),
            ref.new_empty(ref.shape if norm_weight is not None else (0,), dtype=norm_dtype),
            ref.new_empty((*ref.shape[:-1], num_stored + 1) if keep_weights else (0,), dtype=acc_dtype))


def _boundary_launch(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor | None,
                     output: Tensor | None, query: Tensor, gain: Tensor | None, eps: float, closes_block: bool,
                     norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype, keep_mixed: bool,
                     keep_weights: bool, traced: bool = False) -> Results:
    """`_boundary_row` over every token; returns `[new partial, mix, normed, weights]`, each an empty
    tensor where not produced (as `depth_attention_cpu`'s op). `storage [*tokens, C, d]` and
    `inv_storage` are contiguous (row `num_stored` is written in place when `closes_block`). `traced`:
    called as the op (torch.compile sees the kernel through `wrap_triton`); eager callers launch it
    directly (`triton_site_boundary`)."""
    outs = _boundary_outputs(storage, inv_storage, num_stored, partial, output, query, gain, eps, closes_block,
                             norm_weight, norm_eps, dtype, keep_mixed, keep_weights)
    ref = partial if output is None else output
    d, n = ref.shape[-1], num_stored
    tokens = ref.numel() // d
    new_partial, write_mix = output is not None and not closes_block, keep_mixed or norm_weight is None
    if tokens == 0:
        return outs
    k = _load_kernels()
    # Pointers a variant never touches still get a (one-element) tensor: their dtypes pick the roundings.
    new, mix, normed, weights = (x if x.numel() else ref.new_empty(1, dtype=x.dtype) for x in outs)
    rows = {name: x.reshape(tokens, d) for name, x in (("part", partial), ("out", output)) if x is not None}
    rows = {name: x if x.stride(-1) == 1 else x.contiguous() for name, x in rows.items()}
    part, out = rows.get("part", rows.get("out")), rows.get("out", rows.get("part"))
    C = storage.shape[-2]
    src, inv, q = storage.view(tokens, C, d), inv_storage.view(tokens, C), query.reshape(d).contiguous()
    if storage.numel() == 0:                           # no bank rows at all (n == 0, nothing to store): never read
        src, inv = part.unsqueeze(1), ref.new_empty(1, 1, dtype=inv_storage.dtype)
    block_d = k.next_power_of_2(d)
    kernel = torch.library.wrap_triton(k.boundary) if traced else k.boundary
    _launch(kernel, tokens, ref.device, src, inv, part, out, q, q if gain is None else gain.reshape(d).contiguous(),
            new, mix, normed, q if norm_weight is None else norm_weight.reshape(d).contiguous(), weights,
            n, d, eps, norm_eps, src.stride(0), src.stride(1), inv.stride(0), inv.stride(1), part.stride(0),
            out.stride(0), HAS_PARTIAL=partial is not None, HAS_OUTPUT=output is not None, HAS_GAIN=gain is not None,
            NEW_PARTIAL=new_partial, CLOSES=closes_block, WRITE_MIX=write_mix, HAS_NORM=norm_weight is not None,
            KEEP=keep_weights, BLOCK_D=block_d, BLOCK_N=k.next_power_of_2(n + 1) if keep_weights else 1,
            num_warps=max(1, min(16, block_d // 512)))
    return outs


def _boundary_op(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor | None,
                 output: Tensor | None, query: Tensor, gain: Tensor | None, eps: float, closes_block: bool,
                 norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype, keep_mixed: bool,
                 keep_weights: bool) -> Results:
    return _boundary_launch(storage, inv_storage, num_stored, partial, output, query, gain, eps, closes_block,
                            norm_weight, norm_eps, dtype, keep_mixed, keep_weights, traced=not _interpreting())


# Registered once per process (the package and a Hub copy of this file may both be imported): the
# boundary that stores a block declares its write to the bank, the other none. A `triton_op` lets
# Inductor see (and CUDA graphs capture) the kernel itself; under Triton's interpreter, whose kernels
# torch cannot trace, the same function is an opaque custom op with a fake implementation.
if not hasattr(torch.ops.attnres, "triton_site_boundary"):
    for _name, _mutates in (("triton_site_boundary", ()), ("triton_site_boundary_store", ("storage", "inv_storage"))):
        if hasattr(torch.library, "triton_op") and not _interpreting():
            torch.library.triton_op(f"attnres::{_name}", mutates_args=_mutates)(_boundary_op)
        else:
            torch.library.custom_op(f"attnres::{_name}", _boundary_op, mutates_args=_mutates)
            torch.library.register_fake(f"attnres::{_name}", _boundary_outputs)


def _boundary_in_parts(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor, eps: float,
                       closes_block: bool, norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype,
                       keep_weights: bool, keep_mixed: bool, gain: Tensor | None) -> SiteBoundary:
    """The boundary by the separate kernels (rows wider than one program holds, a bank without room or
    not contiguous), or by the torch reference inside torch.compile."""
    if torch.compiler.is_compiling():
        query = query if gain is None else fold_queries(query, gain[None])[0]
        return site_boundary(bank, partial, output, query, eps, closes_block, norm_weight, norm_eps, dtype,
                             keep_weights, keep_mixed)
    p = acc(partial) if output is None else add_to_partial(partial, output)
    mixed, weights = triton_mix_site(bank, p, query, eps, dtype, keep_weights, gain=gain)
    bank, p = (triton_push_source(bank, p, eps), None) if closes_block else (bank, p)
    normed = None if norm_weight is None else rms_norm(mixed, norm_weight, norm_eps)
    return SiteBoundary(bank, p, mixed if keep_mixed or norm_weight is None else None, normed, weights)


def triton_site_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor, eps: float,
                         closes_block: bool, norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype,
                         keep_weights: bool = False, keep_mixed: bool = False,
                         gain: Tensor | None = None) -> SiteBoundary:
    """`depth_attention.site_boundary` (same arguments, same results up to float rounding) in one kernel;
    the block, when the site closes one, is stored in place. With `gain` (the site's key-norm weight),
    `query` is the raw pseudo-query, folded in the kernel. Inside torch.compile it runs as the op
    `attnres::triton_site_boundary[_store]`. Forward only: call it where `triton_applies(..., in_graphs=True)`."""
    ref = partial if output is None else output
    tokens, n, d = _check_bank(bank, ref, "triton_site_boundary")
    if query.numel() != d or (gain is not None and gain.numel() != d) or (
            norm_weight is not None and norm_weight.numel() != d):
        raise ValueError(f"triton_site_boundary: query {tuple(query.shape)}, gain and norm weight must have {d} "
                         f"elements (the hidden size of {tuple(ref.shape)}).")
    storage, inv_storage = bank.storage, bank.inv_storage
    if (1 << (d - 1).bit_length() > _MAX_BLOCK_D or not (storage.is_contiguous() and inv_storage.is_contiguous())
            or (closes_block and n >= storage.shape[-2])):
        return _boundary_in_parts(bank, partial, output, query, eps, closes_block, norm_weight, norm_eps, dtype,
                                  keep_weights, keep_mixed, gain)
    if output is None and partial.dtype not in (torch.float32, torch.float64):
        partial, output = None, partial                # the embedding: read (as the output) in float32
    args = (storage, inv_storage, n, partial, output, query, gain, eps, closes_block, norm_weight, norm_eps, dtype,
            keep_mixed, keep_weights)
    if torch.compiler.is_compiling():
        op = torch.ops.attnres.triton_site_boundary_store if closes_block else torch.ops.attnres.triton_site_boundary
        new_partial, mixed, normed, weights = op(*args)
    else:
        new_partial, mixed, normed, weights = _boundary_launch(*args)
    mixed = mixed if keep_mixed or norm_weight is None else None
    normed, weights = (None if norm_weight is None else normed), (weights if keep_weights else None)
    if closes_block:
        return SiteBoundary(DepthBank(storage, inv_storage, n + 1), None, mixed, normed, weights)
    return SiteBoundary(bank, new_partial if output is not None else partial, mixed, normed, weights)


__all__ = ["enable_triton_kernel", "triton_applies", "triton_mix_site", "triton_push_source", "triton_site_boundary"]
