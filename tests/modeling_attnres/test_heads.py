"""The task heads Llama has (sequence and token classification, extractive QA), on AttnRes's base model."""

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from modeling_attnres import (
    AttnResForQuestionAnswering,
    AttnResForSequenceClassification,
    AttnResForTokenClassification,
    AttnResModel,
)
from tests.support.models import randomize_depth_parameters, tiny_config, tiny_model

HEADS = [(AutoModelForSequenceClassification, AttnResForSequenceClassification),
         (AutoModelForTokenClassification, AttnResForTokenClassification),
         (AutoModelForQuestionAnswering, AttnResForQuestionAnswering)]


def head(cls, seed: int, **overrides):
    torch.manual_seed(seed)
    config = tiny_config(num_labels=3, **overrides)
    config._attn_implementation = "eager"
    model = cls(config).eval()
    randomize_depth_parameters(model, seed)
    return model


@pytest.mark.parametrize("auto, cls", HEADS)
def test_a_causal_lm_checkpoint_loads_into_each_head_with_its_base_weights(tmp_path, auto, cls):
    lm = tiny_model(seed=40)
    lm.save_pretrained(tmp_path)
    model = auto.from_pretrained(tmp_path, num_labels=3, attn_implementation="eager").eval()
    assert type(model) is cls and isinstance(model.model, AttnResModel)
    base = lm.model.state_dict()
    assert {k: v for k, v in model.model.state_dict().items()}.keys() == base.keys()
    assert all(torch.equal(v, base[k]) for k, v in model.model.state_dict().items())
    ids = torch.randint(3, 97, (2, 6))
    with torch.no_grad():
        torch.testing.assert_close(model.model(ids).last_hidden_state, lm.model(ids).last_hidden_state,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_sequence_classification_reads_each_sequences_last_real_token(side):
    """A padded batch gives each sequence the logits it gets alone: the head pools the last non-padding token."""
    model = head(AttnResForSequenceClassification, seed=41)
    lengths, width, pad = (4, 7, 2), 7, model.config.pad_token_id
    prompts = [torch.randint(3, 97, (n,)) for n in lengths]
    ids = torch.full((len(lengths), width), pad)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        where = slice(width - len(prompt), width) if side == "left" else slice(0, len(prompt))
        ids[row, where], mask[row, where] = prompt, 1
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits                                 # [3, num_labels]
        alone = torch.cat([model(p[None]).logits for p in prompts])
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])


def test_sequence_classification_trains_the_pseudo_queries():
    model = head(AttnResForSequenceClassification, seed=42).train()
    ids, labels = torch.randint(3, 97, (4, 6)), torch.tensor([0, 2, 1, 2])
    out = model(ids, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if n.endswith("_res_proj.weight")}
    assert len(grads) == 2 * model.config.num_hidden_layers + 1
    first = "model.layers.0.self_attention_res_proj.weight"    # one source (the embedding): its weight is 1
    assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if n != first)


def test_token_classification_scores_every_token():
    model = head(AttnResForTokenClassification, seed=43)
    ids, labels = torch.randint(3, 97, (2, 5)), torch.randint(0, 3, (2, 5))
    with torch.no_grad():
        out = model(ids, labels=labels)
        hidden = model.model(ids).last_hidden_state
    assert out.logits.shape == (2, 5, 3)
    torch.testing.assert_close(out.logits, model.score(hidden))
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits.reshape(-1, 3), labels.reshape(-1)))


def test_question_answering_gives_span_logits_and_their_loss():
    model = head(AttnResForQuestionAnswering, seed=44)
    ids = torch.randint(3, 97, (2, 6))
    start, end = torch.tensor([1, 2]), torch.tensor([3, 5])
    with torch.no_grad():
        out = model(ids, start_positions=start, end_positions=end)
        logits = model.qa_outputs(model.model(ids).last_hidden_state)
    torch.testing.assert_close(out.start_logits, logits[..., 0])
    torch.testing.assert_close(out.end_logits, logits[..., 1])
    expected = (F.cross_entropy(out.start_logits, start) + F.cross_entropy(out.end_logits, end)) / 2
    torch.testing.assert_close(out.loss, expected)


def test_a_head_saves_and_reloads_exactly(tmp_path):
    model = head(AttnResForSequenceClassification, seed=45)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = torch.randint(3, 97, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)
