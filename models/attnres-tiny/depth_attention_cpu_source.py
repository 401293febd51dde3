"""The C++ source of the fused CPU kernel of a sublayer boundary, which `depth_attention_cpu` compiles at
first use (`torch.utils.cpp_extension.load_inline`) and wraps.

Kept as Python strings in a sibling file so that it ships with the rest of `modeling_attnres` as Hub remote
code, and apart from the wrapper so that each reads on its own. `depth_attention_cpu`'s docstring says what
the kernel does; the tests hold it to the torch reference and the float64 oracle.
"""

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

# Row reductions with independent partial sums, shared with the benchmarks' fused Llama kernel for the same
# reason as the rounding.
LANES_CPP = r"""
// Row reductions keep kLanes partial sums (four float32 vector registers of independent chains) and add
// them up at the end: with one accumulator every add waits for the previous one, and a 576-wide row took
// 36 (float) to 72 (double) dependent adds (a warm boundary with stored sources took 1.05-1.08x as long).
constexpr int64_t kLanes = 64;

template <typename T>
static inline T lanes_total(const T* a) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t k = 0; k < kLanes; ++k) s += a[k];
  return s;
}

// f(j, k) for every element j < d of a row, k being j's lane (its partial sum): kLanes-wide vectorised
// chunks, then the tail.
template <typename F>
static inline void over_lanes(int64_t d, F&& f) {
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) f(j + k, k);
  }
  const int64_t tail = d - j;
#pragma omp simd
  for (int64_t k = 0; k < tail; ++k) f(j + k, k);
}
"""

KERNEL_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/python.h>
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
""" + ROUNDING_CPP + LANES_CPP + r"""

