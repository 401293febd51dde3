"""Reading source checkpoints (local or Hub), checking the destination, carrying side files over.

Sources: transformers folders (`model.safetensors` or `pytorch_model.bin`, either sharded with its
`.index.json`), and plain PyTorch state-dict files (`.pt`/`.bin`/`.pth`). Safetensors files
are opened lazily, one tensor at a time. Writing the output is `publish.staged_folder`'s job.
"""

import argparse
import errno
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .errors import ConversionError, UsageError, hub_reason, listing
from .publish import STAGING_MARK, staged_folder

SAFE_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
STATE_DICT_SUFFIXES = (".pt", ".bin", ".pth")
# Files the converter writes itself, or that describe the source weights, are not carried over.
NOT_CARRIED = re.compile(
    r"(.*\.(safetensors|bin|pt|pth|py|msgpack|h5|ckpt|gguf|onnx)|.*\.index\.json|config\.json|README\.md)\Z")
REPO_ID = re.compile(r"^(?![.-])[\w.-]+(/(?![.-])[\w.-]+)?\Z")      # the Hub's names start with neither
SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


class SafetensorsSource:
    """Lazy access to one or several safetensors files (a sharded checkpoint)."""

    def __init__(self, files: list[Path], weight_map: dict[str, str] | None = None):
        self._handles, self._where = {}, {}
        for path in files:
            try:
                handle = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as err:
                raise ConversionError(
                    f"Cannot read safetensors file {path}: {err}. The file is truncated or corrupt "
                    "(an interrupted download or copy?); download or copy it again."
                ) from err
            self._handles[path.name] = handle
            for key in handle.keys():
                self._where[key] = path.name
        if weight_map is not None:
            check_index(SAFE_INDEX, weight_map, self._where)

    def keys(self) -> Iterable[str]:
        return self._where.keys()

    def get(self, key: str) -> torch.Tensor:
        try:
            return self._handles[self._where[key]].get_tensor(key)
        except SafetensorError as err:
            raise ConversionError(f"Cannot read tensor {key} from {self._where[key]}: {err}. "
                                  "The file is corrupt; download or copy it again.") from err

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handles[self._where[key]].get_slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        name = self._handles[self._where[key]].get_slice(key).get_dtype()
        if name not in SAFETENSORS_DTYPES:
            raise ConversionError(f"Tensor {key} in {self._where[key]} has dtype {name}; expected one of "
                                  f"{', '.join(SAFETENSORS_DTYPES)} (an unquantized checkpoint).")
        return SAFETENSORS_DTYPES[name]


def check_index(index: str, weight_map: dict[str, str], where: dict[str, str]) -> None:
    """Every tensor the index names is in the shard it names (`where`: tensor -> file), and no other."""
    wrong = [f"{k} (index: {f}, found in: {where.get(k, 'no shard')})"
             for k, f in weight_map.items() if where.get(k) != f]
    extra = [k for k in where if k not in weight_map]
    if wrong or extra:
        raise ConversionError(
            f"{index} does not match the shards: {listing(wrong + extra, limit=8)}. "
            "The shards and the index come from different saves; download the checkpoint again."
        )


