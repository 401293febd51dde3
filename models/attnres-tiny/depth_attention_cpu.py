"""A fused C++ CPU kernel for a sublayer boundary (`depth_attention.site_boundary`), for inference.

In eager PyTorch a depth-attention site is about twenty small tensor operations, each paying
dispatch overhead whatever its size; at one decoded token that overhead is most of the site's cost,
and Llama does not pay it (README, "Performance"). This kernel does a whole sublayer boundary in one
call, per token in one pass over its bank row: the sublayer output added into the partial, the
scores, softmax and weighted sum (a bfloat16/float16 bank read as float32, the key-norm gain folded
into the query), the block store in place when the site closes one, and the next sublayer's RMSNorm
of the mix (rounded as transformers' `LlamaRMSNorm`). `mix_site` and `push_source` are the same
kernel's parts on their own, for callers that still run them separately.

It is a sibling backend of the torch functions, not a second definition: `depth_attention` stays
the reference (the tests hold this kernel to it and to the float64 oracle) and the only path under
autograd and on other devices. The kernel is on by default: it is built from the source below with
`torch.utils.cpp_extension.load_inline` at first use (a C++ compiler and ninja are needed; about 35 s
on 2 cores, logged in one line, then cached in torch's extensions directory). Where it cannot be
built, one line says so and depth attention stays on the torch path (same results). It is turned off
by `ATTNRES_CPU_KERNEL=0` or `enable_cpu_kernel(False)`.

Inside `torch.compile` the sites are left to Inductor's generated code unless asked for with
`enable_cpu_kernel(compiled=True)` / `ATTNRES_CPU_KERNEL=compiled`: then they run as the custom ops
`attnres::mix_site` / `attnres::site_boundary` (with fake implementations for tracing). In
transformers' compiled decoding the ops measured no faster than Inductor's code, so graphs do not use
them by default; `attnres-serve` turns them on for vLLM's graphs, where they measured faster
(docs/performance.md).
"""

import contextlib
import hashlib
import logging
import os
import platform
import time

import torch
from torch import Tensor

from .depth_attention import DepthBank, SiteBoundary, acc, fold_queries, push_source, site_boundary

logger = logging.getLogger(__name__)

# `to<T>(v)` in C++: v in T, rounded to nearest even. Kept apart so that the benchmarks' fused Llama kernel
# (bench/fused_llama.py) rounds exactly as this one does.
ROUNDING_CPP = r"""
// `v` in T, rounded to nearest even: for bfloat16 the bits by hand (c10's rounding, without its branch, so
// that loops of it vectorize).
template <typename T, typename S>
static inline T to(S v) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<S, float>) {
    uint32_t b;
    std::memcpy(&b, &v, sizeof(b));
    const uint16_t bits = v != v ? uint16_t(0x7FC0) : static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    return c10::BFloat16(bits, c10::BFloat16::from_bits());
  } else {
    return static_cast<T>(v);
  }
}
"""

