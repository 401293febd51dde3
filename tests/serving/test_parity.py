"""vLLM and transformers agree on tiny random AttnRes models in float32.

For each architecture variant (block sizes 1, 2, 3 with a partial last block, Full AttnRes, GQA and
MHA, q/k norm, biases, tied embeddings) vLLM's greedy tokens equal transformers' for several prompts
at batch sizes 1, 2 and 5, and its top-5 logprobs match transformers' log-softmax. One variant also
runs with vLLM's torch.compile on. Checkpoint loading (seed-name aliases, missing and unexpected
keys) is checked on a live engine.
"""

import pytest
import torch

from tests.serving.engine import free_llm, hf_greedy, load_hf, make_llm

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


def reference_logprobs(hf_model, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Log-softmax at each step of `tokens` after `prompt`, by one float64 forward pass."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model.double()(ids).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    hf_model.float()
    return list(logits.log_softmax(-1))


def assert_parity(llm, hf_model, base_atol: float = LOGPROB_ATOL) -> None:
    """Every prompt at every batch size: identical greedy tokens, top-5 logprobs within tolerance.

    Logprobs are compared with the float64 reference. The tolerance is LOGPROB_ATOL plus twice
    the float32 error of transformers itself on that model (measured here against float64): two
    float32 implementations of a random model with peaked logits can each be off by that much,
    whatever their order of operations, while a real defect is orders of magnitude larger."""
    reference = [hf_greedy(hf_model, p, STEPS) for p in PROMPTS]
    exact = [reference_logprobs(hf_model, p, ref[0]) for p, ref in zip(PROMPTS, reference)]
    fp32_error = max(float((a.double() - b).abs().max()) for (_, lps), ex in zip(reference, exact)
                     for a, b in zip(lps, ex))
    atol = base_atol + 2 * fp32_error
    for batch in BATCHES:
        results = run_vllm(llm, [PROMPTS[i] for i in batch])
        for i, (tokens, logprobs) in zip(batch, results):
            ref_tokens, _ = reference[i]
            assert tokens == ref_tokens, f"prompt {i} in batch {batch}: vLLM {tokens} != HF {ref_tokens}"
            for step, (top, ref) in enumerate(zip(logprobs, exact[i])):
                assert len(top) >= 5
                got = torch.tensor([lp.logprob for lp in top.values()], dtype=torch.float64)
                want = ref[list(top.keys())]
                assert torch.allclose(got, want, atol=atol), (
                    f"prompt {i} step {step} batch {batch}: logprobs {got} != HF float64 {want} (atol {atol:.1e})")
                fifth = ref.topk(5).values[-1]
                assert (want >= fifth - atol).sum() >= 5, "vLLM's top-5 are not HF's top-5"


class Engines:
    """One live in-process engine at a time, reused by consecutive tests of the same variant."""

    def __init__(self, checkpoints):
        self.checkpoints, self.key, self.llm = checkpoints, None, None

    def get(self, variant: str, eager: bool = True):
        if self.key != (variant, eager):
            self.close()
            path = self.path(variant)
            self.llm, self.key = make_llm(path, enforce_eager=eager), (variant, eager)
        return self.llm

    def path(self, variant: str):
        return self.checkpoints(variant, seed=len(variant), **VARIANTS[variant])

    def close(self) -> None:
        if self.llm is not None:
            free_llm(self.llm)
            self.llm, self.key = None, None


@pytest.fixture(scope="module")
def engines(checkpoints):
    pool = Engines(checkpoints)
    yield pool
    pool.close()


# Block size 2 (MHA, q/k norm) is served from a checkpoint with the seed names, in
# `test_seed_names_load_as_aliases`: one engine start fewer.
EAGER_VARIANTS = [v for v in VARIANTS if v != "block2-mha-qknorm"]


@pytest.mark.parametrize("variant", EAGER_VARIANTS)
def test_greedy_and_logprobs_match_transformers_eager(variant, engines):
    assert_parity(engines.get(variant), load_hf(engines.path(variant)))


def test_greedy_and_logprobs_match_transformers_compiled(engines):
    """vLLM's default compilation (Dynamo + Inductor); the partial-block variant has the most structure."""
    llm = engines.get("block3-partial-bias", eager=False)
    assert llm.llm_engine.vllm_config.compilation_config.mode != 0, "compilation is off: nothing tested"
    assert_parity(llm, load_hf(engines.path("block3-partial-bias")))


def edited_copy(src, dst, edit):
    """Copy a checkpoint directory, rewriting its weights with `edit(dict) -> dict`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def test_seed_names_load_as_aliases(engines, tmp_path):
    """A checkpoint that names the attention site `attn_res_proj` / `attn_res_norm` (the seed
    pseudo-code's names) serves exactly like the original (this is also the block-size-2 parity test)."""
    variant = "block2-mha-qknorm"
    original = engines.path(variant)
    renamed = edited_copy(original, tmp_path / "seed-names",
                          lambda w: {k.replace(".self_attention_res_", ".attn_res_"): v for k, v in w.items()})
    engines.close()
    llm = make_llm(renamed, enforce_eager=True)
    try:
        assert_parity(llm, load_hf(original))
    finally:
        free_llm(llm)


def test_load_weights_lists_missing_and_unexpected_keys(engines, tmp_path):
    """Runs last in this module: a failed engine start may leave in-process state behind."""
    def broken(weights):
        weights = dict(weights)
        del weights["model.layers.1.self_attn.k_proj.weight"], weights["model.norm.weight"]
        weights["model.layers.0.surprise.weight"] = torch.zeros(3)
        return weights

    path = edited_copy(engines.path("full-gqa"), tmp_path / "broken", broken)
    engines.close()
    with pytest.raises(ValueError, match="does not match AttnResForCausalLM") as info:
        free_llm(make_llm(path, enforce_eager=True))
    message = str(info.value)
    assert "Missing keys (2)" in message and "Unexpected keys (1)" in message, message[-3000:]
    for key in ("model.layers.1.self_attn.k_proj.weight", "model.norm.weight", "model.layers.0.surprise.weight"):
        assert key in message
