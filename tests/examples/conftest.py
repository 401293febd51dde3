"""Fixtures for the example scripts' tests: the scripts' folder on sys.path, a tiny corpus, the shipped model."""

import shutil
import sys
from pathlib import Path

import pytest

from attnres.models import shipped_model_path

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
SHIPPED_MODEL = shipped_model_path()
# Small, stable stdlib modules: enough text for a 300-token BPE and a few hundred training windows.
TINY_CORPUS_MODULES = ("abc", "bisect", "colorsys", "copy", "fnmatch", "functools", "glob", "heapq", "keyword",
                       "linecache", "opcode", "operator", "queue", "random", "shlex", "string", "textwrap",
                       "token", "types", "warnings")

if str(EXAMPLES) not in sys.path:
    # The examples are scripts (run as `python examples/train.py`) that import their sibling modules.
    sys.path.insert(0, str(EXAMPLES))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """A folder of ~20 stdlib modules (copied from this interpreter's stdlib, so nothing downloads)."""
    import attnres_data

    root = tmp_path_factory.mktemp("corpus")
    stdlib = attnres_data.stdlib_root()
    for name in TINY_CORPUS_MODULES:
        shutil.copyfile(stdlib / f"{name}.py", root / f"{name}.py")
    return root


@pytest.fixture(scope="session")
def shipped():
    """The committed model and tokenizer, loaded once through the Auto classes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import modeling_attnres  # noqa: F401

    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(SHIPPED_MODEL)
