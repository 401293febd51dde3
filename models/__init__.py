"""The model files this package ships (installed as `attnres.models`, package data of the wheel).

- `attnres-tiny/`: a small Block AttnRes model trained on CPython's standard library
  (`examples/train.py`), the server's offline fallback and the demos' model (`shipped_model_path()`).
- `smollm2-135m-attnres-depth.safetensors`: depth-attention parameters retrofitted on the converted
  SmolLM2-135M-Instruct, applied on top of its conversion for `builtin:smollm2-135m-attnres-retrofit`
  (`depth_parameters_path()`).

Every run-time file is found through `importlib.resources`, never through the checkout's layout, so an
installed wheel and an editable checkout behave alike. A missing file is an error that says so; no
caller silently builds something else instead.
"""

from importlib.resources import files
from pathlib import Path

SHIPPED_MODEL_NAME = "attnres-tiny"
DEPTH_PARAMETERS_NAME = "smollm2-135m-attnres-depth.safetensors"
# The files `shipped_model_path()` checks: what loading and serving the model reads.
SHIPPED_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                       "generation_config.json")


class MissingShippedFile(FileNotFoundError):
    """A file this package should ship is absent from the install (a broken or partial install)."""


def resource_path(name: str) -> Path:
    """The installed path of a shipped file or folder (it may not exist; see `require`)."""
    return Path(str(files(__name__) / name))


def require(path: Path) -> Path:
    """`path`, or `MissingShippedFile` naming it and the fix."""
    if not path.exists():
        raise MissingShippedFile(f"the attnres package ships {path.name}, but it is missing from this install "
                                 f"({path}); reinstall the package (pip install --force-reinstall attnres)")
    return path


def shipped_model_path() -> Path:
    """The folder of the shipped `attnres-tiny` model (checked to hold every file it loads from)."""
    folder = resource_path(SHIPPED_MODEL_NAME)
    for name in SHIPPED_MODEL_FILES:
        require(folder / name)
    return folder


def depth_parameters_path() -> Path:
    """The retrofitted depth parameters of the default model (an `attnres-retrofit --export-depth` file)."""
    return require(resource_path(DEPTH_PARAMETERS_NAME))


__all__ = ["DEPTH_PARAMETERS_NAME", "SHIPPED_MODEL_NAME", "MissingShippedFile", "depth_parameters_path",
           "resource_path", "shipped_model_path"]
