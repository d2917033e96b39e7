"""Text that comes from outside the dashboard is shown as typed on every screen of the real app
(App.run_test + Pilot): never read as markup (a gloo error's "[/__w/.../pair.cc:553]" used to
stop the dashboard with a MarkupError), and no control character reaches the terminal (ESC
shows as "\\x1b", BEL as "\\x07", CR is dropped).

Every field a rank, the hub or a job file fills is given such text: the job id, hosts, errors,
exit reasons, `log()` extras and their names, `info` facts and the configuration, group and op
names, phases, stacks, flag values and notes, the toggle audit, log lines and their source,
hub notes, Flight Recorder dump paths and analyses, NCCL RAS reports, and a job file's host in
the job picker.
"""

from __future__ import annotations

import asyncio
import re

from test_tui_app import until
from test_tui_snapshots import screen_text

from scalemon import protocol
from scalemon.collectives import CollectiveStats, size_bucket
from scalemon.home.jobfile import JobFile
from scalemon.protocol import HUB_RANK, Message
from scalemon.tui.app import DashboardApp
from scalemon.tui.model import DashboardData
from scalemon.tui.safe_text import clean, literal_text
from scalemon.tui.screens.collectives import CollectivesScreen
from scalemon.tui.screens.flags import FlagsScreen, ToggleDialog
from scalemon.tui.screens.hang import HangScreen
from scalemon.tui.screens.help import HelpScreen
from scalemon.tui.screens.log import LogScreen
from scalemon.tui.screens.overview import OverviewScreen
from scalemon.tui.screens.pick_job import PickJobScreen
from scalemon.tui.screens.rank_detail import KEYS, RankDetailScreen
from scalemon.tui.sim import GROUP, SimJob

RANKS = 3
SIZE = (200, 60)
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
"""Control characters that must never reach the terminal (the newline is the screen's own)."""

# (what comes in, what the screen must show): markup brackets stay, ESC and BEL show as
# their escapes, CR is dropped, a tab becomes spaces
JOB = ("[/x]job[bold]\x07", "[/x]job[bold]\\x07")
HOST = ("[/x]n\x1b[31m\r", "[/x]n\\x1b[31m")
GROUP_DESC = ("[/x]pg[bold]\x1b", "[/x]pg[bold]\\x1b")
OP = ("[/x]allred\x07", "[/x]allred\\x07")
PHASE = ("[/p]\x1b", "[/p]\\x1b")
CONFIG = ("/data/[/x]\x1b[2J", "/data/[/x]\\x1b[2J")
EXTRA_NOTE = ("[/] [bold]x\x1b[0m", "[/] [bold]x\\x1b[0m")
EXTRA_NAME = ("[/x]lr\x1b", "[/x]lr\\x1b")
INFO_KEY = ("[/x]key\x07", "[/x]key\\x07")
INFO_VALUE = ("[bold]v\x1b[1m", "[bold]v\\x1b[1m")
FLAG_VALUE = ("[/x]INFO\x1b", "[/x]INFO\\x1b")
FLAG_WHY = ("[/x]why[bold]\x07", "[/x]why[bold]\\x07")
RESTART_REASON = ("[/x]no ckpt\x1b", "[/x]no ckpt\\x1b")
TOGGLE_USER = ("[/x]al\x1b", "[/x]al\\x1b")
TOGGLE_TEXT = ("[/x]planned\x07", "[/x]planned\\x07")
TOGGLE_FAILED = ("[/x]bad\x1b[5m", "[/x]bad\\x1b[5m")
LOG_LINE = ("NCCL WARN [/x] [bold] \x1b[31mred\x07\r", "NCCL WARN [/x] [bold] \\x1b[31mred\\x07")
LOG_SOURCE = ("[/s]\x1b", "[/s]\\x1b")
HUB_NOTE = ("[/x]note\x07", "[/x]note\\x07")
STACK = ('  File "/w/[/x].py", line 1\x1b[31m\n    boom()\t[bold]\n',
         ('  File "/w/[/x].py", line 1\\x1b[31m', "    boom()  [bold]"))
