"""The Python API behind `attnres-convert`: plan a conversion, write it atomically, verify it.

`convert(src, dst)` takes a local folder, a Hub repo id, a state-dict file or a Llama GGUF file
(dequantised first, see `gguf_source`) and writes an `AttnResForCausalLM` folder (safetensors,
config with `auto_map`, the modeling files, the source's tokenizer / chat template / generation
config, a model card). Everything is written to a hidden sibling of DST and renamed into place only
after the converted model has loaded and passed its verification; a failed verification raises
`VerificationFailed` and leaves nothing at DST, unless `keep_failed` asks to publish it anyway.
"""

import math
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig
from transformers.utils.hub import convert_file_size_to_int

from modeling_attnres import AttnResConfig, AttnResForCausalLM
from modeling_attnres.configuration_attnres import is_depth_parameter

from .card import carried_from_card, write_model_card
from .checkpoint_io import (
    STATE_DICT_SUFFIXES,
    LoadedSource,
    StateDictSource,
    check_destination,
    copy_side_files,
    load_state_dict_file,
    open_checkpoint,
    read_json_object,
    require_path,
    resolve_source,
    side_files,
    staged_destination,
)
from .datatypes import DTYPES, ConversionResult, ConvertOptions, Plan, VerifyReport
from .errors import ConversionError, UsageError
from .gguf_source import dequantised_folder, find_gguf
from .keymap import TensorSource, TransformContext, apply_key_map, resolve_key_map, stack_experts, target_shapes
from .seed import SEED_RULES, NormalizedSource, attnres_config_from_seed
from .standard import (
    architecture_of,
    attnres_config_from_standard,
    standard_fills,
    standard_rules,
    stream_scale_candidates,
    with_tied_head,
)
from .verify import calibrate_stream_scale, load_source, prompt_ids, verify_attnres_layout, verify_standard


class VerificationFailed(ConversionError):
    """The converted model failed its verification, so nothing was published (see `VerifyReport.passed`)."""

    def __init__(self, dst: Path, report: VerifyReport):
        self.report = report
        super().__init__(
            f"verification failed: {'; '.join(report.failures())}. Nothing was published at {dst}.\n"
            + "\n".join(f"  {line}" for line in report.lines())
            + ("\nThe converted model computes what docs/spec.md predicts; the difference from the source is the "
               "rms_norm_eps effect of its section 8, which changed a generated token here (a source whose top "
               "logits are nearly tied, as in a randomly initialised model, flips on the smallest change). A larger "
               "--stream-scale shrinks the effect; pass --keep-failed (ConvertOptions(keep_failed=True)) to "
               "publish it anyway." if report.prediction_holds and report.eps_effect else
               "\nThe converted model computes what docs/spec.md predicts, with no eps effect here: float rounding "
               "changed a generated token on nearly tied top logits (as in a randomly initialised model). Pass "
               "--keep-failed (ConvertOptions(keep_failed=True)) to publish it anyway." if report.prediction_holds else
               "\nThe converted model does not reproduce its source as docs/spec.md predicts. Check the options "
               "(--stream-scale, --dtype) and report a converter bug with the source's config.json; pass "
               "--keep-failed (ConvertOptions(keep_failed=True)) to publish it anyway."))


