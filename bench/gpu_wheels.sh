#!/usr/bin/env bash
# Prepare the wheels a GPU machine of the `device` tool needs for bench/gpu_checks.sh.
#
#     bash bench/gpu_wheels.sh          # here, on the CPU machine, before the GPU calls
#
# Run it in the checkout that the `run` calls send (a session's own checkout; a helper's call
# also sends that one, not the helper's worktree). It (re)makes the folder .whl/ in the repo root:
#   - the wheels of the packages scalemon needs that the GPU image lacks (pyzmq, py-spy, textual and
#     textual's mdit-py-plugins, linkify-it-py, platformdirs), for CPython 3.12 manylinux
#     x86_64, pinned to the versions .venv has (importlib.metadata): nothing can
#     be fetched there;
#   - scalemon's own wheel, built from a copy of this checkout's working tree (uncommitted
#     changes included), and .whl/SOURCE.txt naming the tree it was built from (gpu_checks.sh
#     warns when the checkout it runs in differs, and builds a fresh wheel there if it can).
# .whl/ is git-ignored through the repository's .git/info/exclude (this script adds `/.whl/`
# there), never committed: the `run` call takes it along with `carry: [".whl"]`.
# Needs .venv (bash .ci/setup) and PyPI. Rerun it after changing the product code.
# GPU_WHEELS_EXTRA="rich pygments": carry these too (at .venv's versions), should gpu_checks.sh
# report in setup.txt that the image's copies are too old.
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
fi
if [[ $# -gt 0 ]]; then
    echo "gpu_wheels.sh takes no arguments (got: $*); see bash bench/gpu_wheels.sh --help" >&2
    exit 2
fi

REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
PY=${PYTHON:-.venv/bin/python}
if [[ ! -x $PY ]]; then
    echo "no $PY: run 'bash .ci/setup' first (its packages' versions are the ones carried)" >&2
    exit 1
fi
# what the GPU image lacks (/work/.library/device/KINDS.md, 'Python packages already there');
# textual's other needs (rich, pygments, markdown-it-py, typing-extensions) are there
NEEDED=(pyzmq textual mdit-py-plugins linkify-it-py platformdirs py-spy)
# more, should gpu_checks.sh's setup.txt say one of those is too old there: GPU_WHEELS_EXTRA=rich
read -r -a extra <<<"${GPU_WHEELS_EXTRA:-}"
NEEDED+=("${extra[@]}")
PLATFORMS=(--platform manylinux_2_39_x86_64 --platform manylinux_2_35_x86_64
           --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
if ! grep -qx '/.whl/' "$exclude" 2>/dev/null; then
    echo '/.whl/' >>"$exclude"
    echo "added /.whl/ to $exclude"
fi

pins=()
for name in "${NEEDED[@]}"; do
    # the installed version, also for a package pip freeze lists as "name @ file://..." (a
    # local wheel, as py-spy's is here), which a "name==" pattern would miss
    version=$("$PY" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' \
        "$name" 2>/dev/null || true)
    if [[ -z $version ]]; then
        echo "$name is not installed in $PY: is .venv complete? (bash .ci/setup)" >&2
        exit 1
    fi
    line="$name==$version"
    pins+=("$line")
done

rm -rf .whl
mkdir .whl
echo "downloading ${pins[*]} (CPython 3.12, manylinux x86_64)"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d .whl "${pins[@]}"

# scalemon's wheel from a copy of the working tree: an in-place build would reuse build/
# (files deleted since would end up in the wheel) and write into the checkout
src=$(mktemp -d /tmp/scalemon-wheel.XXXXXX)
trap 'rm -rf "$src"' EXIT
tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./.whl --exclude=./build \
    --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ --exclude=./runs \
    --exclude=./.pytest_cache --exclude=./.ruff_cache -cf - . | tar -C "$src" -xf -
"$PY" -m pip wheel -q --no-deps --no-build-isolation --wheel-dir .whl "$src" >/dev/null
hash=$("$PY" bench/gpu_checks_helper.py tree-hash "$REPO")
{
    echo "tree_hash=$hash"
    echo "commit=$(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . 2>/dev/null \
        || echo ' (plus uncommitted changes)')"
    echo "built=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >.whl/SOURCE.txt

ls -l .whl
size_kib=$(du -sk .whl | cut -f1)
echo "$(basename "$REPO")/.whl: $((size_kib / 1024)) MiB ($size_kib KiB), tree_hash $hash"
if ((size_kib > 40 * 1024)); then
    echo "warning: over 40 MiB; a run call carries at most 64 MiB with the checkout" >&2
fi
echo "next: the run calls in bench/results/gpu-nvidia-h100-2026-11-25.md, 'Next GPU session'"
