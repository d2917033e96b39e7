"""The agent's private torch.distributed calls, all in agent/c10d.py (the one place to fix when
torch changes), and its one conversion of values into plain wire values (agent/values.py)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from scalemon.agent import c10d, flags, values

AGENT = Path(__file__).resolve().parents[1] / "agent"
HOME = "c10d.py"
"""The one module of agent/ that may touch torch.distributed's private names."""
PRIVATE = {
    "distributed_c10d", "_distributed_c10d", "_world", "pg_map", "pg_names",
    "_get_default_group", "_set_pg_timeout", "_get_backend", "_get_sequence_number_for_group",
    "_enable_collectives_timing", "_timeout", "_dump_fr_trace", "_dump_nccl_trace",
    "_source_rank", "_get_op_type",
}
"""torch.distributed's private names the agent uses (c10d.py's), as attributes or strings."""


def private_uses(source: str) -> list[str]:
    """Where `source` touches a private torch.distributed name: an attribute or name of
    PRIVATE, a string that is one (getattr), an import of a c10d module other than the
    agent's own `c10d`; each as `line: what`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        what = None
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            what = node.attr
        elif isinstance(node, ast.Name) and node.id in PRIVATE:
            what = node.id
        elif isinstance(node, ast.Constant) and node.value in PRIVATE:
            what = repr(node.value)
        elif isinstance(node, ast.Import):
            what = next((a.name for a in node.names if "c10d" in a.name), None)
        elif isinstance(node, ast.ImportFrom) and not (node.level and (
                node.module in (None, "c10d"))):  # `from . import c10d`, `from .c10d import`
            names = [node.module or "", *(a.name for a in node.names)]
            what = next((n for n in names if "c10d" in n), None)
        if what is not None:
            found.append(f"{node.lineno}: {what}")
    return found


def test_no_agent_module_but_c10d_touches_a_private_torch_distributed_name():
    """One place to fix when torch changes: every other module calls agent/c10d.py."""
    offenders = {path.name: uses for path in sorted(AGENT.glob("*.py")) if path.name != HOME
                 and (uses := private_uses(path.read_text()))}
    assert not offenders, f"private torch.distributed calls outside agent/{HOME}: {offenders}"
    assert private_uses((AGENT / HOME).read_text())  # the scan sees them where they are


@pytest.mark.parametrize("code", [
    "from torch.distributed import distributed_c10d as c10d",
    "import torch._C._distributed_c10d as c",
    "import torch.distributed as dist\ndist.distributed_c10d._get_default_group()",
    "names = getattr(world, 'pg_names', {})",
    "getattr(c, '_dump_nccl_trace', None)",
    "pg._get_sequence_number_for_group()",
    "backend.options._timeout.total_seconds()",
])
def test_the_scan_finds_each_way_a_private_call_was_written(code):
    assert private_uses(code)


def test_the_scan_leaves_the_agents_own_names_and_prose_alone():
    code = ('"""Calls `_set_pg_timeout()` (torch._C._distributed_c10d._dump_fr_trace)."""\n'
            "from . import c10d\nfrom .c10d import sequence_number\n"
            "self._names_by_pg_id = {}\nc10d.group_names()\nset_pg_timeout(1.0)\n")
    assert private_uses(code) == []


def test_outside_a_job_every_c10d_call_falls_back():
    assert c10d.process_groups() == [] and c10d.default_group() is None
    assert c10d.default_group_timeout_s() is None and flags.pg_timeout_text() is None
    assert c10d.set_timeouts(5.0) == 0
    assert flags.set_pg_timeout(5.0).startswith("timeout 5 s on 0 process group(s)")
    assert flags.enable_collectives_timing().startswith("no NCCL group here")
    generic, _nccl = c10d.recorder_dumps()  # NCCL's only in a build with NCCL
    assert callable(generic)


def test_in_a_gloo_group_the_c10d_calls_read_and_set_what_torch_keeps(tmp_path):
    import torch.distributed as dist

    from scalemon.agent.c10d import group_ranks

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        pg = c10d.default_group()
        assert c10d.process_groups() == [pg] and c10d.group_names()[pg] == "0"
        assert flags.pg_timeout_text() == "1800"  # torch's default
        assert flags.set_pg_timeout(123.0).startswith("timeout 123 s on 1 process group(s)")
        assert c10d.default_group_timeout_s() == 123.0
        before = c10d.sequence_number(None)
        dist.all_reduce(torch.ones(1))
        assert c10d.sequence_number(None) == c10d.sequence_number(pg) == before + 1
        assert not c10d.enable_backend_timing(pg)  # gloo: no CUDA backend
        c10d.enable_group_timing(pg)
        assert group_ranks("0") == [0] and group_ranks("nope") is None
    finally:
        dist.destroy_process_group()
    assert c10d.process_groups() == [] and c10d.default_group() is None


class Version(str):
    """A str subclass, as torch's version string is."""


def test_one_conversion_makes_values_plain_and_never_reads_a_device():
    """values.plain_value is the one rule (the sender thread's, for message bodies and log()'s
    extra values alike); the training thread's readers refuse or skip a GPU tensor."""
    import numpy as np

    cases = [(np.int64(3), 3), (np.float32(0.25), 0.25), (torch.tensor(2.5), 2.5),
             (torch.ones(1, 1), 1.0), (Version("2.13"), "2.13"), (True, True), (None, None)]
    for value, plain in cases:
        got = values.plain_value(value)
        assert got == plain and type(got) is type(plain), (value, got)
        body = values.plain_values({"v": value, "nested": {"v": value}})
        assert body == {"v": plain, "nested": {"v": plain}}, value
    several = torch.ones(3)
    assert values.plain_value(several) is several  # not a value: left as it is, refused later
    body = {"step": 1, "loss": 0.5}
    assert values.plain_values(body) is body
    assert values.json_like({"p": Path("/x"), "t": (1, np.int64(2))}, "", changed := []) == {
        "p": "/x", "t": [1, 2]}
    assert changed == ["p: PosixPath"]
    assert values.host_int(np.int64(7), "step") == 7 and values.host_float(torch.tensor(0.5)) == 0.5
    assert values.host_float(None) is None and values.host_int(None, "tokens") is None
    with pytest.raises(ValueError, match="a tensor of 3 elements"):
        values.stageable(several)
    assert values.stageable(2) == 2.0 and values.stageable(torch.tensor([1.0])) is not None
    if torch.cuda.is_available():
        gpu = torch.tensor(1.0, device="cuda")
        torch.cuda.set_sync_debug_mode("error")
        try:
            assert values.plain_value(gpu) is gpu and values.host_float(gpu) is None
            assert values.stageable(gpu) is gpu
            with pytest.raises(TypeError, match="step is a CUDA tensor"):
                values.host_int(gpu, "step")
        finally:
            torch.cuda.set_sync_debug_mode("default")
