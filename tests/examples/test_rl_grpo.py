"""`examples/rl_grpo.py`: a GRPO loop with vLLM as the generator on CPU, run as a user runs it (vLLM's default
engine, in a process of its own, so the weights cross a process boundary). After every weight sync vLLM's
logprobs equal transformers' on the updated policy (float32 noise), while the step moved them by far more:
the generator follows the trainer."""

import json
import os
import sys

import pytest

from attnres.serving.random_model import write_tiny_checkpoint
from tests.examples.conftest import EXAMPLES
from tests.support.processes import run_bounded


@pytest.mark.timeout(300)
def test_the_generator_follows_the_trainer_after_every_step(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model", seed=5, max_position_embeddings=128)   # under its own 256
    done = run_bounded([sys.executable, str(EXAMPLES / "rl_grpo.py"), "--model", str(model), "--steps", "3"],
                       timeout=240, env={k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    # vLLM's whole-checkpoint reload warnings, once per module kept by each one-tensor sync, would bury the results
    assert "Failed to load weights" not in done.stdout + done.stderr, done.stdout[-2000:]
    steps = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [s["step"] for s in steps] == [1, 2, 3], done.stdout
    for s in steps:
        assert s["synced_tensors"] > 50 and s["max_logprob_gap"] < 1e-4, s
        assert s["max_logprob_moved"] > 100 * max(s["max_logprob_gap"], 1e-6), s      # the sync carried real changes
