"""The Python API behind `attnres-convert`: plan a conversion, write it atomically, verify it.

`convert(src, dst)` takes a local folder, a Hub repo id, a state-dict file or a Llama GGUF file
(dequantised first, see `gguf_source`) and writes an
`AttnResForCausalLM` folder (safetensors, config with `auto_map`, the modeling files, the source's
tokenizer / chat template / generation config, a model card). Everything is written to a hidden
sibling of DST and renamed into place only after the converted model has loaded and been verified.
"""

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from transformers import AutoConfig

from modeling_attnres import AttnResConfig, AttnResForCausalLM

from .checkpoint_io import (STATE_DICT_SUFFIXES, StateDictSource, check_destination, copy_side_files,
                            load_state_dict_file, open_checkpoint, publish, resolve_source, staging_dir)
from .errors import ConversionError
from .gguf_source import dequantised_folder, find_gguf
from .keymap import Fill, Rule, TensorSource, TransformContext, apply_key_map, resolve_key_map, target_shapes
from .model_card import write_model_card
from .seed import SEED_RULES, NormalizedSource, attnres_config_from_seed
from .standard import (architecture_of, attnres_config_from_standard, standard_fills, standard_rules,
                       stream_scale_candidates)
from .verify import VerifyReport, calibrate_stream_scale, verify_attnres_layout, verify_standard

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ConvertOptions:
    """Knobs of a conversion; the defaults are what `attnres-convert SRC DST` does.

    block_size: layers per block (default ceil(L/8), about 8 blocks). mode: "block" or "full".
    stream_scale: residual-stream scale s for standard models (default: see `choose_stream_scale`;
    1 leaves the weights bit-identical). dtype: "auto" (the source's) or a name in `DTYPES`.
    seed_block_size / config_path: for state-dict files (block size in sublayers; config json).
    """

    block_size: Optional[int] = None
    mode: str = "block"
    stream_scale: Optional[float] = None
    dtype: str = "auto"
    overwrite: bool = False
    verify: bool = True
    clip_to_window: bool = False
    seed_block_size: Optional[int] = None
    config_path: Optional[Path] = None
    revision: Optional[str] = None
    max_shard_size: str = "5GB"


@dataclass
class Plan:
    """What to convert and how: the tensors, the key map, the target config."""

    layout: str                      # a source architecture name, or "attnres" for other AttnRes layouts
    source: TensorSource
    rules: tuple[Rule, ...]
    fills: tuple[Fill, ...]
    config: AttnResConfig
    ctx: TransformContext
    folder: Optional[Path]           # where side files (tokenizer, ...) and the source model live
    dtype: torch.dtype               # of the output
    scale_errors: dict[float, float] = field(default_factory=dict)   # calibration: s -> predicted error


@dataclass
class ConversionResult:
    """What `convert` did, for the CLI summary, the model card and tests."""

    src: str
    dst: Path
    layout: str
    config: AttnResConfig
    stream_scale: float
    dtype: torch.dtype
    scale_errors: dict[float, float] = field(default_factory=dict)
    copied_files: list[str] = field(default_factory=list)
    verification: Optional[VerifyReport] = None
    origin: str | None = None        # how the source was read, when not as given (a dequantised GGUF)

    def calibration_summary(self) -> str:
        """`s=1: 1.4e-06, s=2: ...`: the predicted relative logit error of each candidate scale."""
        return ", ".join(f"s={s:g}: {e:.2e}" for s, e in self.scale_errors.items())


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ConversionError(f"Cannot read {path} as JSON: {err}; fix or replace the file.") from err


def output_dtype(source: TensorSource, name: str) -> torch.dtype:
    """The dtype named by --dtype; "auto" is the source embedding's (the one tensor every layout has)."""
    if name == "auto":
        keys = list(source.keys())
        return source.get(next((k for k in keys if "embed_tokens" in k), keys[0])).dtype
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r} is not supported; expected auto, {', '.join(DTYPES)}.")
    return DTYPES[name]


def _reject_options(options: ConvertOptions, names: tuple[str, ...], why: str) -> None:
    """Options that do not apply to this kind of source are an error, not silently ignored."""
    given = [f"--{n.replace('_', '-')}" for n in names if getattr(options, n) != getattr(ConvertOptions(), n)]
    if given:
        raise ConversionError(f"{', '.join(given)} do(es) not apply here: {why}")


def _plan_attnres_layout(source: TensorSource, config: dict, options: ConvertOptions,
                         folder: Optional[Path]) -> Plan:
    _reject_options(options, ("block_size", "mode", "stream_scale", "clip_to_window"),
                    "SRC is already an AttnRes model, its block structure is kept (set --seed-block-size "
                    "if its config lacks one) and its weights are not rescaled.")
    source = NormalizedSource(source)
    target = attnres_config_from_seed(config, source.keys(), options.seed_block_size)
    return Plan("attnres", source, SEED_RULES, (), target, TransformContext(), folder,
                output_dtype(source, options.dtype))


