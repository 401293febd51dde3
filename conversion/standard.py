"""Standard pre-norm models (Llama, Qwen2, Qwen3, Mistral) -> AttnRes with zero pseudo-queries.

With every pseudo-query zero, each depth-attention site returns the ordinary residual stream divided
by its number of sources `c`, and every reader of the stream is an RMSNorm, which ignores that scale
except through eps (docs/spec.md, "Converting a standard pre-norm model"). So the weights
carry over unchanged; what the converter adds is:

- the depth parameters (pseudo-queries zero, key-norm gains one), filled in;
- an optional *stream scale* `s`: the embedding, `o_proj` and `down_proj` (and their biases) are
  multiplied by `s`, so the whole residual stream is `s*H` and each site's effective eps becomes
  `(c/s)^2 * eps` instead of `c^2 * eps`. A tied lm_head reads the scaled embedding, so the final
  norm's gain is divided by `s` instead (logits unchanged, embeddings stay tied). Powers of two keep
  all of this bit-exact in every float format;
- Qwen2's `o_proj` has no bias while its q/k/v do; AttnRes's `attention_bias` covers all four, so the
  converted `o_proj.bias` is filled with zeros (exact).
"""

import math

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from modeling_attnres import AttnResConfig
from modeling_attnres.configuration_attnres import is_sparse_layer

from .errors import ConversionError, UsageError
from .keymap import Fill, Rule, TensorSource

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                           "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM")
# The model types a supported architecture's config loads as (transformers builds the model from the model type):
# a Mistral config with `layer_types` loads as `ministral`.
MODEL_TYPES = {"LlamaForCausalLM": ("llama",), "Qwen2ForCausalLM": ("qwen2",), "Qwen3ForCausalLM": ("qwen3",),
               "MistralForCausalLM": ("mistral", "ministral"), "Qwen2MoeForCausalLM": ("qwen2_moe",),
               "Qwen3MoeForCausalLM": ("qwen3_moe",), "MixtralForCausalLM": ("mixtral",)}
# Mixture-of-experts fields: AttnResConfig's names (Qwen2/Qwen3-MoE's) <- the source config's.
EXPERT_FIELDS = {"num_experts": ("num_experts", "num_local_experts"), "num_experts_per_tok": ("num_experts_per_tok",),
                 "moe_intermediate_size": ("moe_intermediate_size",), "norm_topk_prob": ("norm_topk_prob",),
                 "decoder_sparse_step": ("decoder_sparse_step",), "mlp_only_layers": ("mlp_only_layers",),
                 "shared_expert_intermediate_size": ("shared_expert_intermediate_size",),
                 "router_aux_loss_coef": ("router_aux_loss_coef",), "output_router_logits": ("output_router_logits",)}
# Rope types whose tables LlamaRotaryEmbedding computes over the full head dimension.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")
# Fields that mean the same in the source configs and in AttnResConfig (a LlamaConfig).
SHARED_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "attention_dropout", "pad_token_id", "bos_token_id", "eos_token_id",
)

LAYER = "model.layers.{i}"
EXPERT = f"{LAYER}.mlp.experts.{{e}}"
MIXTRAL_EXPERT = f"{LAYER}.block_sparse_moe.experts.{{e}}"


def same_keys(*keys: str, transform: str = "copy") -> tuple[Rule, ...]:
    """Rules that keep each key's name (and apply `transform`)."""
    return tuple(Rule((k,), k, transform) for k in keys)


# Old exports store the rotary table; AttnRes recomputes it from rope_parameters.
ROTARY_TABLES = Rule((f"{LAYER}.self_attn.rotary_emb.inv_freq", "model.rotary_emb.inv_freq"), None)

