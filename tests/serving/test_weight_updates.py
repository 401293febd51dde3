"""Weight updates into a running engine, as an RL trainer pushes them (`attnres.serving.weights`): one
tensor per call, a pseudo-query, a part of a fused q/k/v and gate/up, a weight of a layer with a bias,
a norm and the tied embedding; before the updates vLLM equals transformers on the old weights, after
them on the updated ones (greedy tokens and top-5 logprobs, the parity rule). Bad updates are refused
with the names and leave the weights as they were. Offline (`vllm.LLM`) and through `attnres-serve`'s
`/collective_rpc` (dev mode); under tensor and pipeline parallelism: tests/serving/test_pipeline_parallel.py.
"""

import json
import urllib.error
import urllib.request

import pytest
import torch
from safetensors.torch import save_file

from attnres.serving.weights import WORKER_EXTENSION, as_tensor, encode_tensor, update_weights
from tests.support.engines import free_llm, generate, make_llm
from tests.support.models import perturbed_copy
from tests.support.parity import PROMPTS, assert_matches, reference
from tests.support.reference import load_hf

STEPS = 8
LONG_PROMPT = torch.randint(8, 104, (40,), generator=torch.Generator().manual_seed(40)).tolist()
# One of each kind the checkpoint format has; layer 1 is a second pipeline stage's under PP=2.
UPDATED = ["model.layers.1.mlp_res_proj.weight", "model.layers.0.self_attn.q_proj.weight",
           "model.layers.1.self_attn.v_proj.bias", "model.layers.0.mlp.up_proj.weight",
           "model.layers.1.self_attn.o_proj.weight", "model.layers.0.input_layernorm.weight",
           "model.output_attn_res_norm.weight", "model.embed_tokens.weight"]


@pytest.fixture(scope="module")
def models(checkpoints, tmp_path_factory):
    base = checkpoints("weight-updates", seed=17, attention_bias=True, tie_word_embeddings=True)
    new = tmp_path_factory.mktemp("updated") / "model"
    changes = perturbed_copy(base, new, UPDATED)
    return base, new, changes


@pytest.mark.timeout(300)
def test_an_engine_takes_partial_updates_one_tensor_per_call(models, capfd):
    base, new, changes = models
    prompts = [*PROMPTS, LONG_PROMPT]
    before, after = reference(load_hf(base), prompts, STEPS), reference(load_hf(new), prompts, STEPS)
    assert [r.tokens for r in before] != [r.tokens for r in after], "the update changes nothing: nothing tested"
    # Prefix caching in blocks of 32 tokens (the CPU attention's smallest): the long prompt's first block is
    # computed before the update and must not be reused after it (update_weights drops the prefix cache).
    llm = make_llm(base, enforce_eager=True, worker_extension_cls=WORKER_EXTENSION, block_size=32,
                   enable_prefix_caching=True)
    try:
        assert_matches("before the update", generate(llm, prompts, STEPS, logprobs=5), before)
        capfd.readouterr()
        for name, tensor in changes.items():
            name = "lm_head.weight" if name == "model.embed_tokens.weight" else name    # a tied head's own name
            update_weights(llm, [(name, tensor)])
        said = "".join(capfd.readouterr())       # vLLM's whole-checkpoint warnings, about the modules kept as asked
        assert "Failed to load weights" not in said and "were not loaded from checkpoint" not in said, said[-2000:]
        assert_matches("after the update", generate(llm, prompts, STEPS, logprobs=5), after)
        bad = [([("model.layers.0.no_such.weight", torch.zeros(3))], "model.layers.0.no_such.weight: not a parameter"),
               ([("model.norm.weight", torch.zeros(5))], "model.norm.weight: shape (5,), the checkpoint's is (64,)"),
               ([("model.norm.weight", torch.zeros(64, dtype=torch.int64))], "dtype torch.int64"),
               ([("model.norm.weight", torch.full((64,), float("nan")))], "model.norm.weight: holds NaN or infinite"),
               ([("model.norm.weight", torch.full((64,), float("-inf")))], "model.norm.weight: holds NaN or infinite")]
        for update, message in bad:
            with pytest.raises(ValueError, match="nothing was changed") as err:
                update_weights(llm, update)
            assert message in str(err.value), str(err.value)
        assert_matches("after refused updates", generate(llm, prompts, STEPS, logprobs=5), after)
        update_weights(llm, dict(changes))                       # a mapping (a state_dict()) as well as pairs
        assert_matches("after a mapping's update", generate(llm, prompts, STEPS, logprobs=5), after)
    finally:
        free_llm(llm)


MOE = dict(num_hidden_layers=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=48, mlp_only_layers=[1])
# A router and a part of the shared expert's fused gate/up. Routed experts are refused on vLLM's CPU
# build: its in-place reload leaves the fused-expert kernel's packed weights stale, for vLLM's own
# Qwen3-MoE too (a whole block of its experts reloaded gives other tokens than a fresh engine on them).
MOE_UPDATED = ["model.layers.0.mlp.gate.weight", "model.layers.2.mlp.shared_expert.up_proj.weight"]
EXPERT = "model.layers.2.mlp.experts.1.up_proj.weight"


