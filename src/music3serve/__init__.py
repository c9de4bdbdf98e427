"""music3serve: a serving engine for the MiniMax-Music3 text-to-music model."""

__version__ = "0.1.0"
