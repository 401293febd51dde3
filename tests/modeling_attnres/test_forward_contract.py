"""The forward's inputs and outputs as every transformers causal LM keeps them (each check here was found
missing by changing the model and seeing every other test pass): the loss is next-token cross-entropy that
skips -100 labels and divides by `num_items_in_batch` under gradient accumulation, `logits_to_keep` keeps
only the last positions' logits, hidden states come back in the model's dtype, the pad token's embedding
is zero and untrained, `use_cache=False` returns no cache, and ambiguous inputs are refused by name."""

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

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
