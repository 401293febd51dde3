"""A fused C++ CPU kernel for `depth_attention.mix_site`, for eager inference (opt-in).

In eager PyTorch a depth-attention site is about twenty small tensor operations. At one decoded
token each costs a few microseconds of dispatch whatever its size, about 0.1 ms a site and 33 sites
a token at 16 layers: several percent of a decoding step that Llama does not pay. This kernel does
a site in one call (scores, softmax and the weighted sum in one pass over each token's bank row),
and stores a completed block (`push_source`) in another.

It is a sibling backend of the torch function, not a second definition: `depth_attention.mix_site`
stays the reference (the tests hold this kernel to it and to the float64 oracle) and the only path
under autograd, `torch.compile` (which fuses the torch code itself) and on other devices. The
kernel is built from the source below with `torch.utils.cpp_extension.load_inline` the first time
it is enabled (a C++ compiler and ninja are needed; about 35 s on 2 cores, then cached in torch's
extensions directory). It stays off unless asked for: `enable_cpu_kernel()`, or the environment
variable `ATTNRES_CPU_KERNEL=1` (built at the first forward that uses it).
"""

import hashlib
import os
import platform
from typing import Optional

import torch
from torch import Tensor

from .depth_attention import DepthBank, acc

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

// One token: scores of the n stored rows and the partial, softmax, weighted sum. The row of a
// token (n x d) is read for the scores and again, still cached, for the sum.
template <typename acc_t, typename out_t>
static void mix_token(const acc_t* S, const acc_t* inv, const acc_t* p, const acc_t* q, int64_t n,
                      int64_t d, acc_t eps, acc_t* w, out_t* out, acc_t* weights_out) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {  // four independent reductions per pass, one load of q
    const acc_t *r0 = S + i * d, *r1 = r0 + d, *r2 = r1 + d, *r3 = r2 + d;
    acc_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < d; ++j) {
      s0 += r0[j] * q[j]; s1 += r1[j] * q[j]; s2 += r2[j] * q[j]; s3 += r3[j] * q[j];
    }
    w[i] = s0; w[i + 1] = s1; w[i + 2] = s2; w[i + 3] = s3;
  }
  for (; i < n; ++i) {
    const acc_t* r0 = S + i * d;
    acc_t s0 = 0;
#pragma omp simd reduction(+ : s0)
    for (int64_t j = 0; j < d; ++j) s0 += r0[j] * q[j];
    w[i] = s0;
  }
  acc_t sp = 0, ss = 0;
#pragma omp simd reduction(+ : sp, ss)
  for (int64_t j = 0; j < d; ++j) { sp += p[j] * q[j]; ss += p[j] * p[j]; }
  w[n] = sp / std::sqrt(ss / d + eps);
  acc_t m = w[n];
  for (i = 0; i < n; ++i) { w[i] *= inv[i]; m = std::max(m, w[i]); }
  acc_t z = 0;
  for (i = 0; i <= n; ++i) { w[i] = std::exp(w[i] - m); z += w[i]; }
  for (i = 0; i <= n; ++i) w[i] /= z;
  if (weights_out != nullptr) std::copy(w, w + n + 1, weights_out);
  constexpr int64_t kChunk = 256;  // the sum is built in a stack buffer, then cast once
  acc_t buf[kChunk];
  for (int64_t j0 = 0; j0 < d; j0 += kChunk) {
    const int64_t len = std::min(kChunk, d - j0);
    const acc_t wp = w[n];
#pragma omp simd
    for (int64_t j = 0; j < len; ++j) buf[j] = wp * p[j0 + j];
    for (i = 0; i < n; ++i) {
      const acc_t* row = S + i * d + j0;
      const acc_t wi = w[i];
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) buf[j] += wi * row[j];
    }
    for (int64_t j = 0; j < len; ++j) out[j0 + j] = static_cast<out_t>(buf[j]);
  }
}

// `x` as `acc_t` numbers (any floating dtype in; a loop, not tensor ops: this runs per site and token
// step, where each dispatched op would cost as much as the whole mix).
template <typename acc_t>
static void read_as(const at::Tensor& x, acc_t* out, bool multiply) {
  auto xc = x.contiguous();
  const int64_t d = xc.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, xc.scalar_type(), "read_as", [&] {
    const scalar_t* src = xc.data_ptr<scalar_t>();
    for (int64_t j = 0; j < d; ++j) {
      out[j] = multiply ? out[j] * static_cast<acc_t>(src[j]) : static_cast<acc_t>(src[j]);
    }
  });
}

