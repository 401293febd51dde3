"""`make eval`: SmolLM2-135M-Instruct as its source Llama, as the exact AttnRes conversion and as the shipped
retrofitted default, evaluated with EleutherAI's lm-evaluation-harness on local tasks.

- `sources`: the registry packages the task data is read out of, pinned by version and sha256;
- `data`: the items of each task, made from those packages into the cache directory;
- `tasks/`: the lm-eval task files (`lm_eval --include_path eval/tasks`) and their data loader;
- `report`: the side-by-side table, the per-item shifts and the verdict;
- `run` (`python -m eval.run`): builds everything, runs lm-eval and prints the table.

See docs/evaluation.md.
"""
