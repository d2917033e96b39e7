"""The Textual dashboard: `scalemon attach` and `scalemon demo`.

Layers, from the wire up (only `widgets/`, `screens/` and the entry points import textual):

* `model` (`DashboardData`: `scalemon.state.fold.JobFold`, the job state folded from the hub's
  records plus per-rank series and rates, behind one lock; it starts from the hub's own fold
  when it attaches), `views/` (what each screen draws, as plain data copied under that
  lock: `header`, `rows`, `overview`, `nodes` (a row per node for jobs of thousands of
  ranks), `rank_detail`, `collectives`, `hang`, `flags`, `log`), `feed` (the
  receiver thread's loop over a `HubStream`, reconnecting by itself, fetching a big job's
  rank's series when shown, stepping aside while the screen is drawn), `gcpause` (full
  garbage collections kept out of big jobs' redraws), `sim` (a scripted job for tests, the
  bench and the screenshot, collectives and hangs included);
* `widgets/` (braille plot, rank and node tables, job header, lateness heat map, the slowest
  and failed ranks and the lateness histogram) and `screens/` (overview, a node's ranks, rank
  detail, collectives, hang, help, job picker), put together by `app.DashboardApp`;
* entry points: `attach` (`scalemon attach`; `scalemon demo` is `scalemon/cli/demo.py`),
  `screenshot` (`python -m scalemon.tui.screenshot`, the README picture).
"""
