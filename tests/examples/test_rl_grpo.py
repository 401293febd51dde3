"""`examples/rl_grpo.py`: a GRPO loop with vLLM as the generator on CPU, run as a user runs it (vLLM's default
engine, in a process of its own, so the weights cross a process boundary). After every weight sync vLLM's
logprobs equal transformers' on the updated policy (float32 noise), while the step moved them by far more:
the generator follows the trainer."""

import json
import math
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


def test_the_grpo_loss_is_zero_on_policy_and_clips_a_large_ratio():
    """On fresh samples the ratio is 1 and the group-normalised advantages sum to 0, so the loss is 0
    (docs/training.md); a ratio beyond 1 + clip counts as 1 + clip where the advantage is positive."""
    from types import SimpleNamespace

    import rl_grpo
    import torch

    from modeling_attnres import AttnResForCausalLM
    from tests.support.models import tiny_config

    torch.manual_seed(0)
    policy = AttnResForCausalLM(tiny_config()).eval()
    prompt, groups = [10, 11, 12], [[2, 4, 6, 8], [1, 3, 5, 7], [2, 3, 4, 5], [2, 4, 6, 7]]
    rewards = torch.tensor([rl_grpo.reward(tokens) for tokens in groups])
    assert rewards.tolist() == [1.0, 0.0, 0.5, 0.75]

    def completions(shift):
        with torch.no_grad():
            old = [rl_grpo.token_logprobs(policy, prompt, tokens) - shift for tokens in groups]
        return [SimpleNamespace(token_ids=tokens, logprobs=[{t: SimpleNamespace(logprob=float(v))}
                                                            for t, v in zip(tokens, lp)])
                for tokens, lp in zip(groups, old)]
    with torch.no_grad():
        assert rl_grpo.grpo_loss(policy, prompt, completions(0.0), 0.2).item() == pytest.approx(0.0, abs=1e-5)
        clipped = rl_grpo.grpo_loss(policy, prompt, completions(1.0), 0.2).item()
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    expected = -sum(1.2 * a if a > 0 else math.e * a for a in advantages.tolist()) / len(groups)
    assert clipped == pytest.approx(expected, rel=1e-4)