RAS = ("[/x]ras[bold]\x1b", "[/x]ras[bold]\\x1b")
DUMP_DIR = ("/tmp/fr/[/x]\x1b", "/tmp/fr/[/x]\\x1b")
ANALYSIS = ("[/x] analysis [bold]\x07", "[/x] analysis [bold]\\x07")
GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:21901.")
"""The error of every gloo rank whose peer went away: it used to stop the dashboard."""
ERRORS = {r: (f"{GLOO} \x1b[31m\x07\r\n[/x] rank {r} [bold]\x1b[0m",
              f"{GLOO} \\x1b[31m\\x07\n[/x] rank {r} [bold]\\x1b[0m") for r in range(RANKS)}
REASON = ("[/x]reason[bold]\x1b[1m", "[/x]reason[bold]\\x1b[1m")


def encoded(messages: list[Message]) -> list[Message]:
    """Each message through the wire format (checks it is a valid one)."""
    return [protocol.decode(protocol.encode(m.type, m.job, m.rank, m.seq, m.body, t=m.t))
            for m in messages]


def hung_job() -> tuple[SimJob, DashboardData, float]:
    """Three ranks with such text everywhere that ran 20 steps, then hung (rank 1 never issues
    the next all-reduce); returns the job, the data and the time after."""
    sim = SimJob(job=JOB[0], ranks=RANKS, gpu=False, amp=False)
    messages = sim.run(20)
    for m in messages:
        _spoil(m)
    t = sim.end_t(20)
    for rank in range(RANKS):
        messages += _rank_facts(sim, rank, t)
    messages += _hub_facts(sim, t)
    hang = sim.hang(1, 20, stuck_s=15.0)
    for m in hang:
        m.body["stack"] = STACK[0]
        if m.body.get("inflight"):
            m.body["inflight"][0][2] = OP[0]
        else:
            m.body["phase"] = PHASE[0]
    messages += hang
    data = DashboardData()
    data.apply_messages(encoded(messages))
    return sim, data, t + 15.5


def _spoil(m: Message) -> None:
    """Such text in the hello, the steps' extras and the group's description."""
    if m.type == "hello":
        m.body["host"] = HOST[0]
        m.body["config"]["data"] = CONFIG[0]
    elif m.type == "step":
        m.body["extra"].update({"note": EXTRA_NOTE[0], EXTRA_NAME[0]: 0.5})
    elif m.type == "collectives" and m.body["groups"]:
        m.body["groups"][GROUP]["desc"] = GROUP_DESC[0]


def _rank_facts(sim: SimJob, rank: int, t: float) -> list[Message]:
    """A rank's collectives of an op with such a name, info, flags, a toggle result, logs."""
    stats = CollectiveStats()
    row = stats.row(GROUP, OP[0], size_bucket(1024))
    row.count, row.bytes = 3, 3 * 1024
    row.add_time(0.001)
    value = FLAG_VALUE[0] if rank == 0 else "WARN"
    return [
        sim.message(rank, "collectives", {"groups": {}, "stats": stats.to_wire(), "issues": [],
                                          "step": 20}, t),
        sim.message(rank, "info", {"key": INFO_KEY[0], "value": {"path": INFO_VALUE[0]}}, t),
        sim.message(rank, "flags", {
            "values": {"NCCL_DEBUG": value}, "notes": {"NCCL_DEBUG": ["restart", FLAG_WHY[0]]},
            "restart": {"ok": False, "reason": RESTART_REASON[0]}, "rebuild": True}, t),
        sim.message(rank, "toggle_result", {"id": 1, "name": "NCCL_DEBUG", "value": "INFO",
                                            "outcome": "failed", "text": TOGGLE_FAILED[0]}, t),
        sim.message(rank, "log_lines", {"source": "nccl", "lines": [LOG_LINE[0]]}, t),
        sim.message(rank, "log_lines", {"source": LOG_SOURCE[0], "lines": ["plain"]}, t),
    ]


