"""Inference-only AttnRes for vLLM, written as the diff against vLLM's own `llama.py`.

Class names match the transformers model in `modeling_attnres/modeling_attnres.py` so the two read
side by side. Attention, MLP, RMSNorm, RoPE, embeddings and the LM head are vLLM's layers (paged KV
cache, tensor-parallel linears); `AttnResAttention` only adds Qwen3-style q/k norm when
`config.qk_norm`. What AttnRes changes is the residual path: every sublayer reads a depth-attention
mix over earlier blocks of the same token, computed by the project's one kernel
(`modeling_attnres.depth_attention`).

The depth history (stored blocks and the running partial) lives for one forward pass: vLLM hands
the model flattened `[num_tokens]` inputs, and depth attention only mixes vectors of one token
position, so nothing goes into the KV cache, and prefill, decode, chunked prefill and prefix caching
need nothing extra. The stored blocks are a functional `DepthBank` (`[tokens, n, d]` float32), grown
by `push_block` exactly as in the transformers model. It is deliberately not a preallocated module
buffer written in place: under `torch.compile` (vLLM's default) an in-place write into a buffer is
functionalised into a copy of the *whole* buffer (`[max_num_batched_tokens, blocks, d]`) per write,
measured at 230 ms per 64-token decode step at the default benchmark size, against 3.5 ms for all
of AttnRes's compiled depth-attention code with the functional bank (its growing copies included),
whose memory inductor plans like any other activation.
Which sites close a block is fixed at construction (Python bools per layer), so the traced graph
has no data-dependent branches.

Pipeline parallelism is refused (the block bank would have to travel in `IntermediateTensors`).
"""

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaAttention, LlamaMLP
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, make_layers, maybe_prefix
from vllm.sequence import IntermediateTensors

from modeling_attnres.configuration_attnres import AttnResConfig
from modeling_attnres.depth_attention import DepthBank, add_to_partial, empty_bank
from modeling_attnres.depth_attention_ops import site_mix, site_push

# The one table of checkpoint names (HF name -> this module's name). q/k/v and gate/up load into the
# fused `qkv_proj` / `gate_up_proj` (shard ids as in vLLM's llama.py); the seed pseudo-code's names
# for the attention site (`attn_res_proj` / `attn_res_norm`) are aliases. The leading dots keep
# `.attn_res_proj.` from matching `output_attn_res_proj`.
HF_TO_VLLM = WeightsMapper(
    orig_to_new_substr={
        ".attn_res_proj.": ".self_attention_res_proj.",
        ".attn_res_norm.": ".self_attention_res_norm.",
    },
    orig_to_new_stacked={
        ".q_proj": (".qkv_proj", "q"),
        ".k_proj": (".qkv_proj", "k"),
        ".v_proj": (".qkv_proj", "v"),
        ".gate_proj": (".gate_up_proj", 0),
        ".up_proj": (".gate_up_proj", 1),
    },
)


def packed_modules(mapper: WeightsMapper) -> dict[str, list[str]]:
    """Fused module -> the checkpoint modules stacked into it, from a mapper's stacked table."""
    packed: dict[str, list[str]] = {}
    for source, (fused, _) in mapper.orig_to_new_stacked.items():
        packed.setdefault(fused.lstrip("."), []).append(source.lstrip("."))
    return packed


def check_no_pipeline_parallel(vllm_config: VllmConfig) -> None:
    """Refuse pipeline parallelism: the block bank does not travel between stages (yet)."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1:
        raise NotImplementedError(
            f"AttnResForCausalLM does not support pipeline parallelism (pipeline_parallel_size={pp}): "
            "every depth-attention site reads all earlier blocks, which would have to travel between "
            "stages. Use tensor parallelism (--tensor-parallel-size) instead."
        )


class AttnResPseudoQuery(nn.Module):
    """The pseudo-query `w` of one depth-attention site; `weight` is `[1, d]` as in the HF Linear."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))


