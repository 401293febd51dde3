"""`attnres-serve` on a sequence-classification checkpoint: vLLM's `/classify` route, given text as clients
send it, answers with the class probabilities transformers computes for the same tokens."""

import json
import urllib.request

import pytest
import torch
from transformers import AutoTokenizer

from modeling_attnres import AttnResForSequenceClassification
from tests.support.models import write_head_checkpoint

TEXTS = ["hello world", "def f(x):\n    return x + 1", "a"]


@pytest.fixture(scope="module")
def classifier(checkpoints, tmp_path_factory):
    return write_head_checkpoint(checkpoints("features", seed=7), tmp_path_factory.mktemp("classifier"),
                                 "AttnResForSequenceClassification")


def server_args(request) -> list[str]:
    """The `server` fixture's arguments (the checkpoint is made by a fixture)."""
    return [str(request.getfixturevalue("classifier")), "--dtype", "float32", "--max-model-len", "128",
            "--kv-cache-memory-bytes", "64M", "--enforce-eager"]


def get(server, path: str) -> dict:
    with urllib.request.urlopen(server.url + path, timeout=60) as response:
        return json.loads(response.read())


def test_the_classify_route_answers_like_transformers(server, classifier):
    model = get(server, "/v1/models")["data"][0]["id"]
    request = urllib.request.Request(server.url + "/classify", method="POST",
                                     data=json.dumps({"model": model, "input": TEXTS}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        body = json.loads(response.read())
    tokenizer = AutoTokenizer.from_pretrained(classifier)
    hf = AttnResForSequenceClassification.from_pretrained(classifier, dtype=torch.float32).eval()
    ids = [tokenizer(text).input_ids for text in TEXTS]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))          # the server tokenized the same way
    assert [row["index"] for row in body["data"]] == [0, 1, 2]
    for row, prompt in zip(body["data"], ids):
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0].softmax(-1)
        got = torch.tensor(row["probs"])
        assert torch.allclose(got, want, atol=1e-5), (got, want)
        assert row["label"] == hf.config.id2label[int(want.argmax())] and row["num_classes"] == 3
