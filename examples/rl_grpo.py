"""GRPO with vLLM as the generator, on a CPU: the loop an RL trainer runs, weights synced every step.

    .venv/bin/python examples/rl_grpo.py --model CHECKPOINT --steps 3

Each step: vLLM samples a group of completions per prompt (with their logprobs, the behaviour policy),
a reward scores them, transformers computes the clipped GRPO loss with group-normalised advantages and
takes an optimizer step, and the updated parameters go into the running engine one tensor per call
(`attnres.serving.weights.update_weights`, vLLM's in-place reload, checked). After every sync the
script scores one completion with both models and prints the largest difference of their per-token
logprobs (the generator follows the trainer exactly when it is float32 noise), next to how far the
step moved those logprobs.

TRL's own vLLM integration (`GRPOTrainer(use_vllm=True)`) does not run on vLLM's CPU build, for any
model: in colocate mode its weight sync calls the model's `load_weights` directly, which the CPU
backend's repacked linear layers refuse, and its server mode needs CUDA for NCCL (docs/training.md).
This script does the same step with the primitives that work there.

The toy reward prefers completions that use even token ids, so the loop has something to learn.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="an AttnRes checkpoint folder")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--group", type=int, default=4, help="completions per prompt (the GRPO group)")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def reward(tokens: list[int]) -> float:
    """The toy reward: the share of even token ids."""
    return sum(t % 2 == 0 for t in tokens) / max(1, len(tokens))


def token_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The model's log-probability of each completion token after `prompt` (one forward pass)."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def grpo_loss(policy, prompt: list[int], completions: list, clip: float) -> torch.Tensor:
    """Clipped GRPO loss of one group: advantages normalised within the group, ratios to vLLM's logprobs."""
    rewards = torch.tensor([reward(list(c.token_ids)) for c in completions])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
    loss = torch.zeros(())
    for completion, advantage in zip(completions, advantages):
        tokens = list(completion.token_ids)
        old = torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, tokens)])
        ratio = torch.exp(token_logprobs(policy, prompt, tokens) - old)
        loss = loss - torch.min(ratio * advantage, ratio.clamp(1 - clip, 1 + clip) * advantage).mean()
    return loss / len(completions)


def sync(llm, policy) -> int:
    """Push every trainable parameter into the engine, one tensor per call, as TRL does; returns the count."""
    from attnres.serving.weights import update_weights

    tied = policy.config.tie_word_embeddings
    named = [(n, p.detach()) for n, p in policy.named_parameters() if p.requires_grad and not (tied and
                                                                                               n == "lm_head.weight")]
    for name, tensor in named:
        update_weights(llm, [(name, tensor)])
    return len(named)


def follow_gap(llm, policy, prompt: list[int], completion: list[int]) -> float:
    """The largest |vLLM - transformers| per-token logprob of `completion` after `prompt`."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    ids = prompt + completion
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    served = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(len(prompt), len(ids))])
    with torch.no_grad():
        return float((served - token_logprobs(policy, prompt, completion)).abs().max())


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import modeling_attnres  # noqa: F401  (registers the architecture with the Auto classes)
    from attnres.serving.weights import WORKER_EXTENSION

    torch.manual_seed(args.seed)
    policy = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    llm = LLM(model=str(args.model), dtype="float32", enforce_eager=True, kv_cache_memory_bytes=64 << 20,
              max_model_len=min(256, policy.config.max_position_embeddings), seed=args.seed,
              worker_extension_cls=WORKER_EXTENSION)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    prompts = [[10, 11, 12], [40, 41, 42, 43]]
    params = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.max_tokens, logprobs=0,
                            ignore_eos=True, seed=args.seed)
    for step in range(args.steps):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        loss = sum(grpo_loss(policy, p, out.outputs, args.clip) for p, out in zip(prompts, outs)) / len(prompts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        synced = sync(llm, policy)
        mean_reward = sum(reward(list(c.token_ids)) for out in outs for c in out.outputs) / (len(prompts) * args.group)
        first = outs[0].outputs[0]
        gap = follow_gap(llm, policy, prompts[0], list(first.token_ids))
        with torch.no_grad():                       # how far this step moved the policy on that completion
            before = torch.tensor([s[t].logprob for s, t in zip(first.logprobs, first.token_ids)])
            moved = float((token_logprobs(policy, prompts[0], list(first.token_ids)) - before).abs().max())
        print(json.dumps({"step": step + 1, "loss": round(loss.item(), 6), "reward": round(mean_reward, 4),
                          "synced_tensors": synced, "max_logprob_gap": gap, "max_logprob_moved": moved}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
