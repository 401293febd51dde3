"""AttnRes model configuration: Llama's fields plus the depth-attention ones.

One typed config for every consumer (transformers, vLLM, the converters). It subclasses
`LlamaConfig`, so every Llama field keeps its name, default and meaning; `@strict` checks field
types on construction and assignment, and runs every `validate_*` method on construction, on
`from_pretrained` and on `save_pretrained`.
"""

import dataclasses
import difflib
import functools
import logging
import math
import os
import re
from pathlib import Path
from typing import NamedTuple

import transformers

# Hub remote code runs in whatever transformers the user has: name the requirement before an import of a
# 5.x-only name (below, and in the sibling files) fails on its own name.
if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"AttnRes models need transformers >= 5.16.1, found {transformers.__version__}; "
                      "upgrade it with `pip install -U 'transformers>=5.16.1'`")

from huggingface_hub.dataclasses import strict  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama.configuration_llama import LlamaConfig  # noqa: E402

from .depth_attention import BANK_DTYPES  # noqa: E402

ATTN_RES_MODES = ("block", "full")
MAX_SIZE = 2**31 - 1          # any one tensor dimension
MAX_LAYERS = 4096

# The parameter-naming contract (docs/spec.md), written once for the model, the vLLM loader and the
# converters: a site's pseudo-query is `*_res_proj.weight`, its key-norm gain `*_res_norm.weight`.
DEPTH_PARAMETER = re.compile(r"_res_(proj|norm)\.weight\Z")
# The seed pseudo-code's names for the attention site, which loaders accept (saving writes ours).
SEED_SITE_ALIASES = {"attn_res_proj": "self_attention_res_proj", "attn_res_norm": "self_attention_res_norm"}
# What `save_pretrained` writes as `config.auto_map` (the flat files shipped next to the weights).
AUTO_MAP = {
    "AutoConfig": "configuration_attnres.AttnResConfig",
    "AutoModel": "modeling_attnres.AttnResModel",
    "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
    "AutoModelForSequenceClassification": "modeling_attnres.AttnResForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_attnres.AttnResForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_attnres.AttnResForQuestionAnswering",
}


def is_depth_parameter(name: str) -> bool:
    """Whether a checkpoint key or parameter name is a depth-attention parameter (query or key-norm gain)."""
    return DEPTH_PARAMETER.search(name) is not None


class ForeignCheckpointError(ValueError):
    """A config.json that says `model_type: "attnres"` but was written by other AttnRes code."""


class CheckpointMismatchError(ValueError, RuntimeError):
    """A checkpoint whose tensors disagree with the config it is loaded with: a `ValueError` (a bad input), and
    a `RuntimeError` as transformers' own size-mismatch error is, so code written for either catches it."""


class DepthSite(NamedTuple):
    """One depth-attention site of the schedule (see `AttnResConfig.depth_sites`)."""

    index: int          # attention site of layer l: 2l, its MLP site: 2l + 1, the output site: 2L
    num_stored: int     # stored sources the site reads; the running partial comes on top
    closes_block: bool  # after mixing, the partial becomes a stored source and a new partial starts


