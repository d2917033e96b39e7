"""Widgets of the dashboard: braille line plot, rank and node tables (on one line table), job
header, lateness heat map, and a big job's watch panels (slowest, failed, histogram)."""
