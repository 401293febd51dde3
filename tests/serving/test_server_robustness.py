"""The served BPE model under bad input, load and shutdown: one `attnres-serve` process for the module.

It serves the repository's trained `models/attnres-tiny` (byte-level BPE) compiled, as `make serve`
ships it. Every bad request must get a 400 naming the problem (or, for a request longer than the
context, a clean clamp) and leave the server serving; streamed text must equal the non-streamed text
and be valid UTF-8 even where a character is split across tokens; 64 concurrent clients mixing
streaming and non-streaming get no error and the server's memory stays bounded; SIGTERM alone stops
it with status 0 and no process left behind. Start-up mistakes (a missing model path, a busy port)
give one line and a non-zero status without starting anything.
"""

import asyncio
import http.client
import json
import re
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from attnres.models import shipped_model_path
from attnres.serving import cli
from attnres.serving.launcher import group_members, serve_command

MODEL = shipped_model_path()
SERVED = "attnres-tiny"
MAX_MODEL_LEN = json.loads((MODEL / "config.json").read_text())["max_position_embeddings"]
VOCAB_SIZE = json.loads((MODEL / "config.json").read_text())["vocab_size"]
MAX_LOGPROBS = 20                                                  # vLLM's default --max-logprobs
# attnres-serve's `--shutdown-timeout`: on SIGTERM, requests in flight get that long to finish. With
# vLLM's default (0) the engine is killed under them and vLLM 0.32's API server never ends those
# responses nor exits. The server runs with attnres-serve's own default, as users get it.
SHUTDOWN_TIMEOUT = int(cli.SHUTDOWN_TIMEOUT)
DRAIN_SLACK = 10          # seconds past the grace period for the engine and worker processes to exit
# Compiled as `make serve` compiles the model it serves (Dynamo, no Inductor: cli.DEFAULT_COMPILATION).
SERVER_ARGS = [str(MODEL), "--served-model-name", SERVED, "--kv-cache-memory-bytes", "64M", "--seed", "0",
               "--compilation-config", cli.DEFAULT_COMPILATION]
MULTIBYTE_PROMPT = "Grüße aus Köln — naïve café, 你好 🙂"
# Characters of 2, 3 and 4 UTF-8 bytes: structured output forces them, so the model emits byte tokens.
MULTIBYTE_REGEX = "[äöüß€你好🙂]{6}"
# The soak: warm-up rounds (first-use allocations), then measured rounds whose RSS slope (least squares,
# MiB per round of 64 requests) must stay within SOAK_MARGIN of the slope of the control: vLLM's own Llama
# of the same sizes, served the same way, in the same test. The engine itself grows by 3-7 MiB a round,
# by a rate that moved between machines and days (docs/performance.md, the soak), so a fixed bound failed on
# the engine's growth alone; a leak of one request's depth bank or activations (~100 kB+) per request, or
# of one step's bank, would add 6 MiB a round or more.
SOAK_CLIENTS, SOAK_WARMUP, SOAK_ROUNDS, SOAK_TOKENS = 64, 3, 20, 16
SOAK_MARGIN = 4.0
# The first test that uses the server also pays for its start (a cold compile: minutes on a loaded machine).
pytestmark = pytest.mark.timeout(600)


