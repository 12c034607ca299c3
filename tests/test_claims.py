"""The claims table (``depthsat experiment claims``): generated from the committed results.

* rendering a constructed set of summaries gives the hand-written markdown below (full and compact);
* malformed rows raise an error naming the result folder;
* the adapters, on the committed summaries, give the verdicts (and numbers) of the hand-written
  claims table that stood in experiments/README.md before it was generated (typed here from that
  table, not from the code);
* ``--check`` passes on the repository (the committed tables are current: a drift test) and fails,
  writing nothing, on an edited table; without ``--check`` the edit is undone;
* the book chapter includes the part of experiments/README.md between the generator's markers.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.experiments import claims as C

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results"
FROZEN = ROOT / "tests" / "data" / "claims"


def _meta(wall: float, commit: str, command: str = "depthsat experiment x --config full") -> dict:
    return {"command": command, "commit": commit, "wall_s": wall, "machine": {"torch_threads": 1}, "seeds": [0, 1]}


def _claim(claim, verdict, qualifier="", setting="toy, 2 seeds", interval="1 [0, 2]", reason="why"):
    return {
        "claim": claim,
        "setting": setting,
        "verdict": verdict,
        "qualifier": qualifier,
        "interval": interval,
        "reason": reason,
    }


def _write(root: Path, name: str, summary: dict) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "summary.json").write_text(json.dumps(summary))


@pytest.fixture
def toy(tmp_path):
    root = tmp_path / "experiments" / "results"
    _write(
        root,
        "beta",
        {
            "meta": _meta(90.0, "0123456789abcdef"),
            "summary": {},
            "claims": [
                _claim("C2: grows", "holds", "in direction", interval="−2 [−4, −1]"),
                _claim("M: a | b, L*", "untestable here", setting="L* = 2", reason="`L*`"),
            ],
        },
    )
    _write(
        root,
        "alpha",
        {"meta": _meta(3.0, "fedcba9876543210"), "summary": {}, "claims": [_claim("C1: falls", "fails")]},
    )
    (root / "no-summary").mkdir()  # a folder without summary.json is not a result folder
    return root


FULL = """\
| claim | setting | verdict | interval / evidence | reason | results (wall time, commit) |
|---|---|---|---|---|---|
| C1: falls | toy, 2 seeds | *fails* | 1 [0, 2] | why | `alpha` (3 s (0.1 min), 1 thread; fedcba9) |
| C2: grows | toy, 2 seeds | *holds* (in direction) | −2 [−4, −1] | why | `beta` (90 s (1.5 min), 1 thread; 0123456) |
| M: a \\| b, L\\* | L\\* = 2 | *untestable here* | 1 [0, 2] | `L*` | `beta` (90 s (1.5 min), 1 thread; 0123456) |"""

COMPACT = """\
| claim | setting | verdict |
|---|---|---|
| C1 (`alpha`) | toy, 2 seeds | *fails* |
| C2 (`beta`) | toy, 2 seeds | *holds* (in direction) |
| M (`beta`) | L\\* = 2 | *untestable here* |"""


def test_constructed_summaries_render_the_hand_written_tables(toy):
    results = C.collect(toy)
    assert [r.folder for r in results] == ["alpha", "beta"]
    assert C.render_full(results) == FULL
    assert C.render_compact(results) == COMPACT


def test_update_writes_between_the_markers_and_nothing_else(toy):
    readme = toy.parent / "README.md"
    begin, end = C.MARKERS["full"]
    readme.write_text(f"# head\n\n{begin}\nold table\n{end}\n\ntail\n")
    front = toy.parent.parent / "README.md"
    cbegin, cend = C.MARKERS["compact"]
    front.write_text(f"intro\n{cbegin}\n{cend}\nend\n")
    targets = {"full": readme, "compact": front}
    assert C.update(toy, targets, check=True) == [readme, front]
    assert "old table" in readme.read_text()  # check writes nothing
    assert C.update(toy, targets) == [readme, front]
    assert readme.read_text() == f"# head\n\n{begin}\n{FULL}\n{end}\n\ntail\n"
    assert front.read_text() == f"intro\n{cbegin}\n{COMPACT}\n{cend}\nend\n"
    assert C.update(toy, targets, check=True) == []


def test_a_resumed_run_shows_the_models_own_wall_times(tmp_path):
    meta = _meta(5.0, "abc1234", command="depthsat experiment x --resume done.jsonl")
    _write(tmp_path, "x", {"meta": meta, "summary": {}, "claims": [_claim("C1: x", "fails")]})
    (tmp_path / "x" / "runs.csv").write_text("seed,train_wall_s,model_wall_s\n0,50,60\n1,20,30\n")
    (tmp_path / "x" / "growth.csv").write_text("seed,wall_s\n0,30\n")
    (tmp_path / "x" / "sites.csv").write_text("seed,s\n0,1.5\n")
    (res,) = C.collect(tmp_path)
    assert res.wall == "120 s (2 min) summed over the models (growth, runs), 1 thread; this run 5 s"


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ({"claim": "x"}, "'claims' is a dict, not a list"),
        ([_claim("C1: x", "holds in-sample")], "verdict 'holds in-sample'; use exactly one of"),
        ([{k: v for k, v in _claim("C1: x", "holds").items() if k != "reason"}], "lacks reason"),
        ([{**_claim("C1: x", "holds"), "seeds": "3"}], "unknown keys seeds"),
        ([{**_claim("C1: x", "holds"), "interval": 0.5}], "interval must be text"),
        (["C1 holds"], r"claims\[0\] is a str, not a dict"),
    ],
)
def test_an_invalid_row_raises_naming_the_folder(tmp_path, rows, match):
    _write(tmp_path, "my-experiment", {"meta": _meta(1.0, "abc"), "summary": {}, "claims": rows})
    with pytest.raises(C.ClaimsError, match=match) as info:
        C.collect(tmp_path)
    assert "experiments/results/my-experiment/summary.json" in str(info.value)


def test_a_summary_without_rows_or_adapter_is_refused_by_name(tmp_path):
    _write(tmp_path, "new-experiment", {"meta": _meta(1.0, "abc"), "summary": {}})
    with pytest.raises(C.ClaimsError, match=r"new-experiment.*no 'claims' list and no adapter"):
        C.collect(tmp_path)


def test_an_adapter_that_cannot_read_its_summary_names_the_folder(tmp_path):
    _write(tmp_path, "growth", {"meta": _meta(1.0, "abc"), "summary": {"results": {"digits": {}}}})
    with pytest.raises(C.ClaimsError, match=r"growth/summary.json: the 'growth' adapter cannot read it"):
        C.collect(tmp_path)


def test_the_claims_list_wins_over_the_adapter(tmp_path):
    _write(tmp_path, "growth", {"meta": _meta(1.0, "abc"), "summary": {}, "claims": [_claim("C2: x", "fails")]})
    (res,) = C.collect(tmp_path)
    assert res.source == "claims" and [r["verdict"] for r in res.rows] == ["fails"]


# ----------------------------------------------------------------------------- the committed summaries
_NUM = re.compile(r"[−+-]?\d[\d,]*(?:\.\d+)?(?:·10[⁻⁰¹²³⁴⁵⁶⁷⁸⁹]+)?")
_SUP = str.maketrans("⁻⁰¹²³⁴⁵⁶⁷⁸⁹", "-0123456789")


def _numbers(text: str) -> list[float]:
    out = []
    for tok in _NUM.findall(text):
        tok = tok.replace("−", "-").replace(",", "")
        if "·10" in tok:
            mant, exp = tok.split("·10")
            out.append(float(mant) * 10 ** int(exp.translate(_SUP)))
        else:
            out.append(float(tok))
    return out


def _shows(text: str, *expected: str) -> None:
    """Every number of ``expected`` (as today's table printed it) is in ``text``, to the digits printed."""
    for e in expected:
        places = len(e.split(".")[1]) if "." in e else 0
        want = float(e.replace("−", "-").replace("+", ""))
        assert any(round(x, places) == want for x in _numbers(text)), (e, text)


@pytest.fixture(scope="module")
def committed():
    """Each adapter's rows on its committed summary (the adapter itself, whether or not a claims list exists).

    ``tests/data/claims/`` holds frozen copies of the summaries that their experiments regenerate with
    their own claims rows (budget-sweep at e4d8155, criterion-growth at ec47da0): the adapters keep
    being checked against the inputs the hand-written table was read from.
    """
    rows: dict[tuple[str, str], list[dict[str, str]]] = {}
    for name, adapter in C.ADAPTERS.items():
        folder = FROZEN / name if (FROZEN / name).is_dir() else RESULTS / name
        got = C.validate_rows(adapter(json.loads((folder / "summary.json").read_text()), folder), name)
        for row in got:
            rows.setdefault((name, row["claim"].split(":")[0]), []).append(row)
    return rows


def _one(committed, folder, claim, **where):
    rows = [r for r in committed[(folder, claim)] if all(v in r[k] for k, v in where.items())]
    assert len(rows) == 1, rows
    return rows[0]


def test_sweep_verdicts_are_todays_table(committed):
    c1 = _one(committed, "sweep", "C1")
    assert c1["verdict"] == "untestable here"
    assert c1["interval"].startswith("0 of 7 curves")
    c3a = _one(committed, "sweep", "C3a")
    assert c3a["qualifier"] == "holds in-sample"  # today: "holds in-sample", median 0.92–0.985
    _shows(c3a["interval"], "0.92", "0.985")
    c3b = _one(committed, "sweep", "C3b")
    assert c3b["verdict"] == "fails" and c3b["qualifier"] == "in-sample"
    assert "grows on 2" in c3b["interval"]


def test_budget_sweep_verdicts_are_todays_table(committed):
    c1 = _one(committed, "budget-sweep", "C1")
    assert c1["verdict"] == "fails"
    _shows(c1["interval"], "0.0168", "0.0002", "0.0333", "0.0120", "0.0001", "0.0240", "8.50", "6.31", "3.56", "1.86")
    c2 = _one(committed, "budget-sweep", "C2")
    assert (c2["verdict"], c2["qualifier"]) == ("holds", "in direction, not in size")
    _shows(c2["interval"], "−2.41", "−4.71", "−0.12", "+6.69", "+3.68", "+9.70")
    c3a = _one(committed, "budget-sweep", "C3a")
    assert (c3a["verdict"], c3a["qualifier"]) == ("fails", "holds in-sample")
    _shows(c3a["interval"], "0.94", "0.14", "0.11")
    c3b = _one(committed, "budget-sweep", "C3b")
    assert c3b["verdict"] == "fails"
    _shows(c3b["interval"], "0.00042", "−0.00046", "0.0013", "0.000024", "−0.0016", "0.0016", "−0.00012", "−0.0011")


def test_teacher_verdicts_are_todays_table(committed):
    lstar2 = {"setting": "L* = 2"}
    c1 = _one(committed, "teacher", "C1", **lstar2)
    assert c1["verdict"] == "untestable here"
    _shows(c1["interval"], "13.1", "6.3")
    assert _one(committed, "teacher", "C1", setting="L* = 4")["verdict"] == "untestable here"
    c3a = _one(committed, "teacher", "C3a", **lstar2)
    assert (c3a["verdict"], c3a["qualifier"]) == ("fails", "holds in-sample")
    _shows(c3a["interval"], "0.84", "0.02", "−0.03", "−0.20")
    c3b = _one(committed, "teacher", "C3b", **lstar2)
    assert c3b["verdict"] == "untestable here"
    _shows(c3b["interval"], "−0.0006", "−0.0033", "0.0020", "−0.0009", "−0.0017", "−0.0002")
    known = _one(committed, "teacher", "Known-depth transition", **lstar2)
    assert known["verdict"] == "untestable here"
    _shows(known["interval"], "0.0072", "−0.0020", "0.0165")
    big = _one(committed, "teacher-probe65536", "Known-depth transition", **lstar2)
    assert big["verdict"] == "untestable here"
    assert "block 2, 1, 1" in big["interval"]  # today: "transition per seed 2, 1, 1"
    assert "linear 0 of 12, block 0 of 12" in known["interval"]  # today: 0 of 344 site diagnoses improvable
    assert "block 1 of 12" in big["interval"]  # today: improvable at depth 1 in 1 of 3 seeds, none deeper


def test_growth_and_expand_verdicts_are_todays_table(committed):
    c2 = _one(committed, "growth", "C2")
    assert c2["verdict"] == "untestable here"
    _shows(c2["interval"], "−6.3", "−27.4", "+14.7", "−0.9", "−9.1", "+7.2")
    place = _one(committed, "expand", "LLM placement")
    assert place["verdict"] == "untestable here"
    _shows(place["interval"], "−0.0366", "−0.0385", "−0.0347", "0.0071", "−0.0898", "0.1040")


def test_views_fixed_depth_and_criterion_rows_read_as_the_readme_text(committed):
    # not in today's claims table; the numbers are typed from experiments/README.md's text on each run
    views = _one(committed, "views", "Views agree")
    assert views["verdict"] == "untestable here"  # the sweep plateau is at 1-2 blocks on every curve
    assert "on 0 of 4 curves" in views["interval"] and "stopping 3 of 4" in views["interval"]
    fixed = _one(committed, "fixed-depth", "Fixed vs variable depth (seed 003)")
    assert fixed["verdict"] == "untestable here" and fixed["reason"].startswith("1 of 4 intervals")
    _shows(fixed["interval"], "0.077", "0.009", "0.144", "0.010", "0.044", "0.028")
    crit = _one(committed, "criterion-growth", "Criterion growth")
    assert crit["verdict"] == "untestable here"
    _shows(crit["interval"], "6.8", "2.7", "2.6", "1.2")


def test_number_format():
    assert C._num(4.18e-4) == "4.18·10⁻⁴"
    assert C._num(-0.0366) == "−0.0366"
    assert C._num(2345.6) == "2,346"
    assert C._num(1.7e6) == "1.70·10⁶"
    assert C._num(0) == "0"
    assert C._pct(-0.02411) == "−2.41 %"


# ----------------------------------------------------------------------------- drift and --check
def test_committed_tables_are_generated_from_the_committed_results():
    res = runner.invoke(app, ["experiment", "claims", "--root", str(RESULTS), "--check"])
    assert res.exit_code == 0, res.output + "\nthe claims tables are stale: run ./dev claims and commit"


def test_check_detects_an_edited_table_and_a_run_restores_it(tmp_path):
    (tmp_path / "experiments").mkdir()
    root = tmp_path / "experiments" / "results"
    root.symlink_to(RESULTS, target_is_directory=True)
    shutil.copy(ROOT / "experiments" / "README.md", tmp_path / "experiments" / "README.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    args = ["experiment", "claims", "--root", str(root)]
    assert runner.invoke(app, [*args, "--check"]).exit_code == 0
    readme = tmp_path / "experiments" / "README.md"
    original = readme.read_text()
    head, table = original.split(C.MARKERS["full"][0], 1)
    verdict = re.search(r"\| \*(holds|fails|untestable here)\*", table)
    assert verdict is not None
    swapped = "| *fails*" if verdict.group(1) != "fails" else "| *holds*"
    edited = head + C.MARKERS["full"][0] + table[: verdict.start()] + swapped + table[verdict.end() :]
    readme.write_text(edited)
    res = runner.invoke(app, [*args, "--check"])
    assert res.exit_code == 1 and "run `./dev claims`" in res.output
    assert readme.read_text() == edited  # --check writes nothing
    assert runner.invoke(app, args).exit_code == 0
    assert readme.read_text() == original


def test_missing_markers_are_a_one_line_error(tmp_path):
    (tmp_path / "experiments").mkdir()
    root = tmp_path / "experiments" / "results"
    root.symlink_to(RESULTS, target_is_directory=True)
    (tmp_path / "experiments" / "README.md").write_text("# no markers\n")
    (tmp_path / "README.md").write_text("# none either\n")
    res = runner.invoke(app, ["experiment", "claims", "--root", str(root), "--check"])
    assert res.exit_code == 2 and "needs exactly one line" in res.output


def test_the_book_chapter_includes_the_generated_table():
    chapter = (ROOT / "book" / "chapters" / "experiments.md").read_text()
    begin, end = C.MARKERS["full"]
    assert f"```{{include}} ../../experiments/README.md\n:start-after: {begin}\n:end-before: {end}\n```" in chapter
