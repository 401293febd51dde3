"""transformers behaviour of AttnResForCausalLM: contract, Llama parity, caching, padding, backends."""

import copy
import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

from modeling_attnres import AttnResConfig, AttnResForCausalLM, AttnResModel, depth_attention_cpu
from tests.support.models import randomize_depth_parameters, tiny_config, tiny_model


def spec_parameter_names(num_layers, attention_bias=False, qk_norm=False, tied=False):
    """The parameter-name contract of docs/spec.md, spelled out independently."""
    names = ["model.embed_tokens.weight", "model.output_attn_res_proj.weight",
             "model.output_attn_res_norm.weight", "model.norm.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}"
        for proj in "qkvo":
            names.append(f"{p}.self_attn.{proj}_proj.weight")
            if attention_bias:
                names.append(f"{p}.self_attn.{proj}_proj.bias")
        if qk_norm:
            names += [f"{p}.self_attn.q_norm.weight", f"{p}.self_attn.k_norm.weight"]
        names += [f"{p}.mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
        names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
        names += [f"{p}.self_attention_res_proj.weight", f"{p}.self_attention_res_norm.weight",
                  f"{p}.mlp_res_proj.weight", f"{p}.mlp_res_norm.weight"]
    if not tied:
        names.append("lm_head.weight")
    return sorted(names)


@pytest.mark.parametrize("overrides", [{}, dict(attention_bias=True, qk_norm=True), dict(tie_word_embeddings=True)])
def test_parameter_names_are_the_spec_contract(tmp_path, overrides):
    model = tiny_model(**overrides)
    model.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        saved = sorted(f.keys())
    expected = spec_parameter_names(model.config.num_hidden_layers, overrides.get("attention_bias", False),
                                    overrides.get("qk_norm", False), overrides.get("tie_word_embeddings", False))
    assert saved == expected
    d = model.config.hidden_size
    sd = model.state_dict()
    assert sd["model.layers.0.self_attention_res_proj.weight"].shape == (1, d)
    assert sd["model.output_attn_res_norm.weight"].shape == (d,)


def test_fresh_model_has_zero_queries_and_unit_gains():
    model = AttnResForCausalLM(tiny_config())
    for name, param in model.named_parameters():
        if "_res_proj" in name:
            assert torch.count_nonzero(param) == 0, name
        if "_res_norm" in name:
            assert torch.all(param == 1), name


def llama_twin(eps):
    """An AttnRes model with zero queries and a LlamaForCausalLM with the same weights."""
    config = tiny_config(rms_norm_eps=eps, num_hidden_layers=4, attn_res_block_size=1)
    torch.manual_seed(0)
    attnres = AttnResForCausalLM(config).double().eval()
    llama_cfg = LlamaConfig(**{k: v for k, v in config.to_dict().items()
                               if k not in ("qk_norm", "attn_res_mode", "attn_res_block_size", "model_type",
                                            "architectures", "auto_map")})
    llama = LlamaForCausalLM(llama_cfg).double().eval()
    missing, unexpected = llama.load_state_dict(attnres.state_dict(), strict=False)
    assert not missing and all("_res_" in k for k in unexpected)
    return attnres, llama


def test_zero_queries_equal_llama_when_eps_is_zero():
    """With uniform mixing, AttnRes is the standard residual stream up to RMSNorm's eps (spec).

    Llama's RMSNorm computes in float32 even for float64 models, so equality holds to float32
    rounding; the control with a large eps shows the comparison does see the eps effect."""
    ids = torch.randint(3, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    attnres, llama = llama_twin(eps=0.0)
    with torch.no_grad():
        torch.testing.assert_close(attnres(ids).logits, llama(ids).logits, rtol=1e-6, atol=1e-6)
    attnres, llama = llama_twin(eps=1e-3)
    with torch.no_grad():
        assert (attnres(ids).logits - llama(ids).logits).abs().max() > 1e-4


@pytest.mark.parametrize("overrides", [dict(attn_res_block_size=2), dict(attn_res_mode="full", num_hidden_layers=3),
                                       dict(attn_res_block_size=3, qk_norm=True)])
def test_cached_greedy_generation_equals_full_recomputation(overrides):
    model = tiny_model(seed=1, **overrides)
    ids = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cached = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        seq = ids
        for _ in range(12):
            nxt = model(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
    assert torch.equal(cached, seq)


@pytest.mark.timeout(300)
def test_continuous_batching_generates_what_generate_does():
    """`generate_batch` (transformers' continuous batching, as `transformers serve --continuous-batching` runs
    it) hands its paged cache to the attention as `cache=`; taken for the KV cache it failed every request."""
    from transformers import GenerationConfig

    model = tiny_model(seed=3, attn_res_block_size=2)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen).tolist() for n in (6, 3, 9)]
    config = GenerationConfig(max_new_tokens=8, min_new_tokens=8, do_sample=False, eos_token_id=1, pad_token_id=0)
    with torch.no_grad():
        results = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
        expected = [model.generate(torch.tensor([p]), generation_config=config)[0, len(p):].tolist() for p in prompts]
    got = [results[key] for key in sorted(results, key=lambda k: int(k.rsplit("_", 1)[1]))]
    assert [r.error for r in got] == [None] * 3
    assert [r.generated_tokens for r in got] == expected


def test_decode_step_logits_equal_full_forward():
    model = tiny_model(seed=2, attn_res_block_size=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids).logits
        cache = DynamicCache(config=model.config)
        prefix = model(ids[:, :7], past_key_values=cache, use_cache=True).logits
        steps = [model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(7, 10)]
    torch.testing.assert_close(torch.cat([prefix, *steps], 1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_holds_only_attention_keys_and_values():
    """Depth attention is per token: the cache holds exactly Llama's K/V, nothing of the block bank."""
    model = tiny_model(seed=3, attn_res_block_size=1)
    cfg = model.config
    ids = torch.randint(3, cfg.vocab_size, (2, 5))
    with torch.no_grad():
        out = model(ids, use_cache=True)
    cache = out.past_key_values
    assert len(cache.layers) == cfg.num_hidden_layers
    for layer in cache.layers:
        assert layer.keys.shape == (2, cfg.num_key_value_heads, 5, cfg.head_dim)
        assert layer.values.shape == (2, cfg.num_key_value_heads, 5, cfg.head_dim)
    # No module state either: buffers are only RoPE's, no module keeps a tensor as a plain attribute
    # after a forward pass, and a model that has seen other inputs (with their own block banks) gives
    # the same logits as a fresh copy that has seen nothing.
    assert {name.split(".")[-1] for name, _ in model.named_buffers()} <= {"inv_freq", "original_inv_freq"}
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        model(torch.randint(3, cfg.vocab_size, (3, 9)), use_cache=True)
        for module in model.modules():
            kept = [k for k, v in vars(module).items() if isinstance(v, (torch.Tensor, tuple)) and k not in
                    ("_parameters", "_buffers") and any(isinstance(t, torch.Tensor) for t in _flatten(v))]
            assert not kept, f"{type(module).__name__} keeps tensors between calls: {kept}"
        torch.testing.assert_close(model(ids).logits, fresh(ids).logits, rtol=0, atol=0)


def _flatten(value):
    return [t for item in value for t in _flatten(item)] if isinstance(value, tuple) else [value]


def left_padded(model, seed):
    """Three prompts alone and as one left-padded batch `(ids, mask)`, padded with token 1 (token 0, the
    config's pad token, has a zero embedding, which with eps = 0 makes Llama's own RMSNorm NaN at the pads)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=gen) for n in (3, 7, 5)]
    width = max(len(p) for p in prompts)
    ids = torch.ones(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = 1
    return prompts, ids, mask


# sdpa gives a fully masked query (a left pad) a zero attention output: with eps = 0 a partial that starts
# from it has a zero norm, which must score 0, not 0 * inf (NaN that attention then spreads to real tokens).
@pytest.mark.parametrize("attn_implementation, eps", [("eager", 1e-6), ("sdpa", 0.0)])
def test_left_padded_batch_matches_each_prompt_alone(attn_implementation, eps):
    model = tiny_model(seed=4, attn_res_block_size=2, attn_implementation=attn_implementation, rms_norm_eps=eps)
    prompts, ids, mask = left_padded(model, seed=4)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        assert model(ids, attention_mask=mask).logits.isfinite().all()
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], **kwargs)
            assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(p):]), f"prompt {i}"


def test_a_left_padded_batch_trains_with_eps_zero_under_sdpa():
    """The training path (the torch reference, with autograd) gives the pads' zero partials a zero score
    with a finite gradient: the loss and every gradient are finite, and the real tokens' logits are each prompt's."""
    model = tiny_model(seed=6, attn_res_block_size=2, attn_implementation="sdpa", rms_norm_eps=0.0).train()
    prompts, ids, mask = left_padded(model, seed=6)
    out = model(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    out.loss.backward()
    assert out.loss.isfinite() and all(p.grad.isfinite().all() for p in model.parameters() if p.grad is not None)
    with torch.no_grad():
        for i, p in enumerate(prompts):
            torch.testing.assert_close(out.logits[i, -len(p):], model(p[None]).logits[0], rtol=1e-5, atol=1e-5)


def test_eager_and_sdpa_agree():
    eager = tiny_model(seed=5, attn_implementation="eager")
    sdpa = tiny_model(seed=5, attn_implementation="sdpa")
    ids = torch.randint(3, eager.config.vocab_size, (2, 8))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    with torch.no_grad():
        a, b = eager(ids, attention_mask=mask).logits, sdpa(ids, attention_mask=mask).logits
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[0, 3:], b[0, 3:], rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_is_exact(tmp_path):
    model = tiny_model(seed=6, attn_res_mode="full", num_hidden_layers=3, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert isinstance(loaded, AttnResForCausalLM)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, model.config.vocab_size, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert isinstance(AutoModel.from_pretrained(tmp_path), AttnResModel)


@pytest.mark.parametrize("edit", [dict(attn_res_block_size=4), dict(attn_res_block_size=1),
                                  dict(attn_res_mode="full")])
def test_a_depth_schedule_edited_after_building_is_refused_on_save(tmp_path, edit):
    """The layers fix the schedule when they are built: saved, the edited config would load as another model."""
    model = tiny_model(seed=4, attn_res_block_size=2, num_hidden_layers=4)
    for field, value in edit.items():
        setattr(model.config, field, value)
    built = r"this model was built with \(attn_res_mode='block', attn_res_block_size=2\).*Restore those values"
    for saved in (model, model.model):
        with pytest.raises(ValueError, match=built):
            saved.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    model.config.attn_res_mode, model.config.attn_res_block_size = "block", 2
    model.save_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "config.json").exists()


def test_missing_depth_parameters_are_initialised_not_garbage(tmp_path):
    """from_pretrained builds on meta and only initialises what the checkpoint lacks: check those."""
    from safetensors.torch import load_file, save_file

    model = tiny_model(seed=7)
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    save_file({k: v for k, v in sd.items() if "_res_" not in k}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, param in loaded.named_parameters():
        if "_res_proj" in name:
            assert torch.count_nonzero(param) == 0, name
        elif "_res_norm" in name:
            assert torch.all(param == 1), name
    rotary = loaded.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq, model.model.rotary_emb.inv_freq)


def test_gradients_reach_every_pseudo_query_and_norm():
    model = tiny_model(seed=8, attn_res_mode="block", attn_res_block_size=2).train()
    ids = torch.randint(3, model.config.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None, name                    # no unused parameters (DDP-safe)
        if "_res_" in name and not name.startswith("model.layers.0.self_attention_res_"):
            assert torch.count_nonzero(param.grad) > 0, name
    # The first site mixes the embedding alone: its weight is exactly 1, its gradient exactly 0.
    assert torch.count_nonzero(model.model.layers[0].self_attention_res_proj.weight.grad) == 0


def test_gradients_flow_from_zero_init():
    """At initialisation (zero queries) the queries still get a gradient: training can start."""
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=3, attn_res_mode="full")).train()
    ids = torch.randint(3, model.config.vocab_size, (2, 8))
    model(ids, labels=ids).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if "_res_proj" in n}
    assert all(g is not None for g in grads.values())
    nonzero = {n for n, g in grads.items() if torch.count_nonzero(g) > 0}
    assert set(grads) - nonzero == {"model.layers.0.self_attention_res_proj.weight"}   # mixes one source


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant):
    """Bit for bit, as for Llama: a reentrant checkpoint's first forward runs without autograd, where the
    C++ kernel would otherwise apply, and the values it hands on must be those the replay differentiates."""
    ids = torch.randint(3, 97, (2, 8))

    def grads(checkpointing):
        model = tiny_model(seed=9, attn_res_block_size=2).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss, {n: p.grad.clone() for n, p in model.named_parameters()}

    loss_a, grads_a = grads(False)
    loss_b, grads_b = grads(True)
    assert torch.equal(loss_a, loss_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=0, atol=0, msg=name)


def test_hidden_states_and_depth_attentions_outputs():
    model = tiny_model(seed=10, num_hidden_layers=5, attn_res_block_size=2)
    ids = torch.randint(3, model.config.vocab_size, (2, 4))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_depth_attentions=True)
    assert len(out.hidden_states) == 6
    assert all(h.shape == (2, 4, 32) for h in out.hidden_states)
    counts = [w.shape[-1] for w in out.depth_attentions]
    assert counts == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4]      # emb | +block 1 (layers 0-1) | +block 2 | partial
    for w in out.depth_attentions:
        torch.testing.assert_close(w.sum(-1), torch.ones(2, 4))


@pytest.mark.parametrize("mode", ["block", "full"])
def test_hidden_states_are_the_residual_stream(mode):
    """`hidden_states[0]` is the embedding, entry l + 1 the stream after layer l (the embedding plus every
    sublayer output so far: what a standard residual stream holds, summed here from the sublayers' own outputs
    caught by hooks), the last the final norm's output (as Llama's)."""
    model = tiny_model(seed=10, num_hidden_layers=5, attn_res_block_size=2, attn_res_mode=mode)
    randomize_depth_parameters(model, seed=3)
    outputs = []
    for layer in model.model.layers:
        for sublayer in (layer.self_attn, layer.mlp):
            sublayer.register_forward_hook(lambda m, args, out: outputs.append(out[0] if isinstance(out, tuple)
                                                                               else out))
    ids = torch.randint(3, model.config.vocab_size, (2, 4))
    with torch.no_grad():
        out = model.model(ids, output_hidden_states=True)
        embedding = model.model.embed_tokens(ids)
    assert len(out.hidden_states) == 6 and len(outputs) == 10
    assert torch.equal(out.hidden_states[0], embedding)
    stream = embedding.double()
    for l in range(4):
        stream = stream + outputs[2 * l].double() + outputs[2 * l + 1].double()
        torch.testing.assert_close(out.hidden_states[l + 1].double(), stream, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.hidden_states[-1], out.last_hidden_state)


@pytest.mark.timeout(600)
def test_static_cache_generation_with_torch_compile():
    """Static cache, then the forward compiled by Inductor as one graph (transformers only compiles on
    its own on GPUs, so the compile is explicit); a counting backend proves Inductor really ran."""
    from torch._inductor.compile_fx import compile_fx

    # 3 layers (a completed block of 2, then a partial one): Inductor's cold compile grows with the layers
    model = tiny_model(seed=11, attn_implementation="sdpa", num_hidden_layers=3)
    ids = torch.randint(3, model.config.vocab_size, (1, 5))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False)
    graphs = []

    def inductor(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        dynamic = model.generate(ids, **kwargs)
        static = model.generate(ids, cache_implementation="static", **kwargs)
        model.forward = torch.compile(model.forward, backend=inductor, fullgraph=True)
        compiled = model.generate(ids, cache_implementation="static", **kwargs)
    assert graphs, "torch.compile never handed a graph to Inductor"
    assert torch.equal(dynamic, static)
    assert torch.equal(dynamic, compiled)


@pytest.mark.parametrize("ids, fragment", [
    ([[5, 97]], "token id 97, outside the vocabulary [0, 97)"),
    ([[-1, 5]], "token id -1, outside the vocabulary [0, 97)"),
    ([[]], "input_ids has no tokens (shape (1, 0))"),
    (torch.zeros(0, 3), "input_ids has no tokens (shape (0, 3))"),
])
def test_bad_input_ids_get_a_clear_error(ids, fragment):
    model = tiny_model(seed=1)
    with pytest.raises(ValueError) as err:
        model(torch.as_tensor(ids, dtype=torch.long))
    assert fragment in str(err.value)


def test_token_ids_are_checked_against_the_embedding_in_use():
    """An embedding set with `set_input_embeddings` (no `resize_token_embeddings`, so the config still says
    97) takes ids up to its own size, as Llama's does; past it, the error names that size."""
    model = tiny_model(seed=1)
    model.set_input_embeddings(torch.nn.Embedding(128, model.config.hidden_size))
    assert model(torch.tensor([[5, 120]])).logits.shape == (1, 2, 97)
    with pytest.raises(ValueError, match=r"token id 128, outside the vocabulary \[0, 128\)"):
        model(torch.tensor([[128]]))
    assert "AttnResPseudoQuery(32)" in repr(model.model.layers[0])


def test_config_that_disagrees_with_weights_fails_at_load_naming_the_tensor(tmp_path):
    tiny_model(seed=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["intermediate_size"] = 48                                    # the weights have 64
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as err:
        AutoModelForCausalLM.from_pretrained(tmp_path)
    message = str(err.value)
    assert "model.layers.0.mlp.gate_proj.weight: checkpoint (64, 32), config implies (48, 32)" in message
    assert "intermediate_size=48" in message and "15 tensors" in message
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, ignore_mismatched_sizes=True)
    assert loaded.model.layers[0].mlp.gate_proj.weight.shape == (48, 32)


def test_a_size_mismatch_raises_what_llamas_raises_too(tmp_path):
    """Code written for transformers catches Llama's size mismatch as a RuntimeError: AttnRes's more precise
    error is one too (and a ValueError), from the folder check and from the check after loading alike."""
    llama = LlamaForCausalLM(LlamaConfig(**{k: getattr(tiny_config(), k) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads")}))
    llama.save_pretrained(tmp_path / "llama")
    tiny_model(seed=2).save_pretrained(tmp_path / "attnres")
    with pytest.raises(RuntimeError) as llamas:
        AutoModelForCausalLM.from_pretrained(tmp_path / "llama", intermediate_size=48)
    with pytest.raises(type(llamas.value)) as err:                      # found after loading
        AutoModelForCausalLM.from_pretrained(tmp_path / "attnres", intermediate_size=48)
    assert isinstance(err.value, ValueError) and "config implies (48, 32)" in str(err.value)
    config = json.loads((tmp_path / "attnres" / "config.json").read_text())
    for wrong, message in (({"intermediate_size": 48}, "config implies"),   # found in the folder, before
                           ({"num_hidden_layers": 3}, "layers but its config.json says num_hidden_layers=3")):
        (tmp_path / "attnres" / "config.json").write_text(json.dumps({**config, **wrong}))
        with pytest.raises(RuntimeError, match=message):
            AutoModelForCausalLM.from_pretrained(tmp_path / "attnres")


def test_resize_token_embeddings_keeps_tied_head():
    model = tiny_model(seed=12, tie_word_embeddings=True)
    model.resize_token_embeddings(120)
    assert model.lm_head.weight.shape == (120, 32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model(torch.randint(0, 120, (1, 4))).logits.shape == (1, 4, 120)


def test_device_map_loading(tmp_path):
    tiny_model(seed=13).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert model(torch.randint(3, 97, (1, 4))).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_disk_offloaded_layers_generate_as_in_memory(tmp_path, cpu_kernel, monkeypatch):
    """accelerate's offloading puts a module's weights in place only around its own forward; the boundaries
    read the pseudo-queries' and norms' weights without calling them, so the layers fire their hooks."""
    monkeypatch.setattr(depth_attention_cpu, "_enabled", cpu_kernel and depth_attention_cpu._enabled)
    model = tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2)
    model.save_pretrained(tmp_path / "model")
    ids = torch.randint(3, 97, (2, 6))
    generate = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = model.generate(ids, **generate)
    on_disk = ["model.layers.1", "model.layers.2", "model.norm", "model.output_attn_res_proj",
               "model.output_attn_res_norm"]
    device_map = {name: "cpu" for name in ("model.embed_tokens", "model.layers.0", "model.rotary_emb", "lm_head")}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map | dict.fromkeys(
        on_disk, "disk"), offload_folder=tmp_path / "offload")
    assert offloaded.model.layers[1].mlp_res_proj.weight.device.type == "meta"        # offloaded indeed
    with torch.no_grad():
        assert torch.equal(offloaded.generate(ids, **generate), expected)
        compiled = torch.compile(offloaded.forward, backend="eager")      # the hooks also fire in a graph
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)


def test_compiled_forward_is_not_guarded_on_offloading_hooks():
    """The layers fire accelerate's hooks in eager code only: traced by Dynamo, their lookups of `_hf_hook`
    became guards (one per weight holder and layer) that every compiled step checks before it runs."""
    model = tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2)
    guards = []

    def record(entries):
        guards.extend(str(entry.orig_guard) for entry in entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True, options={"guard_filter_fn": record})
    with torch.no_grad():
        compiled(torch.randint(3, 97, (1, 5)))
    assert guards, "Dynamo installed no guards: the forward was not traced"
    assert [guard for guard in guards if "_hf_hook" in guard] == []
    assert any("mlp_res_proj" in guard for guard in guards)     # the holders themselves are still traced


def test_a_graph_compiled_before_offloading_runs_the_hooks_after_it():
    """The graph skips the hooks where no weight holder has one, without a guard on that; offloading moves
    the weights the graph guards on, so the next call retraces with the hooks."""
    from accelerate import cpu_offload

    model = tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2)
    ids = torch.randint(3, 97, (1, 5))
    torch._dynamo.reset()
    compiled = torch.compile(model.forward, backend="eager")
    with torch.no_grad():
        expected = compiled(ids).logits
        cpu_offload(model, execution_device="cpu")
        assert model.model.layers[1].mlp_res_proj.weight.device.type == "meta"       # offloaded indeed
        torch.testing.assert_close(compiled(ids).logits, expected)


def test_peft_adapters_on_the_pseudo_queries_are_refused_unless_they_are_copies():
    """PEFT's `target_parameters` LoRA and LN tuning change a weight only inside its module's call, which the
    boundaries never make (they read the weight): refused by name. `modules_to_save` copies are read and trained."""
    from peft import LNTuningConfig, LoraConfig, get_peft_model

    ids = torch.randint(3, 97, (2, 6))
    lora = get_peft_model(tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2),
                          LoraConfig(r=1, target_modules=[], target_parameters=["mlp_res_proj.weight"]))
    with pytest.raises(ValueError, match=r"mlp_res_proj is wrapped by ParamWrapper.*modules_to_save"):
        lora(input_ids=ids)
    ln_tuning = get_peft_model(tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2),
                               LNTuningConfig(target_modules=["input_layernorm", "post_attention_layernorm"]))
    with pytest.raises(ValueError, match=r"input_layernorm is wrapped by LNTuningLayer.*To fine-tune "
                                         r"input_layernorm, list it in PEFT's modules_to_save"):
        ln_tuning(input_ids=ids)
    copies = get_peft_model(tiny_model(seed=13, num_hidden_layers=3, attn_res_block_size=2),
                            LoraConfig(r=1, target_modules=["q_proj"], modules_to_save=["mlp_res_proj"]))
    copies(input_ids=ids, labels=ids).loss.backward()
    trained = [p for n, p in copies.named_parameters() if "mlp_res_proj.modules_to_save" in n]
    assert trained and all(p.grad is not None and p.grad.abs().sum() > 0 for p in trained)


