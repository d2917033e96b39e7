"""The per-job hub process: collects every rank's messages, keeps history, serves dashboards
(`scalemon.hub.server.Hub`), and keeps the book of the other nodes' relays
(`scalemon.hub.relay_book`; each relay is a process of its own, `scalemon.relay`).

Importing the package loads nothing else: `scalemon hub`'s options (`main.add_arguments`) are
read by every `scalemon` command, which should not pay for the hub's server or its metrics
exporter."""

METRICS_ENV = "SCALEMON_METRICS"
"""HOST:PORT where an auto-started hub serves OpenMetrics (`hub/openmetrics.py`)."""
METRICS_FILE_ENV = "SCALEMON_METRICS_FILE"
"""The file an auto-started hub writes its OpenMetrics text to, for node_exporter."""
