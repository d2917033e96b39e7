"""bench/gpu_checks.sh's plumbing, on the CPU: the summaries it writes from pytest's junit or,
when pytest was killed, from its -v lines; the bench results it takes back out of the checkout;
the hash that tells a stale carried wheel; its refusals of bad arguments. And the tests' own
imports: the suite must run against an installed wheel from outside the checkout, where the
source folders (hub/, agent/, ...) are not importable by those names."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import gpu_checks_helper as helper  # noqa: E402

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite>
<testcase classname="tests.test_a" name="test_ok" time="0.1" />
<testcase classname="tests.test_a.TestK" name="test_bad[x]"><failure message="m" /></testcase>
<testcase classname="tests.test_b" name="test_err"><error message="e" /></testcase>
<testcase classname="tests.test_b" name="test_gpu"><skipped message="needs CUDA" /></testcase>
<testcase time="0.001" />
</testsuite></testsuites>"""

XDIST_LOG = "".join(f"{line} \n" for line in [  # pytest ends these lines with a space
    "scheduling tests via LoadFileScheduling",
    "../../repo/tests/test_a.py::test_ok",
    "[gw0] [ 25%] PASSED ../../repo/tests/test_a.py::test_ok",
    "../../repo/tests/test_a.py::test_bad",
    "../../repo/tests/test_b.py::test_hangs",
    "[gw0] [ 50%] FAILED ../../repo/tests/test_a.py::test_bad",
    "[gw1] [ 75%] SKIPPED ../../repo/tests/test_b.py::test_gpu",
    "FAILED ../../repo/tests/test_a.py::test_bad - assert 1 == 2",
])


def test_the_summary_comes_from_the_junit_with_each_failing_test_named(tmp_path: Path) -> None:
    (tmp_path / "junit.xml").write_text(JUNIT)
    text = helper.summary(tmp_path / "junit.xml", tmp_path / "suite.log")
    lines = text.splitlines()
    assert lines[0] == "passed 1, failed 1, errors 1, skipped 1"
    assert "FAILED tests/test_a.py::TestK::test_bad[x]" in lines
    assert "ERROR tests/test_b.py::test_err" in lines
    assert "skipped x1: needs CUDA" in lines


def test_without_a_junit_the_log_gives_counts_failures_and_the_unfinished(tmp_path: Path) -> None:
    (tmp_path / "suite.log").write_text(XDIST_LOG)
    (tmp_path / "junit.xml").write_text(JUNIT[:80])  # cut short: killed while writing
    text = helper.summary(tmp_path / "junit.xml", tmp_path / "suite.log")
    lines = text.splitlines()
    assert lines[0].startswith("passed 1, failed 1, errors 0, skipped 1 (no complete junit.xml")
    assert "FAILED tests/test_a.py::test_bad" in lines
    assert lines.count("FAILED tests/test_a.py::test_bad") == 1  # not again from -rfE's line
    assert "UNFINISHED tests/test_b.py::test_hangs" in lines
    assert not any("UNFINISHED tests/test_a.py" in line for line in lines)


def test_new_bench_results_are_reported_and_trimmed_back_out(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setattr(helper, "BENCH", tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    (results / "old-cpu.json").write_text(json.dumps([{"run": 1}], indent=1) + "\n")
    before = (results / "old-cpu.json").read_text()
    state = tmp_path / "state"
    (state).write_text(json.dumps(helper._result_lengths()))
    (results / "old-cpu.json").write_text(json.dumps([{"run": 1}, {"run": 2}]))
    (results / "new-cpu.json").write_text(json.dumps([{"run": 3}]))
    assert helper.results_new(state, trim=True) == {"new-cpu.json": [{"run": 3}],
                                                     "old-cpu.json": [{"run": 2}]}
    assert (results / "old-cpu.json").read_text() == before
    assert not (results / "new-cpu.json").exists()


def test_the_tree_hash_follows_the_product_code_only(tmp_path: Path) -> None:
    for name in ("scalemon", "agent", "tests"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x.py").write_text("a = 1\n")
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    first = helper.tree_hash(tmp_path)
    (tmp_path / "tests" / "x.py").write_text("a = 2\n")
    (tmp_path / "agent" / "__pycache__").mkdir()
    (tmp_path / "agent" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert helper.tree_hash(tmp_path) == first
    (tmp_path / "agent" / "x.py").write_text("a = 2\n")
    assert helper.tree_hash(tmp_path) != first


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(("args", "env", "said"), [
    ([], {"OUT": "/tmp/x"}, "which part? suite, benches or all"),
    (["bench"], {"OUT": "/tmp/x"}, "unknown argument 'bench'"),
    (["suite"], {}, "OUT is not set"),
    (["benches"], {"OUT": "/tmp/x", "GPU_CHECKS_ROWS": "segfault speed"},
     "GPU_CHECKS_ROWS names 'speed'"),
])
def test_gpu_checks_refuses_bad_arguments_saying_what_to_give(args, env, said) -> None:
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu_checks.sh"), *args],
                          env={**base, **env}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_tests_import_the_product_as_installed() -> None:
    """`from hub.limits import ...` works only from the checkout's root (the editable install
    maps scalemon.hub to hub/): from outside it, as on a GPU machine with the wheel, such a
    test module fails to import."""
    folders = "|".join(("hub", "agent", "tui", "demo_train"))
    pattern = re.compile(rf"^\s*(from|import) ({folders})(\.|\s|$)", re.MULTILINE)
    offenders = [f"{path.name}: {m.group(0).strip()}"
                 for path in sorted((REPO / "tests").rglob("*.py"))
                 for m in pattern.finditer(path.read_text())]
    assert not offenders, offenders


def test_unmet_names_a_need_missing_or_too_old_that_no_deps_let_through(tmp_path: Path) -> None:
    """pip install --no-deps checks nothing: the setup step lists what the installed
    distributions need and this Python lacks."""
    def dist(name: str, version: str, *needs: str) -> None:
        info = tmp_path / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text("\n".join([
            "Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
            *(f"Requires-Dist: {n}" for n in needs)]) + "\n")

    dist("gckfront", "1.0", "gckold>=2", "gckgone", 'gckpypy; implementation_name == "pypy"',
         'gckextra; extra == "x"')
    dist("gckold", "1.5")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_checks_helper.py"),
                           "unmet", "gckfront", "gckold"],
                          env={**os.environ, "PYTHONPATH": str(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["gckold 1.5: gckfront needs gckold>=2",
                                        "gckgone: not installed (gckfront needs gckgone)"]