def _hub_facts(sim: SimJob, t: float) -> list[Message]:
    """The hub's toggle record, a note, a Flight Recorder dump; rank 0's NCCL RAS report."""
    return [
        sim.message(HUB_RANK, "toggle", {
            "id": 1, "name": "NCCL_DEBUG", "value": "INFO", "state": "partial", "tier": "live",
            "user": TOGGLE_USER[0], "client_host": "[bold]h", "at_step": 21,
            "text": TOGGLE_TEXT[0]}, t),
        sim.message(HUB_RANK, "hub_note", {"kind": "history", "text": HUB_NOTE[0]}, t),
        sim.message(HUB_RANK, "fr_dump", {
            "directory": DUMP_DIR[0], "state": "analysed", "requested": [0, 1, 2],
            "written": [0, 1], "missing": [2], "analysis": ANALYSIS[0], "exit_code": 0}, t),
        sim.message(0, "info", {"key": "nccl_ras", "value": {"t": t, "status": RAS[0],
                                                             "error": None}}, t),
    ]


def exits(sim: SimJob, t: float) -> list[Message]:
    """Every rank exits with such an error and reason."""
    return encoded([sim.message(r, "exit", {"reason": REASON[0], "exit_code": 1, "step": 20,
                                            "error": ERRORS[r][0]}, t) for r in range(RANKS)])


def squeezed(text: str) -> str:
    """`text` without whitespace: long text wraps in its column."""
    return re.sub(r"\s+", "", text)


def missing(text: str, expected: tuple[str, ...]) -> list[str]:
    """What of `expected` is not in `text` (whitespace aside: long text wraps in its column)."""
    return [e for e in expected if squeezed(e) not in squeezed(text)]


def shows(app: DashboardApp, *expected: str) -> bool:
    """The screen holds everything expected, and no control character."""
    text = screen_text(app)
    assert not CONTROL.findall(text), f"control characters on screen: {text!r}"
    return not missing(text, expected)


async def visit(pilot, app: DashboardApp, key: str, screen: type, *expected: str) -> str:
    """Press `key`, wait for `screen` to show everything expected; returns its text. Fails
    when a control character reached the screen."""
    await pilot.press(key)
    seen = [""]

    def drawn() -> bool:
        """the screen and every expected text (or a control character)"""
        if not isinstance(app.screen, screen):
            return False
        seen[0] = text = screen_text(app)
        return bool(CONTROL.search(text)) or not missing(text, expected)

    try:
        await until(pilot, drawn, timeout=20)
    except AssertionError:
        raise AssertionError(f"{screen.__name__} after {key!r} misses "
                             f"{missing(seen[0], expected)}:\n{seen[0]}") from None
    assert not CONTROL.findall(seen[0]), f"control characters on screen: {seen[0]!r}"
    return seen[0]


def test_text_from_ranks_and_the_hub_shows_as_typed_on_every_screen():
    """Hang view, overview, collectives, flags (and the change dialog), log, help, and the
    detail of every rank before and after they exit with a gloo error: the app never stops,
    every text is on screen as typed (control characters made visible)."""
    sim, data, now = hung_job()
    clock = [now]

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: clock[0])
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, HangScreen), timeout=20)
            await visit(pilot, app, "d", HangScreen, OP[1], GROUP_DESC[1], PHASE[1], *STACK[1],
                        RAS[1], HOST[1], DUMP_DIR[1], ANALYSIS[1])
            await visit(pilot, app, "escape", OverviewScreen, JOB[1], HOST[1], PHASE[1],
                        HUB_NOTE[1], OP[1])
            await visit(pilot, app, "c", CollectivesScreen, OP[1], GROUP_DESC[1])
            await visit(pilot, app, "f", FlagsScreen, FLAG_VALUE[1], FLAG_WHY[1],
                        TOGGLE_USER[1], "[bold]h", TOGGLE_TEXT[1], TOGGLE_FAILED[1])
            await visit(pilot, app, "R", ToggleDialog, RESTART_REASON[1])
            await visit(pilot, app, "escape", FlagsScreen)
            await visit(pilot, app, "L", LogScreen, LOG_LINE[1], LOG_SOURCE[1])
            await visit(pilot, app, "escape", OverviewScreen)
            await visit(pilot, app, "question_mark", HelpScreen)
            await visit(pilot, app, "escape", OverviewScreen)
            await every_rank(pilot, app, HOST[1], CONFIG[1], EXTRA_NOTE[1], EXTRA_NAME[1],
                             INFO_KEY[1], INFO_VALUE[1])
            data.apply_messages(exits(sim, now + 1))
            clock[0] = now + 2
            await every_rank(pilot, app, REASON[1], errors=True)
            assert app.is_running

    asyncio.run(scenario())