def mix(bank: DepthBank, partial: torch.Tensor, proj: AttnResPseudoQuery, norm: RMSNorm) -> torch.Tensor:
    """Mix one site over the stored sources of the bank and the partial `[tokens, d]`."""
    mixed, _ = site_mix(bank, partial, proj.weight, norm.weight, norm.variance_epsilon)
    return mixed


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
        layer_idx = int(prefix.rsplit(".", 1)[-1])
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
        self.mlp = LlamaMLP(d, config.intermediate_size, config.hidden_act, quant_config=quant_config,
                            bias=config.mlp_bias, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(d, eps=eps)
        self.post_attention_layernorm = RMSNorm(d, eps=eps)
        self.self_attention_res_proj = AttnResPseudoQuery(d)
        self.self_attention_res_norm = RMSNorm(d, eps=eps)
        self.mlp_res_proj = AttnResPseudoQuery(d)
        self.mlp_res_norm = RMSNorm(d, eps=eps)
        self.attn_closes_block = config.depth_sites[2 * layer_idx].closes_block
        self.mlp_closes_block = config.depth_sites[2 * layer_idx + 1].closes_block
        self.eps = eps

    def forward(self, positions: torch.Tensor, bank: DepthBank,
                partial: torch.Tensor) -> tuple[DepthBank, torch.Tensor]:
        """Mixes both sites; returns the bank (with any block closed here) and the new partial `[tokens, d]`."""
        h = mix(bank, partial, self.self_attention_res_proj, self.self_attention_res_norm)
        bank, partial = site_push(bank, partial, self.attn_closes_block, self.eps)
        h = self.self_attn(positions=positions, hidden_states=self.input_layernorm(h))
        partial = add_to_partial(partial, h)

        h = mix(bank, partial, self.mlp_res_proj, self.mlp_res_norm)
        bank, partial = site_push(bank, partial, self.mlp_closes_block, self.eps)
        return bank, add_to_partial(partial, self.mlp(self.post_attention_layernorm(h)))


@support_torch_compile(
    dynamic_arg_dims={
        "input_ids": {0: "b"},
        "positions": {0: "b"},
        "intermediate_tensors": {0: "b"},
        "inputs_embeds": {0: "b"},
    },
)
class AttnResModel(nn.Module):
    """The AttnRes decoder stack: embedding, layers, the output depth-attention site and the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config: AttnResConfig = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.vocab_size = config.vocab_size
        d, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = VocabParallelEmbedding(self.vocab_size, d, quant_config=self.quant_config)
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AttnResDecoderLayer(vllm_config=vllm_config, prefix=prefix),
            prefix=f"{prefix}.layers",
        )
        self.output_attn_res_proj = AttnResPseudoQuery(d)
        self.output_attn_res_norm = RMSNorm(d, eps=eps)
        self.norm = RMSNorm(d, eps=eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[tokens, d]`."""
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states `[tokens, d]` for flattened `[tokens]` inputs."""
        embeds = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        partial = add_to_partial(None, embeds)                         # the embedding: block 0
        bank = empty_bank(partial)
        for layer in self.layers:
            bank, partial = layer(positions, bank, partial)
        out = mix(bank, partial, self.output_attn_res_proj, self.output_attn_res_norm)
        return self.norm(out)


class AttnResForCausalLM(nn.Module):
    """AttnRes with vLLM's LM head and logits processor; loads the transformers checkpoints."""

    hf_to_vllm_mapper = HF_TO_VLLM
    packed_modules_mapping = packed_modules(HF_TO_VLLM)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        check_no_pipeline_parallel(vllm_config)
        config: AttnResConfig = vllm_config.model_config.hf_config
        self.config = config
        self.quant_config = vllm_config.quant_config
        self.model = AttnResModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size,
                                      quant_config=vllm_config.quant_config,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size, scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings `[tokens, d]`."""
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states `[tokens, d]` (see `AttnResModel.forward`)."""
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """Logits `[tokens, vocab]` from the LM head."""
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load a transformers AttnRes checkpoint through vLLM's `AutoWeightsLoader` and `HF_TO_VLLM`.

        Raises `ValueError` listing every missing and unexpected checkpoint key of this rank's
        parameters, after reading the whole checkpoint.
        """
        mapper = checkpoint_mapper(self)
        params = dict(self.named_parameters(remove_duplicate=False))  # a tied lm_head included
        renames = mapper.get_rename_mapper()                            # aliases only, no fusing
        seen: set[str] = set()
        unexpected: list[str] = []

        def known(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                target = mapper.map_name(name)
                if target is None:                                      # dropped by the mapper
                    continue
                if target not in params:
                    unexpected.append(name)
                    continue
                seen.add(renames.map_name(name))
                yield name, tensor

        loaded = AutoWeightsLoader(self).load_weights(known(weights), mapper=HF_TO_VLLM)
        missing = sorted(self.checkpoint_keys() - seen)
        if missing or unexpected:
            raise ValueError(
                f"The checkpoint does not match AttnResForCausalLM ({len(params)} parameters, "
                f"tie_word_embeddings={self.config.tie_word_embeddings}).\n"
                f"Missing keys ({len(missing)}): {missing}\n"
                f"Unexpected keys ({len(unexpected)}): {sorted(unexpected)}"
            )
        return loaded

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
            fused = next((f for f in self.packed_modules_mapping if f".{f}." in name), None)
            sources = self.packed_modules_mapping[fused] if fused else []
            keys.update([name.replace(f".{fused}.", f".{s}.") for s in sources] or [name])
        return keys


def checkpoint_mapper(model: nn.Module) -> WeightsMapper:
    """`HF_TO_VLLM` plus what `AutoWeightsLoader.load_weights` adds (quantization and rotary-cache
    renames), so that a key is judged by the name the loader will give it."""
    mapper = HF_TO_VLLM
    quant_config = getattr(model, "quant_config", None)
    if quant_config is not None:
        mapper = mapper | quant_config.get_cache_scale_mapper() | quant_config.get_checkpoint_weight_mapper()
    return mapper | AutoWeightsLoader.REMOVE_UNUSED_ROTARY_EMBEDS_MAPPER


__all__ = ["AttnResForCausalLM", "AttnResModel", "AttnResDecoderLayer", "check_no_pipeline_parallel"]
