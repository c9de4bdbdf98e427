"""Serving: the engine that runs both stages, the deploy config, the stage-1 worker and its shared-memory connector,
the HTTP API, audio I/O and metrics."""
