#!/usr/bin/env bash
# The GPU checks of issue #25 as one prepared command, on a GPU machine of the `device` tool.
#
#     bash bench/gpu_checks.sh suite      # the whole test suite, xdist, junit + summary
#     bash bench/gpu_checks.sh benches    # the #25 rows: segfault x3, NCCL/CUDA tests, A/B benches
#     bash bench/gpu_checks.sh all        # both, for a machine without the 10-minute call limit
#     GPU_CHECKS_CPU=1 OUT=/tmp/gpuout bash bench/gpu_checks.sh benches   # CPU mode (see below)
#
# First, on the CPU machine: bash bench/gpu_wheels.sh (makes .whl/, carried with the call).
# It installs .whl/'s wheels into $GPU_CHECKS_SITE (/tmp/site) as a user would
# (pip install --no-deps --no-index --target), puts its bin/ on PATH (the `scalemon` script)
# and it on PYTHONPATH, checks both, prints the versions (torch, CUDA, NCCL, GPU, driver), then
# runs the PART from outside the checkout (cd /tmp/...; the checkout's scalemon/ would shadow the
# installed package). Every part stops itself by its budget, before the call's 600 s, and
# writes under $OUT (at most 8 files, all parts together):
#   setup.txt            install and versions
#   suite.log            suite: pytest -v output, written as it runs (a kill leaves it)
#   junit.xml            suite: pytest's report (stopped at its budget by SIGINT: still written)
#   suite_summary.txt    suite: passed/failed/errors/skipped and the failing tests
#   benches.log          benches: everything the rows printed, with each row's rc and wall time
#   benches.json         benches: per row: exit codes, and the runs the benches saved
#   nccl_junit.xml       benches: the NCCL and CUDA tests' report
#   benches_summary.txt  benches: one line per row, written after each row
# Exit status: 0 when every test passed and every row exited 0, else 1 (2: bad arguments).
#
# Environment (all optional):
#   OUT                    where the results go (the `run` tool sets it; required elsewhere)
#   GPU_CHECKS_CPU=1       CPU mode, to try this script on a machine without a GPU: the same
#                          plumbing with tiny CPU sizes; what needs CUDA is skipped, saying why
#   GPU_CHECKS_PYTHON      the interpreter (python3; CPU mode: the checkout's .venv/bin/python)
#   GPU_CHECKS_SITE        the install target (/tmp/site; CPU mode: a fresh /tmp folder)
#   GPU_CHECKS_BUDGET      seconds a part may take (540; `all`: 1800 for the suite, 900 benches)
#   GPU_CHECKS_TESTS       suite: test files to run instead of all, e.g. "test_seed.py test_hub.py"
#   GPU_CHECKS_WORKERS     suite: pytest-xdist workers (12; CPU mode 2)
#   GPU_CHECKS_AB_BLOCKS   benches: bench/agent_ab.py --blocks (300 pairs of blocks of
#                          GPU_CHECKS_AB_BLOCK_STEPS=2 steps: short blocks, many pairs, so
#                          that the paired ratio's 95% interval resolves 1%; ~1 min after
#                          the two compiles on an H100, estimated)
#   GPU_CHECKS_OPT_BLOCKS  benches: bench/optimizer_ab.py --blocks (8: ~2 min on an H100, estimated)
#   GPU_CHECKS_ROWS        benches: which rows, in order (segfault tests agent_ab optimizer_ab;
#                          also: sweep, our AdamW kernels' launch shapes beside torch fused,
#                          bench/fused_adam_sweep.py, whose fastest fp32 shape optimizer_ab then
#                          uses; demo, the demo trainer on the GPU with the monitor, one rank:
#                          MoE, ZeRO-3 bf16, compile with our AdamW)
#   GPU_CHECKS_SWEEP_ARGS  benches: more arguments of the sweep row, e.g.
#                          "--configs 512x4 512x4x4 --dtypes bf16 --iters 100"
#   GPU_CHECKS_ADAM_SHAPE  benches: optimizer_ab's --adam-shape (BLOCKxWARPS[xITERS]; default: the
#                          sweep row's fastest fp32 shape when it ran first, else the module's)
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

