"""Inference-only AttnRes for vLLM, written as the diff against vLLM's own `llama.py`.

Class names match the transformers model in `modeling_attnres/modeling_attnres.py` so the two read
side by side. Attention, MLP, RMSNorm, RoPE, embeddings and the LM head are vLLM's layers (paged KV
cache, tensor-parallel linears); `AttnResAttention` only adds Qwen3-style q/k norm when
`config.qk_norm`. What AttnRes changes is the residual path: every sublayer reads a depth-attention
mix over earlier blocks of the same token, computed by the project's one site helper
(`modeling_attnres.depth_attention_ops`).

The depth history (the stored sources and the running partial) lives for one forward pass: vLLM
hands the model flattened `[num_tokens]` inputs, and depth attention only mixes vectors of one token
position, so nothing goes into the KV cache, and prefill, decode, chunked prefill and prefix caching
need nothing extra. The bank is a `DepthBank` allocated by each forward pass with room for every
source (`start_depth`) and filled in place at each block-closing boundary (`site_boundary`), as in
the transformers model. It must be
a local of the forward pass and never a module buffer: under `torch.compile` (vLLM's default) an
in-place write into a module buffer becomes a copy of the whole buffer per write, while a buffer
created inside the traced forward is written in place (the README has both measurements).
Which sites close a block is fixed at construction (Python bools per layer, from
`config.depth_sites`), so the traced graph has no data-dependent branches.

Pipeline parallelism (`SupportsPP`): each rank builds and loads only its layers; between stages the
depth history travels in `IntermediateTensors` (see `AttnResModel.make_empty_intermediate_tensors`).
"""

import os
import re
from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import MixtureOfExperts, SupportsLoRA, SupportsPP
from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
from vllm.model_executor.models.qwen3_moe import Qwen3MoeSparseMoeBlock
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    is_pp_missing_parameter,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from modeling_attnres.configuration_attnres import SEED_SITE_ALIASES, AttnResConfig, check_checkpoint_against_config
from modeling_attnres.depth_attention import DepthBank, SiteBoundary, add_to_partial, empty_bank
from modeling_attnres.depth_attention_ops import site_bank, site_boundary

logger = init_logger(__name__)

# The one table of checkpoint names (HF name -> this module's name). q/k/v and gate/up load into the
# fused `qkv_proj` / `gate_up_proj` (shard ids as in vLLM's llama.py); the seed pseudo-code's names
# for the attention site (`SEED_SITE_ALIASES`) are aliases. The leading dots keep `.attn_res_proj.`
# from matching `output_attn_res_proj`.
HF_TO_VLLM = WeightsMapper(
    orig_to_new_substr={f".{seed}.": f".{ours}." for seed, ours in SEED_SITE_ALIASES.items()},
    orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".mlp.gate_proj": (".mlp.gate_up_proj", 0),
        ".mlp.up_proj": (".mlp.gate_up_proj", 1),
        # A mixture of experts' shared expert; the routed experts (`.experts.E.gate_proj`) are loaded by
        # vLLM's FusedMoE itself, as in vLLM's qwen3_moe.py.
        ".shared_expert.gate_proj": (".shared_expert.gate_up_proj", 0),
        ".shared_expert.up_proj": (".shared_expert.gate_up_proj", 1),
    },
)
EXPERT_KEY = re.compile(r"(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight\Z")


def packed_modules(mapper: WeightsMapper) -> dict[str, list[str]]:
    """Fused module -> the checkpoint modules stacked into it, from a mapper's stacked table."""
    packed: dict[str, list[str]] = {}
    for source, (fused, _) in mapper.orig_to_new_stacked.items():
        sources = packed.setdefault(fused.rsplit(".", 1)[-1], [])
        if source.rsplit(".", 1)[-1] not in sources:
            sources.append(source.rsplit(".", 1)[-1])
    return packed


def make_mlp(vllm_config: VllmConfig, config: AttnResConfig, layer_idx: int, prefix: str) -> nn.Module:
    """Layer `layer_idx`'s MLP sublayer: vLLM's Qwen3-MoE block (FusedMoE experts, and Qwen2-MoE's shared
    expert when the config has one) on sparse layers, vLLM's Llama MLP otherwise."""
    if config.is_sparse_layer(layer_idx):
        return Qwen3MoeSparseMoeBlock(vllm_config=vllm_config, prefix=prefix)
    return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    quant_config=vllm_config.quant_config, bias=config.mlp_bias, prefix=prefix)


