"""Weight updates into a running vLLM engine, as RL trainers push them after every step.

    llm = vllm.LLM(model=path, worker_extension_cls=WORKER_EXTENSION)     # attnres-serve adds it itself
    update_weights(llm, [("model.layers.0.self_attn.q_proj.weight", q), ...])

`update_weights` sends transformers-named tensors (any subset, one or many per call) to every worker
(`collective_rpc`; to an engine in another process, vLLM's default, as `encode_tensor`'s raw bytes), where
`AttnResWeightUpdates.attnres_update_weights`:

1. checks every name, shape, dtype and value against the checkpoint format (`check_update`): an unknown
   name, a wrong shape, a non-float dtype or a NaN/inf is a `ValueError` naming it, raised before anything
   is touched (in the caller too: `update_weights` unwraps it from vLLM's cross-process error);
2. completes the update module by module (`complete_update`): vLLM's in-place reload processes a
   module only once every tensor of it has arrived, so a part of a fused module (`q_proj` of
   `qkv_proj`) or a weight without its bias is sent together with the module's other tensors as they
   are now, read back from the engine (under tensor parallelism gathered from every rank);
3. runs vLLM's own in-place reload (`model_runner.reload_weights`), which restores the CPU backend's
   repacked linear weights around `AttnResForCausalLM.load_weights` and repacks them afterwards (and
   repacks a tied LM head after an embedding update, which the reload does not reach).

A linear weight the CPU backend has repacked away is read back by applying the layer to an identity
matrix: each output element is one weight times 1 plus zeros, so the weight comes back exactly.
"""

import contextlib
import json
import logging
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group
from vllm.model_executor.layers.linear import ColumnParallelLinear, RowParallelLinear
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.platforms import current_platform

from .model import EXPERT_KEY

WORKER_EXTENSION = f"{__name__}.AttnResWeightUpdates"
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def encode_tensor(tensor: torch.Tensor) -> dict:
    """`{"dtype", "shape", "data"}` with the tensor's raw bytes: what reaches an engine in another process intact.
    vLLM's msgpack hop sends a tensor in untyped arguments as a `[dtype, shape, buffer]` list that nothing turns
    back into a tensor (a small one as a memoryview, which the engine cannot pass on to its workers)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return {"dtype": str(flat.dtype).removeprefix("torch."), "shape": list(tensor.shape),
            "data": flat.view(torch.uint8).numpy().tobytes()}


def as_tensor(name: str, value) -> torch.Tensor:
    """A tensor, `encode_tensor`'s dict or nested lists of numbers (what a JSON request carries), as a CPU tensor;
    anything else is a `ValueError` naming the weight."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict) and value.keys() == {"dtype", "shape", "data"}:
        dtype = getattr(torch, str(value["dtype"]), None)
        if isinstance(dtype, torch.dtype):
            data = bytearray(value["data"])                       # writable: the model may keep the tensor
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            return flat.reshape(value["shape"])
    try:
        return torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{name}: got {type(value).__name__} {str(value)[:80]}, expected a tensor, nested lists of "
                         f"numbers or encode_tensor's dict ({err}); send tensors with update_weights") from None