def _plan_state_dict_file(path: Path, options: ConvertOptions) -> Plan:
    state_dict, stored_config = load_state_dict_file(path)
    config_path = options.config_path or (path.parent / "config.json")
    if options.config_path is not None or config_path.exists():
        config = _read_json(config_path)
    elif stored_config is not None:
        config = stored_config
    else:
        raise ConversionError(f"{path} is a bare state dict with no config: pass --config CONFIG.json (Llama "
                              "field names: hidden_size, num_attention_heads, ...) or put config.json next to it.")
    return _plan_attnres_layout(StateDictSource(state_dict), config, options, None)


def _plan_standard(folder: Path, options: ConvertOptions) -> Plan:
    _reject_options(options, ("seed_block_size", "config_path"),
                    f"{folder} is a transformers checkpoint with its own config.json, not a seed-layout state dict.")
    try:
        src_config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, OSError) as err:
        model_type = _read_json(folder / "config.json").get("model_type")
        raise ConversionError(f"Cannot read the config of {folder} (model_type {model_type!r}): {err}. "
                              "Supported: Llama, Qwen2, Qwen3, Mistral and AttnRes checkpoints.") from err
    layout = architecture_of(src_config)
    config = attnres_config_from_standard(src_config, block_size=options.block_size, mode=options.mode,
                                          clip_to_window=options.clip_to_window)
    source = open_checkpoint(folder)
    rules, fills = standard_rules(config, source), standard_fills(src_config)
    resolve_key_map(source, rules, fills, target_shapes(meta_model(config)))   # before loading the source
    dtype = output_dtype(source, options.dtype)
    scale, errors = choose_stream_scale(folder, config, dtype, options.stream_scale)
    ctx = TransformContext(stream_scale=scale, tied=config.tie_word_embeddings)
    return Plan(layout, source, rules, fills, config, ctx, folder, dtype, errors)


def choose_stream_scale(folder: Path, config: AttnResConfig, dtype: torch.dtype,
                        requested: Optional[float]) -> tuple[float, dict[float, float]]:
    """The residual-stream scale s, and the predicted error of each candidate when calibrated.

    Which s is best depends on the model: random-init models (tiny embeddings) want s near the
    largest source count, trained ones often s = 1 (the first site, which reads the embedding alone,
    is then exact). So by default each power-of-two candidate is scored with the spec's prediction
    on the source model alone, and the best one (the smallest on a tie) is used. No calibration when
    eps = 0 (every s is exact: 1 keeps the weights identical) or for float16 output (it ends at 65504
    and real residual streams have outliers in the thousands: 1, unless --stream-scale says otherwise).
    """
    if requested is not None:
        if not requested > 0:
            raise ConversionError(f"--stream-scale must be positive, got {requested}.")
        return float(requested), {}
    if config.rms_norm_eps == 0 or dtype == torch.float16:
        return 1.0, {}
    errors = calibrate_stream_scale(folder, config, stream_scale_candidates(config))
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
    raw = _read_json(config_file)
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
    model.load_state_dict(tensors, strict=False, assign=True)
    if plan.config.tie_word_embeddings:
        model.tie_weights()
    model.config.dtype = plan.dtype
    model.save_pretrained(out, max_shard_size=max_shard_size)


def convert(src: str | Path, dst: str | Path, options: ConvertOptions | None = None) -> ConversionResult:
    """Convert SRC (folder, Hub repo id, state-dict file or Llama GGUF file) into an AttnRes checkpoint at DST."""
    options = options or ConvertOptions()
    src_path = resolve_source(str(src), options.revision)
    dst = Path(dst).expanduser().resolve()
    check_destination(dst, src_path, options.overwrite)
    gguf_file = find_gguf(src_path)
    if gguf_file is None:
        return _convert_planned(str(src), plan_conversion(src_path, options), dst, options)
    _reject_options(options, ("seed_block_size", "config_path"), f"{gguf_file.name} is a GGUF file with its own "
                    "config in its metadata, not a seed-layout state dict.")
    with dequantised_folder(gguf_file, dst) as (folder, origin):
        return _convert_planned(str(src), _plan_standard(folder, options), dst, options, origin)


def _convert_planned(src: str, plan: Plan, dst: Path, options: ConvertOptions,
                     origin: str | None = None) -> ConversionResult:
    """Write the planned model to a staging folder, verify it there and publish it at DST."""
    result = ConversionResult(src, dst, plan.layout, plan.config, plan.ctx.stream_scale, plan.dtype,
                              plan.scale_errors, origin=origin)
    tmp = staging_dir(dst)
    try:
        write_model(plan, tmp, options.max_shard_size)
        if plan.folder is not None:
            result.copied_files = copy_side_files(plan.folder, tmp)
        if options.verify:
            result.verification = (
                verify_standard(plan.folder, tmp, plan.config, plan.ctx.stream_scale, plan.dtype,
                                reference="the dequantised GGUF" if origin else None)
                if plan.layout != "attnres" else verify_attnres_layout(plan, tmp))
        write_model_card(tmp, result)
        publish(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


__all__ = ["ConvertOptions", "ConversionResult", "convert", "plan_conversion"]
