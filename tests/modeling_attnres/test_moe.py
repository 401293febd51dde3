"""Mixture-of-experts AttnRes in transformers: the config fields, the checkpoint layout (one tensor per
expert on disk, transformers' 3D expert tensors in memory), and the behaviour a Llama-style model must
keep: cached decoding, left padding, save/load, remote code, gradient checkpointing, the Trainer and
the router outputs. (Parity with transformers' own Qwen2/Qwen3-MoE and Mixtral: tests/conversion/test_moe.py.)"""

import os
import subprocess
import sys

import pytest
import torch
from huggingface_hub.errors import StrictDataclassClassValidationError
from safetensors import safe_open
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from modeling_attnres import AttnResConfig, AttnResForCausalLM
from modeling_attnres.modeling_attnres import AttnResSharedExpertMoeBlock, AttnResSparseMoeBlock
from tests.support.models import LOAD_WITHOUT_PACKAGE, tiny_config, tiny_model

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1])
SHARED = dict(MOE, shared_expert_intermediate_size=24)


def moe_model(seed: int, **overrides) -> AttnResForCausalLM:
    """A tiny MoE AttnRes model with distinct routing (router weights large enough that no top-k is a tie)."""
    model = tiny_model(seed=seed, **{**MOE, **overrides})
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.copy_(torch.randn(param.shape, generator=gen))
    return model


def test_dense_is_the_default_and_sparse_layers_follow_qwens_rule():
    assert AttnResConfig().num_experts == 0 and AttnResConfig().sparse_layers == []
    config = tiny_config(num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert config.sparse_layers == [1] and config.moe_intermediate_size == config.intermediate_size
    model = AttnResForCausalLM(tiny_config(**SHARED))
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["AttnResSharedExpertMoeBlock", "AttnResMLP", *["AttnResSharedExpertMoeBlock"] * 3]
    assert isinstance(AttnResForCausalLM(tiny_config(**MOE)).model.layers[0].mlp, AttnResSparseMoeBlock)
    assert isinstance(model.model.layers[0].mlp, AttnResSharedExpertMoeBlock)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok (5) must be at most num_experts (4)"),
    (dict(num_experts=4, moe_intermediate_size=0), "moe_intermediate_size must be a positive integer, got 0"),
    (dict(num_experts=-1), "num_experts must be a positive integer or 0 for a dense model, got -1"),
    (dict(num_experts=4, mlp_only_layers=[7]), "mlp_only_layers names layers [7] outside 0..4; list dense layers"),
    (dict(num_experts=4, shared_expert_intermediate_size=-1), "shared_expert_intermediate_size must be >= 0"),
    (dict(num_experts=4, router_aux_loss_coef=float("nan")),
     "router_aux_loss_coef must be a finite number >= 0, got nan; 0 turns"),
    (dict(num_experts=4, decoder_sparse_step=9), "but no layer is sparse"),
])
def test_invalid_expert_fields_raise_at_construction(overrides, fragment):
    with pytest.raises(StrictDataclassClassValidationError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value)


def test_checkpoints_store_one_tensor_per_expert_and_reload_exactly(tmp_path):
    model = moe_model(seed=1, **SHARED)
    model.save_pretrained(tmp_path / "a")
    with safe_open(tmp_path / "a" / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    layer = "model.layers.0.mlp"
    assert {f"{layer}.gate.weight", f"{layer}.shared_expert_gate.weight", f"{layer}.shared_expert.up_proj.weight",
            *(f"{layer}.experts.{e}.{p}_proj.weight" for e in range(4) for p in ("gate", "up", "down"))} <= keys
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in keys)
    assert "model.layers.1.mlp.gate_proj.weight" in keys                       # the dense layer
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", attn_implementation="eager").eval()
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "b")                                     # a reload saves the same layout
    with safe_open(tmp_path / "b" / "model.safetensors", "pt") as f:
        assert set(f.keys()) == keys


@pytest.mark.parametrize("overrides", [MOE, SHARED])
def test_cached_greedy_generation_equals_full_recomputation(overrides):
    model = moe_model(seed=2, **overrides)
    ids = torch.randint(3, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=10, do_sample=False, min_new_tokens=10)
        seq = ids
        for _ in range(10):
            logits = model(seq, use_cache=False).logits[:, -1]
            logits[:, model.config.eos_token_id] = -float("inf")       # as min_new_tokens makes generate() do
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, seq)


def test_left_padded_batch_matches_each_prompt_alone():
    model = moe_model(seed=3)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 97, (n,), generator=gen) for n in (3, 7, 5)]
    width = max(len(p) for p in prompts)
    ids, mask = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        for i, p in enumerate(prompts):
            assert torch.equal(batched[i, width:], model.generate(p[None], **kwargs)[0, len(p):]), f"prompt {i}"


def test_router_logits_and_the_aux_loss_as_qwen3_moe_returns_them():
    model = moe_model(seed=4)
    ids = torch.randint(3, 97, (2, 5))
    out = model(ids, labels=ids, output_router_logits=True)
    plain = model(ids, labels=ids)
    assert len(out.router_logits) == len(model.config.sparse_layers) == 4
    assert all(r.shape == (10, 4) for r in out.router_logits)
    assert out.aux_loss is not None and plain.aux_loss is None and plain.router_logits is None
    torch.testing.assert_close(out.loss, plain.loss + model.config.router_aux_loss_coef * out.aux_loss)
    assert tiny_model(seed=4)(ids, output_router_logits=True).aux_loss is None        # dense: nothing to balance