CPU=${GPU_CHECKS_CPU:-0}
PART=
for arg in "$@"; do
    case $arg in
        -h | --help) usage; exit 0 ;;
        --cpu) CPU=1 ;;
        suite | benches | all) PART=$arg ;;
        *) echo "gpu_checks.sh: unknown argument '$arg': give suite, benches or all" \
               "(bash bench/gpu_checks.sh --help)" >&2; exit 2 ;;
    esac
done
if [[ -z $PART ]]; then
    echo "gpu_checks.sh: which part? suite, benches or all (bash bench/gpu_checks.sh --help)" >&2
    exit 2
fi
if [[ -z ${OUT:-} ]]; then
    echo "gpu_checks.sh: OUT is not set: name a folder for the results, e.g." \
         "OUT=/tmp/gpuout bash bench/gpu_checks.sh $PART" >&2
    exit 2
fi
ROWS=${GPU_CHECKS_ROWS:-segfault tests agent_ab optimizer_ab}
for name in $ROWS; do
    case $name in
        segfault | tests | agent_ab | optimizer_ab | sweep | demo) ;;
        *) echo "gpu_checks.sh: GPU_CHECKS_ROWS names '$name': give some of" \
               "segfault tests agent_ab optimizer_ab sweep demo" >&2; exit 2 ;;
    esac
done
REPO=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [[ $CPU == 1 ]]; then
    PY=${GPU_CHECKS_PYTHON:-$REPO/.venv/bin/python}
    SITE=${GPU_CHECKS_SITE:-/tmp/gpuchecks-site.$$}
    WORKERS=${GPU_CHECKS_WORKERS:-2}
else
    PY=${GPU_CHECKS_PYTHON:-python3}
    SITE=${GPU_CHECKS_SITE:-/tmp/site}
    WORKERS=${GPU_CHECKS_WORKERS:-12}
fi
AB_BLOCKS=${GPU_CHECKS_AB_BLOCKS:-300}
AB_BLOCK_STEPS=${GPU_CHECKS_AB_BLOCK_STEPS:-2}
OPT_BLOCKS=${GPU_CHECKS_OPT_BLOCKS:-8}
RUNDIR=$(mktemp -d /tmp/gck.XXXXXX)  # short: ipc socket paths under it stay short
TRIM=()  # CPU mode: the benches' runs are taken out of bench/results/ again (kept in $OUT)
[[ $CPU == 1 ]] && TRIM=(--trim)
if [[ $CPU == 1 && -z ${GPU_CHECKS_SITE:-} ]]; then
    trap 'rm -rf "$RUNDIR" "$SITE"' EXIT  # its own fresh install target
else
    trap 'rm -rf "$RUNDIR"' EXIT
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=$SITE PATH=$SITE/bin:$PATH

helper() { "$PY" "$REPO/bench/gpu_checks_helper.py" "$@"; }
stamp() { date -u +%H:%M:%S; }

