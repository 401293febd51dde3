"""Int8 weight-and-activation (W8A8) quantization of an AttnRes checkpoint, in the compressed-tensors format.

Round-to-nearest, no calibration data: every q/k/v/o/gate/up/down projection gets a symmetric
per-output-channel int8 weight (`weight` int8 `[out, in]`, `weight_scale` float32 `[out, 1]`,
scale = max|row| / 127), and the `quantization_config` asks for dynamic symmetric per-token int8
activations, which vLLM computes at run time. That is the `int-quantized` format that
`llm-compressor`'s W8A8 recipe writes and vLLM's `CompressedTensorsW8A8Int8` scheme loads (oneDNN
int8 GEMM on CPUs, CUTLASS on GPUs). `llm-compressor` itself does not fit this environment (0.14 pins
`transformers<=5.17` and `compressed-tensors==0.19`), so the arithmetic is written here and the
config comes from `compressed_tensors`' own pydantic classes.

Left in their original dtype, as vLLM expects: the embeddings and `lm_head` (vLLM's convention), all
RMSNorm gains, and AttnRes's pseudo-queries `*_res_proj` (`Linear(d, 1)`: one output channel, and a
depth-attention score error feeds a softmax over whole blocks; vLLM holds them as plain parameters,
not quantizable linear layers).

`--reduce-range` keeps the int8 weights in [-63, 63] (scale = max|row| / 63), for CPUs without VNNI: there
oneDNN's int8 GEMM adds pairs of u8 x s8 products in 16-bit integers, which full-range weights overflow
(PyTorch's `reduce_range` exists for the same instruction). It halves the weights' resolution.

    attnres-quantize SRC DST [--overwrite] [--reduce-range]

SRC may also be a built-in model name, as `attnres-serve` takes it (`builtin:attnres-tiny`,
`builtin:smollm2-135m-attnres`, ...): its folder, built on first use like the server builds it.
"""

import argparse
import json
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

import modeling_attnres
from modeling_attnres.configuration_attnres import AUTO_MAP
from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES, SEED_KEY_ALIASES

from .card import carried_from_card
from .checkpoint_io import (
    builtin_folder,
    check_attnres_config,
    check_destination,
    copy_side_files,
    open_checkpoint,
    path_argument,
    read_json_object,
    require_path,
    side_files,
    staged_destination,
)
from .errors import EXIT_INTERRUPTED, ConversionError, fail, listing
from .keymap import target_shapes

# The linear layers vLLM runs through its quantizable `LinearBase` layers (qkv_proj, o_proj,
# gate_up_proj, down_proj); nothing else in an AttnRes checkpoint is quantized.
QUANTIZED = re.compile(r"\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight\Z")
# compressed-tensors' `ignore` list: what a loader matching the target class `Linear` must skip.
IGNORE = ["lm_head", "re:.*_res_proj$"]
INT8_MAX = 127
# Largest weight whose products with u8 activations still add in pairs within int16: 2 * 255 * 63 < 2**15.
REDUCED_MAX = 63


