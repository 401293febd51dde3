"""End to end: one real `attnres-serve` process, driven by the `openai` client.

The server serves the built-in tiny random model in float32 on a free loopback port, behind a key; it is
the session's shared server (`tests.support.shared_server`), which test_clients.py also uses. Every greedy
answer is checked against transformers on the same checkpoint.
"""

import concurrent.futures
import json
import re
import urllib.error
import urllib.request

import openai
import pytest
import torch

from attnres.serving.defaults import RANDOM_SERVED_NAME
from attnres.serving.launcher import group_members
from attnres.serving.random_model import ensure_random_model
from tests.support.reference import hf_greedy, load_hf
from tests.support.shared_server import API_KEY as SERVER_API_KEY
from tests.support.shared_server import MAX_MODEL_LEN

SHARED_SERVER = True
MAX_TOKENS = 8
NO_EOS = {"ignore_eos": True}
OPEN_PATHS = {"/health", "/ping"}
NOT_IN_SCHEMA = ["/metrics", "/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"]
PROMPTS = ["Hello", "The quick brown fox", "a", "AttnRes mixes depth.", "1 2 3 4", "\n", "Why?", "zzz zzz zzz"]


@pytest.fixture(scope="module")
def hf(server_cache):
    """The served checkpoint's transformers model (float32) and tokenizer."""
    from transformers import AutoTokenizer

    path = ensure_random_model(server_cache)
    return load_hf(path), AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def reference(hf):
    """`greedy(token_ids) -> next MAX_TOKENS token ids` from transformers, and the tokenizer."""
    model, tokenizer = hf
    cache = {}

    def greedy(ids: list[int]) -> list[int]:
        if tuple(ids) not in cache:
            cache[tuple(ids)] = hf_greedy(model, ids, MAX_TOKENS)[0]
        return cache[tuple(ids)]

    return greedy, tokenizer


def complete(client, prompt: str, **kwargs):
    return client.completions.create(model=RANDOM_SERVED_NAME, prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0.0, extra_body={**NO_EOS, "return_token_ids": True}, **kwargs)


def expected_completion(reference, prompt: str) -> tuple[list[int], str]:
    greedy, tokenizer = reference
    ids = greedy(tokenizer(prompt)["input_ids"])
    return ids, tokenizer.decode(ids, skip_special_tokens=True)


def test_models_lists_the_served_name(client):
    assert [m.id for m in client.models.list().data] == [RANDOM_SERVED_NAME]


def test_completion_matches_transformers(client, reference):
    for prompt in PROMPTS[:3]:
        choice = complete(client, prompt).choices[0]
        ids, text = expected_completion(reference, prompt)
        assert choice.token_ids == ids, prompt
        assert choice.text == text
        assert choice.finish_reason == "length"


def test_chat_uses_the_chat_template(client, reference):
    greedy, tokenizer = reference
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"]
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    response = client.chat.completions.create(model=RANDOM_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0.0, extra_body=NO_EOS)
    assert response.choices[0].message.content == tokenizer.decode(greedy(ids), skip_special_tokens=True)
    assert response.usage.prompt_tokens == len(ids)


def test_streaming_completion_and_chat(client, reference):
    _, text = expected_completion(reference, PROMPTS[1])
    stream = client.completions.create(model=RANDOM_SERVED_NAME, prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                       temperature=0.0, stream=True, extra_body=NO_EOS)
    pieces = [chunk.choices[0].text for chunk in stream if chunk.choices]
    assert len(pieces) >= 2 and "".join(pieces) == text

    messages = [{"role": "user", "content": "stream please"}]
    full = client.chat.completions.create(model=RANDOM_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0.0, extra_body=NO_EOS).choices[0].message.content
    stream = client.chat.completions.create(model=RANDOM_SERVED_NAME, messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0.0, stream=True, extra_body=NO_EOS)
    deltas = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(deltas) >= 2 and "".join(deltas) == full


def allowed_tokens(model, ids: list[int], temperature: float, top_k: int, top_p: float) -> set[int]:
    """The tokens that top-k then top-p sampling at `temperature` can draw after `ids` (transformers,
    float32), with a little slack at the nucleus edge for float rounding."""
    with torch.no_grad():
        probs = (model(torch.tensor([ids])).logits[0, -1].float() / temperature).softmax(-1)
    order = probs.argsort(descending=True)[:top_k]
    kept = probs[order] / probs[order].sum()
    before = kept.cumsum(0) - kept                                      # mass of the tokens ranked above
    return {int(t) for t, mass in zip(order, before) if mass < top_p + 1e-3}