_SOURCE = r"""
#include <torch/extension.h>
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

// `f(T{})` with T the C++ type of a floating dtype: row-level code chooses its element type at run time,
// so that only the bank reader is a template over (accumulation, bank) types.
template <typename F>
static void with_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kDouble: f(double{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, "attnres: unsupported dtype ", t);
  }
}
""" + ROUNDING_CPP + r"""
// One token: softmax over the scores of the n stored rows (row stride d, read as acc_t, times their
// inverse RMS) and of the partial p; the weights go to w[0..n] (the partial's last).
template <typename acc_t, typename src_t>
static void softmax_weights(const src_t* S, const acc_t* inv, const acc_t* p, const acc_t* q, int64_t n, int64_t d,
                            acc_t eps, acc_t* w) {
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
}

// The weighted sum of the rows and p into mix[0..d), four rows per pass over mix (one load and store of it
// per four rows, the sum's order unchanged); the rows of a token are still cached from the scores.
template <typename acc_t, typename src_t>
static void weighted_sum(const src_t* S, const acc_t* p, const acc_t* w, int64_t n, int64_t d, acc_t* mix) {
  const acc_t wp = w[n];
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) mix[j] = wp * p[j];
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const src_t *r0 = S + i * d, *r1 = r0 + d, *r2 = r1 + d, *r3 = r2 + d;
    const acc_t w0 = w[i], w1 = w[i + 1], w2 = w[i + 2], w3 = w[i + 3];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j)
      mix[j] = mix[j] + w0 * static_cast<acc_t>(r0[j]) + w1 * static_cast<acc_t>(r1[j]) +
               w2 * static_cast<acc_t>(r2[j]) + w3 * static_cast<acc_t>(r3[j]);
  }
  for (; i < n; ++i) {
    const src_t* r0 = S + i * d;
    const acc_t w0 = w[i];
#pragma omp simd
    for (int64_t j = 0; j < d; ++j) mix[j] += w0 * static_cast<acc_t>(r0[j]);
  }
}

// The next sublayer's RMSNorm of one token's mix, rounded as transformers' `LlamaRMSNorm`, in two steps.
// `rms_row`: y = the mix rounded to T (the model's dtype), as float32; returns 1 / sqrt(mean(y^2) + eps),
// the float32 squares summed in double so that the mean rounds as torch's near-exact one. The rounding and
// the double sum are separate loops: GCC does not vectorize them as one (a boundary took 1.7x as long).
template <typename T, typename acc_t>
static float rms_row(const acc_t* mix, int64_t d, float eps, float* y) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) y[j] = static_cast<float>(to<T>(mix[j]));
  double ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) ss += static_cast<double>(y[j] * y[j]);
  return 1.0f / std::sqrt(static_cast<float>(ss / d) + eps);
}

// `scale_row`: out = weight * (y * rs rounded to T), in the promoted dtype To; the weight is float, or double
// for a double result (w_t).
template <typename T, typename To, typename w_t>
static void scale_row(const float* y, float rs, const w_t* weight, int64_t d, To* out) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) out[j] = to<To>(weight[j] * static_cast<w_t>(static_cast<float>(to<T>(y[j] * rs))));
}

// `push_source` for one token: p rounded into the bank row, the inverse RMS of the rounded row.
template <typename acc_t, typename src_t>
static void push_token(const acc_t* p, int64_t d, acc_t eps, src_t* row, acc_t* inv) {
  acc_t ss = 0;
#pragma omp simd reduction(+ : ss)
  for (int64_t j = 0; j < d; ++j) {
    row[j] = to<src_t>(p[j]);
    const acc_t r = static_cast<acc_t>(row[j]);
    ss += r * r;
  }
  *inv = 1 / std::sqrt(ss / d + eps);
}

// `x` (any floating dtype, d elements) into acc_t numbers, or multiplied into them.
template <typename acc_t>
static void read_as(const at::Tensor& x, acc_t* out, bool multiply) {
  auto xc = x.contiguous();
  const int64_t d = xc.numel();
  with_dtype(xc.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* src = xc.data_ptr<T>();
    for (int64_t j = 0; j < d; ++j) out[j] = (multiply ? out[j] : acc_t(1)) * static_cast<acc_t>(src[j]);
  });
}

// Shared checks: CPU tensors; `storage [N, C, d]` contiguous in the accumulation dtype `acc` (float32 or
// float64), or bfloat16/float16 with float32; `inv_storage [N, C]` in `acc`; rows [0, rows) inside C.
static void check_bank(const char* name, const at::Tensor& storage, const at::Tensor& inv_storage, int64_t rows,
                       at::ScalarType acc, int64_t N, int64_t d) {
  const int64_t C = storage.dim() >= 2 ? storage.size(-2) : -1;
  TORCH_CHECK(storage.device().is_cpu() && inv_storage.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK((acc == at::kFloat || acc == at::kDouble) && inv_storage.scalar_type() == acc, name,
              ": the partial and inv_rms must be float32 or float64, got ", acc, " and ", inv_storage.scalar_type());
  TORCH_CHECK(storage.scalar_type() == acc || (acc == at::kFloat && (storage.scalar_type() == at::kBFloat16 ||
              storage.scalar_type() == at::kHalf)), name, ": a ", storage.scalar_type(), " bank with a ", acc,
              " partial (expected the same dtype, or a bfloat16/float16 bank with a float32 partial)");
  TORCH_CHECK(storage.is_contiguous() && inv_storage.is_contiguous(), name, ": the bank must be contiguous");
  TORCH_CHECK(0 <= rows && rows <= C && storage.numel() == N * C * d && inv_storage.numel() == N * C, name,
              ": bank ", storage.sizes(), " / ", inv_storage.sizes(), " with ", rows, " rows does not match partial [",
              N, " tokens, ", d, "]");
}

// A sublayer boundary (`depth_attention.site_boundary`) for every token: p = partial + output (either may
// be missing, not both; `output` in any floating dtype), the mix of rows [0, n) and p with the query
// (folded with `gain` when given), row n <- p when `closes_block`, and RMSNorm(mix in `dtype`) with
// `norm_weight` when given. Returns {new partial, mix, normed, weights}, undefined (None) where not
// produced: no new partial when the block closes or no output was added; the mix when neither kept nor
// needed (a norm was given); the weights unless kept.
std::vector<at::Tensor> site_boundary(at::Tensor& storage, at::Tensor& inv_storage, int64_t n,
                                      const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& output,
                                      const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                                      bool closes_block, const c10::optional<at::Tensor>& norm_weight, double norm_eps,
                                      at::ScalarType dtype, bool keep_mixed, bool keep_weights) {
  TORCH_CHECK(partial.has_value() || output.has_value(), "site_boundary: no partial and no output");
  const at::Tensor& ref = output.has_value() ? *output : *partial;
  TORCH_CHECK(ref.device().is_cpu() && query.device().is_cpu() && (!gain.has_value() || gain->device().is_cpu()) &&
              (!norm_weight.has_value() || norm_weight->device().is_cpu()), "site_boundary: CPU tensors expected");
  const int64_t d = ref.size(-1), N = ref.numel() / std::max<int64_t>(d, 1);
  const auto acc = partial.has_value() ? partial->scalar_type() : (ref.scalar_type() == at::kDouble ? at::kDouble
                                                                                                      : at::kFloat);
  check_bank("site_boundary", storage, inv_storage, n + (closes_block ? 1 : 0), acc, N, d);
  const int64_t C = storage.size(-2);
  TORCH_CHECK(!partial.has_value() || !output.has_value() || partial->sizes() == output->sizes(),
              "site_boundary: partial ", partial->sizes(), " and output ", ref.sizes(), " differ");
  TORCH_CHECK(query.numel() == d && (!gain.has_value() || gain->numel() == d) &&
              (!norm_weight.has_value() || norm_weight->numel() == d), "site_boundary: query ", query.sizes(),
              " does not match partial ", ref.sizes());
  const bool has_output = output.has_value(), has_norm = norm_weight.has_value();
  const bool new_partial = has_output && !closes_block, write_mix = keep_mixed || !has_norm;
  at::Tensor p_in = partial.has_value() ? partial->contiguous() : at::Tensor();
  at::Tensor o_in = has_output ? output->contiguous() : at::Tensor();
  auto opts = ref.options();
  at::Tensor p_out, mixed, normed, weights;  // undefined unless produced
  if (new_partial) p_out = at::empty(ref.sizes(), opts.dtype(acc));
  if (write_mix) mixed = at::empty(ref.sizes(), opts.dtype(dtype));
  const auto norm_dtype = has_norm ? c10::promoteTypes(norm_weight->scalar_type(), dtype) : dtype;
  if (has_norm) normed = at::empty(ref.sizes(), opts.dtype(norm_dtype));
  auto weight_sizes = ref.sizes().vec();
  weight_sizes.back() = n + 1;
  if (keep_weights) weights = at::empty(weight_sizes, opts.dtype(acc));
  std::vector<float> nwf(has_norm ? d : 0);   // the norm weight, exact (as float, or double for float64 results)
  std::vector<double> nwd(has_norm && norm_dtype == at::kDouble ? d : 0);
  if (has_norm) (norm_dtype == at::kDouble ? read_as<double>(*norm_weight, nwd.data(), false)
                                           : read_as<float>(*norm_weight, nwf.data(), false));
  const float neps = static_cast<float>(norm_eps);  // the norm is float32 whatever the dtype, as in transformers
  AT_DISPATCH_FLOATING_TYPES(acc, "site_boundary_acc", [&] {  // (inside a macro: _Pragma, not #pragma)
    using acc_t = scalar_t;
    std::vector<acc_t> q(d);
    read_as<acc_t>(query, q.data(), false);
    if (gain.has_value()) read_as<acc_t>(*gain, q.data(), true);
    acc_t* inv_ = inv_storage.data_ptr<acc_t>();
    const acc_t* p_in_ = p_in.defined() ? p_in.data_ptr<acc_t>() : nullptr;
    acc_t* p_out_ = new_partial ? p_out.data_ptr<acc_t>() : nullptr;
    acc_t* w_out = keep_weights ? weights.data_ptr<acc_t>() : nullptr;
    auto run = [&](auto src_tag) {
      using src_t = decltype(src_tag);
      src_t* S_ = storage.data_ptr<src_t>();
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        std::vector<acc_t> pbuf(new_partial || !has_output ? 0 : d), mix(d), w(n + 1);
        std::vector<float> y(has_norm ? d : 0);
        for (int64_t t = begin; t < end; ++t) {
          const acc_t* p = has_output ? nullptr : p_in_ + t * d;
          if (has_output) {
            acc_t* dst = new_partial ? p_out_ + t * d : pbuf.data();
            const acc_t* base = p_in_ ? p_in_ + t * d : nullptr;
            with_dtype(o_in.scalar_type(), [&](auto tag) {
              using T = decltype(tag);
              const T* o = o_in.data_ptr<T>() + t * d;
              if (base) {
_Pragma("omp simd")
                for (int64_t j = 0; j < d; ++j) dst[j] = base[j] + static_cast<acc_t>(o[j]);
              } else {
_Pragma("omp simd")
                for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<acc_t>(o[j]);
              }
            });
            p = dst;
          }
          softmax_weights<acc_t, src_t>(S_ + t * C * d, inv_ + t * C, p, q.data(), n, d, (acc_t)eps, w.data());
          if (w_out) std::copy(w.begin(), w.end(), w_out + t * (n + 1));
          weighted_sum<acc_t, src_t>(S_ + t * C * d, p, w.data(), n, d, mix.data());
          if (closes_block) push_token<acc_t, src_t>(p, d, (acc_t)eps, S_ + (t * C + n) * d, inv_ + t * C + n);
          if (write_mix) {
            with_dtype(dtype, [&](auto tag) {  // the mix in `dtype`
              using T = decltype(tag);
              T* m = mixed.data_ptr<T>() + t * d;
_Pragma("omp simd")
              for (int64_t j = 0; j < d; ++j) m[j] = to<T>(mix[j]);
            });
          }
          if (!has_norm) continue;
          with_dtype(dtype, [&](auto tag) {  // the norm reads the mix rounded to `dtype`, as float32
            using T = decltype(tag);
            const float rs = rms_row<T, acc_t>(mix.data(), d, neps, y.data());
            with_dtype(norm_dtype, [&](auto out_tag) {  // times the weight, in the promoted dtype
              using To = decltype(out_tag);
              To* o = normed.data_ptr<To>() + t * d;
              if constexpr (std::is_same_v<To, double>) scale_row<T, To, double>(y.data(), rs, nwd.data(), d, o);
              else scale_row<T, To, float>(y.data(), rs, nwf.data(), d, o);
            });
          });
        }
      });
    };
    if constexpr (std::is_same_v<acc_t, double>) {
      run(double{});
    } else {
      switch (storage.scalar_type()) {
        case at::kBFloat16: run(c10::BFloat16{}); break;
        case at::kHalf: run(c10::Half{}); break;
        default: run(float{});
      }
    }
  });
  return {p_out, mixed, normed, weights};
}

// The ops `attnres::site_boundary` / `attnres::site_boundary_store` (schemas defined from Python), as compiled
// graphs call them, with few scalars (a boxed call converts each Python scalar, ~0.15 us apiece): whether the
// block closes is the op's name, the mix is in the query's dtype, and only what the models read is returned
// (a compiled call that keeps the weights or the mix runs the torch reference). The first returns {new
// partial, or an empty tensor where none is produced; the normed mix, or the mix without a norm}; the
// second stores the block in the bank and returns the normed mix alone.
static at::Tensor result(std::vector<at::Tensor>& r, bool has_norm) { return has_norm ? r[2] : r[1]; }

static std::tuple<at::Tensor, at::Tensor> boundary_op(const at::Tensor& storage, const at::Tensor& inv_storage,
                                                      int64_t n, const c10::optional<at::Tensor>& partial,
                                                      const c10::optional<at::Tensor>& output, const at::Tensor& query,
                                                      const c10::optional<at::Tensor>& gain, double eps,
                                                      const c10::optional<at::Tensor>& norm_weight, double norm_eps) {
  at::Tensor s = storage, i = inv_storage;  // not written: the site does not close a block
  auto r = site_boundary(s, i, n, partial, output, query, gain, eps, false, norm_weight, norm_eps,
                         query.scalar_type(), false, false);
  return {r[0].defined() ? r[0] : at::empty({0}, query.options()), result(r, norm_weight.has_value())};
}

static at::Tensor boundary_store_op(at::Tensor& storage, at::Tensor& inv_storage, int64_t n,
                                    const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& output,
                                    const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                                    const c10::optional<at::Tensor>& norm_weight, double norm_eps) {
  auto r = site_boundary(storage, inv_storage, n, partial, output, query, gain, eps, true, norm_weight, norm_eps,
                         query.scalar_type(), false, false);
  return result(r, norm_weight.has_value());
}

// Registers the two ops' CPU kernels with the dispatcher (once per process): a compiled graph then calls
// the C++ directly, with no Python in between.
void register_ops() {
  static torch::Library* lib = nullptr;  // lives as long as the process
  if (lib != nullptr) return;
  lib = new torch::Library(torch::Library::IMPL, "attnres", c10::DispatchKey::CPU, __FILE__, __LINE__);
  lib->impl("site_boundary", TORCH_FN(boundary_op));
  lib->impl("site_boundary_store", TORCH_FN(boundary_store_op));
}

// `depth_attention.mix_site`: the boundary without an output to add, a block to close or a norm.
std::vector<at::Tensor> mix_site(at::Tensor& storage, at::Tensor& inv_storage, int64_t n, const at::Tensor& partial,
                                 const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                                 at::ScalarType dtype, bool keep_weights) {
  auto out = site_boundary(storage, inv_storage, n, partial, c10::nullopt, query, gain, eps, false, c10::nullopt, 0.0,
                           dtype, true, keep_weights);
  return {out[1], out[3]};
}

// `depth_attention.push_source` in place: row n of the bank (n < C) becomes the partial, in one pass
// instead of a cast, a norm and two writes.
void push_source(at::Tensor& storage, at::Tensor& inv_storage, int64_t n, const at::Tensor& partial, double eps) {
  const int64_t d = partial.size(-1), N = partial.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(partial.device().is_cpu(), "push_source: CPU tensors expected");
  check_bank("push_source", storage, inv_storage, n + 1, partial.scalar_type(), N, d);
  const int64_t C = storage.size(-2);
  auto p = partial.contiguous();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "push_source_acc", [&] {
    using acc_t = scalar_t;
    const acc_t* p_ = p.data_ptr<acc_t>();
    acc_t* inv_ = inv_storage.data_ptr<acc_t>();
    with_dtype(storage.scalar_type(), [&](auto tag) {
      using src_t = decltype(tag);
      src_t* S_ = storage.data_ptr<src_t>();
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) push_token<acc_t, src_t>(p_ + t * d, d, (acc_t)eps, S_ + (t * C + n) * d,
                                                                          inv_ + t * C + n);
      });
    });
  });
}
"""

