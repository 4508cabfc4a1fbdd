"""MLflow tracking: opening the store, one run's params/metrics/artifacts, the outbox, the UI's view."""
