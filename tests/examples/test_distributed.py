"""Training that outgrows one process: `examples/train.py` (DDP and FSDP) and `attnres-retrofit` (DDP)
under `accelerate launch` with 2 CPU processes (gloo) follow the one-process loss curve at the same
global batch, and their checkpoints reload (under another process count)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import train
from safetensors.torch import load_file

from attnres.serving.launcher import free_port
from tests.support.processes import run_bounded
from tests.support.training import RETROFIT_ARGS, TRAIN_ARGS, write_corpus, write_zeroed

ACCELERATE = Path(sys.executable).parent / "accelerate"
STEPS = ["--steps", "6", "--checkpoint-every", "3"]


def launch(args: list[str], log: Path, timeout: int = 150) -> None:
    """`accelerate launch` with 2 processes (torchrun; gloo on CPUs), bounded in time, no worker left."""
    cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_ip", "127.0.0.1",
           "--main_process_port", str(free_port()), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = run_bounded(cmd, timeout=timeout, env=env)
    log.write_text(done.stdout + done.stderr)
    assert done.returncode == 0, f"accelerate launch exited {done.returncode} (None: timed out after {timeout} s); " \
        f"log:\n{log.read_text()[-3000:]}"


def train_args(corpus, work, *extra) -> list[str]:
    return ["--corpus-root", str(corpus), "--work-dir", str(work), *TRAIN_ARGS, *STEPS, *extra]


def run_in_process(corpus, work, *extra) -> dict:
    args = train.parse_args(train_args(corpus, work, *extra))
    train.check_args(args)
    return train.train(args)


def checkpoint(work: Path) -> dict:
    return torch.load(work / "checkpoint.pt", weights_only=True)


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def single(tiny_corpus, tmp_path_factory) -> tuple[Path, dict]:
    """The one-process reference run (6 steps, global batch 4) and its metrics."""
    work = tmp_path_factory.mktemp("single")
    return work, run_in_process(tiny_corpus, work)


@pytest.mark.timeout(300)
def test_train_ddp_matches_one_process_and_its_checkpoint_resumes_in_one(single, tiny_corpus, tmp_path):
    work, reference = single
    launch([str(train.__file__), *train_args(tiny_corpus, tmp_path, "--stop-after", "3")], tmp_path / "ddp.log")
    ddp = checkpoint(tmp_path)
    assert ddp["step"] == 3
    torch.testing.assert_close(ddp["history"], reference["history"][:3], rtol=1e-5, atol=1e-6)
    resumed = run_in_process(tiny_corpus, tmp_path)            # one process continues the 2-process checkpoint
    torch.testing.assert_close(resumed["history"], reference["history"], rtol=1e-4, atol=1e-5)
    assert_same_weights(checkpoint(tmp_path)["model"], checkpoint(work)["model"])


@pytest.mark.timeout(300)
def test_train_fsdp_resumes_a_one_process_checkpoint_and_matches(single, tiny_corpus, tmp_path):
    work, reference = single
    run_in_process(tiny_corpus, tmp_path, "--stop-after", "3")
    launch([str(train.__file__), *train_args(tiny_corpus, tmp_path, "--fsdp")], tmp_path / "fsdp.log")
    fsdp = checkpoint(tmp_path)                                  # written unsharded by the first process
    assert fsdp["step"] == 6
    assert "returned a view tensor" not in (tmp_path / "fsdp.log").read_text()    # the bank's, filtered
    torch.testing.assert_close(fsdp["history"], reference["history"], rtol=1e-4, atol=1e-5)
    assert_same_weights(fsdp["model"], checkpoint(work)["model"])


@pytest.mark.timeout(300)
def test_retrofit_ddp_matches_one_process(tmp_path):
    from attnres.conversion import retrofit

    zeroed, corpus = write_zeroed(tmp_path / "zeroed"), write_corpus(tmp_path / "corpus")
    common = [str(zeroed), str(corpus), *RETROFIT_ARGS, "--steps", "4"]
    one = retrofit.retrofit(retrofit.parse_args([*common, "--work-dir", str(tmp_path / "w1"),
                                                 "--out", str(tmp_path / "one")]))
    launch(["-m", "attnres.conversion.retrofit", *common, "--work-dir", str(tmp_path / "w2"),
            "--out", str(tmp_path / "two")], tmp_path / "retrofit.log")
    two = json.loads((tmp_path / "two" / "retrofit.json").read_text())
    assert "find_unused_parameters=True was specified" not in (tmp_path / "retrofit.log").read_text()
    assert two["processes"] == 2 and one["processes"] == 1
    torch.testing.assert_close(two["history"], one["history"], rtol=0, atol=2e-4)    # the Trainer logs 4 decimals
    assert_same_weights(load_file(tmp_path / "one" / "model.safetensors"),
                        load_file(tmp_path / "two" / "model.safetensors"))