// sums[r] = the dot product of rows[r] (read as acc_t) and q, for R rows at once (one pass over q). With
// `ahead` > 0 it also prefetches the rows `ahead` elements on (the next token's): a token's rows are a short
// run followed by a jump, which the hardware prefetchers do not follow, and the loads of the scores waited
// on memory (a cold boundary with 4-8 stored sources took 1.2-1.3x as long without).
template <int R, typename acc_t, typename src_t>
static inline void dots(const src_t* const* rows, const acc_t* q, int64_t d, acc_t* sums, int64_t ahead) {
  acc_t a[R][kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= d; j += kLanes) {
    for (int r = 0; r < R; ++r) {
      const src_t* x = rows[r] + j;
      for (int64_t b = 0; ahead > 0 && b < int64_t(kLanes * sizeof(src_t)); b += 64)   // its cache lines
        __builtin_prefetch(reinterpret_cast<const char*>(x + ahead) + b, 0, 3);
#pragma omp simd
      for (int64_t k = 0; k < kLanes; ++k) a[r][k] += static_cast<acc_t>(x[k]) * q[j + k];
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t tail = d - j;
#pragma omp simd
    for (int64_t k = 0; k < tail; ++k) a[r][k] += static_cast<acc_t>(rows[r][j + k]) * q[j + k];
    sums[r] = lanes_total(a[r]);
  }
}

// The partial's terms of its score, p.q and p.p, into sp / ss; with `o` (T*, d elements) given, first
// p = base + o (base may be missing) into dst, in the same pass. One pass over the row, kLanes sums each.
template <typename acc_t, typename T>
static void partial_moments(const acc_t* base, const T* o, const acc_t* q, int64_t d, acc_t* dst, acc_t& sp,
                            acc_t& ss) {
  acc_t sp_[kLanes] = {}, ss_[kLanes] = {};
  over_lanes(d, [&](int64_t j, int64_t k) {
    const acc_t v = o == nullptr ? base[j] : (base ? base[j] : acc_t(0)) + static_cast<acc_t>(o[j]);
    if (o != nullptr) dst[j] = v;
    sp_[k] += v * q[j];
    ss_[k] += v * v;
  });
  sp = lanes_total(sp_);
  ss = lanes_total(ss_);
}

// f(i, rows, std::integral_constant<int, r>{}) for each group of a token's n rows (row stride d), rows
// [i, i + r) in order: groups of four, then the rest (r in [1, 4]), each group done in one pass.
template <typename src_t, typename F>
static inline void row_groups(const src_t* S, int64_t n, int64_t d, F&& f) {
  for (int64_t i = 0; i < n; i += 4) {
    const int64_t r = std::min<int64_t>(4, n - i);
    const src_t* rows[4];
    for (int64_t k = 0; k < r; ++k) rows[k] = S + (i + k) * d;
    if (r == 4) f(i, rows, std::integral_constant<int, 4>{});
    else if (r == 3) f(i, rows, std::integral_constant<int, 3>{});
    else if (r == 2) f(i, rows, std::integral_constant<int, 2>{});
    else f(i, rows, std::integral_constant<int, 1>{});
  }
}

// One token: softmax over the scores of the n stored rows (row stride d, read as acc_t, times their
// inverse RMS) and of the partial (from its moments sp = p.q, ss = p.p); the weights go to w[0..n] (the
// partial's last). `ahead`: the prefetch distance of `dots` (0: none).
template <typename acc_t, typename src_t>
static void softmax_weights(const src_t* S, const acc_t* inv, acc_t sp, acc_t ss, const acc_t* q, int64_t n,
                            int64_t d, acc_t eps, acc_t* w, int64_t ahead) {
  row_groups(S, n, d, [&](int64_t i, const src_t* const* rows, auto R) { dots<R()>(rows, q, d, w + i, ahead); });
  const acc_t v = ss / d + eps;
  w[n] = v > 0 ? sp / std::sqrt(v) : 0;             // an all-zero partial with eps = 0 scores 0 (docs/spec.md)
  acc_t m = w[n];
  for (int64_t i = 0; i < n; ++i) { w[i] *= inv[i]; m = std::max(m, w[i]); }
  acc_t z = 0;
  for (int64_t i = 0; i <= n; ++i) { w[i] = std::exp(w[i] - m); z += w[i]; }
  for (int64_t i = 0; i <= n; ++i) w[i] /= z;
}

// v = (mix, or wp * p on the first pass) + the R rows times their weights, in that order, for each element:
// into mix, or (a type Round) rounded to Round into y as float32, what the norm reads. One pass over mix.
template <int R, typename Round, typename acc_t, typename src_t>
static inline void add_rows(const src_t* const* rows, const acc_t* ws, const acc_t* p, acc_t wp, bool first,
                            int64_t d, acc_t* mix, float* y) {
#pragma omp simd
  for (int64_t j = 0; j < d; ++j) {
    acc_t v = first ? wp * p[j] : mix[j];
    for (int r = 0; r < R; ++r) v = v + ws[r] * static_cast<acc_t>(rows[r][j]);
    if constexpr (std::is_void_v<Round>) mix[j] = v;
    else y[j] = static_cast<float>(to<Round>(v));
  }
}

// The weighted sum of p and the rows, a group of up to four rows per pass over mix[0..d) (the sum's order
// unchanged); the rows of a token are still cached from the scores. The last pass writes the sum into mix, or
// with a type Round, rounded into y (`add_rows`).
template <typename Round, typename acc_t, typename src_t>
static void weighted_sum(const src_t* S, const acc_t* p, const acc_t* w, int64_t n, int64_t d, acc_t* mix, float* y) {
  row_groups(S, n, d, [&](int64_t i, const src_t* const* rows, auto R) {
    if (i + R() < n) add_rows<R(), void>(rows, w + i, p, w[n], i == 0, d, mix, y);
    else add_rows<R(), Round>(rows, w + i, p, w[n], i == 0, d, mix, y);
  });
  if (n == 0) add_rows<0, Round, acc_t, src_t>(nullptr, w, p, w[n], true, d, mix, y);
}

// The next sublayer's RMSNorm of one token's mix, rounded as transformers' `LlamaRMSNorm`, in two steps.
// `rms_row`: given y = the mix rounded to the model's dtype, as float32 (written by the weighted sum's last
// pass, which saves a pass over the mix), 1 / sqrt(mean(y^2) + eps), the float32 squares summed in double so
// that the mean rounds as torch's near-exact one. The rounding and the double sum stay separate loops: GCC
// does not vectorize them as one (a boundary took 1.7-2.2x as long).
static float rms_row(const float* y, int64_t d, float eps) {
  double ss_[kLanes] = {};
  over_lanes(d, [&](int64_t j, int64_t k) { ss_[k] += static_cast<double>(y[j] * y[j]); });
  return 1.0f / std::sqrt(static_cast<float>(lanes_total(ss_) / d) + eps);
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
  const acc_t v = ss / d + eps;
  *inv = v > 0 ? 1 / std::sqrt(v) : 0;              // an all-zero row with eps = 0 scores 0 (docs/spec.md)
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

// Shared checks: CPU tensors; `storage [*tokens, C, d]` contiguous in the accumulation dtype `acc` (float32
// or float64), or bfloat16/float16 with float32; `inv_storage [*tokens, C]` in `acc`; rows [0, rows) inside C.
// The token shape is compared, not only the count: a bank of [3, 2] tokens read for a [2, 3] partial would
// mix each token with another token's sources.
static void check_bank(const char* name, const at::Tensor& storage, const at::Tensor& inv_storage, int64_t rows,
                       at::ScalarType acc, const at::Tensor& partial) {
  const auto ps = partial.sizes(), ss = storage.sizes(), is = inv_storage.sizes();
  const size_t k = ps.size() - 1;                                   // token dims (a decoding call: ~2 ns each)
  const int64_t C = ss.size() >= 2 ? ss[ss.size() - 2] : -1;
  bool shaped = ss.size() == k + 2 && is.size() == k + 1 && ss[k + 1] == ps[k] && is[k] == C;
  for (size_t i = 0; shaped && i < k; ++i) shaped = ss[i] == ps[i] && is[i] == ps[i];
  TORCH_CHECK(storage.device().is_cpu() && inv_storage.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK((acc == at::kFloat || acc == at::kDouble) && inv_storage.scalar_type() == acc, name,
              ": the partial and inv_rms must be float32 or float64, got ", acc, " and ", inv_storage.scalar_type());
  TORCH_CHECK(storage.scalar_type() == acc || (acc == at::kFloat && (storage.scalar_type() == at::kBFloat16 ||
              storage.scalar_type() == at::kHalf)), name, ": a ", storage.scalar_type(), " bank with a ", acc,
              " partial (expected the same dtype, or a bfloat16/float16 bank with a float32 partial)");
  TORCH_CHECK(storage.is_contiguous() && inv_storage.is_contiguous(), name, ": the bank must be contiguous");
  TORCH_CHECK(0 <= rows && rows <= C && shaped, name, ": bank ", storage.sizes(), " / ", inv_storage.sizes(),
              " with ", rows, " rows does not match partial ", partial.sizes(),
              " (expected [*tokens, C, d] / [*tokens, C])");
}

// A sublayer boundary (`depth_attention.site_boundary`) for every token: p = partial + output (either may
// be missing, not both; `output` in any floating dtype), the mix of rows [0, n) and p with the query
// (folded with `gain` when given), row n <- p when `closes_block`, and RMSNorm(mix in `dtype`) with
// `norm_weight` when given. Returns {new partial, mix, normed, weights}, undefined (None) where not
// produced: no new partial when the block closes or no output was added; the mix when neither kept nor
// needed (a norm was given); the weights unless kept. With `reuse_partial` (the caller no longer reads
// `partial`) a contiguous partial is the new partial, written in place: a fresh one is not in the caches
// (cold, 13-70 us more for a 1024-token boundary at hidden 576). With `consume_output` (the caller no longer
// reads `output`) a contiguous output of the normed mix's dtype is the normed mix, written over it row by
// row after the row was read, as Llama's fused add+norm writes its input: a fresh tensor per boundary is
// memory the allocator may map afresh (page faults at long prefills).
std::vector<at::Tensor> site_boundary(at::Tensor& storage, at::Tensor& inv_storage, int64_t n,
                                      const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& output,
                                      const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                                      bool closes_block, const c10::optional<at::Tensor>& norm_weight, double norm_eps,
                                      at::ScalarType dtype, bool keep_mixed, bool keep_weights, bool reuse_partial,
                                      bool consume_output) {
  TORCH_CHECK(partial.has_value() || output.has_value(), "site_boundary: no partial and no output");
  const at::Tensor& ref = output.has_value() ? *output : *partial;
  TORCH_CHECK(ref.device().is_cpu() && query.device().is_cpu() && (!gain.has_value() || gain->device().is_cpu()) &&
              (!norm_weight.has_value() || norm_weight->device().is_cpu()), "site_boundary: CPU tensors expected");
  const int64_t d = ref.size(-1), N = ref.numel() / std::max<int64_t>(d, 1);
  const auto acc = partial.has_value() ? partial->scalar_type() : (ref.scalar_type() == at::kDouble ? at::kDouble
                                                                                                      : at::kFloat);
  check_bank("site_boundary", storage, inv_storage, n + (closes_block ? 1 : 0), acc, ref);
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
  if (new_partial) {
    const bool in_place = reuse_partial && p_in.defined() && p_in.is_same(*partial);   // contiguous: not a copy
    p_out = in_place ? p_in : at::empty(ref.sizes(), opts.dtype(acc));
  }
  if (write_mix) mixed = at::empty(ref.sizes(), opts.dtype(dtype));
  const auto norm_dtype = has_norm ? c10::promoteTypes(norm_weight->scalar_type(), dtype) : dtype;
  if (has_norm) {
    const bool into_output = consume_output && has_output && o_in.is_same(*output) && o_in.scalar_type() == norm_dtype;
    normed = into_output ? o_in : at::empty(ref.sizes(), opts.dtype(norm_dtype));
  }
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
          acc_t sp, ss;  // p.q and p.p
          if (has_output) {
            acc_t* dst = new_partial ? p_out_ + t * d : pbuf.data();
            const acc_t* base = p_in_ ? p_in_ + t * d : nullptr;
            with_dtype(o_in.scalar_type(), [&](auto tag) {
              using T = decltype(tag);
              partial_moments<acc_t, T>(base, o_in.data_ptr<T>() + t * d, q.data(), d, dst, sp, ss);
            });
            p = dst;
          } else {
            partial_moments<acc_t, acc_t>(p, nullptr, q.data(), d, nullptr, sp, ss);
          }
          softmax_weights<acc_t, src_t>(S_ + t * C * d, inv_ + t * C, sp, ss, q.data(), n, d, (acc_t)eps, w.data(),
                                        t + 1 < end ? C * d : 0);
          if (w_out) std::copy(w.begin(), w.end(), w_out + t * (n + 1));
          const src_t* S_t = S_ + t * C * d;
          if (write_mix) {  // the mix in `dtype`
            weighted_sum<void>(S_t, p, w.data(), n, d, mix.data(), nullptr);
            with_dtype(dtype, [&](auto tag) {
              using T = decltype(tag);
              T* m = mixed.data_ptr<T>() + t * d;
              float* y_ = has_norm ? y.data() : nullptr;  // the rounded mix is also what the norm reads
_Pragma("omp simd")
              for (int64_t j = 0; j < d; ++j) {
                const T r = to<T>(mix[j]);
                m[j] = r;
                if (y_) y_[j] = static_cast<float>(r);
              }
            });
          } else if (has_norm) {  // the mix rounded to `dtype` straight into y by the sum's last pass
            with_dtype(dtype, [&](auto tag) {
              weighted_sum<decltype(tag)>(S_t, p, w.data(), n, d, mix.data(), y.data());
            });
          }
          if (closes_block) push_token<acc_t, src_t>(p, d, (acc_t)eps, S_ + (t * C + n) * d, inv_ + t * C + n);
          if (!has_norm) continue;
          with_dtype(dtype, [&](auto tag) {  // the norm, float32 whatever the dtype
            using T = decltype(tag);
            const float rs = rms_row(y.data(), d, neps);
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

// The ops `attnres::site_boundary[_store|_reuse][_into]` (schemas defined from Python), as compiled graphs call
// them, with few scalars (a boxed call converts each Python scalar, ~0.15 us apiece): what the op writes is its
// name, the mix is in the query's dtype, and only what the models read is returned (a compiled call that keeps
// the weights or the mix runs the torch reference). `_store` (Closes) stores the block in the bank, `_reuse`
// (Reuse) writes the new partial into `partial`, `_into` (Into) writes the normed mix over `output`: each
// argument an op writes is one its caller no longer reads, and its schema declares the write. An op returns
// what it wrote nowhere: `site_boundary` {the new partial, or an empty tensor where none is produced; the
// normed mix, or the mix without a norm}, `_store` and `_reuse` the normed mix, `_into` the new partial, and
// `_store_into` and `_reuse_into` nothing.
template <bool Closes, bool Reuse, bool Into>
static auto boundary_op(const at::Tensor& storage, const at::Tensor& inv_storage, int64_t n,
                        const c10::optional<at::Tensor>& partial, const c10::optional<at::Tensor>& output,
                        const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                        const c10::optional<at::Tensor>& norm_weight, double norm_eps) {
  TORCH_CHECK(!Reuse || (partial.has_value() && output.has_value()),
              "site_boundary_reuse[_into]: a partial and an output are needed");
  if constexpr (Into) {
    TORCH_CHECK(output.has_value() && norm_weight.has_value(),
                "site_boundary[_store|_reuse]_into: an output and a norm weight are needed");
    const auto normed_dtype = c10::promoteTypes(norm_weight->scalar_type(), query.scalar_type());
    TORCH_CHECK(output->scalar_type() == normed_dtype, "site_boundary[_store|_reuse]_into: the output is ",
                output->scalar_type(), " but the normed mix is ", normed_dtype,
                "; call attnres::site_boundary instead");
  }
  at::Tensor s = storage, i = inv_storage;  // written only when the block closes
  auto r = site_boundary(s, i, n, partial, output, query, gain, eps, Closes, norm_weight, norm_eps,
                         query.scalar_type(), false, false, Reuse, Into);
  if (Reuse && !r[0].is_same(*partial)) partial->copy_(r[0]);  // a partial that was not contiguous
  if (Into && !r[2].is_same(*output)) output->copy_(r[2]);     // an output that was not contiguous
  if constexpr (Into && (Closes || Reuse)) {
    return;
  } else if constexpr (Into) {
    return r[0];  // the new partial (an output was added)
  } else if constexpr (Closes || Reuse) {
    return norm_weight.has_value() ? r[2] : r[1];
  } else {
    return std::tuple<at::Tensor, at::Tensor>(r[0].defined() ? r[0] : at::empty({0}, inv_storage.options()),
                                              norm_weight.has_value() ? r[2] : r[1]);
  }
}

// Registers the six ops' CPU kernels with the dispatcher (once per process): a compiled graph then calls
// the C++ directly, with no Python in between.
void register_ops() {
  static torch::Library* lib = nullptr;  // lives as long as the process
  if (lib != nullptr) return;
  lib = new torch::Library(torch::Library::IMPL, "attnres", c10::DispatchKey::CPU, __FILE__, __LINE__);
  lib->impl("site_boundary", TORCH_FN((boundary_op<false, false, false>)));
  lib->impl("site_boundary_store", TORCH_FN((boundary_op<true, false, false>)));
  lib->impl("site_boundary_reuse", TORCH_FN((boundary_op<false, true, false>)));
  lib->impl("site_boundary_into", TORCH_FN((boundary_op<false, false, true>)));
  lib->impl("site_boundary_store_into", TORCH_FN((boundary_op<true, false, true>)));
  lib->impl("site_boundary_reuse_into", TORCH_FN((boundary_op<false, true, true>)));
}

// `depth_attention.mix_site`: the boundary without an output to add, a block to close or a norm.
std::vector<at::Tensor> mix_site(at::Tensor& storage, at::Tensor& inv_storage, int64_t n, const at::Tensor& partial,
                                 const at::Tensor& query, const c10::optional<at::Tensor>& gain, double eps,
                                 at::ScalarType dtype, bool keep_weights) {
  auto out = site_boundary(storage, inv_storage, n, partial, c10::nullopt, query, gain, eps, false, c10::nullopt, 0.0,
                           dtype, true, keep_weights, false, false);
  return {out[1], out[3]};
}

// `depth_attention.push_source` in place: row n of the bank (n < C) becomes the partial, in one pass
// instead of a cast, a norm and two writes.
void push_source(at::Tensor& storage, at::Tensor& inv_storage, int64_t n, const at::Tensor& partial, double eps) {
  const int64_t d = partial.size(-1), N = partial.numel() / std::max<int64_t>(d, 1);
  TORCH_CHECK(partial.device().is_cpu(), "push_source: CPU tensors expected");
  check_bank("push_source", storage, inv_storage, n + 1, partial.scalar_type(), partial);
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