async def every_rank(pilot, app: DashboardApp, *expected: str, errors: bool = False) -> None:
    """Enter on each row of the rank table (Down to the next): its detail shows `expected`
    (and its own error when `errors`); Esc back."""
    await pilot.press("home")
    for rank in range(RANKS):
        mine = (ERRORS[rank][1],) if errors else ()
        text = await visit(pilot, app, "enter", RankDetailScreen, f"rank {rank}  ·", *expected,
                           *mine)
        assert app.screen.rank == rank, text
        await visit(pilot, app, "escape", OverviewScreen)
        await pilot.press("down")


def test_the_job_picker_shows_hosts_as_typed(home):
    """Job files whose host holds markup and control characters (a hub checks job ids, not
    host names): the picker lists them as typed and attaches to the chosen one."""
    jobs = [JobFile(job=f"job{i}", address=f"ipc:///tmp/none{i}", host=HOST[0], pid=100 + i,
                    started=1_700_000_000.0, world_size=2, run_dir="/tmp", protocol=[1, 0])
            for i in range(2)]

    async def scenario() -> None:
        app = DashboardApp(jobs=jobs, home=home)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, lambda: isinstance(app.screen, PickJobScreen)
                        and shows(app, "job0", f"hub pid 101 on {HOST[1]}"))
            await pilot.press("down", "enter")
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen))
            assert app.feed is not None and app.feed.label == "job1"

    asyncio.run(scenario())


def test_the_rank_detail_title_names_the_keys_its_footer_shows():
    """The title's "Esc back, ←/→ prev/next rank" and the footer: esc Back, ← Prev rank,
    → Next rank (the footer showed "," and "." while the title said ←/→)."""
    sim = SimJob(ranks=2, gpu=False, amp=False)
    data = DashboardData()
    data.apply_messages(sim.run(3))

    async def scenario() -> None:
        app = DashboardApp(data=data, clock=lambda: sim.end_t(3))
        async with app.run_test(size=(120, 30)) as pilot:
            await until(pilot, lambda: isinstance(app.screen, OverviewScreen) and app.redraws)
            text = await visit(pilot, app, "enter", RankDetailScreen, f"rank 0  ·  running  ·  "
                               f"{KEYS}")
            footer = text.splitlines()[-1]
            for key, what in (("esc", "Back"), ("←", "Prev rank"), ("→", "Next rank")):
                assert f"{key} {what}" in footer, footer
            assert "Esc back" in KEYS and "←/→" in KEYS
            await pilot.press("right")
            await until(pilot, lambda: app.screen.rank == 1 and "rank 1  ·" in screen_text(app))
            await pilot.press("left")
            await until(pilot, lambda: app.screen.rank == 0 and "rank 0  ·" in screen_text(app))

    asyncio.run(scenario())


def test_clean_makes_control_characters_visible_and_keeps_the_rest():
    assert clean("[/x] [bold] ok") == "[/x] [bold] ok"
    assert clean("a\x1b[31mb\x07c\r\nd\x00e\x7f\x9b") == "a\\x1b[31mb\\x07c\nd\\x00e\\x7f\\x9b"
    assert clean("\x1b]52;c;aGVsbG8=\x07") == "\\x1b]52;c;aGVsbG8=\\x07"  # OSC 52
    assert clean("a\u202eb") == "a\\u202eb"
    assert clean("x\ty\nz", one_line=True) == "x   y z"
    assert literal_text("[/x]\x1b", style="bold").plain == "[/x]\\x1b"
