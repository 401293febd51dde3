"""The forward's inputs and outputs as every transformers causal LM keeps them (each check here was found
missing by changing the model and seeing every other test pass): the loss is next-token cross-entropy that
skips -100 labels and divides by `num_items_in_batch` under gradient accumulation, `logits_to_keep` keeps
only the last positions' logits, hidden states come back in the model's dtype, the pad token's embedding
is zero and untrained, `use_cache=False` returns no cache, and ambiguous inputs are refused by name."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from modeling_attnres import AttnResForCausalLM
from modeling_attnres.modeling_attnres import CACHE_NAME
from tests.support.models import tiny_config, tiny_model


def random_ids(batch: int = 2, tokens: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 97, (batch, tokens), generator=torch.Generator().manual_seed(seed))


def test_the_loss_is_next_token_cross_entropy_over_the_labels_kept():
    model = tiny_model(seed=3)
    ids = random_ids()
    labels = ids.clone()
    labels[0, :3] = -100                                      # a prompt left out of the loss
    with torch.no_grad():
        out = model(ids, labels=labels)
        vocab = model.config.vocab_size
        logits, targets = out.logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1)
        torch.testing.assert_close(out.loss, F.cross_entropy(logits, targets, ignore_index=-100))
        # gradient accumulation (Trainer): the summed loss over the tokens of the whole accumulated batch
        summed = F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        torch.testing.assert_close(model(ids, labels=labels, num_items_in_batch=3).loss, summed / 3)


def test_logits_to_keep_computes_only_the_last_positions():
    model = tiny_model(seed=3)
    ids = random_ids()
    with torch.no_grad():
        full, last = model(ids).logits, model(ids, logits_to_keep=1).logits
    assert last.shape == (2, 1, model.config.vocab_size)
    torch.testing.assert_close(last, full[:, -1:])


def test_hidden_states_come_back_in_the_models_dtype():
    model = tiny_model(seed=4, dtype=torch.bfloat16)
    with torch.no_grad():
        out = model(random_ids(), output_hidden_states=True)
    assert {h.dtype for h in out.hidden_states} == {torch.bfloat16}


def test_the_pad_tokens_embedding_is_zero_and_gets_no_gradient():
    model = AttnResForCausalLM(tiny_config())
    pad = model.config.pad_token_id
    embedding = model.model.embed_tokens
    assert embedding.padding_idx == pad and torch.count_nonzero(embedding.weight[pad]) == 0
    ids = torch.tensor([[pad, 5, 6, 7]])
    model(ids, labels=ids).loss.backward()
    assert torch.count_nonzero(embedding.weight.grad[pad]) == 0
    assert torch.count_nonzero(embedding.weight.grad[5]) > 0


def test_use_cache_false_returns_no_cache():
    model = tiny_model(seed=5)
    with torch.no_grad():
        assert getattr(model(random_ids(), use_cache=False), CACHE_NAME) is None
        assert getattr(model(random_ids(), use_cache=True), CACHE_NAME).get_seq_length() == 7


@pytest.mark.parametrize("given", ["both", "neither"])
def test_exactly_one_of_input_ids_and_inputs_embeds(given):
    model = tiny_model(seed=5)
    ids = random_ids()
    embeds = model.get_input_embeddings()(ids) if given == "both" else None
    with pytest.raises(ValueError, match="exactly one of input_ids or inputs_embeds"):
        model(input_ids=ids if given == "both" else None, inputs_embeds=embeds)


def test_empty_inputs_embeds_and_two_caches_are_refused_by_name():
    model = tiny_model(seed=5)
    with pytest.raises(ValueError, match=r"inputs_embeds has no tokens \(shape \(1, 0, 32\)\)"):
        model(inputs_embeds=torch.zeros(1, 0, 32))
    one, other = DynamicCache(config=model.config), DynamicCache(config=model.config)
    with pytest.raises(ValueError, match="Both cache and past_key_values were given, two different caches"):
        model(random_ids(), past_key_values=one, cache=other)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_output_attentions_returns_each_layers_attention_weights(qk_norm):
    """As every transformers causal LM: one `[batch, heads, seq, seq]` tensor per layer (Llama's attention, or
    Qwen3's with `qk_norm`), each row a causal distribution, through the LM head's output too."""
    model = tiny_model(seed=6, qk_norm=qk_norm)
    with torch.no_grad():
        attentions = model(random_ids(), output_attentions=True).attentions
    config = model.config
    assert attentions is not None and len(attentions) == config.num_hidden_layers
    for weights in attentions:
        assert weights.shape == (2, config.num_attention_heads, 7, 7)
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, config.num_attention_heads, 7))
        assert torch.count_nonzero(weights.triu(1)) == 0                                # causal


def test_the_configs_output_hidden_states_is_the_default():
    """`config.output_hidden_states=True` returns the hidden states without the argument, as for Llama; the
    argument still overrides it."""
    model = tiny_model(seed=6)
    model.config.output_hidden_states = True
    with torch.no_grad():
        assert len(model(random_ids()).hidden_states) == model.config.num_hidden_layers + 1
        assert model(random_ids(), output_hidden_states=False).hidden_states is None


def test_given_position_ids_are_the_ones_rotary_embeddings_use():
    """Position ids passed in (packed sequences, a custom offset) reach the attention: with zero pseudo-queries and
    eps = 0 the model is Llama, and stays Llama's twin under the same non-contiguous position ids."""
    config = tiny_config(rms_norm_eps=0.0, num_hidden_layers=2, attn_res_block_size=1)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).double().eval()
    llama_config = LlamaConfig(**{k: v for k, v in config.to_dict().items() if k in LlamaConfig().to_dict()
                                  and k not in ("model_type", "architectures", "auto_map")})
    llama = LlamaForCausalLM(llama_config).double().eval()
    llama.load_state_dict(model.state_dict(), strict=False)
    ids, positions = random_ids(1, 6), torch.tensor([[0, 1, 2, 0, 1, 2]])           # two packed sequences
    with torch.no_grad():
        ours = model(ids, position_ids=positions).logits
        torch.testing.assert_close(ours, llama(ids, position_ids=positions).logits, rtol=1e-6, atol=1e-6)
        assert not torch.allclose(ours, model(ids).logits, rtol=1e-4, atol=1e-4)
