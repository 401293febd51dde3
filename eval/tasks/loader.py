"""Data loader of the task files in this folder (`custom_dataset: !function loader.NAME`).

lm-eval imports this file by its path and calls a loader with the run's metadata as keyword arguments
(`--metadata '{"data_dir": DIR}'` or `simple_evaluate(metadata=...)`, merged with the model's
arguments); `data_dir` is the folder `eval.data.ensure_data` made, or any folder with the same JSONL
files (the tests write small ones). Each loader returns the file as the task's `test` split.
"""

import json
from pathlib import Path


def _load(name: str, data_dir: str | None) -> "datasets.DatasetDict":  # noqa: F821 (imported below)
    import datasets

    if not data_dir:
        raise ValueError(f"no data_dir for {name}: pass --metadata '{{\"data_dir\": \"DIR\"}}' "
                         "(python -m eval.run does), DIR holding the files eval/data.py writes")
    path = Path(data_dir) / name
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def capitals_mc(data_dir: str | None = None, **_) -> "datasets.DatasetDict":  # noqa: F821
    """`capitals_mc.jsonl`: {id, country, choices, answer}."""
    return _load("capitals_mc.jsonl", data_dir)


def countries_gen(data_dir: str | None = None, **_) -> "datasets.DatasetDict":  # noqa: F821
    """`countries_gen.jsonl`: {id, capital, country}."""
    return _load("countries_gen.jsonl", data_dir)


def alice_ppl(data_dir: str | None = None, **_) -> "datasets.DatasetDict":  # noqa: F821
    """`alice_ppl.jsonl`: {id, text}."""
    return _load("alice_ppl.jsonl", data_dir)
