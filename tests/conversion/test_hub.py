"""The Hub without a network.

Push: `attnres-convert ... --push-to-hub` runs the real `HfApi.upload_folder` client (Git LFS path)
against a local Hub API server (tests/conversion/fake_hub.py), which writes the commit in the Hub
cache layout. Pull: one fresh interpreter with `HF_HUB_OFFLINE=1` (read at import time) converts a
source given by repo id from a hub-layout cache, and loads the pushed repo with
`from_pretrained(repo_id, trust_remote_code=True)`; the tests compare logits.
"""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from huggingface_hub import constants
from huggingface_hub import errors as hub_errors
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.conversion.cli import main
from attnres.conversion.errors import ConversionError, hub_reason
from attnres.conversion.hub import require_token, upload_command
from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES
from tests.conversion.builders import hub_cache_snapshot, rel_diff, save_source, source_model, token_ids
from tests.conversion.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[2]

OFFLINE_SCRIPT = """
import sys, torch
from pathlib import Path
# First, before anything imports the installed modeling_attnres (which would take precedence):
# the pushed repo, by repo id, with the modeling files it ships, loaded by its model card's own snippet.
card_snippet = {"PATH_OR_REPO": sys.argv[3]}
exec(Path(sys.argv[6]).read_text(), card_snippet)
model, tok = card_snippet["model"].eval(), card_snippet["tok"]
assert model.dtype == torch.float32, model.dtype
with torch.no_grad():
    logits = model(torch.load(sys.argv[4])).logits
tokens = tok("def f(x):")["input_ids"]
from attnres.conversion.cli import main
from modeling_attnres.modeling_attnres import REMOTE_CODE_FILES
status = main([sys.argv[1], sys.argv[2], "--revision", "main"])     # SRC pulled by repo id from the cache
torch.save({"status": status, "logits": logits, "module": type(model).__module__, "tokens": tokens}, sys.argv[5])
"""


def python_block(card: Path, heading: str) -> str:
    """The first ```python block after `heading` in a model card."""
    after = card.read_text().split(f"\n{heading}\n", 1)[1]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory):
    """Push one conversion to the local Hub, then pull a source and the pushed repo offline."""
    tmp = tmp_path_factory.mktemp("hub")
    pushed_src = save_source(source_model("llama_tied_bias", eps=1e-6), tmp / "pushed_src", tokenizer=True)
    pulled_src = source_model("qwen3", eps=0.0)
    hub_cache_snapshot(save_source(pulled_src, tmp / "pulled_src", tokenizer=True), tmp / "cache", "tiny-org/qwen3")
    with FakeHub(tmp / "cache") as hub, pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "ENDPOINT", hub.url)            # what HF_ENDPOINT sets at import time
        mp.setattr(constants, "HF_HUB_DISABLE_XET", True)     # the Git LFS upload path (no Xet CAS server here)
        mp.setenv("HF_TOKEN", "hf_test_token")
        status = main([str(pushed_src), str(tmp / "pushed"), "--no-verify", "--push-to-hub", "me/tiny-attnres"])
    torch.save(token_ids(), tmp / "ids.pt")
    (tmp / "offline.py").write_text(OFFLINE_SCRIPT)
    (tmp / "card_snippet.py").write_text(python_block(tmp / "pushed" / "README.md", "## Use"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp / "cache"), HF_HOME=str(tmp / "hf_home"),
               HF_MODULES_CACHE=str(tmp / "modules"), OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "offline.py", "tiny-org/qwen3", str(tmp / "pulled"), "me/tiny-attnres",
                           "ids.pt", "out.pt", "card_snippet.py"], cwd=tmp, env=env, capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(tmp=tmp, hub=hub, push_status=status, offline=torch.load(tmp / "out.pt"), stdout=proc.stdout,
                stderr=proc.stderr, pulled_src=pulled_src)


