"""meshlm: serve LLMs across several machines on MLX behind one OpenAI-compatible endpoint."""

__version__ = "0.1.0"
