"""Every multi-rank vLLM engine of the test suite, started one after another in ONE subprocess.

Tensor- and pipeline-parallel engines spawn their worker processes, so the script that creates them
needs an `if __name__ == "__main__":` guard and cannot live in the pytest process; each engine
start costs tens of seconds on 2 cores (the workers import vLLM). `results()` therefore writes the
checkpoints, runs this file once as a script (its own session, output to a file, killed at the end,
with a timeout) and returns what every engine generated, memoised for the whole pytest session;
`tests/serving/test_pipeline_parallel.py` and `test_tensor_parallel.py` compare that with transformers,
computed in the test process (`reference`, by the rule of `parity.assert_matches`).

Engines (two CPU ranks, one core each: `VLLM_CPU_OMP_THREADS_BIND="0|1"`, the `mp` executor), in
this order so that the control comes first:
- `mixtral-pp2`: vLLM's own Mixtral at PP=2 (attention, dense norms and a mixture of experts), the
  control that tells an engine failure from ours (one control engine: each multi-rank engine costs two
  spawned workers that import vLLM);
- `block-pp2-on` / `block-pp2-off`: Block AttnRes (5 layers, blocks of 2) at PP=2, the second stage
  starting at layer 2 (where a block closes) and at layer 3 (mid-block);
- `block-tp2`: the same at TP=2;
- `full-pp2-server`: Full AttnRes with tied embeddings at PP=2 behind `attnres-serve`'s OpenAI
  server, compiled (Dynamo), the PP worker added by `attnres-serve` itself;
- `block-1rank`: the same checkpoint on one rank, in-process.

The block checkpoint is a mixture of experts with dense layers between the sparse ones (`mlp_only_layers`
1 and 3), so that every stage of either partition and every tensor-parallel rank runs both kinds of MLP:
one engine each covers the dense and the MoE paths (about 26 s an engine here).
"""

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.models import perturbed_copy
from tests.support.parity import PROMPTS, Reference
from tests.support.parity import reference as parity_reference
from tests.support.processes import stop_group
from tests.support.reference import load_hf

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
PROMPT_INDICES = (0, 2, 4)  # of parity.PROMPTS: lengths 1, 7 and 19
PP_WORKER = "attnres.serving.cpu_worker.PipelineCPUWorker"
CHECKPOINTS = {
    "block": dict(seed=21, num_hidden_layers=5, attn_res_block_size=2, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=32, mlp_only_layers=[1, 3]),
    "full": dict(seed=22, num_hidden_layers=3, attn_res_mode="full", tie_word_embeddings=True),
}
# vLLM's own models as controls, random at the tiny model's sizes: transformers class name -> extra fields.
# Mixtral's reference runs its experts one by one ("eager", as AttnRes does): the teacher-forced float64
# pass cannot use transformers' default grouped_mm, which takes float32/16 only.
CONTROLS = {"mixtral": ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2))}
ENGINES = {   # name -> (checkpoint, engine kwargs, VLLM_PP_LAYER_PARTITION or None)
    # The control first: vLLM's own Mixtral at PP=2. No expert parallelism: on vllm-cpu 0.32 an
    # enable_expert_parallel engine dies at its first step for vLLM's own Qwen3-MoE too.
    "mixtral-pp2": ("mixtral", dict(pipeline_parallel_size=2), None),
    "block-pp2-on": ("block", dict(pipeline_parallel_size=2), "2,3"),
    "block-pp2-off": ("block", dict(pipeline_parallel_size=2), "3,2"),
    "block-tp2": ("block", dict(tensor_parallel_size=2), None),
}
# These engines also take a weight update after generating (tensors of every rank: both pipeline stages,
# every tensor-parallel shard, the embedding and the untied head; dense layers' tensors, since routed
# experts are updated a whole MoE block at a time) and generate again as `NAME-updated`.
UPDATED_ENGINES = ("block-pp2-off", "block-tp2")
UPDATE = ["model.layers.0.self_attn.k_proj.weight", "model.layers.2.self_attention_res_proj.weight",
          "model.layers.3.input_layernorm.weight", "model.layers.3.mlp.gate_proj.weight",
          "model.embed_tokens.weight", "lm_head.weight", "model.output_attn_res_proj.weight"]
