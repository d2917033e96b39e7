"""`scalemon --help` and every command's `--help`, as a person runs them (the console script),
and options that are checked before anything starts."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import SCALEMON
from scalemon.cli.main import build_parser

SOURCES = ("scalemon", "hub", "agent", "tui", "demo_train")


def environment_variables() -> set[str]:
    """Every SCALEMON_* name the code reads: each quoted literal of the sources (`environ.get(
    "SCALEMON_X")`, `env.get(...)`, `X_ENV = "SCALEMON_X"` read later), so a new variable
    without a line in `scalemon --help` fails the test."""
    repo = Path(__file__).resolve().parents[1]
    names: set[str] = set()
    for folder in SOURCES:
        for path in (repo / folder).rglob("*.py"):
            names.update(re.findall(r"""["'](SCALEMON_[A-Z0-9_]+)["']""", path.read_text()))
    return names


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every subcommand of the real parser: a new one is covered without editing this file."""
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def run(*args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    """`scalemon ARGS` with SCALEMON_HOME at `home`, 100 columns wide."""
    return subprocess.run([SCALEMON, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "SCALEMON_HOME": str(home), "COLUMNS": "100"})


def option_entries(help_text: str) -> dict[str, str]:
    """Option string -> its whole entry in a help text, continuation lines joined."""
    entries: dict[str, str] = {}
    block: list[str] = []

    def close() -> None:
        if block:
            head = block[0].strip().split("  ")[0]  # "-h, --help", "--ranks N"
            for option in re.findall(r"(?<![\w-])(--?\w[\w-]*)", head):
                entries[option] = " ".join(" ".join(block).split())
            block.clear()

    for line in help_text.splitlines():
        if line.startswith("  -"):
            close()
            block.append(line)
        elif block and line.startswith("    ") and line.strip():
            block.append(line)
        else:
            close()
    close()
    return entries


def test_top_level_help_lists_commands_and_environment_variables(home: Path):
    out = run("--help", home=home)
    assert out.returncode == 0, out.stderr
    assert "Terminal monitor for distributed PyTorch training." in out.stdout
    for name in commands():
        assert re.search(rf"^    {name}\s+\S", out.stdout, re.M), f"{name} has no help line"
    env_part = out.stdout[out.stdout.index("environment variables:"):]
    read = environment_variables()
    assert {"SCALEMON_HOME", "SCALEMON_HUB", "SCALEMON_HUB_KEY", "SCALEMON_LISTEN"} <= read
    for var in sorted(read):
        line = re.search(rf"^  {var}\s+(\S.*)$", env_part, re.M)
        assert line, f"{var} is not described in `scalemon --help`"


@pytest.mark.parametrize("name", sorted(commands()))
def test_every_command_help_has_a_description_and_shows_its_defaults(name: str, home: Path):
    out = run(name, "--help", home=home)
    assert out.returncode == 0, out.stderr
    usage, _, rest = out.stdout.partition("\n\n")
    assert usage.startswith(f"usage: scalemon {name}")
    description = rest.split("\n\n")[0]
    assert description.strip() and not description.startswith(("options:", "positional")), \
        f"`scalemon {name} --help` has no description"
    parser = commands()[name]
    entries = option_entries(out.stdout)
    for action in parser._actions:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            continue
        shown = (format(action.default, "g") if isinstance(action.default, float)
                 else str(action.default))
        option = action.option_strings[-1]
        assert f"(default: {shown})" in entries[option], \
            f"`scalemon {name} --help` does not show the default of {option}: {entries[option]}"


def test_demo_help_lists_the_trainers_presets(home: Path):
    from scalemon.demo_train.model import PRESETS

    out = run("demo", "--help", home=home)
    text = " ".join(out.stdout.split())
    listed = re.search(r"--preset NAME .*?: ([\w, -]+?) \(default: tiny\)", text)
    assert listed, out.stdout
    assert sorted(listed.group(1).split(", ")) == sorted(PRESETS)


@pytest.mark.parametrize(("args", "says"), [
    (["--preset", "nosuch"], "argument --preset: invalid choice: 'nosuch' (choose from "),
    (["--ranks", "0"], "argument --ranks: must be from 1 to 64, not 0"),
    (["--ranks", "two"], "argument --ranks: 'two' is not a whole number"),
    (["--max-steps", "0"], "argument --max-steps: must be at least 1, not 0"),
    (["--step-delay", "-1"], "argument --step-delay: must be 0 seconds or more, not -1"),
    (["--step-delay", "nan"], "argument --step-delay: must be 0 seconds or more, not nan"),
    (["--batch-size", "0"], "argument --batch-size: must be at least 1, not 0"),
    (["--job", "../x"], "argument --job: job id '../x' must be 1-100 characters"),
])
def test_demo_refuses_bad_options_before_starting_anything(args: list[str], says: str,
                                                           home: Path):
    started = time.monotonic()
    out = run("demo", *args, home=home)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"scalemon demo: error: {says}" in out.stderr
    assert out.stderr.startswith("usage: scalemon demo")
    assert time.monotonic() - started < 30  # it did not sit waiting for ranks
    assert not (home / "demo").exists() and not (home / "run").exists()  # no job, no log


def test_bad_preset_error_names_every_preset(home: Path):
    from scalemon.demo_train.model import PRESETS

    out = run("demo", "--preset", "nosuch", home=home)
    for name in PRESETS:
        assert repr(name) in out.stderr


@pytest.mark.parametrize(("args", "says"), [
    (["attach", "--wait", "-1"], "argument --wait: must be 0 seconds or more, not -1"),
    (["attach", "--hang-after", "0"], "argument --hang-after: must be more than 0 seconds"),
    (["snapshot", "--timeout", "0"], "argument --timeout: must be more than 0 seconds"),
    (["hub", "--job", "a b"], "argument --job: job id 'a b' must be 1-100 characters"),
    (["hub", "--job", "j", "--world-size", "0"], "argument --world-size: must be at least 1"),
])
def test_other_commands_check_their_numbers_too(args: list[str], says: str, home: Path):
    out = run(*args, home=home)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"error: {says}" in out.stderr


def test_the_demo_refuses_a_job_id_that_a_live_job_has(home: Path, start_hub):
    start_hub("busy")
    out = run("demo", "--job", "busy", home=home)
    assert out.returncode == 2
    assert "scalemon demo: a live job is named busy already (see `scalemon jobs`): pass " \
           "another --job, or leave it out" in out.stderr
    assert not (home / "demo").exists()


def test_toggle_help_explains_each_refusal(home: Path):
    """Every reason the hub refuses a toggle for (hub/toggles.py, the roles) is in the usage."""
    out = run("toggle", "--help", home=home)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for reason in ("not among the flags", "still under way", "no rank of the job is running",
                   "--ckpt-dir", "--max-restarts", "role control", "scalemon keys add"):
        assert reason in text, f"`scalemon toggle --help` does not say: {reason}"
    source = (Path(__file__).parents[1] / "hub" / "toggles.py").read_text()
    for said in ("still under way", "no rank of the job is running"):
        assert said in source  # the usage quotes what the hub says
