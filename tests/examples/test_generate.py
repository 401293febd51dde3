"""examples/generate.py (`make demo`): the shipped model continues the prompt; bad options end in one line."""

import generate
import pytest


def test_the_demo_prints_the_prompt_and_its_greedy_continuation(capsys):
    assert generate.main(["--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr().out
    prompt = generate.DEFAULT_PROMPT
    assert printed.startswith(prompt) and printed[len(prompt):].strip(), printed
    assert generate.main(["--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out == printed                                          # greedy: the same again


@pytest.mark.parametrize("argv, message", [(["--prompt", ""], "--prompt is empty"),
                                           (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1, got 0"),
                                           (["--model", "/nonexistent"], "is not a checkpoint folder")])
def test_bad_options_end_in_one_line_naming_them(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        generate.main(argv)
    said = str(exited.value) if isinstance(exited.value.code, str) else capsys.readouterr().err
    assert message in said, said


def test_sampling_is_seeded_and_only_the_continuation_comes_back(shipped):
    """`--sample --seed N` gives the same text whatever ran before; `complete` returns the new tokens only (the
    demo prints the prompt itself)."""
    import torch

    model, tokenizer = shipped
    prompt = "import os\n"
    torch.manual_seed(1)
    first = generate.complete(model, tokenizer, prompt, 6, sample=True, seed=3)
    torch.manual_seed(2)
    assert generate.complete(model, tokenizer, prompt, 6, sample=True, seed=3) == first
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert generate.complete(model, tokenizer, prompt, 6) == tokenizer.decode(out[0, ids.shape[1]:],
                                                                            skip_special_tokens=True)
