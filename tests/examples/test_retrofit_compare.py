"""examples/retrofit_compare.py: the control folder it writes whole never takes a folder of other files."""

import json

import pytest
import retrofit_compare


def test_a_control_out_of_other_files_or_a_file_is_refused_before_any_work(tmp_path):
    notes = tmp_path / "results"
    (notes / "notes").mkdir(parents=True)
    (notes / "notes" / "paper.tex").write_text("precious")
    missing = ["--source", str(tmp_path / "no-source"), "--converted", str(tmp_path / "no-converted"),
               "--retrofitted", str(tmp_path / "no-retrofitted"), "--corpus", str(tmp_path / "no-corpus")]
    with pytest.raises(SystemExit, match="holds files that are not a control model written by this script"):
        retrofit_compare.main([*missing, "--control-out", str(notes)])
    assert (notes / "notes" / "paper.tex").read_text() == "precious"
    (tmp_path / "afile").write_text("kept")
    with pytest.raises(SystemExit, match="is a file; pass a folder"):
        retrofit_compare.main([*missing, "--control-out", str(tmp_path / "afile")])
    assert (tmp_path / "afile").read_text() == "kept"
    # a control this script wrote (control.json inside) or an empty folder passes the check (and the run then
    # stops at the first missing input, before any training)
    (tmp_path / "empty").mkdir()
    for ok in (tmp_path / "empty", tmp_path / "new"):
        with pytest.raises(FileNotFoundError):
            retrofit_compare.main([*missing, "--control-out", str(ok)])


def test_a_stored_control_is_reused_only_for_the_same_budget(tmp_path, monkeypatch):
    """A control trained earlier stands in only if it was trained on this budget (control lr included);
    otherwise it is trained again."""
    from types import SimpleNamespace

    out = tmp_path / "control"
    out.mkdir()
    (out / "config.json").write_text("{}")
    budget = {"steps": 4, "lr": 0.01, "seed": 0}
    (out / "control.json").write_text(json.dumps({"trained_parameters": 96, **budget}))
    monkeypatch.setattr(retrofit_compare, "AutoModelForCausalLM",
                        SimpleNamespace(from_pretrained=lambda *args, **kwargs: "stored control"))

    def trains_again(source):
        raise RuntimeError("trains the control again")
    monkeypatch.setattr(retrofit_compare, "load_source", trains_again)
    assert retrofit_compare.train_control(tmp_path / "src", None, None, budget, out) == ("stored control", 96)
    with pytest.raises(RuntimeError, match="trains the control again"):
        retrofit_compare.train_control(tmp_path / "src", None, None, {**budget, "lr": 0.02}, out)
