"""The revisions, oldest first by number; Alembic loads each file by path."""
