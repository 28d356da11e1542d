"""Shared foundations: settings and metrics. Imports nothing from the other app packages."""
