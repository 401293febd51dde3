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

import json
import math
import os
import re
import struct
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from .errors import ConversionError, listing
from .publish import scratch_folder

# GGUF `general.architecture` values whose transformers models the standard conversion carries
# (llama.cpp also writes Mistral models as "llama"; transformers maps those back to Mistral).
SUPPORTED_GGUF_ARCHITECTURES = ("llama",)
INSTALL_HINT = "install the gguf package (`pip install 'attnres[gguf]'` or `pip install gguf`)"

# Limits of the header pre-scan (`check_gguf_bounds`). The gguf package's reader makes numpy objects for
# every metadata array element and every tensor (measured: 1M one-byte elements 17 s and 700 MB, 100k
# tensors 7 s and 500 MB), so a small file that claims many costs far more than its size. Real Llama
# GGUFs hold about 0.5M array elements (Llama 3's vocabulary and merges) and under 2,000 tensors.
MAX_ARRAY_ELEMENTS = 1 << 21
MAX_TENSORS = 1 << 16
MAX_NAME_BYTES = 65535      # the GGUF spec's limit on keys (tensor names are shorter still)
MAX_DIMS = 4                # GGML_MAX_DIMS
# Bytes of GGUF's fixed-size metadata value types, by type id (8 is a string, 9 an array).
VALUE_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY, UINT32 = 8, 9, 4
INTEGER_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}
# Metadata numbers (`ARCH.KEY`) transformers builds the model from before it reads a tensor; each is a
# tensor dimension or smaller, except the context length.
SHAPE_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count",
              "attention.head_count_kv", "rope.dimension_count", "vocab_size", "context_length")


# The tensors of a llama GGUF that transformers' reader puts into its Llama (built from the metadata, so without
# biases); it drops any other tensor without a word, e.g. `rope_freqs.weight`, Llama 3.1+'s rope scaling.
READ_TENSOR = re.compile(r"(token_embd|output_norm|output)\.weight|blk\.\d+\.(attn_norm|attn_q|attn_k|attn_v|"
                         r"attn_output|ffn_norm|ffn_gate|ffn_up|ffn_down)\.weight")
WHAT_DROPPED = {"rope_freqs.weight": "Llama 3.1+ rope scaling"}

# The oldest transformers whose GGUF loader this conversion can use: 5.17 added `GgufConfig`, and 5.16-5.17 read
# a GGUF tokenizer's end-of-sequence token wrong (a converted chat model would never stop).
MIN_TRANSFORMERS = (5, 18)


def _gguf_module():
    """The `gguf` package, where the installed transformers can read GGUF files too."""
    import transformers

    found = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    if found < MIN_TRANSFORMERS:
        raise ConversionError(f"Reading a GGUF file needs transformers >= {'.'.join(map(str, MIN_TRANSFORMERS))}, "
                              f"found {transformers.__version__}: pip install 'attnres[gguf]' (or upgrade "
                              "transformers).")
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
                              "pass the one to convert as SRC (or name it with --gguf-file).")
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


