"""The training script on a tiny config: it learns, it is deterministic, and it resumes exactly."""

from pathlib import Path

import pytest
import torch
import train
from transformers import AutoModelForCausalLM

from tests.support.training import TRAIN_ARGS


def run(tiny_corpus, work_dir, *extra):
    """Run the script in-process (no interpreter start-up) and return its metrics."""
    args = train.parse_args(["--corpus-root", str(tiny_corpus), "--work-dir", str(work_dir), *TRAIN_ARGS, *extra])
    train.check_args(args)
    return train.train(args)


def checkpoint(work_dir):
    return torch.load(work_dir / "checkpoint.pt", weights_only=False)


@pytest.mark.parametrize("arch", ["block", "full", "llama"])
def test_a_few_steps_lower_the_loss(tiny_corpus, tmp_path, arch):
    metrics = run(tiny_corpus, tmp_path, "--arch", arch, "--steps", "30")
    history = metrics["history"]
    assert len(history) == 30
    start, end = sum(history[:3]) / 3, sum(history[-3:]) / 3
    assert end < start - 0.5, f"{arch}: loss went from {start:.3f} to {end:.3f}"
    assert metrics["val_loss"] < metrics["uniform_loss"] - 0.5


def test_resume_continues_exactly_where_it_stopped(tiny_corpus, tmp_path):
    straight = run(tiny_corpus, tmp_path / "straight", "--steps", "10")
    first = run(tiny_corpus, tmp_path / "resumed", "--steps", "10", "--stop-after", "6")
    assert first["steps_done"] == 6 and "val_loss" not in first        # interrupted: no evaluation yet
    assert checkpoint(tmp_path / "resumed")["step"] == 6
    resumed = run(tiny_corpus, tmp_path / "resumed", "--steps", "10")
    assert resumed["history"] == straight["history"]                    # same batches, same losses
    assert resumed["val_loss"] == straight["val_loss"]
    a, b = checkpoint(tmp_path / "straight"), checkpoint(tmp_path / "resumed")
    assert a["step"] == b["step"] == 10
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name


def test_compare_prints_both_tables(tiny_corpus, tmp_path, capsys):
    import compare

    run(tiny_corpus, tmp_path / "done", "--steps", "8")
    run(tiny_corpus, tmp_path / "llama", "--arch", "llama", "--steps", "8", "--stop-after", "6")
    assert compare.main([str(tmp_path / "done"), str(tmp_path / "llama"), "--window", "4"]) == 0
    out = capsys.readouterr().out
    assert "| Block AttnRes | " in out.split("\n\n")[0] and "Llama" not in out.split("\n\n")[0]
    assert "online loss, steps 3-6" in out and "| Llama baseline | 768 |" in out
    with pytest.raises(SystemExit, match="does not exist"):
        compare.main([str(tmp_path / "missing")])
    with pytest.raises(SystemExit, match="share only 6 steps, fewer than --window 50; pass --window 6 or less"):
        compare.main([str(tmp_path / "done"), str(tmp_path / "llama")])


def test_resume_refuses_a_checkpoint_from_other_arguments(tiny_corpus, tmp_path):
    run(tiny_corpus, tmp_path, "--steps", "10", "--stop-after", "4")
    with pytest.raises(SystemExit, match="different arguments.*lr.*--no-resume"):
        run(tiny_corpus, tmp_path, "--steps", "10", "--lr", "5e-3")


def test_data_order_is_a_function_of_seed_and_step():
    a = train.data.batch_indices(7, 4, 10, seed=0)
    assert torch.equal(a, train.data.batch_indices(7, 4, 10, seed=0))
    assert not torch.equal(a, train.data.batch_indices(7, 4, 10, seed=1))
    epoch0 = torch.cat([train.data.batch_indices(s, 5, 10, seed=0) for s in range(2)])
    assert sorted(epoch0.tolist()) == list(range(10))                   # one epoch sees every window once


def test_split_is_deterministic_and_disjoint(tiny_corpus):
    files = train.data.list_corpus_files(tiny_corpus)
    assert files == sorted(files)
    val = [rel for rel, _ in files if train.data.is_validation(rel, 20)]
    assert val and len(val) < len(files)


def test_bad_arguments_name_the_value():
    args = train.parse_args(["--hidden-size", "30", "--heads", "4"])
    with pytest.raises(SystemExit, match="--hidden-size 30 must be a multiple of --heads 4"):
        train.check_args(args)
    with pytest.raises(SystemExit, match="corpus root /nonexistent/corpus is not a directory"):
        train.main(["--corpus-root", "/nonexistent/corpus", "--work-dir", "/nonexistent/work"])
    for option in ("--eval-windows", "--checkpoint-every", "--threads", "--block-size", "--kv-heads"):
        with pytest.raises(SystemExit, match=f"error: {option} must be >= 1, got 0"):  # not a crash after training
            train.check_args(train.parse_args([option, "0"]))
    with pytest.raises(SystemExit, match="--heads 4 must be a multiple of --kv-heads 3"):
        train.check_args(train.parse_args(["--kv-heads", "3"]))
    with pytest.raises(SystemExit, match="--validation-percent must be in 1..99, got 0"):
        train.check_args(train.parse_args(["--validation-percent", "0"]))