def check_update(model: nn.Module, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse, naming each, unknown checkpoint names, shapes other than the checkpoint's, non-float dtypes,
    NaN or infinite values and one weight sent twice with different values (`lm_head.weight` and the embedding
    of a tied model); a quantized model is refused as a whole (its weights cannot be read back exactly)."""
    if model.quant_config is not None:
        raise ValueError(f"weight updates into a quantized model ({type(model.quant_config).__name__}) are not "
                         "supported: update the unquantized model and quantize it again.")
    if not hasattr(model, "all_checkpoint_shapes"):
        model.all_checkpoint_shapes = checkpoint_shapes(model.config)
    shapes, problems, seen = model.all_checkpoint_shapes, [], {}
    for name, tensor in weights:
        key = model.resolve_checkpoint_key(name)
        expected = shapes.get(key)
        earlier = seen.setdefault(key, (name, tensor))
        if earlier[1] is not tensor and not (earlier[1].shape == tensor.shape and torch.equal(earlier[1], tensor)):
            problems.append(f"{name}: the same weight as {earlier[0]} (a tied or repeated name) with other values; "
                            "send one of them")
        elif expected is None:
            problems.append(f"{name}: not a parameter of this model{unknown_name_hint(model, name, shapes)}")
        elif EXPERT_KEY.match(key) and current_platform.is_cpu():
            problems.append(f"{name}: a routed expert; vLLM's CPU build cannot update those in place (its in-place "
                            "reload leaves the fused-expert kernel's packed weights stale, for vLLM's own Qwen3-MoE "
                            "too); save the model and start the engine from it")
        elif tuple(tensor.shape) != expected:
            problems.append(f"{name}: shape {tuple(tensor.shape)}, the checkpoint's is {expected}")
        elif tensor.dtype not in FLOAT_DTYPES:
            problems.append(f"{name}: dtype {tensor.dtype}, expected one of float32, bfloat16, float16")
        elif not torch.isfinite(tensor).all():
            problems.append(f"{name}: holds NaN or infinite values (a diverged training step?); every generation "
                            "would be garbage")
    if problems:
        raise ValueError(f"The weight update was refused, nothing was changed ({len(problems)} problem(s)):\n  "
                         + "\n  ".join(problems) + "\nSend transformers checkpoint names (model.layers.0.self_attn."
                         "q_proj.weight, ...) with the shapes of the model's config.json.")


# vLLM's fused modules, named as transformers splits them; prefixes that wrappers put before the names.
FUSED_PARTS = {"qkv_proj": "q_proj, k_proj and v_proj", "gate_up_proj": "gate_proj and up_proj"}
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")


def unknown_name_hint(model: nn.Module, name: str, shapes: dict) -> str:
    """What an unknown name probably meant: a vLLM fused module's parts, or the name without a wrapper's prefix
    (DDP's `module.`, torch.compile's `_orig_mod.`, PEFT's `base_model.model.`)."""
    for fused, parts in FUSED_PARTS.items():
        if f".{fused}." in name:
            return f" (vLLM's fused {fused}: send its transformers parts, {parts})"
    for prefix in WRAPPER_PREFIXES:
        if name.startswith(prefix) and shapes.get(model.resolve_checkpoint_key(name.removeprefix(prefix))):
            return f" (a wrapper's name: send {name.removeprefix(prefix)!r}, without {prefix!r})"
    return ""


def checkpoint_shapes(config) -> dict[str, tuple[int, ...]]:
    """Every checkpoint key of the whole model (all pipeline ranks) and its shape, in the layout on disk
    (one tensor per routed expert, no tied `lm_head`): the transformers model's, built on the meta device."""
    from attnres.conversion.keymap import target_shapes
    from modeling_attnres import AttnResForCausalLM

    with torch.device("meta"):
        return {key: tuple(shape) for key, shape in target_shapes(AttnResForCausalLM(config)).items()}


def complete_update(model: nn.Module, weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The update plus, for every module it touches on this rank, that module's other checkpoint
    tensors as they are now (full, unsharded), so that vLLM's reload processes each module whole."""
    by_key = {model.resolve_checkpoint_key(name): tensor for name, tensor in weights}
    completed = dict(by_key)
    for module, keys in module_keys(model).items():
        missing = [key for key in keys if key not in by_key] if any(key in by_key for key in keys) else []
        if any(EXPERT_KEY.match(key) for key in missing):
            raise ValueError(f"The weight update was refused, nothing was changed: it has "
                             f"{len(keys) - len(missing)} of the {len(keys)} routed-expert tensors of {module}. "
                             "Routed experts are updated a whole MoE block at a time (every expert's gate, up and "
                             "down projection), since the fused-expert kernels repack them and a part cannot be "
                             "read back.")
        completed.update({key: current_tensor(model, key) for key in missing})
    return list(completed.items())


def module_keys(model: nn.Module) -> dict[str, list[str]]:
    """vLLM module name -> the checkpoint keys it loads from (on this rank), in a fixed order."""
    modules = defaultdict(list)
    for key in sorted(model.checkpoint_keys()):
        target, _ = model.checkpoint_target(key)
        expert = EXPERT_KEY.match(key)
        if target is not None:                          # a routed expert's tensors belong to their FusedMoE block
            modules[expert.group(1) if expert else target.rsplit(".", 1)[0]].append(key)
    return dict(modules)


def current_tensor(model: nn.Module, key: str) -> torch.Tensor:
    """The current value of checkpoint tensor `key`, in the checkpoint's layout (full, unsharded)."""
    target, shard = model.checkpoint_target(key)
    module_name, leaf = target.rsplit(".", 1)
    module = model.get_submodule(module_name)
    local = local_tensor(module, leaf)
    if shard is not None:                                              # a part of a fused module, this rank's
        sizes = [size // module.tp_size for size in module.output_sizes] if hasattr(module, "tp_size") else \
            list(module.output_sizes)
        index = shard if isinstance(shard, int) else "qkv".index(shard)
        local = local.split(sizes, dim=0)[index]
    return gather(module, leaf, local, shard)


def local_tensor(module: nn.Module, leaf: str) -> torch.Tensor:
    """This rank's `module.<leaf>` in checkpoint layout, read back through an identity matrix where the
    CPU backend has repacked the weight away."""
    param = getattr(module, leaf)
    if leaf != "weight" or (param.numel() > 0 and not param.is_meta):
        return param.detach().to(getattr(module, "params_dtype", param.dtype)).clone()
    size = getattr(module, "input_size_per_partition", None) or module.input_size    # replicated layers
    eye = torch.eye(size, dtype=module.params_dtype, device=param.device)
    return module.quant_method.apply(module, eye, bias=None).t().contiguous()


def split_dim(module: nn.Module, leaf: str) -> int | None:
    """The dim along which tensor parallelism splits `module.<leaf>` (`None`: replicated)."""
    if isinstance(module, RowParallelLinear):
        return 1 if leaf == "weight" else None                         # the bias is added after the reduce
    if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
        return 0
    return None


def gather(module: nn.Module, leaf: str, local: torch.Tensor, shard) -> torch.Tensor:
    """The full tensor of this rank's part: concatenated over the tensor-parallel ranks along the dim the
    layer splits (replicated KV heads taken once); the vocabulary's padding cut off."""
    tp, dim = get_tensor_model_parallel_world_size(), split_dim(module, leaf)
    full = local
    if tp > 1 and dim is not None and getattr(module, "tp_size", tp) > 1:
        parts = get_tp_group().all_gather(local.contiguous(), dim=dim).chunk(tp, dim=dim)
        replicas = getattr(module, "num_kv_head_replicas", 1) if shard in ("k", "v") else 1
        full = torch.cat(parts[::replicas], dim=dim)
    vocab = getattr(module, "org_vocab_size", None)
    return full[:vocab] if vocab is not None else full


# vLLM's in-place reload expects a whole checkpoint. After a partial update it warns "Failed to load weights" for
# every module the update leaves alone and lists each tensor it was not sent as "not loaded": hundreds of lines per
# call, tens of thousands per RL step, all saying that the weights not updated were kept, as asked. The modules
# an update touches are checked and completed before the reload (`check_update`, `complete_update`).
PARTIAL_UPDATE_NOISE = {"vllm.model_executor.model_loader.reload.layerwise": "%s: Failed to load weights",
                        "vllm.model_executor.model_loader.reload.inplace":
                            "Following weights were not loaded from checkpoint: %s"}


class DropMessage(logging.Filter):
    """Drops the records of one message format."""

    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != self.message


@contextlib.contextmanager
def partial_update_quiet():
    """While held, vLLM's reload does not log `PARTIAL_UPDATE_NOISE`; its other messages pass."""
    filters = [(logging.getLogger(name), DropMessage(message)) for name, message in PARTIAL_UPDATE_NOISE.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)


class AttnResWeightUpdates:
    """A vLLM worker extension (`worker_extension_cls=WORKER_EXTENSION`): checked, in-place, partial
    weight updates for the AttnRes model (see the module docstring). Called on every worker through
    `collective_rpc("attnres_update_weights", args=(weights,))`."""

    def attnres_update_weights(self, weights: Iterable[tuple[str, object]] | str) -> list[str]:
        """Update the named tensors in place; returns the checkpoint names updated. `weights` may also be
        a JSON string of `[name, nested list]` pairs (what vLLM's `/collective_rpc` route passes on)."""
        model = self.model_runner.get_model()
        weights = json.loads(weights) if isinstance(weights, str) else weights
        weights = weights.items() if isinstance(weights, Mapping) else weights        # a state_dict()
        named = [(str(name), as_tensor(str(name), value)) for name, value in weights]
        check_update(model, named)
        with partial_update_quiet():
            self.model_runner.reload_weights(weights_iterator=complete_update(model, named))
        keys = sorted(model.resolve_checkpoint_key(name) for name, _ in named)
        refresh_tied_head(model, keys)
        return keys

    def attnres_update_weights_from_file(self, path: str) -> list[str]:
        """`attnres_update_weights` with the tensors of a safetensors file (how an update of any size
        reaches a server: `POST /collective_rpc {"method": "attnres_update_weights_from_file", "args":
        [PATH]}` with `VLLM_SERVER_DEV_MODE=1`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            weights = load_file(path)
        except (SafetensorError, OSError) as err:
            raise ValueError(f"The weight update was refused, nothing was changed: {path} cannot be read as a "
                             f"safetensors file ({err}); write it with safetensors.torch.save_file") from None
        return self.attnres_update_weights(list(weights.items()))


def refresh_tied_head(model: nn.Module, keys: list[str]) -> None:
    """A tied LM head reads the embedding matrix through a kernel handle packed from it (on CPUs) when
    the model was loaded; the reload refreshes the embedding's own module only, so the head's handle is
    rebuilt here from the updated matrix."""
    head = getattr(model, "lm_head", None)
    if model.config.tie_word_embeddings and "model.embed_tokens.weight" in keys and hasattr(head, "quant_method"):
        head.quant_method.process_weights_after_loading(head)


def update_weights(llm, weights: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> None:
    """Update an offline `vllm.LLM` (made with `worker_extension_cls=WORKER_EXTENSION`) in place and drop
    its prefix cache, whose entries were computed with the old weights. `weights`: `(name, tensor)` pairs or a
    mapping (a `state_dict()`). An engine in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) gets the
    tensors themselves, one in another process their bytes. A refused update raises `ValueError` whichever
    the engine (vLLM wraps a worker's error in a plain `Exception` across processes)."""
    from vllm.v1.engine.core_client import InprocClient

    weights = list(weights.items() if isinstance(weights, Mapping) else weights)
    if not isinstance(getattr(llm.llm_engine, "engine_core", None), InprocClient):
        weights = [(name, encode_tensor(tensor)) for name, tensor in weights]
    try:
        llm.collective_rpc("attnres_update_weights", args=(weights,))
    except Exception as err:
        raise update_error(err) from None
    llm.reset_prefix_cache()


def update_error(err: Exception) -> Exception:
    """The error a refused or impossible update raises in the caller: the worker's `ValueError` (unwrapped from
    vLLM's cross-process `Exception`), a missing worker extension named with the fix, anything else as it is."""
    message = str(err)
    if "attnres_update_weights" in message and "has no attribute" in message:
        return ValueError("this engine has no AttnRes weight updates: create it with "
                          "`vllm.LLM(..., worker_extension_cls=WORKER_EXTENSION)` (from attnres.serving.weights); "
                          "attnres-serve adds it itself")
    refused = re.search(r"(The weight update was refused.*?)(?:', please check|'$|$)", message, re.S)
    if isinstance(err, ValueError) or not refused:
        return err
    return ValueError(refused.group(1))


__all__ = ["WORKER_EXTENSION", "AttnResWeightUpdates", "check_update", "complete_update", "encode_tensor",
           "update_weights"]