# --- install: the carried wheels into $SITE, as a user would -----------------------------------
install_wheels() {
    set +e
    echo "gpu_checks.sh $PART at $(stamp) UTC; python: $PY; install target: $SITE" \
         "$([[ $CPU == 1 ]] && echo '; CPU mode (GPU_CHECKS_CPU=1)')"
    if [[ ! -d $REPO/.whl ]]; then
        echo "INSTALL FAILED: no .whl/ in the checkout: run 'bash bench/gpu_wheels.sh' here" \
             "before the call, and name .whl in the call's carry"
        return 1
    fi
    local wheels=() built carried expected fresh problems
    mapfile -t wheels < <(cd "$RUNDIR" && helper wheels "$REPO/.whl")
    carried=$(sed -n 's/^tree_hash=//p' "$REPO/.whl/SOURCE.txt" 2>/dev/null)
    expected=$(helper tree-hash "$REPO")
    echo "wheel source: $(tr '\n' ' ' <"$REPO/.whl/SOURCE.txt" 2>/dev/null);" \
         "this checkout's tree_hash=$expected"
    if [[ $carried != "$expected" ]]; then
        echo "WARNING: .whl/'s scalemon wheel was built from other product code than this" \
             "checkout's (rerun bash bench/gpu_wheels.sh before the call); building one here"
        fresh=$RUNDIR/wheel
        mkdir -p "$fresh/src"
        tar -C "$REPO" --exclude=./.whl --exclude=./.venv --exclude=./build \
            --exclude='*.egg-info' --exclude=__pycache__ -cf - . | tar -C "$fresh/src" -xf -
        if "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-index \
                --wheel-dir "$fresh/dist" "$fresh/src" >"$fresh/log" 2>&1; then
            built=$(ls "$fresh"/dist/scalemon-*.whl)
            wheels=("${wheels[@]/*scalemon-*.whl/$built}")
            echo "built $built from this checkout"
        else
            echo "WARNING: could not build it here (tail of pip's output below): the carried" \
                 "wheel is used, its code may differ from the tests'"
            tail -5 "$fresh/log"
        fi
    fi
    rm -rf "$SITE"
    echo "installing: ${wheels[*]##*/}"
    if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$SITE" "${wheels[@]}"; then
        echo "INSTALL FAILED: pip install --target $SITE"
        return 1
    fi
    if [[ $(command -v scalemon) != "$SITE/bin/scalemon" ]]; then
        echo "INSTALL FAILED: 'scalemon' on PATH is $(command -v scalemon || echo nothing)," \
             "not $SITE/bin/scalemon"
        return 1
    fi
    if ! (cd "$RUNDIR" && scalemon --help >/dev/null); then
        echo "INSTALL FAILED: '$SITE/bin/scalemon --help' did not exit 0"
        return 1
    fi
    if ! (cd "$RUNDIR" && "$PY" -c '
import sys, scalemon.agent, scalemon.hub.main, scalemon.tui.app, scalemon.demo_train.model
import zmq, textual
if not scalemon.__file__.startswith(sys.argv[1]):
    sys.exit(f"scalemon imported from {scalemon.__file__}, not from {sys.argv[1]}")
' "$SITE"); then
        echo "INSTALL FAILED: the installed package does not import (above)"
        return 1
    fi
    echo "scalemon script: $SITE/bin/scalemon (--help exits 0); packages import from $SITE"
    problems=$(cd "$RUNDIR" && helper unmet scalemon textual)
    if [[ -n $problems ]]; then  # --no-deps checked nothing: say what may break, go on
        echo "WARNING: needs not met by this Python's packages (carry them: GPU_WHEELS_EXTRA" \
             "for bench/gpu_wheels.sh):"
        echo "$problems"
    fi
    (cd "$RUNDIR" && helper versions)
}

# --- row: one command under its own limit, clamped to what is left of the part's budget ------
DEADLINE=0
ROW_RC=0
ROW_WALL=0
ROW_LOG=
row() {  # row NAME LIMIT_S COMMAND...: sets ROW_RC, ROW_WALL, ROW_LOG
    local name=$1 limit=$2 left t0
    shift 2
    left=$((DEADLINE - SECONDS))
    ((limit > left)) && limit=$left
    ROW_LOG=$RUNDIR/row-${name//[^a-zA-Z0-9]/_}.log
    if ((limit < 10)); then
        echo "=== $name: not run, ${left} s left of the part's budget"
        ROW_RC=-1 ROW_WALL=0
        : >"$ROW_LOG"
        return
    fi
    echo "=== $name ($(stamp), limit ${limit} s): $*"
    t0=$SECONDS
    set +e
    timeout -k 10 "$limit" "$@" 2>&1 | tee "$ROW_LOG"
    ROW_RC=${PIPESTATUS[0]}
    ROW_WALL=$((SECONDS - t0))
    echo "=== $name: rc $ROW_RC$( ((ROW_RC == 124 || ROW_RC == 137)) \
        && echo ' (stopped at its limit)'), ${ROW_WALL} s"
}

rc_text() {  # the last row's exit, in words
    case $ROW_RC in
        -1) echo "NOT RUN (the part's budget was spent)" ;;
        124 | 137) echo "rc $ROW_RC (STOPPED at its limit after ${ROW_WALL} s)" ;;
        *) echo "rc $ROW_RC, ${ROW_WALL} s" ;;
    esac
}