// `query` is the folded query, or the raw pseudo-query when the key-norm `gain` is given (folded
// here as `fold_queries` does, both factors in the accumulation dtype: in eager Python the fold
// costs more than the rest of the site).
std::vector<at::Tensor> mix_site(const at::Tensor& sources, const at::Tensor& inv_rms,
                                 const at::Tensor& partial, const at::Tensor& query,
                                 const c10::optional<at::Tensor>& gain, double eps, at::ScalarType dtype,
                                 bool keep_weights) {
  const int64_t d = partial.size(-1), n = sources.size(-2), N = partial.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(partial.device().is_cpu() && sources.device().is_cpu() && inv_rms.device().is_cpu() &&
              query.device().is_cpu() && (!gain.has_value() || gain->device().is_cpu()),
              "mix_site: CPU tensors expected");
  TORCH_CHECK(sources.scalar_type() == partial.scalar_type() && inv_rms.scalar_type() == partial.scalar_type(),
              "mix_site: bank and partial dtypes differ");
  TORCH_CHECK(sources.numel() == N * n * d && inv_rms.numel() == N * n && query.numel() == d &&
              (!gain.has_value() || gain->numel() == d),
              "mix_site: bank ", sources.sizes(), " / ", inv_rms.sizes(), " does not match partial ",
              partial.sizes(), " and query ", query.sizes());
  auto S = sources.contiguous(), inv = inv_rms.contiguous(), p = partial.contiguous();
  auto out = at::empty(partial.sizes(), partial.options().dtype(dtype));
  auto weight_sizes = partial.sizes().vec();
  weight_sizes.back() = n + 1;
  at::Tensor weights = keep_weights ? at::empty(weight_sizes, partial.options()) : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "mix_site_acc", [&] {
    using acc_t = scalar_t;
    std::vector<acc_t> q(d);
    read_as<acc_t>(query, q.data(), false);
    if (gain.has_value()) read_as<acc_t>(*gain, q.data(), true);
    const acc_t *S_ = S.data_ptr<acc_t>(), *inv_ = inv.data_ptr<acc_t>(), *p_ = p.data_ptr<acc_t>(), *q_ = q.data();
    acc_t* w_out = keep_weights ? weights.data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mix_site_out", [&] {
      scalar_t* o_ = out.data_ptr<scalar_t>();
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> w(n + 1);
        for (int64_t t = begin; t < end; ++t) {
          mix_token<acc_t, scalar_t>(S_ + t * n * d, inv_ + t * n, p_ + t * d, q_, n, d, (acc_t)eps, w.data(),
                                     o_ + t * d, w_out ? w_out + t * (n + 1) : nullptr);
        }
      });
    });
  });
  return {out, weights};
}

// One token of `push_source`: its n stored rows and the partial copied into the new row, inverse RMS.
template <typename scalar_t>
static void push_token(const scalar_t* S, const scalar_t* inv, const scalar_t* p, int64_t n, int64_t d,
                       scalar_t eps, scalar_t* S_out, scalar_t* inv_out) {
  std::copy(S, S + n * d, S_out);
  std::copy(p, p + d, S_out + n * d);
  std::copy(inv, inv + n, inv_out);
  scalar_t ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) ss += p[j] * p[j];
  inv_out[n] = 1 / std::sqrt(ss / d + eps);
}