def output_dtype(source: TensorSource, name: str) -> torch.dtype:
    """The dtype named by --dtype; "auto" is the source embedding's as stored (the one tensor every layout has)."""
    if name == "auto":
        keys = list(source.keys())
        return source.dtype(next((k for k in keys if "embed_tokens" in k), keys[0]))
    if name not in DTYPES:
        raise UsageError(f"--dtype {name!r} is not supported; expected auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


# --stream-scale's range, as a power of two: a sanity bound far past any useful scale (the calibration tries
# 1 up to the number of depth sources), which keeps absurd values (2^1000 overflowed to NaN weights) out.
MAX_SCALE_POWER = 16


def check_options(src: str, options: ConvertOptions) -> None:
    """Values and combinations of options that are wrong whatever SRC holds: refused before any work."""
    if options.block_size is not None and options.block_size < 1:
        raise UsageError(f"--block-size must be at least 1 (layers per block), got {options.block_size}.")
    if options.config_path is not None and not Path(options.config_path).is_file():
        raise UsageError(f"--config {options.config_path} is not a file; pass the config.json of the state dict "
                         "(Llama field names: hidden_size, num_attention_heads, ...).")
    if options.block_size is not None and options.mode == "full":
        raise UsageError("--block-size does not apply with --mode full: Full AttnRes attends over every "
                         "sublayer output, without blocks. Drop one of the two.")
    if options.stream_scale is not None and not (math.isfinite(options.stream_scale) and options.stream_scale > 0):
        raise UsageError(f"--stream-scale must be a positive finite number, got {options.stream_scale}.")
    scale_range = (2.0 ** -MAX_SCALE_POWER, 2.0 ** MAX_SCALE_POWER)
    if options.stream_scale is not None and not scale_range[0] <= options.stream_scale <= scale_range[1]:
        raise UsageError(f"--stream-scale {options.stream_scale:g} is far past any useful scale (the calibration "
                         "tries 1 up to the number of depth sources, and much larger scales push weights to "
                         f"overflow); use a power of two from 1/{2 ** MAX_SCALE_POWER} to {2 ** MAX_SCALE_POWER}.")
    if options.stream_scale is not None and math.frexp(options.stream_scale)[0] != 0.5:
        power = 2.0 ** round(math.log2(options.stream_scale))
        raise UsageError(f"--stream-scale must be a power of two, got {options.stream_scale:g}: other scales round "
                         f"every scaled weight, and verification would fail; use {power:g}.")
    if options.seed_block_size is not None and (options.seed_block_size < 1 or (options.seed_block_size > 1
                                                                                and options.seed_block_size % 2)):
        raise UsageError(f"--seed-block-size must be 1 (Full AttnRes) or an even number of sublayers (2 per layer: "
                         f"AttnRes blocks hold whole layers), got {options.seed_block_size}.")
    try:
        size = convert_file_size_to_int(options.max_shard_size)
    except ValueError:
        size = None
    if size is None or size <= 0:
        raise UsageError(f"--max-shard-size {options.max_shard_size!r} is not a size: expected a positive number "
                         "with a unit, such as 5GB or 500MB.")
    if options.keep_failed and not options.verify:
        raise UsageError("--keep-failed does nothing with --no-verify (nothing is verified, so nothing can "
                         "fail); drop one of the two.")
    if options.revision is not None and Path(src).expanduser().exists():
        raise UsageError(f"--revision applies to a Hub repo id, but SRC {src!r} is a local path; drop "
                         "--revision, or check out that revision locally.")
    if options.gguf_file is not None:
        _check_gguf_file(src, options.gguf_file)


def _check_gguf_file(src: str, name: str) -> None:
    """`--gguf-file` names a .gguf inside SRC (a folder or Hub repo), as transformers' `gguf_file` does."""
    if Path(src).expanduser().is_file():
        raise UsageError(f"--gguf-file picks a file inside a folder or Hub repo, but SRC {src!r} is already a file; "
                         "drop --gguf-file.")
    parts = Path(name).parts
    if not name.endswith(".gguf") or Path(name).is_absolute() or ".." in parts:
        raise UsageError(f"--gguf-file {name!r} is not a .gguf file's path inside SRC; pass its name as the repo "
                         "or folder lists it, such as model-Q8_0.gguf.")


# The command-line spelling of the options whose field names differ from it.
OPTION_FLAGS = {"config_path": "--config", "clip_to_window": "--clip-to-sliding-window"}


def _reject_options(options: ConvertOptions, names: tuple[str, ...], why: str) -> None:
    """Options that do not apply to this kind of source are an error, not silently ignored."""
    given = [OPTION_FLAGS.get(n, f"--{n.replace('_', '-')}") for n in names
             if getattr(options, n) != getattr(ConvertOptions(), n)]
    if given:
        raise UsageError(f"{', '.join(given)} do(es) not apply here: {why}")


def _plan_attnres_layout(source: TensorSource, config: dict, options: ConvertOptions,
                         folder: Path | None) -> Plan:
    _reject_options(options, ("block_size", "mode", "stream_scale", "clip_to_window"),
                    "SRC is already an AttnRes model, its block structure is kept (set --seed-block-size "
                    "if its config lacks one) and its weights are not rescaled.")
    source = NormalizedSource(source)
    target = attnres_config_from_seed(config, source.keys(), options.seed_block_size)
    return Plan("attnres", source, with_tied_head(target, source, SEED_RULES), (), target, TransformContext(), folder,
                output_dtype(source, options.dtype))


def _plan_state_dict_file(path: Path, options: ConvertOptions) -> Plan:
    state_dict, stored_config = load_state_dict_file(path)
    sibling = path.parent / "config.json"
    if options.config_path is not None:
        config = read_json_object(options.config_path)
    elif stored_config is not None:                  # the file's own config, over whatever lies beside it
        config = stored_config
    elif sibling.exists():
        config = read_json_object(sibling)
    else:
        raise ConversionError(f"{path} is a bare state dict with no config: pass --config CONFIG.json (Llama "
                              "field names: hidden_size, num_attention_heads, ...) or put config.json next to it.")
    if not any(is_depth_parameter(key) for key in state_dict):     # a transformers model's weights, not a seed's
        folder = path.parent if options.config_path is None and (path.parent / "config.json").exists() else None
        raise ConversionError(f"{path} holds no depth-attention parameters (*_res_proj / *_res_norm): it is not an "
                              "AttnRes checkpoint, and a state-dict file converts only from the seed AttnRes "
                              "layout. " + (f"Convert its folder, {folder}, instead." if folder is not None else
                                            "Save it as a transformers checkpoint folder (with its config.json) "
                                            "and convert the folder."))
    return _plan_attnres_layout(StateDictSource(state_dict), config, options, None)


def _plan_standard(folder: Path, options: ConvertOptions, model: torch.nn.Module | None = None) -> Plan:
    """Plan a standard source. Its tensors are read once: into `model` (transformers' own class, float32),
    which calibrates, is written from and verifies; `model` is given when the caller loaded it already
    (a dequantised GGUF), and `folder` then holds only its config and tokenizer."""
    _reject_options(options, ("seed_block_size", "config_path"),
                    f"{folder} is a transformers checkpoint with its own config.json, not a seed-layout state dict.")
    try:
        src_config = AutoConfig.from_pretrained(folder)
    except StrictDataclassError as err:              # a known model type with a value of the wrong type or size
        model_type = read_json_object(folder / "config.json").get("model_type")
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip()).rstrip(".")
        raise ConversionError(f"{folder / 'config.json'} is not a valid {model_type} config: {reason}. Fix that "
                              "value in config.json.") from None
    except (ValueError, KeyError, OSError) as err:
        model_type = read_json_object(folder / "config.json").get("model_type")
        raise ConversionError(f"Cannot read the config of {folder} (model_type {model_type!r}): {err}. "
                              "Supported: Llama, Qwen2, Qwen3, Mistral and AttnRes checkpoints.") from err
    layout = architecture_of(src_config)
    config = attnres_config_from_standard(src_config, block_size=options.block_size, mode=options.mode,
                                          clip_to_window=options.clip_to_window)
    checkpoint = open_checkpoint(folder) if model is None else StateDictSource(model.state_dict())
    rules, fills = standard_rules(config, checkpoint), standard_fills(src_config)
    resolve_key_map(checkpoint, rules, fills, target_shapes(meta_model(config)))   # names and shapes, before loading
    dtype = output_dtype(checkpoint, options.dtype)
    if model is None:
        model = load_source(folder)
    source = LoadedSource(checkpoint, model)
    ids = prompt_ids(folder, config.vocab_size, config.max_position_embeddings)
    scale, errors = choose_stream_scale(model, ids, config, dtype, options.stream_scale)
    ctx = TransformContext(stream_scale=scale, tied=config.tie_word_embeddings)
    return Plan(layout, source, rules, fills, config, ctx, folder, dtype, errors, model=model, ids=ids)