def quantize_weight(weight: torch.Tensor, limit: int = INT8_MAX) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel round-to-nearest int8 with each row's largest magnitude at `limit`
    (127, or `REDUCED_MAX`): `(int8 [out, in], float32 scale [out, 1])`."""
    w = weight.float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny) / limit
    q = torch.round(w / scale).clamp(-limit, limit).to(torch.int8)
    return q, scale


def quantization_config() -> dict:
    """The `quantization_config` of a W8A8 int8 checkpoint (static per-channel weights, dynamic per-token
    activations), as `compressed_tensors` serialises it."""
    try:
        from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    except ImportError as err:
        raise ConversionError('attnres-quantize needs compressed-tensors, which installs with vLLM or alone: '
                              'pip install "attnres[quantize]"') from err

    config = QuantizationConfig(config_groups={"group_0": preset_name_to_scheme("W8A8", ["Linear"])},
                                ignore=IGNORE, format="int-quantized", quantization_status="compressed")
    return config.model_dump(mode="json")


def quantize_tensors(source, limit: int = INT8_MAX, skip: frozenset[str] = frozenset()
                     ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """All tensors of `source` but `skip`, the projections quantized (`quantize_weight`); returns `(tensors,
    quantized weight names)`."""
    out, done = {}, []
    for key in source.keys():
        if key in skip:
            continue
        tensor = source.get(key)
        if QUANTIZED.search(key):
            if tensor.dim() != 2 or not tensor.is_floating_point():
                raise ConversionError(f"{key} is {tensor.dtype} {tuple(tensor.shape)}, expected a floating-point "
                                      "[out, in] weight; is the checkpoint already quantized?")
            out[key], out[key[: -len("weight")] + "weight_scale"] = quantize_weight(tensor, limit)
            done.append(key)
        else:
            out[key] = tensor.contiguous()
    return out, done


def read_config(src: Path) -> dict:
    """The source `config.json`, checked to be an unquantized AttnRes checkpoint."""
    path = src / "config.json"
    if not src.is_dir():
        raise ConversionError(f"SRC {src} {'is not a folder' if src.exists() else 'does not exist'}; pass an AttnRes "
                              "checkpoint folder (convert other models with attnres-convert first).")
    if not path.is_file():
        raise ConversionError(f"No config.json in {src}; SRC must be an AttnRes checkpoint folder "
                              "(convert other models with attnres-convert first).")
    config = read_json_object(src / "config.json")
    if "AttnResForCausalLM" not in (config.get("architectures") or []):
        raise ConversionError(f"{path} has architectures={config.get('architectures')}, expected "
                              "['AttnResForCausalLM']; convert the model with attnres-convert first.")
    if "quantization_config" in config:
        settings = config["quantization_config"]
        method = settings.get("quant_method") if isinstance(settings, dict) else settings
        raise ConversionError(f"{src} is already quantized (quant_method={method!r}); pass the unquantized checkpoint.")
    if config.get("num_experts"):
        raise ConversionError(f"{src} is a mixture of experts ({config['num_experts']} experts): attnres-quantize "
                              "writes W8A8 int8 for dense linear layers only, and vLLM's CPU build has no int8 "
                              "kernel for fused experts. Serve the unquantized model, or quantize it with a tool "
                              "that supports MoE (e.g. llm-compressor) on a GPU machine.")
    check_attnres_config(config, src)
    check_tensors(src, config)
    return config


def check_tensors(src: Path, config: dict) -> None:
    """Refuse a checkpoint whose tensors (read from the headers) are not the ones its config implies, by name
    and shape: quantizing copies every name as it is, and transformers and vLLM would start a missing tensor
    from random values. A tied checkpoint may also store its lm_head; the seed names of the attention site
    are allowed, since both loaders map them (`SEED_KEY_ALIASES`)."""
    with torch.device("meta"):
        model = modeling_attnres.AttnResForCausalLM(modeling_attnres.AttnResConfig.from_dict(config))
    expected = {key: tuple(shape) for key, shape in target_shapes(model).items()}
    checkpoint = open_checkpoint(src)
    found = {}
    for key in checkpoint.keys():
        ours = key
        for pattern, name in SEED_KEY_ALIASES.items():
            ours = re.sub(pattern, name, ours)
        found[ours] = tuple(checkpoint.shape(key))
    if model.config.tie_word_embeddings:
        found.pop("lm_head.weight", None)
    missing, extra = sorted(set(expected) - set(found)), sorted(set(found) - set(expected))
    misshapen = sorted(f"{k} {found[k]} (expected {expected[k]})" for k in set(found) & set(expected)
                       if found[k] != expected[k])
    if missing or extra or misshapen:
        problems = [f"{what}: {listing(keys, limit=5)}" for what, keys in (
            ("missing", missing), ("not in the model", extra), ("misshapen", misshapen)) if keys]
        raise ConversionError(f"SRC {src}: its tensors disagree with its config.json ({'; '.join(problems)}); "
                              "pass the complete checkpoint (copy or convert it again), or fix config.json.")


def quantize_checkpoint(src: str | Path, dst: str | Path, overwrite: bool = False,
                        reduce_range: bool = False) -> list[str]:
    """Write the W8A8 int8 checkpoint of the AttnRes checkpoint `src` to `dst` (atomically); with
    `reduce_range`, its weights in [-63, 63] (exact on CPUs without VNNI, see the module docstring).

    Returns the names of the quantized weights.
    """
    src, dst = Path(require_path(src, "SRC")), Path(require_path(dst, "DST"))
    config = read_config(src)
    check_destination(dst, src, overwrite)
    side_files(src)                             # a broken or outside link is refused before anything is written
    # A tied checkpoint's stored lm_head is the embedding again (in a .bin, the same storage, which safetensors
    # refuses to write twice); both loaders tie the head to the embedding, so it is left out.
    tied = modeling_attnres.AttnResConfig.from_dict(config).tie_word_embeddings
    config["quantization_config"] = quantization_config()
    tensors, done = quantize_tensors(open_checkpoint(src), REDUCED_MAX if reduce_range else INT8_MAX,
                                     skip=frozenset({"lm_head.weight"} if tied else ()))
    if not done:
        raise ConversionError(f"No q/k/v/o/gate/up/down projection weights in {src} (keys such as "
                              f"{listing(list(tensors), limit=5)}); is it an AttnRes checkpoint?")
    config["auto_map"] = dict(AUTO_MAP)
    with staged_destination(dst, overwrite) as tmp:      # DST was checked: absent, empty or --overwrite
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_side_files(src, tmp)
        for name in REMOTE_CODE_FILES:          # what save_pretrained ships beside `auto_map` (remote code)
            shutil.copyfile(Path(modeling_attnres.__file__).parent / name, tmp / name)
        (tmp / "README.md").write_text(quantized_card(src, len(done), reduce_range))
    return done


def quantized_card(src: Path, count: int, reduce_range: bool) -> str:
    """The model card (README.md) of a quantized checkpoint: what it is and how to serve it."""
    limit = REDUCED_MAX if reduce_range else INT8_MAX
    scale, base = carried_from_card(src)
    # The Hub links a quantization to the model it came from (its tree, "Quantizations of ...").
    lineage = [f"base_model: {base}", "base_model_relation: quantized"] if base else []
    carried = ([f"- residual-stream scale s: {scale:g} (applied when the source was converted from its "
                "Llama-family model, and kept: from the source's model card)", ""] if scale is not None else [])
    return "\n".join([
        "---", "library_name: transformers", "tags:", "- attnres", "- attention-residuals", "- compressed-tensors",
        "- int8", *lineage, "---", "", f"# W8A8 int8 quantization of {src.name}", "",
        f"An Attention Residuals (Kimi Team, arXiv:2603.15031) model, `{src}`, quantized with `attnres-quantize`: "
        f"{count} q/k/v/o/gate/up/down projection weights as symmetric per-output-channel int8 in "
        f"[-{limit}, {limit}]" + (" (`--reduce-range`, for CPUs without VNNI)" if reduce_range else "") +
        ", with dynamic per-token int8 activations (the compressed-tensors `int-quantized` format). The "
        "embeddings, lm_head, RMSNorm gains and depth-attention pseudo-queries keep their dtype; round-to-nearest, "
        "no calibration data.", "", *carried, "## Use", "", "```bash", "attnres-serve PATH_OR_REPO                "
        "# vLLM's CompressedTensorsW8A8Int8 scheme", "```", ""])


def main(argv: Sequence[str] | None = None) -> int:
    """`attnres-quantize SRC DST [--overwrite] [--reduce-range]`: W8A8 int8 (compressed-tensors) for vLLM."""
    parser = argparse.ArgumentParser(prog="attnres-quantize", description=main.__doc__)
    parser.add_argument("src", type=path_argument("SRC", str),
                        help="an AttnRes checkpoint folder (transformers layout), or a built-in model "
                             "(builtin:attnres-tiny, builtin:smollm2-135m-attnres, ...)")
    parser.add_argument("dst", type=path_argument("DST"), help="output folder (written atomically)")
    parser.add_argument("--overwrite", action="store_true", help="replace a DST that holds a checkpoint")
    parser.add_argument("--reduce-range", action="store_true",
                        help="int8 weights in [-63, 63]: exact products on CPUs without VNNI (AVX2 only), whose "
                             "int8 GEMM overflows full-range weights; half the weights' resolution")
    args = parser.parse_args(argv)
    try:
        done = quantize_checkpoint(builtin_folder(args.src, "attnres-quantize"), args.dst, overwrite=args.overwrite,
                                   reduce_range=args.reduce_range)
    except (ConversionError, OSError) as err:
        return fail("attnres-quantize", err)
    except KeyboardInterrupt:                    # the staging is already removed
        return fail("attnres-quantize", f"interrupted; nothing half-written is left at {args.dst}.",
                    status=EXIT_INTERRUPTED)
    reduced = f" in [-{REDUCED_MAX}, {REDUCED_MAX}]" if args.reduce_range else ""
    print(f"Quantized {len(done)} linear weights to int8{reduced} (W8A8, compressed-tensors) -> {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
