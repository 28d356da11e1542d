"""phasewatch's Alembic migrations, installed as `phasewatch.migrations`
(app/phasewatch/store/migrate.py finds them through the package). env.py is run by Alembic, not
imported."""