class AttnResPseudoQuery(nn.Module):
    """The pseudo-query `w` of one depth-attention site; `weight` is `[1, d]` as in the HF Linear."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))


def boundary(bank: DepthBank, partial: torch.Tensor | None, output: torch.Tensor | None, proj: AttnResPseudoQuery,
             key_norm: RMSNorm, closes_block: bool, norm: RMSNorm, reuse_partial: bool = False) -> SiteBoundary:
    """One sublayer boundary (`depth_attention_ops.site_boundary`): `output` added into the partial, the
    site's mix, the block store when the site closes one, and `norm` (the next sublayer's RMSNorm) of the
    mix as `.normed`. `reuse_partial`: `partial` came out of an earlier boundary that added an output, so
    its memory may take the new partial. `output` is a sublayer's result that nothing reads afterwards, so
    its memory may take `.normed`, as vLLM's fused add+norm writes Llama's."""
    return site_boundary(bank, partial, output, proj.weight, key_norm.weight, key_norm.variance_epsilon,
                         closes_block, norm.weight, norm.variance_epsilon, reuse_partial=reuse_partial,
                         consume_output=True)


class AttnResAttention(LlamaAttention):
    """vLLM's Llama attention plus Qwen3-style per-head q/k RMSNorm when `config.qk_norm`."""

    def __init__(self, config: AttnResConfig, **kwargs):
        super().__init__(config=config, **kwargs)
        self.qk_norm = bool(config.qk_norm)
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _norm_heads(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        by_head = x.view(*x.shape[:-1], x.shape[-1] // self.head_dim, self.head_dim)
        return norm(by_head).view(x.shape)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """Same as `LlamaAttention.forward`, with q/k normalised per head before RoPE."""
        if not self.qk_norm:
            return super().forward(positions, hidden_states)
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self._norm_heads(q, self.q_norm), self._norm_heads(k, self.k_norm)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class AttnResDecoderLayer(nn.Module):
    """A Llama decoder layer whose two sublayers read depth-attention mixes instead of the residual sum."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: AttnResConfig = vllm_config.model_config.hf_config
        quant_config = vllm_config.quant_config
        layer_idx = extract_layer_index(prefix)
        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = AttnResAttention(
            config,
            hidden_size=d,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            max_position_embeddings=config.max_position_embeddings,
            quant_config=quant_config,
            bias=config.attention_bias,
            bias_o_proj=config.attention_bias,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.self_attn",
        )
        self.mlp = make_mlp(vllm_config, config, layer_idx, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(d, eps=eps)
        self.post_attention_layernorm = RMSNorm(d, eps=eps)
        self.self_attention_res_proj = AttnResPseudoQuery(d)
        self.self_attention_res_norm = RMSNorm(d, eps=eps)
        self.mlp_res_proj = AttnResPseudoQuery(d)
        self.mlp_res_norm = RMSNorm(d, eps=eps)
        self.attn_closes_block = config.depth_sites[2 * layer_idx].closes_block
        self.mlp_closes_block = config.depth_sites[2 * layer_idx + 1].closes_block

    def forward(self, positions: torch.Tensor, bank: DepthBank, partial: torch.Tensor | None,
                output: torch.Tensor | None) -> tuple[DepthBank, torch.Tensor | None, torch.Tensor]:
        """Both boundaries and sublayers. Takes the depth history and the previous sublayer's output, not
        yet added (None at a stage's first layer); returns the bank (with any block closed here), the
        partial and this layer's MLP output, likewise not yet added."""
        # Past a stage's first layer the partial is the forward's own (an earlier boundary made it): its
        # memory is reused. At a later stage's first layer it may be the received partial, which a site
        # that closes no block passes through (on the first stage, site 0 stores the embedding).
        owned = output is not None
        b = boundary(bank, partial, output, self.self_attention_res_proj, self.self_attention_res_norm,
                     self.attn_closes_block, self.input_layernorm, owned)
        h = self.self_attn(positions=positions, hidden_states=b.normed)
        b = boundary(b.bank, b.partial, h, self.mlp_res_proj, self.mlp_res_norm, self.mlp_closes_block,
                     self.post_attention_layernorm, owned)
        del h                                  # in the partial now (on a CPU its memory holds the MLP's input)
        return b.bank, b.partial, self.mlp(b.normed)


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": {0: "b"},
        "positions": {0: "b"},
        "intermediate_tensors": {0: "b"},
        "inputs_embeds": {0: "b"},
    },
)
class AttnResModel(nn.Module):
    """The AttnRes decoder stack: embedding, layers, the output depth-attention site and the final norm.

    Under pipeline parallelism the first rank embeds, each rank runs its layers, and the last rank
    mixes the output site and applies the final norm; the others hand on `IntermediateTensors`
    with the depth history (`INTERMEDIATE_KEYS`).
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: AttnResConfig = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.vocab_size = config.vocab_size
        d, eps = config.hidden_size, config.rms_norm_eps
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(self.vocab_size, d, quant_config=self.quant_config)
        else:
            self.embed_tokens = PPMissingLayer()
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AttnResDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        if pp.is_last_rank:
            self.output_attn_res_proj = AttnResPseudoQuery(d)
            self.output_attn_res_norm = RMSNorm(d, eps=eps)
            self.norm = RMSNorm(d, eps=eps)
        else:
            # Separate placeholders: one module under three names would be found under one name only.
            self.output_attn_res_proj, self.output_attn_res_norm, self.norm = (PPMissingLayer() for _ in range(3))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[tokens, d]`."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Final-normed hidden states `[tokens, d]` for flattened `[tokens]` inputs (last rank), or
        the depth history after this rank's layers (other ranks)."""
        if get_pp_group().is_first_rank:
            embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
            bank, partial = self.start_depth(embeds)
        else:
            bank, partial = unpack_depth(intermediate_tensors, self.config.depth_sites[-1].num_stored)
        output = None                                       # the last sublayer's output, not yet in the partial
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            bank, partial, output = layer(positions, bank, partial, output)
        if not get_pp_group().is_last_rank:
            return pack_depth(bank, partial if output is None else add_to_partial(partial, output))
        return boundary(bank, partial, output, self.output_attn_res_proj, self.output_attn_res_norm, False,
                        self.norm, output is not None).normed

    def start_depth(self, embeds: torch.Tensor) -> tuple[DepthBank, torch.Tensor]:
        """The depth history before layer 0: an empty bank with room for every source of the schedule,
        and the embedding as the partial (block 0)."""
        return site_bank(embeds, self.config, same_on_every_rank=True), add_to_partial(None, embeds)

    def make_empty_intermediate_tensors(self, batch_size: int, dtype: torch.dtype,
                                        device: torch.device) -> IntermediateTensors:
        """The receive buffer of this rank: the depth history entering its first layer.

        `bank_sources [batch, n, d]`, `bank_inv_rms [batch, n]` and `partial [batch, d]`, where
        `n` is the number of sources stored before this rank's first site. vLLM copies what the
        previous rank sends into this buffer, so its dtypes are those the first rank produces for
        a model of `dtype` (found by running `start_depth` on a shape-only tensor): a different
        dtype would round the bank at every stage boundary.
        """
        d = self.config.hidden_size
        n = self.config.depth_sites[2 * self.start_layer].num_stored
        bank, partial = self.start_depth(torch.empty(batch_size, d, dtype=dtype, device="meta"))
        return IntermediateTensors({
            "bank_sources": torch.zeros(batch_size, n, d, dtype=bank.sources.dtype, device=device),
            "bank_inv_rms": torch.zeros(batch_size, n, dtype=bank.inv_rms.dtype, device=device),
            "partial": torch.zeros(batch_size, d, dtype=partial.dtype, device=device),
        })


INTERMEDIATE_KEYS = ("bank_sources", "bank_inv_rms", "partial")


def pack_depth(bank: DepthBank, partial: torch.Tensor) -> IntermediateTensors:
    """What a non-last pipeline rank sends on: the stored sources, their inverse RMS, the partial
    (the written rows only, contiguous, as the receive buffers of `make_empty_intermediate_tensors`)."""
    tensors = (bank.sources.contiguous(), bank.inv_rms.contiguous(), partial)
    return IntermediateTensors(dict(zip(INTERMEDIATE_KEYS, tensors)))


def unpack_depth(intermediate_tensors: IntermediateTensors, capacity: int) -> tuple[DepthBank, torch.Tensor]:
    """The depth history a non-first pipeline rank receives (see `pack_depth`), in a bank with room for
    `capacity` sources, so that this rank's blocks are stored in place too."""
    sources, inv_rms, partial = (intermediate_tensors[key] for key in INTERMEDIATE_KEYS)
    n = sources.shape[-2]
    bank = empty_bank(partial, capacity, sources.dtype)
    if bank.storage.shape[-2] <= n:                        # nothing left to store here (or autograd)
        return DepthBank(sources, inv_rms, num_stored=n), partial
    bank.storage[..., :n, :] = sources
    bank.inv_storage[..., :n] = inv_rms
    return DepthBank(bank.storage, bank.inv_storage, num_stored=n), partial


class AttnResForCausalLM(nn.Module, SupportsLoRA, SupportsPP, MixtureOfExperts):
    """AttnRes with vLLM's LM head and logits processor; loads the transformers checkpoints. With experts
    it declares vLLM's `MixtureOfExperts` interface (expert parallelism, EPLB) as vLLM's Qwen3-MoE does;
    a dense model has no MoE layer, which is what vLLM checks."""

    hf_to_vllm_mapper = HF_TO_VLLM
    packed_modules_mapping = packed_modules(HF_TO_VLLM)
    embedding_modules = {
        "embed_tokens": "input_embeddings",
        "lm_head": "output_embeddings",
    }

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: AttnResConfig = vllm_config.model_config.hf_config
        check_before_allocating(vllm_config.model_config, config)
        check_cpu_attention(vllm_config, config)
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = AttnResModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                          quant_config=vllm_config.quant_config,
                                          prefix=maybe_prefix(prefix, "lm_head"))
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            self.logits_processor = LogitsProcessor(config.vocab_size,
                                                    scale=getattr(config, "logit_scale", 1.0))
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors
        self.set_moe_attributes()

    def set_moe_attributes(self) -> None:
        """`MixtureOfExperts`'s counts, from this rank's sparse layers (none for a dense model)."""
        blocks = [layer.mlp for layer in self.model.layers if isinstance(getattr(layer, "mlp", None),
                                                                        Qwen3MoeSparseMoeBlock)]
        self.moe_layers = [block.experts for block in blocks]
        self.num_moe_layers = len(blocks)
        self.num_expert_groups = 1
        self.num_shared_experts = int(self.config.shared_expert_intermediate_size > 0)
        self.num_logical_experts = self.num_routed_experts = self.config.num_experts
        first = blocks[0] if blocks else None
        self.num_physical_experts = first.n_physical_experts if first else 0
        self.num_local_physical_experts = first.n_local_physical_experts if first else 0
        self.num_redundant_experts = first.n_redundant_experts if first else 0

    def update_physical_experts_metadata(self, num_physical_experts: int, num_local_physical_experts: int) -> None:
        """EPLB's rebalancing: the new physical expert counts, on every MoE block (as vLLM's Qwen3-MoE)."""
        self.num_physical_experts, self.num_local_physical_experts = num_physical_experts, num_local_physical_experts
        self.num_redundant_experts = num_physical_experts - self.num_logical_experts
        for layer in self.model.layers:
            if isinstance(getattr(layer, "mlp", None), Qwen3MoeSparseMoeBlock):
                layer.mlp.n_local_physical_experts = num_local_physical_experts
                layer.mlp.n_physical_experts = num_physical_experts
                layer.mlp.n_redundant_experts = self.num_redundant_experts
                layer.mlp.experts.update_expert_map()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[tokens, d]`."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        """Hidden states `[tokens, d]`, or the depth history on a non-last rank (see `AttnResModel.forward`)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits `[tokens, vocab]` from the LM head."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers AttnRes checkpoint through vLLM's `AutoWeightsLoader` and `HF_TO_VLLM`.

        The first load must be the whole checkpoint: it raises `ValueError` listing every missing and
        unexpected key, after reading all of it. Later loads (vLLM's in-place `reload_weights`, which
        `weights.update_weights` drives after checking the update) may carry any subset; an unknown
        name is then logged and skipped rather than raised, since an exception inside vLLM's reload
        would leave layers unmaterialised. Under pipeline parallelism each rank loads and checks only
        its own parameters; keys of other ranks' layers are skipped, never reported.
        """
        first = not getattr(self, "weights_loaded", False)
        # Before the weights are read: vLLM's classify adapter consumes `score.bias` on the way in and only
        # then adds it as a parameter, so it is not a key this method must see.
        expected = self.checkpoint_keys() if first else set()
        mapper = checkpoint_mapper(self)
        params = dict(self.named_parameters(remove_duplicate=False))  # a tied lm_head included
        renames = mapper.get_rename_mapper()                            # aliases only, no fusing
        seen: set[str] = set()
        unexpected: list[str] = []

        def known(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                target = mapper.map_name(name)
                if target is None or is_pp_missing_parameter(target, self):  # dropped, or another rank's
                    continue
                if target not in params and not self.is_expert_key(target, params):
                    unexpected.append(name)
                    continue
                seen.add(renames.map_name(name))
                yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(known(weights), mapper=HF_TO_VLLM)
        missing = sorted(expected - seen)
        if first and (missing or unexpected):
            raise ValueError(
                f"The checkpoint does not match AttnResForCausalLM ({len(params)} parameters, "
                f"tie_word_embeddings={self.config.tie_word_embeddings}).\n"
                f"Missing keys ({len(missing)}): {missing}\n"
                f"Unexpected keys ({len(unexpected)}): {sorted(unexpected)}"
            )
        if unexpected:
            logger.error("Weight update: skipped %d names that are not parameters of AttnResForCausalLM: %s",
                         len(unexpected), sorted(unexpected))
        self.weights_loaded = True
        return loaded

    def is_expert_key(self, key: str, params: dict) -> bool:
        """Whether `key` is a routed expert's checkpoint tensor (`...experts.E.gate_proj.weight`) of an MoE
        block on this rank, with `E` one of the model's experts (vLLM's FusedMoE loads it)."""
        match = EXPERT_KEY.match(key)
        return bool(match) and int(match.group(2)) < self.config.num_experts and any(
            name.startswith(match.group(1) + ".") for name in params)

    def resolve_checkpoint_key(self, name: str) -> str:
        """A checkpoint name with the seed aliases resolved (and a tied `lm_head.weight` as the embedding)."""
        key = checkpoint_mapper(self).get_rename_mapper().map_name(name) or name
        return "model.embed_tokens.weight" if key == "lm_head.weight" and self.config.tie_word_embeddings else key

    def checkpoint_target(self, key: str) -> tuple[str | None, str | int | None]:
        """`(parameter name, shard id)` a checkpoint key loads into on this rank; `(None, None)` when it
        is another pipeline rank's (or dropped)."""
        mapped = checkpoint_mapper(self)._map_name_with_shard(key)
        if mapped is None or is_pp_missing_parameter(mapped[0], self):
            return None, None
        return mapped

    def checkpoint_keys(self) -> set[str]:
        """The checkpoint keys (aliases resolved) this model's parameters load from; fused ones expanded.

        A tied `lm_head` is not among them; KV-cache scales (which a checkpoint may lack) neither.
        """
        skip = {f"{name}." for name, module in self.named_modules()
                if isinstance(getattr(module, "quant_method", None), BaseKVCacheMethod)}
        keys = set()
        for name, _ in self.named_parameters():
            if any(name.startswith(prefix) for prefix in skip):
                continue
            if ".experts." in name:                              # FusedMoE: every routed expert, one tensor each
                block = name.split(".experts.")[0]
                projections = ("gate", "up") if name.endswith("w13_weight") else ("down",)
                keys.update(f"{block}.experts.{e}.{p}_proj.weight" for e in range(self.config.num_experts)
                            for p in projections)
                continue
            fused = next((f for f in self.packed_modules_mapping if f".{f}." in name), None)
            sources = self.packed_modules_mapping[fused] if fused else []
            keys.update([name.replace(f".{fused}.", f".{s}.") for s in sources] or [name])
        return keys


def check_before_allocating(model_config, config: AttnResConfig) -> None:
    """Refuse, before any weight is allocated, a local checkpoint whose tensors disagree with its config
    (`check_checkpoint_against_config`), and a tokenizer with more tokens than the model has rows: a normal
    request could then produce an id past the embedding and bring the engine down."""
    if os.path.isdir(model_config.model):
        check_checkpoint_against_config(model_config.model, config, fix="Fix config.json to describe these "
                                        "weights (or drop the --hf-overrides that change these sizes).")
    tokenizer = getattr(model_config, "tokenizer", None)
    if tokenizer and os.path.isdir(tokenizer) and not getattr(model_config, "skip_tokenizer_init", False):
        # vLLM's own loader, as the engine loads it: its mode, revision and trust_remote_code apply.
        from vllm.tokenizers.registry import cached_tokenizer_from_config

        size = len(cached_tokenizer_from_config(model_config))
        if size > config.vocab_size:
            raise ValueError(f"The tokenizer in {tokenizer} has {size} tokens but the model's vocab_size is "
                             f"{config.vocab_size}: ids {config.vocab_size}..{size - 1} have no embedding row. Resize "
                             "the embeddings (model.resize_token_embeddings(len(tokenizer)) and save), or serve the "
                             "tokenizer the model was trained with.")


def check_cpu_attention(vllm_config: VllmConfig, config: AttnResConfig) -> None:
    """On a CPU, a head size vLLM's CPU attention has no kernel for is refused before allocating: vLLM itself
    starts the server, reports it healthy and dies on the first request (`Unsupported CPU attention
    configuration`). Asked of the kernel's own scheduler with a one-token request, as the engine will ask it:
    vLLM's list of supported sizes (`CPUAttentionBackend.get_supported_head_sizes`) omits some it runs (48)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return                                          # GPU backends check their head sizes themselves
    dtype, block_size = vllm_config.model_config.dtype, vllm_config.cache_config.block_size or 128
    if cpu_attention_runs(config.head_dim, config, dtype, block_size):
        return
    sizes = [size for size in range(16, 257, 16) if cpu_attention_runs(size, config, dtype, block_size)]
    raise ValueError(f"head_dim {config.head_dim} (hidden_size {config.hidden_size}, num_attention_heads "
                     f"{config.num_attention_heads}) has no kernel in vLLM's CPU attention, which runs head sizes "
                     f"{', '.join(map(str, sizes))}, ... here; serve this model on a GPU, or with transformers "
                     "(AutoModelForCausalLM) on this CPU.")


def cpu_attention_runs(head_dim: int, config: AttnResConfig, dtype: torch.dtype, block_size: int) -> bool:
    """Whether vLLM's CPU attention schedules a one-token request with this head size (its kernels are chosen
    there: an unsupported size raises)."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    one = dict(seq_lens=torch.tensor([1], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32))
    try:
        ops.cpu_attn_get_scheduler_metadata(num_reqs=1, num_heads=config.num_attention_heads,
                                            num_kv_heads=config.num_key_value_heads, head_dim=head_dim, dtype=dtype,
                                            causal=True, sliding_window_size=-1, enable_kv_split=False,
                                            isa=_get_attn_isa(dtype, block_size, head_dim), **one)
    except RuntimeError as err:
        if "Unsupported CPU attention configuration" in str(err):
            return False
        raise
    return True


def checkpoint_mapper(model: nn.Module) -> WeightsMapper:
    """`HF_TO_VLLM` plus what `AutoWeightsLoader.load_weights` adds (quantization and rotary-cache
    renames), so that a key is judged by the name the loader will give it."""
    mapper = HF_TO_VLLM
    quant_config = getattr(model, "quant_config", None)
    if quant_config is not None:
        mapper = mapper | quant_config.get_cache_scale_mapper() | quant_config.get_checkpoint_weight_mapper()
    return mapper | AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER


__all__ = ["AttnResForCausalLM", "AttnResModel", "AttnResDecoderLayer", "HF_TO_VLLM"]