SERVER = ("full-pp2-server", "full")
ONE_RANK = ("block-1rank", "block")
SCRIPT_TIMEOUT = 1500
TEST_TIMEOUT = SCRIPT_TIMEOUT + 300    # the first test also waits for every multi-rank engine


def prompts() -> list[list[int]]:
    return [PROMPTS[i] for i in PROMPT_INDICES]


# --- in the test process ---------------------------------------------------------------------------

def write_checkpoints(root: Path) -> dict[str, Path]:
    """The tiny float32 checkpoints every engine serves (even head counts: TP=2 splits them)."""
    from attnres.serving.random_model import RANDOM_CONFIG, make_tokenizer, write_tiny_checkpoint

    paths = {name: write_tiny_checkpoint(root / name, **fields) for name, fields in CHECKPOINTS.items()}
    for name, (model_class, extra) in CONTROLS.items():
        paths[name] = write_control(root / name, model_class, {**RANDOM_CONFIG, **extra}, make_tokenizer())
    changes = perturbed_copy(paths["block"], root / "block-updated", UPDATE)
    save_file(changes, root / "update.safetensors")
    paths["block-updated"], paths["update"] = root / "block-updated", root / "update.safetensors"
    return paths


def write_control(path: Path, model_class: str, fields: dict, tokenizer) -> Path:
    """A random transformers `model_class` (MixtralForCausalLM, LlamaForCausalLM) of an AttnRes model's sizes
    (`fields`: its config), which vLLM serves with its own model: a control for the multi-rank engines, and
    for the server soak (tests/serving/test_server_robustness.py)."""
    import transformers

    model_cls = getattr(transformers, model_class)
    config_cls = model_cls.config_class
    torch.manual_seed(23)
    keep = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "max_position_embeddings", "rms_norm_eps", "initializer_range", "num_experts",
            "num_experts_per_tok", "moe_intermediate_size", "num_local_experts")
    config = config_cls(**{k: v for k, v in fields.items() if k in keep}, vocab_size=len(tokenizer), pad_token_id=0,
                        bos_token_id=1, eos_token_id=2)
    model_cls(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def run_script(workdir: Path, paths: dict[str, Path]) -> dict:
    """Run this file as a script over `paths`; returns `{engine: [(tokens, top logprobs)] or error}`."""
    (workdir / "paths.json").write_text(json.dumps({k: str(v) for k, v in paths.items()}))
    log = workdir / "engines.log"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, __file__, str(workdir)], cwd=REPO, env=env, stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=SCRIPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        pass
    finally:
        stop_group(proc.pid)
        server_pgid = workdir / "server.pgid"
        if server_pgid.exists():                                       # a server outliving a killed script
            stop_group(int(server_pgid.read_text()))
    results = json.loads((workdir / "results.json").read_text()) if (workdir / "results.json").exists() else {}
    results["_log"] = log.read_text(errors="replace")[-8000:]
    return results


def results(root: Path) -> tuple[dict, dict[str, Path]]:
    """`(engine results, checkpoint paths)`: the checkpoints written under `root`, every engine run once
    (the `multirank` fixture of tests/serving/conftest.py calls this once per session)."""
    paths = write_checkpoints(root)
    return run_script(root, paths), paths


@functools.cache
def reference(path: Path, control: str | None = None) -> list[Reference]:
    """transformers' reference of every prompt (`parity.reference`) for the checkpoint at `path`: the
    AttnRes model, or a control's own transformers class (`CONTROLS`)."""
    import transformers

    if control is None:
        return parity_reference(load_hf(path), prompts(), STEPS)
    model_class = getattr(transformers, CONTROLS[control][0])
    kwargs = dict(experts_implementation="eager") if control == "mixtral" else {}
    return parity_reference(load_hf(path, model_class, **kwargs), prompts(), STEPS)


