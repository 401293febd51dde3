"""A fused C++ CPU kernel for `depth_attention.mix_site` and `push_source`, for inference (opt-in).

In eager PyTorch a depth-attention site is about twenty small tensor operations, each paying
dispatch overhead whatever its size; at one decoded token that overhead is most of the site's cost,
and Llama does not pay it (README, "Performance"). This kernel does a site in one call (scores,
softmax and the weighted sum in one pass over each token's bank row, reading a bfloat16/float16 bank
as float32), and stores a completed block in place (`push_source`) in another.

It is a sibling backend of the torch functions, not a second definition: `depth_attention.mix_site`
stays the reference (the tests hold this kernel to it and to the float64 oracle) and the only path
under autograd and on other devices. The kernel is built from the source below with
`torch.utils.cpp_extension.load_inline` the first time it is enabled (a C++ compiler and ninja are
needed; then cached in torch's extensions directory). It stays off unless asked for:
`enable_cpu_kernel()`, or the environment variable `ATTNRES_CPU_KERNEL=1` (built at first use).

Inside `torch.compile` the sites are left to Inductor's generated code unless asked for with
`enable_cpu_kernel(compiled=True)` / `ATTNRES_CPU_KERNEL=compiled`: then the mix runs as the custom op
`attnres::mix_site` (with a fake implementation for tracing). Measured on real weights, the op is
slower there (it stops fusion, and compilation already removed the Python the kernel saves), so
compiled graphs do not use it by default (README, "Performance").
"""

import hashlib
import os
import platform

import torch
from torch import Tensor

from .depth_attention import DepthBank, acc, push_source

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>
#include <vector>

