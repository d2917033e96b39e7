"""`?`: keys, what each column and plot means, how stragglers and hangs are named."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Markdown

from scalemon import policy
from scalemon.text import display
from scalemon.text.display import AGGREGATE_AT, KEY_METRICS, LATE, LOW_IS_WORSE

from ..views.rows import COLUMNS

HELP_TEMPLATE = """\
# scalemon dashboard

- `↑` `↓` `PgUp` `PgDn` `Home` `End`, mouse: move in the rank table; `←` `→` scroll it sideways
- `Enter`, or a click on the highlighted row: that rank's detail, every series over the steps;
  there `←` `→` go to the previous / next rank and `Esc` comes back
- `n`: a row per node (host) instead of per rank, the default from {aggregate_at} ranks on;
  `Enter` on a node shows its ranks (`Esc` comes back), `n` goes back to a row per rank
- `g`: group the rank table by an axis of the job's device mesh (`pp`, `dp`, `tp`...: a heading
  per coordinate, its ranks under it); again for the next axis, then rank order again
- `l`: loss and memory plots as one line per rank, or mean with a min..max band
- `c`: collectives: the pipeline's bubble and the MoE balance, durations and bus bandwidth by
  group, op and size, sends and receives by src -> dst, a rank x time heat map of arrival
  lateness, the ranks by lateness and the Flight Recorder's health on each rank
- `h`: hang view (shown by itself when the job hangs): who holds up whom, each rank's state,
  collectives in flight and Python stack; there `d` asks every rank for a Flight Recorder dump
  and shows scalemon's analysis of it: per group who issued and completed what, mismatches,
  the culprit
- `f`: flags (NCCL_DEBUG, NCCL_ALGO, TORCH_DISTRIBUTED_DEBUG, ...): each flag's tier, its
  value on the ranks (a value that differs across ranks is a MISMATCH, in red) and the toggle
  audit; there `Enter` or `t` changes the flag under the cursor on every rank and `R` changes
  it by restarting the job
- `L`: log: NCCL's debug lines and torch's stderr of every rank; `/` edits the filter
  (`rank:0,2 src:nccl sub:WARN` and words the line must hold)