note() {  # one line into the benches summary, as soon as it is known
    echo "$*" | tee -a "$OUT/benches_summary.txt"
}

# --- suite -------------------------------------------------------------------------------------
suite_part() {
    set +e
    local budget=${GPU_CHECKS_BUDGET:-$([[ $PART == all ]] && echo 1800 || echo 540)}
    local tests=() xdist=() limit rc t0 name
    if [[ -n ${GPU_CHECKS_TESTS:-} ]]; then
        for name in $GPU_CHECKS_TESTS; do tests+=("$REPO/tests/$name"); done
    else
        tests=("$REPO/tests")
    fi
    if ((WORKERS > 0)); then
        xdist=(-n "$WORKERS" --dist loadfile)
        # the README's ordering flag came with pytest-xdist 3.8; an older one refuses it
        if (cd "$RUNDIR" && "$PY" -c 'import sys, xdist
sys.exit(tuple(map(int, xdist.__version__.split(".")[:2])) < (3, 8))'); then
            xdist+=(--no-loadscope-reorder)
        else
            echo "pytest-xdist older than 3.8: files are not handed out longest first"
        fi
    fi
    # pytest gets SIGINT 30 s before the budget's end (it then writes junit.xml), KILL at the end
    limit=$((budget - SECONDS - 30))
    if ((limit < 20)); then
        echo "only $((budget - SECONDS)) s left of the ${budget} s budget: pytest gets 20 s"
        limit=20
    fi
    rm -f "$OUT/junit.xml"
    echo "=== suite ($(stamp), SIGINT after ${limit} s): pytest ${xdist[*]} ${tests[*]}"
    t0=$SECONDS
    (cd "$RUNDIR" && timeout --foreground -s INT -k 25 "$limit" "$PY" -m pytest -v -rfE --tb=short \
        -p no:cacheprovider --timeout 240 --junitxml="$OUT/junit.xml" "${xdist[@]}" \
        "${tests[@]}")
    rc=$?
    echo "=== suite: pytest rc $rc$( ((rc == 124 || rc == 137)) \
        && echo ' (stopped by its budget)'), $((SECONDS - t0)) s"
    {
        echo "suite: pytest rc $rc, $((SECONDS - t0)) s, ${WORKERS} workers$( \
            ((rc == 124 || rc == 137)) && echo ", STOPPED by the ${budget} s budget")"
        helper summary "$OUT/junit.xml" "$OUT/suite.log"
    } >"$OUT/suite_summary.txt" 2>&1
    return "$rc"
}

# --- benches: one function per row of #25 ---------------------------------------------------
FAILS=0
counted() {  # a row's exit code into FAILS
    ((ROW_RC == 0)) || FAILS=$((FAILS + 1))
}

row_segfault() {  # (a) the gloo job with the agent exits 0 (#25's SIGSEGV at exit), 3 times
    local i home fatal ranks runs=()
    for i in 1 2 3; do
        home=$RUNDIR/kc$i
        mkdir -p "$home/out"
        # the environment of tests/test_collectives_jobs.py's job_env, which failed there
        row "segfault run $i" 45 env PYTHONFAULTHANDLER=1 OMP_NUM_THREADS=1 \
            SCALEMON_HOME="$home" SCALEMON_JOB_ID="kc$i" SCALEMON_HUB_ARGS="--linger 60" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
            "$REPO/tests/jobs/known_collectives.py" "$home/out"
        helper kill-hubs "$home"
        fatal=$(grep -cE 'Segmentation fault|SIGSEGV|exitcode *: -11|Fatal Python error' \
                "$ROW_LOG")
        ranks=$(find "$home/out" -name 'rank*.json' | wc -l)
        runs+=("{\"rc\": $ROW_RC, \"wall_s\": $ROW_WALL, \"fatal_lines\": $fatal,
                \"rank_files\": $ranks}")
        note "segfault run $i: $(rc_text), $fatal segfault/fatal line(s)," \
             "$ranks of 2 rank files"
        counted
    done
    helper put "$OUT/benches.json" segfault "[$(IFS=,; echo "${runs[*]}")]"
}

row_tests() {  # (b) the NCCL tests and the agent's CUDA test (without CUDA: skipped, saying why)
    local junit=$OUT/nccl_junit.xml summary
    row "nccl and cuda tests" 150 "$PY" -m pytest -v -rfEs --tb=short -p no:cacheprovider \
        --timeout 120 -n 4 --junitxml="$junit" "$REPO/tests/test_gpu_nccl.py" \
        "$REPO/tests/test_stepcomm.py" "$REPO/tests/test_agent.py" \
        -k "(test_gpu_nccl or test_stepcomm) and nccl or test_agent and cuda"
    summary=$(helper summary "$junit" "$ROW_LOG")
    note "nccl and cuda tests: $(rc_text): ${summary//$'\n'/; }"
    helper put "$OUT/benches.json" nccl_tests "{\"rc\": $ROW_RC, \"wall_s\": $ROW_WALL}"
    counted
}

saved_runs() {  # NAME: the runs the row appended to bench/results/, into benches.json
    local new
    new=$(helper results-new "$RUNDIR/results.state" "${TRIM[@]}")
    helper put "$OUT/benches.json" "$1" \
        "{\"rc\": $ROW_RC, \"wall_s\": $ROW_WALL, \"saved\": ${new:-null}}"
}

row_agent_ab() {  # (c) the agent's cost on the training thread, in-process A/B
    helper results-mark "$RUNDIR/results.state"
    if [[ $CPU == 1 ]]; then
        echo "CPU mode: agent_ab runs its CPU form (2 gloo ranks, tiny) instead of the GPU form"
        row "agent_ab" 200 env SCALEMON_HOME="$RUNDIR/ab" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -- \
            "$REPO/bench/agent_ab.py" --mode agent --breakdown --blocks 3 --block-steps 5 \
            --label gpu_checks-cpu
    else
        row "agent_ab" 200 env SCALEMON_HOME="$RUNDIR/ab" \
            "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -- \
            "$REPO/bench/agent_ab.py" --device cuda --preset gpt2-124m --compile --amp bf16 \
            --ddp --mode agent --breakdown --blocks "$AB_BLOCKS" --block-steps "$AB_BLOCK_STEPS" \
            --label gpu_checks
    fi
    helper kill-hubs "$RUNDIR/ab"
    saved_runs agent_ab
    note "agent_ab: $(rc_text): $(grep -E ' (agent|control): A ' "$ROW_LOG" \
        | tail -1) $(grep -E 'paired geometric mean' "$ROW_LOG" | tail -1)
        $(grep -E '^  agent .*disabled' "$ROW_LOG" | tail -1)"
    counted
}

ADAM_SHAPE=${GPU_CHECKS_ADAM_SHAPE:-}

row_sweep() {  # our AdamW kernels' launch shapes beside torch fused (bench/fused_adam_sweep.py)
    local saved
    if [[ $CPU == 1 ]]; then
        note "sweep: not run in CPU mode (it needs CUDA)"
        return
    fi
    # shellcheck disable=SC2086  # GPU_CHECKS_SWEEP_ARGS: words on purpose
    row "sweep" 240 "$PY" "$REPO/bench/fused_adam_sweep.py" --best fp32 ${GPU_CHECKS_SWEEP_ARGS:-}
    saved=$(ls -t "$REPO"/bench/results/fused_adam_sweep_*.json 2>/dev/null | head -1)
    if [[ -n $saved ]]; then cp "$saved" "$OUT/"; fi
    if ((ROW_RC == 0)) && [[ -z ${GPU_CHECKS_ADAM_SHAPE:-} ]]; then
        ADAM_SHAPE=$(tail -1 "$ROW_LOG")
    fi
    note "sweep: $(rc_text): $(grep -E '^fastest shape' "$ROW_LOG" | tail -1)"
    counted
}

row_demo() {  # the demo trainer on the GPU with the monitor, one rank (NCCL needs a GPU a rank)
    local args i=0 runs=("--experts 4" "--zero 3 --amp bf16")
    # the compiled run with our AdamW: GPU only (the CPU would compile for minutes)
    if [[ $CPU != 1 ]]; then runs+=("--compile --amp bf16 --optimizer fused"); fi
    for args in "${runs[@]}"; do
        i=$((i + 1))
        row "demo $args" 120 env SCALEMON_HOME="$RUNDIR/demo$i" "$PY" -m torch.distributed.run \
            --standalone --nproc-per-node 1 -- "$REPO/demo_train/train.py" \
            $([[ $CPU == 1 ]] && echo "--device cpu --preset tiny" || echo "--device cuda") \
            $args --max-steps 30 --monitor
        helper kill-hubs "$RUNDIR/demo$i"
        note "demo $args: $(rc_text): $(grep -E 'step +30|tokens/s' "$ROW_LOG" | tail -1)"
        counted
    done
}

row_optimizer_ab() {  # (d) the trainer's AdamW choices, in-process A/B/C
    local mode line shape=()
    helper results-mark "$RUNDIR/results.state"
    if [[ -n $ADAM_SHAPE ]]; then shape=(--adam-shape "$ADAM_SHAPE"); fi
    if [[ $CPU == 1 ]]; then
        echo "CPU mode: optimizer_ab runs tiny on the CPU (Triton interpreter, no compile)"
        row "optimizer_ab" 130 env TRITON_INTERPRET=1 "$PY" "$REPO/bench/optimizer_ab.py" \
            --device cpu --preset tiny --blocks 2 --block-steps 3 --untimed 1 --no-compile \
            "${shape[@]}"
    else
        row "optimizer_ab" 130 "$PY" "$REPO/bench/optimizer_ab.py" --blocks "$OPT_BLOCKS" \
            "${shape[@]}"
    fi
    saved_runs optimizer_ab
    note "optimizer_ab: $(rc_text)${ADAM_SHAPE:+, our kernels at $ADAM_SHAPE}"
    for mode in torch-fused fused fused-flat; do
        line=$(grep -E "^$mode +[0-9]" "$ROW_LOG" | tail -1)
        if [[ -n $line ]]; then note "  $line"; fi
    done
    counted
}

benches_part() {
    set +e
    local budget=${GPU_CHECKS_BUDGET:-$([[ $PART == all ]] && echo 900 || echo 540)}
    local name
    DEADLINE=$((SECONDS + budget))
    : >"$OUT/benches_summary.txt"
    echo '{}' >"$OUT/benches.json"
    helper put "$OUT/benches.json" setup \
        "{\"cpu_mode\": $CPU, \"budget_s\": $budget, \"rows\": \"$ROWS\"}"
    for name in $ROWS; do
        case $name in
            segfault) row_segfault ;;
            tests) row_tests ;;
            agent_ab) row_agent_ab ;;
            optimizer_ab) row_optimizer_ab ;;
            sweep) row_sweep ;;
            demo) row_demo ;;
        esac
    done
    note "benches: $FAILS row(s) not exiting 0; $((SECONDS - DEADLINE + budget)) s of $budget"
    ((FAILS == 0))
}

# --- main --------------------------------------------------------------------------------------
STATUS=0
if ! install_wheels 2>&1 | tee "$OUT/setup.txt"; then
    echo "gpu_checks.sh: the install failed (setup.txt above): no part was run" \
        | tee "$OUT/${PART/all/suite}_summary.txt"
    exit 1
fi
cd "$RUNDIR"
if [[ $PART == suite || $PART == all ]]; then
    suite_part 2>&1 | tee "$OUT/suite.log" || STATUS=1
fi
if [[ $PART == benches || $PART == all ]]; then
    benches_part 2>&1 | tee "$OUT/benches.log" || STATUS=1
fi
for f in suite_summary.txt benches_summary.txt; do
    if [[ -f $OUT/$f ]]; then
        echo "----- $f"
        cat "$OUT/$f"
    fi
done
echo "----- results in $OUT: $(cd "$OUT" && echo *)"
exit "$STATUS"
