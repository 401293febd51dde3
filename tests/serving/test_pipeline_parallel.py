"""Pipeline parallelism 2 on CPU (two ranks, one core each): greedy tokens equal transformers' and
one rank's, top-5 logprobs within the parity rule (`tests.support.parity`), for Block AttnRes with the stage
boundary on and off a block boundary (`VLLM_PP_LAYER_PARTITION`), Full AttnRes with tied embeddings
behind a compiled `attnres-serve` OpenAI server, and vLLM's own Mixtral as the control. The engines run
once per session in one subprocess (`tests.support.multirank`); the references are computed here."""

from types import SimpleNamespace

import pytest
import torch

from tests.support.multirank import TEST_TIMEOUT, outputs, reference
from tests.support.parity import LOGPROB_ATOL, assert_matches


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("name", ["block-pp2-on", "block-pp2-off", "full-pp2-server"])
def test_pipeline_parallel_2_matches_transformers(multirank, name):
    """The control first: vLLM's own Mixtral at PP=2 equals transformers' Mixtral."""
    results, paths = multirank
    assert_matches("mixtral-pp2", outputs(results, "mixtral-pp2"), reference(paths["mixtral"], "mixtral"))
    checkpoint = "full" if name.startswith("full") else "block"
    assert_matches(name, outputs(results, name), reference(paths[checkpoint]))


@pytest.mark.timeout(TEST_TIMEOUT)
@pytest.mark.parametrize("name", ["block-pp2-on", "block-pp2-off"])
def test_pipeline_parallel_2_equals_one_rank(multirank, name):
    """The same engine code on one rank: same tokens, logprobs equal to float32 rounding."""
    results, _ = multirank
    one_rank = outputs(results, "block-1rank")
    for i, ((tokens, top), (want_tokens, want_top)) in enumerate(zip(outputs(results, name), one_rank)):
        assert tokens == want_tokens, f"{name}, prompt {i}: {tokens} != one rank's {want_tokens}"
        for step, (lps, want) in enumerate(zip(top, want_top)):
            for token in lps.keys() & want.keys():
                assert abs(lps[token] - want[token]) <= LOGPROB_ATOL, (name, i, step, token)


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_weight_update_reaches_both_pipeline_stages(multirank):
    """Tensors of both stages (layers 0-2 and 3-4), the embedding and the head, one per call into the
    running PP=2 engine (`attnres.serving.weights`): the engine then equals transformers on the updated
    checkpoint."""
    results, paths = multirank
    assert_matches("block-pp2-off-updated", outputs(results, "block-pp2-off-updated"),
                   reference(paths["block-updated"]))


@pytest.mark.parametrize("mode, start_layer, stored, bank, sources_dtype", [
    ("block", 2, 1, "float32", torch.float32), ("block", 3, 2, "float32", torch.float32),
    ("full", 2, 4, "float32", torch.float32), ("block", 3, 2, "auto", torch.bfloat16)])
def test_stage_receive_buffer_shapes_and_dtypes(mode, start_layer, stored, bank, sources_dtype):
    """The buffer a later stage receives into (vLLM copies into it: its dtype wins). For a bfloat16
    model the partial and the inverse RMS stay float32 and the sources keep the bank's dtype
    (`attn_res_bank_dtype`: float32, or bfloat16 for "auto"): nothing is rounded at a stage boundary.
    `stored` is counted from the spec by hand: Block (blocks of 2 layers) stores the embedding at
    layer 0 and a block at layer 2; Full stores the embedding and every sublayer output but the last
    (still the partial)."""
    from attnres.serving.model import AttnResModel
    from modeling_attnres import AttnResConfig

    config = AttnResConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=5,
                           num_attention_heads=2, num_key_value_heads=1, attn_res_mode=mode, attn_res_block_size=2,
                           attn_res_bank_dtype=bank)
    stage = SimpleNamespace(config=config, start_layer=start_layer)
    stage.start_depth = lambda embeds: AttnResModel.start_depth(stage, embeds)
    buffer = AttnResModel.make_empty_intermediate_tensors(stage, 4, torch.bfloat16, torch.device("cpu"))
    assert {k: (tuple(v.shape), v.dtype) for k, v in buffer.tensors.items()} == {
        "bank_sources": ((4, stored, 8), sources_dtype),
        "bank_inv_rms": ((4, stored), torch.float32),
        "partial": ((4, 8), torch.float32),
    }


def test_depth_history_round_trips_a_stage_boundary_and_is_stored_in_place_after_it():
    """`pack_depth` sends the written rows only, contiguous; `unpack_depth` puts them in a bank with
    room for the rest of the schedule, so the next stage's blocks are written in place (no `torch.cat`
    copy of the earlier ones); a stage with nothing left to store uses the received tensors as they are."""
    from attnres.serving.model import pack_depth, unpack_depth
    from modeling_attnres.depth_attention import empty_bank, push_source

    torch.manual_seed(0)
    partial = torch.randn(3, 8)
    with torch.inference_mode():
        bank = empty_bank(partial, 5, torch.bfloat16)
        for _ in range(2):
            bank = push_source(bank, torch.randn(3, 8), 1e-6)
        sent = pack_depth(bank, partial)
        assert all(t.is_contiguous() for t in sent.tensors.values())
        assert sent["bank_sources"].shape == (3, 2, 8) and torch.equal(sent["bank_sources"], bank.sources)
        received, received_partial = unpack_depth(sent, capacity=5)
        assert received.num_stored == 2 and received.storage.shape == (3, 5, 8)
        assert torch.equal(received.sources, bank.sources) and torch.equal(received.inv_rms, bank.inv_rms)
        assert torch.equal(received_partial, partial)
        storage = received.storage
        pushed = push_source(received, torch.randn(3, 8), 1e-6)
        assert pushed.storage is storage and pushed.num_stored == 3            # in place
        one_left, _ = unpack_depth(sent, capacity=3)                           # room for the last source only
        assert one_left.storage.shape == (3, 3, 8)
        assert push_source(one_left, torch.randn(3, 8), 1e-6).storage is one_left.storage
        full, _ = unpack_depth(sent, capacity=2)
        assert full.storage is sent["bank_sources"] and full.num_stored == 2
