"""GGUF files (llama.cpp's format) as a conversion source: `attnres-convert model.gguf DST`.

A GGUF holds the weights (often quantized), the config as metadata and the tokenizer (vocabulary,
merges, special tokens, chat template). transformers reads all of it (`from_pretrained(folder,
gguf_file=...)`, which needs the `gguf` package) into its own model class (Llama), dequantised to
float32; that model is the standard conversion's source (read once), so the verification compares
the converted model with the dequantised source. The quantisation error itself is the GGUF's, not
the conversion's, and is not part of either number. Its config and tokenizer go to a folder next to
DST, removed when the conversion ends, or by the next writer in that folder if this one is killed
(`publish.scratch_folder`).
"""

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from .errors import ConversionError, listing
from .publish import scratch_folder

# GGUF `general.architecture` values whose transformers models the standard conversion carries
# (llama.cpp also writes Mistral models as "llama"; transformers maps those back to Mistral).
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
INSTALL_HINT = "install the gguf package (`pip install 'attnres[gguf]'` or `pip install gguf`)"


def _gguf_module():
    try:
        import gguf
    except ImportError as err:
        raise ConversionError(f"Reading a GGUF file needs the `gguf` package, which is not installed: "
                              f"{INSTALL_HINT}.") from err
    return gguf


def find_gguf(src: Path) -> Path | None:
    """The GGUF file SRC stands for: SRC itself, or the single `.gguf` in a folder without config.json."""
    if src.is_file():
        return src if src.suffix == ".gguf" else None
    if not src.is_dir() or (src / "config.json").exists():
        return None
    files = sorted(src.glob("*.gguf"))
    if len(files) > 1:
        raise ConversionError(f"{src} holds {len(files)} GGUF files ({listing(p.name for p in files)}); "
                              "pass the one to convert as SRC.")
    return files[0] if files else None


def dequantisable_types() -> list[str]:
    """Names of the ggml tensor types the `gguf` package can turn into floats (probed on one block)."""
    gguf = _gguf_module()
    names = []
    for qtype in gguf.GGMLQuantizationType:
        try:
            gguf.quants.dequantize(np.zeros(gguf.GGML_QUANT_SIZES[qtype][1], np.uint8), qtype)
        except (NotImplementedError, ValueError):
            continue
        names.append(qtype.name)
    return names


def inspect_gguf(path: Path) -> Counter:
    """Check the architecture and tensor types before any work; returns the count of each type."""
    gguf = _gguf_module()
    try:
        reader = gguf.GGUFReader(path)
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode()
    except (ValueError, KeyError, IndexError, OSError) as err:
        raise ConversionError(f"Cannot read {path} as a GGUF file: {err}. The file is truncated or corrupt, "
                              "or not a GGUF; download or copy it again.") from err
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ConversionError(f"Unsupported GGUF architecture {arch!r} in {path.name}: attnres-convert reads "
                              f"GGUF files of architecture {', '.join(map(repr, SUPPORTED_GGUF_ARCHITECTURES))} "
                              "(Llama-family). Convert the original transformers checkpoint instead.")
    types = Counter(t.tensor_type.name for t in reader.tensors)
    supported = dequantisable_types()
    unsupported = {name: [t.name for t in reader.tensors if t.tensor_type.name == name]
                   for name in types if name not in supported}
    if unsupported:
        found = "; ".join(f"{name} ({listing(tensors, limit=3)})" for name, tensors in unsupported.items())
        raise ConversionError(f"{path.name} holds tensor types that cannot be dequantised: {found}. Supported: "
                              f"{', '.join(supported)}. Re-export the GGUF with one of these types.")
    return types


def describe(types: Counter) -> str:
    """`GGUF (Q4_1: 210 tensors, F32: 61 tensors), dequantised to float32` for the summary and card."""
    counts = ", ".join(f"{name}: {n} tensor{'s' * (n != 1)}" for name, n in types.most_common())
    return f"GGUF ({counts}), dequantised to float32"


def load_dequantised(path: Path):
    """The GGUF as a dense float32 transformers model, and its tokenizer (with the chat template)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(path.parent), path.name
    try:
        loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                      quantization_config=GgufConfig(dequantize=True))
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except (ValueError, KeyError, OSError, RuntimeError) as err:
        raise ConversionError(f"transformers cannot load {path} as a GGUF model: {err}. Check that the file is "
                              "complete (download it again) and that its architecture is a plain Llama.") from err
    if hasattr(loaded.config, "quantization_config"):       # its tensors are dense float32 already
        del loaded.config.quantization_config
    loaded.config.architectures = [type(loaded).__name__]
    return loaded.eval(), tokenizer


@contextmanager
def dequantised_folder(path: Path, dst: Path) -> Iterator[tuple[Path, str, torch.nn.Module]]:
    """The GGUF read once, as a dense float32 transformers model, and a hidden sibling of DST holding its
    config, generation config and tokenizer (the side files of the conversion); removed on exit.

    Yields the folder, a description of the file's tensor types (for the summary and card) and the model.
    """
    types = inspect_gguf(path)
    with scratch_folder(dst) as folder:
        model, tokenizer = load_dequantised(path)
        model.config.save_pretrained(folder)
        model.generation_config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        yield folder, describe(types), model
