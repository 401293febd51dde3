"""AttnRes model configuration: Llama's fields plus the depth-attention ones.

One typed config for every consumer (transformers, vLLM, the converters). It subclasses
`LlamaConfig`, so every Llama field keeps its name, default and meaning; `@strict` checks field
types on construction and assignment, and runs every `validate_*` method on construction, on
`from_pretrained` and on `save_pretrained`.
"""

from typing import NamedTuple

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig

from .depth_attention import BANK_DTYPES

ATTN_RES_MODES = ("block", "full")


class DepthSite(NamedTuple):
    """One depth-attention site of the schedule (see `AttnResConfig.depth_sites`)."""

    index: int          # attention site of layer l: 2l, its MLP site: 2l + 1, the output site: 2L
    num_stored: int     # stored sources the site reads; the running partial comes on top
    closes_block: bool  # after mixing, the partial becomes a stored source and a new partial starts


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

    ```python
    >>> from modeling_attnres import AttnResConfig, AttnResForCausalLM
    >>> config = AttnResConfig(hidden_size=256, intermediate_size=704, num_hidden_layers=8,
    ...                        num_attention_heads=4, attn_res_block_size=2)
    >>> model = AttnResForCausalLM(config)
    ```
    """

    model_type = "attnres"

    qk_norm: bool = False
    attn_res_mode: str = "block"
    attn_res_block_size: int = 2
    attn_res_bank_dtype: str = "auto"

    def validate_architecture(self):
        """Shapes the attention layers need; runs on construction and load."""
        super().validate_architecture()
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if value is None or value < 1:
                raise ValueError(f"AttnResConfig.{name} must be a positive integer, got {value!r}.")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"AttnResConfig.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads}) for grouped-query attention; "
                f"choose num_key_value_heads among the divisors of {self.num_attention_heads}."
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"AttnResConfig.head_dim must be even for rotary embeddings, got {self.head_dim}.")

    def validate_attn_res(self):
        """The depth-attention fields; runs on construction and load."""
        if self.attn_res_mode not in ATTN_RES_MODES:
            raise ValueError(
                f"AttnResConfig.attn_res_mode must be one of {ATTN_RES_MODES}, got {self.attn_res_mode!r}. "
                'Use "block" for Block AttnRes (with attn_res_block_size) or "full" for Full AttnRes.'
            )
        if self.attn_res_block_size < 1:
            raise ValueError(
                f"AttnResConfig.attn_res_block_size is the number of transformer layers per block and must be "
                f">= 1, got {self.attn_res_block_size}. The paper recommends about 8 blocks: "
                f"attn_res_block_size = ceil(num_hidden_layers / 8) = {-(-self.num_hidden_layers // 8)} here."
            )

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
        s, last = self.sublayers_per_block, 2 * self.num_hidden_layers
        return tuple(DepthSite(j, -(-j // s), j < last and j % s == 0) for j in range(last + 1))

    @property
    def num_depth_sources(self) -> int:
        """Sources the output site mixes: the embedding, the stored blocks and the partial."""
        return self.depth_sites[-1].num_stored + 1


__all__ = ["AttnResConfig", "DepthSite"]
