"""Persistence: schema, migrations, the write-behind record writer, queries and retention."""
