"""Command-line tools (``python -m engine.tools.NAME``) and the GPU runbooks (``*.sh``): the bench,
replay, checks, projection and prompt sets. Nothing in the runtime imports them."""
