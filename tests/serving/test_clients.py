"""Clients users point at the server, end to end against one `attnres-serve` of the tiny random model, which
requires an API key (the session's shared server, `tests.support.shared_server`, which test_server.py also
uses):

- EleutherAI's lm-evaluation-harness, `local-completions` with no tokenizer argument and no hub
  (`HF_HUB_OFFLINE=1`): it finds the tokenizer through the server (`/tokenizer_info`, then `/tokenize` and
  `/detokenize`) and runs the three task files of `make eval` (eval/tasks/) on small items written here;
  every log-likelihood it got (each answer, each paragraph from its start) and every generation must
  equal transformers' on the same checkpoint, so a wrong tokenizer or logprob path fails;
- `vllm bench serve`, started from the install as `attnres-vllm bench serve`.
"""

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from attnres.serving.defaults import RANDOM_SERVED_NAME
from attnres.serving.random_model import ensure_random_model
from tests.support.processes import run_bounded
from tests.support.reference import hf_greedy, load_hf, teacher_forced
from tests.support.shared_server import API_KEY as SERVER_API_KEY
from tests.support.shared_server import MAX_MODEL_LEN

REPO = Path(__file__).resolve().parents[2]
SHARED_SERVER = True
CHILD_TIMEOUT = 240
TASKS = ("attnres_capitals_mc", "attnres_countries_gen", "attnres_alice_ppl")
# Items for eval/tasks/ in the random model's alphabet (printable ASCII and newline).
ROWS = {
    "capitals_mc.jsonl": [
        {"id": "KE", "country": "Kenya", "choices": ["Lusaka", "Nairobi", "Kampala", "Dodoma"], "answer": 1},
        {"id": "FR", "country": "France", "choices": ["Paris", "Rome", "Berlin", "Madrid"], "answer": 0},
        {"id": "CI", "country": "Ivory Coast", "choices": ["Dakar", "Accra", "Yamoussoukro"], "answer": 2},
    ],
    "countries_gen.jsonl": [
        {"id": "KE", "capital": "Nairobi", "country": "Kenya"},
        {"id": "PE", "capital": "Lima", "country": "Peru"},
    ],
    "alice_ppl.jsonl": [
        {"id": "p0000", "text": "Alice was beginning to get very tired of sitting by her sister on the bank, and "
                                "of having nothing to do: `and what is the use of a book,' thought Alice."},
        {"id": "p0005", "text": "Either the well was very deep, or she fell very slowly."},
    ],
}
STOPS = (".", "\n")                       # countries_gen.yaml's `until`
MAX_GEN_TOKS = 10                         # countries_gen.yaml's `max_gen_toks`
# float32 on both sides; per token the logprobs agree to about 1e-5 (tests/serving/test_parity.py bounds 2e-4).
LOGLIK_TOLERANCE_PER_TOKEN = 2e-4


@pytest.fixture(scope="module")
def hf(server_cache):
    """The served checkpoint's transformers model (float32), its tokenizer and its folder."""
    from transformers import AutoTokenizer

    path = ensure_random_model(server_cache)
    return load_hf(path), AutoTokenizer.from_pretrained(path), path


