"""The per-job hub process: collects every rank's messages, keeps history, serves dashboards."""

from .server import Hub, HubAlreadyRunning

__all__ = ["Hub", "HubAlreadyRunning"]
