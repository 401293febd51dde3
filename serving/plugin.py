"""The vLLM plugin: `register()` is the `vllm.general_plugins` entry point named `attnres`.

vLLM calls it in every process it starts (API server, engine core, workers, the model-inspection
subprocess). It registers the model class lazily (a `"module:Class"` string, so nothing heavy is
imported until vLLM builds the model) and imports `modeling_attnres`, whose import registers the
config with transformers' `AutoConfig`, so that checkpoints with `model_type: "attnres"` load
without `--trust-remote-code`.
"""

ARCHITECTURE = "AttnResForCausalLM"
MODEL_CLASS = "attnres.serving.model:AttnResForCausalLM"


def register() -> None:
    """Register AttnRes with vLLM's `ModelRegistry` (and, by importing `modeling_attnres`, with
    transformers' Auto classes); idempotent."""
    from vllm import ModelRegistry

    import modeling_attnres  # noqa: F401  (its import registers AutoConfig / AutoModel / AutoModelForCausalLM)

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, MODEL_CLASS)


__all__ = ["register", "ARCHITECTURE", "MODEL_CLASS"]
