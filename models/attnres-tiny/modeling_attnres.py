"""Attention Residuals (Kimi Team, arXiv:2603.15031) for transformers.

Only the difference from Llama is written here: attention, MLP, RMSNorm and RoPE are transformers'
own Llama (and Qwen3, for `qk_norm`) modules. What AttnRes adds is the residual path: every
sublayer reads a softmax-weighted mix over depth (earlier blocks of the same token) instead of the
running sum. The mixing math lives in `depth_attention.py`, shared with the vLLM model.

The depth history (stored blocks and the running partial) is a local of `forward`. Depth attention
mixes vectors of one token position, so decoding needs nothing beyond the ordinary KV cache.
"""

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping
from transformers.generation import GenerationMixin
from transformers.integrations.accelerate import force_accelerate_hooks
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
    MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)
from transformers.models.qwen2_moe.modeling_qwen2_moe import (
    Qwen2MoeExperts,
    Qwen2MoeSparseMoeBlock,
    Qwen2MoeTopKRouter,
)
from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention
from transformers.models.qwen3_moe.modeling_qwen3_moe import (
    Qwen3MoeExperts,
    Qwen3MoeSparseMoeBlock,
    Qwen3MoeTopKRouter,
    load_balancing_loss_func,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_attnres import (
    AUTO_MAP,
    SEED_SITE_ALIASES,
    AttnResConfig,
    CheckpointMismatchError,
    check_local_folder,
    check_schedule_as_built,
    describe_mismatched_shapes,
)
from .depth_attention import DepthBank, SiteBoundary, acc, add_to_partial
from .depth_attention_ops import site_bank, site_boundary

# The files `save_pretrained` ships next to the weights (transformers' `custom_object_save` copies this
# module and its relative imports); `from_pretrained(..., trust_remote_code=True)` runs them.
REMOTE_CODE_FILES = ("configuration_attnres.py", "depth_attention.py", "depth_attention_cpu.py",
                     "depth_attention_cpu_source.py", "depth_attention_ops.py", "depth_attention_triton.py",
                     "modeling_attnres.py")
# The seed names of the attention site, as `from_pretrained(key_mapping=...)` patterns. Applied on load
# only: saving always writes the spec's names.
SEED_KEY_ALIASES = {rf"\.{seed}\.": f".{ours}." for seed, ours in SEED_SITE_ALIASES.items()}


class AttnResRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm; also the key norm of every depth-attention site."""


class AttnResRotaryEmbedding(LlamaRotaryEmbedding):
    """Llama's rotary embedding (reads `config.rope_parameters`)."""


class AttnResMLP(LlamaMLP):
    """Llama's gated MLP."""


class AttnResSparseMoeBlock(Qwen3MoeSparseMoeBlock):
    """A mixture-of-experts MLP: Qwen3-MoE's top-k router and routed experts (transformers' 3D expert
    tensors, so its experts implementations, `device_map` and tensor-parallel plans apply)."""


class AttnResSharedExpertMoeBlock(Qwen2MoeSparseMoeBlock):
    """A mixture-of-experts MLP with Qwen2-MoE's shared expert (a gated MLP every token passes through,
    scaled by a sigmoid gate) next to the routed experts."""


def make_mlp(config: AttnResConfig, layer_idx: int) -> nn.Module:
    """The MLP sublayer of layer `layer_idx`: a mixture of experts on sparse layers, else Llama's MLP."""
    if not config.is_sparse_layer(layer_idx):
        return AttnResMLP(config)
    block = AttnResSharedExpertMoeBlock if config.shared_expert_intermediate_size else AttnResSparseMoeBlock
    return block(config)


# On disk (and for vLLM) experts are stored one tensor per expert and projection, as transformers saves
# Qwen2/Qwen3-MoE; in memory they are transformers' stacked 3D tensors. Registered as Qwen2-MoE's mapping.
register_checkpoint_conversion_mapping("attnres", get_checkpoint_conversion_mapping("qwen2_moe"), overwrite=True)


class AttnResPseudoQuery(nn.Module):
    """The pseudo-query `w` of one depth-attention site: a `[1, d]` weight (as `Linear(d, 1, bias=False)`
    stores it), zero at init. Not an `nn.Linear`: it is never applied as one (its folded form is), and
    frameworks that swap or quantize every Linear (vLLM's Transformers backend, bitsandbytes) must
    leave it alone."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))

    def extra_repr(self) -> str:
        return f"{self.weight.shape[1]}"


class AttnResDepthMix(nn.Module):
    """One sublayer boundary (`depth_attention_ops.site_boundary`: the previous sublayer's output added into
    the partial, this site's mix, the block store, the next sublayer's RMSNorm), without parameters of its
    own: a module so that transformers' output capturing records its weights (index 1) as `depth_attentions`."""

    def forward(self, bank: DepthBank, partial: torch.Tensor | None, output: torch.Tensor | None,
                proj: AttnResPseudoQuery, key_norm: AttnResRMSNorm, closes_block: bool, norm: AttnResRMSNorm,
                keep_weights: bool = False, reuse_partial: bool = False,
                reference: bool = False) -> tuple[SiteBoundary, torch.Tensor | None]:
        """The boundary (`.normed` is the next sublayer's input) and, if `keep_weights`, the site's weights
        `[*tokens, num_sources]`. `reuse_partial`: `partial` came out of an earlier boundary that added an
        output, so its memory may take the new partial; `reference`: the torch reference runs, as a
        checkpointed layer's replay will (`depth_attention_ops.site_boundary`)."""
        boundary = site_boundary(bank, partial, output, proj.weight, key_norm.weight, key_norm.variance_epsilon,
                                 closes_block, norm.weight, norm.variance_epsilon, keep_weights,
                                 reuse_partial=reuse_partial, reference=reference)
        return boundary, boundary.weights


# transformers 5.24 renamed the KV cache's argument and output field `past_key_values` to `cache` (the old name
# deprecated until 5.40; its `generate()` passes `cache=`). The models take the cache under either name and hand
# it on under the installed version's, so this file runs, and ships as Hub remote code, on both sides.
CACHE_NAME = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_argument(past_key_values: Cache | None, kwargs: dict) -> Cache | None:
    """The KV cache a forward was given as `past_key_values` or as `cache` (taken out of `kwargs`). Before 5.24
    `cache=` is also continuous batching's paged cache, which is no `Cache` and must reach the attention as is."""
    if CACHE_NAME != "cache" and not isinstance(kwargs.get("cache"), Cache):
        return past_key_values
    cache = kwargs.pop("cache", None)
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Both cache and past_key_values were given, two different caches; pass the KV cache once "
                         f"(as {CACHE_NAME}, this transformers version's name).")
    return past_key_values if cache is None else cache


