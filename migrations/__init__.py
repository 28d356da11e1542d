"""phasewatch's Alembic migrations, installed as `phasewatch.migrations` (app/store/migrate.py
finds them through the package). env.py is run by Alembic, not imported."""
