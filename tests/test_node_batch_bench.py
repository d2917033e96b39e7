"""`bench/node_batch_cost.py`: its prototype node batch gives back the very records its ranks
sent, refuses what `protocol.decode` refuses, and the bench writes its figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from conftest import REPO
from scalemon import protocol

sys.path.insert(0, str(REPO / "bench"))
import node_batch_cost as bench  # noqa: E402


def test_a_batch_gives_back_every_record_in_order_and_packs_as_the_ranks_did() -> None:
    frames = bench.node_frames(16, heartbeat_every=3)
    records = bench.decode_batch(bench.encode_batch(frames))
    assert records == [protocol.decode(f) for f in frames]
    assert [bench.repack(m) for m in records] == frames


def test_a_batch_with_a_value_decode_refuses_is_refused() -> None:
    frames = bench.node_frames(8, heartbeat_every=0)
    obj = msgpack.unpackb(bench.encode_batch(frames))
    fields, columns = obj["groups"][0][2], obj["groups"][0][6]
    columns[fields.index("step")][3] = "4"  # a step that is not an int
    with pytest.raises(protocol.ProtocolError, match="step.step"):
        bench.decode_batch(msgpack.packb(obj))
    with pytest.raises(protocol.ProtocolError):
        protocol.decode(protocol.encode("step", bench.JOB, 3, 1, {"step": "4"}))


@pytest.mark.timeout(120)
def test_the_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "node_batch_cost.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "node_batch_cost.py"),
                           "--sizes", "8", "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = json.loads(out.read_text())
    (row,) = run["runs"]
    assert row["batch_records"] == 8 and row["decode_us"] > 0 and row["merge_us"] > 0
    assert run["fold_us_per_step_record"] > 0
