"""vLLM's Transformers backend (`model_impl="transformers"`) serves the transformers AttnRes model itself:
greedy tokens and top-5 logprobs equal transformers' (the parity rule of `tests.support.parity`), eager
and compiled (Dynamo).

The engines run in a child process: the backend decorates the transformers model classes it serves
in place (with `support_torch_compile`), after which those classes cannot be built outside an engine,
which would break every later test that loads a transformers model in this process.
"""

import json
import os
import sys
from pathlib import Path

import pytest

from tests.support.parity import PROMPTS, assert_matches, reference
from tests.support.processes import run_bounded
from tests.support.reference import load_hf

STEPS = 8
CHILD = """
import json, sys
from tests.support.engines import free_llm, generate, make_llm
path, steps, modes = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
prompts = json.loads(sys.argv[4])
out = {}
for mode, kwargs in modes.items():
    llm = make_llm(path, model_impl="transformers", trust_remote_code=True, **kwargs)
    impl = type(llm.llm_engine.model_executor.driver_worker.worker.model_runner.model).__name__
    out[mode] = {"class": impl, "outputs": generate(llm, prompts, steps, logprobs=5)}
    free_llm(llm)
print("RESULT " + json.dumps(out))
"""
MODES = {"eager": dict(enforce_eager=True), "compiled": dict(compilation_config={"mode": 2, "backend": "eager"})}


@pytest.fixture(scope="module")
def served(checkpoints):
    """`(checkpoint, {mode: {"class", "outputs"}})` from one child process."""
    path = checkpoints("transformers-backend", seed=11, attn_res_block_size=1, num_hidden_layers=3)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = run_bounded([sys.executable, "-c", CHILD, str(path), str(STEPS), json.dumps(MODES), json.dumps(PROMPTS)],
                       timeout=400, env=env, cwd=Path(__file__).resolve().parents[2])
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, (done.stdout + done.stderr)[-5000:]
    return path, json.loads(lines[-1].removeprefix("RESULT "))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("mode", list(MODES))
def test_the_transformers_backend_matches_transformers(served, mode):
    path, results = served
    assert results[mode]["class"] == "TransformersForCausalLM", results[mode]["class"]   # not the plugin's model
    assert_matches(f"transformers backend, {mode}", results[mode]["outputs"], reference(load_hf(path), PROMPTS, STEPS))