def outputs(results: dict, name: str) -> list:
    """What engine `name` generated, or a test failure that says whether vLLM's own Llama failed too."""
    import pytest

    result = results.get(name, {"error": "did not run (the script stopped before it)"})
    if "outputs" not in result:
        control = results.get("mixtral-pp2", {})
        verdict = ("vLLM's own Mixtral at PP=2 failed too: an engine problem, not the plugin's"
                   if "outputs" not in control else "vLLM's own Mixtral at PP=2 works: the plugin's failure")
        pytest.fail(f"{name}: {result['error']}\n{verdict}\n--- engine log ---\n{results['_log']}")
    return result["outputs"]


# --- in the subprocess -------------------------------------------------------------------------------

def generate_offline(path: str, kwargs: dict, update: str | None = None) -> list:
    """Start an engine, generate greedily for `prompts()` with top-5 logprobs, shut it down; with `update`
    (a safetensors file), also apply it in place and generate again: `[before, after]`."""
    from safetensors.torch import load_file

    from attnres.serving.weights import WORKER_EXTENSION, update_weights
    from tests.support.engines import free_llm, generate, make_llm

    llm = make_llm(Path(path), enforce_eager=True, worker_extension_cls=WORKER_EXTENSION, **kwargs)
    try:
        before = generate(llm, prompts(), STEPS, logprobs=5)
        if update is None:
            return before
        for name, tensor in load_file(update).items():                # one tensor per call
            update_weights(llm, [(name, tensor)])
        return [before, generate(llm, prompts(), STEPS, logprobs=5)]
    finally:
        free_llm(llm)


def generate_server(path: str, workdir: Path) -> list:
    """`attnres-serve PATH -pp 2` (compiled with Dynamo only), one completions request for all prompts."""
    import urllib.request

    from attnres.serving.launcher import ServerProcess

    args = [path, "-pp", "2", "--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "64M",
            "-cc", json.dumps({"mode": 2, "backend": "eager"})]
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": None}                    # the server's usual processes
    with ServerProcess(args, env=env, startup_timeout=600, log_path=workdir / "server.log") as server:
        (workdir / "server.pgid").write_text(str(server.proc.pid))
        body = dict(model=path, prompt=prompts(), max_tokens=STEPS, temperature=0.0, logprobs=5, ignore_eos=True,
                    return_tokens_as_token_ids=True)
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            choices = sorted(json.load(response)["choices"], key=lambda c: c["index"])
    token_id = lambda s: s.removeprefix("token_id:")                  # noqa: E731
    return [([int(token_id(t)) for t in c["logprobs"]["tokens"]],
             [{token_id(t): lp for t, lp in step.items()} for step in c["logprobs"]["top_logprobs"]])
            for c in choices]


def main(workdir: Path) -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))          # unwind: stop the server's group
    paths = json.loads((workdir / "paths.json").read_text())
    done: dict = {}

    def record(name: str, run) -> None:
        began = time.monotonic()
        try:
            outputs = run()
            if name in UPDATED_ENGINES:                                # [before, after] the update
                outputs, done[f"{name}-updated"] = outputs[0], {"outputs": outputs[1]}
            done[name] = {"outputs": outputs, "seconds": round(time.monotonic() - began, 1)}
        except Exception as exc:                                       # the others still run
            done[name] = {"error": f"{type(exc).__name__}: {exc}"[-4000:]}
        print(f"=== {name}: {done[name].get('seconds', 'FAILED')}", flush=True)
        tmp = workdir / "results.json.tmp"
        tmp.write_text(json.dumps(done))
        os.replace(tmp, workdir / "results.json")

    for name, (checkpoint, kwargs, partition) in ENGINES.items():
        os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
        if partition:
            os.environ["VLLM_PP_LAYER_PARTITION"] = partition
        extra = {"worker_cls": PP_WORKER} if kwargs.get("pipeline_parallel_size", 1) > 1 else {}
        engine = dict(distributed_executor_backend="mp", **kwargs, **extra)
        update = paths["update"] if name in UPDATED_ENGINES else None
        record(name, lambda: generate_offline(paths[checkpoint], engine, update))
    os.environ.pop("VLLM_PP_LAYER_PARTITION", None)
    record(SERVER[0], lambda: generate_server(paths[SERVER[1]], workdir))
    record(ONE_RANK[0], lambda: generate_offline(paths[ONE_RANK[1]], {}))


if __name__ == "__main__":      # workers are spawned: the entry point must be guarded
    main(Path(sys.argv[1]))