STANDARD_RULES = (
    *same_keys("model.embed_tokens.weight", transform="scale_stream"),
    *same_keys(*(f"{LAYER}.self_attn.{p}_proj.{t}" for p in "qkv" for t in ("weight", "bias"))),
    *same_keys(f"{LAYER}.self_attn.o_proj.weight", f"{LAYER}.self_attn.o_proj.bias", transform="scale_stream"),
    *same_keys(f"{LAYER}.self_attn.q_norm.weight", f"{LAYER}.self_attn.k_norm.weight"),
    *same_keys(*(f"{LAYER}.mlp.{p}_proj.{t}" for p in ("gate", "up") for t in ("weight", "bias"))),
    *same_keys(f"{LAYER}.mlp.down_proj.weight", f"{LAYER}.mlp.down_proj.bias", transform="scale_stream"),
    *same_keys(f"{LAYER}.input_layernorm.weight", f"{LAYER}.post_attention_layernorm.weight"),
    *same_keys("model.norm.weight", transform="unscale_tied_head"),
    *same_keys("lm_head.weight"),
    ROTARY_TABLES,
    # Mixtures of experts: the router and routed experts (Qwen2/Qwen3-MoE's names, Mixtral's w1/w3/w2 in
    # `block_sparse_moe`), Qwen2-MoE's shared expert and its gate. Every down projection writes into the
    # residual stream, so it is scaled like any other.
    Rule((f"{LAYER}.mlp.gate.weight", f"{LAYER}.block_sparse_moe.gate.weight"), f"{LAYER}.mlp.gate.weight"),
    Rule((f"{EXPERT}.gate_proj.weight", f"{MIXTRAL_EXPERT}.w1.weight"), f"{EXPERT}.gate_proj.weight"),
    Rule((f"{EXPERT}.up_proj.weight", f"{MIXTRAL_EXPERT}.w3.weight"), f"{EXPERT}.up_proj.weight"),
    Rule((f"{EXPERT}.down_proj.weight", f"{MIXTRAL_EXPERT}.w2.weight"), f"{EXPERT}.down_proj.weight", "scale_stream"),
    *same_keys(f"{LAYER}.mlp.shared_expert.gate_proj.weight", f"{LAYER}.mlp.shared_expert.up_proj.weight",
               f"{LAYER}.mlp.shared_expert_gate.weight"),
    *same_keys(f"{LAYER}.mlp.shared_expert.down_proj.weight", transform="scale_stream"),
)

# Some exports store a tied head anyway; it is dropped once it is checked to equal the embedding.
TIED_HEAD_RULE = Rule(("lm_head.weight",), None)
# A Qwen2-MoE with shared_expert_intermediate_size 0 stores a zero-width shared expert (and its gate), which
# adds exactly nothing; the AttnRes config carries the 0, so its tensors are dropped.
ZERO_SHARED_EXPERT_RULE = Rule(tuple(f"{LAYER}.mlp.shared_expert{part}.weight" for part in (
    ".gate_proj", ".up_proj", ".down_proj", "_gate")), None)

DEPTH_FILLS = (
    Fill(f"{LAYER}.self_attention_res_proj.weight", "zeros"),
    Fill(f"{LAYER}.mlp_res_proj.weight", "zeros"),
    Fill("model.output_attn_res_proj.weight", "zeros"),
    Fill(f"{LAYER}.self_attention_res_norm.weight", "ones"),
    Fill(f"{LAYER}.mlp_res_norm.weight", "ones"),
    Fill("model.output_attn_res_norm.weight", "ones"),
)
# Only Qwen2 lacks the o_proj bias its AttnRes config implies.
QWEN2_FILLS = (Fill(f"{LAYER}.self_attn.o_proj.bias", "zeros"),)


def default_block_size(num_layers: int, blocks: int = 8) -> int:
    """Layers per block for about `blocks` blocks (the paper's recommendation): ceil(L / 8)."""
    return max(1, math.ceil(num_layers / blocks))


def architecture_of(config: PretrainedConfig) -> str:
    """The source's `architectures[0]` (or, for a config saved without it, its `model_type`'s causal LM),
    checked against the supported list."""
    archs = getattr(config, "architectures", None) or []
    model_type = getattr(config, "model_type", None)
    by_type = {arch.removesuffix("ForCausalLM").lower(): arch for arch in SUPPORTED_ARCHITECTURES}
    arch = archs[0] if archs else by_type.get(str(model_type).replace("_", ""),
                                              f"<none; model_type={model_type!r}>")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            f"Unsupported architecture {arch}: attnres-convert converts {', '.join(SUPPORTED_ARCHITECTURES)} "
            "checkpoints (and AttnRes checkpoints in other layouts). Other models differ in more than the "
            "residual path and cannot be carried over exactly."
        )
    if model_type not in MODEL_TYPES[arch]:
        raise ConversionError(
            f"The source config says architectures=[{arch!r}] but model_type={model_type!r} (a {arch} checkpoint "
            f"has model_type {MODEL_TYPES[arch][0]!r}): transformers would build a {model_type} model from it. "
            "One of the two is wrong; fix config.json.")
    return arch


