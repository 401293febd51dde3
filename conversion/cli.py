"""`attnres-convert SRC DST`: convert a Llama-family or other-layout AttnRes checkpoint to AttnRes.

Examples:
    attnres-convert meta-llama/Llama-3.2-1B out/llama-attnres
    attnres-convert ./qwen3-0.6b out/qwen3-attnres --block-size 4 --dtype bfloat16 --push-to-hub me/qwen3-attnres
    attnres-convert run/ckpt.pt out/seed --config run/config.json --seed-block-size 8
    attnres-convert smollm2-135m-instruct-q4_1.gguf out/smollm2-attnres --dtype bfloat16
    attnres-convert bartowski/Llama-3.2-1B-Instruct-GGUF out/llama --gguf-file Llama-3.2-1B-Instruct-Q8_0.gguf
"""

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from .checkpoint_io import path_argument
from .converter import convert
from .datatypes import DTYPES, ConversionResult, ConvertOptions
from .errors import EXIT_INTERRUPTED, ConversionError, fail
from .hub import push_folder, require_token, upload_command

PROG = "attnres-convert"


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface; every option maps onto a `ConvertOptions` field."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=path_argument("SRC", str), help="local folder, Hub repo id (ORG/NAME), a .pt/.bin "
                   "state dict or a Llama .gguf file (or a folder holding one)")
    p.add_argument("dst", type=path_argument("DST"),
                   help="output folder (written to a temporary sibling, renamed at the end)")
    p.add_argument("--block-size", type=int, help="layers per block (default: ceil(layers / 8), about 8 blocks)")
    p.add_argument("--mode", choices=("block", "full"), default="block", help="Block or Full AttnRes")
    p.add_argument("--stream-scale", type=float, help="scale s of the residual stream for standard models "
                   "(default: the power of two with the smallest predicted logit error, calibrated on the source; "
                   "1 for float16 output or eps 0; 1 keeps the weights identical)")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="output dtype (default: the source's)")
    p.add_argument("--overwrite", action="store_true", help="replace a DST that holds a checkpoint "
                   "(a non-empty folder without a config.json beside weights is refused)")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip running both models")
    p.add_argument("--keep-failed", action="store_true", help="publish DST even if the verification fails "
                   "(by default a failed verification leaves nothing at DST and exits with status 1)")
    p.add_argument("--clip-to-sliding-window", dest="clip_to_window", action="store_true",
                   help="convert a sliding-window model (Mistral, Mixtral, Qwen2, Qwen3, Qwen2/3-MoE) with "
                        "max_position_embeddings cut to the window")
    p.add_argument("--seed-block-size", type=int, help="block size of a seed-layout checkpoint, in sublayers")
    p.add_argument("--config", dest="config_path", type=Path, help="config.json for a bare state-dict file")
    p.add_argument("--revision", help="Hub revision of SRC")
    p.add_argument("--gguf-file", metavar="NAME", help="the .gguf file to convert in SRC, a folder or Hub repo "
                   "holding several (from the Hub only that file is downloaded)")
    p.add_argument("--max-shard-size", default="5GB", help="safetensors shard size of the output")
    p.add_argument("--push-to-hub", metavar="REPO", help="upload DST to this Hub repo after converting")
    p.add_argument("--private", action="store_true", default=None, help="create the Hub repo as private")
    return p


def scale_said(result: ConversionResult) -> str:
    """The stream scale as the summary gives it: an AttnRes source's is not changed (its card's, where known)."""
    if result.layout != "attnres":
        return f"{result.stream_scale:g}"
    known = result.source_stream_scale
    return "unchanged" + (f" ({known:g}, from the source's model card)" if known is not None else "")


def summary(result: ConversionResult) -> list[str]:
    """What the CLI prints after a conversion."""
    cfg = result.config
    origin = f"; {result.origin}" if result.origin else ""
    lines = [f"Converted {result.src} ({result.layout}{origin}) -> {result.dst}",
             f"  {cfg.num_hidden_layers} layers, attn_res_mode={cfg.attn_res_mode}, "
             f"attn_res_block_size={cfg.attn_res_block_size}, dtype={str(result.dtype).removeprefix('torch.')}, "
             f"stream scale={scale_said(result)}, rms_norm_eps={cfg.rms_norm_eps:g}"]
    if result.scale_errors:
        lines.append(f"  stream scale calibration (predicted relative logit error): {result.calibration_summary()}")
    if result.verification is not None:
        lines += ["Verification:", *(f"  {line}" for line in result.verification.lines())]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `attnres-convert`; returns the exit status (`errors`: 1 failed work, 2 bad usage)."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    src, dst, repo, private = args.pop("src"), args.pop("dst"), args.pop("push_to_hub"), args.pop("private")
    if private and not repo:
        parser.error("--private applies to the Hub repo that --push-to-hub creates; add --push-to-hub REPO "
                     "or drop --private.")
    if repo:
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(repo)
        except HFValidationError as err:
            parser.error(f"--push-to-hub {repo!r} is not a Hub repo id ({str(err).splitlines()[0]}); expected "
                         "NAME or OWNER/NAME.")
    try:
        if repo:
            require_token(repo)                  # before the conversion, not after it
        result = convert(src, dst, ConvertOptions(**args))
    except (ConversionError, OSError) as err:
        return fail(PROG, err)
    except KeyboardInterrupt:                    # the staging is already removed
        return fail(PROG, f"interrupted; nothing half-written is left at {dst}.", status=EXIT_INTERRUPTED)
    print("\n".join(summary(result)))
    if result.verification is not None and not result.verification.passed:
        print(f"attnres-convert: warning: verification FAILED ({'; '.join(result.verification.failures())}); "
              f"{result.dst} was published anyway because of --keep-failed.", file=sys.stderr)
    if repo:
        try:
            print(f"Pushed to {push_folder(result.dst, repo, private=private)}")
        except ConversionError as err:
            return fail(PROG, err)
        except KeyboardInterrupt:
            return fail(PROG, f"interrupted while pushing; the converted checkpoint is complete at {result.dst} "
                        f"(push it again with `{upload_command(repo, result.dst, private)}`).", status=EXIT_INTERRUPTED)
    return 0


if __name__ == "__main__":
    sys.exit(main())
