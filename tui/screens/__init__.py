"""Screens of the dashboard: overview, rank detail, help, job picker."""
