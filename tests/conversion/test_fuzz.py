"""The readers of untrusted files, fuzzed: GGUF (`inspect_gguf`, and `convert` for a few cases), safetensors
(`SafetensorsSource`) and config.json (`AttnResConfig.from_dict`, `AutoConfig.from_pretrained`).

Each reader gets seeded mutations of a valid tiny file (flipped bytes, counts and lengths set to 2**62,
2**64-1 and the like, truncations, garbage appended; for configs NaN, inf, negative, huge, wrong-typed
and missing fields) and must load it or refuse it with its error type and a message. The cases run in
a child process with a per-case time limit and its address space capped at 1 GiB above what its imports
mapped, so a reader that allocates by a claimed count fails its case instead of filling the machine; the
child prints one JSON line per case.
"""

import json
import math
import os
import random
import signal
import struct
import sys
import time
from pathlib import Path

import pytest

from tests.support.processes import run_bounded

ROOT = Path(__file__).resolve().parents[2]
HUGE = (2**62, 2**63, 2**64 - 1, 2**32, 2**31)
SMALL_U32 = (0, 7, 8, 9, 13, 99, 2**31, 2**32 - 1)     # value types 8/9 are string/array, 13+ no type
CASE_SECONDS = 10
# Address space the cases may add to what the child's imports mapped: a cap relative to the imports, since
# torch and transformers alone map about 0.95 GB here (more with CUDA builds).
BUDGET = 1 << 30
DRIVER = "import sys; from tests.conversion.test_fuzz import child; child(*sys.argv[1:])"


# ----------------------------------------------------------------------------------------- the child


class CaseTimeout(BaseException):
    """SIGALRM in the child: a case ran past its limit (a BaseException, so no reader's handler eats it)."""


def time_out(*_) -> None:
    raise CaseTimeout()


def gguf_reader():
    from attnres.conversion.errors import ConversionError
    from attnres.conversion.gguf_source import inspect_gguf

    return (lambda path: inspect_gguf(Path(path))), (ConversionError,)


def convert_reader():
    from attnres.conversion import ConversionError, ConvertOptions, convert

    return (lambda path: convert(Path(path), Path(path + ".out"), ConvertOptions(verify=False))), (ConversionError,)


def safetensors_reader():
    from attnres.conversion.checkpoint_io import SafetensorsSource
    from attnres.conversion.errors import ConversionError

    def read(path):
        source = SafetensorsSource([Path(path)])
        for key in source.keys():
            source.shape(key), source.dtype(key), source.get(key)

    return read, (ConversionError,)


def config_reader():
    import torch
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    from modeling_attnres import AttnResConfig, AttnResForCausalLM

    def read(folder):
        AttnResConfig.from_dict(json.loads((Path(folder) / "config.json").read_text()))
        config = AutoConfig.from_pretrained(folder)
        with torch.device("meta"):                          # a config that loads must also build its model
            AttnResForCausalLM(config)

    # huggingface_hub's strict-dataclass errors (type and validator failures) are plain Exceptions
    return read, (ValueError, StrictDataclassError)


READERS = {"gguf": gguf_reader, "convert": convert_reader, "safetensors": safetensors_reader, "config": config_reader}


def address_space() -> int:
    """Bytes of address space this process has mapped (VmSize)."""
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmSize:")[1].split()[0]) * 1024


def run_case(read, expected: tuple, path: str, seconds: float) -> dict:
    start = time.monotonic()
    signal.alarm(math.ceil(seconds))
    try:
        read(path)
        outcome = {"outcome": "loaded"}
    except CaseTimeout:
        outcome = {"outcome": "timeout"}
    except BaseException as err:        # MemoryError, RecursionError and the like are the bugs sought
        kind = "refused" if isinstance(err, expected) else "wrong error"
        outcome = {"outcome": kind, "error": f"{type(err).__module__}.{type(err).__name__}", "message": str(err)}
    finally:
        signal.alarm(0)
    return {**outcome, "seconds": round(time.monotonic() - start, 3)}