def test_the_model_card_describes_this_run(tiny_corpus, tmp_path):
    """The card of a run on another corpus names that corpus and this run's size, not the shipped model's."""
    run(tiny_corpus, tmp_path / "work", "--steps", "4", "--out", str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"trained from scratch on the `.py` files under `{tiny_corpus}`" in card
    assert "standard-library" not in card and "stdlib" not in card and "3M-token" not in card
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    params = sum(p.numel() for p in model.parameters())
    split = sum(len(text) for text in train.data.read_texts(tiny_corpus, 20)["train"])   # characters >= tokens
    assert f"Limitations: {params / 1e6:.2f}M parameters and " in card
    assert f"path = {str(tmp_path / 'out')!r}\n" in card and "shipped_model_path" not in card     # this run's folder
    epochs = float(card.split("Limitations: ")[1].split(" and ")[1].split(" epochs")[0])
    assert 4 * 4 * 32 / split <= epochs <= 4 * 4 * 32 / (split / 8)     # 4 steps of 4 x 32 tokens


def test_an_out_that_would_lose_data_is_refused_before_training(tiny_corpus, tmp_path, monkeypatch):
    """--out replaces its folder whole: a folder of other files, a file, the current folder, or a checkpoint
    without --overwrite is refused before any training, and left as it was."""
    def refused(out, *extra) -> str:
        with pytest.raises(SystemExit) as exited:
            run(tiny_corpus, tmp_path / "work", "--steps", "2", "--out", str(out), *extra)
        assert not (tmp_path / "work").exists(), "trained before refusing"
        return str(exited.value)

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "paper.tex").write_text("precious")
    assert "exists and is not empty; pass --overwrite" in refused(notes)
    assert "holds files that are not a checkpoint" in refused(notes, "--overwrite")
    assert (notes / "paper.tex").read_text() == "precious"
    (tmp_path / "afile").write_text("kept")
    assert "exists and is not a folder" in refused(tmp_path / "afile")
    assert (tmp_path / "afile").read_text() == "kept"
    monkeypatch.chdir(notes)
    assert "is the current folder" in refused(notes, "--overwrite")
    assert "overlaps --corpus-root" in refused(tiny_corpus / "model")
    monkeypatch.chdir(tmp_path)
    run(tiny_corpus, tmp_path / "w1", "--steps", "2", "--out", str(tmp_path / "out"))
    assert "pass --overwrite" in refused(tmp_path / "out")
    run(tiny_corpus, tmp_path / "w2", "--steps", "2", "--out", str(tmp_path / "out"), "--overwrite")  # a checkpoint
    card = (tmp_path / "out" / "README.md").read_text()
    assert "--overwrite" not in card and "--steps 2" in card, card


def test_a_bad_learning_rate_is_refused_naming_it():
    for value in ("-1", "0", "nan"):
        with pytest.raises(SystemExit, match=f"--lr must be a finite number > 0, got {float(value)}"):
            train.check_args(train.parse_args(["--lr", value]))


def test_a_window_longer_than_the_corpus_and_ctrl_c_end_in_one_line(tiny_corpus, tmp_path, monkeypatch, capsys):
    argv = ["--corpus-root", str(tiny_corpus), "--work-dir", str(tmp_path / "work"), *TRAIN_ARGS]
    with pytest.raises(SystemExit, match=r"error: a token stream of \d+ tokens is shorter than one window of "
                                         r"--seq-len 1000000; lower --seq-len"):
        train.main([*argv, "--seq-len", "1000000"])

    def interrupted(args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train, "train", interrupted)
    capsys.readouterr()
    assert train.main(argv) == 130
    assert capsys.readouterr().err.strip() == "error: interrupted; no checkpoint was saved yet."
    (tmp_path / "work").mkdir(exist_ok=True)
    (tmp_path / "work" / "checkpoint.pt").write_bytes(b"")
    assert train.main(argv) == 130
    assert capsys.readouterr().err.strip() == (f"error: interrupted; run the same command to continue from the last "
                                               f"checkpoint in {tmp_path / 'work'}.")


def test_model_card_does_not_import_the_training_script():
    import ast

    tree = ast.parse((Path(train.__file__).parent / "model_card.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "train" not in imported, "examples/model_card.py imports examples/train.py back (an import cycle)"