// One token: scores of the n stored rows (row stride d, any floating src_t, read as acc_t) and the
// partial, softmax, weighted sum. The row of a token is read for the scores and again, still
// cached, for the sum.
template <typename acc_t, typename src_t, typename out_t>
static void mix_token(const src_t* S, const acc_t* inv, const acc_t* p, const acc_t* q, int64_t n,
                      int64_t d, acc_t eps, acc_t* w, out_t* out, acc_t* weights_out) {
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {  // four independent reductions per pass, one load of q
    const src_t *r0 = S + i * d, *r1 = r0 + d, *r2 = r1 + d, *r3 = r2 + d;
    acc_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < d; ++j) {
      s0 += static_cast<acc_t>(r0[j]) * q[j]; s1 += static_cast<acc_t>(r1[j]) * q[j];
      s2 += static_cast<acc_t>(r2[j]) * q[j]; s3 += static_cast<acc_t>(r3[j]) * q[j];
    }
    w[i] = s0; w[i + 1] = s1; w[i + 2] = s2; w[i + 3] = s3;
  }
  for (; i < n; ++i) {
    const src_t* r0 = S + i * d;
    acc_t s0 = 0;
#pragma omp simd reduction(+ : s0)
    for (int64_t j = 0; j < d; ++j) s0 += static_cast<acc_t>(r0[j]) * q[j];
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
      const src_t* row = S + i * d + j0;
      const acc_t wi = w[i];
#pragma omp simd
      for (int64_t j = 0; j < len; ++j) buf[j] += wi * static_cast<acc_t>(row[j]);
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

// The checks both entry points share: CPU tensors, `storage [N, C, d]` contiguous in float32, float64,
// bfloat16 or float16 (float64 only with a float64 partial), `inv_storage [N, C]` and the partial
// [N, d] in the accumulation dtype, `n <= C` rows written.
static void check_bank(const char* name, const at::Tensor& storage, const at::Tensor& inv_storage, int64_t n,
                       const at::Tensor& partial) {
  const int64_t d = partial.size(-1), N = partial.numel() / std::max<int64_t>(d, 1);
  const int64_t C = storage.dim() >= 2 ? storage.size(-2) : -1;
  TORCH_CHECK(partial.device().is_cpu() && storage.device().is_cpu() && inv_storage.device().is_cpu(),
              name, ": CPU tensors expected");
  const auto acc = partial.scalar_type();
  TORCH_CHECK((acc == at::kFloat || acc == at::kDouble) && inv_storage.scalar_type() == acc, name,
              ": the partial and inv_rms must be float32 or float64, got ", acc, " and ", inv_storage.scalar_type());
  TORCH_CHECK(storage.scalar_type() == acc || (acc == at::kFloat && (storage.scalar_type() == at::kBFloat16 ||
              storage.scalar_type() == at::kHalf)), name, ": a ", storage.scalar_type(), " bank with a ", acc,
              " partial (expected the same dtype, or a bfloat16/float16 bank with a float32 partial)");
  TORCH_CHECK(storage.is_contiguous() && inv_storage.is_contiguous(), name, ": the bank must be contiguous");
  TORCH_CHECK(0 <= n && n <= C && storage.numel() == N * C * d && inv_storage.numel() == N * C, name, ": bank ",
              storage.sizes(), " / ", inv_storage.sizes(), " with ", n, " stored does not match partial ",
              partial.sizes());
}

// `storage` holds the bank (rows [0, n) written); `query` is the folded query, or the raw pseudo-query
// when the key-norm `gain` is given (folded here as `fold_queries` does, both factors in the
// accumulation dtype: in eager Python the fold costs more than the rest of the site).
std::vector<at::Tensor> mix_site(const at::Tensor& storage, const at::Tensor& inv_storage, int64_t n,
                                 const at::Tensor& partial, const at::Tensor& query,
                                 const c10::optional<at::Tensor>& gain, double eps, at::ScalarType dtype,
                                 bool keep_weights) {
  check_bank("mix_site", storage, inv_storage, n, partial);
  const int64_t d = partial.size(-1), N = partial.numel() / std::max<int64_t>(d, 1), C = storage.size(-2);
  TORCH_CHECK(query.device().is_cpu() && (!gain.has_value() || gain->device().is_cpu()),
              "mix_site: CPU tensors expected");
  TORCH_CHECK(query.numel() == d && (!gain.has_value() || gain->numel() == d), "mix_site: query ", query.sizes(),
              " does not match partial ", partial.sizes());
  auto p = partial.contiguous();
  auto out = at::empty(partial.sizes(), partial.options().dtype(dtype));
  auto weight_sizes = partial.sizes().vec();
  weight_sizes.back() = n + 1;
  at::Tensor weights;  // undefined (None in Python) unless kept: one allocation less per site
  if (keep_weights) weights = at::empty(weight_sizes, partial.options());
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "mix_site_acc", [&] {
    using acc_t = scalar_t;
    std::vector<acc_t> q(d);
    read_as<acc_t>(query, q.data(), false);
    if (gain.has_value()) read_as<acc_t>(*gain, q.data(), true);
    const acc_t *inv_ = inv_storage.data_ptr<acc_t>(), *p_ = p.data_ptr<acc_t>(), *q_ = q.data();
    acc_t* w_out = keep_weights ? weights.data_ptr<acc_t>() : nullptr;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, storage.scalar_type(), "mix_site_src", [&] {
      using src_t = scalar_t;
      if constexpr (std::is_same_v<acc_t, double> != std::is_same_v<src_t, double>) {
        TORCH_CHECK(false, "mix_site: unsupported bank dtype");  // refused by check_bank already
      } else {
        const src_t* S_ = storage.data_ptr<src_t>();
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "mix_site_out", [&] {
          scalar_t* o_ = out.data_ptr<scalar_t>();
          at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
            std::vector<acc_t> w(n + 1);
            for (int64_t t = begin; t < end; ++t) {
              mix_token<acc_t, src_t, scalar_t>(S_ + t * C * d, inv_ + t * C, p_ + t * d, q_, n, d, (acc_t)eps,
                                                w.data(), o_ + t * d, w_out ? w_out + t * (n + 1) : nullptr);
            }
          });
        });
      }
    });
  });
  return {out, weights};
}

// One token of `push_source`: the partial rounded into row n, the inverse RMS of the rounded row.
template <typename acc_t, typename src_t>
static void push_token(const acc_t* p, int64_t d, acc_t eps, src_t* row, acc_t* inv) {
  acc_t ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) {
    row[j] = static_cast<src_t>(p[j]);
    const acc_t r = static_cast<acc_t>(row[j]);
    ss += r * r;
  }
  *inv = 1 / std::sqrt(ss / d + eps);
}

