"""attnres-retrofit's objective and choice of model (attnres.conversion.distill): the KL term is the KL
divergence, distillation keeps the trained model nearer its start, the best evaluated checkpoint is
the one kept, a run that only hurts leaves the model as it was, and training and held-out windows
start where paragraphs start."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.conversion import retrofit
from attnres.conversion.distill import heldout_loss, kl_to_teacher, no_worse, paragraph_windows
from attnres.models import shipped_model_path
from modeling_attnres.configuration_attnres import is_depth_parameter
from tests.support.models import tiny_model
from tests.support.training import RETROFIT_ARGS, write_corpus, write_zeroed


@pytest.fixture(scope="module")
def zeroed(tmp_path_factory) -> Path:
    return write_zeroed(tmp_path_factory.mktemp("zeroed"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def run(model: Path, corpus: Path, work: Path, *extra) -> dict:
    args = retrofit.parse_args([str(model), str(corpus), "--work-dir", str(work), "--out", str(work / "out"),
                                *RETROFIT_ARGS, *extra])
    return retrofit.retrofit(args)


def naive_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """sum_v p_t(v) (log p_t(v) - log p_s(v)), averaged over positions, in float64."""
    p = teacher.double().softmax(-1)
    return (p * (p.log() - student.double().softmax(-1).log())).sum(-1).mean()


@pytest.mark.timeout(60)
def test_kl_term_is_the_kl_divergence():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 11) * 3, torch.randn(2, 5, 11) * 3
    torch.testing.assert_close(kl_to_teacher(student, teacher).double(), naive_kl(student, teacher),
                               rtol=1e-5, atol=1e-6)
    assert kl_to_teacher(teacher, teacher).abs() < 1e-6
    assert kl_to_teacher(student, teacher) > 0.1


@pytest.mark.timeout(60)
def test_heldout_loss_is_the_language_model_loss_per_predicted_token():
    """The held-out loss reported before and after training is transformers' own LM loss on the same windows
    (nats per predicted token: a window of n tokens predicts n - 1), whatever the evaluation batch."""
    model = tiny_model()
    windows = torch.randint(0, model.config.vocab_size, (3, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=windows, labels=windows).loss.item()
    assert heldout_loss(model, windows) == pytest.approx(want, rel=1e-5)
    assert heldout_loss(model, windows, batch_size=2) == pytest.approx(want, rel=1e-5)


def test_a_trained_model_is_kept_only_when_no_worse_on_both_measures():
    """Better long windows do not buy worse paragraph starts, nor the other way round: either keeps the start."""
    before = {"loss": 2.0, "short_loss": 3.0}
    assert no_worse({"loss": 1.5, "short_loss": 2.5}, before)
    assert no_worse(dict(before), before)
    assert not no_worse({"loss": 1.5, "short_loss": 3.5}, before)
    assert not no_worse({"loss": 2.5, "short_loss": 2.5}, before)


@pytest.mark.timeout(60)
def test_windows_start_where_paragraphs_start():
    tok = AutoTokenizer.from_pretrained(shipped_model_path())
    paragraphs = ["def alpha(x):\n    return x + 1", "class Beta:\n    pass", "x", "gamma = [1, 2, 3]\nprint(gamma)"]
    text = "\n\n".join(paragraphs[:2]) + "\n  \n\n" + "\n\n".join(paragraphs[2:])
    own = [tok(p + "\n\n", add_special_tokens=False)["input_ids"] for p in paragraphs]
    assert [len(ids) for ids in own] == [13, 8, 2, 19]
    ids = sum(own, [])
    # "x" (2 tokens) starts no window; a window from the last paragraph would run past the end.
    windows = paragraph_windows(tok, [text], length=20, min_tokens=3)
    assert windows.tolist() == [ids[0:20], ids[13:33]]
    assert paragraph_windows(tok, ["one paragraph only"], length=64).shape == (0, 64)


def kl_from(start: Path, trained: Path, windows: torch.Tensor) -> float:
    """KL(start || trained) per token on `windows`, by the two models' own forward passes."""
    models = [AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (start, trained)]
    with torch.no_grad():
        a, b = (m(input_ids=windows).logits for m in models)
    return naive_kl(b, a).item()


@pytest.mark.timeout(600)
def test_distillation_stays_nearer_the_start_and_the_best_checkpoint_is_kept(zeroed, corpus, tmp_path):
    steps = ["--steps", "8", "--save-every", "4"]
    plain = run(zeroed, corpus, tmp_path / "plain", *steps, "--kl-weight", "0")
    distilled = run(zeroed, corpus, tmp_path / "kl", *steps, "--kl-weight", "5")
    tok = AutoTokenizer.from_pretrained(zeroed)
    texts = retrofit.read_corpus(corpus, ("*.py",), 20)
    windows = retrofit.token_windows(tok, texts["validation"], 32, "held-out")[:16]
    kl_plain, kl_distilled = (kl_from(zeroed, tmp_path / name / "out", windows) for name in ("plain", "kl"))
    assert kl_distilled < 0.75 * kl_plain, (kl_distilled, kl_plain)     # measured 1.19 vs 2.01
    assert plain["heldout_loss_after"] < plain["heldout_loss_before"]

    # The model kept is the evaluated checkpoint with the lowest held-out sum, long + short windows.
    for name, metrics in (("plain", plain), ("kl", distilled)):
        state = json.loads((tmp_path / name / "checkpoint-8" / "trainer_state.json").read_text())
        evals = {log["step"]: log["eval_heldout"] for log in state["log_history"] if "eval_heldout" in log}
        assert sorted(evals) == [4, 8]
        best = min(evals, key=evals.get)
        assert metrics["kept"] == "best checkpoint" and metrics["best_step"] == best, (evals, metrics)
        kept = metrics["heldout_loss_after"] + metrics["heldout_short_loss_after"]
        assert kept == pytest.approx(evals[best], abs=1e-5)


@pytest.mark.timeout(300)
def test_a_run_that_only_hurts_leaves_the_model_as_it_was(corpus, tmp_path, capsys):
    start = shutil.copytree(shipped_model_path(), tmp_path / "trained")   # depth attention already trained
    metrics = run(start, corpus, tmp_path / "work", "--steps", "4", "--save-every", "2", "--lr", "30",
                  "--kl-weight", "0", "--export-depth", str(tmp_path / "depth.safetensors"))
    assert metrics["kept"] == "start" and metrics["best_step"] == 0
    assert metrics["heldout_loss_after"] == metrics["heldout_loss_before"]
    assert "keeping the starting model" in capsys.readouterr().err
    original = load_file(start / "model.safetensors")
    exported = load_file(tmp_path / "depth.safetensors")
    assert sorted(exported) == sorted(n for n in original if is_depth_parameter(n))
    for name, tensor in load_file(tmp_path / "work" / "out" / "model.safetensors").items():
        assert torch.equal(tensor, original[name]), name
        if name in exported:
            assert torch.equal(exported[name], original[name].float()), name


@pytest.mark.timeout(60)
def test_bad_objective_options_are_refused(zeroed, corpus, capsys):
    for option, value, message in (("--kl-weight", "-1", "--kl-weight must be a finite number >= 0, got -1.0"),
                                   ("--kl-weight", "nan", "--kl-weight must be a finite number >= 0, got nan"),
                                   ("--short-tokens", "1", "--short-tokens must be in 2..--seq-len (128), got 1")):
        assert retrofit.main([str(zeroed), str(corpus), option, value]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"attnres-retrofit: error: {message}"