_module = None
_OFF = ("0", "false", "no", "off")
_ENV = os.environ.get("ATTNRES_CPU_KERNEL", "auto").strip().lower()
_enabled = _ENV not in _OFF                           # the default ("auto"): on where it can be built
_in_graphs = _ENV == "compiled"                       # also inside torch.compile, as the `attnres::` ops


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


@contextlib.contextmanager
def _build_lock(build_dir: str):
    """Held while building: an OS lock (released by the OS when its holder dies), so that a lock file
    torch's builder left behind in a killed process (torch would wait on it forever) is known stale."""
    try:
        import fcntl
    except ImportError:                               # not POSIX: torch's own lock file only
        yield
        return
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, "attnres.lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(build_dir, "lock"))   # any build that held it is dead: we hold the OS lock
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def compiler_flags() -> tuple[list[str], list[str]]:
    """The compile and link flags of the kernel (`load_inline`'s `extra_cflags`, `extra_ldflags`): for
    this CPU, OpenMP where the compiler has it."""
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
    return flags, ldflags


def _build():
    """Compile (or load from torch's extension cache) the kernel module; one line of log when compiled."""
    global _module
    if _module is None:
        import torch.utils.cpp_extension as cpp_extension

        flags, ldflags = compiler_flags()
        name, start = _extension_name(), time.perf_counter()
        try:
            build_dir = cpp_extension._get_build_directory(name, False)      # where load_inline builds it
            with _build_lock(build_dir):
                functions = ["site_boundary", "mix_site", "push_source", "register_ops"]
                module = cpp_extension.load_inline(name, cpp_sources=_SOURCE, functions=functions, extra_cflags=flags,
                                                   extra_ldflags=ldflags, build_directory=build_dir)
        except Exception as error:  # compiler missing, ninja missing, headers missing, ...
            raise RuntimeError(
                f"Could not build the AttnRes CPU kernel ({type(error).__name__}: {error}). It needs a C++ "
                "compiler (g++ or clang++) and `ninja` (pip install ninja); without them turn it off "
                "(ATTNRES_CPU_KERNEL=0): the torch path computes the same thing."
            ) from error
        seconds = time.perf_counter() - start
        if seconds > 5:                               # compiled now, not loaded from the cache
            logger.warning("AttnRes: built the fused C++ CPU kernel for depth attention in %.0f s (cached in %s; "
                           "ATTNRES_CPU_KERNEL=0 turns it off)", seconds, build_dir)
        _module = module
    return _module