def check_input_ids(input_ids: torch.LongTensor, vocab_size: int) -> None:
    """Refuse token ids outside `[0, vocab_size)` and inputs with no token, naming the value."""
    if input_ids.numel() == 0:
        raise ValueError(f"input_ids has no tokens (shape {tuple(input_ids.shape)}); pass at least one sequence "
                         "of at least one token (for an empty prompt, start it with the tokenizer's BOS token).")
    if torch.compiler.is_compiling():                                  # a value check would break the graph
        return
    low, high = (int(v) for v in torch.aminmax(input_ids))            # one device sync, not two
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {vocab_size}); "
                         "encode the text with this model's tokenizer (or resize_token_embeddings after adding "
                         "tokens).")


# The modules whose weights a layer's boundaries read without calling them (the fused boundary takes the
# pseudo-queries and norm gains as tensors). Whatever acts only inside a module's own call misses them:
# accelerate's offloading hooks (fired here instead) and wrappers such as PEFT's `target_parameters` LoRA
# (refused: `reads_weights_of`).
LAYER_WEIGHT_HOLDERS = ["self_attention_res_proj", "self_attention_res_norm", "input_layernorm", "mlp_res_proj",
                        "mlp_res_norm", "post_attention_layernorm"]


def refuse_call_only_wrappers(holders: dict[str, nn.Module]) -> None:
    """Raise if a weight holder (by name) was replaced by an adapter wrapper (PEFT's `BaseTunerLayer`s keep
    the module they wrap as `base_layer`): it changes the weight only inside its own call, which never
    happens, so it would train and apply nothing. PEFT's `modules_to_save` copies do work (their weight is
    the copy's)."""
    for name, holder in holders.items():
        if not isinstance(holder, (AttnResPseudoQuery, AttnResRMSNorm)) and hasattr(holder, "base_layer"):
            raise ValueError(
                f"{name} is wrapped by {type(holder).__name__}, which changes {name}.weight only inside its own "
                f"call, but AttnRes reads that weight without calling {name} (the fused sublayer boundary takes "
                f"it as a tensor): the adapter would train and apply nothing. To fine-tune {name}, list it in "
                f"PEFT's modules_to_save (modules_to_save=['{name}']) instead of adapting it (target_modules, "
                f"target_parameters, LN tuning).")