def read_index(index: Path) -> dict[str, str]:
    """The `weight_map` of a sharded checkpoint's index, its shards checked present."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise ConversionError(f"{index} is not a valid checkpoint index ({err}); download it again.") from err
    if not isinstance(weight_map, dict):
        raise ConversionError(f"{index} is not a valid checkpoint index (its weight_map is a "
                              f"{type(weight_map).__name__}, expected an object of tensor name -> shard file name); "
                              "download it again.")
    bad = next(((k, f) for k, f in weight_map.items() if not isinstance(f, str)), None)
    if bad is not None:
        raise ConversionError(f"{index} is not a valid checkpoint index (its weight_map gives {bad[0]!r} the shard "
                              f"{bad[1]!r}, expected a file name); download it again.")
    missing = sorted({f for f in weight_map.values() if not (index.parent / f).exists()})
    if missing:
        raise ConversionError(f"{index} names shard(s) that are not in {index.parent}: {listing(missing)}. "
                              "Download the complete checkpoint.")
    return weight_map


class StateDictSource:
    """A state dict already in memory (from a `.pt`/`.bin` file)."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self._sd = state_dict

    def keys(self) -> Iterable[str]:
        return self._sd.keys()

    def get(self, key: str) -> torch.Tensor:
        return self._sd[key]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._sd[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._sd[key].dtype


class LoadedSource:
    """A checkpoint read once: its key names, shapes and dtypes from its files (so the key map judges
    the checkpoint itself), its tensors from the model transformers loaded from it."""

    def __init__(self, checkpoint: "SafetensorsSource | StateDictSource", model: torch.nn.Module):
        self._checkpoint, self._tensors = checkpoint, model.state_dict()

    def keys(self) -> Iterable[str]:
        return self._checkpoint.keys()

    def get(self, key: str) -> torch.Tensor:
        tensor = self._tensors.get(key)
        return tensor if tensor is not None else self._checkpoint.get(key)   # a name the loader renamed

    def shape(self, key: str) -> tuple[int, ...]:
        return self._checkpoint.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self._checkpoint.dtype(key)


def load_state_dict_file(path: Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Tensors of a `torch.save` file and the config dict stored with them, if any.

    Accepts a bare state dict or the usual training-script wrapper `{"model"|"state_dict": sd,
    "config": {...}}`. Loaded with `weights_only=True`: a pickle cannot run code here.
    """
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several unrelated types for bad pickles and zip archives
        # torch's text spans lines and advises loading unsafely, which would run the file's code: keep the cause.
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        cause = next((line for line in lines if "WeightsUnpickler error" in line), lines[0]).split(" Please use")[0]
        raise ConversionError(f"Cannot load {path} as a PyTorch state dict ({cause}); the file is corrupt, "
                              "truncated, or not a torch.save of tensors (Python objects other than tensors are "
                              "not loaded, since unpickling them could run code): save model.state_dict(), or "
                              "convert from safetensors.") from err
    if not isinstance(obj, dict):
        raise ConversionError(f"{path} holds a {type(obj).__name__}, expected a dict of tensors; "
                              "save `model.state_dict()`, not the module.")
    config = obj.get("config") if isinstance(obj.get("config"), dict) else None
    for wrapper in ("model", "state_dict", "model_state_dict"):
        if isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
            break
    not_tensors = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise ConversionError(f"{path} has entries that are not tensors: {listing(not_tensors)}; "
                              "expected a state dict (or {'model': state_dict, 'config': {...}}).")
    return obj, config


def open_checkpoint(folder: Path) -> SafetensorsSource | StateDictSource:
    """The tensors of a transformers-style folder: sharded or single safetensors, else `.bin`."""
    if (folder / SAFE_INDEX).exists():
        weight_map = read_index(folder / SAFE_INDEX)
        return SafetensorsSource([folder / f for f in sorted(set(weight_map.values()))], weight_map)
    shards = sorted(folder.glob("*.safetensors"))
    if shards:
        return SafetensorsSource(shards)
    if (folder / BIN_INDEX).exists():
        weight_map, state_dict, where = read_index(folder / BIN_INDEX), {}, {}
        for name in sorted(set(weight_map.values())):
            shard = load_state_dict_file(folder / name)[0]
            state_dict.update(shard)
            where.update(dict.fromkeys(shard, name))
        check_index(BIN_INDEX, weight_map, where)
        return StateDictSource(state_dict)
    for path in sorted(folder.iterdir()):
        if path.suffix in STATE_DICT_SUFFIXES:
            return StateDictSource(load_state_dict_file(path)[0])
    raise ConversionError(f"No weights in {folder}: expected model.safetensors, {SAFE_INDEX} with its shards, "
                          f"a pytorch_model.bin, or {BIN_INDEX} with its shards.")


def resolve_source(src: str, revision: str | None = None, gguf_file: str | None = None) -> Path:
    """A local path as is; otherwise a Hub repo id, downloaded (or found in the cache when
    `HF_HUB_OFFLINE=1`) with `huggingface_hub.snapshot_download`. With `gguf_file`, that file of the
    folder or repo (and, from the Hub, only that file is downloaded)."""
    path = Path(src).expanduser()
    if not path.exists():
        path = _download_source(src, revision, gguf_file)
    if gguf_file is None:
        return path
    if not (path / gguf_file).is_file():
        found = listing(str(p.relative_to(path)) for p in path.rglob("*.gguf")) or "none"
        raise ConversionError(f"--gguf-file {gguf_file!r} is not a file of {src} (its GGUF files: {found}); "
                              "pass one of those.")
    return path / gguf_file


def _download_source(src: str, revision: str | None, gguf_file: str | None) -> Path:
    """A Hub repo's snapshot, with only the files the conversion reads."""
    if not REPO_ID.match(src):
        raise ConversionError(f"SRC {src!r} is not an existing path and not a Hub repo id (ORG/NAME).")
    from huggingface_hub import snapshot_download

    try:
        patterns = download_patterns(src, revision, gguf_file)
        return Path(snapshot_download(repo_id=src, revision=revision, **patterns))
    except ConversionError:
        raise
    except Exception as err:  # network, auth, offline-cache misses: all end the same way for the user
        raise ConversionError(f"SRC {src!r} is not a local path and could not be fetched from the Hub: "
                              f"{hub_reason(err, revision)}; or download it and pass its folder.") from err


# Files of a Hub repo the conversion never reads: other formats of the same weights (ONNX, Flax, TF, Core ML,
# the original consolidated checkpoint of Llama repos). Many repos hold the weights two or three times over.
NEVER_READ = ["original/*", "onnx/*", "*.onnx", "*.onnx_data", "*.msgpack", "*.h5", "*.ot", "*.tflite",
              "coreml/*", "*.mlmodel", "*.mlpackage/*"]


def download_patterns(repo_id: str, revision: str | None, gguf_file: str | None = None) -> dict[str, list[str]]:
    """`snapshot_download`'s file patterns for a source repo: `gguf_file` alone where given; else all but
    `NEVER_READ`, the PyTorch pickles where the repo also has safetensors (read first) and GGUF copies
    beside a config.json (never read). A GGUF repo of several files without `gguf_file` is refused before
    anything is downloaded: a typical one holds every quantisation of the model, gigabytes each. Offline,
    the cache is read as it is."""
    from huggingface_hub import HfApi, constants

    if gguf_file is not None:
        return {"allow_patterns": [gguf_file]}
    if constants.is_offline_mode():
        return {"ignore_patterns": NEVER_READ}
    files = HfApi().list_repo_files(repo_id, revision=revision)      # errors: as snapshot_download's would be
    ggufs = sorted(name for name in files if name.endswith(".gguf"))
    if "config.json" not in files and len(ggufs) > 1:
        raise ConversionError(f"{repo_id} holds {len(ggufs)} GGUF files ({listing(ggufs)}) and no config.json; "
                              "pick the one to convert with --gguf-file NAME (nothing was downloaded).")
    has_safetensors = any(name.endswith(".safetensors") and "/" not in name for name in files)
    skipped = (["*.bin", "*.pth", "*.pt"] if has_safetensors else []) + (["*.gguf"] if "config.json" in files else [])
    return {"ignore_patterns": NEVER_READ + skipped}


def is_builtin(model: str | Path) -> bool:
    """Whether a model argument names a built-in model (`builtin:NAME`, as `attnres-serve` takes it)."""
    return str(model).startswith("builtin:")


def builtin_folder(src: str, prog: str) -> str:
    """`src` itself, or the folder of the built-in model it names (`builtin:NAME`, as `attnres-serve` takes it:
    built on first use and cached; an unknown name is a usage error listing the built-in models). `prog`
    names the command in the build's progress lines."""
    if not is_builtin(src):
        return src
    from attnres.serving.default_model import DefaultModelUnavailable  # the server's names and cache, only here
    from attnres.serving.defaults import resolve_model

    try:
        return resolve_model(src, prog=prog)
    except DefaultModelUnavailable as err:           # no registry, a wrong download: said in one line
        raise ConversionError(" ".join(str(err).split())) from err


def read_json_object(path: Path) -> dict:
    """The JSON object in `path` (a config); a file that cannot be read, is not JSON or holds no object is a
    `ConversionError` naming it."""
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConversionError(f"Cannot read {path} as JSON ({err}); fix the file, or save or convert the "
                              "checkpoint again.") from None
    if not isinstance(config, dict):
        raise ConversionError(f"{path} holds a JSON {type(config).__name__}, not an object of config fields; fix "
                              "the file, or save or convert the checkpoint again.")
    return config


def check_attnres_config(config: dict, folder: Path) -> None:
    """Refuse an AttnRes config.json whose values `AttnResConfig` refuses, in one line (before any work that
    would otherwise publish or train a checkpoint nobody can load)."""
    from huggingface_hub.errors import StrictDataclassError

    from modeling_attnres import AttnResConfig

    try:
        AttnResConfig.from_dict(config)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as err:
        reason = " ".join(line.strip() for line in str(err).splitlines() if line.strip())
        raise ConversionError(f"{folder / 'config.json'} is not a valid AttnRes config: {reason}") from None


def require_path(value: str | Path, name: str) -> str | Path:
    """`value`, refused when it is an empty (or blank) string: `Path("")` is the current folder, so an unset
    shell variable (`"$OUT"`) would otherwise name it, and `--overwrite` would replace it."""
    if isinstance(value, str) and not value.strip():
        raise UsageError(f"{name} is empty ({value!r}); pass a path (an unset shell variable?)")
    return value


def path_argument(name: str, kind: type = Path):
    """An argparse `type` for a path argument `name`: `kind(value)` (a `Path`, or `str` for a source that may
    also be a Hub repo id or a built-in name), an empty string refused (`require_path`) with argparse's usage
    line and exit status 2."""
    def parse(value: str):
        try:
            value = require_path(value, name)
            return kind(os.path.expanduser(value) if kind is Path else value)    # a quoted '~/out', as the shell
        except UsageError as err:
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"{name} ")) from None
    return parse


