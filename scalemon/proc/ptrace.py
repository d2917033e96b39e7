"""Why this process may be refused when it reads another's stacks, said once and plainly.

py-spy reads a process's memory with ptrace (Linux) or the task port (macOS). On Linux the
kernel allows it when the reader has CAP_SYS_PTRACE, or when both run as the same user and the
Yama security module (kernel.yama.ptrace_scope) agrees:

- no Yama, or scope 0: any process of the same user may read;
- scope 1 (Ubuntu's and many clusters' default): only an ancestor of the process, or a process
  it named with prctl(PR_SET_PTRACER) (and that process's descendants: py-spy started by the
  named hub or relay counts), or a reader with CAP_SYS_PTRACE;
- scope 2: only a reader with CAP_SYS_PTRACE;
- scope 3: no process may, until the machine reboots.

A container usually runs without CAP_SYS_PTRACE (Docker's default set lacks it) under the
host's Yama setting. On macOS the reader must be root. `ptrace_obstacle(pid)` puts whichever
of these blocks reading `pid` into one sentence, or None where reading should work.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

YAMA_SCOPE = Path("/proc/sys/kernel/yama/ptrace_scope")
"""Yama's setting; absent where the kernel has no Yama. (Module attributes, for tests.)"""
SELF_STATUS = Path("/proc/self/status")
"""This process's status: its effective capabilities (CapEff)."""
PROC = Path("/proc")
CONTAINER_MARKS = (Path("/.dockerenv"), Path("/run/.containerenv"))
"""Files a container runtime leaves at the root (Docker's, Podman's)."""
CAP_SYS_PTRACE = 19
"""The capability's bit in CapEff (linux/capability.h)."""
AGENT_NAMES_READER = ("scalemon's agent names its node's hub or relay as its reader "
                      "(scalemon 1.12 or later)")


def ptrace_scope() -> int | None:
    """kernel.yama.ptrace_scope (0-3), or None where the kernel has no Yama (or it cannot be
    read)."""
    try:
        return int(YAMA_SCOPE.read_text().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace() -> bool | None:
    """Whether this process holds CAP_SYS_PTRACE in its effective set (None where
    /proc/self/status cannot be read)."""
    try:
        for line in SELF_STATUS.read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def target_uids(pid: int) -> tuple[int, ...] | None:
    """The real, effective, saved and filesystem user ids of process `pid`, or None."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("Uid:"):
                return tuple(int(u) for u in line.split()[1:])
    except (OSError, ValueError):
        return None
    return None


def in_container() -> bool:
    """Whether this process runs in a container (Docker, Podman, Kubernetes), by the marks
    the runtimes leave."""
    if any(mark.exists() for mark in CONTAINER_MARKS):
        return True
    try:
        cgroups = (PROC / "1" / "cgroup").read_text()
    except OSError:
        return False
    return any(word in cgroups for word in ("docker", "kubepods", "containerd", "libpod"))


def is_ancestor_of(pid: int) -> bool:
    """Whether this process is `pid` or one of its ancestors (walking /proc/PID/stat's ppid)."""
    me, seen = os.getpid(), set()
    while pid > 0 and pid not in seen:
        if pid == me:
            return True
        seen.add(pid)
        try:
            stat = (PROC / str(pid) / "stat").read_bytes()
            pid = int(stat.rpartition(b")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            return False
    return False


def ptrace_obstacle(pid: int, named: bool = False) -> str | None:
    """What would stop this process (and py-spy, its child) from reading process `pid`, in
    one sentence that says what to do, or None when reading should work. `named`: the
    process said it named this one as its reader (prctl PR_SET_PTRACER), which Yama's scope 1
    lets through; /proc does not show it. A process that does not exist is no obstacle of
    permission: None."""
    if sys.platform == "darwin":
        if os.geteuid() != 0:
            return ("on macOS only root may read another process's memory: run the hub or "
                    "relay as root (sudo) to read ranks' stacks")
        return None
    if not sys.platform.startswith("linux"):
        return None
    uids = target_uids(pid)
    if uids is None and not (PROC / str(pid)).exists():
        return None
    scope = ptrace_scope()
    if scope == 3:
        return ("no process may read another's memory on this machine "
                "(kernel.yama.ptrace_scope is 3, until reboot), so ranks' stacks cannot be read")
    cap = has_cap_sys_ptrace()
    if cap:
        return None
    fix_cap = ("start the container with --cap-add SYS_PTRACE" if in_container()
               else "give py-spy the capability (sudo setcap cap_sys_ptrace+ep $(which py-spy))")
    me = os.getuid()
    if uids is not None and any(u != me for u in uids[:3]):
        owner = uids[1] if len(uids) > 1 else uids[0]
        return (f"process {pid} runs as uid {owner} and this one as uid {me}, without "
                f"CAP_SYS_PTRACE: run the hub or relay as that user, or {fix_cap}")
    if scope == 2:
        return ("kernel.yama.ptrace_scope is 2: only a process with CAP_SYS_PTRACE may read "
                f"another: {fix_cap}, or set `sysctl kernel.yama.ptrace_scope=1`")
    if scope == 1 and not named and not is_ancestor_of(pid):
        return ("kernel.yama.ptrace_scope is 1: only a process the rank names "
                "(prctl PR_SET_PTRACER) or its ancestor may read it, and this one is "
                f"neither; {AGENT_NAMES_READER}; else {fix_cap}")
    return None
