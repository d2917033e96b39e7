"""Screens of the dashboard: overview, a node's ranks, rank detail, collectives, hang, flags,
log, help, job picker and the job's exit."""
