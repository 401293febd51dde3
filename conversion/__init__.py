"""Checkpoint conversion to AttnRes (installed as `attnres.conversion`).

`convert(src, dst, ConvertOptions(...))` is the API behind the `attnres-convert` command; the key maps
live in `standard` (Llama, Qwen2, Qwen3, Mistral) and `seed` (other AttnRes layouts); Llama GGUF
files are dequantised into a standard source first (`gguf_source`).

The names below are imported on first use (PEP 562), so that importing a light module of this package
(`errors`, `publish`, the console scripts' `commands`) does not load torch and transformers.
"""

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .converter import VerificationFailed, convert
    from .datatypes import ConversionResult, ConvertOptions, VerifyReport
    from .errors import ConversionError
    from .hub import push_folder

_HOMES = {"VerificationFailed": ".converter", "convert": ".converter", "ConversionResult": ".datatypes",
          "ConvertOptions": ".datatypes", "VerifyReport": ".datatypes", "ConversionError": ".errors",
          "push_folder": ".hub"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})


__all__ = ["ConversionError", "ConversionResult", "ConvertOptions", "VerificationFailed", "VerifyReport", "convert",
           "push_folder"]
