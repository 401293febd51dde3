"""Attention Residuals (AttnRes) for transformers.

Importing this package registers `AttnResConfig` and the models with `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM`, `AutoModelForSequenceClassification`, `AutoModelForTokenClassification` and
`AutoModelForQuestionAnswering` (model type `"attnres"`).
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_attnres import AttnResConfig
from .depth_attention import fold_queries, mix_site
from .depth_attention_cpu import enable_cpu_kernel
from .depth_attention_triton import enable_triton_kernel
from .modeling_attnres import (
    AttnResForCausalLM,
    AttnResForQuestionAnswering,
    AttnResForSequenceClassification,
    AttnResForTokenClassification,
    AttnResModel,
    AttnResPreTrainedModel,
)


def _register() -> None:
    """Register with the Auto classes; harmless when already registered (e.g. on re-import)."""
    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
    AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
    AutoModelForSequenceClassification.register(AttnResConfig, AttnResForSequenceClassification, exist_ok=True)
    AutoModelForTokenClassification.register(AttnResConfig, AttnResForTokenClassification, exist_ok=True)
    AutoModelForQuestionAnswering.register(AttnResConfig, AttnResForQuestionAnswering, exist_ok=True)


_register()

__all__ = ["AttnResConfig", "AttnResModel", "AttnResForCausalLM", "AttnResForQuestionAnswering",
           "AttnResForSequenceClassification", "AttnResForTokenClassification", "AttnResPreTrainedModel",
           "enable_cpu_kernel", "enable_triton_kernel", "fold_queries", "mix_site"]
