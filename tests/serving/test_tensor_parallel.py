"""Tensor parallelism 2 on CPU (two ranks, one core each): greedy tokens equal transformers' and one
rank's, top-5 logprobs within 1e-3 plus test_parity's float32 allowance. The engine runs with the
pipeline-parallel ones in one subprocess per session (`multirank.py`); the reference is computed here.
The checkpoint has 4 attention and 2 KV heads: TP=2 needs head counts divisible by 2."""

import pytest

from tests.serving import multirank
from tests.serving.test_pipeline_parallel import TIMEOUT, engines, outputs  # noqa: F401 (a fixture)

# Each rank sums half of every o_proj / down_proj reduction: float32 rounding differs by ~2e-4.
TP_ATOL = 1e-3


@pytest.mark.timeout(TIMEOUT)
def test_tensor_parallel_2_matches_transformers_and_one_rank(engines):  # noqa: F811
    _, paths = engines
    got = outputs(engines, "block-tp2")
    multirank.assert_matches("block-tp2", got, multirank.reference(paths["block"]), TP_ATOL)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in outputs(engines, "block-1rank")]