def test_n_and_sampling_parameters(client, hf):
    """n=3 seeded samples at a temperature where they must differ: not all equal, each token one that
    top-k/top-p allow (checked against transformers), and the same seed repeats them."""
    model, tokenizer = hf
    temperature, top_k, top_p, steps = 1.5, 20, 0.95, 6
    kwargs = dict(model=RANDOM_SERVED_NAME, prompt="Sample", max_tokens=steps, n=3, temperature=temperature,
                  top_p=top_p, seed=7, extra_body={**NO_EOS, "top_k": top_k, "return_token_ids": True}, logprobs=2)
    first, again = client.completions.create(**kwargs), client.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert all(len(c.logprobs.tokens) == steps and len(c.token_ids) == steps for c in first.choices)
    assert len({tuple(c.token_ids) for c in first.choices}) > 1, "three samples at temperature 1.5 all equal"
    prompt = tokenizer("Sample")["input_ids"]
    for choice in first.choices:
        for i, token in enumerate(choice.token_ids):
            allowed = allowed_tokens(model, prompt + choice.token_ids[:i], temperature, top_k, top_p)
            assert token in allowed, (choice.index, i, token, sorted(allowed))
    by_index = {c.index: c.token_ids for c in again.choices}
    assert all(by_index[c.index] == c.token_ids for c in first.choices), "seeded sampling must repeat"
    assert first.usage.completion_tokens == 3 * steps


def test_32_concurrent_requests_all_correct(client, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(lambda p: complete(client, p).choices[0], prompts, timeout=300))
    for prompt, choice in zip(prompts, answers):
        assert choice.token_ids == expected_completion(reference, prompt)[0], prompt


def assert_still_serving(server, client):
    with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
        assert response.status == 200
    assert complete(client, "still there?").choices[0].finish_reason == "length"


@pytest.mark.parametrize("bad", [
    dict(prompt="x" * (MAX_MODEL_LEN + 50)),                       # longer than the context
    dict(prompt="ok", temperature=-1.0),
    dict(prompt="ok", n=0),
    dict(prompt="ok", max_tokens=-3),
    dict(prompt="ok", top_p=1.5),
], ids=["too-long", "temperature", "n", "max_tokens", "top_p"])
def test_bad_requests_get_400_and_server_keeps_serving(server, client, bad):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=RANDOM_SERVED_NAME, **{"max_tokens": 4, **bad})
    assert err.value.status_code == 400
    assert_still_serving(server, client)


def test_unknown_model_gets_404_and_server_keeps_serving(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert err.value.status_code == 404
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert_still_serving(server, client)


def status_of(server, method: str, path: str, key: str | None) -> int:
    """The HTTP status of one request (a POST carries `{}`), with `Authorization: Bearer key` if given."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(server.url + path, method=method, headers=headers,
                                     data=b"{}" if method in ("POST", "PUT", "PATCH") else None)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status
    except urllib.error.HTTPError as err:
        return err.code


def test_every_route_but_the_health_checks_needs_the_key(server):
    """Every route the server has (its OpenAPI schema, read with the key, plus the unlisted ones): 401
    without the key or with a wrong one, anything else with it; /health and /ping stay open."""
    with urllib.request.urlopen(urllib.request.Request(server.url + "/openapi.json", headers={
            "Authorization": f"Bearer {SERVER_API_KEY}"}), timeout=60) as response:
        schema = json.load(response)
    routes = sorted({(method.upper(), re.sub(r"\{[^}]*\}", "x", path)) for path, ops in schema["paths"].items()
                     for method in ops} | {("GET", path) for path in NOT_IN_SCHEMA})
    for needed in [("POST", "/invocations"), ("POST", "/tokenize"), ("POST", "/detokenize"),
                   ("GET", "/tokenizer_info"), ("GET", "/version"), ("POST", "/v1/completions")]:
        assert needed in routes, f"{needed} is not served: the test would not cover it"
    for method, path in routes:
        without, wrong = status_of(server, method, path, None), status_of(server, method, path, "wrong")
        if path in OPEN_PATHS:
            assert without != 401 and wrong != 401, (method, path, without, wrong)
        else:
            assert without == 401 and wrong == 401, (method, path, without, wrong)
            assert status_of(server, method, path, SERVER_API_KEY) != 401, (method, path)
    assert_still_serving(server, openai.OpenAI(base_url=server.url + "/v1", api_key=SERVER_API_KEY, max_retries=0))


def test_the_tokenizer_is_served_for_clients_that_look_it_up(server, client, hf):
    """`/tokenizer_info` (what lm-eval's `local-completions` asks for) and `/tokenize` agree with the
    checkpoint's own tokenizer."""
    _, tokenizer = hf
    headers = {"Authorization": f"Bearer {SERVER_API_KEY}", "Content-Type": "application/json"}
    with urllib.request.urlopen(urllib.request.Request(server.url + "/tokenizer_info", headers=headers),
                                timeout=60) as response:
        info = json.load(response)
    assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
    body = json.dumps({"prompt": "AttnRes", "add_special_tokens": False}).encode()
    with urllib.request.urlopen(urllib.request.Request(server.url + "/tokenize", data=body, headers=headers),
                                timeout=60) as response:
        assert json.load(response)["tokens"] == tokenizer("AttnRes", add_special_tokens=False)["input_ids"]


def test_sigterm_alone_stops_the_server_with_status_0_and_no_process_left(server):
    """Runs last in this module."""
    pgid = server.proc.pid
    shutdown = server.stop()
    assert shutdown.returncode == 0, server.log_tail()
    assert shutdown.survivors == [], f"processes left after SIGTERM: {shutdown.survivors}"
    assert group_members(pgid) == []
