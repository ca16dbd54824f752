"""``./run celery-suite``: Celery's own integration tests run with every task a GuardedTask and
without, compared (see the README's "Celery's own integration suite")."""
