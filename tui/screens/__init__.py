"""Screens of the dashboard: overview, rank detail, collectives, hang, help, job picker."""