def _first_use() -> bool:
    """The default path's first call: build or load the kernel; where that fails, say so in one line and
    stay on the torch path for the rest of the process (no exception reaches the caller)."""
    global _enabled
    try:
        _build()
    except Exception as error:                        # whatever it is, the torch path still works
        _enabled = False
        cause = str(error.__cause__ or error).strip().splitlines()
        logger.warning("AttnRes: the fused C++ CPU kernel could not be built (%s: %s); depth attention runs on "
                       "the torch path (same results, slower eager decoding). It needs a C++ compiler and ninja "
                       "(pip install ninja); ATTNRES_CPU_KERNEL=0 silences this.",
                       type(error.__cause__ or error).__name__, (cause[0] if cause else "")[:200])
        return False
    return True


def enable_cpu_kernel(enabled: bool = True, compiled: bool = False) -> None:
    """Turn the fused CPU kernel on (the default; this builds it now and raises if it cannot) or off
    (`enable_cpu_kernel(False)`: every site on the torch path). `compiled=True` also runs it inside
    `torch.compile` graphs (as the custom ops `attnres::site_boundary` / `attnres::mix_site`, slower than
    Inductor's code in our measurements)."""
    global _enabled, _in_graphs
    if enabled:
        _build()
    _enabled, _in_graphs = enabled, enabled and compiled