def post(server, path: str, body) -> tuple[int, dict]:
    """POST `body` (a dict as JSON, or a raw string sent as is); returns the status and the JSON answer."""
    conn = http.client.HTTPConnection(server.host, server.port, timeout=120)
    try:
        data = body if isinstance(body, str) else json.dumps(body)
        conn.request("POST", path, body=data.encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def assert_still_serving(server, client) -> None:
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        assert response.status == 200
    done = client.completions.create(model=SERVED, prompt="def main(", max_tokens=4, temperature=0.0,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 4


def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2's printable stand-ins for the 256 bytes), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(extra)}}


@pytest.fixture(scope="module")
def token_bytes():
    """`token_bytes(ids) -> bytes`, read from tokenizer.json alone (not through vLLM or transformers)."""
    spec = json.loads((MODEL / "tokenizer.json").read_text())
    special = {t["id"] for t in spec["added_tokens"] if t["special"]}
    pieces = {i: tok for tok, i in spec["model"]["vocab"].items()}
    decoder = byte_decoder()
    return lambda ids: b"".join(bytes(decoder[c] for c in pieces[i]) for i in ids if i not in special)


def split_tokens(ids: list[int], token_bytes) -> list[int]:
    """The tokens that are not valid UTF-8 on their own: pieces of a character split across tokens."""
    def invalid(i: int) -> bool:
        try:
            token_bytes([i]).decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True
    return [i for i in ids if invalid(i)]


# --- start-up mistakes: one line, non-zero status, nothing started ------------------------------------

def run_serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*serve_command(), *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def assert_one_line_error(done: subprocess.CompletedProcess, *words: str) -> None:
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnres-serve: error:"), done.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def test_unknown_model_path_is_one_line_and_nonzero(tmp_path):
    missing = tmp_path / "no" / "such-model"
    assert_one_line_error(run_serve(str(missing), "--port", "0"), str(missing), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_one_line_error(run_serve(str(empty), "--port", "0"), str(empty), "config.json")


def test_help_names_this_command_and_its_models_before_vllms_options():
    done = run_serve("--help")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: attnres-serve [MODEL] [vllm serve options]\n"), done.stdout[:500]
    assert "builtin:smollm2-135m-attnres" in done.stdout.split("usage: vllm serve")[0], done.stdout[:2000]
    assert "usage: vllm serve" in done.stdout                                        # vLLM's own help follows


def test_busy_port_is_one_line_and_nonzero():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        done = run_serve(str(MODEL), "--host", "127.0.0.1", "--port", str(port))
    assert_one_line_error(done, f"127.0.0.1:{port}", "in use")


# --- bad requests: a 400 that names the problem, and the server keeps serving -------------------------

BAD_REQUESTS = {
    "malformed-json": ("/v1/completions", '{"model": "attnres-tiny", "prompt": "hi", ', "JSON decode error"),
    "not-json": ("/v1/chat/completions", "hello", "JSON decode error"),
    "max_tokens-type": ("/v1/completions", {"prompt": "hi", "max_tokens": "abc"}, "max_tokens"),
    "temperature-type": ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    "prompt-type": ("/v1/completions", {"prompt": {"text": "hi"}}, "prompt"),
    "messages-type": ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    "empty-prompt": ("/v1/completions", {"prompt": ""}, "non-empty"),
    "empty-messages": ("/v1/chat/completions", {"messages": []}, "empty conversation"),
    "id-at-vocab": ("/v1/completions", {"prompt": [17, 42, VOCAB_SIZE]}, f"Token id {VOCAB_SIZE} is out of vocabulary"),
    "id-negative": ("/v1/completions", {"prompt": [17, -1]}, "greater than or equal to 0"),
    "prompt-over-context": ("/v1/completions", {"prompt": [300] * (MAX_MODEL_LEN + 10)},
                            f"maximum context length is {MAX_MODEL_LEN}"),
    "prompt-fills-context": ("/v1/completions", {"prompt": [300] * MAX_MODEL_LEN}, "max_tokens"),
    "logprobs": ("/v1/completions", {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, f"max allowed: {MAX_LOGPROBS}"),
    "prompt_logprobs": ("/v1/completions", {"prompt": "hi", "prompt_logprobs": MAX_LOGPROBS + 1},
                        f"max allowed: {MAX_LOGPROBS}"),
    "top_logprobs": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                                              "top_logprobs": MAX_LOGPROBS + 1}, f"max allowed: {MAX_LOGPROBS}"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_gets_400_and_server_keeps_serving(server, client, case):
    path, body, says = BAD_REQUESTS[case]
    if isinstance(body, dict):
        body = {"model": SERVED, "max_tokens": 4, **body}
    status, answer = post(server, path, body)
    assert status == 400, answer
    assert says in answer["error"]["message"], answer
    assert_still_serving(server, client)


def test_prompt_plus_max_tokens_over_context_is_clamped(server, client):
    """vLLM 0.32 shortens max_tokens to what the context leaves (earlier versions answered 400)."""
    prompt = [300] * (MAX_MODEL_LEN - 40)
    status, answer = post(server, "/v1/completions", {"model": SERVED, "prompt": prompt, "max_tokens": 100,
                                                      "ignore_eos": True})
    assert status == 200, answer
    assert answer["usage"] == {**answer["usage"], "prompt_tokens": len(prompt), "completion_tokens": 40,
                               "total_tokens": MAX_MODEL_LEN}
    assert answer["choices"][0]["finish_reason"] == "length"
    assert post(server, "/v1/completions", {"model": SERVED, "prompt": "hi", "max_tokens": 2,
                                            "logprobs": MAX_LOGPROBS})[0] == 200      # the limit itself is fine
    assert_still_serving(server, client)


# --- UTF-8: prompts in, characters split across tokens out ---------------------------------------------

def test_multibyte_prompt_is_tokenized_and_echoed_exactly(server, client, token_bytes):
    from tokenizers import Tokenizer

    expected = Tokenizer.from_file(str(MODEL / "tokenizer.json")).encode(MULTIBYTE_PROMPT).ids
    assert split_tokens(expected, token_bytes), "the prompt should split a character across tokens"
    kwargs = dict(model=SERVED, prompt=MULTIBYTE_PROMPT, max_tokens=8, temperature=0.0)
    done = client.completions.create(**kwargs, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert done.choices[0].prompt_token_ids == expected and done.usage.prompt_tokens == len(expected)
    # (vLLM 0.32 leaves the echo out when token ids are returned: two requests.)
    echoed = client.completions.create(**kwargs, echo=True, extra_body={"ignore_eos": True}).choices[0].text
    assert echoed == MULTIBYTE_PROMPT + done.choices[0].text, echoed
    streamed = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text


def check_multibyte_output(text: str, streamed: list[str], ids: list[int], token_bytes) -> None:
    assert "".join(streamed) == text, (streamed, text)
    assert "\ufffd" not in text and re.fullmatch(MULTIBYTE_REGEX, text), text
    assert token_bytes(ids).decode("utf-8") == text                   # strict: valid UTF-8, same characters
    assert split_tokens(ids, token_bytes), f"no character was split across tokens: {ids}"


def test_multibyte_output_streams_whole_characters_completion(client, token_bytes):
    kwargs = dict(model=SERVED, prompt="Grüße", max_tokens=24, temperature=0.0,
                  extra_body={"structured_outputs": {"regex": MULTIBYTE_REGEX}, "return_token_ids": True})
    full = client.completions.create(**kwargs).choices[0]
    streamed = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    check_multibyte_output(full.text, streamed, full.token_ids, token_bytes)


def test_multibyte_output_streams_whole_characters_chat(client, token_bytes):
    kwargs = dict(model=SERVED, messages=[{"role": "user", "content": "Schreib: Grüße, 你好 🙂"}], max_tokens=24,
                  temperature=0.0, extra_body={"structured_outputs": {"regex": MULTIBYTE_REGEX},
                                               "return_token_ids": True})
    full = client.chat.completions.create(**kwargs).choices[0]
    streamed = [c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices]
    check_multibyte_output(full.message.content, streamed, full.token_ids, token_bytes)


# --- a client that goes away mid-stream -----------------------------------------------------------------

def metric(server, name: str) -> float:
    """Sum of a Prometheus counter or gauge over its labels, from `/metrics`."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def test_client_disconnect_mid_stream_aborts_the_request(server, client):
    # 32 sequences of 240 tokens: the engine takes seconds (3.5 s here, idle), and counts tokens as it makes them,
    # whatever the client reads; a server that never aborts makes all n * max_tokens. Without logprobs: with
    # them, the API server took seconds to serialise a chunk (the steps made meanwhile merged into it) and
    # sent nothing meanwhile, so saw the disconnect only once the engine had finished (once in a full test
    # run on a loaded machine). How much is made before the abort depends on the load (59 % with both cores
    # busy besides the server, a few steps idle), so the test asks only that the request stopped short.
    n, max_tokens = 32, MAX_MODEL_LEN - 16
    before = metric(server, "vllm:generation_tokens_total")
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    body = {"model": SERVED, "prompt": "def f(", "max_tokens": max_tokens, "n": n, "ignore_eos": True,
            "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")                 # generation has begun
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()
    deadline = time.monotonic() + 60
    while metric(server, "vllm:num_requests_running") > 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    generated = metric(server, "vllm:generation_tokens_total") - before
    assert metric(server, "vllm:num_requests_running") == 0
    assert generated < n * max_tokens, f"{generated} tokens generated: the request ran on after the disconnect"
    assert_still_serving(server, client)


# --- load: 64 concurrent clients, streaming and not, memory bounded ----------------------------------

async def soak_round(url: str, clients: int, max_tokens: int) -> list[str]:
    """One request per client, odd clients streaming; returns the errors (exceptions, wrong lengths)."""
    api = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = ["def fibonacci(n):", "import os\n", "class Parser:", "Grüße, 你好 🙂", "for i in range("]

    async def one(i: int) -> str | None:
        kwargs = dict(model=SERVED, prompt=prompts[i % len(prompts)], max_tokens=max_tokens, temperature=0.0,
                      extra_body={"ignore_eos": True})
        if i % 2:
            stream = await api.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
            usage = [chunk.usage async for chunk in stream if chunk.usage][-1]
        else:
            usage = (await api.completions.create(**kwargs)).usage
        return None if usage.completion_tokens == max_tokens else f"client {i}: {usage.completion_tokens} tokens"

    try:
        results = await asyncio.gather(*(one(i) for i in range(clients)), return_exceptions=True)
    finally:
        await api.close()
    return [repr(r) if isinstance(r, BaseException) else r for r in results if r is not None]


def slope(values: list[float]) -> float:
    """Least-squares slope of `values` against their index."""
    n, mean_x, mean_y = len(values), (len(values) - 1) / 2, sum(values) / len(values)
    return sum((i - mean_x) * (v - mean_y) for i, v in enumerate(values)) / sum((i - mean_x) ** 2 for i in range(n))


def test_the_engine_runs_with_the_variables_attnres_serve_sets(server):
    """With `make serve`'s compilation the engine process gets the C++ op in its graphs and vLLM's AOT
    compilation off (else vLLM hashes its configuration before every forward call): the variables
    `attnres-serve` sets before vLLM starts its processes, read from the engine's own environment."""
    children = [pid for pid in group_members(server.proc.pid) if pid != server.proc.pid]
    environments = []
    for pid in children:
        try:
            environments.append(set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")))
        except OSError:                                                # gone meanwhile
            continue
    wanted = {b"VLLM_USE_AOT_COMPILE=0", b"ATTNRES_CPU_KERNEL=compiled"}
    assert any(wanted <= env for env in environments), (children, [sorted(wanted & env) for env in environments])


def soak(server) -> list[float]:
    """The server's RSS (MiB) after each soak round; every request must succeed."""
    rss = []
    for round_ in range(SOAK_WARMUP + SOAK_ROUNDS):
        errors = asyncio.run(soak_round(server.url, SOAK_CLIENTS, SOAK_TOKENS))
        assert errors == [], (round_, errors[:5])
        rss.append(server.rss_bytes() / 2**20)
    assert min(rss) > 0, rss
    return rss


@pytest.mark.timeout(900)
def test_soak_64_concurrent_clients_no_errors_and_no_memory_growth(server, client, server_cache, tmp_path):
    """AttnRes's server grows no faster than vLLM's own Llama of the same sizes under the same rounds."""
    from transformers import AutoTokenizer

    from tests.serving.conftest import start_server
    from tests.support.multirank import write_control

    attnres = soak(server)
    assert_still_serving(server, client)
    fields, tokenizer = json.loads((MODEL / "config.json").read_text()), AutoTokenizer.from_pretrained(MODEL)
    control_model = write_control(tmp_path / "llama", "LlamaForCausalLM", fields, tokenizer)   # served natively
    with start_server([str(control_model), *SERVER_ARGS[1:]], server_cache, None, {}) as control:
        llama = soak(control)
    growth = {name: slope(rss[SOAK_WARMUP:]) for name, rss in (("AttnRes", attnres), ("Llama", llama))}
    print(f"server RSS per round (MiB): AttnRes {[round(r) for r in attnres]}, Llama {[round(r) for r in llama]}; "
          f"slopes after warm-up {growth}")
    assert growth["AttnRes"] < growth["Llama"] + SOAK_MARGIN, (growth, [round(r) for r in attnres])


# --- shutdown: runs last in this module -------------------------------------------------------------

def test_sigterm_alone_stops_the_server_with_status_0_and_no_process_left(server):
    """A stream is in flight when SIGTERM arrives: it runs to its end (within `--shutdown-timeout`),
    then the server exits with status 0 and leaves no process behind."""
    pgid = server.proc.pid
    assert len(group_members(pgid)) >= 2                               # API server and engine core at least
    conn = http.client.HTTPConnection(server.host, server.port, timeout=60)
    body = {"model": SERVED, "prompt": "def f(", "max_tokens": 64, "n": 2, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")                 # generation has begun
    received = []
    reader = threading.Thread(target=lambda: received.extend(response), daemon=True)
    reader.start()
    began = time.monotonic()
    shutdown = server.stop(grace=SHUTDOWN_TIMEOUT + DRAIN_SLACK)      # SIGTERM, then wait (SIGKILL only if needed)
    drained = time.monotonic() - began
    reader.join(timeout=30)
    print(f"drained and exited {drained:.1f} s after SIGTERM (--shutdown-timeout {SHUTDOWN_TIMEOUT})")
    assert drained <= SHUTDOWN_TIMEOUT + DRAIN_SLACK
    conn.close()
    assert shutdown.returncode == 0, server.log_tail()
    assert shutdown.survivors == [], f"processes left after SIGTERM: {shutdown.survivors}"
    assert shutdown.graceful and group_members(pgid) == []
    events = [line for line in received if line.startswith(b"data: ")]
    assert events and events[-1].strip() == b"data: [DONE]", events[-3:]
