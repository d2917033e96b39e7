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


# --- sealed chunks ---------------------------------------------------------------------------
def step_frames(n: int, ranks: int = 4, job: str = "j") -> list[bytes]:
    """`n` step records of `ranks` ranks, a step at a time (rank r's step n // ranks)."""
    return [protocol.encode("step", job, i % ranks, i // ranks, {"step": i // ranks,
                                                                 "loss": 1.0 + i % 7}, t=1.0 + i)
            for i in range(n)]


def sealed_history(tmp_path, n: int = 400, seal_bytes: int = 2000):
    path = tmp_path / HISTORY_FILE
    history = History(path, memory_limit=10, seal_bytes=seal_bytes)
    written = step_frames(n)
    for frame in written:
        history.append(frame)
        history.flush()
    history.settle()  # the last seal written
    return path, history, written


def test_the_tail_is_sealed_into_compressed_chunks_and_read_back_whole(tmp_path):
    from scalemon.home import chunks

    path, history, written = sealed_history(tmp_path)
    entries, damaged, _ = chunks.load_index(path)
    assert len(entries) > 5 and not damaged
    assert path.stat().st_size < 2000  # the tail: only what is not sealed yet
    assert history.get(0, 1000) == written  # from the chunks, the tail and memory
    assert history.get(123, 7) == written[123:130]
    assert history.pick([0, 150, 399]) == [written[0], written[150], written[399]]
    history.close()
    assert list(read_records(path)) == written
    messages, rejected = read_messages(path, "j")
    assert [seq for seq, _ in messages] == list(range(400)) and rejected == 0
    chunked = path.with_name(path.name + chunks.CHUNKS_SUFFIX).stat().st_size
    assert chunked < sum(4 + len(f) for f in written) / 2  # compressed
    reopened = History(path, seal_bytes=2000)
    assert len(reopened) == 400 and reopened.get(0, 1000) == written
    assert reopened.append(step_frames(401)[400]) == 400
    reopened.close()


def test_one_ranks_or_one_step_ranges_records_read_only_the_chunks_that_hold_them(tmp_path):
    from scalemon.home.history import ReadStats, Selection, read_selected

    path, history, written = sealed_history(tmp_path, n=800)
    history.close()
    everything = ReadStats()
    read_selected(path, Selection(), stats=everything)
    stats = ReadStats()
    steps = read_selected(path, Selection(steps=(20, 29)), stats=stats)
    assert sorted({m.body["step"] for _, m in steps}) == list(range(20, 30))
    assert len(steps) == 40 and stats.chunks_read < everything.chunks_read / 4
    one = read_selected(path, Selection(ranks={2}))
    assert [m.rank for _, m in one] == [2] * 200
    assert [seq for seq, _ in one] == list(range(2, 800, 4))
    records = read_selected(path, Selection(seqs=(500, 509)))
    assert [seq for seq, _ in records] == list(range(500, 510))


def test_a_hub_killed_between_sealing_and_cutting_the_tail_loses_and_repeats_nothing(tmp_path):
    from scalemon.home import chunks

    path, history, written = sealed_history(tmp_path, n=100, seal_bytes=10_000_000)
    history.close()
    tail = path.read_bytes()
    sealed = History(path, seal_bytes=100)
    sealed.settle()  # seals the whole tail and cuts it
    sealed.close()
    assert path.stat().st_size == 0
    path.write_bytes(tail + (len(written[0]).to_bytes(4, "big") + written[0]))  # uncut + 1
    reopened = History(path, seal_bytes=10_000_000)
    assert len(reopened) == 101 and reopened.get(0, 200) == [*written, written[0]]
    reopened.close()
    assert len(chunks.load_index(path)[0]) >= 1
    assert len(list(read_records(path))) == 101


def test_damage_in_a_chunk_is_salvaged_and_a_torn_chunk_set_aside(tmp_path):
    from scalemon.home import chunks

    path, history, written = sealed_history(tmp_path)
    history.close()
    entries, _, size = chunks.load_index(path)
    chunk_file = path.with_name(path.name + chunks.CHUNKS_SUFFIX)
    data = bytearray(chunk_file.read_bytes())
    middle = entries[3]
    data[middle.offset + middle.length // 2] ^= 0xFF  # within a chunk's compressed bytes
    chunk_file.write_bytes(bytes(data) + b"SMC1\x00\x00")  # and a torn header after the last
    messages, rejected = read_messages(path, "j")
    seqs = [seq for seq, _ in messages]
    assert rejected >= 2 and 0 < len(seqs) < 400  # the damaged chunk, the torn end
    assert seqs[:middle.first] == list(range(middle.first))  # every other chunk whole
    assert seqs[-(400 - middle.stop):] == list(range(middle.stop, 400))
    salvaged = [(seq, m) for seq, m in messages if middle.first <= seq < middle.stop]
    assert all(protocol.decode(written[seq]) == m for seq, m in salvaged)  # numbered right
    reopened = History(path, seal_bytes=2000)
    assert reopened.recovery["chunks_set_aside_bytes"] == 6
    assert chunk_file.stat().st_size == size
    assert len(reopened) == 400 and reopened.append(written[0]) == 400
    reopened.close()


def test_a_history_of_an_earlier_version_is_read_and_sealed_on(tmp_path):
    path = tmp_path / HISTORY_FILE
    written = step_frames(50)
    path.write_bytes(b"".join(len(f).to_bytes(4, "big") + f for f in written))  # old format
    assert list(read_records(path)) == written
    history = History(path, seal_bytes=1000)
    assert len(history) == 50
    history.append(written[0])
    history.settle()  # seals the old file's records too
    assert path.stat().st_size == 0
    assert history.get(0, 100) == [*written, written[0]]
    history.close()
    assert [seq for seq, _ in read_messages(path)[0]] == list(range(51))


def test_one_ranks_records_are_read_from_its_lane_of_each_chunk_only(tmp_path, monkeypatch):
    from scalemon.home import chunks
    from scalemon.home.history import ReadStats, Selection, read_selected

    monkeypatch.setattr(chunks, "LANE_BYTES", 2048)
    path = tmp_path / HISTORY_FILE
    history = History(path, seal_bytes=32_000)
    written = step_frames(3200, ranks=64)
    for frame in written:
        history.append(frame)
    history.settle()
    history.close()
    everything, one = ReadStats(), ReadStats()
    assert [seq for seq, _ in read_selected(path, Selection(), stats=everything)] == list(
        range(3200))
    records = read_selected(path, Selection(ranks={17}), stats=one)
    assert [seq for seq, _ in records] == list(range(17, 3200, 64))
    assert one.bytes_read < everything.bytes_read / 8


def test_the_hubs_told_cover_of_a_record_is_what_reading_it_gives() -> None:
    """The hub tells the history what each record covers (`hub.ingest._cover`), so sealing
    never unpacks a record again: it must be what `chunks.record_cover` reads."""
    from scalemon.home.chunks import Cover
    from scalemon.hub.ingest import _cover

    frames = [protocol.encode("step", "j", 3, 0, {"step": 7, "loss": 1.0}, 10.0),
              protocol.encode("heartbeat", "j", 4, 1, {"step": 9}, 11.0),
              protocol.encode("rank_state", "j", protocol.HUB_RANK, 2,
                              {"target": 3, "state": "running"}, 12.0)]
    read, told = Cover(), Cover()
    for frame in frames:
        assert read.add(frame) == told.add(frame, _cover(protocol.decode_stored(frame)))
    assert read == told and told.steps == [7, 7] and told.ranks == [-1, 4]
