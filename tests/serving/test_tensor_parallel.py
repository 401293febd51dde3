"""Tensor parallelism 2 on CPU (two ranks, one core each): greedy tokens equal transformers' and one
rank's, top-5 logprobs within 1e-3 plus the parity rule's float32 allowance. The engine runs with the
pipeline-parallel ones in one subprocess per session (`tests.support.multirank`); the reference is
computed here. The checkpoint has 4 attention and 2 KV heads: TP=2 needs head counts divisible by 2."""

import pytest

from tests.support.multirank import TEST_TIMEOUT, outputs, reference
from tests.support.parity import assert_matches

# Each rank sums half of every o_proj / down_proj reduction: float32 rounding differs by ~2e-4.
TP_ATOL = 1e-3


@pytest.mark.timeout(TEST_TIMEOUT)
def test_tensor_parallel_2_matches_transformers_and_one_rank(multirank):
    results, paths = multirank
    got = outputs(results, "block-tp2")
    assert_matches("block-tp2", got, reference(paths["block"]), TP_ATOL)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in outputs(results, "block-1rank")]


@pytest.mark.timeout(TEST_TIMEOUT)
def test_a_weight_update_reaches_every_tensor_parallel_shard(multirank):
    """A fused part (k of q/k/v), gate of gate/up, a norm, a pseudo-query, the embedding and the head, one
    per call into the running TP=2 engine: every shard is updated (and the rest of each fused module kept,
    read back from both ranks)."""
    results, paths = multirank
    assert_matches("block-tp2-updated", outputs(results, "block-tp2-updated"), reference(paths["block-updated"]),
                   TP_ATOL)
