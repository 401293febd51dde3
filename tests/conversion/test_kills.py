"""SIGKILL at seeded moments: `attnres-convert`, `attnres-quantize` and `attnres-retrofit` leave their
destination as it was or complete and new, and the next run succeeds with nothing left beside it
(`tests.support.kills`; the default model's build: tests/serving/test_default_model.py)."""

import random
import shutil
import sys
from pathlib import Path

import pytest

from attnres.conversion import retrofit
from tests.conversion.builders import save_source, source_model
from tests.support.kills import check_kills
from tests.support.models import tiny_model
from tests.support.training import RETROFIT_ARGS, write_corpus, write_zeroed

SEED = 20261204


def command(module: str, *args) -> list[str]:
    return [sys.executable, "-m", module, *map(str, args)]


def restorer(dst: Path, old: Path):
    """`restore()`: put the old folder back at `dst`."""
    def restore() -> None:
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(old, dst)
    return restore


@pytest.mark.timeout(600)
def test_a_killed_conversion_leaves_the_old_folder_or_the_new_one(tmp_path):
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src", tokenizer=True)
    old = tmp_path / "old"
    tiny_model(seed=6).save_pretrained(old)          # an earlier model at the destination (saved here: no process)
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    seen = check_kills(command("attnres.conversion.cli", src, dst, "--block-size", "2", "--overwrite"), dst,
                       restorer(dst, old), random.Random(SEED))
    print("conversion killed at", seen)


@pytest.mark.timeout(600)
def test_a_killed_quantization_leaves_the_old_folder_or_the_new_one(tmp_path):
    tiny_model(seed=3).save_pretrained(tmp_path / "src")
    tiny_model(seed=4).save_pretrained(tmp_path / "old")
    dst = tmp_path / "out" / "dst"
    dst.parent.mkdir()
    seen = check_kills(command("attnres.conversion.quantize", tmp_path / "src", dst, "--overwrite"), dst,
                       restorer(dst, tmp_path / "old"), random.Random(SEED + 1))
    print("quantization killed at", seen)


@pytest.mark.timeout(900)
def test_a_killed_retrofit_leaves_the_old_folder_or_the_new_one_and_resumes(tmp_path):
    zeroed, corpus = write_zeroed(tmp_path / "zeroed"), write_corpus(tmp_path / "corpus")
    tiny_model(seed=5).save_pretrained(tmp_path / "old")
    work, dst = tmp_path / "work", tmp_path / "out" / "dst"
    dst.parent.mkdir()
    restore_folder = restorer(dst, tmp_path / "old")

    def restore() -> None:                                                   # a fresh start each time
        restore_folder()
        shutil.rmtree(work, ignore_errors=True)

    def resume_if_possible() -> list[str]:
        try:
            retrofit.last_checkpoint(work, log=lambda _: None)
        except retrofit.RetrofitError:
            return []
        return ["--resume"]

    run = command("attnres.conversion.retrofit", zeroed, corpus, *RETROFIT_ARGS, "--steps", "8", "--save-every", "2",
                  "--work-dir", work, "--out", dst, "--overwrite")
    seen = check_kills(run, dst, restore, random.Random(SEED + 2), before_rerun=resume_if_possible)
    print("retrofit killed at", seen)