def child(cases_file: str, budget: str) -> None:
    """Run the cases of `cases_file` (readers imported first, then the address space capped at what they
    mapped plus `budget` bytes), printing `FUZZ {json}` per case as it ends."""
    import resource

    cases = json.loads(Path(cases_file).read_text())
    readers = {name: READERS[name]() for name in {case["reader"] for case in cases}}
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = address_space() + int(budget)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    signal.signal(signal.SIGALRM, time_out)
    for case in cases:
        print(f"START {case['name']}", flush=True)
        result = run_case(*readers[case["reader"]], case["path"], case.get("seconds", CASE_SECONDS))
        print("FUZZ " + json.dumps({"name": case["name"], **result}), flush=True)


# ---------------------------------------------------------------------------------------- the parent


def run_cases(cases: list[dict], tmp_path: Path, budget: int = BUDGET, timeout: float = 50) -> list[dict]:
    """Run `cases` ({name, reader, path}) in a child; its results, failing on a child that died or hung."""
    spec = tmp_path / "cases.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2", "TOKENIZERS_PARALLELISM": "false"}
    proc = run_bounded([sys.executable, "-c", DRIVER, str(spec), str(budget)], timeout=timeout, cwd=ROOT, env=env)
    results = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("FUZZ ")]
    if proc.returncode != 0 or len(results) != len(cases):
        started = [line[6:] for line in proc.stdout.splitlines() if line.startswith("START ")]
        pytest.fail(f"the child {'hung' if proc.returncode is None else f'exited with {proc.returncode}'} after "
                    f"{len(results)} of {len(cases)} cases, in case {started[-1] if started else None}; "
                    f"stderr: {proc.stderr[-3000:]}")
    return results


def assert_clean(results: list[dict], cases: list[dict], seconds: float = CASE_SECONDS) -> None:
    """Every case loaded, or was refused with a message (not a traceback), within `seconds`."""
    described = {case["name"]: case.get("mutation", "") for case in cases}
    bad = [r for r in results if r["outcome"] not in ("loaded", "refused") or r["seconds"] > seconds
           or (r["outcome"] == "refused" and (not r["message"].strip() or r["message"].startswith("Traceback")))]
    assert not bad, "\n".join(f"{r['name']} ({described[r['name']]}): {r['outcome']} after {r['seconds']} s: "
                              f"{r.get('error')}: {r.get('message', '')[:300]}" for r in bad)


def mutate_bytes(rng: random.Random, data: bytes, slots: dict[int, list[list[int]]], header: int) -> tuple[str, bytes]:
    """One seeded mutation of a file: flipped bytes in its first `header` bytes, a number at a known offset
    (`slots`: offsets of u64 and u32 numbers, grouped by field) overwritten, a cut (mostly in the header),
    garbage appended, or a number and a cut."""
    data, done = bytearray(data), []
    kind = rng.choice(["flip", "u64", "u64", "u64", "u32", "cut", "append", "u64+cut"])
    if kind == "flip":
        spots = sorted(rng.randrange(header) for _ in range(rng.randint(1, 8)))
        for spot in spots:
            data[spot] ^= 1 << rng.randrange(8)
        done.append(f"flip bytes at {spots}")
    if kind.startswith("u"):
        width = 4 if kind == "u32" else 8
        offset = rng.choice(rng.choice(slots[width]))
        value = rng.choice(SMALL_U32 if width == 4 else HUGE + (0, len(data), len(data) + 1))
        struct.pack_into("<I" if width == 4 else "<Q", data, offset, value)
        done.append(f"u{width * 8} at {offset} = {value}")
    if kind.endswith("cut"):
        cut = rng.randrange(header + 64 if rng.random() < 0.7 else len(data))
        data = data[:cut]
        done.append(f"cut at {cut}")
    if kind == "append":
        data += rng.randbytes(rng.randint(1, 4096))
        done.append("garbage appended")
    return ", ".join(done), bytes(data)


# -------------------------------------------------------------------------------------------- GGUF


def gguf_slots(path: Path) -> tuple[dict[int, list[list[int]]], int]:
    """Offsets of the header's u64 numbers (counts, lengths, dims, data offsets) and u32 numbers (value and
    tensor types, n_dims, metadata integers), grouped by field; and where the data section starts."""
    import numpy as np
    from gguf import GGUFReader

    reader = GGUFReader(path)
    base, slots = reader.data.ctypes.data, {4: [], 8: []}
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        for width, dtype in ((4, np.uint32), (8, np.uint64)):
            offsets = [part.ctypes.data - base + i for part in field.parts if part.dtype == dtype
                       for i in range(0, part.nbytes, width)]
            if offsets:
                slots[width].append(offsets)
    return slots, reader.data_offset