def cpu_kernel_applies(partial: Tensor) -> bool:
    """Whether a site mixing `partial` runs the fused kernel: it is enabled (the default), the tensors
    are on the CPU, no gradient is being recorded, and this is eager code or the kernel is enabled for
    graphs. The first `True` builds the kernel (or finds that it cannot: then `False` from then on)."""
    if not _enabled or partial.device.type != "cpu" or torch.is_grad_enabled():
        return False
    if torch.compiler.is_compiling():
        return _in_graphs                             # built by then: enable_cpu_kernel(), or at import (env)
    return _module is not None or _first_use()


def _mix_site_impl(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    mixed, weights = _build().mix_site(storage, inv_storage, num_stored, partial, query, gain, eps, dtype,
                                       keep_weights)
    return [mixed, weights if keep_weights else partial.new_empty(0)]      # an op returns tensors only


def _mix_site_fake(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor, query: Tensor,
                   gain: Tensor | None, eps: float, dtype: torch.dtype, keep_weights: bool) -> list[Tensor]:
    weights_shape = (*partial.shape[:-1], num_stored + 1) if keep_weights else (0,)
    return [partial.new_empty(partial.shape, dtype=dtype), partial.new_empty(weights_shape)]


if not hasattr(torch.ops.attnres, "mix_site"):      # once per process (the package and a Hub copy may both load)
    torch.library.custom_op("attnres::mix_site", _mix_site_impl, mutates_args=())
    torch.library.register_fake("attnres::mix_site", _mix_site_fake)

_SIGNATURE = ("({storage}, {inv_storage}, int num_stored, Tensor? partial, Tensor? output, Tensor query, "
              "Tensor? gain, float eps, Tensor? norm_weight, float norm_eps) -> {returns}")


def _boundary_fake(storage: Tensor, inv_storage: Tensor, num_stored: int, partial: Tensor | None,
                   output: Tensor | None, query: Tensor, gain: Tensor | None, eps: float,
                   norm_weight: Tensor | None, norm_eps: float) -> tuple[Tensor, Tensor]:
    """`attnres::site_boundary`'s results, shapes and dtypes only: (new partial or `[0]`, the normed mix)."""
    ref = partial if output is None else output
    dtype = query.dtype if norm_weight is None else torch.promote_types(norm_weight.dtype, query.dtype)
    return (ref.new_empty(ref.shape if output is not None else (0,), dtype=inv_storage.dtype),
            ref.new_empty(ref.shape, dtype=dtype))


def _boundary_store_fake(*args) -> Tensor:
    """`attnres::site_boundary_store`'s result: the normed mix (the block goes into the bank)."""
    return _boundary_fake(*args)[1]


def _boundary_first_call(name: str):
    """The ops' kernel until the C++ one is registered: builds (or loads) the extension, registers its CPU
    kernels with the dispatcher, which take precedence from then on, and calls the op again."""
    def first_call(*args):
        _build().register_ops()
        return getattr(torch.ops.attnres, name)(*args)
    return first_call


# Registered once per process: the package and a Hub copy of this file may both be imported. The
# boundary is two ops, so that only the one that stores a block declares (and does) a write to the bank.
# Schemas and fake implementations are defined here, the CPU kernels in C++ (`register_ops`), so a
# compiled graph calls the C++ without a Python hop; until the extension is loaded a Python kernel for
# any backend (CompositeExplicitAutograd, below the CPU kernel in precedence) loads it.
if not hasattr(torch.ops.attnres, "site_boundary"):
    _LIBRARY = torch.library.Library("attnres", "FRAGMENT")  # a registration lives as long as its Library
    for _name, _mutable, _returns, _fake in (("site_boundary", "", "(Tensor, Tensor)", _boundary_fake),
                                             ("site_boundary_store", "(a!)", "Tensor", _boundary_store_fake)):
        _LIBRARY.define(_name + _SIGNATURE.format(storage=f"Tensor{_mutable} storage",
                                                  inv_storage=f"Tensor{_mutable and '(b!)'} inv_storage",
                                                  returns=_returns))
        torch.library.register_fake(f"attnres::{_name}", _fake)
        _LIBRARY.impl(_name, _boundary_first_call(_name), "CompositeExplicitAutograd")


if _in_graphs:          # ATTNRES_CPU_KERNEL=compiled: graphs are traced before any eager call could build it
    _first_use()


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


def fused_site_boundary(bank: DepthBank, partial: Tensor | None, output: Tensor | None, query: Tensor, eps: float,
                        closes_block: bool, norm_weight: Tensor | None, norm_eps: float, dtype: torch.dtype,
                        keep_weights: bool = False, keep_mixed: bool = False,
                        gain: Tensor | None = None) -> SiteBoundary:
    """`depth_attention.site_boundary` (same arguments, same results up to float rounding) in one C++
    call; the block, when the site closes one, is stored in place. With `gain` (the site's key-norm
    weight), `query` is the raw pseudo-query, folded in C++. Forward only: call it where
    `cpu_kernel_applies`."""
    n = bank.num_stored
    no_room = closes_block and n >= bank.storage.shape[-2]              # the reference grows the bank
    # The ops return only what the models read, in the query's dtype: other compiled calls take the reference.
    not_the_models = torch.compiler.is_compiling() and (keep_weights or keep_mixed or dtype != query.dtype)
    if no_room or not_the_models:
        query = query if gain is None else fold_queries(query, gain[None])[0]
        return site_boundary(bank, partial, output, query, eps, closes_block, norm_weight, norm_eps, dtype,
                             keep_weights, keep_mixed)
    if output is None and partial.dtype not in (torch.float32, torch.float64):
        partial, output = None, partial                # the embedding: read (as the output) in float32
    if torch.compiler.is_compiling():
        args = (bank.storage, bank.inv_storage, n, partial, output, query, gain, eps, norm_weight, norm_eps)
        if closes_block:
            new_partial, result = None, torch.ops.attnres.site_boundary_store(*args)
        else:
            new_partial, result = torch.ops.attnres.site_boundary(*args)
            new_partial = new_partial if output is not None else None
        mixed, normed, weights = (result, None, None) if norm_weight is None else (None, result, None)
    else:
        # Eager calls the extension directly (see `fused_mix_site`); what it does not produce is None.
        new_partial, mixed, normed, weights = (_module or _build()).site_boundary(
            bank.storage, bank.inv_storage, n, partial, output, query, gain, eps, closes_block, norm_weight, norm_eps,
            dtype, keep_mixed, keep_weights)
    if closes_block:
        return SiteBoundary(DepthBank(bank.storage, bank.inv_storage, n + 1), None, mixed, normed, weights)
    return SiteBoundary(bank, partial if new_partial is None else new_partial, mixed, normed, weights)
