"""transformers as the reference every vLLM test compares with: greedy continuations by full forward
passes (no cache, no EOS handling, like vLLM's `ignore_eos`) and teacher-forced log-softmax."""

from pathlib import Path

import torch


def load_hf(path: Path, model_class=None, **kwargs):
    """The transformers model of a checkpoint, float32, eval mode (`AttnResForCausalLM` by default);
    `kwargs` go to `from_pretrained`."""
    if model_class is None:
        from modeling_attnres import AttnResForCausalLM as model_class

    return model_class.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full forward passes; the tokens and the log-softmax `[vocab]` at each."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(steps):
            lp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            logprobs.append(lp)
            ids.append(int(lp.argmax()))
    return ids[len(prompt):], logprobs


def teacher_forced(model, prompt: list[int], tokens: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The log-softmax `[len(tokens), vocab]` at each of `tokens` after `prompt`, by one forward pass in
    `dtype` (float64: the exact reference; the model is returned to float32). Greedy decoding reproduces
    `tokens` exactly when every row's argmax is the next token."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model.to(dtype)(ids).logits[0, len(prompt) - 1: len(prompt) - 1 + len(tokens)]
    model.float()
    return logits.to(dtype).log_softmax(-1)