def test_push_goes_through_the_upload_client(hub_run):
    hub, pushed = hub_run["hub"], hub_run["tmp"] / "pushed"
    assert hub_run["push_status"] == 0
    assert hub.unexpected == [] and len(hub.commits) == 1 and hub.commits[0]["repo"] == "me/tiny-attnres"
    assert hub.commits[0]["files"] == sorted(p.name for p in pushed.iterdir())
    assert {"config.json", *REMOTE_CODE_FILES, "README.md", "tokenizer.json", "model.safetensors"} <= set(
        hub.commits[0]["files"])
    assert any(call.startswith("PUT /lfs-upload/") for call in hub.calls)   # weights went through Git LFS
    assert hub.card_metadata["library_name"] == "transformers" and "attnres" in hub.card_metadata["tags"]


def test_pushed_repo_loads_from_pretrained_with_remote_code(hub_run):
    offline = hub_run["offline"]
    assert offline["module"].startswith("transformers_modules")
    local = AutoModelForCausalLM.from_pretrained(hub_run["tmp"] / "pushed", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(offline["logits"], local(token_ids()).logits, rtol=1e-6, atol=1e-6)
    # The tokenizer as the README loads it: its config is remote code too, so without trust_remote_code
    # transformers asks before running it.
    assert offline["tokens"] == AutoTokenizer.from_pretrained(hub_run["tmp"] / "pushed")("def f(x):")["input_ids"]
    assert "Do you wish to run the custom code" not in hub_run["stdout"] + hub_run["stderr"]


def test_source_pulled_by_repo_id_offline(hub_run):
    assert hub_run["offline"]["status"] == 0
    assert "Converted tiny-org/qwen3 (Qwen3ForCausalLM)" in hub_run["stdout"]
    assert "greedy generation (8 tokens) agrees: yes" in hub_run["stdout"]
    pulled = hub_run["tmp"] / "pulled"
    converted = AutoModelForCausalLM.from_pretrained(pulled).eval()
    with torch.no_grad():
        assert rel_diff(converted(token_ids()).logits, hub_run["pulled_src"](token_ids()).logits) < 1e-5
    assert "base_model: tiny-org/qwen3" in (pulled / "README.md").read_text()
    assert "- source: `tiny-org/qwen3` at revision `main` (" in (pulled / "README.md").read_text()
    assert (pulled / "tokenizer.json").exists()


def only_error_line(err: str) -> str:
    """The command's error: exactly one line, the last one on stderr."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("attnres-convert: error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    return errors[0]


def test_a_repo_missing_from_the_offline_cache_is_one_line_naming_the_fix(tmp_path, capsys):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "HF_HUB_OFFLINE", True)
        mp.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        assert main(["tiny-org/not-cached", str(tmp_path / "dst")]) == 1
    line = only_error_line(capsys.readouterr().err)
    assert "'tiny-org/not-cached'" in line and "HF_HUB_OFFLINE=1" in line and "pass its folder" in line
    assert not (tmp_path / "dst").exists()


@pytest.fixture
def hub_without_login(tmp_path):
    """The local Hub as the endpoint, and no token anywhere (`HF_TOKEN`, a saved login)."""
    with FakeHub(tmp_path / "cache") as hub, pytest.MonkeyPatch.context() as mp:
        mp.setattr(constants, "ENDPOINT", hub.url)
        mp.setattr(constants, "HF_HUB_DISABLE_XET", True)
        mp.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
        mp.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-tokens"))
        for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
            mp.delenv(name, raising=False)
        yield hub, mp


def test_a_push_without_a_token_is_refused_in_one_line_before_converting(tmp_path, capsys, hub_without_login):
    hub, _ = hub_without_login
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify", "--push-to-hub", "me/tiny-attnres"]) == 1
    line = only_error_line(capsys.readouterr().err)
    assert line == ("attnres-convert: error: --push-to-hub me/tiny-attnres needs a Hub token and none was found; "
                    "log in with `hf auth login` or set HF_TOKEN, then run again.")
    assert hub.calls == [] and not (tmp_path / "dst").exists()


def test_a_token_the_hub_refuses_is_one_line_and_keeps_the_conversion(tmp_path, capsys, hub_without_login):
    hub, mp = hub_without_login
    mp.setenv("HF_TOKEN", "expired-token")                  # the local Hub accepts only hf_... tokens
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify", "--push-to-hub", "me/tiny-attnres"]) == 1
    line = only_error_line(capsys.readouterr().err)
    assert "'me/tiny-attnres' failed: the Hub refused the token (HTTP 401: set HF_TOKEN to a valid token)" in line
    assert f"push it again with `hf upload me/tiny-attnres {tmp_path / 'dst'} --delete '*'`" in line
    assert hub.commits == [] and (tmp_path / "dst" / "model.safetensors").exists()
    # A private push's retry stays private (`hf upload` creates a missing repo public), its path quoted.
    dst = tmp_path / "my models" / "dst"
    assert main([str(src), str(dst), "--no-verify", "--push-to-hub", "me/tiny-attnres", "--private"]) == 1
    line = only_error_line(capsys.readouterr().err)
    assert f"push it again with `hf upload me/tiny-attnres '{dst}' --delete '*' --private`" in line


def test_a_second_push_replaces_the_repos_files_and_private_is_never_ignored(tmp_path, capsys, hub_without_login):
    """A push leaves the repo holding exactly DST's files: an earlier push's `model.safetensors` beside new
    shards would be what transformers loads. `--private` on an existing public repo, whose visibility a push
    cannot change, is refused before uploading."""
    hub, mp = hub_without_login
    mp.setenv("HF_TOKEN", "hf_test_token")
    first, second = (save_source(source_model("llama", eps=1e-6, seed=seed), tmp_path / f"src{seed}", shards=False)
                     for seed in (0, 1))
    assert main([str(first), str(tmp_path / "one"), "--no-verify", "--push-to-hub", "me/tiny-attnres"]) == 0
    assert main([str(second), str(tmp_path / "two"), "--no-verify", "--max-shard-size", "40KB",
                 "--push-to-hub", "me/tiny-attnres"]) == 0
    snapshot = hub.cache / "models--me--tiny-attnres" / "snapshots" / hub.commits[-1]["sha"]
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in (tmp_path / "two").iterdir())
    assert "model.safetensors" in hub.commits[-1]["deleted"] and not (snapshot / "model.safetensors").exists()
    capsys.readouterr()
    commits = len(hub.commits)
    assert main([str(first), str(tmp_path / "three"), "--no-verify", "--push-to-hub", "me/tiny-attnres",
                 "--private"]) == 1
    line = only_error_line(capsys.readouterr().err)
    # Said as itself, not as a failed upload whose retry command would hit the same public repo.
    assert line.startswith("attnres-convert: error: --private: the Hub repo 'me/tiny-attnres' already exists and "
                           "is public"), line
    assert "nothing was uploaded" in line and len(hub.commits) == commits
    assert main([str(first), str(tmp_path / "four"), "--no-verify", "--push-to-hub", "me/private-attnres",
                 "--private"]) == 0
    assert hub.repos["me/private-attnres"] is True


def http_error(cls, status: int):
    """A `huggingface_hub` HTTP error as the client raises it, with a multi-line message."""
    response = httpx.Response(status, request=httpx.Request("GET", "https://hub.example/api/models/a/b"))
    return cls(f"{status} Client Error.\n\nRepository Not Found for url: https://hub.example/...\nRequest id: x",
               response=response)


def wrapped(outer: Exception, cause: Exception) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize("err, reason", [
    (http_error(hub_errors.RepositoryNotFoundError, 404), "the Hub has no such repo, or it is private"),
    (http_error(hub_errors.GatedRepoError, 403), "the repo is gated (accept its terms on the Hub"),
    (http_error(hub_errors.RevisionNotFoundError, 404), "the repo has no revision 'v2'"),
    (http_error(hub_errors.HfHubHTTPError, 401), "the Hub refused the token (HTTP 401"),
    (http_error(hub_errors.HfHubHTTPError, 403), "the token has no access to that repo (HTTP 403"),
    (http_error(hub_errors.HfHubHTTPError, 503), "the Hub answered HTTP 503 (503 Client Error.)"),
    (hub_errors.LocalTokenNotFoundError("Token is required.\nSee https://..."), "no Hub token was found"),
    (wrapped(hub_errors.LocalEntryNotFoundError("Cannot find...\nset 'HF_HUB_OFFLINE=0'"),
             hub_errors.OfflineModeIsEnabled("offline")),
     "it is not in the local Hub cache at revision 'v2', and offline mode (HF_HUB_OFFLINE=1 or "
     "TRANSFORMERS_OFFLINE=1)"),
    (wrapped(hub_errors.LocalEntryNotFoundError("Got: ConnectError...\nPlease check your internet connection"),
             httpx.ConnectError("[Errno 111] Connection refused\nmore")),
     "the Hub could not be reached (ConnectError: [Errno 111] Connection refused; check the network or HF_ENDPOINT); "
     "it is not in the local Hub cache either"),
    (wrapped(hub_errors.LocalEntryNotFoundError("Got: ...\n..."), http_error(hub_errors.HfHubHTTPError, 429)),
     "the Hub answered HTTP 429 (429 Client Error.); it is not in the local Hub cache either"),
    (hub_errors.IncompleteSnapshotError("partial\nsnapshot", "/cache/snapshot"),
     "the local Hub cache holds only part of it"),
])
def test_hub_failures_are_named_in_one_line_with_their_fix(err, reason):
    got = hub_reason(err, revision="v2")
    assert "\n" not in got and got.startswith(reason), got


def test_offline_mode_names_the_revision_and_refuses_a_push(monkeypatch):
    offline = wrapped(hub_errors.LocalEntryNotFoundError("Cannot find...\n"), hub_errors.OfflineModeIsEnabled("off"))
    assert hub_reason(offline, revision="nosuch").startswith("it is not in the local Hub cache at revision 'nosuch', "
                                                             "and offline mode")
    assert hub_reason(offline, writing=True).startswith("offline mode (HF_HUB_OFFLINE=1 or TRANSFORMERS_OFFLINE=1) "
                                                        "forbids uploading")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ConversionError, match="needs the Hub, and offline mode .* forbids reaching it; unset"):
        require_token("me/tiny-attnres", token="hf_x")


def test_a_push_is_told_it_needs_write_access():
    assert hub_reason(http_error(hub_errors.HfHubHTTPError, 403), writing=True).startswith(
        "the token has no write access to that repo (HTTP 403: use a token of an account that may write to it)")


@pytest.mark.parametrize("files, pickles_skipped", [
    (["config.json", "model.safetensors", "pytorch_model.bin", "model-Q8_0.gguf"], True),
    (["config.json", "pytorch_model.bin", "model-Q8_0.gguf"], False),
    # Safetensors only in a training checkpoint's subfolder: the weights the conversion reads are the .bin.
    (["config.json", "pytorch_model.bin", "checkpoint-500/model.safetensors"], False)])
def test_a_hub_source_downloads_only_what_the_conversion_reads(monkeypatch, tmp_path, files, pickles_skipped):
    """Not the repo's other formats of the same weights (ONNX, Flax, Llama's original/ checkpoint), nor its
    PyTorch pickles where it has safetensors; offline, the cache is read as it is."""
    import huggingface_hub

    from attnres.conversion import checkpoint_io

    asked, listed = [], []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo, revision=None: listed.append(revision) or files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: asked.append(kw) or str(tmp_path))
    assert checkpoint_io.resolve_source("org/model", revision="main") == tmp_path
    assert listed == ["main"]                       # the patterns are chosen from the revision downloaded
    (kwargs,) = asked
    assert kwargs["repo_id"] == "org/model" and kwargs["revision"] == "main" and "allow_patterns" not in kwargs
    assert {"original/*", "*.onnx", "*.msgpack", "*.h5", "*.gguf"} <= set(kwargs["ignore_patterns"])
    assert ("*.bin" in kwargs["ignore_patterns"]) == pickles_skipped
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda *a, **k: pytest.fail("listed offline"))
    checkpoint_io.resolve_source("org/model")
    assert "*.bin" not in asked[-1]["ignore_patterns"]


def test_a_hub_gguf_repo_downloads_the_one_file_named(monkeypatch, tmp_path):
    """A GGUF repo holds every quantisation of a model (gigabytes each): one is named with --gguf-file and
    only it is downloaded; without it the repo is refused before anything is downloaded."""
    import huggingface_hub

    from attnres.conversion import checkpoint_io

    files = ["README.md", "model-Q4_K_M.gguf", "model-Q8_0.gguf", "model-f16.gguf"]
    asked = []
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files", lambda self, repo, revision=None: files)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda **kw: asked.append(kw) or str(tmp_path))
    with pytest.raises(ConversionError, match=r"org/model-GGUF holds 3 GGUF files \(model-Q4_K_M\.gguf, "
                       r"model-Q8_0\.gguf, model-f16\.gguf\) and no config\.json; pick the one to convert with "
                       r"--gguf-file NAME \(nothing was downloaded\)"):
        checkpoint_io.resolve_source("org/model-GGUF")
    assert asked == []
    (tmp_path / "model-Q8_0.gguf").write_bytes(b"")
    assert checkpoint_io.resolve_source("org/model-GGUF", None, "model-Q8_0.gguf") == tmp_path / "model-Q8_0.gguf"
    assert asked == [{"repo_id": "org/model-GGUF", "revision": None, "allow_patterns": ["model-Q8_0.gguf"]}]


def test_push_folder_uses_the_token_endpoint_and_revision_it_is_given(tmp_path, hub_without_login):
    """`push_folder` as a library call: a token passed in needs no login, the endpoint passed in is the one
    reached (not HF_ENDPOINT), and the commit lands on the revision asked for, not on `main`."""
    from attnres.conversion import push_folder

    hub, mp = hub_without_login
    mp.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")        # HF_ENDPOINT elsewhere: never reached
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify"]) == 0
    push_folder(tmp_path / "dst", "me/tiny-attnres", token="hf_test_token", endpoint=hub.url, revision="dev")
    refs = hub.cache / "models--me--tiny-attnres" / "refs"
    assert len(hub.commits) == 1 and sorted(p.name for p in refs.iterdir()) == ["dev"]
    assert hub.commits[0]["files"] == sorted(p.name for p in (tmp_path / "dst").iterdir())


def test_only_a_finished_conversion_is_pushed(tmp_path, hub_without_login):
    """A folder without its model card or modeling files (a copy cut short, another tool's output) is refused
    before anything reaches the Hub, naming what is missing: the repo would not load with remote code."""
    from attnres.conversion import push_folder

    hub, mp = hub_without_login
    mp.setenv("HF_TOKEN", "hf_test_token")
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify"]) == 0
    (tmp_path / "dst" / "README.md").unlink()
    (tmp_path / "dst" / REMOTE_CODE_FILES[0]).unlink()
    missing = rf"\['{REMOTE_CODE_FILES[0]}', 'README\.md'\]"
    with pytest.raises(ConversionError, match=rf"is not a converted AttnRes folder \(missing: {missing}\); push the "
                                              "DST of a finished attnres-convert run"):
        push_folder(tmp_path / "dst", "me/tiny-attnres")
    assert hub.calls == []


def test_the_retry_command_pushes_to_the_same_revision():
    """The `hf upload` line a failed push prints must redo that push: same repo, folder (quoted), privacy
    and revision."""
    assert upload_command("me/m", Path("/out/my model"), private=True, revision="v2") == (
        "hf upload me/m '/out/my model' --delete '*' --private --revision v2")
    assert upload_command("me/m", Path("/out/m")) == "hf upload me/m /out/m --delete '*'"


def test_ctrl_c_while_pushing_says_the_conversion_is_complete_and_exits_130(tmp_path, capsys, monkeypatch):
    """An interrupt during the upload ends like every interrupt (status 130, one line), and tells the user the
    converted folder is whole and how to push it again."""
    from attnres.conversion import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    monkeypatch.setattr(cli, "push_folder", interrupted)
    src = save_source(source_model("llama", eps=1e-6), tmp_path / "src")
    assert main([str(src), str(tmp_path / "dst"), "--no-verify", "--push-to-hub", "me/m"]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("attnres-convert: error: interrupted while pushing; the converted checkpoint is complete")
    assert f"hf upload me/m {tmp_path / 'dst'} --delete '*'" in line and (tmp_path / "dst" / "config.json").is_file()