# The supported families whose attention slides on every layer when the config has a window (their
# modeling code reads `sliding_window` alone; a `layer_types` in their config is only checked and logged).
# A Mistral config with `layer_types` loads as `ministral`, whose layers follow them, as the check does.
EVERY_LAYER_SLIDES = ("mistral", "mixtral", "qwen3_moe")


def _check_attention_window(config: PretrainedConfig, clip_to_window: bool) -> int | None:
    """Reject sliding-window attention, which AttnRes (full causal attention) cannot carry.

    Mistral, Mixtral and Qwen3-MoE slide on every layer whenever the config keeps a `sliding_window` (Qwen3-MoE
    only with `use_sliding_window`), whatever `layer_types` says: their modeling code never reads it. Qwen2,
    Qwen3 and Qwen2-MoE slide on their `sliding_attention` layers (with `use_sliding_window`; which ones
    follows `max_window_layers`). A window at least `max_position_embeddings` long is full attention. A shorter
    one equals full attention for sequences up to the window, on every layer that has it, so
    `clip_to_window` converts it with `max_position_embeddings` cut to the window. Returns the new limit,
    if any.
    """
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise ConversionError(
            f"Layers {[i for i, t in enumerate(layer_types) if t in other]} use {other[0]!r} attention, expected "
            "full or sliding-window attention: AttnRes uses full causal attention on every layer.")
    slides = config.model_type in EVERY_LAYER_SLIDES or not layer_types or "sliding_attention" in layer_types
    window = getattr(config, "sliding_window", None) if slides else None
    if not window or window >= config.max_position_embeddings:       # None, or Qwen2-MoE's 0 for none
        if clip_to_window:
            raise UsageError(f"--clip-to-sliding-window does not apply: this {config.model_type} model has no "
                             f"sliding window shorter than its max_position_embeddings "
                             f"({config.max_position_embeddings}; sliding_window={window}), so it converts exactly "
                             "as it is; drop the option.")
        return None
    if clip_to_window:
        return window
    raise ConversionError(
        f"sliding_window={window} is smaller than max_position_embeddings={config.max_position_embeddings}: "
        "AttnRes uses full attention, which equals this model only for sequences up to the window. Pass "
        f"--clip-to-sliding-window to convert with max_position_embeddings={window}, or use a checkpoint "
        "with sliding_window null."
    )


def _check_rope(config: PretrainedConfig) -> dict:
    rope = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConversionError(f"rope_type {rope_type!r} is not supported by AttnRes; expected one of "
                              f"{', '.join(SUPPORTED_ROPE_TYPES)}.")
    factor = rope.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise ConversionError(f"partial_rotary_factor={factor}: AttnRes rotates the whole head (expected 1.0).")
    return rope


