"""The relay: one per node that is not the hub's, started by that node's local rank 0 as a
process of its own (`python -m scalemon.relay`, see `scalemon.agent.autostart`).

The node's ranks send over ipc, in a 0700 directory on the node's own disk
(`scalemon.home.paths.relay_dir`), to the relay, which forwards to the hub over one CurveZMQ tcp
connection:

- ingest: the ranks' frames go on in batches, one multipart message of up to `BATCH` frames
  every `FLUSH_S` (the hub takes each part as one message), so a node of eight ranks costs the
  hub one receive instead of eight;
- rpc: the ranks' requests pass through (ROUTER to DEALER), but their once-a-second `sync`s
  are answered by the relay itself once it can (`syncs.py`): the hub's clock from the relay's
  own offset, the hub's threshold, and the commands the hub handed over for that rank; so
  the hub answers a node, not each rank (until the hub is known requests wait, so a rank's
  first answer comes as soon as the relay reaches the hub);
- report: every `REPORT_S` the relay sends the hub a `relay` request with its counts and the
  ranks whose syncs it answers; the replies give the hub's clock, from which the relay
  estimates its node's clock offset (the fastest of the recent round trips, as the agents
  do), and those ranks' commands.

The relay finds the hub in the job file on the shared `$SCALEMON_HOME` and reads it again
when the hub stops answering (a restarted hub binds new ports); or it is given an address
(`--hub`, `$SCALEMON_HUB`); where neither works and `$SCALEMON_LISTEN` names a fixed port it
tries `$MASTER_ADDR` at that port. It never slows the ranks: what the hub cannot take is dropped
and counted (the hub also sees it as gaps in each rank's `seq`). It exits once its ranks have
been silent for `linger_s`.

The parts: `forward.py` (`Relay`: the node's sockets and the forwarding loop), `upstream.py`
(finding the hub), `report.py` (the relay's own report and its node's clock), `syncs.py` (the
ranks' syncs answered), `main.py` (the
command line). The relay imports only the core, never the hub it forwards to (the hub's book
of relays is `scalemon.hub.relay_book`).
"""
