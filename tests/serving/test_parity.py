"""vLLM and transformers agree on tiny random AttnRes models in float32.

For each architecture variant (block sizes 1, 2, 3 with a partial last block, Full AttnRes, GQA and
MHA, q/k norm, biases, tied embeddings, mixtures of experts with and without a shared expert) vLLM's
greedy tokens equal transformers' for several prompts
at batch sizes 1, 2 and 5, and its top-5 logprobs match transformers' log-softmax. One variant also
runs with vLLM's torch.compile on. Checkpoint loading (seed-name aliases, missing and unexpected
keys) is checked on a live engine.
"""

import pytest
import torch

from tests.support.engines import EnginePool, free_llm, generate, make_llm
from tests.support.parity import PROMPTS, assert_matches, reference
from tests.support.reference import load_hf

STEPS = 10
BATCHES = [[0], [1, 3], [0, 1, 2, 3, 4]]

VARIANTS = {
    "block1-gqa-tied": dict(attn_res_block_size=1, num_hidden_layers=3, tie_word_embeddings=True),
    "block2-mha-qknorm": dict(attn_res_block_size=2, num_hidden_layers=4, num_key_value_heads=4, qk_norm=True),
    "block3-partial-bias": dict(attn_res_block_size=3, num_hidden_layers=5, attention_bias=True, mlp_bias=True),
    "full-gqa": dict(attn_res_mode="full", num_hidden_layers=3, num_key_value_heads=1),
    # Mixtures of experts (vLLM's FusedMoE): Qwen3-MoE-style with a dense layer, Qwen2-MoE's shared expert.
    "moe": dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                mlp_only_layers=[1]),
    "moe-shared": dict(num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False),
}


def assert_parity(llm, hf_model) -> None:
    """Every prompt at every batch size: identical greedy tokens, top-5 logprobs within the parity rule."""
    refs = reference(hf_model, PROMPTS, STEPS)
    for batch in BATCHES:
        got = generate(llm, [PROMPTS[i] for i in batch], STEPS, logprobs=5)
        assert_matches(f"batch {batch}", got, [refs[i] for i in batch])


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    """`checkpoint(variant)`: the variant's tiny random checkpoint."""
    return lambda variant: checkpoints(variant, seed=len(variant), **VARIANTS[variant])


@pytest.fixture(scope="module")
def engines():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def engine(engines, checkpoint):
    """`engine(variant, eager=True)`: the pool's live engine for that variant."""
    return lambda variant, eager=True: engines.get((variant, eager),
                                                   lambda: make_llm(checkpoint(variant), enforce_eager=eager))


# Block size 2 (MHA, q/k norm) is served from a checkpoint with the seed names, in
# `test_seed_names_load_as_aliases`: one engine start fewer.
EAGER_VARIANTS = [v for v in VARIANTS if v != "block2-mha-qknorm"]


@pytest.mark.parametrize("variant", EAGER_VARIANTS)
def test_greedy_and_logprobs_match_transformers_eager(variant, engine, checkpoint):
    assert_parity(engine(variant), load_hf(checkpoint(variant)))


def test_greedy_and_logprobs_match_transformers_compiled(engine, checkpoint):
    """vLLM's default compilation (Dynamo + Inductor); the partial-block variant has the most structure."""
    llm = engine("block3-partial-bias", eager=False)
    assert llm.llm_engine.vllm_config.compilation_config.mode != 0, "compilation is off: nothing tested"
    assert_parity(llm, load_hf(checkpoint("block3-partial-bias")))


def edited_copy(src, dst, edit):
    """Copy a checkpoint directory, rewriting its weights with `edit(dict) -> dict`."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    return dst


def test_seed_names_load_as_aliases(engines, checkpoint, tmp_path):
    """A checkpoint that names the attention site `attn_res_proj` / `attn_res_norm` (the seed
    pseudo-code's names) serves exactly like the original (this is also the block-size-2 parity test)."""
    variant = "block2-mha-qknorm"
    original = checkpoint(variant)
    renamed = edited_copy(original, tmp_path / "seed-names",
                          lambda w: {k.replace(".self_attention_res_", ".attn_res_"): v for k, v in w.items()})
    engines.close()
    llm = make_llm(renamed, enforce_eager=True)
    try:
        assert_parity(llm, load_hf(original))
    finally:
        free_llm(llm)


# checkpoint variant -> keys deleted, keys added: what a failed start must name. vLLM's own check passes the first
# two: a fused q/k/v counts as loaded once any shard arrived, and FusedMoE's experts are one parameter.
# The MoE case first: a failed dense start leaves vLLM's distributed state without the expert-parallel group.
BROKEN = {
    "one-expert-missing": ("moe", ["model.layers.2.mlp.experts.1.down_proj.weight"], []),
    # An expert past `num_experts` (a checkpoint with more experts than its config says) is not one of the model's.
    # (An added key is a 3-vector, or `(key, shape)`: this one has an expert's shape, so only its index is wrong.)
    "expert-past-num-experts": ("moe", [], [("model.layers.2.mlp.experts.4.down_proj.weight", (64, 32))]),
    "missing-and-unexpected": ("full-gqa", ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"],
                               ["model.layers.0.surprise.weight"]),
    "one-shard-missing": ("full-gqa", ["model.layers.1.self_attn.k_proj.weight"], []),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_load_weights_lists_missing_and_unexpected_keys(engines, checkpoint, tmp_path, case):
    """Runs last in this module: a failed engine start may leave in-process state behind."""
    variant, deleted, added = BROKEN[case]
    added = dict(key if isinstance(key, tuple) else (key, (3,)) for key in added)

    def broken(weights):
        weights = dict(weights)
        for key in deleted:
            del weights[key]
        weights.update({key: torch.zeros(shape) for key, shape in added.items()})
        return weights

    path = edited_copy(checkpoint(variant), tmp_path / "broken", broken)
    engines.close()
    with pytest.raises(ValueError, match="does not match AttnResForCausalLM") as info:
        free_llm(make_llm(path, enforce_eager=True))
    message = str(info.value)
    assert f"Missing keys ({len(deleted)})" in message and f"Unexpected keys ({len(added)})" in message, message[-3000:]
    for key in [*deleted, *added]:
        assert key in message


# Refused by the model's constructor, before vLLM allocates anything: vLLM alone would start the first and die on
# its first request, and index past the embedding on the second's last tokens.
REFUSED = {
    "head-size": (dict(head_dim=16), r"head_dim 16 \(hidden_size 64, num_attention_heads 4\) has no kernel in "
                                     r"vLLM's CPU attention"),
    "tokenizer-larger-than-vocab": (dict(vocab_size=100), r"has 104 tokens but the model's vocab_size is 100"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_engine_start_refuses_what_it_cannot_serve(engines, checkpoints, case):
    overrides, message = REFUSED[case]
    path = checkpoints(f"refused-{case}", seed=5, **overrides)
    engines.close()
    with pytest.raises(ValueError, match=message):
        free_llm(make_llm(path, enforce_eager=True))
