"""The transformers model against the naive spec implementation in tests/oracle.py."""

import pytest
import torch

from tests.oracle import naive_forward
from tests.support.models import oracle_state_dict, tiny_model

CASES = {
    "block1": dict(attn_res_block_size=1),
    "block2_partial_last": dict(attn_res_block_size=2, num_hidden_layers=5),
    "block3_partial_last": dict(attn_res_block_size=3, num_hidden_layers=5),
    "block_larger_than_depth": dict(attn_res_block_size=8, num_hidden_layers=3),
    "full": dict(attn_res_mode="full", num_hidden_layers=4),
    "gqa_qknorm_bias": dict(num_attention_heads=4, num_key_value_heads=1, qk_norm=True, attention_bias=True),
    "tied": dict(tie_word_embeddings=True, attn_res_block_size=2),
    "mha_head_dim": dict(num_key_value_heads=4, head_dim=16),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_oracle_float64(case):
    model = tiny_model(seed=3, dtype=torch.float64, **CASES[case])
    ids = torch.randint(3, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    expected = naive_forward(oracle_state_dict(model, model.dtype), model.config, ids)
    torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)  # RoPE tables are float32 in Llama


@pytest.mark.parametrize("case", ["block2_partial_last", "full"])
def test_logits_match_oracle_float32(case):
    model = tiny_model(seed=4, dtype=torch.float32, **CASES[case])
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    sd64 = oracle_state_dict(model)
    expected = naive_forward(sd64, model.config, ids)
    torch.testing.assert_close(logits.double(), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["block2_partial_last", "full"])
def test_depth_attention_weights_match_oracle(case):
    model = tiny_model(seed=5, dtype=torch.float64, **CASES[case])
    ids = torch.randint(3, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model(ids, output_depth_attentions=True)
    _, expected = naive_forward(oracle_state_dict(model), model.config, ids, return_weights=True)
    L = model.config.num_hidden_layers
    assert len(out.depth_attentions) == 2 * L + 1
    for got, want in zip(out.depth_attentions, expected):
        torch.testing.assert_close(got, want.movedim(0, -1), rtol=1e-6, atol=1e-6)  # RoPE tables are float32 in Llama
    assert out.depth_attentions[-1].shape[-1] == model.config.num_depth_sources
