"""Output paths of every command: ``-`` is stdout, special files are written in place, and an output that
cannot be written is refused before any work (or, when it fails after the work, the results are printed first).

A read-only folder is made with mode ``0o555``; as root (who ignores mode bits) the write is attempted with the
effective user ``nobody``, so the operating system itself refuses it.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from depthsat_theory.cli import app
from depthsat_theory.io import atomic_write

runner = CliRunner()
DIAGNOSE = ["diagnose", "--model", "mlp", "--batches", "1", "--batch-size", "8", "-q"]
NOBODY = 65534


@contextlib.contextmanager
def _unprivileged():
    """Run the body as a user the mode bits apply to (``nobody`` when the tests run as root)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(NOBODY)
    os.seteuid(NOBODY)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


@pytest.fixture
def read_only():
    """A folder with mode ``0o555`` inside a folder ``nobody`` can traverse."""
    base = Path(tempfile.mkdtemp(prefix="depthsat-ro-"))
    base.chmod(0o755)
    ro = base / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    with _unprivileged(), contextlib.suppress(PermissionError):  # os.access would ask for the real user
        (ro / "probe").touch()
        pytest.fail("the read-only fixture folder is writable: mode bits are not enforced here")
    yield ro
    ro.chmod(0o755)
    shutil.rmtree(base)


def _error_lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.startswith("error")]


# ----------------------------------------------------------------------------- stdout and special files
def test_json_dash_is_stdout_with_the_table_on_stderr(tmp_path, monkeypatch):
    """``--json -`` printed the JSON nowhere and wrote a file named ``-``; now the JSON is stdout."""
    monkeypatch.chdir(tmp_path)
    out = runner.invoke(app, [*DIAGNOSE, "--json", "-"])
    assert out.exit_code == 0, out.output
    assert not (tmp_path / "-").exists()
    got = json.loads(out.stdout)
    ref = runner.invoke(app, [*DIAGNOSE, "--json", str(tmp_path / "d.json")])
    assert ref.exit_code == 0, ref.output
    assert got == json.loads((tmp_path / "d.json").read_text())
    # the table (its title "depthsat diagnose: ...") goes to stderr; stdout is the JSON alone (whose next_step
    # lines name the command "depthsat diagnose ... --max-examples N", without a colon)
    assert "depthsat diagnose:" in out.stderr and "depthsat diagnose:" not in out.stdout


def test_json_through_a_symlink_to_a_pipe_keeps_the_symlink(tmp_path):
    """``/dev/stdout`` is a symlink to ``/proc/self/fd/1``; renaming over it replaced it by a regular file.

    The same shape here: a symlink to ``/proc/self/fd/W`` of a pipe; the JSON must arrive through the pipe.
    """
    read_fd, write_fd = os.pipe()
    link = tmp_path / "stdout"
    link.symlink_to(f"/proc/self/fd/{write_fd}")
    chunks: list[bytes] = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: os.read(read_fd, 65536), b"")))
    reader.start()
    try:
        out = runner.invoke(app, [*DIAGNOSE, "--json", str(link)])
    finally:
        os.close(write_fd)
        reader.join(timeout=60)
        os.close(read_fd)
    assert out.exit_code == 0, out.output
    assert link.is_symlink() and os.readlink(link) == f"/proc/self/fd/{write_fd}"
    assert json.loads(b"".join(chunks))["n"] == 8


def test_atomic_write_keeps_a_symlink_to_a_regular_file_and_writes_dash_to_stdout(tmp_path, capsys):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_write(link, lambda fh: fh.write("new"))
    assert link.is_symlink() and target.read_text() == "new"
    atomic_write("-", lambda fh: fh.write(b"bytes\n"), binary=True)
    atomic_write("-", lambda fh: fh.write("text\n"))
    assert capsys.readouterr().out == "bytes\ntext\n"
    assert not Path("-").exists()


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ([*DIAGNOSE, "--plot", "-"], "--plot"),
        ([*DIAGNOSE, "--checkpoint", "-"], "--checkpoint"),
        (["grow", "--model", "mlp", "--blocks", "1", "--out", "-"], "--out"),
        (["experiment", "sweep", "--config", "tiny", "--out", "-"], "--out"),
    ],
)
def test_outputs_that_cannot_be_stdout_refuse_dash(args, flag):
    out = runner.invoke(app, args)
    assert out.exit_code == 2, out.output
    (line,) = _error_lines(out.output)
    assert line.startswith(f"error: {flag} -")


