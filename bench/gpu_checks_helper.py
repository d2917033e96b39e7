"""The Python half of bench/gpu_wheels.sh and bench/gpu_checks.sh: what a shell does badly.

    python3 bench/gpu_checks_helper.py tree-hash REPO            # the product source's hash
    python3 bench/gpu_checks_helper.py wheels DIR                # DIR's wheels for this Python
    python3 bench/gpu_checks_helper.py versions                  # torch, CUDA, NCCL, GPU, driver
    python3 bench/gpu_checks_helper.py unmet DIST...             # their needs not installed
    python3 bench/gpu_checks_helper.py summary JUNIT LOG         # counts and failing tests
    python3 bench/gpu_checks_helper.py kill-hubs HOME            # hubs a job's ranks started
    python3 bench/gpu_checks_helper.py results-mark STATE        # bench/results/*.json lengths
    python3 bench/gpu_checks_helper.py results-new STATE [--trim]  # the runs appended since
    python3 bench/gpu_checks_helper.py put JSON KEY VALUE_JSON   # set KEY in the JSON file

Standard library only (`packaging` where the image has it), so that it runs before anything
is installed. Every command prints what it found and exits 0 unless its arguments are wrong:
the scripts call it on the way to their summaries, which must be written whatever happened.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PRODUCT = ("pyproject.toml", "scalemon", "agent", "hub", "tui", "demo_train")
"""What the scalemon wheel is built from (pyproject.toml [tool.setuptools.package-dir])."""


def tree_hash(repo: Path) -> str:
    """sha256 over the product files' paths and bytes, in path order (no git needed: the device
    machine's copy of the checkout has no .git)."""
    digest = hashlib.sha256()
    files: list[Path] = []
    for name in PRODUCT:
        top = repo / name
        if top.is_file():
            files.append(top)
        elif top.is_dir():
            files += [p for p in top.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                      and p.suffix not in (".pyc", ".pyo")]
    for path in sorted(files, key=lambda p: p.relative_to(repo).as_posix()):
        digest.update(path.relative_to(repo).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def wheels_for_this_python(folder: Path) -> tuple[list[Path], list[str]]:
    """The wheels in `folder` that this interpreter can install, and why each other cannot."""
    try:
        from packaging.tags import sys_tags
        from packaging.utils import parse_wheel_filename
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.tags import sys_tags  # type: ignore[no-redef]
        from pip._vendor.packaging.utils import parse_wheel_filename  # type: ignore[no-redef]
    ours = set(sys_tags())
    usable, skipped = [], []
    for wheel in sorted(folder.glob("*.whl")):
        _, _, _, tags = parse_wheel_filename(wheel.name)
        if ours & set(tags):
            usable.append(wheel)
        else:
            skipped.append(f"{wheel.name}: not for Python {sys.version.split()[0]} on this "
                           f"platform")
    return usable, skipped


def _nvidia_smi(query: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"n/a ({e.__class__.__name__})"
    return out.stdout.strip().replace("\n", "; ") or f"n/a (nvidia-smi rc {out.returncode})"


def versions() -> list[str]:
    """One `name: value` line per thing a GPU result depends on; 'n/a (why)' where missing."""
    lines = [f"python: {sys.version.split()[0]} ({sys.executable})"]
    try:
        import torch
    except ImportError as e:
        return [*lines, f"torch: n/a ({e})"]
    lines.append(f"torch: {torch.__version__}")
    cuda = torch.cuda.is_available()
    lines.append(f"cuda (torch built with): {torch.version.cuda}; available: {cuda}")
    if cuda:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(
            torch.cuda, "nccl") else "n/a"
        lines += [f"nccl (torch.cuda.nccl.version()): {nccl}",
                  f"gpu: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}",
                  f"driver: {_nvidia_smi('driver_version')}"]
    else:
        lines += ["nccl: n/a (no CUDA device)", "gpu: n/a (no CUDA device)",
                  f"driver: {_nvidia_smi('driver_version')}"]
    for module in ("triton", "scalemon", "zmq", "textual", "msgpack", "xdist", "pytest_timeout"):
        try:
            mod = __import__(module)
        except Exception as e:  # a version line, whatever broke
            lines.append(f"{module}: n/a ({e.__class__.__name__}: {e})")
            continue
        version = getattr(mod, "__version__", None)
        if version is None:
            from importlib import metadata
            dist = {"xdist": "pytest-xdist", "pytest_timeout": "pytest-timeout"}.get(module,
                                                                                      module)
            with contextlib.suppress(metadata.PackageNotFoundError):
                version = metadata.version(dist)
        lines.append(f"{module}: {version} ({Path(mod.__file__ or '?').parent})")
    return lines


def unmet(dists: list[str]) -> list[str]:
    """The requirements of `dists` (and of theirs, recursively; extras left out) that no
    installed distribution meets: `pip install --no-deps` checks none of them."""
    from importlib import metadata
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip vendors it
        from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    problems, todo, done = [], list(dists), set()
    while todo:
        dist = todo.pop()
        if dist.lower() in done:
            continue
        done.add(dist.lower())
        try:
            needs = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            problems.append(f"{dist}: not installed")
            continue
        for text in needs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            try:
                have = metadata.version(req.name)
            except metadata.PackageNotFoundError:
                problems.append(f"{req.name}: not installed ({dist} needs {req})")
                continue
            if req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{req.name} {have}: {dist} needs {req}")
            todo.append(req.name)
    return problems


def junit_counts(junit: Path) -> dict | None:
    """passed/failed/errors/skipped and the failing node ids from a junit file; None when the
    file is missing or cut short (pytest killed before it wrote it)."""
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    skip_reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        if not case.get("name"):  # pytest-xdist leaves nameless ones when interrupted
            continue
        parts = (case.get("classname") or "").split(".")  # tests.test_x[.TestClass]
        where = f"{'/'.join(parts[:2])}.py" if parts[0] == "tests" and len(parts) > 1 else ""
        name = "::".join([where or ".".join(parts), *parts[2:], case.get("name", "")])
        kinds = {child.tag for child in case}
        if "failure" in kinds:
            counts["failed"] += 1
            failing.append(f"FAILED {name}")
        elif "error" in kinds:
            counts["errors"] += 1
            failing.append(f"ERROR {name}")
        elif "skipped" in kinds:
            counts["skipped"] += 1
            reason = (case.find("skipped").get("message") or "").strip()[:120]
            skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
        else:
            counts["passed"] += 1
    return {**counts, "failing": failing, "skip_reasons": skip_reasons, "source": "junit"}


_RESULT = re.compile(r"\b(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_NODE = re.compile(r"(\S+\.py::\S+)")


def _short(node: str) -> str:
    """`../../repo/tests/x.py::t` (pytest run from outside the checkout) -> `tests/x.py::t`."""
    return node[node.find("tests/"):] if "tests/" in node else node


def log_counts(log: Path) -> dict:
    """The same counts from pytest's `-v` lines (`[gw3] [ 40%] PASSED tests/x.py::t` under
    xdist, `tests/x.py::t PASSED [ 40%]` without): what is known when pytest was killed.
    `unfinished`: the tests xdist announced (a line of the node id alone) with no result."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failing: list[str] = []
    seen: set[tuple[str, str]] = set()
    started: dict[str, None] = {}
    finished: set[str] = set()
    key = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "errors",
           "SKIPPED": "skipped", "XFAIL": "skipped"}
    try:
        text = log.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ", "SKIPPED ")):
            continue  # the -r short summary repeats what the -v lines said
        result, node = _RESULT.search(line), _NODE.search(line)
        if node and not result and line.strip() == node.group(1):
            started[_short(node.group(1))] = None
            continue
        if not (result and node) or (node.group(1), result.group(1)) in seen:
            continue
        finished.add(_short(node.group(1)))
        seen.add((node.group(1), result.group(1)))
        counts[key[result.group(1)]] += 1
        if result.group(1) in ("FAILED", "ERROR"):
            failing.append(f"{result.group(1)} {_short(node.group(1))}")
    unfinished = [node for node in started if node not in finished]
    return {**counts, "failing": failing, "skip_reasons": {}, "unfinished": unfinished,
            "source": "log"}


def summary(junit: Path, log: Path) -> str:
    """A short text: counts, then the failing tests; from the junit when pytest wrote it, else
    from the log's -v lines (say which)."""
    found = junit_counts(junit)
    note = ""
    if found is None:
        found = log_counts(log)
        note = (f" (no complete {junit.name}: pytest was stopped before writing it; counted "
                f"from the -v lines of {log.name}, tests still running then are not counted)")
    lines = [f"passed {found['passed']}, failed {found['failed']}, errors {found['errors']}, "
             f"skipped {found['skipped']}{note}"]
    tail = log.read_text(errors="replace").splitlines()[-3:] if log.exists() else []
    closing = [line for line in tail if re.search(r"\b(passed|failed|error|skipped)\b", line)]
    if closing:
        lines.append(f"pytest's closing line: {closing[-1].strip()}")
    lines += found["failing"]
    unfinished = log_counts(log)["unfinished"] if log.exists() else []
    if unfinished:
        lines.append(f"started but not finished when pytest stopped ({len(unfinished)}):")
        lines += [f"UNFINISHED {node}" for node in unfinished]
    for reason, n in sorted(found["skip_reasons"].items(), key=lambda kv: -kv[1])[:10]:
        lines.append(f"skipped x{n}: {reason}")
    return "\n".join(lines)


def kill_hubs(home: Path) -> list[str]:
    """SIGTERM the hubs whose job files are under HOME/jobs (a monitored job's ranks start
    one; it lingers after the job)."""
    done = []
    for job_file in sorted((home / "jobs").glob("*.json")):
        with contextlib.suppress(Exception):
            pid = int(json.loads(job_file.read_text())["pid"])
            os.kill(pid, signal.SIGTERM)
            done.append(f"stopped hub pid {pid} ({job_file.stem})")
    return done


def _result_lengths() -> dict[str, int]:
    lengths = {}
    for path in sorted((BENCH / "results").glob("*.json")):
        with contextlib.suppress(OSError, ValueError, TypeError):
            lengths[path.name] = len(json.loads(path.read_text()))
    return lengths


def results_new(state: Path, trim: bool = False) -> dict[str, list]:
    """The runs appended to bench/results/*.json since `results-mark STATE`, by file; `trim`:
    and take them out of the files again (a file made since is removed), so that a try on a
    developer's machine leaves the checkout as it was."""
    before = json.loads(state.read_text()) if state.exists() else {}
    new = {}
    for name, length in _result_lengths().items():
        old = before.get(name, 0)
        if length <= old:
            continue
        path = BENCH / "results" / name
        runs = json.loads(path.read_text())
        new[name] = runs[old:]
        if trim and name in before:
            path.write_text(json.dumps(runs[:old], indent=1) + "\n")
        elif trim:
            path.unlink()
    return new


def put(path: Path, key: str, value: str) -> None:
    """Set `key` in the JSON object in `path` to `value` (JSON text, else a string)."""
    data = {}
    with contextlib.suppress(OSError, ValueError):
        data = json.loads(path.read_text())
    try:
        data[key] = json.loads(value)
    except ValueError:
        data[key] = value
    path.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("tree-hash", allow_abbrev=False).add_argument("repo", type=Path)
    sub.add_parser("wheels", allow_abbrev=False).add_argument("folder", type=Path)
    sub.add_parser("versions", allow_abbrev=False)
    sub.add_parser("unmet", allow_abbrev=False).add_argument("dists", nargs="+")
    s = sub.add_parser("summary", allow_abbrev=False)
    s.add_argument("junit", type=Path)
    s.add_argument("log", type=Path)
    sub.add_parser("kill-hubs", allow_abbrev=False).add_argument("home", type=Path)
    sub.add_parser("results-mark", allow_abbrev=False).add_argument("state", type=Path)
    s = sub.add_parser("results-new", allow_abbrev=False)
    s.add_argument("state", type=Path)
    s.add_argument("--trim", action="store_true")
    s = sub.add_parser("put", allow_abbrev=False)
    s.add_argument("path", type=Path)
    s.add_argument("key")
    s.add_argument("value")
    args = p.parse_args(argv)
    if args.cmd == "tree-hash":
        print(tree_hash(args.repo))
    elif args.cmd == "wheels":
        usable, skipped = wheels_for_this_python(args.folder)
        for reason in skipped:
            print(f"skipped {reason}", file=sys.stderr)
        print("\n".join(str(w) for w in usable))
    elif args.cmd == "versions":
        print("\n".join(versions()))
    elif args.cmd == "unmet":
        print("\n".join(unmet(args.dists)))
    elif args.cmd == "summary":
        print(summary(args.junit, args.log))
    elif args.cmd == "kill-hubs":
        print("\n".join(kill_hubs(args.home)))
    elif args.cmd == "results-mark":
        args.state.write_text(json.dumps(_result_lengths()))
    elif args.cmd == "results-new":
        print(json.dumps(results_new(args.state, args.trim)))
    elif args.cmd == "put":
        put(args.path, args.key, args.value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
