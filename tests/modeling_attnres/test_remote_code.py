"""Hub remote code: a saved folder loads with trust_remote_code where modeling_attnres is absent."""

import json
import os
import subprocess
import sys

import torch

from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES
from tests.support.models import LOAD_WITHOUT_PACKAGE, tiny_model


def test_saved_folder_carries_remote_code(tmp_path):
    model = tiny_model(seed=20, qk_norm=True)
    model.save_pretrained(tmp_path / "ckpt")
    files = set(os.listdir(tmp_path / "ckpt"))
    assert set(REMOTE_CODE_FILES) <= files
    auto_map = json.loads((tmp_path / "ckpt" / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_attnres.AttnResConfig",
        "AutoModel": "modeling_attnres.AttnResModel",
        "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
        "AutoModelForSequenceClassification": "modeling_attnres.AttnResForSequenceClassification",
        "AutoModelForTokenClassification": "modeling_attnres.AttnResForTokenClassification",
        "AutoModelForQuestionAnswering": "modeling_attnres.AttnResForQuestionAnswering",
    }


def test_remote_code_loads_in_a_fresh_interpreter_without_the_package(tmp_path):
    model = tiny_model(seed=21, attn_res_mode="full", num_hidden_layers=3)
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    result = subprocess.run(
        [sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(tmp_path / "ckpt"), str(tmp_path / "ids.pt"),
         str(tmp_path / "logits.pt"), str(torch.get_num_threads())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=0, atol=0)