@pytest.mark.timeout(300)
def test_a_mixture_of_experts_takes_router_and_shared_expert_updates(checkpoints, tmp_path):
    base = checkpoints("weight-updates-moe", seed=19, **MOE)
    changes = perturbed_copy(base, tmp_path / "updated", MOE_UPDATED)
    before, after = reference(load_hf(base), PROMPTS, STEPS), reference(load_hf(tmp_path / "updated"), PROMPTS, STEPS)
    llm = make_llm(base, enforce_eager=True, worker_extension_cls=WORKER_EXTENSION)
    try:
        assert_matches("MoE before the update", generate(llm, PROMPTS, STEPS, logprobs=5), before)
        for name in MOE_UPDATED:
            update_weights(llm, [(name, changes[name])])
        assert_matches("MoE after the update", generate(llm, PROMPTS, STEPS, logprobs=5), after)
        with pytest.raises(Exception, match=f"{EXPERT}: a routed expert; vLLM's CPU build cannot update those"):
            update_weights(llm, [(EXPERT, torch.zeros(32, 64))])
        assert_matches("MoE after a refused expert update", generate(llm, PROMPTS, STEPS, logprobs=5), after)
    finally:
        free_llm(llm)


def test_encoded_tensors_cross_vllms_process_boundary_intact():
    """To an engine in another process the arguments go through vLLM's msgpack (untyped) and then pickle to
    the workers: a tensor does not come out of that, its `encode_tensor` form does, in every dtype and shape;
    anything else is refused naming the weight. `update_weights` into a real engine in another process (which
    of the two forms it sends): tests/examples/test_rl_grpo.py, which runs examples/rl_grpo.py on one."""
    import pickle

    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    def cross(value):
        return pickle.loads(pickle.dumps(MsgpackDecoder().decode(MsgpackEncoder().encode(value))))

    gen = torch.Generator().manual_seed(0)
    for tensor in (torch.randn(64, 64, generator=gen), torch.randn(3, 5, generator=gen).bfloat16().t(),
                   torch.randn(7, generator=gen).half(), torch.tensor(2.5), torch.zeros(0, 4)):
        got = as_tensor("w", cross(encode_tensor(tensor)))
        assert got.dtype == tensor.dtype and got.shape == tensor.shape and torch.equal(got, tensor)
    assert not isinstance(cross(torch.randn(64, 64)), torch.Tensor)
    with pytest.raises(ValueError, match=r"model.norm.weight: got list .* expected a tensor"):
        as_tensor("model.norm.weight", ["float32", [64, 64], 0])


def test_a_refused_update_raises_valueerror_from_an_engine_in_another_process():
    """vLLM wraps a worker's error in a plain `Exception` across processes (its default engine): `update_weights`
    raises the worker's `ValueError` message as a `ValueError`, and names the fix for an engine made without
    the worker extension."""
    from types import SimpleNamespace

    refusal = ("The weight update was refused, nothing was changed (1 problem(s)):\n  model.norm.weight: shape (5,), "
               "the checkpoint's is (64,)\nSend transformers checkpoint names")
    def engine(error):
        def rpc(*args, **kwargs):
            raise error
        return SimpleNamespace(llm_engine=SimpleNamespace(engine_core=None), collective_rpc=rpc,
                               reset_prefix_cache=lambda: None)
    wrapped = Exception(f"Call to collective_rpc method failed: Worker failed with error '{refusal}', please check "
                        "the stack trace above for the root cause")
    with pytest.raises(ValueError) as err:
        update_weights(engine(wrapped), [("model.norm.weight", torch.zeros(5))])
    assert str(err.value) == refusal
    missing = Exception("Worker failed with error ''CPUWorker' object has no attribute 'attnres_update_weights''")
    with pytest.raises(ValueError, match=r"create it with `vllm.LLM\(..., worker_extension_cls=WORKER_EXTENSION\)`"):
        update_weights(engine(missing), {"model.norm.weight": torch.zeros(64)})
    with pytest.raises(RuntimeError, match="engine died"):                 # anything else passes through unchanged
        update_weights(engine(RuntimeError("engine died")), [])