@pytest.fixture(scope="module")
def valid_gguf(tmp_path_factory) -> Path:
    from tests.conversion.builders import source_model
    from tests.conversion.gguf_files import VOCAB_SIZE, write_gguf

    model = source_model("llama", vocab_size=VOCAB_SIZE, num_hidden_layers=1)
    return write_gguf(model, tmp_path_factory.mktemp("gguf") / "valid.gguf")


def hostile_gguf(element_type: int) -> bytes:
    """The reported file: 94 bytes, whose metadata array claims 2**62 elements. Of int32 (type 5), gguf's
    reader reads each as an empty array past the end of the file, for ever; of strings (type 8) it fails
    on the first."""
    def string(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text

    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + string(b"general.architecture") + struct.pack("<I", 8)
    return head + string(b"llama") + string(b"a") + struct.pack("<IIQ", 9, element_type, 2**62)


@pytest.mark.timeout(60)
def test_gguf_whose_array_claims_2_62_elements_is_refused_at_once(tmp_path):
    cases = []
    for element_type in (5, 8):
        path = tmp_path / f"hostile-{element_type}.gguf"
        path.write_bytes(hostile_gguf(element_type))
        cases += [{"name": f"{path.name} via {reader}", "reader": reader, "path": str(path), "seconds": 5}
                  for reader in ("gguf", "convert")]
    for result in run_cases(cases, tmp_path):
        assert result["outcome"] == "refused" and result["seconds"] < 5, result
        assert result["error"] == "attnres.conversion.errors.ConversionError"
        assert "metadata array 'a' claims 4611686018427387904 elements but only 0 bytes remain" in result["message"]
        assert result["message"].endswith("The file is truncated or corrupt; download or copy it again.")


def test_the_bounds_check_passes_either_byte_order_and_holds_its_limits(tmp_path):
    """What the pre-scan must let through (gguf's own writer, either byte order, alignment 64, a string
    array), and its limits on array elements and tensors (checked without gguf's reader)."""
    import numpy as np
    from gguf import GGUFEndian, GGUFWriter

    from attnres.conversion.errors import ConversionError
    from attnres.conversion.gguf_source import MAX_ARRAY_ELEMENTS, MAX_TENSORS, check_gguf_bounds

    for order in GGUFEndian:
        writer = GGUFWriter(tmp_path / f"{order.name}.gguf", "llama", endianess=order)
        writer.add_uint32("general.alignment", 64)
        writer.add_token_list(["a", "bb", "ccc"])
        writer.add_tensor("x", np.ones((7, 10), np.float32))
        writer.add_tensor("y", np.ones(3, np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        check_gguf_bounds(tmp_path / f"{order.name}.gguf")
    many = MAX_ARRAY_ELEMENTS + 1
    (tmp_path / "elements.gguf").write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"a"
                                             + struct.pack("<IIQ", 9, 0, many) + bytes(many))
    with pytest.raises(ConversionError, match=f"its metadata arrays claim over {MAX_ARRAY_ELEMENTS} elements"):
        check_gguf_bounds(tmp_path / "elements.gguf")
    (tmp_path / "tensors.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, MAX_TENSORS + 1, 0)
                                            + bytes(24 * (MAX_TENSORS + 1)))
    with pytest.raises(ConversionError, match=f"it claims {MAX_TENSORS + 1} tensors, expected at most {MAX_TENSORS}"):
        check_gguf_bounds(tmp_path / "tensors.gguf")


def with_metadata(data: bytes, path: Path, key: str, value: int) -> bytes:
    """The GGUF's bytes with one u32 metadata value replaced."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    part = reader.fields[key].parts[-1]
    offset = part.ctypes.data - reader.data.ctypes.data
    return data[:offset] + struct.pack("<I", value) + data[offset + 4:]


def gguf_cases(folder: Path, valid: Path) -> list[dict]:
    """120 mutated GGUFs for `inspect_gguf`, and 9 whose metadata numbers (those transformers builds the
    model from) are 0, 10**8 or out of range, through the whole converter."""
    rng, data = random.Random(20260201), valid.read_bytes()
    slots, header = gguf_slots(valid)
    cases = []
    for i in range(120):
        mutation, mutated = mutate_bytes(rng, data, slots, header)
        (folder / f"{i}.gguf").write_bytes(mutated)
        cases.append({"name": f"gguf {i}", "reader": "gguf", "path": str(folder / f"{i}.gguf"), "mutation": mutation})
    metadata = [(f"llama.{key}", value) for key in ("block_count", "attention.head_count", "rope.dimension_count",
                                                    "embedding_length") for value in (0, 10**8)]
    for i, (key, value) in enumerate(metadata + [("tokenizer.ggml.bos_token_id", 2**32 - 1)]):
        path = folder / f"convert-{i}.gguf"
        path.write_bytes(with_metadata(data, valid, key, value))
        cases.append({"name": f"convert {i}", "reader": "convert", "path": str(path), "mutation": f"{key} = {value}"})
    return cases


# ------------------------------------------------------------------------------------------ safetensors


def safetensors_header(data: bytes) -> dict:
    (length,) = struct.unpack_from("<Q", data)
    return json.loads(data[8:8 + length])


def with_header(data: bytes, header: dict) -> bytes:
    """The file's tensor bytes under a new JSON header."""
    (length,) = struct.unpack_from("<Q", data)
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + length:]


def mutate_safetensors(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    """A byte-level mutation (the header length is the one u64), or one field of one tensor's entry set
    to a wrong dtype, shape or data offsets, or removed."""
    (length,) = struct.unpack_from("<Q", data)
    if rng.random() < 0.5:
        return mutate_bytes(rng, data, {8: [[0]], 4: [[0]]}, 8 + length)
    header = safetensors_header(data)
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(["dtype", "shape", "data_offsets", "__metadata__"])
    value = rng.choice({
        "dtype": ["F8_E4M3", "I64", "BOOL", "U8", "X", "", 7, None],
        "shape": [[2**62], [-1], [2**32, 2**32], [], [0], "x", [1.5], [2**64], None],
        "data_offsets": [[0, 2**62], [8, 0], [0, 2**64], [-1, 4], [0], [0, 0], None, [0, length]],
        "__metadata__": [{"format": 7}, [1], "x", None, {"a": {"b": 1}}],
    }[field] + ["drop"])
    entry = header if field == "__metadata__" else header[name]
    if value == "drop":
        entry.pop(field, None)
    else:
        entry[field] = value
    return f"{name}.{field} = {value!r}", with_header(data, header)


def safetensors_cases(folder: Path) -> list[dict]:
    """120 mutations of a three-tensor file (float32, float16, bfloat16)."""
    import torch
    from safetensors.torch import save_file

    path = folder / "valid.safetensors"
    save_file({"a": torch.randn(4, 8), "b": torch.zeros(16, dtype=torch.float16),
               "c": torch.ones(2, 3, dtype=torch.bfloat16)}, path, metadata={"format": "pt"})
    rng, data = random.Random(20260202), path.read_bytes()
    cases = []
    for i in range(120):
        mutation, mutated = mutate_safetensors(rng, data)
        (folder / f"{i}.safetensors").write_bytes(mutated)
        cases.append({"name": f"safetensors {i}", "reader": "safetensors", "mutation": mutation,
                      "path": str(folder / f"{i}.safetensors")})
    return cases


# -------------------------------------------------------------------------------------------- config


CONFIG_VALUES = (math.nan, math.inf, -math.inf, -1, 0, 2**62, -(2**62), 1.5, "7", None, True, [], {}, "drop")
# Non-numeric fields of the wrong type or value, each tried once.
WRONG_FIELDS = (("id2label", 1), ("dtype", math.inf), ("dtype", "7"), ("auto_map", 1), ("auto_map", {"AutoConfig": 1}),
                ("rope_parameters", []), ("hidden_act", 7), ("attn_res_mode", None), ("model_type", None))


def tiny_config() -> dict:
    from modeling_attnres import AttnResConfig

    return AttnResConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64).to_dict()


def mutate_config(rng: random.Random, config: dict) -> tuple[str, dict]:
    """One to three fields (numbers mostly, rope_theta among them) set to a hostile value, or dropped."""
    config = json.loads(json.dumps(config))
    numbers = [k for k, v in config.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    changes = []
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(numbers * 3 + list(config) + ["rope_parameters.rope_theta"] * 3)
        value = rng.choice(CONFIG_VALUES)
        parent, leaf = (config.get("rope_parameters"), "rope_theta") if "." in key else (config, key)
        if not isinstance(parent, dict):
            continue
        if value == "drop":
            parent.pop(leaf, None)
        else:
            parent[leaf] = value
        changes.append(f"{key} = {value!r}")
    return ", ".join(changes), config


def config_cases(folder: Path) -> list[dict]:
    """Every number of a tiny config at 0 and at -1, the WRONG_FIELDS, then 100 random mutations."""
    rng, base = random.Random(20260203), tiny_config()
    numbers = [k for k, v in base.items() if isinstance(v, int | float) and not isinstance(v, bool)]
    fields = [(k, v) for k in numbers for v in (0, -1)] + list(WRONG_FIELDS)
    edits = [(f"{k} = {v!r}", {**base, k: v}) for k, v in fields]
    edits += [mutate_config(rng, base) for _ in range(100)]
    cases = []
    for i, (mutation, config) in enumerate(edits):
        (folder / f"config-{i}").mkdir()
        (folder / f"config-{i}" / "config.json").write_text(json.dumps(config))
        cases.append({"name": f"config {i}", "reader": "config", "path": str(folder / f"config-{i}"),
                      "mutation": mutation})
    return cases


# -------------------------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory, valid_gguf) -> dict[str, tuple[list[dict], list[dict]]]:
    """Every reader's cases, run in one child (its imports take most of the time): {reader: (cases, results)}."""
    folder = tmp_path_factory.mktemp("fuzz")
    groups = {"gguf": gguf_cases(folder, valid_gguf), "safetensors": safetensors_cases(folder),
              "config": config_cases(folder)}
    results = {r["name"]: r for r in run_cases([c for cases in groups.values() for c in cases], folder, timeout=90)}
    return {name: (cases, [results[c["name"]] for c in cases]) for name, cases in groups.items()}


@pytest.mark.timeout(120)   # the first test to use `fuzzed` runs the child
def test_gguf_fuzz(fuzzed):
    cases, results = fuzzed["gguf"]
    assert_clean(results, cases)
    outcomes = {reader: [r["outcome"] for c, r in zip(cases, results) if c["reader"] == reader]
                for reader in ("gguf", "convert")}
    assert outcomes["gguf"].count("refused") >= 80          # the mutations do reach the checks
    assert set(outcomes["convert"]) == {"refused"}


@pytest.mark.timeout(120)
def test_safetensors_fuzz(fuzzed):
    cases, results = fuzzed["safetensors"]
    assert_clean(results, cases)
    assert [r["outcome"] for r in results].count("refused") >= 60


@pytest.mark.timeout(120)
def test_config_fuzz(fuzzed):
    cases, results = fuzzed["config"]
    assert_clean(results, cases)
    assert [r["outcome"] for r in results].count("refused") >= 40


def test_the_bounds_check_counts_the_alignment_padding_and_refuses_an_alignment_not_a_power_of_two(tmp_path):
    """Tensor data starts at the header's end rounded up to `general.alignment`: a file cut short by one byte is
    refused naming the tensor, even where the padding would hide that; and an alignment the spec does not
    allow (a power of two) is refused before any offset is computed from it."""
    import numpy as np
    from gguf import GGUFReader, GGUFWriter

    from attnres.conversion.errors import ConversionError
    from attnres.conversion.gguf_source import check_gguf_bounds

    def write(path, alignment=None):
        writer = GGUFWriter(path, "llama")
        if alignment:
            writer.add_uint32("general.alignment", alignment)
        writer.add_tensor("x", np.ones((7, 10), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    path = write(tmp_path / "cut.gguf")
    start = GGUFReader(path).data_offset                              # the header's end, rounded up to 32
    path.write_bytes(path.read_bytes()[:start + 279])                 # x's 280 bytes, less one
    with pytest.raises(ConversionError, match=r"tensor 'x' claims 280 bytes at data offset 0 but only 279 bytes"):
        check_gguf_bounds(path)
    with pytest.raises(ConversionError, match=r"general\.alignment is 24, expected a power of two"):
        check_gguf_bounds(write(tmp_path / "odd.gguf", alignment=24))
