"""The rule by which vLLM output equals transformers' in float32, shared by every parity test.

Greedy tokens must be identical. Each returned logprob must match the float64 reference within a
base tolerance plus twice the float32 error of transformers itself on the same prompts (measured
against float64): two float32 implementations of a random model with peaked logits can each be off
by that much, whatever their order of operations, while a real defect is orders of magnitude larger.
"""

from typing import NamedTuple

import torch

from tests.support.reference import hf_greedy, teacher_forced

LOGPROB_ATOL = 2e-4
# Lengths 1..19, token ids past the built-in tokenizer's special tokens; deterministic.
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(8, 104, (n,), generator=_gen).tolist() for n in (1, 4, 7, 12, 19)]


class Reference(NamedTuple):
    """transformers on one prompt: greedy tokens, float64 log-softmax rows, its own float32 error."""

    tokens: list[int]
    exact: torch.Tensor
    fp32_error: float


def reference(model, prompts: list[list[int]], steps: int) -> list[Reference]:
    """The reference of every prompt (greedy by full float32 passes, then one float64 pass)."""
    out = []
    for prompt in prompts:
        tokens, fp32 = hf_greedy(model, prompt, steps)
        exact = teacher_forced(model, prompt, tokens, torch.float64)
        out.append(Reference(tokens, exact, max(float((a.double() - b).abs().max()) for a, b in zip(fp32, exact))))
    return out


def assert_matches(name: str, got: list[tuple[list[int], list[dict]]], refs: list[Reference],
                   base_atol: float = LOGPROB_ATOL, top: int = 5) -> None:
    """`got` (from `engines.generate(..., logprobs=top)`, keys as ints or strings) equals `refs`: the
    same greedy tokens, every logprob within tolerance, and the returned top ones the reference's top."""
    assert len(got) == len(refs), f"{name}: {len(got)} outputs for {len(refs)} prompts"
    atol = base_atol + 2 * max(r.fp32_error for r in refs)
    for i, ((tokens, steps), ref) in enumerate(zip(got, refs)):
        assert tokens == ref.tokens, f"{name}, prompt {i}: vLLM {tokens} != transformers {ref.tokens}"
        for step, (logprobs, want) in enumerate(zip(steps, ref.exact)):
            assert len(logprobs) >= top, f"{name}, prompt {i} step {step}: {len(logprobs)} logprobs"
            ids = [int(t) for t in logprobs]
            gotten, wanted = torch.tensor(list(logprobs.values()), dtype=torch.float64), want[ids]
            assert torch.allclose(gotten, wanted, atol=atol), (
                f"{name}, prompt {i} step {step}: logprobs {gotten} != transformers float64 {wanted} (atol {atol:.1e})")
            assert (wanted >= want.topk(top).values[-1] - atol).sum() >= top, f"{name}: vLLM's top-{top} are not HF's"
