"""In-process vLLM engines for tests, and the transformers reference they are compared with."""

import gc
from pathlib import Path

import torch

# Every offline engine in these tests: float32 (exact parity), a small KV cache, short contexts.
ENGINE_KWARGS = dict(dtype="float32", kv_cache_memory_bytes=64 << 20, max_model_len=256, seed=0)


def make_llm(model: Path, **kwargs):
    """An in-process `vllm.LLM` with the test defaults; free it with `free_llm`."""
    from vllm import LLM

    return LLM(model=str(model), **{**ENGINE_KWARGS, **kwargs})


def free_llm(llm) -> None:
    """Shut an in-process engine down so that the next one can start in the same process."""
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()
    del llm
    gc.collect()


def hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation by full forward passes (no cache, no EOS handling, like `ignore_eos`).

    Returns the tokens and the log-softmax `[vocab]` at every generated position.
    """
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(steps):
            lp = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
            logprobs.append(lp)
            ids.append(int(lp.argmax()))
    return ids[len(prompt):], logprobs


def load_hf(path: Path):
    """The transformers model of a checkpoint, float32, eval mode."""
    from modeling_attnres import AttnResForCausalLM

    return AttnResForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
