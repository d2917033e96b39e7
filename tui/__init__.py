"""The Textual dashboard: `scalemon attach` and `scalemon demo`.

Layers, from the wire up (only `widgets/`, `screens/` and the entry points import textual):

* `series` (bounded min/max time series), `model` (`DashboardData`: the job state folded
  from the hub's records plus per-rank series, all-reduce arrival times and rates, behind one
  lock), `views` (what a screen draws, copied under that lock), `feed` (the receiver thread's
  loop over a `HubStream`, reconnecting by itself), `sim` (a scripted job for tests, the bench
  and the screenshot);
* `widgets/` (braille plot, rank table, job header) and `screens/` (overview, rank detail,
  help, job picker), put together by `app.DashboardApp`;
* entry points: `attach` (`scalemon attach`), `demo` (`scalemon demo`), `screenshot`
  (`python -m scalemon.tui.screenshot`, the README picture).
"""
