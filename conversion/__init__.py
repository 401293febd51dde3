"""Checkpoint conversion to AttnRes (installed as `attnres.conversion`).

`convert(src, dst, ConvertOptions(...))` is the API behind the `attnres-convert` command; the key maps
live in `standard` (Llama, Qwen2, Qwen3, Mistral) and `seed` (other AttnRes layouts); Llama GGUF
files are dequantised into a standard source first (`gguf_source`).
"""

from .converter import VerificationFailed, convert
from .datatypes import ConversionResult, ConvertOptions, VerifyReport
from .errors import ConversionError
from .hub import push_folder

__all__ = ["ConversionError", "ConversionResult", "ConvertOptions", "VerificationFailed", "VerifyReport", "convert",
           "push_folder"]
