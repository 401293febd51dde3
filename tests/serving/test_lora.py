"""A PEFT LoRA adapter of an AttnRes model, served by vLLM, equals its merged checkpoint served without LoRA.

The adapter targets q/k/v/o/gate/up/down of a tiny random model, with random non-zero B matrices so
that it changes the greedy tokens. References: transformers with the adapter (PEFT) and the
`merge_and_unload` checkpoint served by a plain engine; the same adapter also goes through a real
`attnres-serve --enable-lora --lora-modules` server. An adapter that targets a pseudo-query
(`*_res_proj`, a `Linear(d, 1)` that vLLM holds as a plain parameter) is refused by name.
"""

import json
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from attnres.serving.launcher import ServerProcess
from tests.support.engines import chosen_logprobs, free_llm, make_llm
from tests.support.engines import generate as generate_tokens
from tests.support.reference import hf_greedy, load_hf

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK = 8
STEPS = 8
_gen = torch.Generator().manual_seed(77)
PROMPTS = [torch.randint(8, 104, (n,), generator=_gen).tolist() for n in (2, 5, 11, 16)]
# float32: `W x + s B (A x)` against `(W + s B A) x` differ by rounding only.
LOGPROB_ATOL = 1e-3


def peft_model(base, target_modules: list[str], seed: int):
    """transformers' model of `base` wrapped in a PEFT LoRA with random non-zero B (a stand-in for training)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=target_modules, lora_dropout=0.0)
    model = get_peft_model(load_hf(base), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.05 * torch.randn(param.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="module")
def lora(checkpoints, tmp_path_factory):
    """`(base, adapter, merged)` folders and the adapter's transformers greedy tokens per prompt."""
    from transformers import AutoTokenizer

    base = checkpoints("lora-base", seed=5)
    root = tmp_path_factory.mktemp("lora")
    model = peft_model(base, TARGETS, seed=0)
    model.save_pretrained(root / "adapter")
    expected = [hf_greedy(model, p, STEPS)[0] for p in PROMPTS]
    model.merge_and_unload().save_pretrained(root / "merged")
    AutoTokenizer.from_pretrained(base).save_pretrained(root / "merged")
    return base, root / "adapter", root / "merged", expected


def generate(llm, lora_request=None) -> list[tuple[list[int], list[float]]]:
    """Greedy tokens and each chosen token's logprob, per prompt."""
    return [(tokens, chosen_logprobs(tokens, steps))
            for tokens, steps in generate_tokens(llm, PROMPTS, STEPS, logprobs=1, lora_request=lora_request)]


@pytest.fixture(scope="module")
def merged_results(lora):
    """The merged checkpoint served without LoRA (engine freed before the LoRA engine starts)."""
    llm = make_llm(lora[2], enforce_eager=True)
    try:
        return generate(llm)
    finally:
        free_llm(llm)


def test_adapter_equals_merged_checkpoint(lora, merged_results, tmp_path):
    from vllm.lora.request import LoRARequest

    base, adapter, _, expected = lora
    # An adapter that also carries LoRA weights for a pseudo-query (PEFT itself refuses to make one: it is
    # no Linear), as a hand-edited or foreign adapter would: vLLM judges an adapter by its tensors.
    bad = tmp_path / "targets-pseudo-query"
    shutil.copytree(adapter, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    config["target_modules"] = sorted({*config["target_modules"], "mlp_res_proj"})
    (bad / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(bad / "adapter_model.safetensors")
    hidden = tensors["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"].shape[1]
    prefix = "base_model.model.model.layers.0.mlp_res_proj"
    tensors |= {f"{prefix}.lora_A.weight": torch.ones(RANK, hidden), f"{prefix}.lora_B.weight": torch.ones(1, RANK)}
    save_file(tensors, bad / "adapter_model.safetensors")
    llm = make_llm(base, enforce_eager=True, enable_lora=True, max_lora_rank=RANK, max_loras=1)
    try:
        with_lora = generate(llm, LoRARequest("adapter", 1, str(adapter)))
        without = generate(llm)
        # Last: the engine is not used after a failed adapter load.
        with pytest.raises(ValueError, match=r"expected target modules.*mlp_res_proj"):
            generate(llm, LoRARequest("bad", 2, str(bad)))
    finally:
        free_llm(llm)
    base_model = load_hf(base)
    changed, worst = 0, 0.0
    for i, prompt in enumerate(PROMPTS):
        (tokens, logprobs), (merged_tokens, merged_logprobs) = with_lora[i], merged_results[i]
        assert tokens == expected[i], f"prompt {i}: vLLM + LoRA {tokens} != PEFT {expected[i]}"
        assert merged_tokens == expected[i], f"prompt {i}: merged checkpoint {merged_tokens} != PEFT {expected[i]}"
        deviation = float((torch.tensor(logprobs) - torch.tensor(merged_logprobs)).abs().max())
        assert deviation < LOGPROB_ATOL, f"prompt {i}: LoRA vs merged logprobs differ by {deviation}"
        worst = max(worst, deviation)
        # The same engine without the adapter is the base model: the adapter really is applied per request.
        assert without[i][0] == hf_greedy(base_model, prompt, STEPS)[0], f"prompt {i}: base request"
        changed += without[i][0] != tokens
    print(f"LoRA vs merged: max |dlogprob| {worst:.2e}; adapter changed {changed}/{len(PROMPTS)} greedy outputs")
    assert changed >= len(PROMPTS) // 2, "the adapter barely changes the outputs: nothing was tested"


@pytest.mark.timeout(480)
def test_server_lists_and_serves_the_adapter(lora, merged_results):
    """`attnres-serve BASE --enable-lora --lora-modules adapter=PATH`: `/v1/models` lists the adapter,
    and a completion with `model="adapter"` gives the merged checkpoint's tokens."""
    base, adapter, _, _ = lora
    args = [str(base), "--served-model-name", "base", "--dtype", "float32", "--kv-cache-memory-bytes", "64M",
            "--max-model-len", "128", "--enforce-eager", "--seed", "0",
            "--enable-lora", "--max-lora-rank", str(RANK), "--lora-modules", f"adapter={adapter}"]
    with ServerProcess(args, env={"VLLM_ENABLE_V1_MULTIPROCESSING": None}, startup_timeout=420) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        models = {m.id: m for m in client.models.list().data}
        assert set(models) == {"base", "adapter"}, models
        assert getattr(models["adapter"], "parent", "base") == "base"
        for i in (0, 2):
            response = client.completions.create(model="adapter", prompt=PROMPTS[i], max_tokens=STEPS,
                                                 temperature=0.0,
                                                 extra_body={"ignore_eos": True, "return_token_ids": True})
            assert response.choices[0].token_ids == merged_results[i][0], f"prompt {i} via the server"