def check_destination(dst: Path, src: Path, overwrite: bool, dst_name: str = "DST", src_name: str = "SRC") -> None:
    """Refuse, before any work is done, a DST that would lose data or overlap SRC (named as the command
    line names them)."""
    dst, src = Path(require_path(dst, dst_name)).resolve(), Path(require_path(src, src_name)).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise ConversionError(f"{dst_name} {dst} overlaps {src_name} {src}; choose a separate output folder.")
    here = Path.cwd().resolve()
    if dst == here or dst in here.parents:
        # The output replaces DST whole (a rename), which would pull the folder out from under the shell.
        raise ConversionError(f"{dst_name} {dst} is the current folder{' or above it' if dst != here else ''}; "
                              f"the output replaces {dst_name} whole. Choose a new folder, e.g. {dst / 'model'}.")
    if os.path.ismount(dst):
        raise ConversionError(f"{dst_name} {dst} is a mount point, which cannot be replaced whole (the output is "
                              f"written beside {dst_name} and renamed into place); choose a folder inside it, "
                              f"e.g. {dst / 'model'}.")
    if dst.exists() and not dst.is_dir():
        raise ConversionError(f"{dst_name} {dst} exists and is not a folder; choose a folder path.")
    if next((p for p in dst.parents if p.exists()), dst.parent).is_file():
        raise ConversionError(f"{dst_name} {dst} is inside a file, not a folder; choose a folder path.")
    filled = dst.is_dir() and any(dst.iterdir())
    if filled and not overwrite:
        raise ConversionError(f"{dst_name} {dst} exists and is not empty; pass --overwrite to replace it, "
                              "or choose another folder.")
    if filled and not holds_checkpoint(dst):                                             # --overwrite, not a model
        raise ConversionError(f"{dst_name} {dst} holds files that are not a checkpoint (no config.json beside "
                              f"weights; {listing(sorted(p.name for p in dst.iterdir()), limit=3)}), and --overwrite "
                              "replaces only a checkpoint folder; choose another folder, or empty this one first.")


