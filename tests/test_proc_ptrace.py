"""Why reading another process may be refused (`scalemon.proc.ptrace`), with Yama's setting and
this process's capabilities put in files of the test's own (this machine has no Yama and runs
the tests as root, so each case is made up around a real target process); and the agent's
side (`scalemon.agent.ptracer`), which names its reader and never raises."""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

import pytest
from proc_children import SLEEPER, child

from scalemon.agent import ptracer
from scalemon.proc import ptrace
from scalemon.proc.ptrace import has_cap_sys_ptrace, ptrace_obstacle, ptrace_scope

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's rules")

WITH_CAP = f"{1 << 19 | 1 << 21:016x}"  # CAP_SYS_PTRACE and CAP_SYS_ADMIN
WITHOUT_CAP = f"{1 << 21:016x}"


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """`machine(scope, cap, container=False)`: Yama's scope (None: no Yama) and whether this
    process holds CAP_SYS_PTRACE, as ptrace.py will read them."""
    def make(scope: int | None, cap: bool, container: bool = False) -> None:
        yama = tmp_path / "ptrace_scope"
        yama.unlink(missing_ok=True)
        if scope is not None:
            yama.write_text(f"{scope}\n")
        status = tmp_path / "status"
        status.write_text(f"Name:\tpython\nCapInh:\t0000000000000000\n"
                          f"CapEff:\t{WITH_CAP if cap else WITHOUT_CAP}\n")
        monkeypatch.setattr(ptrace, "YAMA_SCOPE", yama)
        monkeypatch.setattr(ptrace, "SELF_STATUS", status)
        monkeypatch.setattr(ptrace, "in_container", lambda: container)

    return make


def test_the_files_are_read(machine):
    machine(None, cap=True)
    assert ptrace_scope() is None and has_cap_sys_ptrace() is True
    machine(2, cap=False)
    assert ptrace_scope() == 2 and has_cap_sys_ptrace() is False


def test_this_machine():
    """Whatever this machine is, the real files are read without error."""
    assert ptrace_scope() in (None, 0, 1, 2, 3)
    assert has_cap_sys_ptrace() in (True, False)


def test_no_yama_and_the_same_user_reads(machine):
    machine(None, cap=False)
    assert ptrace_obstacle(os.getppid()) is None


def test_scope_3_forbids_everyone_even_with_the_capability(machine):
    machine(3, cap=True)
    assert ptrace_obstacle(os.getppid()) == (
        "no process may read another's memory on this machine (kernel.yama.ptrace_scope is 3, "
        "until reboot), so ranks' stacks cannot be read")


def test_scope_2_needs_the_capability(machine):
    machine(2, cap=True)
    assert ptrace_obstacle(os.getppid()) is None
    machine(2, cap=False)
    said = ptrace_obstacle(os.getppid())
    assert said is not None and said.startswith("kernel.yama.ptrace_scope is 2: only a process "
                                                "with CAP_SYS_PTRACE may read another")
    assert "setcap cap_sys_ptrace+ep" in said and "sysctl kernel.yama.ptrace_scope=1" in said
    machine(2, cap=False, container=True)
    said = ptrace_obstacle(os.getppid())
    assert said is not None and "--cap-add SYS_PTRACE" in said and "setcap" not in said


def test_scope_1_lets_an_ancestor_or_a_named_reader_through(machine, tmp_path):
    machine(1, cap=False)
    said = ptrace_obstacle(os.getppid())  # our parent: not our descendant, did not name us
    assert said is not None and said.startswith(
        "kernel.yama.ptrace_scope is 1: only a process the rank names (prctl PR_SET_PTRACER) or "
        "its ancestor may read it, and this one is neither")
    assert "names its node's hub or relay" in said
    assert ptrace_obstacle(os.getppid(), named=True) is None
    with child(SLEEPER, tmp_path) as proc:  # our child: we are its ancestor
        assert ptrace_obstacle(proc.pid) is None
    machine(1, cap=True)
    assert ptrace_obstacle(os.getppid()) is None


def test_another_user_s_process(machine, monkeypatch):
    other = os.getuid() + 1000
    monkeypatch.setattr(ptrace, "target_uids", lambda pid: (other, other, other, other))
    machine(None, cap=False)
    said = ptrace_obstacle(os.getppid())
    assert said == (f"process {os.getppid()} runs as uid {other} and this one as uid "
                    f"{os.getuid()}, without CAP_SYS_PTRACE: run the hub or relay as that "
                    "user, or give py-spy the capability (sudo setcap cap_sys_ptrace+ep "
                    "$(which py-spy))")
    machine(None, cap=False, container=True)
    assert ptrace_obstacle(os.getppid()).endswith("start the container with --cap-add SYS_PTRACE")
    machine(1, cap=True)
    assert ptrace_obstacle(os.getppid()) is None


def test_a_process_that_is_not_there_is_no_obstacle(machine):
    machine(2, cap=False)
    pid = os.spawnlp(os.P_NOWAIT, "true", "true")
    os.waitpid(pid, 0)
    assert ptrace_obstacle(pid) is None


# -- the agent's side -------------------------------------------------------------------------


def test_allow_reader_names_the_reader_or_says_it_is_not_needed():
    """Real prctl calls: on this machine (no Yama) the kernel answers EINVAL, "not needed";
    with Yama it takes the name."""
    yama = Path("/proc/sys/kernel/yama/ptrace_scope").exists()
    outcome = ptracer.name_reader(os.getppid())
    assert outcome == (ptracer.NAMED if yama else ptracer.NOT_NEEDED)
    assert ptracer.allow_reader(os.getppid()) is True
    assert ptracer.allow_reader(0) in (True, False)  # 0 clears the name; never raises
    assert ptracer.allow_reader(2 ** 40) in (True, False)


def test_what_each_prctl_answer_means():
    assert ptracer.outcome(0, 0, True, 7) == ptracer.NAMED
    assert ptracer.outcome(-1, errno.EINVAL, False, 7) == ptracer.NOT_NEEDED
    assert ptracer.outcome(-1, errno.EINVAL, True, 7) == "refused: no process 7 to name"
    assert ptracer.outcome(-1, errno.EPERM, True, 7) == \
        f"refused: {os.strerror(errno.EPERM)}"


def test_allow_reader_never_raises(monkeypatch):
    def broken(*args: object) -> int:
        raise OSError("no libc")

    monkeypatch.setattr(ptracer, "_prctl", broken)
    assert ptracer.name_reader(os.getppid()) == "refused: no libc"
    assert ptracer.allow_reader(os.getppid()) is False
    monkeypatch.setattr(ptracer, "_prctl", None)
    monkeypatch.setattr(ptracer, "LINUX", False)
    assert ptracer.name_reader(os.getppid()) == ptracer.UNSUPPORTED
    assert ptracer.allow_reader(os.getppid()) is False


def test_the_agent_names_the_process_holding_its_nodes_hub_or_relay_lock(tmp_path) -> None:
    from scalemon.agent.ptracer import NAMED, NOT_NEEDED, ReaderNaming

    naming = ReaderNaming(f"ipc://{tmp_path}/ingest.sock")
    naming.check(0.0)
    assert naming.named_pid is None  # no hub or relay yet: nothing to name
    (tmp_path / "relay.lock").write_text(str(os.getppid()))
    naming.check(1.0)
    assert naming.named_pid is None  # checked again only after CHECK_S
    naming.check(10.0)
    assert naming.named_pid == os.getppid() and naming.outcome in (NAMED, NOT_NEEDED)
    assert ReaderNaming("tcp://h:1").directory is None  # a hub elsewhere: no lock to read