class _HeaderScan:
    """A GGUF header read a few bytes at a time: every count and length is checked against the bytes
    left in the file before anything is read or skipped by it."""

    def __init__(self, file, path: Path):
        self.file, self.path, self.size = file, path, os.fstat(file.fileno()).st_size
        self.order, self.elements = "<", 0

    def refuse(self, what: str, fix: str = "The file is truncated or corrupt; download or copy it again.") -> NoReturn:
        raise ConversionError(f"Cannot read {self.path} as a GGUF file: {what}. {fix}")

    def need(self, count: int, units: str, what: str, unit_bytes: int = 1) -> None:
        left = self.size - self.file.tell()
        if count * unit_bytes > left:
            self.refuse(f"{what} claims {count} {units} but only {left} bytes remain")

    def number(self, fmt: str, what: str) -> int:
        self.need(struct.calcsize(fmt), "bytes", what)
        return struct.unpack(self.order + fmt, self.file.read(struct.calcsize(fmt)))[0]

    def skip(self, count: int, units: str, what: str, unit_bytes: int = 1) -> None:
        self.need(count, units, what, unit_bytes)
        self.file.seek(count * unit_bytes, os.SEEK_CUR)

    def name_string(self, what: str) -> str:
        """A key or tensor name (short by the spec, so read; value strings are only skipped)."""
        length = self.number("Q", f"the length of {what}")
        if length > MAX_NAME_BYTES:
            self.refuse(f"{what} claims {length} bytes, expected at most {MAX_NAME_BYTES}")
        self.need(length, "bytes", what)
        return self.file.read(length).decode("utf-8", "replace")

    def value(self, vtype: int, key: str) -> None:
        """Skip one metadata value (arrays: their elements) by seeking, never reading it whole."""
        if vtype in VALUE_BYTES:
            self.skip(VALUE_BYTES[vtype], "bytes", f"metadata value {key!r}")
        elif vtype == STRING:
            self.skip(self.number("Q", f"the length of metadata string {key!r}"), "bytes", f"metadata string {key!r}")
        elif vtype != ARRAY:
            self.refuse(f"metadata value {key!r} has type {vtype}, expected a GGUF value type (0-12)")
        else:
            etype, count = self.number("I", f"the element type of {key!r}"), self.number("Q", f"the length of {key!r}")
            what = f"metadata array {key!r}"
            if etype not in VALUE_BYTES and etype != STRING:
                self.refuse(f"{what} has element type {etype}, expected a number, bool or string type (0-8, 10-12)")
            self.need(count, "elements", what, VALUE_BYTES.get(etype, 8))   # a string is at least its length
            self.elements += count
            if self.elements > MAX_ARRAY_ELEMENTS:
                self.refuse(f"its metadata arrays claim over {MAX_ARRAY_ELEMENTS} elements (at {key!r}), far "
                            "more than a Llama model's vocabulary needs")
            if etype == STRING:
                for _ in range(count):
                    self.skip(self.number("Q", f"a string's length in {what}"), "bytes", f"a string in {what}")
            else:
                self.file.seek(count * VALUE_BYTES[etype], os.SEEK_CUR)

    def tensor_info(self, quant_sizes: dict) -> tuple[str, int, int]:
        """A tensor's name, byte size (compared, never allocated) and offset in the data section."""
        name = self.name_string("a tensor name")
        n_dims = self.number("I", f"the dimension count of tensor {name!r}")
        if n_dims > MAX_DIMS:
            self.refuse(f"tensor {name!r} claims {n_dims} dimensions, expected at most {MAX_DIMS}")
        dims = [self.number("Q", f"the shape of tensor {name!r}") for _ in range(n_dims)]
        qtype, offset = self.number("I", f"the type of tensor {name!r}"), self.number("Q", f"the offset of {name!r}")
        if qtype not in quant_sizes:
            self.refuse(f"tensor {name!r} has type id {qtype}, which is not a ggml tensor type this gguf package "
                        "knows", "The file is corrupt, or newer than the gguf package: `pip install -U gguf`.")
        if 0 in dims:
            self.refuse(f"tensor {name!r} has shape {dims}, expected no dimension of 0")
        block_elements, block_bytes = quant_sizes[qtype]
        return name, math.prod(dims) * block_bytes // block_elements, offset