def holds_checkpoint(folder: Path) -> bool:
    """Whether `folder` holds a checkpoint (a config.json beside safetensors or .bin weights): the only
    non-empty folder `--overwrite` replaces, so that a mistyped DST never takes a folder of other files."""
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    return (folder / "config.json").is_file() and weights


# Why writing an output failed, by errno, with the fix; anything else keeps its own message.
WRITE_FAILURES = {errno.ENOSPC: ("no space is left on its device", "free some space, or choose another location"),
                  errno.EDQUOT: ("the disk quota is exhausted", "free some space, or choose another location"),
                  errno.EROFS: ("its file system is read-only", "choose a writable location"),
                  errno.EACCES: ("permission was denied", "choose a folder you may write to"),
                  errno.EPERM: ("permission was denied", "choose a folder you may write to")}


def writes_to(path: Path, dst: Path) -> bool:
    """Whether `path` (resolved) is where writing `dst` (resolved) goes: `dst` and the folders above it
    (created first), or inside `dst` or one of its stagings (`.NAME.staging-...` beside it)."""
    if path == dst or path in dst.parents:
        return True
    if not path.is_relative_to(dst.parent) or path == dst.parent:
        return False
    top = path.relative_to(dst.parent).parts[0]
    return top == dst.name or top.startswith(f".{dst.name}{STAGING_MARK}")