def test_an_unknown_name_says_what_it_probably_meant():
    """vLLM's fused names and a wrapper's prefix (DDP, torch.compile, PEFT) are named with the name to send."""
    from types import SimpleNamespace

    from attnres.serving.weights import check_update

    shapes = {"model.layers.0.self_attn.q_proj.weight": (64, 64), "model.norm.weight": (64,)}
    model = SimpleNamespace(quant_config=None, all_checkpoint_shapes=shapes, resolve_checkpoint_key=lambda n: n)
    cases = {"model.layers.0.self_attn.qkv_proj.weight": "(vLLM's fused qkv_proj: send its transformers parts, "
                                                         "q_proj, k_proj and v_proj)",
             "model.layers.0.mlp.gate_up_proj.weight": "send its transformers parts, gate_proj and up_proj)",
             "module.model.norm.weight": "(a wrapper's name: send 'model.norm.weight', without 'module.')",
             "base_model.model.model.norm.weight": "without 'base_model.model.')",
             "model.nowhere.weight": "model.nowhere.weight: not a parameter of this model\n"}
    for name, hint in cases.items():
        with pytest.raises(ValueError) as err:
            check_update(model, [(name, torch.zeros(64))])
        assert hint in str(err.value), str(err.value)
    ones = torch.ones(64)
    check_update(model, [("model.norm.weight", ones), ("model.norm.weight", ones.clone())])     # the same values
    quantized = SimpleNamespace(**{**vars(model), "quant_config": SimpleNamespace()})
    with pytest.raises(ValueError, match=r"weight updates into a quantized model \(SimpleNamespace\) are not "
                                         r"supported: update the unquantized model and quantize it again"):
        check_update(quantized, [("model.norm.weight", ones)])
    with pytest.raises(ValueError, match=r"model.norm.weight: the same weight as model.norm.weight \(a tied or "
                                         r"repeated name\) with other values; send one of them"):
        check_update(model, [("model.norm.weight", ones), ("model.norm.weight", torch.zeros(64))])


def test_an_update_file_that_is_not_safetensors_is_named(tmp_path):
    """`attnres_update_weights_from_file` (the server's route) on a `torch.save` file or a missing path: a
    ValueError naming the file and how to write one, before the engine is touched."""
    from attnres.serving.weights import AttnResWeightUpdates

    torch.save({"model.norm.weight": torch.ones(64)}, tmp_path / "update.pt")
    for path in (tmp_path / "update.pt", tmp_path / "missing.safetensors"):
        with pytest.raises(ValueError, match=rf"{path} cannot be read as a safetensors file .*; write it with "
                                             r"safetensors.torch.save_file"):
            AttnResWeightUpdates().attnres_update_weights_from_file(str(path))


# The module's server (tests/serving/conftest.py): the same base checkpoint, dev mode for /collective_rpc.
SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}


def server_args(request) -> list[str]:
    """The `server` fixture's arguments (the checkpoint is made by a fixture, so not a constant)."""
    base = request.getfixturevalue("models")[0]
    return [str(base), "--dtype", "float32", "--max-model-len", "128", "--kv-cache-memory-bytes", "64M",
            "--enforce-eager", "--seed", "0"]


def post(server, path: str, body: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(server.url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            text = response.read().decode()
            return response.status, json.loads(text) if text else {}
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def served(server) -> list[tuple[list[int], list[dict]]]:
    """Greedy completions of the token-id prompts with top-5 logprobs, through the OpenAI route."""
    status, answer = post(server, "/v1/completions", dict(model=server.args[0], prompt=PROMPTS, max_tokens=STEPS,
                                                            temperature=0.0, logprobs=5, ignore_eos=True,
                                                            return_tokens_as_token_ids=True))
    assert status == 200, answer
    def ids(tokens):
        return [int(t.removeprefix("token_id:")) for t in tokens]

    return [(ids(c["logprobs"]["tokens"]), [dict(zip(ids(step), step.values())) for step in c["logprobs"][
        "top_logprobs"]]) for c in sorted(answer["choices"], key=lambda c: c["index"])]


@pytest.mark.timeout(600)
def test_a_server_takes_partial_updates_through_collective_rpc(models, server, tmp_path):
    base, new, changes = models
    before, after = reference(load_hf(base), PROMPTS, STEPS), reference(load_hf(new), PROMPTS, STEPS)
    assert_matches("server before the update", served(server), before)
    for i, (name, tensor) in enumerate(changes.items()):
        if tensor.dim() == 1:         # small: as JSON, the route's own serialized form ([name, nested list] pairs)
            call = {"method": "attnres_update_weights", "args": [json.dumps([[name, tensor.tolist()]])]}
        else:
            save_file({name: tensor.contiguous()}, tmp_path / f"{i}.safetensors")
            call = {"method": "attnres_update_weights_from_file", "args": [str(tmp_path / f"{i}.safetensors")]}
        status, answer = post(server, "/collective_rpc", call)
        assert status == 200 and answer["results"] == [[name]], answer
    assert post(server, "/reset_prefix_cache", {})[0] == 200
    assert_matches("server after the update", served(server), after)
    save_file({"model.norm.weight": torch.zeros(5)}, tmp_path / "bad.safetensors")
    status, answer = post(server, "/collective_rpc", {"method": "attnres_update_weights_from_file",
                                                       "args": [str(tmp_path / "bad.safetensors")]})
    assert status >= 400 and "shape (5,), the checkpoint's is (64,)" in answer, (status, answer)
    assert_matches("server after a refused update", served(server), after)