@functools.cache
def warn_one_block(block_size: int, num_hidden_layers: int) -> None:
    """Warn (once per pair) that blocks longer than the model leave one block: a valid config, but more likely
    a mistaken value (a context length, a block count) than a model that means to mix only two sources."""
    logging.getLogger(__name__).warning(
        "AttnResConfig.attn_res_block_size %d is more than num_hidden_layers %d: the model has one block, so every "
        "site mixes only the embedding and the running sum of the layers. If you meant several blocks, the paper "
        "recommends about 8: attn_res_block_size = ceil(num_hidden_layers / 8) = %d.",
        block_size, num_hidden_layers, -(-num_hidden_layers // 8))


@strict
class AttnResConfig(LlamaConfig):
    r"""
    Configuration of an Attention Residuals model (Kimi Team, arXiv:2603.15031).

    All Llama fields (`vocab_size`, `hidden_size`, `intermediate_size`, `num_hidden_layers`,
    `num_attention_heads`, `num_key_value_heads`, `head_dim`, `hidden_act`,
    `max_position_embeddings`, `rms_norm_eps`, `rope_parameters`, `attention_bias`, `mlp_bias`,
    `tie_word_embeddings`, ...) mean what they mean for `LlamaConfig`. Added:

    qk_norm (`bool`, defaults to `False`):
        Qwen3-style RMSNorm over each head of the queries and keys (`self_attn.{q,k}_norm`).
    attn_res_mode (`str`, defaults to `"block"`):
        `"block"`: each site attends over completed blocks of `attn_res_block_size` layers plus the
        running partial block. `"full"`: every sublayer output is its own source.
    attn_res_block_size (`int`, defaults to 2):
        Transformer layers per block (Block AttnRes only). Need not divide `num_hidden_layers`.
    attn_res_bank_dtype (`str`, defaults to `"auto"`):
        The dtype completed blocks are stored in during a forward pass. `"auto"`: the model's dtype
        for bfloat16/float16 models (each block rounded once when stored, as Llama rounds its
        residual stream; half the bytes per site), float32 otherwise, and float32 on the eager torch
        path on a CPU, where converting the bank at every site costs more than it saves
        (`depth_attention_ops.site_bank`). `"float32"`: always float32 (float64 for float64 models).
        Scores, softmax and the running partial are float32 either way.

    Mixture of experts (the fields of transformers' Qwen2-MoE / Qwen3-MoE configs; dense by default). A
    sparse layer's MLP sublayer is a routed MoE block, whose output is the sublayer output that the
    running partial accumulates; depth attention is unchanged.

    num_experts (`int`, defaults to 0):
        Routed experts per sparse layer; 0 makes every layer dense.
    num_experts_per_tok (`int`, defaults to 2):
        Experts each token is routed to (top-k).
    moe_intermediate_size (`int`, *optional*):
        Intermediate size of each routed expert (default: `intermediate_size`).
    norm_topk_prob (`bool`, defaults to `True`):
        Renormalise the top-k routing weights to sum to 1 (Mixtral always does; Qwen3-MoE checkpoints say).
    decoder_sparse_step (`int`, defaults to 1), mlp_only_layers (`list[int]`, *optional*):
        Layer `l` is sparse when `(l + 1) % decoder_sparse_step == 0` and `l` is not in `mlp_only_layers`.
    shared_expert_intermediate_size (`int`, defaults to 0):
        Qwen2-MoE's shared expert (a gated MLP every token passes through, scaled by a sigmoid gate); 0: none.
    router_aux_loss_coef (`float`, defaults to 0.001), output_router_logits (`bool`, defaults to `False`):
        The load-balancing loss, returned (and added to the loss) as Qwen3-MoE does when router logits
        are output.

    ```python
    >>> from modeling_attnres import AttnResConfig, AttnResForCausalLM
    >>> config = AttnResConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=8,
    ...                        num_attention_heads=4, attn_res_block_size=2)
    >>> model = AttnResForCausalLM(config)
    ```
    """

    model_type = "attnres"
    # Llama's tensor-parallel plan holds (pseudo-queries and key norms read the full hidden state and are
    # replicated); the pipeline plan is AttnRes's own: a layer passes the depth history, not a hidden state.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["bank", "partial", "attention_mask"], ["bank", "partial"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    qk_norm: bool = False
    attn_res_mode: str = "block"
    attn_res_block_size: int = 2
    attn_res_bank_dtype: str = "auto"
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None
    shared_expert_intermediate_size: int = 0
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False

    def __post_init__(self, **kwargs):
        heads = self.num_attention_heads
        if self.head_dim is None and (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1):
            raise ValueError(f"AttnResConfig.num_attention_heads must be a positive integer, got {heads!r}; give the "
                             "model's own head count (a config written by save_pretrained has it).")
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self.mlp_only_layers = [] if self.mlp_only_layers is None else list(self.mlp_only_layers)
        super().__post_init__(**kwargs)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """`PreTrainedConfig.from_dict`, refusing a config that another AttnRes implementation wrote under
        the same `model_type` (its fields and parameter names are not this package's), and turning what
        a malformed config.json makes transformers' own parsing raise into one clear `ValueError`."""
        check_not_foreign(config_dict)
        try:
            return super().from_dict(config_dict, **kwargs)
        except (AttributeError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError) as err:
            raise ValueError(f"config.json cannot be read as an AttnResConfig ({type(err).__name__}: {err}); a field "
                             "has a value of the wrong type or range: compare it with a config written by "
                             "save_pretrained.") from err

    def validate_numbers(self):
        """Every numeric field finite and of the right sign; runs on construction and load."""
        usual = {"rms_norm_eps": "typically 1e-6, or 0 for exact conversions", "initializer_range": "Llama's is 0.02",
                 "attention_dropout": "0.0 for none, Llama's default"}
        for name, fix in usual.items():
            value = getattr(self, name, 0.0)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"AttnResConfig.{name} must be a finite number >= 0, got {value!r}; set it in "
                                 f"config.json ({fix}).")
        if not self.attention_dropout < 1:
            raise ValueError(f"AttnResConfig.attention_dropout is a probability and must be < 1, got "
                             f"{self.attention_dropout!r}; use 0.0 for none (Llama's default).")
        if not (isinstance(self.max_position_embeddings, int) and self.max_position_embeddings >= 1):
            raise ValueError("AttnResConfig.max_position_embeddings must be a positive integer, got "
                             f"{self.max_position_embeddings!r}; set it to the longest sequence the model takes "
                             "(the source model's value, e.g. 2048).")
        rope = self.rope_parameters if isinstance(self.rope_parameters, dict) else {}
        theta = rope.get("rope_theta", 1.0)
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not (math.isfinite(theta) and theta > 0):
            raise ValueError(f"AttnResConfig.rope_parameters['rope_theta'] must be a finite number > 0, got {theta!r}; "
                             "use the source model's (Llama 2: 10000.0, Llama 3: 500000.0).")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"AttnResConfig.hidden_act {self.hidden_act!r} is not an activation transformers knows; "
                             f"use one of {', '.join(sorted(ACT2FN)[:8])}, ... (Llama's is 'silu').")

    def validate_architecture(self):
        """Shapes the attention layers need; runs on construction and load. Sizes are bounded too: past
        int32 no tensor dimension can be indexed, and past `MAX_LAYERS` building the model never ends."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value, limit = getattr(self, name), MAX_LAYERS if name == "num_hidden_layers" else MAX_SIZE
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
                raise ValueError(f"AttnResConfig.{name} must be a positive integer up to {limit}, got {value!r}; "
                                 "give the model's own size (a config written by save_pretrained has it).")
        super().validate_architecture()
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"AttnResConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention; "
                f"choose num_key_value_heads among the divisors of {self.num_attention_heads}."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"AttnResConfig.head_dim must be even for rotary embeddings, got {self.head_dim}; the "
                             f"usual one is hidden_size // num_attention_heads "
                             f"({self.hidden_size // self.num_attention_heads} here).")

    def validate_experts(self):
        """The mixture-of-experts fields; runs on construction and load."""
        if self.num_experts == 0:
            return
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "decoder_sparse_step"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SIZE:
                dense = " or 0 for a dense model" if name == "num_experts" else ""
                raise ValueError(f"AttnResConfig.{name} must be a positive integer{dense}, got {value!r} (num_experts="
                                 f"{self.num_experts}; set num_experts=0 for a dense model).")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"AttnResConfig.num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"num_experts ({self.num_experts}): each token is routed to that many distinct experts.")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("AttnResConfig.shared_expert_intermediate_size must be >= 0 (0: no shared expert), got "
                             f"{self.shared_expert_intermediate_size}.")
        outside = [l for l in self.mlp_only_layers if not 0 <= l < self.num_hidden_layers]
        if outside:
            raise ValueError(f"AttnResConfig.mlp_only_layers names layers {outside} outside "
                             f"0..{self.num_hidden_layers - 1}; list dense layers by their 0-based index.")
        if not (math.isfinite(self.router_aux_loss_coef) and self.router_aux_loss_coef >= 0):
            raise ValueError(f"AttnResConfig.router_aux_loss_coef must be a finite number >= 0, got "
                             f"{self.router_aux_loss_coef!r}; 0 turns the load-balancing loss off (Qwen's is 0.001).")
        if not self.sparse_layers:
            raise ValueError(f"AttnResConfig.num_experts is {self.num_experts} but no layer is sparse "
                             f"(decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                             f"{self.mlp_only_layers}); set num_experts=0 for a dense model.")

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx`'s MLP is a mixture of experts (the rule of Qwen2/Qwen3-MoE)."""
        return is_sparse_layer(layer_idx, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @property
    def sparse_layers(self) -> list[int]:
        """The indices of the layers whose MLP is a mixture of experts."""
        return [l for l in range(self.num_hidden_layers) if self.is_sparse_layer(l)]

    def validate_attn_res(self):
        """The depth-attention fields; runs on construction, load and save. An `attn_res_*` attribute that is
        not one of them (a misspelt field, kept by transformers as an extra attribute) is refused: it would be
        saved and never read, the model silently using the default."""
        known = [f.name for f in dataclasses.fields(self) if f.name.startswith("attn_res_")]
        misspelt = sorted(key for key in vars(self) if key.startswith("attn_res_") and key not in known)
        if misspelt:
            suffixes = {name.removeprefix("attn_res_"): name for name in known}   # the shared prefix says nothing
            guess = difflib.get_close_matches(misspelt[0].removeprefix("attn_res_"), suffixes, 1)
            raise ValueError(f"AttnResConfig has no field {misspelt[0]!r}; its depth-attention fields are "
                             f"{', '.join(known)}" + (f" (did you mean {suffixes[guess[0]]!r}?)." if guess else "."))
        if self.attn_res_mode not in ATTN_RES_MODES:
            raise ValueError(
                f"AttnResConfig.attn_res_mode must be one of {ATTN_RES_MODES}, got {self.attn_res_mode!r}. "
                'Use "block" for Block AttnRes (with attn_res_block_size) or "full" for Full AttnRes.'
            )
        if self.attn_res_block_size < 1:
            fix = ("Full AttnRes does not use it: leave it at its default, 2" if self.attn_res_mode == "full" else
                   "The paper recommends about 8 blocks: attn_res_block_size = ceil(num_hidden_layers / 8) = "
                   f"{-(-self.num_hidden_layers // 8)} here")
            raise ValueError(
                f"AttnResConfig.attn_res_block_size is the number of transformer layers per block and must be "
                f">= 1, got {self.attn_res_block_size}. {fix}."
            )
        if self.attn_res_mode == "block" and self.attn_res_block_size > self.num_hidden_layers:
            warn_one_block(self.attn_res_block_size, self.num_hidden_layers)

    def validate_attn_res_bank_dtype(self):
        """The stored-block dtype; runs on construction and load."""
        if self.attn_res_bank_dtype not in BANK_DTYPES:
            raise ValueError(
                f"AttnResConfig.attn_res_bank_dtype must be one of {BANK_DTYPES}, got "
                f"{self.attn_res_bank_dtype!r}. Use \"auto\" to store completed blocks in a bfloat16/float16 "
                f"model's dtype, or \"float32\" to keep them in float32."
            )

    @property
    def sublayers_per_block(self) -> int:
        """Sublayers (attention or MLP) per stored source: 1 for Full AttnRes, `2k` for blocks of k layers."""
        return 1 if self.attn_res_mode == "full" else 2 * self.attn_res_block_size

    @property
    def depth_sites(self) -> tuple[DepthSite, ...]:
        """The block schedule, one entry per site in order (the role `layer_types` plays for other
        models): `depth_sites[2 * l]` is layer l's attention site, `[2 * l + 1]` its MLP site and
        `[-1]` the output site. Every model, converter and benchmark reads the schedule from here.

        Site j reads `ceil(j / s)` stored sources with `s = sublayers_per_block`, and closes a block
        when `j % s == 0`: site 0 stores the embedding as block 0, then every `s`-th sublayer output
        sum becomes a block. The output site never closes one.
        """
        return depth_schedule(self.sublayers_per_block, self.num_hidden_layers)

    @property
    def num_depth_sources(self) -> int:
        """Sources the output site mixes: the embedding, the stored blocks and the partial."""
        return self.depth_sites[-1].num_stored + 1


def check_schedule_as_built(config: AttnResConfig, built_sublayers_per_block: int) -> None:
    """Refuse a config whose depth-attention schedule was edited after its model was built: the layers fix at
    construction which sites close a block, so the model still computes the old schedule, and the edited
    config, saved beside its weights, would load as another model."""
    if config.sublayers_per_block == built_sublayers_per_block:
        return
    built = ("attn_res_mode='full'" if built_sublayers_per_block == 1 else
             f"attn_res_mode='block', attn_res_block_size={built_sublayers_per_block // 2}")
    raise ValueError(f"config.attn_res_mode={config.attn_res_mode!r}, attn_res_block_size={config.attn_res_block_size} "
                     f"is not the depth-attention schedule this model was built with ({built}): it is fixed when "
                     "the layers are built, so the model still computes the old one, and the edited config would "
                     "load as another model. Restore those values, or build a model from the edited config "
                     "(AttnResForCausalLM(config)) and train or convert into it.")


_SCHEDULES: dict[tuple[int, int], tuple[DepthSite, ...]] = {}


def depth_schedule(sublayers_per_block: int, num_hidden_layers: int) -> tuple[DepthSite, ...]:
    """`AttnResConfig.depth_sites`, computed once per shape (every layer reads it at construction; a
    plain dict rather than `lru_cache`, which torch.compile would trace through)."""
    key = (sublayers_per_block, num_hidden_layers)
    if key not in _SCHEDULES:
        s, last = key[0], 2 * key[1]
        _SCHEDULES[key] = tuple(DepthSite(j, -(-j // s), j < last and j % s == 0) for j in range(last + 1))
    return _SCHEDULES[key]


def describe_mismatched_shapes(mismatched: set[tuple[str, tuple, tuple]], config: AttnResConfig,
                               fix: str | None = None) -> str:
    """The error for a checkpoint whose weights do not have the shapes its config implies, ending in `fix`
    (default: what a transformers user can do)."""
    rows = "\n".join(f"  {key}: checkpoint {tuple(ckpt)}, config implies {tuple(model)}"
                     for key, ckpt, model in sorted(mismatched))
    return (
        f"The checkpoint's weights do not match the config they are loaded with ({len(mismatched)} tensors):\n"
        f"{rows}\n(config: hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
        f"num_attention_heads={config.num_attention_heads}, num_key_value_heads={config.num_key_value_heads}, "
        f"head_dim={config.head_dim}, vocab_size={config.vocab_size}). " + (fix or
        "Fix config.json to describe these weights (or drop the size overrides given to from_pretrained), or pass "
        "ignore_mismatched_sizes=True to re-initialise the mismatched tensors.")
    )


def implied_shape(key: str, config: AttnResConfig) -> tuple[int, ...] | None:
    """The shape `config` implies for checkpoint tensor `key` (`None` for a name it does not know)."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    inter = (config.moe_intermediate_size if ".experts." in key else
             config.shared_expert_intermediate_size if ".shared_expert." in key else config.intermediate_size)
    by_suffix = {"embed_tokens.weight": (config.vocab_size, d), "lm_head.weight": (config.vocab_size, d),
                 "q_proj.weight": (q, d), "k_proj.weight": (kv, d), "v_proj.weight": (kv, d), "o_proj.weight": (d, q),
                 "q_proj.bias": (q,), "k_proj.bias": (kv,), "v_proj.bias": (kv,), "o_proj.bias": (d,),
                 "q_norm.weight": (hd,), "k_norm.weight": (hd,), "gate_proj.weight": (inter, d),
                 "up_proj.weight": (inter, d), "down_proj.weight": (d, inter), "_res_proj.weight": (1, d),
                 "mlp.gate.weight": (config.num_experts, d), "shared_expert_gate.weight": (1, d), "norm.weight": (d,)}
    return next((shape for suffix, shape in by_suffix.items() if key.endswith(suffix)), None)


def is_sparse_layer(layer_idx: int, num_experts: int, decoder_sparse_step: int, mlp_only_layers) -> bool:
    """Qwen2/Qwen3-MoE's rule: layer `layer_idx`'s MLP is a mixture of experts when there are experts, the
    layer is not in `mlp_only_layers` and `layer_idx + 1` is a multiple of `decoder_sparse_step` (>= 1)."""
    return num_experts > 0 and layer_idx not in mlp_only_layers and (layer_idx + 1) % decoder_sparse_step == 0


def check_checkpoint_against_config(folder: str | os.PathLike, config: AttnResConfig, fix: str | None = None) -> None:
    """Refuse a checkpoint folder whose tensors (read from the safetensors headers only: nothing is
    allocated) disagree with the sizes or layer count of `config`, its own config.json, before a model is
    built: a config.json that claims more rows or layers than the weights would otherwise allocate them
    first. (A config the caller gives may differ: fewer layers load the first ones, as for Llama.) `fix` ends
    a shape mismatch's message (`describe_mismatched_shapes`) for a caller other than transformers."""
    from safetensors import SafetensorError, safe_open

    shapes = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(str(file), "pt") as handle:
                shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
        except SafetensorError as err:
            raise ValueError(f"Cannot read the safetensors file {file} ({err}): it is truncated or corrupt; "
                             "download or copy it again.") from None
    layers = {int(m.group(1)) for key in shapes if (m := re.match(r"model\.layers\.(\d+)\.", key))}
    if layers and max(layers) + 1 != config.num_hidden_layers:
        raise CheckpointMismatchError(
            f"The checkpoint in {folder} has {max(layers) + 1} layers but its config.json says "
            f"num_hidden_layers={config.num_hidden_layers}; fix config.json to describe these weights.")
    mismatched = {(key, shape, implied) for key, shape in shapes.items()
                  if (implied := implied_shape(key, config)) is not None and tuple(shape) != implied}
    if mismatched:
        raise CheckpointMismatchError(describe_mismatched_shapes(mismatched, config, fix))


def check_local_folder(folder: str, given_config: AttnResConfig | None) -> None:
    """Before a local checkpoint folder is loaded: its own config.json against its weights
    (`check_checkpoint_against_config`). Weights without a config.json, and no config given, are refused:
    transformers would build a default-size model first."""
    if os.path.isfile(os.path.join(folder, "config.json")):
        check_checkpoint_against_config(folder, AttnResConfig.from_pretrained(folder))
    elif given_config is None and any(Path(folder).glob("*.safetensors")):
        raise ValueError(f"{folder} has weights but no config.json; pass the folder that save_pretrained or "
                         "attnres-convert wrote (with subfolder= if the checkpoint is in one), or config=.")


# Keys of older configs that transformers still reads (as it does for Llama), beside AttnResConfig's own.
LEGACY_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "auto_map", "quantization_config"})


@functools.cache
def own_keys() -> frozenset[str]:
    """Every key an AttnResConfig's config.json may hold (beside transformers' `_`-prefixed bookkeeping)."""
    return frozenset(AttnResConfig().to_dict()) | LEGACY_KEYS


def other_keys(config_dict: dict) -> list[str]:
    """The keys of `config_dict` that no AttnResConfig has, sorted."""
    return sorted(k for k in config_dict if not k.startswith("_") and k not in own_keys())


def reads_as_ours(config_dict: dict) -> bool:
    """Whether a config dict without this package's depth-attention fields is still this package's: every
    key is one an AttnResConfig has and every architecture one of its classes (a hand-written config that
    relies on the defaults, as a Llama one may). Another implementation's config names fields or classes of
    its own."""
    classes = {path.rsplit(".", 1)[-1] for path in AUTO_MAP.values()}
    architectures = config_dict.get("architectures") or []
    return not other_keys(config_dict) and isinstance(architectures, list) and set(architectures) <= classes


def check_not_foreign(config_dict: dict) -> None:
    """Raise `ForeignCheckpointError` for a config dict another AttnRes implementation wrote: its
    `auto_map` points at other code, or it has none of this package's depth-attention fields and fields
    or classes of its own (`reads_as_ours`); and one of another architecture (a Llama's: `model_type` is
    not `attnres`), which `attnres-convert` turns into an AttnRes checkpoint. A dict of this package's keys
    alone (an empty one is what transformers reads from a folder without config.json) takes the defaults,
    as for Llama."""
    if not isinstance(config_dict, dict):
        raise ValueError(f"config.json holds a JSON {type(config_dict).__name__}, not an object of config fields; "
                         "replace it with the config.json that save_pretrained or attnres-convert wrote.")
    if not config_dict:
        return
    model_type = config_dict.get("model_type", "attnres")
    if model_type != "attnres":
        raise ForeignCheckpointError(
            f"This config.json is a {model_type!r} checkpoint (architectures {config_dict.get('architectures')}), "
            "not an AttnRes one. Convert it: attnres-convert PATH OUT writes an AttnRes checkpoint that computes "
            "what the source does (Llama, Qwen2, Qwen3, Mistral and their mixtures of experts; docs/conversion.md); "
            "or load it with its own class, AutoModelForCausalLM.from_pretrained(PATH).")
    auto_map = config_dict.get("auto_map") or {}
    if not isinstance(auto_map, dict):
        raise ValueError(f"config.json's auto_map must be a mapping of Auto class names to code, got {auto_map!r}; "
                         "remove it, or write it as save_pretrained does.")
    foreign_code = {k: v for k, v in auto_map.items() if k in AUTO_MAP and str(v).split("--")[-1] != AUTO_MAP[k]}
    ours = [k for k in ("attn_res_mode", "attn_res_block_size") if k in config_dict]
    if not foreign_code and (ours or reads_as_ours(config_dict)):
        return
    others = other_keys(config_dict)
    found = (f"auto_map {foreign_code}" if foreign_code else
             f"none of this package's fields (attn_res_mode, attn_res_block_size); fields it has that "
             f"AttnResConfig has not: {', '.join(others[:12]) or 'none'}")
    raise ForeignCheckpointError(
        f"This config.json says model_type 'attnres' but was written by other AttnRes code ({found}, "
        f"architectures {config_dict.get('architectures')}); its fields and parameter names are not those of "
        "this package's AttnResConfig. Either load it with its own code, in a process that has not imported "
        "modeling_attnres or the attnres vLLM plugin: AutoModelForCausalLM.from_pretrained(PATH, "
        "trust_remote_code=True); or convert its weights to this package's layout: attnres-convert PATH OUT "
        "(other AttnRes layouts are read by name, see docs/conversion.md). A config.json written by hand for this "
        "package names attn_res_mode and attn_res_block_size; add them.")


__all__ = ["AUTO_MAP", "SEED_SITE_ALIASES", "AttnResConfig", "CheckpointMismatchError", "DepthSite",
           "ForeignCheckpointError", "check_checkpoint_against_config", "check_local_folder", "is_depth_parameter"]