@contextmanager
def write_failures_named(dst: Path, dst_name: str = "DST") -> Iterator[None]:
    """Turn a failure to write the output (a full disk, a read-only or forbidden folder) into one
    `ConversionError` naming `dst`, the cause and the fix, instead of the path of a staging file or
    safetensors' own wording (which gives the errno only in its text). Only failures at `dst`'s folder
    (where its staging lives) and safetensors' write errors are translated: reading SRC or a cache
    elsewhere fails with its own message."""
    try:
        yield
    except (OSError, SafetensorError) as err:
        if isinstance(err, SafetensorError):
            found = re.search(r"serializ.*os error (\d+)", str(err))
            code = int(found.group(1)) if found else None
        else:
            paths = [Path(name).resolve() for name in (err.filename, err.filename2) if name]
            code = err.errno if any(writes_to(path, dst.resolve()) for path in paths) else None
        if code not in WRITE_FAILURES or isinstance(err, FileExistsError):
            raise
        cause, fix = WRITE_FAILURES[code]
        raise ConversionError(f"Cannot write {dst_name} {dst}: {cause}; {fix}. {dst_name} is as it was.") from err


@contextmanager
def staged_destination(dst: Path, overwrite: bool) -> Iterator[Path]:
    """`publish.staged_folder` for a DST that `check_destination` accepted, write failures named
    (`write_failures_named`). Without `overwrite`, a DST that another writer filled meanwhile is kept, and
    this run's output discarded with an error saying so."""
    try:
        with write_failures_named(dst), staged_folder(dst, overwrite=overwrite) as tmp:
            yield tmp
    except FileExistsError as err:
        if overwrite or err.filename != str(dst.resolve()):
            raise
        raise ConversionError(f"DST {dst} was filled while this run was writing (another run into the same "
                              "folder?); it was kept as it is and this run's output discarded. Pass --overwrite "
                              "to replace it, or choose another folder.") from err


def side_file_roots(src: Path) -> list[Path]:
    """Where a side file of `src` may live once symlinks are resolved: inside `src` itself, and for a
    Hub cache snapshot (`models--ORG--NAME/snapshots/SHA/`) in that repository's own `blobs/`."""
    roots = [src.resolve()]
    if src.parent.name == "snapshots":
        roots.append((src.parent.parent / "blobs").resolve())
    return roots


def side_files(src: Path) -> list[tuple[str, Path]]:
    """`(name, file to copy)` for every side file of `src`: tokenizer files, chat template, generation config and
    the like (every top-level file that is not weights, config, code or the model card). Raises, before
    anything is written when called first, for a broken symlink or one that leads outside the checkpoint.

    A symlink is followed only when it resolves inside the source folder (or, for a Hub cache snapshot, into
    the same repository's blobs); any other symlink is refused, so that nothing outside the checkpoint is
    published (or pushed) by accident."""
    files = []
    roots = side_file_roots(src) if src.is_dir() else []
    for path in sorted(src.iterdir()) if src.is_dir() else []:
        if path.name.startswith(".") or NOT_CARRIED.match(path.name):
            continue
        if path.is_symlink() and not path.exists():       # a Hub cache whose download stopped, say
            raise ConversionError(f"{path} is a broken symlink (to {os.readlink(path)}, which does not exist); "
                                  "download or copy the checkpoint again, or remove the link.")
        if not path.is_file():
            continue
        target = path.resolve()
        if path.is_symlink() and not any(target.is_relative_to(root) for root in roots):
            raise ConversionError(f"{path} is a symlink to {target}, outside the checkpoint folder {src}; "
                                  "side files are copied only from inside it. Replace the link with a copy of "
                                  "the file (or remove it).")
        files.append((path.name, target))
    return files


def copy_side_files(src: Path, dst: Path) -> list[str]:
    """Copy the side files of `src` (`side_files`) into `dst`, by content. Returns the copied names."""
    copied = []
    for name, target in side_files(src):
        shutil.copyfile(target, dst / name)
        copied.append(name)
    return copied
