"""The training script on a tiny config: it learns, it is deterministic, and it resumes exactly."""

import json
import math
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


def test_optimizer_leaves_norms_embeddings_and_queries_undecayed_and_follows_the_schedule(tiny_corpus, tmp_path):
    """Weight decay spares norm gains, the embedding and the depth pseudo-queries (decay would pull a site back to
    uniform mixing); the learning rate warms up from lr / warmup to lr, then decays by a cosine to lr * min_lr_ratio."""
    args = train.parse_args(["--corpus-root", str(tiny_corpus), "--work-dir", str(tmp_path), *TRAIN_ARGS,
                             "--steps", "10", "--warmup", "4", "--min-lr-ratio", "0.1"])
    tok = train.prepare_data(args)[0]
    model = train.build_model(args, tok)
    optimizer, scheduler = train.build_optimizer(model, args)
    decayed = {id(p) for p in optimizer.param_groups[0]["params"]}
    names = {name for name, p in model.named_parameters() if id(p) not in decayed}
    groups = optimizer.param_groups
    assert groups[0]["weight_decay"] == args.weight_decay > 0 and groups[1]["weight_decay"] == 0
    assert any("_res_proj" in n for n in names) and any("embed_tokens" in n for n in names)
    assert all(p.ndim == 2 and "_res_proj" not in n and "embed_tokens" not in n
               for n, p in model.named_parameters() if id(p) in decayed)
    factor = scheduler.lr_lambdas[0]
    assert [factor(s) for s in range(5)] == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0])
    assert factor(10) == pytest.approx(0.1) and 0.1 < factor(7) < 1.0


def test_every_option_that_changes_the_run_is_checked_on_resume():
    """A checkpoint resumes only under the arguments that wrote it: every option but output paths, process
    settings, evaluation and logging is compared (a run resumed under another --seed would mix two runs)."""
    free = {"out", "overwrite", "work_dir", "eval_windows", "checkpoint_every", "stop_after", "no_resume", "threads",
            "save_dtype", "fsdp"}
    assert set(train.RESUME_KEYS) == set(vars(train.parse_args([]))) - free


def test_validation_windows_are_spread_over_the_whole_stream():
    """--eval-windows picks windows evenly from the first to the last (every held-out file contributes)."""
    val = torch.arange(10)[:, None].expand(10, 3)
    assert train.eval_windows(val, 4)[:, 0].tolist() == [0, 3, 6, 9]
    assert torch.equal(train.eval_windows(val, 20), val)


def test_a_training_step_clips_the_gradient_norm_to_one():
    """Gradient clipping 1.0 (docs/training.md): a huge gradient moves the weights by one lr-unit of SGD."""
    from types import SimpleNamespace

    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(4))

        def forward(self, input_ids, labels):
            return SimpleNamespace(loss=(1000.0 * self.w * torch.arange(1.0, 5.0)).sum())

    model = Toy()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    train.train_step(model, optimizer, scheduler, torch.zeros(1, 2, dtype=torch.long))
    assert model.w.detach().norm().item() == pytest.approx(1.0, rel=1e-4)


def test_a_vocabulary_without_room_for_the_special_tokens_and_bad_process_counts_are_refused(monkeypatch):
    """The 256 byte tokens plus the special tokens must fit; --fsdp needs several processes, and the global
    batch must split evenly over them."""
    with pytest.raises(SystemExit, match="--vocab-size 259 is below the 256 byte tokens plus 4 special tokens"):
        train.check_args(train.parse_args(["--vocab-size", "259"]))
    train.check_args(train.parse_args(["--vocab-size", "300"]))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="--fsdp shards over several processes"):
        train.check_args(train.parse_args(["--fsdp"]))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(SystemExit, match="--batch-size 8 .* must be a multiple of the 3 processes"):
        train.check_args(train.parse_args([]))


def test_the_token_cache_is_not_reused_for_another_window_length(tiny_corpus, tmp_path):
    """The work folder's cached windows are keyed by --seq-len (among others): a run with another length gets
    windows of its own length, not the cached ones."""
    common = ["--corpus-root", str(tiny_corpus), "--work-dir", str(tmp_path), *TRAIN_ARGS]
    assert train.prepare_data(train.parse_args(common))[1].shape[1] == 32
    _, windows, val, _ = train.prepare_data(train.parse_args([*common, "--seq-len", "16"]))
    assert windows.shape[1] == val.shape[1] == 16


def test_corpus_leaves_out_test_folders_and_splits_by_the_path_hash(tmp_path):
    """Test suites and IDLE are not corpus files; a file is held out when the first 4 bytes of sha256(path),
    as a number, are below the percentage modulo 100, and every document ends with the end-of-text token."""
    import hashlib

    for rel in ("a.py", "pkg/e.py", "test/b.py", "pkg/tests/c.py", "idlelib/d.py", "pkg/__pycache__/f.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x = 1\n")
    assert [rel for rel, _ in train.data.list_corpus_files(tmp_path)] == ["a.py", "pkg/e.py"]
    for i in range(300):
        rel = f"pkg/module_{i}.py"
        value = int.from_bytes(hashlib.sha256(rel.encode()).digest()[:4], "big") % 100
        assert train.data.is_validation(rel, 5) == (value < 5), rel
    tok = train.data.wrap_tokenizer(train.data.train_tokenizer(["def f():\n    return 1\n"] * 4, 300), 32)
    stream = train.data.encode_stream(tok, ["x = 1", "y = 2"]).tolist()
    eos = tok.convert_tokens_to_ids(train.data.EOS_TOKEN)
    assert stream.count(eos) == 2 and stream[-1] == eos and stream.index(eos) > 0


