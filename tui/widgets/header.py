"""`JobHeader`: job id, world size, state, progress, rates, drops, stragglers and the hub link."""

from __future__ import annotations

from rich.text import Text
from textual.widget import Widget

from scalemon.text import display

from ..views.header import Summary

STATE_STYLES = {
    "running": "bold green",
    "finished": "bold green",
    "waiting": "bold yellow",
    "restarting": "bold yellow",
    "stalled": "bold magenta",
    "hub down": "bold magenta",
    "hung": "bold white on red",
    "degraded": "bold red",
    "ended": "bold red",
    "stopping": "bold yellow",
    "stopped": "bold cyan",
    "crashed": "bold red",
    "lost": "bold red",  # the job lost a rank: its first failure is a rank that vanished
}
ALERT_STYLE = "bold white on red"
CONN_STYLES = {
    "connected": "green",
    "offline": "grey50",
    "connecting": "yellow",
    "waiting": "yellow",
    "disconnected": "bold red",
    "incompatible": "bold red",
}


def header_text(s: Summary) -> Text:
    """Three lines: identity and state; progress, rates, drops and a flag note; hub link and
    stragglers. Then, once a rank failed: which one failed first, and why; while a rank's
    training is unhealthy (NaN loss, loss scale collapsed, steps skipped): the alerts."""
    t = Text(no_wrap=True, overflow="ellipsis")
    t.append("job ", style="dim").append(s.job or "?", style="bold")
    world = display.NA if s.world_size is None else str(s.world_size)
    t.append("  world ", style="dim").append(world)
    if s.world_size is not None and s.ranks_seen != s.world_size:
        t.append(f" ({s.ranks_seen} seen)", style="yellow")
    t.append("  elapsed ", style="dim").append(display.duration(s.elapsed_s))
    t.append("  ")
    t.append(s.state_text, style=STATE_STYLES.get(s.state, "bold"))
    t.append("\n")
    if s.step_min is None:
        t.append("step ", style="dim").append(display.NA)
    elif s.step_min == s.step_max:
        t.append("step ", style="dim").append(str(s.step_max), style="bold")
    else:
        t.append("step min/max ", style="dim").append(f"{s.step_min}/{s.step_max}", style="bold")
    t.append("  steps/s ", style="dim").append(display.num(s.steps_per_s, 2))
    t.append(f"  {s.tokens_label} ", style="dim").append(display.si(s.tokens_per_s))
    t.append("  dropped ", style="dim").append(str(s.dropped),
                                               style="bold red" if s.dropped else "")
    t.append("  seq gaps ", style="dim").append(str(s.gaps), style="bold red" if s.gaps else "")
    if s.rejected:
        t.append("  undecodable ", style="dim").append(str(s.rejected), style="bold red")
    if s.flag_note:
        t.append("  ").append(s.flag_note, style=s.flag_style)
    t.append("\n")
    conn = s.conn
    t.append("hub ", style="dim")
    label = "disconnected, retrying" if conn.status == "disconnected" else conn.status
    t.append(label, style=CONN_STYLES.get(conn.status, ""))
    if conn.status not in ("connected", "disconnected") and conn.detail:
        t.append(f" ({conn.detail})", style="dim")
    t.append("  stragglers ", style="dim")
    if s.stragglers:
        parts = [f"rank {r} {v * 1000:+.0f} ms" for r, v in s.stragglers[:3]]
        more = f" (+{len(s.stragglers) - 3})" if len(s.stragglers) > 3 else ""
        t.append(", ".join(parts) + more, style="bold yellow")
        t.append(f" ({s.straggler_basis})", style="dim")
    else:
        t.append("none" if s.straggler_basis else display.NA)
    if s.hub_note:  # on the hub's own line: a long hang text on the first cannot hide it
        t.append("  hub note: ", style="dim").append(s.hub_note, style="yellow")
    if s.failure:
        t.append("\n")
        t.append(s.failure, style="bold red")
    if s.alert:
        t.append("\n")
        t.append(f"ALERT: {s.alert}", style=ALERT_STYLE)
    return t


class JobHeader(Widget):
    """The overview's header: three lines (and a failure line, an alert line), repainted only
    when their text changes (a fixed height, so an update re-lays out the screen only when a
    failure or alert line comes or goes)."""

    DEFAULT_CSS = """
    JobHeader { height: 3; padding: 0 1; background: $boost; text-wrap: nowrap;
                text-overflow: ellipsis; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._text = Text("connecting...")

    def render(self) -> Text:
        """The current header text."""
        return self._text

    def show(self, summary: Summary) -> None:
        """Redraw from a summary (only when the text changed)."""
        text = header_text(summary)
        if text.plain != self._text.plain or text.spans != self._text.spans:
            self._text = text
            height = 3 + bool(summary.failure) + bool(summary.alert)
            if self.styles.height is None or self.styles.height.value != height:
                self.styles.height = height  # re-lays out once
            self.refresh()
