"""The history store on its own: records beyond the in-memory bound come back from the file,
and a torn last record (a hub killed mid-write) is dropped when the file is reopened or read."""

from __future__ import annotations

import logging

from scalemon import protocol
from scalemon.home.history import HISTORY_FILE, History, history_path, read_messages, read_records


def frames(n: int, start: int = 0, job: str = "j") -> list[bytes]:
    return [protocol.encode("step", job, 0, i, {"step": i}, t=1.0) for i in range(start, n)]


def test_records_beyond_the_memory_bound_are_read_back_from_the_file(tmp_path):
    history = History(tmp_path / HISTORY_FILE, memory_limit=10)
    written = frames(50)
    for i, frame in enumerate(written):
        assert history.append(frame) == i
    assert len(history) == 50 and len(history._memory) == 10  # only the newest in memory
    assert history.get(0, 50) == written  # 40 from the file, then 10 from memory
    assert history.get(5, 3) == written[5:8]
    assert history.get(38, 5) == written[38:43]  # across the boundary
    assert history.get(45, 100) == written[45:]
    assert history.get(50, 10) == []
    history.close()


def test_a_torn_last_record_is_dropped_and_numbering_goes_on(tmp_path, caplog):
    path = tmp_path / HISTORY_FILE
    history = History(path)
    for frame in frames(3):
        history.append(frame)
    history.close()
    whole = path.stat().st_size
    torn = frames(4, 3)[0]
    with open(path, "ab") as f:  # a hub killed half-way through writing record 3
        f.write(len(torn).to_bytes(4, "big") + torn[: len(torn) // 2])
    assert [protocol.decode(r).body["step"] for r in read_records(path)] == [0, 1, 2]
    messages, rejected = read_messages(path)
    assert [seq for seq, _ in messages] == [0, 1, 2] and rejected == 1  # the torn tail
    with caplog.at_level(logging.WARNING, logger="scalemon.hub"):
        reopened = History(path)
    torn_bytes = 4 + len(torn) // 2  # kept aside, not thrown away
    assert f"{torn_bytes} damaged bytes in 1 stretch(es) moved to" in caplog.text
    assert (tmp_path / (HISTORY_FILE + ".damaged")).stat().st_size == torn_bytes
    assert reopened.recovery["torn_tail_only"] and reopened.recovery["records"] == 3
    assert path.stat().st_size == whole and len(reopened) == 3
    assert reopened.append(frames(4, 3)[0]) == 3
    assert [protocol.decode(r).body["step"] for r in reopened.get(0, 10)] == [0, 1, 2, 3]
    reopened.close()


def test_a_torn_length_header_alone_is_dropped_too(tmp_path):
    path = tmp_path / HISTORY_FILE
    history = History(path)
    history.append(frames(1)[0])
    history.close()
    with open(path, "ab") as f:
        f.write(b"\x00\x00")  # two of the four length bytes
    assert len(list(read_records(path))) == 1
    assert len(History(path)) == 1


def test_history_path_is_inside_the_jobs_run_directory(tmp_path):
    assert history_path("job-1", tmp_path) == tmp_path / "run" / "job-1" / HISTORY_FILE


def test_the_history_file_is_named_in_one_module_and_read_without_the_hub(tmp_path):
    """`scalemon snapshot` and the dashboard replay a history through scalemon.home.history, with
    nothing of the hub's package imported."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    sources = [p for folder in ("scalemon", "agent", "hub", "tui", "demo_train")
               for p in (REPO / folder).rglob("*.py")]
    naming = [p.relative_to(REPO).as_posix() for p in sources
              if '"history.smlog"' in p.read_text()]
    assert naming == ["scalemon/home/history.py"]

    path = history_path("jobR", tmp_path)
    path.parent.mkdir(parents=True)
    history = History(path)
    history.append(frames(2, 1, job="jobR")[0])  # one step, step 1
    history.close()
    code = (
        "import sys\n"
        "from scalemon.cli import snapshot as cli\n"
        "from scalemon.tui.feed import HubFeed\n"
        "from scalemon.tui.model import DashboardData\n"
        "state = cli._offline_state('jobR')\n"
        "assert state['state']['ranks'][0]['step'] == 1, state\n"
        "data = DashboardData()\n"
        "assert HubFeed(job='jobR')._replay_history(data) and data.records == 1\n"
        "hub = sorted(m for m in sys.modules if m.startswith('scalemon.hub'))\n"
        "assert not hub, hub\n"
    )
    env = {**os.environ, "SCALEMON_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
