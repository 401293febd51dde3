"""Tiny training runs for the retrofit and training-script tests: arguments, a corpus and a start model."""

import shutil
import sysconfig
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.models import shipped_model_path
from modeling_attnres.configuration_attnres import is_depth_parameter

CORPUS_MODULES = ("abc", "bisect", "colorsys", "copy", "fnmatch", "functools", "glob", "heapq", "keyword",
                  "linecache", "opcode", "operator", "queue", "shlex", "string", "textwrap")
# `attnres-retrofit` options for a run of seconds on the tiny corpus.
RETROFIT_ARGS = ["--pattern", "*.py", "--validation-percent", "20", "--seq-len", "32", "--batch-size", "4",
                 "--lr", "3e-2", "--warmup", "1", "--eval-windows", "8"]
# `examples/train.py` options for a 3-layer model of hidden size 32.
TRAIN_ARGS = ["--validation-percent", "20", "--vocab-size", "300", "--seq-len", "32", "--batch-size", "4",
              "--hidden-size", "32", "--layers", "3", "--heads", "2", "--kv-heads", "2", "--intermediate-size", "64",
              "--warmup", "2", "--lr", "1e-2", "--eval-windows", "8", "--checkpoint-every", "4"]


def write_zeroed(folder: Path) -> Path:
    """The shipped model with uniform depth mixing (zero queries, unit key gains), saved to `folder`."""
    model = AutoModelForCausalLM.from_pretrained(shipped_model_path(), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_depth_parameter(name):
                param.zero_() if "_res_proj." in name else param.fill_(1.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(shipped_model_path()).save_pretrained(folder)
    return folder


def write_corpus(root: Path) -> Path:
    """A folder of small stdlib modules (nothing downloads)."""
    root.mkdir(parents=True, exist_ok=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in CORPUS_MODULES:
        shutil.copyfile(stdlib / f"{name}.py", root / f"{name}.py")
    return root