def check_gguf_bounds(path: Path) -> None:
    """Refuse a GGUF whose header claims more than the file holds, before the gguf package's reader
    allocates by those claims (a 100-byte file with a metadata array of 2**62 elements made it run for
    minutes and take GBs): walks the header, checking each count and length against the bytes left
    and each tensor's data against the end of the file."""
    gguf = _gguf_module()
    try:
        with open(path, "rb") as file:
            scan = _HeaderScan(file, path)
            if (magic := file.read(4)) != b"GGUF":
                scan.refuse(f"it starts with {magic!r}, expected b'GGUF'")
            version = scan.number("I", "the version")
            if version & 0xFFFF == 0:       # written on a big-endian machine; gguf's reader reads those too
                scan.order, version = ">", int.from_bytes(version.to_bytes(4, "little"), "big")
            if version not in (2, 3):
                scan.refuse(f"it is GGUF version {version}, expected 2 or 3", "Re-export it with a current llama.cpp.")
            tensors, kvs = scan.number("Q", "the tensor count"), scan.number("Q", "the metadata count")
            scan.need(kvs, "metadata entries", "the metadata count", 13)    # key length, type, a 1-byte value
            scan.need(tensors, "tensors", "the tensor count", 24)           # name length, n_dims, type, offset
            if tensors > MAX_TENSORS:
                scan.refuse(f"it claims {tensors} tensors, expected at most {MAX_TENSORS}")
            alignment = 32
            for _ in range(kvs):
                key = scan.name_string("a metadata key")
                vtype = scan.number("I", f"the type of metadata value {key!r}")
                if key == "general.alignment" and vtype == UINT32:
                    alignment = scan.number("I", key)
                    if alignment == 0 or alignment & (alignment - 1):
                        scan.refuse(f"general.alignment is {alignment}, expected a power of two")
                else:
                    scan.value(vtype, key)
            infos = [scan.tensor_info(gguf.GGML_QUANT_SIZES) for _ in range(tensors)]
            start = -(-file.tell() // alignment) * alignment
            for name, size, offset in infos:
                if start + offset + size > scan.size:
                    scan.refuse(f"tensor {name!r} claims {size} bytes at data offset {offset} but only "
                                f"{max(scan.size - start - offset, 0)} bytes remain there")
    except OSError as err:
        raise ConversionError(f"Cannot read {path}: {err}. Check the path and its permissions.") from err


def inspect_gguf(path: Path) -> Counter:
    """Check the file's bounds, architecture, shape metadata and tensor types before any work (and before
    anything else reads it); returns the count of each tensor type."""
    gguf = _gguf_module()
    check_gguf_bounds(path)
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
    check_single_file(reader, path)
    check_shape_metadata(reader, arch, path)
    check_dense(reader, arch, path)
    check_read_in_full(reader, arch, path)
    types = Counter(t.tensor_type.name for t in reader.tensors)
    supported = dequantisable_types()
    unsupported = {name: [t.name for t in reader.tensors if t.tensor_type.name == name]
                   for name in types if name not in supported}
    if unsupported:
        found = "; ".join(f"{name} ({listing(tensors, limit=3)})" for name, tensors in unsupported.items())
        raise ConversionError(f"{path.name} holds tensor types that cannot be dequantised: {found}. Supported: "
                              f"{', '.join(supported)}. Re-export the GGUF with one of these types.")
    return types


def check_shape_metadata(reader, arch: str, path: Path) -> None:
    """Refuse shape metadata that transformers cannot build a model from, or would build a model far larger
    than the file from (it makes every claimed layer first: a claim of 10**8 layers ran for minutes): each
    number a positive integer no larger than the largest tensor dimension, the block count the number of
    layers the file holds tensors for."""
    layers = len({t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")})
    largest = max((int(d) for t in reader.tensors for d in t.shape), default=0)
    for key in SHAPE_KEYS:
        field = reader.fields.get(f"{arch}.{key}")
        if field is None:
            continue
        integer = len(field.types) == 1 and int(field.types[0]) in INTEGER_TYPES
        value = int(field.parts[field.data[0]][0]) if integer else None
        low, high = {"block_count": (layers, layers), "context_length": (1, math.inf)}.get(key, (1, largest))
        expected = (f"{layers}, the number of layers it holds tensors for" if key == "block_count" else
                    "a positive integer" if key == "context_length" else
                    f"a positive integer no larger than its largest tensor dimension ({largest})")
        if value is None or not low <= value <= high:
            shown = value if value is not None else f"a {field.types[-1].name.lower()} value"
            raise ConversionError(f"Cannot read {path} as a GGUF model: its metadata {arch}.{key} is {shown}, "
                                  f"expected {expected}. The file is corrupt; download or copy it again.")


def metadata_value(reader, key: str):
    """A scalar metadata value (a number or a string), `None` where the key is absent."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode(errors="replace") if int(field.types[0]) == STRING else value[0].item()


def check_single_file(reader, path: Path) -> None:
    """Refuse one part of a split GGUF (`llama-gguf-split`): its tensors are a fraction of the model."""
    count = metadata_value(reader, "split.count") or 1
    if count > 1:
        raise ConversionError(f"{path.name} is one of {count} parts of a split GGUF (split.count = {count}), which "
                              "attnres-convert does not read; merge them into one file with llama.cpp's "
                              f"`llama-gguf-split --merge {path.name} merged.gguf` and convert that.")


def check_read_in_full(reader, arch: str, path: Path) -> None:
    """Refuse what transformers' GGUF reader would drop without a word, so that the conversion (and its
    verification, against that reader's model) would describe another model: tensors its Llama has no
    place for (`rope_freqs.weight`: Llama 3.1+ rope scaling; biases) and rope scaling metadata."""
    dropped = [t.name for t in reader.tensors if not READ_TENSOR.fullmatch(t.name)]
    scaling = metadata_value(reader, f"{arch}.rope.scaling.type")
    factor = metadata_value(reader, f"{arch}.rope.scaling.factor")
    if scaling not in (None, "none") or factor not in (None, 0, 1):
        dropped.append(f"{arch}.rope.scaling.type = {scaling}, factor {factor} (rope scaling)")
    if dropped:
        named = [f"{name} ({WHAT_DROPPED[name]})" if name in WHAT_DROPPED else name for name in dropped]
        raise ConversionError(f"{path.name} holds what transformers' GGUF reader drops: {listing(named, limit=4)}; "
                              "the converted model would compute another model than the file's. Convert the "
                              "original transformers checkpoint instead.")


def check_dense(reader, arch: str, path: Path) -> None:
    """Refuse a mixture of experts (llama.cpp writes Mixtral as "llama" with an expert count): its experts
    are not read from GGUF here, and transformers would build a dense Llama without them."""
    count = metadata_value(reader, f"{arch}.expert_count")
    if count:
        raise ConversionError(f"{path.name} is a mixture of experts ({arch}.expert_count = {count}): attnres-convert "
                              "reads dense GGUF models only. Convert the original transformers checkpoint "
                              "(Mixtral, Qwen2-MoE and Qwen3-MoE are supported) instead.")


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
    except Exception as err:    # bad metadata surfaces as any type: ZeroDivisionError, IndexError, StrictDataclassError
        raise ConversionError(f"transformers cannot load {path} as a GGUF model: {type(err).__name__}: {err}. Check "
                              "that the file is complete (download it again) and that its architecture is a plain "
                              "Llama.") from err
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
        drop_load_settings(folder / "tokenizer_config.json")
        yield folder, describe(types), model


# How transformers was asked to read the file here (offline, a local folder), which `save_pretrained` writes into
# the tokenizer's config: a published model would then refuse to look anything up on the Hub.
LOAD_SETTINGS = ("local_files_only", "is_local", "gguf_file")


def drop_load_settings(path: Path) -> None:
    """Remove `LOAD_SETTINGS` from a saved tokenizer config."""
    if path.is_file():
        saved = json.loads(path.read_text(encoding="utf-8"))
        path.write_text(json.dumps({k: v for k, v in saved.items() if k not in LOAD_SETTINGS}, indent=2,
                                   ensure_ascii=False) + "\n", encoding="utf-8")