def choose_stream_scale(model: torch.nn.Module, ids: list[torch.Tensor], config: AttnResConfig, dtype: torch.dtype,
                        requested: float | None) -> tuple[float, dict[float, float]]:
    """The residual-stream scale s, and the predicted error of each candidate when calibrated.

    Which s is best depends on the model: random-init models (tiny embeddings) want s near the
    largest source count, trained ones often s = 1 (the first site, which reads the embedding alone,
    is then exact). So by default each power-of-two candidate is scored with the spec's prediction
    on the source model alone, and the best one (the smallest on a tie) is used. No calibration when
    eps = 0 (every s is exact: 1 keeps the weights identical) or for float16 output (it ends at 65504
    and real residual streams have outliers in the thousands: 1, unless --stream-scale says otherwise).
    """
    if requested is not None:                  # checked positive and finite (`check_options`)
        return float(requested), {}
    if config.rms_norm_eps == 0 or dtype == torch.float16:
        return 1.0, {}
    errors = calibrate_stream_scale(model, ids, config, stream_scale_candidates(config))
    return min(errors, key=lambda s: (errors[s], s)), errors


def plan_conversion(src_path: Path, options: ConvertOptions) -> Plan:
    """Read SRC's config and open its tensors; pick the key map for its layout."""
    if src_path.is_file():
        if src_path.suffix not in STATE_DICT_SUFFIXES:
            raise ConversionError(f"SRC file {src_path} is not a state dict ({', '.join(STATE_DICT_SUFFIXES)}) "
                                  "or a .gguf file; pass a checkpoint folder, a torch.save'd state dict or a GGUF.")
        return _plan_state_dict_file(src_path, options)
    config_file = src_path / "config.json"
    if not config_file.exists():
        files = [p for p in src_path.iterdir() if p.suffix in STATE_DICT_SUFFIXES]
        if len(files) == 1:
            return _plan_state_dict_file(files[0], options)
        raise ConversionError(f"{src_path} has no config.json: expected a transformers checkpoint folder "
                              "(or a folder holding one .gguf or one state-dict file).")
    raw = read_json_object(config_file)
    if isinstance(raw.get("quantization_config"), dict):
        method = raw["quantization_config"].get("quant_method", "unnamed")
        raise ConversionError(f"{src_path} is a quantized checkpoint (quantization_config: {method}); the "
                              "converter reads unquantized weights. Convert the unquantized model (then "
                              "`attnres-quantize` the result, if you want int8 weights).")
    if raw.get("model_type") == "attnres":
        return _plan_attnres_layout(open_checkpoint(src_path), raw, options, src_path)
    return _plan_standard(src_path, options)


