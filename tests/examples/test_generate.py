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