- `Ctrl+P`: command palette (type `rank 3` to open rank 3, `node` and a host name for that
  node's ranks; theme; screenshot)
- `?`: this help, `q`: quit (the job keeps running; only `scalemon demo` stops its own job)

**Columns.** *rank*, *state* (see below), *step*: the last step the rank logged, *host*.

{columns}
**n/a** means the value cannot exist there (no GPU, no AMP scaler, not timed): never zero.

**Stragglers** are running ranks that issue their collectives at least {straggler_min} and
{straggler_share} of a step later than the first rank of the group (*late*: the median over the
rank's last 100 collectives (61 at 16,384 ranks), from the Flight Recorder's issue times on the
hub's clock). A slow rank arrives last and then waits least, so the time spent in collectives
cannot name it. Before any collective was seen by every rank, ranks whose compute time is that
much above the median rank's are named instead. They are named in the header, largest first,
and drawn in yellow.

**Nodes.** From {aggregate_at} ranks on the overview has a row per node: its ranks, its worst
state ({node_states}) and how many ranks run,
are frozen (*frz*), gone (*gone*: gone, unreachable or silent), failed or finished; the step
range; *min*, *med* and *max* over the node's ranks of
{key_metrics}, and of every other column the node's worst value (the *min* of {low_is_worse},
else the *max*). Nodes with a
rank that failed or stopped sending come first, then nodes with a straggling, stuck or
restarting rank or a slow median step, slowest first; the others keep their order. Above the
table, always: the slowest ranks (stragglers in yellow), the ranks that failed or stopped
sending (frozen ones first, with where they are stuck), and a histogram of the
straggler measure over the running ranks (bar length: log of the count, so one rank shows
next to thousands). Ranks whose host is not known yet are on node *?*.

**Collectives.** busbw = S/t x factor (nccl-tests): all_reduce 2(n-1)/n,
all_gather/reduce_scatter/all_to_all (n-1)/n, broadcast/reduce 1; S is the whole buffer, t the
mean duration, n the ranks of the group, 1 GB = 1e9 B. A duration includes the wait for the
last rank, so a straggler lowers everyone's busbw. *n/a* says why: gloo records no durations
(the agent times only DDP's all-reduce there), a barrier moves no data. A recorder whose ring
wrapped between two reads lost entries: raise TORCH_FR_BUFFER_SIZE.

**3-D parallel jobs.** Where the ranks reported their place in a device mesh, the *mesh*
column has each rank's coordinates (`pp0 dp1 tp0`) and groups read by mesh dimension and
ranks (`tp [2,3]`). Sends and receives are listed by (group, src -> dst) in global ranks. The
pipeline line puts the measured bubble (the median over the ranks of the share of a step spent
waiting for pipeline neighbours) beside the schedule's for equal stages ((p-1)/(m+p-1) for
GPipe and 1F1B). A stage blocked in a receive waits for its sender: the hang view draws such
chains with the op on each edge (`2 -recv-> 1 -recv-> 0`) and the culprit's cause at the end.

**Flags.** A change takes effect by its tier: *live* (the ranks switch at the planned step
boundary), *new comm* (read when a communicator is created: the demo trainer moves to a new
group, other scripts get it in groups created later) or *restart* (the job checkpoints and
torchrun restarts its workers with the new value). The dashboard checks the value first; the
hub checks it again, plans the step and records who asked. Flags can be changed only on the
hub's host, by the job's owner (its control socket).

**Hangs.** The job is *hung* when no rank completed a step for the hang threshold ({hang} s,
`scalemon attach --hang-after S`). The culprit is the rank that never issued the collective the
others wait in (or whose process is gone).

**States.** *running*: the rank sends its steps and heartbeats. When a running rank stops
sending for a few seconds, the hub looks at its process and says which of these it is:

- *frozen* (white on purple): its process exists but sends nothing; the hub (or its node's
  relay) read its stacks from outside. Its detail says where it is stuck ("frozen in native
  code holding the GIL: ...") and what the process does (sleeping, CPU moving or not). It has
  not ended: the job hangs on it.
- *gone*: its process ended without reporting an exit (killed: SIGKILL, the OOM killer).
- *unreachable*: its node's relay is silent too, so nothing can look at its process (the node,
  or its relay, is down or cut off); taken for ended.
- *silent*: nothing on its node could look at its process (no relay there, its process out of
  the hub's sight, or the look failed: the reason says which); taken for ended. A history
  written before scalemon 1.12 said *lost*: it reads as *silent*.

*exited N*: it ended with exit code N (*failed 1st*: the first rank to fail; *peer lost*: it
failed only because a peer went away). *finished*: it ended its run (`finish()`). *stopped*:
its user stopped the job. *restarting*: it exited to be restarted with a new flag value. A
rank shown as `<phase> Ns` has been in one phase (for example `allreduce`) that long (at least
{stuck_s} s and {stuck_steps} median steps): a hang candidate. The job is *stalled* when no
rank finished a step for that long, and *hung* (above) when the ranks' collectives tell who
holds it up.

**Plots.** x is the step. *Step time* shows compute (step - all-reduce - optimizer, at least 0:
a lower bound, since the all-reduce overlaps backward), all-reduce and optimizer, as means
over ranks. *AMP loss scale* is on a log scale; ▲ marks skipped steps (inf/NaN gradients).
Each pixel column keeps the minimum and maximum of its steps, so no spike is averaged away.
A rank's detail also plots every number the script passes to `log(name=value)`.

**Hub.** "disconnected, retrying" means the job's hub does not answer; the dashboard attaches
again by itself and resumes where it stopped, without gaps. "incompatible" means the hub runs
another scalemon protocol version: attach with the scalemon version the job runs.
"""


def columns_help() -> str:
    """One line per metric column of the rank table: its heading and what it means, from the
    table of metrics."""
    return "".join(f"- *{c.heading}*: {c.metric.description}\n"
                   for c in COLUMNS if c.metric is not None)


def _headings(names: tuple[str, ...] | frozenset[str]) -> str:
    """"*step ms*, *late ms* and *loss*": the column headings of metrics `names`, in table
    order."""
    heads = [f"*{c.heading}*" for c in COLUMNS if c.metric is not None and c.key in names]
    return ", ".join(heads[:-1]) + (" and " if len(heads) > 1 else "") + heads[-1]


HELP = HELP_TEMPLATE.format(
    columns=columns_help(), aggregate_at=AGGREGATE_AT,
    straggler_min=f"{display.shown(LATE, policy.STRAGGLER_MIN_S):g} {display.unit(LATE)}",
    straggler_share=f"{policy.STRAGGLER_STEP_SHARE:.0%}",
    key_metrics=_headings(KEY_METRICS), low_is_worse=_headings(LOW_IS_WORSE),
    node_states=", ".join(policy.NODE_STATES), hang=f"{policy.HANG_AFTER_S:g}",
    stuck_s=f"{policy.STUCK_MIN_S:g}", stuck_steps=f"{policy.STUCK_STEPS:g}")


class HelpScreen(ModalScreen[None]):
    """Keys and meanings."""

    BINDINGS = [Binding("escape,q,question_mark", "dismiss", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 90%; max-width: 110; height: 90%;
                                  border: round $accent; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Markdown(HELP)

    async def action_dismiss(self, result: None = None) -> None:
        """Close the help."""
        self.dismiss(result)