def meta_model(config: AttnResConfig) -> AttnResForCausalLM:
    """The target model without memory: its parameter names and shapes."""
    with torch.device("meta"):
        return AttnResForCausalLM(config)


def write_model(plan: Plan, out: Path, max_shard_size: str) -> None:
    """Map the tensors into a meta-device AttnRes model and save it (safetensors, config, auto_map,
    modeling files). Only the converted tensors are ever materialised."""
    model = meta_model(plan.config)
    tensors = apply_key_map(plan.source, plan.rules, plan.fills, target_shapes(model), plan.ctx, plan.dtype)
    model.load_state_dict(stack_experts(tensors, model), strict=False, assign=True)
    if plan.config.tie_word_embeddings:
        model.tie_weights()
    model.config.dtype = plan.dtype
    model.save_pretrained(out, max_shard_size=max_shard_size)


def convert(src: str | Path, dst: str | Path, options: ConvertOptions | None = None) -> ConversionResult:
    """Convert SRC (folder, Hub repo id, state-dict file or Llama GGUF file) into an AttnRes checkpoint at DST."""
    options = options or ConvertOptions()
    src, dst = require_path(src, "SRC"), require_path(dst, "DST")
    check_options(str(src), options)
    src_path = resolve_source(str(src), options.revision, options.gguf_file)
    label = options.source_label or str(src)
    dst = Path(dst).expanduser().resolve()
    check_destination(dst, src_path, options.overwrite)
    gguf_file = find_gguf(src_path)
    if gguf_file is None:
        return _convert_planned(label, plan_conversion(src_path, options), dst, options)
    _reject_options(options, ("seed_block_size", "config_path"), f"{gguf_file.name} is a GGUF file with its own "
                    "config in its metadata, not a seed-layout state dict.")
    with dequantised_folder(gguf_file, dst) as (folder, origin, model):
        origin = f"file {options.gguf_file}, {origin}" if options.gguf_file else origin
        return _convert_planned(label, _plan_standard(folder, options, model), dst, options, origin)


def _convert_planned(src: str, plan: Plan, dst: Path, options: ConvertOptions,
                     origin: str | None = None) -> ConversionResult:
    """Write the planned model to a staging folder, verify it there and publish it at DST if it passed
    (or `options.keep_failed`)."""
    result = ConversionResult(src, dst, plan.layout, plan.config, plan.ctx.stream_scale, plan.dtype,
                              plan.scale_errors, origin=origin, revision=options.revision)
    if plan.layout == "attnres" and plan.folder is not None:
        result.source_stream_scale, result.base_model = carried_from_card(plan.folder)
    if plan.folder is not None:
        side_files(plan.folder)                 # a broken or outside link is refused before anything is written
    with staged_destination(dst, options.overwrite) as tmp:      # DST was checked: absent, empty or --overwrite
        write_model(plan, tmp, options.max_shard_size)
        if plan.folder is not None:
            result.copied_files = copy_side_files(plan.folder, tmp)
        if options.verify:
            result.verification = (
                verify_standard(plan.model, plan.ids, tmp, plan.config, plan.ctx.stream_scale, plan.dtype,
                                reference="the dequantised GGUF" if origin else f"the source model ({src})")
                if plan.layout != "attnres" else verify_attnres_layout(plan, tmp))
            if not result.verification.passed and not options.keep_failed:
                raise VerificationFailed(dst, result.verification)
        write_model_card(tmp, result)
    return result


__all__ = ["ConversionResult", "ConvertOptions", "VerificationFailed", "convert", "plan_conversion"]