def test_each_epoch_has_an_order_of_its_own():
    """Epochs are concatenated, each a new permutation of the windows (not the first one repeated)."""
    order = torch.cat([train.data.batch_indices(s, 5, 10, seed=0) for s in range(4)])
    assert sorted(order[10:].tolist()) == list(range(10)) and not torch.equal(order[:10], order[10:])


def test_a_checkpoint_cut_short_leaves_the_previous_one(tmp_path, monkeypatch):
    """Checkpoints are written whole or not at all: a save that dies half-way keeps the last complete one."""
    path = tmp_path / "checkpoint.pt"
    train.atomic_save({"step": 4}, path)

    def dies_half_way(obj, f):
        Path(f).write_bytes(b"PK\x03\x04 half")
        raise OSError("disk full")
    monkeypatch.setattr(train.torch, "save", dies_half_way)
    with pytest.raises(OSError, match="disk full"):
        train.atomic_save({"step": 8}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"step": 4}


def test_compare_averages_the_last_window_of_steps_and_refuses_unequal_budgets():
    """The online loss is the mean of steps at-window+1..at exactly; the validation table gives each run's
    difference from the first row, and refuses runs trained on different numbers of tokens."""
    import compare

    def finished(arch, val_loss, tokens=1000):
        return {"arch": arch, "params": 1e6, "train_tokens": tokens, "val_loss": val_loss}
    runs = [{"arch": "block", "history": [float(i) for i in range(10)], "tokens_per_step": 100,
             "metrics": finished("block", 4.0)},
            {"arch": "llama", "history": [2.0 * i for i in range(12)], "tokens_per_step": 100,
             "metrics": finished("llama", 4.5)}]
    online = compare.online_table(runs, 3).splitlines()
    assert online[2] == f"| Block AttnRes | 1,000 | 8.0000 | {math.exp(8.0):.2f} |"
    assert online[3].startswith("| Llama baseline | 1,000 | 16.0000 |")
    assert compare.online_table(runs, 2, at=5).splitlines()[2].startswith("| Block AttnRes | 500 | 3.5000 |")
    table = compare.validation_table(runs).splitlines()
    assert table[2].endswith("| 4.0000 | 54.60 |  |") and table[3].endswith("| 4.5000 | 90.02 | +0.5000 |")
    runs[1]["metrics"] = finished("llama", 4.5, tokens=2000)
    with pytest.raises(SystemExit, match=r"different numbers of tokens \[1000, 2000\]"):
        compare.validation_table(runs)


@pytest.mark.parametrize("argv, message", [(["--window", "0"], "--window must be at least 1 step, got 0"),
                                           (["--window", "-3"], "--window must be at least 1 step, got -3"),
                                           (["--at", "0"], "--at must be a step >= 1, got 0")])
def test_compare_refuses_a_window_or_step_below_one_naming_it(argv, message, capsys):
    """A zero window divided by zero, a negative one averaged nothing, and `--at 0` silently meant the largest
    common step: each is refused before any run is read."""
    import compare

    with pytest.raises(SystemExit):
        compare.main(["no-such-run", *argv])
    assert message in capsys.readouterr().err


def test_the_reproduce_command_names_changed_options_and_bare_flags():
    """The card's command is the training command: changed options with their values, flags without one."""
    from model_card import command_line

    args = train.parse_args(["--arch", "full", "--steps", "5", "--fsdp", "--threads", "2", "--overwrite"])
    assert command_line(args, vars(train.parse_args([]))) == ".venv/bin/python examples/train.py --arch full " \
                                                             "--steps 5 --fsdp"


def test_the_exported_folder_keeps_the_saved_dtype_heldout_text_and_greedy_decoding(tiny_corpus, tmp_path):
    """--save-dtype is the weights' dtype on disk; heldout_sample.txt is the text the card's held-out loss was
    measured on (so a test can re-measure it); the generation config decodes greedily."""
    from model_card import HELDOUT_FILE
    from safetensors.torch import load_file

    out = tmp_path / "out"
    run(tiny_corpus, tmp_path / "work", "--steps", "2", "--out", str(out), "--save-dtype", "bfloat16")
    assert {t.dtype for t in load_file(out / "model.safetensors").values()} == {torch.bfloat16}
    validation = train.data.read_texts(tiny_corpus, 20)["validation"]
    assert (out / HELDOUT_FILE).read_text() == train.heldout_sample("\n".join(validation))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["do_sample"] is False
