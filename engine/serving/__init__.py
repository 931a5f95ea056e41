"""Serving the engine: the one queue every model call goes through, and the OpenAI-compatible endpoint."""
