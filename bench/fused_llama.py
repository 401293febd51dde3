"""A transformers Llama whose residual adds are fused into the next RMSNorm: the baseline with the same
residual-path fusion as AttnRes's C++ boundary kernel (`bench_transformers.py --modes fused-llama`).

Llama as transformers runs it does, per sublayer, an RMSNorm (about six tensor ops in eager code) and
a separate residual add. vLLM's Llama instead carries the residual beside the hidden state and does
"add the sublayer's output into the residual, then RMSNorm it" in one kernel (`fused_add_rms_norm`).
AttnRes's default path does its whole boundary (add, block store, depth mix, next norm) in one C++
call, so against the plain Llama its ratio includes the fusion's gain; against this Llama it says what
the depth attention itself costs.

The kernel below is built the way AttnRes's is (its `load_inline`: the same flags and headers, OpenMP through
`at::parallel_for` over tokens in chunks of 16, so that one decoded token runs inline with no thread
team to wake): vLLM's own CPU kernel starts an OpenMP team on every call, which costs milliseconds
per call on a loaded 2-core machine and would make this baseline slower than the one it improves.
Its rounding is `LlamaRMSNorm`'s: the residual add in the model's dtype, the norm in float32, the
normalised row cast to the model's dtype before the gain multiplies it.

The patch is a context manager on a loaded `LlamaForCausalLM`: inside it each decoder layer and the
final norm run the fused order (vLLM's `LlamaDecoderLayer.forward`); on exit the model is as it was.
"""

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from modeling_attnres.depth_attention_cpu import extension_name, load_inline
from modeling_attnres.depth_attention_cpu_source import LANES_CPP, ROUNDING_CPP

AddNorm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], None]

_SOURCE = r"""
#include <ATen/ATen.h>
#include <torch/python.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <type_traits>

""" + ROUNDING_CPP + LANES_CPP + r"""
// `to<T>` is AttnRes's rounding (ROUNDING_CPP: c10's conversion has a branch that stops these loops from
// vectorizing; a bfloat16 call took 14x as long). Separate loops for the rounded add, the sum of squares
// and the scaling: GCC vectorizes each alone.
template <typename T>
static void add_norm_rows(T* x, T* r, const T* w, int64_t N, int64_t d, float eps) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* xr = x + t * d;
      T* rr = r + t * d;
_Pragma("omp simd")
      for (int64_t j = 0; j < d; ++j) rr[j] = to<T>(static_cast<float>(rr[j]) + static_cast<float>(xr[j]));  // in T
      float ss_[kLanes] = {};  // the sum of squares in kLanes partial sums, as AttnRes's kernel sums
      over_lanes(d, [&](int64_t j, int64_t k) { ss_[k] += static_cast<float>(rr[j]) * static_cast<float>(rr[j]); });
      const float inv = 1.f / std::sqrt(lanes_total(ss_) / static_cast<float>(d) + eps);
_Pragma("omp simd")
      for (int64_t j = 0; j < d; ++j)
        xr[j] = to<T>(static_cast<float>(w[j]) * static_cast<float>(to<T>(static_cast<float>(rr[j]) * inv)));
    }
  });
}

// residual += x; x = RMSNorm(residual) * weight, in place; all three contiguous, one dtype.
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type() &&
              weight.scalar_type() == x.scalar_type() && weight.numel() == x.size(-1), "shapes or dtypes differ");
  const int64_t d = x.size(-1), N = x.numel() / d;
  switch (x.scalar_type()) {
    case at::kFloat: add_norm_rows(x.data_ptr<float>(), residual.data_ptr<float>(), weight.data_ptr<float>(), N, d,
                                   (float)eps); break;
    case at::kBFloat16: add_norm_rows(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(),
                                      weight.data_ptr<c10::BFloat16>(), N, d, (float)eps); break;
    case at::kHalf: add_norm_rows(x.data_ptr<c10::Half>(), residual.data_ptr<c10::Half>(),
                                  weight.data_ptr<c10::Half>(), N, d, (float)eps); break;
    default: TORCH_CHECK(false, "fused_add_rms_norm: float32, bfloat16 or float16 expected, got ", x.scalar_type());
  }
}
"""


def fused_add_rms_norm_op() -> AddNorm:
    """The in-place `fused_add_rms_norm(x, residual, weight, eps)`: `residual += x`, then
    `x = RMSNorm(residual)`; compiled on first use (a C++ compiler and ninja, as AttnRes's kernel)."""
    module = load_inline(extension_name("attnres_bench_fused_add_rms_norm", _SOURCE), _SOURCE,  # AttnRes's flags
                         ["fused_add_rms_norm"])
    return module.fused_add_rms_norm


class _Residual:
    """The residual stream of one forward pass, carried from sublayer to sublayer (as vLLM passes it)."""

    tensor: torch.Tensor | None = None


def _add_norm(op: AddNorm, x: torch.Tensor, state: _Residual, norm: nn.Module) -> torch.Tensor:
    """`state.tensor += x` and `x := norm(state.tensor)`, in place, in one kernel call."""
    op(x, state.tensor, norm.weight, norm.variance_epsilon)
    return x


def _layer_forward(layer: nn.Module, op: AddNorm, state: _Residual, first: bool) -> Callable:
    """`layer.forward` in vLLM's order: it receives the previous layer's MLP output (not yet added) and
    returns its own; the first layer receives the embeddings, which start the residual."""

    def forward(hidden_states, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if first:
            state.tensor = hidden_states.clone()                    # the embeddings start the residual
            hidden_states = layer.input_layernorm(hidden_states)
        else:
            hidden_states = _add_norm(op, hidden_states, state, layer.input_layernorm)
        hidden_states, _ = layer.self_attn(hidden_states=hidden_states, attention_mask=attention_mask,
                                           position_ids=position_ids, past_key_values=past_key_values,
                                           use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        hidden_states = _add_norm(op, hidden_states, state, layer.post_attention_layernorm)
        return layer.mlp(hidden_states)

    return forward


@contextlib.contextmanager
def fused_add_norm(model: nn.Module, op: AddNorm | None = None) -> Iterator[nn.Module]:
    """Run `model` (a transformers `LlamaForCausalLM`, inference only) with each residual add fused into
    the next RMSNorm, inside the `with` block; the model's own forwards are restored on exit."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", [])
    if not layers or not all(hasattr(layer, "post_attention_layernorm") for layer in layers):
        raise SystemExit(f"--modes fused-llama patches a Llama-style decoder (model.layers[i].input_layernorm, "
                         f"post_attention_layernorm, self_attn, mlp); {type(model).__name__} is not one.")
    op = op or fused_add_rms_norm_op()
    state = _Residual()
    patched = [*base.layers[: base.config.num_hidden_layers], base.norm]
    for i, layer in enumerate(patched[:-1]):
        layer.forward = _layer_forward(layer, op, state, first=i == 0)
    base.norm.forward = lambda hidden_states: _add_norm(op, hidden_states, state, base.norm)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward                                      # the class's forward again
        state.tensor = None