def test_the_aux_loss_leaves_the_pads_out_and_a_fresh_router_is_random():
    """As Qwen3-MoE: a left-padded batch's load-balancing loss counts only its real tokens (the attention
    mask is passed on); a fresh model's routers start from `initializer_range` noise, not zeros (every token
    would tie and go to the same experts)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = moe_model(seed=6)
    ids, mask = torch.randint(3, 97, (2, 6)), torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, output_router_logits=True)
    config = model.config
    torch.testing.assert_close(out.aux_loss, load_balancing_loss_func(out.router_logits, config.num_experts,
                                                                      config.num_experts_per_tok, mask))
    unmasked = load_balancing_loss_func(out.router_logits, config.num_experts, config.num_experts_per_tok, None)
    assert not torch.allclose(out.aux_loss, unmasked)
    fresh = AttnResForCausalLM(tiny_config(**MOE, initializer_range=0.02))
    routers = [p for n, p in fresh.named_parameters() if n.endswith("mlp.gate.weight")]
    assert routers and all(0.015 < float(p.std()) < 0.025 for p in routers), [float(p.std()) for p in routers]


# Reentrant checkpointing runs the first forward without autograd, so router logits captured there carry no
# gradient: the auxiliary loss trains nothing under it, as in transformers' own Qwen3-MoE. Its rows drop it.
@pytest.mark.parametrize("use_reentrant, router_logits", [(False, True), (True, False)])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant, router_logits):
    ids = torch.randint(3, 97, (2, 8))

    def grads(checkpointing):
        model = moe_model(seed=5, **SHARED).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        model(ids, labels=ids, output_router_logits=router_logits).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, checkpointed = grads(False), grads(True)
    assert plain.keys() == checkpointed.keys() and any("experts" in n for n in plain)
    assert any(".layers.0." in n for n in plain)                       # the depth history reaches layer 0
    for name in plain:
        torch.testing.assert_close(plain[name], checkpointed[name], rtol=0, atol=0, msg=name)   # bit for bit


def test_trainer_trains_experts_routers_and_pseudo_queries(tmp_path):
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=3, **{**MOE, "mlp_only_layers": []},
                                           output_router_logits=True))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.tensor([[(i + t) % 7 + 3 for t in range(16)] for i in range(32)])
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, max_steps=20,
                             learning_rate=3e-3, logging_steps=5, report_to=[], use_cpu=True, seed=0,
                             save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert losses[-1] < 0.8 * losses[0], losses
    for part in ("experts.gate_up_proj", "mlp.gate.weight", "mlp_res_proj"):
        moved = [n for n, p in model.named_parameters() if part in n and not torch.equal(p, before[n])]
        assert moved, f"nothing named {part} was trained"


def test_remote_code_loads_an_moe_checkpoint_without_the_package(tmp_path):
    model = moe_model(seed=6, **SHARED)
    model.save_pretrained(tmp_path / "ckpt")
    ids = torch.randint(3, 97, (2, 5))
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    done = subprocess.run([sys.executable, "-c", LOAD_WITHOUT_PACKAGE, str(tmp_path / "ckpt"), str(tmp_path / "ids.pt"),
                           str(tmp_path / "logits.pt"), str(torch.get_num_threads())],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with torch.no_grad():
        torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("overrides, fragment", [
    (dict(num_experts=4, mlp_only_layers=[5]), "mlp_only_layers names layers [5] outside 0..4"),   # 5 layers: 0..4
    (dict(num_experts=4, mlp_only_layers=[-1]), "mlp_only_layers names layers [-1] outside 0..4"),
    (dict(num_experts=4, router_aux_loss_coef=-0.01), "router_aux_loss_coef must be a finite number >= 0, got -0.01"),
])
def test_expert_fields_just_outside_their_range_are_refused(overrides, fragment):
    """The edges of each range: a layer index one past the last (or negative, which Python would read from the
    end) names no layer, and a negative aux-loss coefficient would reward unbalanced routing."""
    with pytest.raises(StrictDataclassClassValidationError) as err:
        tiny_config(**overrides)
    assert fragment in str(err.value)


def test_every_token_may_be_routed_to_every_expert():
    """`num_experts_per_tok == num_experts` is valid (the bound is "at most"): the model builds and runs."""
    model = tiny_model(seed=5, **{**MOE, "num_experts_per_tok": 4})
    with torch.no_grad():
        assert model(torch.randint(3, 97, (1, 4))).logits.isfinite().all()


def test_a_fresh_models_experts_and_routers_start_from_the_configs_initializer_range():
    """A model built from a config (to train from scratch) draws its experts' and routers' weights from
    normal(0, initializer_range), as Qwen3-MoE does: zero experts would make every sparse MLP output zero, and
    another scale than the config's would train another model."""
    torch.manual_seed(7)
    model = AttnResForCausalLM(tiny_config(**MOE, initializer_range=0.2))
    for kind in ("experts.gate_up_proj", "experts.down_proj", "gate.weight"):
        values = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith(f".mlp.{kind}")])
        assert values.numel() >= 4 * 4 * 32, kind                                     # every sparse layer's
        assert abs(values.mean().item()) < 0.02 and abs(values.std().item() - 0.2) < 0.02, kind


def test_the_configs_output_router_logits_is_the_default():
    """`output_router_logits=True` in the config returns the router logits and adds the aux loss without the
    argument, as Qwen3-MoE does (a training script sets it once in the config); the argument overrides it."""
    model = moe_model(seed=8, output_router_logits=True)
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        out, plain = model(ids, labels=ids), model(ids, labels=ids, output_router_logits=False)
    assert out.aux_loss is not None and len(out.router_logits) == len(model.config.sparse_layers)
    assert plain.aux_loss is None
    torch.testing.assert_close(out.loss, plain.loss + model.config.router_aux_loss_coef * out.aux_loss)
