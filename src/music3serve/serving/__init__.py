"""I/O around the engine: audio files and (later) the deploy config, workers and the HTTP API."""