def reads_weights_of(holders: list[str]) -> Callable:
    """For a forward that reads the weights of the submodules `holders` without calling them: refuses
    wrappers that act only in a call (`refuse_call_only_wrappers`) and fires accelerate's offloading hooks
    (transformers' `force_accelerate_hooks`), both only where a holder is not one of ours or has a hook in its
    own `__dict__` (where accelerate's `add_hook_to_module` puts it). The common case, plain holders without
    offloading, is one dict lookup per holder: `force_accelerate_hooks` looks each hook up through
    `nn.Module.__getattr__`, ~28 us a layer in eager decoding (2 % of a SmolLM2 step), and traced, those
    lookups became ~35 guards per layer, checked before every compiled step. Dynamo does not guard the dict
    check; a graph traced before offloading is retraced anyway, since offloading moves the weights it
    guards on (tested)."""
    plain = (AttnResPseudoQuery, AttnResRMSNorm)

    def decorator(forward: Callable) -> Callable:
        hooked = force_accelerate_hooks(holders)(forward)

        @functools.wraps(forward)
        def wrapped(self, *args, **kwargs):
            modules = self._modules
            if all(isinstance(modules[name], plain) and "_hf_hook" not in modules[name].__dict__ for name in holders):
                return forward(self, *args, **kwargs)
            refuse_call_only_wrappers({name: modules[name] for name in holders})
            return hooked(self, *args, **kwargs)
        return wrapped
    return decorator


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """A Llama decoder layer whose two sublayers read depth-attention mixes instead of the residual sum."""

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        attention_cls = Qwen3Attention if config.qk_norm else LlamaAttention
        self.self_attn = attention_cls(config=config, layer_idx=layer_idx)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attention_res_proj = AttnResPseudoQuery(config.hidden_size)
        self.self_attention_res_norm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp_res_proj = AttnResPseudoQuery(config.hidden_size)
        self.mlp_res_norm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.depth_mix = AttnResDepthMix()
        self.attn_closes_block = config.depth_sites[2 * layer_idx].closes_block
        self.mlp_closes_block = config.depth_sites[2 * layer_idx + 1].closes_block
        self.stores = self.attn_closes_block + self.mlp_closes_block      # sources this layer adds to the bank

    @reads_weights_of(LAYER_WEIGHT_HOLDERS)
    def forward(
        self,
        storage: torch.Tensor,
        inv_storage: torch.Tensor,
        num_stored: int,
        partial: torch.Tensor | None,
        output: torch.Tensor | None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        output_depth_attentions: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """Takes the depth history (a `DepthBank`'s fields) and the previous sublayer's output, not yet
        added (`output`; None at layer 0, where `partial` is the embedding); returns the new bank's tensors
        (`num_stored + self.stores` sources), the new partial and this layer's MLP output, likewise not yet
        added. The sites' weights are recorded when asked. The KV cache is in `kwargs`, for the attention.

        The bank crosses the call as tensors, not as a `DepthBank`: gradient checkpointing with
        `use_reentrant=True` tracks gradients only through the tensors passed and returned at the top level
        of the checkpointed call, so through a tuple every gradient into the depth history (all earlier
        layers and the embedding) would be dropped without a word."""
        bank = DepthBank(storage, inv_storage, num_stored)
        # Past layer 0 the partial is the forward's own (an earlier boundary made it): its memory is reused.
        # (At layer 0 it is None by the MLP's site: site 0 stores the embedding as block 0.) Not while
        # checkpointing, whose recomputation reads the layer's inputs again, and which differentiates the
        # torch reference: a reentrant checkpoint's first forward (no autograd) must compute the same values.
        checkpointed = self.gradient_checkpointing and self.training
        owned = output is not None and not checkpointed
        boundary, _ = self.depth_mix(bank, partial, output, self.self_attention_res_proj,
                                     self.self_attention_res_norm, self.attn_closes_block, self.input_layernorm,
                                     output_depth_attentions, reuse_partial=owned, reference=checkpointed)
        h, _ = self.self_attn(
            hidden_states=boundary.normed,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        boundary, _ = self.depth_mix(boundary.bank, boundary.partial, h, self.mlp_res_proj, self.mlp_res_norm,
                                     self.mlp_closes_block, self.post_attention_layernorm, output_depth_attentions,
                                     reuse_partial=owned, reference=checkpointed)
        del h                                  # now in the partial: freed before the MLP's peak, as Llama frees it
        bank = boundary.bank
        return bank.storage, bank.inv_storage, boundary.partial, self.mlp(boundary.normed)


class AttnResPreTrainedModel(PreTrainedModel):
    config: AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _skip_keys_device_placement = [CACHE_NAME]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "attentions": [LlamaAttention, Qwen3Attention],
        # Every site in order: attention and MLP site of each layer, then the output site.
        "depth_attentions": OutputRecorder(AttnResDepthMix, index=1),
        "router_logits": [OutputRecorder(Qwen3MoeTopKRouter, index=0), OutputRecorder(Qwen2MoeTopKRouter, index=0)],
    }

    def __init__(self, config: AttnResConfig, *inputs, **kwargs):
        config.validate()   # a config edited after construction was type-checked only: check its values too
        super().__init__(config, *inputs, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, key_mapping: dict[str, str] | None = None, ignore_mismatched_sizes: bool = False,
                        output_loading_info: bool = False, **kwargs):
        """`PreTrainedModel.from_pretrained`, also accepting the seed names of the attention site, and
        failing on a checkpoint whose tensor shapes disagree with its config with an error that names
        every such tensor (transformers' own error only points at a logged report). A local folder is
        checked against its config from the safetensors headers before anything is allocated."""
        path = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        folder = os.path.join(path, kwargs.get("subfolder") or "") if path is not None else None
        if not ignore_mismatched_sizes and folder is not None and os.path.isdir(folder):
            check_local_folder(folder, given_config=kwargs.get("config"))
        model, info = super().from_pretrained(
            *args, key_mapping={**SEED_KEY_ALIASES, **(key_mapping or {})}, ignore_mismatched_sizes=True,
            output_loading_info=True, **kwargs)
        if info["mismatched_keys"] and not ignore_mismatched_sizes:
            raise CheckpointMismatchError(describe_mismatched_shapes(info["mismatched_keys"], model.config))
        # transformers reverses load-time renamings on save; the aliases must not be reversed.
        aliases = [[pattern] for pattern in SEED_KEY_ALIASES]
        conversions = getattr(model, "_weight_conversions", None) or []
        model._weight_conversions = [c for c in conversions if list(getattr(c, "source_patterns", [])) not in aliases]
        model._weight_conversions = model._weight_conversions or None
        return (model, info) if output_loading_info else model

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`PreTrainedModel.save_pretrained`: transformers copies the modeling files (`REMOTE_CODE_FILES`,
        the classes are registered for the Auto classes) and this adds the whole `AUTO_MAP`, so that the
        folder (and a `push_to_hub` of it) loads with `trust_remote_code=True` for AutoConfig, AutoModel,
        AutoModelForCausalLM and the task heads' Auto classes where this package is not installed. An
        installed `modeling_attnres` still takes precedence when it is."""
        check_schedule_as_built(self.config, self.base_model.built_sublayers_per_block)
        self.config.auto_map = dict(AUTO_MAP)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module):
        # Pseudo-queries start at zero (uniform mixing at step 0); the generic Linear init would not.
        if isinstance(module, AttnResPseudoQuery):
            init.zeros_(module.weight)
            return
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, Qwen3MoeExperts | Qwen2MoeExperts):         # 3D expert tensors
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, Qwen3MoeTopKRouter | Qwen2MoeTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)


@dataclass
class AttnResModelOutputWithPast(BaseModelOutputWithPast):
    """`BaseModelOutputWithPast` plus `depth_attentions`: one `[batch, seq, num_sources]` tensor per
    site (attention and MLP of every layer, then the output site), when `output_depth_attentions=True`;
    and, for mixtures of experts, `router_logits` (one `[tokens, num_experts]` per sparse layer) when
    `output_router_logits=True`."""

    depth_attentions: tuple[torch.Tensor, ...] | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None


@dataclass
class AttnResCausalLMOutputWithPast(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus `depth_attentions`, `router_logits` (see `AttnResModelOutputWithPast`)
    and `aux_loss`, the routers' load-balancing loss, as Qwen3-MoE returns it."""

    aux_loss: torch.FloatTensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    depth_attentions: tuple[torch.Tensor, ...] | None = None


class AttnResModel(AttnResPreTrainedModel):
    """The AttnRes decoder stack: embedding, layers, the output depth-attention site and the final norm."""

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.output_attn_res_proj = AttnResPseudoQuery(config.hidden_size)
        self.output_attn_res_norm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.output_depth_mix = AttnResDepthMix()
        self.norm = AttnResRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = AttnResRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.built_sublayers_per_block = config.sublayers_per_block      # the layers' schedule, for save_pretrained
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @reads_weights_of(["output_attn_res_proj", "output_attn_res_norm", "norm"])
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_depth_attentions: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResModelOutputWithPast:
        r"""
        output_hidden_states (`bool`, *optional*):
            Return the embedding and, after each layer, the equivalent residual stream (the sum of all
            sources); the last entry is `last_hidden_state`, as in every transformers model.
        output_depth_attentions (`bool`, *optional*):
            Return the depth-attention weights of every site, `[batch, seq, num_sources]` each (recorded
            by transformers' output capturing from every `AttnResDepthMix`).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        past_key_values = cache_argument(past_key_values, kwargs)
        if inputs_embeds is None:
            check_input_ids(input_ids, self.embed_tokens.num_embeddings)      # the embedding in use
            inputs_embeds = self.embed_tokens(input_ids)
        elif inputs_embeds.shape[1] == 0:
            raise ValueError(f"inputs_embeds has no tokens (shape {tuple(inputs_embeds.shape)}); pass at least one.")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{CACHE_NAME: past_key_values},
        )
        position_embeddings = self.rotary_emb(inputs_embeds, position_ids=position_ids)
        output_hidden_states = bool(output_hidden_states if output_hidden_states is not None
                                    else self.config.output_hidden_states)
        output_depth_attentions = bool(output_depth_attentions)

        bank = site_bank(inputs_embeds, self.config)                 # [batch, seq, capacity, d]
        partial, output = inputs_embeds, None                          # the embedding (block 0), no output yet
        all_hidden_states = [inputs_embeds] if output_hidden_states else None
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            storage, inv_storage, partial, output = decoder_layer(
                bank.storage,                          # the bank as tensors: see the layer's forward
                bank.inv_storage,
                bank.num_stored,
                partial,
                output,
                attention_mask=causal_mask,
                position_ids=position_ids,
                use_cache=use_cache,
                position_embeddings=position_embeddings,
                output_depth_attentions=output_depth_attentions,
                **{CACHE_NAME: past_key_values},
                **kwargs,
            )
            bank = DepthBank(storage, inv_storage, bank.num_stored + decoder_layer.stores)
            if output_hidden_states:
                stream = acc(bank.sources).sum(-2) + add_to_partial(partial, output)
                all_hidden_states.append(stream.to(inputs_embeds.dtype))

        boundary, _ = self.output_depth_mix(bank, partial, output, self.output_attn_res_proj,
                                            self.output_attn_res_norm, False, self.norm, output_depth_attentions,
                                            reuse_partial=output is not None)
        hidden_states = boundary.normed
        if output_hidden_states:
            all_hidden_states[-1] = hidden_states
        return AttnResModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden_states) if output_hidden_states else None,
            **{CACHE_NAME: past_key_values},
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    """AttnRes with a language-modelling head, ready for `generate()` and `Trainer`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _validate_model_kwargs(self, model_kwargs: dict) -> None:
        """`generate()`'s check of its extra arguments, with a clear word for `output_depth_attentions`:
        transformers would call it unused and suggest a typo, but its output has no field for them."""
        if "output_depth_attentions" in model_kwargs:
            raise ValueError("generate() does not return depth attentions (its output has no field for them); "
                             "drop output_depth_attentions and run one forward pass over the generated ids: "
                             "model(output_ids, output_depth_attentions=True).depth_attentions gives every "
                             "generated token's weights as decoding computed them.")
        super()._validate_model_kwargs(model_kwargs)

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> AttnResCausalLMOutputWithPast:
        """Same contract as `LlamaForCausalLM.forward` (and, for mixtures of experts, as
        `Qwen3MoeForCausalLM.forward`: `output_router_logits=True` returns the router logits and the
        load-balancing `aux_loss`, added to the loss with `router_aux_loss_coef`);
        `output_depth_attentions=True` adds the depth weights."""
        output_router_logits = bool(output_router_logits if output_router_logits is not None
                                    else self.config.output_router_logits) and self.config.num_experts > 0
        past_key_values = cache_argument(past_key_values, kwargs)
        outputs: AttnResModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, slice_indices, :])

        loss = aux_loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        if output_router_logits:
            aux_loss = load_balancing_loss_func(outputs.router_logits, self.config.num_experts,
                                                self.config.num_experts_per_tok, attention_mask)
            if loss is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
        return AttnResCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            depth_attentions=outputs.depth_attentions,
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
        )