// `depth_attention.push_source`: the bank with the partial appended as a stored source (n -> n + 1)
// and its inverse RMS, written into new tensors in one pass instead of two `cat`s and a norm.
std::vector<at::Tensor> push_source(const at::Tensor& sources, const at::Tensor& inv_rms,
                                    const at::Tensor& partial, double eps) {
  const int64_t d = partial.size(-1), n = sources.size(-2), N = partial.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(partial.device().is_cpu() && sources.device().is_cpu() && inv_rms.device().is_cpu(),
              "push_source: CPU tensors expected");
  TORCH_CHECK(sources.scalar_type() == partial.scalar_type() && inv_rms.scalar_type() == partial.scalar_type(),
              "push_source: bank and partial dtypes differ");
  TORCH_CHECK(sources.numel() == N * n * d && inv_rms.numel() == N * n, "push_source: bank ", sources.sizes(),
              " / ", inv_rms.sizes(), " does not match partial ", partial.sizes());
  auto S = sources.contiguous(), inv = inv_rms.contiguous(), p = partial.contiguous();
  auto bank_sizes = sources.sizes().vec(), inv_sizes = inv_rms.sizes().vec();
  bank_sizes[bank_sizes.size() - 2] = n + 1;
  inv_sizes.back() = n + 1;
  auto new_sources = at::empty(bank_sizes, p.options()), new_inv = at::empty(inv_sizes, p.options());
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "push_source", [&] {
    const scalar_t *S_ = S.data_ptr<scalar_t>(), *inv_ = inv.data_ptr<scalar_t>(), *p_ = p.data_ptr<scalar_t>();
    scalar_t *S2 = new_sources.data_ptr<scalar_t>(), *inv2 = new_inv.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        push_token<scalar_t>(S_ + t * n * d, inv_ + t * n, p_ + t * d, n, d, static_cast<scalar_t>(eps),
                             S2 + t * (n + 1) * d, inv2 + t * (n + 1));
      }
    });
  });
  return {new_sources, new_inv};
}
"""

_module = None
_enabled = os.environ.get("ATTNRES_CPU_KERNEL", "0").lower() in ("1", "true", "yes")


def _extension_name() -> str:
    """The build is for this CPU (`-march=native`): its name carries a digest of the CPU's feature
    flags, so that a home directory shared by different machines never loads a foreign binary."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = ""
    digest = hashlib.sha1(f"{platform.machine()} {platform.processor()} {flags}".encode()).hexdigest()[:10]
    return f"attnres_depth_attention_cpu_{digest}"


def _build():
    """Compile (or load from torch's extension cache) the kernel module."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load_inline

        flags, ldflags = ["-O3", "-march=native"], []
        if platform.system() == "Linux":
            # OpenMP makes at::parallel_for split tokens across torch's threads; the library it links
            # (libgomp.so.1) resolves to the copy torch already loaded. Apple clang has no -fopenmp.
            flags.append("-fopenmp")
            ldflags.append("-fopenmp")
        else:
            flags.append("-fopenmp-simd")
        if platform.machine().lower() in ("x86_64", "amd64"):
            flags.append("-mprefer-vector-width=512")  # full AVX-512 width where there is one
        try:
            _module = load_inline(_extension_name(), cpp_sources=_SOURCE, functions=["mix_site", "push_source"],
                                  extra_cflags=flags, extra_ldflags=ldflags)
        except Exception as error:  # compiler missing, ninja missing, headers missing, ...
            raise RuntimeError(
                f"Could not build the AttnRes CPU kernel ({type(error).__name__}: {error}). It needs a C++ "
                "compiler (g++ or clang++) and `ninja` (pip install ninja); without them leave it off "
                "(unset ATTNRES_CPU_KERNEL): the torch path computes the same thing."
            ) from error
    return _module


def enable_cpu_kernel(enabled: bool = True) -> None:
    """Use the fused CPU kernel for depth attention in eager inference (builds it now if needed);
    `enable_cpu_kernel(False)` goes back to the torch path."""
    global _enabled
    if enabled:
        _build()
    _enabled = enabled


def cpu_kernel_applies(partial: Tensor) -> bool:
    """Whether a site mixing `partial` runs the fused kernel: it is enabled, the tensors are on the
    CPU, no gradient is being recorded and torch.compile is not tracing."""
    return (_enabled and partial.device.type == "cpu" and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def fused_push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """`depth_attention.push_source` in one C++ call. Forward only: call it where `cpu_kernel_applies`."""
    return DepthBank(*_build().push_source(bank.sources, bank.inv_rms, acc(partial), eps))


def fused_mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
                   keep_weights: bool = False, gain: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """`depth_attention.mix_site` (same arguments, same results up to float rounding) in one C++
    call. With `gain` (the site's key-norm weight), `query` is the raw pseudo-query and the two are
    folded in C++, as `fold_queries` would. Forward only: call it where `cpu_kernel_applies`."""
    mixed, weights = _build().mix_site(bank.sources, bank.inv_rms, acc(partial), query, gain, eps, dtype,
                                       keep_weights)
    return mixed, (weights if keep_weights else None)