def test_generate_refuses_depth_attentions_saying_how_to_get_them():
    model = tiny_model(seed=13)
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(ValueError, match=r"generate\(\) does not return depth attentions.*forward pass"):
        model.generate(ids, max_new_tokens=2, do_sample=False, output_depth_attentions=True)
    with pytest.raises(ValueError, match="not used by the model"):      # any other unknown argument as before
        model.generate(ids, max_new_tokens=2, do_sample=False, output_depth_attention=True)


def test_seed_names_load_and_resave_with_the_spec_names(tmp_path):
    """The spec: the seed pseudo-code's `attn_res_proj` / `attn_res_norm` are accepted on load."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    model = tiny_model(seed=14)
    model.save_pretrained(tmp_path / "seed")
    sd = load_file(tmp_path / "seed" / "model.safetensors")
    seed_sd = {k.replace("self_attention_res_", "attn_res_"): v for k, v in sd.items()}
    assert any(".attn_res_proj." in k for k in seed_sd)
    save_file(seed_sd, tmp_path / "seed" / "model.safetensors", metadata={"format": "pt"})
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "seed", attn_implementation="eager")
    ids = torch.randint(3, 97, (1, 6))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
    loaded.save_pretrained(tmp_path / "resaved")
    with safe_open(tmp_path / "resaved" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(sd)


def test_a_config_claiming_more_rows_than_the_weights_is_refused_before_allocating(tmp_path):
    """2**30 vocabulary rows in config.json over a 97-row checkpoint: refused from the safetensors
    headers, in a child whose address space (4 GiB) the embedding alone (128 GiB) would exceed."""
    tiny_model(seed=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["vocab_size"] = 2 ** 30
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = ("import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))\n"
            "import modeling_attnres\nfrom transformers import AutoModelForCausalLM\n"
            "try:\n    AutoModelForCausalLM.from_pretrained(sys.argv[1])\n"
            "except ValueError as err:\n    print(err)\n    sys.exit(3)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-3000:]
    assert "model.embed_tokens.weight: checkpoint (97, 32), config implies (1073741824, 32)" in done.stdout


def test_a_config_with_another_layer_count_is_refused_at_load(tmp_path):
    tiny_model(seed=2).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers"] = 4000
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has 5 layers but its config.json says num_hidden_layers=4000"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_a_full_attnres_model_edited_to_blocks_names_its_own_schedule_on_save(tmp_path):
    """The refusal names the schedule the model was built with, so that the user can restore it: here Full
    AttnRes, not a block size. Editing only attn_res_block_size, which Full AttnRes never reads, changes nothing."""
    model = tiny_model(seed=4, attn_res_mode="full", num_hidden_layers=3)
    model.config.attn_res_mode = "block"
    with pytest.raises(ValueError, match=r"attn_res_block_size=2 is not the depth-attention schedule this model was "
                                         r"built with \(attn_res_mode='full'\)"):
        model.save_pretrained(tmp_path / "out")
    model.config.attn_res_mode, model.config.attn_res_block_size = "full", 3
    model.save_pretrained(tmp_path / "out")
    assert AttnResConfig.from_pretrained(tmp_path / "out").attn_res_block_size == 3


def test_device_map_auto_keeps_each_decoder_layer_on_one_device(tmp_path):
    """A layer's boundaries read its norms' and pseudo-queries' weights beside calling its attention and MLP:
    `device_map="auto"` places a decoder layer whole (`_no_split_modules`, as Llama's), and the model it builds
    (here partly offloaded to disk) computes what the model in memory does."""
    model = tiny_model(seed=15)
    model.save_pretrained(tmp_path / "model")
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map="auto",
                                                     max_memory={"cpu": 90_000}, offload_folder=tmp_path / "offload")
    placed = offloaded.hf_device_map
    assert "cpu" in placed.values() and "disk" in placed.values()
    assert [name for name in placed if name.startswith("model.layers.") and name.count(".") > 2] == []
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(offloaded(ids).logits, model(ids).logits)