// `depth_attention.push_source` in place: row n of the bank (n < C) becomes the partial, in one pass
// instead of a cast, a norm and two writes.
void push_source(at::Tensor& storage, at::Tensor& inv_storage, int64_t n, const at::Tensor& partial, double eps) {
  check_bank("push_source", storage, inv_storage, n + 1, partial);
  const int64_t d = partial.size(-1), N = partial.numel() / std::max<int64_t>(d, 1), C = storage.size(-2);
  auto p = partial.contiguous();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "push_source_acc", [&] {
    using acc_t = scalar_t;
    const acc_t* p_ = p.data_ptr<acc_t>();
    acc_t* inv_ = inv_storage.data_ptr<acc_t>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, storage.scalar_type(), "push_source_src", [&] {
      if constexpr (std::is_same_v<acc_t, double> != std::is_same_v<scalar_t, double>) {
        TORCH_CHECK(false, "push_source: unsupported bank dtype");
      } else {
        scalar_t* S_ = storage.data_ptr<scalar_t>();
        at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
          for (int64_t t = begin; t < end; ++t) {
            push_token<acc_t, scalar_t>(p_ + t * d, d, static_cast<acc_t>(eps), S_ + (t * C + n) * d, inv_ + t * C + n);
          }
        });
      }
    });
  });
}
"""

_module = None
_ENV = os.environ.get("ATTNRES_CPU_KERNEL", "0").lower()
_enabled = _ENV in ("1", "true", "yes", "compiled")
_in_graphs = _ENV == "compiled"                       # also inside torch.compile, as `attnres::mix_site`


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


def enable_cpu_kernel(enabled: bool = True, compiled: bool = False) -> None:
    """Use the fused CPU kernel for depth attention in eager inference (builds it now if needed);
    `compiled=True` also inside `torch.compile` graphs (as the custom op `attnres::mix_site`, slower
    than Inductor's code in our measurements); `enable_cpu_kernel(False)` goes back to the torch path."""
    global _enabled, _in_graphs
    if enabled:
        _build()
    _enabled, _in_graphs = enabled, enabled and compiled


def cpu_kernel_applies(partial: Tensor) -> bool:
    """Whether a site mixing `partial` runs the fused kernel: it is enabled, the tensors are on the
    CPU, no gradient is being recorded, and this is eager code or the kernel is enabled for graphs."""
    return (_enabled and partial.device.type == "cpu" and not torch.is_grad_enabled()
            and (_in_graphs or not torch.compiler.is_compiling()))


def _mix_site_impl(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    mixed, weights = _build().mix_site(storage, inv_storage, num_stored, partial, query, gain, eps, dtype,
                                       keep_weights)
    return [mixed, weights if keep_weights else partial.new_empty(0)]      # an op returns tensors only


def _mix_site_fake(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    weights_shape = (*partial.shape[:-1], num_stored + 1) if keep_weights else (0,)
    return [partial.new_empty(partial.shape, dtype=dtype), partial.new_empty(weights_shape)]


# Registered once per process: the package and a Hub copy of this file may both be imported.
if not hasattr(torch.ops.attnres, "mix_site"):
    torch.library.custom_op("attnres::mix_site", _mix_site_impl, mutates_args=())
    torch.library.register_fake("attnres::mix_site", _mix_site_fake)


def fused_push_source(bank: DepthBank, partial: Tensor, eps: float) -> DepthBank:
    """`depth_attention.push_source` in one C++ call, in place (a bank with no room left grows by
    concatenation as in the torch function). Forward only: call it where `cpu_kernel_applies`."""
    if bank.num_stored >= bank.storage.shape[-2] or torch.compiler.is_compiling():   # compiled: fused by Inductor
        return push_source(bank, partial, eps)
    _build().push_source(bank.storage, bank.inv_storage, bank.num_stored, acc(partial), eps)
    return DepthBank(bank.storage, bank.inv_storage, bank.num_stored + 1)


def fused_mix_site(bank: DepthBank, partial: Tensor, query: Tensor, eps: float, dtype: torch.dtype,
                   keep_weights: bool = False, gain: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`depth_attention.mix_site` (same arguments, same results up to float rounding) in one C++
    call. With `gain` (the site's key-norm weight), `query` is the raw pseudo-query and the two are
    folded in C++, as `fold_queries` would. Forward only: call it where `cpu_kernel_applies`."""
    args = (bank.storage, bank.inv_storage, bank.num_stored, acc(partial), query, gain, eps, dtype, keep_weights)
    if torch.compiler.is_compiling():
        mixed, weights = torch.ops.attnres.mix_site(*args)
        return mixed, (weights if keep_weights else None)
    # Eager calls the extension directly: the op's dispatch, or one more Python frame, costs about as
    # much as a decoding site's arithmetic. Without `keep_weights` the extension returns no weights.
    return tuple((_module or _build()).mix_site(*args))
