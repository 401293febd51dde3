"""In-process vLLM engines for tests: the one set of engine settings, one way to generate, one pool."""

import gc
from collections.abc import Callable, Hashable
from pathlib import Path

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


def generate(llm, prompts: list[list[int]], steps: int, logprobs: int | None = None,
             lora_request=None) -> list[tuple[list[int], list[dict[int, float]] | None]]:
    """Greedy continuations of token-id prompts (`ignore_eos`): per prompt, the tokens and, when
    `logprobs` is given, `{token id: logprob}` of the top `logprobs` (and the chosen token) at each step."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, lora_request=lora_request,
                        use_tqdm=False)
    return [(list(o.outputs[0].token_ids), None if logprobs is None else
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]) for o in outs]


def chosen_logprobs(tokens: list[int], steps: list[dict[int, float]]) -> list[float]:
    """The logprob of each generated token (from `generate(..., logprobs=1)`)."""
    return [step[t] for t, step in zip(tokens, steps)]


class EnginePool:
    """One live in-process engine at a time: `get(key, start)` reuses the engine of the same key and
    otherwise frees the current one before `start()` makes the next (two engines do not fit)."""

    def __init__(self):
        self.key, self.llm = None, None

    def get(self, key: Hashable, start: Callable[[], object]):
        if self.key != key:
            self.close()
            self.llm, self.key = start(), key
        return self.llm

    def close(self) -> None:
        if self.llm is not None:
            free_llm(self.llm)
            self.llm, self.key = None, None
