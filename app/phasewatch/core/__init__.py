"""Shared foundations: settings, metrics, records, the database engine and the OpenAI stream
format (SSE splitting, event meaning). Imports nothing from the other app packages."""
