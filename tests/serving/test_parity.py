"""vLLM and transformers agree on tiny random AttnRes models in float32.

For each architecture variant (block sizes 1, 2, 3 with a partial last block, Full AttnRes, GQA and
MHA, q/k norm, biases, tied embeddings) vLLM's greedy tokens equal transformers' for several prompts
at batch sizes 1, 2 and 5, and its top-5 logprobs match transformers' log-softmax. One variant also
runs with vLLM's torch.compile on. Checkpoint loading (seed-name aliases, missing and unexpected
keys) is checked on a live engine.
"""

import pytest
import torch

pytest.importorskip("vllm")

from tests.serving.engine import free_llm, hf_greedy, load_hf, make_llm  # noqa: E402

STEPS = 10
LOGPROB_ATOL = 2e-4
# Lengths 1..19, token ids past the special tokens; deterministic.
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [torch.randint(8, 104, (n,), generator=_gen).tolist() for n in (1, 4, 7, 12, 19)]
BATCHES = [[0], [1, 3], [0, 1, 2, 3, 4]]

VARIANTS = {
    "block1-gqa-tied": dict(attn_res_block_size=1, num_hidden_layers=3, tie_word_embeddings=True),
    "block2-mha-qknorm": dict(attn_res_block_size=2, num_hidden_layers=4, num_key_value_heads=4, qk_norm=True),
    "block3-partial-bias": dict(attn_res_block_size=3, num_hidden_layers=5, attention_bias=True, mlp_bias=True),
    "full-gqa": dict(attn_res_mode="full", num_hidden_layers=3, num_key_value_heads=1),
}


def run_vllm(llm, prompts: list[list[int]]):
    """Greedy generation with top-5 logprobs; returns `[(tokens, logprobs)]` per prompt."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


def assert_parity(llm, hf_model) -> None:
    """Every prompt at every batch size: identical greedy tokens, top-5 logprobs within tolerance."""
    reference = [hf_greedy(hf_model, p, STEPS) for p in PROMPTS]
    for batch in BATCHES:
        results = run_vllm(llm, [PROMPTS[i] for i in batch])
        for i, (tokens, logprobs) in zip(batch, results):
            ref_tokens, ref_logprobs = reference[i]
            assert tokens == ref_tokens, f"prompt {i} in batch {batch}: vLLM {tokens} != HF {ref_tokens}"
            for step, (top, ref) in enumerate(zip(logprobs, ref_logprobs)):
                assert len(top) >= 5
                got = torch.tensor([lp.logprob for lp in top.values()])
                want = ref[list(top.keys())]
                assert torch.allclose(got, want, atol=LOGPROB_ATOL), (
                    f"prompt {i} step {step} batch {batch}: logprobs {got} != HF {want}")
                fifth = ref.topk(5).values[-1]
                assert (want >= fifth - LOGPROB_ATOL).sum() >= 5, "vLLM's top-5 are not HF's top-5"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_and_logprobs_match_transformers_eager(variant, checkpoints):
    path = checkpoints(variant, seed=len(variant), **VARIANTS[variant])
    llm = make_llm(path, enforce_eager=True)
    try:
        assert_parity(llm, load_hf(path))
    finally:
        free_llm(llm)


def test_greedy_and_logprobs_match_transformers_compiled(checkpoints):
    """vLLM's default compilation (Dynamo + Inductor); the partial-block variant has the most structure."""
    variant = "block3-partial-bias"
    path = checkpoints(variant, seed=len(variant), **VARIANTS[variant])
    llm = make_llm(path, enforce_eager=False)
    try:
        config = llm.llm_engine.vllm_config.compilation_config
        assert config.mode != 0, "compilation is off: this test would not test torch.compile"
        assert_parity(llm, load_hf(path))
    finally:
        free_llm(llm)