def _fix_rope_factor(rope: dict, max_positions: int) -> dict:
    """`rope` with the scaling factor that yarn and longrope derive from `max_position_embeddings` (as
    `max_position_embeddings / original_max_position_embeddings`, where no factor is given) written out, so
    that cutting `max_position_embeddings` to a window leaves every rotation and attention scale as it was."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    original = rope.get("original_max_position_embeddings")
    if rope_type in ("yarn", "longrope") and rope.get("factor") is None and original:
        return {**rope, "factor": max_positions / original}
    return rope


def attnres_config_from_standard(config: PretrainedConfig, *, block_size: int | None = None,
                                 mode: str = "block", clip_to_window: bool = False) -> AttnResConfig:
    """The AttnResConfig that carries `config` (a Llama/Qwen2/Qwen3/Mistral config) exactly."""
    arch = architecture_of(config)
    fields = {name: getattr(config, name) for name in SHARED_FIELDS if hasattr(config, name)}
    fields["rope_parameters"] = _check_rope(config)
    window = _check_attention_window(config, clip_to_window)
    if window is not None:
        fields["max_position_embeddings"] = window
        fields["rope_parameters"] = _fix_rope_factor(fields["rope_parameters"], config.max_position_embeddings)
    fields["head_dim"] = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    biased = {"Qwen2ForCausalLM": True, "Qwen2MoeForCausalLM": getattr(config, "qkv_bias", True)}
    fields["attention_bias"] = biased.get(arch, getattr(config, "attention_bias", False))
    fields["mlp_bias"] = getattr(config, "mlp_bias", False)
    fields["qk_norm"] = arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
    fields.update(expert_fields(config, arch))
    fields["attn_res_mode"] = mode
    fields["attn_res_block_size"] = block_size if block_size is not None else default_block_size(
        config.num_hidden_layers)
    fields["architectures"] = ["AttnResForCausalLM"]
    try:
        return AttnResConfig(**fields)
    except (ValueError, TypeError, StrictDataclassError) as err:
        raise ConversionError(f"The converted config is invalid: {err}") from err


def expert_fields(config: PretrainedConfig, arch: str) -> dict:
    """The mixture-of-experts fields of the AttnResConfig that carries `config` (none for a dense model).
    Mixtral routes every layer's MLP through its experts (of `intermediate_size`) and always
    renormalises the top-k weights. A source that declares experts but routes no layer through them
    (every layer in `mlp_only_layers`, or `decoder_sparse_step` above the layer count) is a dense model:
    its own class builds dense MLPs of `intermediate_size` everywhere, and so does the conversion."""
    fields = {ours: getattr(config, name) for ours, names in EXPERT_FIELDS.items() for name in names
              if getattr(config, name, None) is not None}
    if arch == "MixtralForCausalLM":
        fields.update(moe_intermediate_size=config.intermediate_size, norm_topk_prob=True)
    if not fields.get("num_experts"):
        return {}
    step, dense = fields.get("decoder_sparse_step", 1), fields.get("mlp_only_layers") or ()
    if not isinstance(step, int) or step < 1:                      # left to AttnResConfig's check, which names it
        return fields
    sparse = [i for i in range(config.num_hidden_layers) if is_sparse_layer(i, fields["num_experts"], step, dense)]
    return fields if sparse else {}


def standard_rules(config: AttnResConfig, source: TensorSource) -> tuple[Rule, ...]:
    """The standard table; for a tied model whose export also stores lm_head, that copy is dropped
    after checking it is the embedding (a differing head means the config's tie flag is wrong), and a
    zero-width shared expert is dropped (`ZERO_SHARED_EXPERT_RULE`)."""
    rules = STANDARD_RULES
    if config.num_experts and not config.shared_expert_intermediate_size:
        rules = (ZERO_SHARED_EXPERT_RULE, *rules)         # the first matching rule wins
    return with_tied_head(config, source, rules)


def with_tied_head(config: AttnResConfig, source: TensorSource, rules: tuple[Rule, ...]) -> tuple[Rule, ...]:
    """`rules`, and for a tied model whose checkpoint also stores lm_head (every `state_dict()` of a tied
    transformers model does), a first rule dropping that copy once it is checked to be the embedding: a
    differing head means the config's tie flag is wrong."""
    if not config.tie_word_embeddings or "lm_head.weight" not in source.keys():
        return rules
    if not torch.equal(source.get("lm_head.weight"), source.get("model.embed_tokens.weight")):
        raise ConversionError(
            "tie_word_embeddings is true but the checkpoint stores an lm_head.weight that differs from "
            "model.embed_tokens.weight; if the head is separate, set tie_word_embeddings to false in config.json."
        )
    return (TIED_HEAD_RULE, *rules)


def standard_fills(config: PretrainedConfig) -> tuple[Fill, ...]:
    """The depth parameters, plus Qwen2's missing o_proj bias."""
    qwen2 = architecture_of(config) == "Qwen2ForCausalLM" or (
        architecture_of(config) == "Qwen2MoeForCausalLM" and getattr(config, "qkv_bias", True))
    return DEPTH_FILLS + (QWEN2_FILLS if qwen2 else ())


def sources_per_site(config: AttnResConfig) -> list[int]:
    """Number of sources `c` each site mixes, in site order (attention and MLP of every layer, then
    the output site). With zero queries site j reads `H / c_j`, the eps change the spec describes."""
    return [site.num_stored + 1 for site in config.depth_sites]     # stored sources + the partial


def stream_scale_candidates(config: AttnResConfig) -> list[float]:
    """Powers of two from 1 to the smallest one >= the largest source count. Beyond that every site's
    effective eps is already below the source's and larger scales change almost nothing; below 1
    every site gets worse. Powers of two scale weights without rounding in every float format."""
    top = math.ceil(math.log2(max(sources_per_site(config))))
    return [float(2 ** k) for k in range(top + 1)]
