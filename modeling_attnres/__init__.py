"""Attention Residuals (AttnRes) for transformers.

Importing this package registers `AttnResConfig`, `AttnResModel` and `AttnResForCausalLM` with
`AutoConfig`, `AutoModel` and `AutoModelForCausalLM` (model type `"attnres"`).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_attnres import AttnResConfig
from .depth_attention import fold_queries, mix_site
from .depth_attention_cpu import enable_cpu_kernel
from .depth_attention_triton import enable_triton_kernel
from .modeling_attnres import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel


def _register() -> None:
    """Register with the Auto classes; harmless when already registered (e.g. on re-import)."""
    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)


_register()

__all__ = ["AttnResConfig", "AttnResModel", "AttnResForCausalLM", "AttnResPreTrainedModel", "enable_cpu_kernel",
           "enable_triton_kernel", "fold_queries", "mix_site"]
