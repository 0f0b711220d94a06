"""The suite's section runner on stand-in sections: failures, hangs and stale results are reported, not hidden."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks import suite
from benchmarks.suite import Section, Skip, SuiteConfig, run_section


def _cfg(tmp_path: Path) -> SuiteConfig:
    return SuiteConfig(tmp_path / "model", "tiny", "float32", 1, True, tmp_path, None)


def _section(code: str) -> Section:
    return Section("stand-in", "A stand-in section", lambda cfg: [sys.executable, "-c", code], (1, 1))


def test_a_section_that_writes_its_json_is_ok(tmp_path: Path) -> None:
    lines: list[str] = []
    code = (f"import sys; print('progress', file=sys.stderr); "
            f"open({str(tmp_path / 'stand-in.json')!r}, 'w').write('{{}}'); print('| table |')")
    result = run_section(_section(code), _cfg(tmp_path), lines.append)
    assert (result.status, result.json_file) == ("ok", "stand-in.json")
    assert (tmp_path / "stand-in.md").read_text() == "| table |\n"
    assert result.command.startswith("python -c ")


def test_a_failing_section_reports_its_exit_status_and_log_tail(tmp_path: Path) -> None:
    result = run_section(_section("import sys; print('boom: bad flag', file=sys.stderr); sys.exit(3)"),
                         _cfg(tmp_path), lambda line: None)
    assert result.status == "failed" and result.note.startswith("exit status 3;") and "boom: bad flag" in result.note


def test_an_old_json_does_not_pass_for_a_new_result(tmp_path: Path) -> None:
    (tmp_path / "stand-in.json").write_text("{}")  # left by an earlier run in the same --out directory
    result = run_section(_section("pass"), _cfg(tmp_path), lambda line: None)
    assert result.status == "failed"


def test_a_hanging_section_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(suite, "SECTION_TIMEOUT_S", 1.0)
    result = run_section(_section("import time; time.sleep(60)"), _cfg(tmp_path), lambda line: None)
    assert result.status == "failed" and result.note.startswith("killed after 1 s") and result.seconds < 30


def test_a_skipped_section_runs_nothing(tmp_path: Path) -> None:
    section = Section("stand-in", "A stand-in section", lambda cfg: Skip("not installed: run X"), (1, 1))
    result = run_section(section, _cfg(tmp_path), lambda line: None)
    assert (result.status, result.note) == ("skipped", "not installed: run X")
    assert not (tmp_path / "stand-in.md").exists()


def test_unknown_sections_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--sections", "offline,nonsense"]) == 2
    assert "unknown nonsense" in capsys.readouterr().err