class AttnResTaskHead:
    """What the task heads add to transformers' generic ones (`GenericFor*`, as Llama's heads use): those build
    their base model with `AutoModel.from_config(config)`, so AutoModel is told about `config`'s class first.
    Installed, the package has registered it; as Hub remote code, transformers loads the config's module and
    this one from different folders, so `config`'s class is another copy of `AttnResConfig`."""

    def __init__(self, config: AttnResConfig):
        AutoModel.register(type(config), AttnResModel, exist_ok=True)
        super().__init__(config)


class AttnResForSequenceClassification(AttnResTaskHead, GenericForSequenceClassification, AttnResPreTrainedModel):
    """AttnRes with a classification head on each sequence's last non-padding token, as Llama's."""


class AttnResForTokenClassification(AttnResTaskHead, GenericForTokenClassification, AttnResPreTrainedModel):
    """AttnRes with a classification head on every token, as Llama's."""


class AttnResForQuestionAnswering(AttnResTaskHead, GenericForQuestionAnswering, AttnResPreTrainedModel):
    """AttnRes with an extractive question-answering head (span start and end logits), as Llama's."""


# Saving copies this module and its siblings next to the weights and writes `auto_map` (`custom_object_save`).
AttnResConfig.register_for_auto_class()
for _model, _auto_class in ((AttnResModel, "AutoModel"), (AttnResForCausalLM, "AutoModelForCausalLM"),
                            (AttnResForSequenceClassification, "AutoModelForSequenceClassification"),
                            (AttnResForTokenClassification, "AutoModelForTokenClassification"),
                            (AttnResForQuestionAnswering, "AutoModelForQuestionAnswering")):
    _model.register_for_auto_class(_auto_class)

# Some of transformers' behaviour goes by class name through its own task tables, not the Auto registry:
# Trainer's label smoothing shifts the labels only for names in the causal-LM table (else every position
# is trained on its own token), and the pipelines log "not supported" for names outside their task's table.
for _table, _model in ((MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, AttnResForCausalLM),
                       (MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, AttnResForSequenceClassification),
                       (MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES, AttnResForTokenClassification),
                       (MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES, AttnResForQuestionAnswering)):
    _table.setdefault(AttnResConfig.model_type, _model.__name__)

__all__ = ["AttnResPreTrainedModel", "AttnResModel", "AttnResForCausalLM", "AttnResForSequenceClassification",
           "AttnResForTokenClassification", "AttnResForQuestionAnswering"]