# ----------------------------------------------------------------------------- read-only folders
@pytest.mark.parametrize(
    ("args", "flag"),
    [
        ([*DIAGNOSE, "--json", "{ro}/d.json"], "--json"),
        ([*DIAGNOSE, "--plot", "{ro}/p"], "--plot"),
        ([*DIAGNOSE, "--checkpoint", "{ro}/c.safetensors"], "--checkpoint"),
        (["grow", "--model", "mlp", "--blocks", "1", "--out", "{ro}/grown"], "--out"),
        (["check", "-n", "1", "--report", "{ro}/r.json"], "--report"),
        (["proofs", "--quick", "--json", "{ro}/p.json"], "--json"),
        (["experiment", "sweep", "--config", "tiny", "--out", "{ro}/sweep"], "--out"),
    ],
)
def test_a_read_only_output_folder_is_refused_before_any_work(read_only, args, flag):
    """Each output flag: exit 2 with one line naming the flag, before the probe, training or checks run."""
    argv = [a.replace("{ro}", str(read_only)) for a in args]
    with _unprivileged():
        out = runner.invoke(app, argv)
    assert out.exit_code == 2, out.output
    (line,) = _error_lines(out.output)
    assert line.startswith(f"error: {flag} ") and "not writable" in line
    assert "depthsat" not in out.stdout  # no table: nothing ran
    assert list(read_only.iterdir()) == []


def test_diagnose_prints_the_table_when_the_json_write_fails_after_the_probe(read_only, monkeypatch):
    """The folder becomes read-only during the run: the table is printed, then one error line (exit 2)."""
    from depthsat_theory.diagnose.report import Diagnosis

    cli = importlib.import_module("depthsat_theory.cli.app")
    monkeypatch.setattr(cli, "check_output_path", lambda *a, **k: None)  # the folder was writable at the start
    real = Diagnosis.write_json

    def write_as_nobody(self, path):
        with _unprivileged():
            real(self, path)

    monkeypatch.setattr(Diagnosis, "write_json", write_as_nobody)
    out = runner.invoke(app, [*DIAGNOSE, "--json", str(read_only / "d.json")])
    assert out.exit_code == 2, out.output
    assert "depthsat diagnose" in out.stdout and "blocks.0" in out.stdout
    (line,) = _error_lines(out.stderr)
    assert line.startswith(f"error: --json {read_only / 'd.json'}: could not write") and "denied" in line


def test_grow_prints_its_results_when_the_out_write_fails_after_training(read_only, monkeypatch):
    """``grow --out`` reported the OSError as an internal error (exit 3); now the results, then exit 2."""
    grow_run = importlib.import_module("depthsat_theory.grow.run")
    cli = importlib.import_module("depthsat_theory.cli.app")
    monkeypatch.setattr(cli, "check_output_path", lambda *a, **k: None)
    real = grow_run.write_grown

    def write_as_nobody(rep, out, **kwargs):
        with _unprivileged():
            return real(rep, out, **kwargs)

    monkeypatch.setattr(grow_run, "write_grown", write_as_nobody)
    dest = read_only / "grown"
    out = runner.invoke(app, ["grow", "--model", "mlp", "--blocks", "1", "--batches", "1", "--out", str(dest)])
    assert out.exit_code == 2, out.output
    assert "depthsat grow" in out.stdout and "first Adam step" in out.stdout
    (line,) = _error_lines(out.stderr)
    assert line.startswith(f"error: --out {dest}: could not write the grown model") and "denied" in line
    assert not dest.exists()


def test_special_output_files_are_detected_by_type():
    from depthsat_theory.io import is_special

    assert is_special("/dev/null") and stat.S_ISCHR(os.stat("/dev/null").st_mode)
    assert not is_special(__file__) and not is_special(os.path.dirname(__file__))
    assert not is_special("/no/such/path")


def test_dev_stdout_redirected_to_a_file_is_written_in_place(tmp_path, capfd):
    """``--json /dev/stdout > file``: the file is fd 1 itself; renaming over it would orphan the stream."""
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")  # pytest's fd capture: fd 1 is a regular temporary file
    before = os.fstat(1)
    atomic_write(link, lambda fh: fh.write("through fd 1\n"))
    assert link.is_symlink() and os.path.samestat(os.fstat(1), before)
    assert capfd.readouterr().out == "through fd 1\n"
