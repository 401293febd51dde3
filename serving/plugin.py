"""The vLLM plugin: `register()` is the `vllm.general_plugins` entry point named `attnres`.

vLLM calls it in every process it starts (API server, engine core, workers, the model-inspection
subprocess). It registers the model class lazily (a `"module:Class"` string, so nothing heavy is
imported until vLLM builds the model) and `AttnResConfig` with transformers' `AutoConfig`, so that
checkpoints with `model_type: "attnres"` load without `--trust-remote-code`.
"""

ARCHITECTURE = "AttnResForCausalLM"
MODEL_CLASS = "attnres.serving.model:AttnResForCausalLM"


def register() -> None:
    """Register AttnRes with vLLM's `ModelRegistry` and transformers' `AutoConfig`; idempotent."""
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from modeling_attnres.configuration_attnres import AttnResConfig

    AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


__all__ = ["register", "ARCHITECTURE", "MODEL_CLASS"]