def child_env(**extra) -> dict:
    """The environment of a client process: no hub, the server's key for OpenAI-style clients, and none of
    the in-process engine settings tests/serving/conftest.py gives this package (a client is no engine)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return {**env, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "OPENAI_API_KEY": SERVER_API_KEY, "TOKENIZERS_PARALLELISM": "false", **extra}


@pytest.fixture(scope="module")
def lm_eval_samples(server, tmp_path_factory) -> dict[str, list[dict]]:
    """Run `lm_eval run --model local-completions` once on eval/tasks/ against the module's server (no
    `tokenizer=`, the key as `auth_token` and in `OPENAI_API_KEY`); its logged samples by task (as lm-eval
    writes them: arguments as `{"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}`, numbers as strings)."""
    work = tmp_path_factory.mktemp("lm-eval")
    for name, rows in ROWS.items():
        (work / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
    model_args = (f"model={RANDOM_SERVED_NAME},base_url={server.url}/v1/completions,auth_token={SERVER_API_KEY},"
                  f"max_retries=1,max_length={MAX_MODEL_LEN}")
    cmd = [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions", "--model_args", model_args,
           "--tasks", ",".join(TASKS), "--include_path", str(REPO / "eval" / "tasks"), "--batch_size", "4",
           "--metadata", json.dumps({"data_dir": str(work)}), "--output_path", str(work / "out"), "--log_samples",
           "--verbosity", "INFO"]
    done = run_bounded(cmd, timeout=CHILD_TIMEOUT, cwd=work, env=child_env())
    log = done.stdout[-3000:] + done.stderr[-6000:]
    assert done.returncode == 0, f"lm_eval exited with {done.returncode}:\n{log}"
    assert "Using remote tokenizer backend" in done.stdout + done.stderr, log
    samples = {}
    for task in TASKS:
        files = sorted((work / "out").rglob(f"samples_{task}_*.jsonl"))
        assert len(files) == 1, (task, files, log)
        samples[task] = [json.loads(line) for line in files[0].read_text().splitlines() if line.strip()]
    return samples


def get(url: str, key: str | None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_the_tokenizer_routes_answer_behind_the_key(server):
    assert get(server.url + "/tokenizer_info", None) == 401
    assert get(server.url + "/tokenizer_info", SERVER_API_KEY) == 200


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def continuation_loglik(model, tokenizer, context: str, continuation: str) -> tuple[float, int]:
    """transformers' log-likelihood of `continuation` after `context`, split into tokens the way lm-eval
    does (`_encode_pair`: the whole string's tokens past the context's)."""
    context_ids = encode(tokenizer, context)
    tokens = encode(tokenizer, context + continuation)[len(context_ids):]
    logprobs = teacher_forced(model, context_ids, tokens)
    return float(sum(logprobs[i, t] for i, t in enumerate(tokens))), len(tokens)


def test_lm_eval_answer_logliks_equal_transformers(lm_eval_samples, hf):
    model, tokenizer, _ = hf
    samples = lm_eval_samples["attnres_capitals_mc"]
    assert sorted(s["doc"]["id"] for s in samples) == sorted(r["id"] for r in ROWS["capitals_mc.jsonl"])
    for sample in samples:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]   # gen_args_0, 1, ... in order
        assert len(pairs) == len(sample["doc"]["choices"]) == len(sample["filtered_resps"])
        for (context, continuation), (got, _) in zip(pairs, sample["filtered_resps"]):
            expected, n = continuation_loglik(model, tokenizer, context, continuation)
            assert abs(float(got) - expected) <= LOGLIK_TOLERANCE_PER_TOKEN * n, (sample["doc"]["id"], continuation,
                                                                                got, expected)


def test_lm_eval_paragraph_logliks_equal_transformers(lm_eval_samples, hf):
    """Each paragraph is scored from its start: after the prefix token, which lm-eval takes from the
    server's `/tokenizer_info` (the BOS token)."""
    model, tokenizer, _ = hf
    samples = lm_eval_samples["attnres_alice_ppl"]
    assert len(samples) == len(ROWS["alice_ppl.jsonl"])
    for sample in samples:
        tokens = encode(tokenizer, sample["doc"]["text"])
        logprobs = teacher_forced(model, [tokenizer.bos_token_id], tokens)
        expected = float(sum(logprobs[i, t] for i, t in enumerate(tokens)))
        got = float(sample["filtered_resps"][0])                     # logged as ["-123.4"]
        assert abs(got - expected) <= LOGLIK_TOLERANCE_PER_TOKEN * len(tokens), (sample["doc"]["id"], got, expected)


def expected_generation(model, tokenizer, prompt: str) -> str:
    """transformers' greedy continuation as the server returns it: up to EOS, special tokens dropped,
    cut before the first stop string."""
    ids, _ = hf_greedy(model, encode(tokenizer, prompt), MAX_GEN_TOKS)
    if tokenizer.eos_token_id in ids:
        ids = ids[:ids.index(tokenizer.eos_token_id)]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    return min((text[:text.index(s)] for s in STOPS if s in text), key=len, default=text)


def test_lm_eval_generations_equal_transformers(lm_eval_samples, hf):
    model, tokenizer, _ = hf
    samples = lm_eval_samples["attnres_countries_gen"]
    assert len(samples) == len(ROWS["countries_gen.jsonl"])
    for sample in samples:
        prompt = sample["arguments"]["gen_args_0"]["arg_0"]
        assert prompt.endswith(f"{sample['doc']['capital']} is the capital of")
        assert sample["resps"][0][0] == expected_generation(model, tokenizer, prompt), sample["doc"]["id"]


def test_vllm_bench_serve_runs_from_the_install(server, hf, tmp_path):
    _, _, checkpoint = hf
    script = Path(sys.executable).parent / "attnres-vllm"
    assert script.exists(), f"{script} is missing: reinstall the package (pip install --no-deps -e .)"
    prompts = 8
    cmd = [str(script), "bench", "serve", "--base-url", server.url, "--model", RANDOM_SERVED_NAME,
           "--tokenizer", str(checkpoint), "--dataset-name", "random", "--random-input-len", "16",
           "--random-output-len", "8", "--num-prompts", str(prompts), "--seed", "0", "--save-result",
           "--result-dir", str(tmp_path), "--result-filename", "bench.json"]
    done = run_bounded(cmd, timeout=CHILD_TIMEOUT, cwd=tmp_path, env=child_env())
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["num_prompts"] == prompts and result["completed"] == prompts and result["failed"] == 0, result
    assert result["total_output_tokens"] == prompts * 8                 # random data ignores EOS
    for name in ("mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms"):
        assert result[name] > 0, (name, result[name])
