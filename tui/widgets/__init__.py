"""Widgets of the dashboard: braille line plot, rank table, job header."""
