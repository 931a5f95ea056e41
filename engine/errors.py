import sys


class EngineError(ValueError):
    """Bad input or an unusable model/setting. The message names the cause and the fix;
    the CLI and the app show it instead of a traceback, the API as OpenAI's error with ``field`` as its
    ``param``. ``field``: the setting at fault (``DecodeSettings``' name for it), where one is."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


def run_command(body, args) -> int:
    """A CLI's ``main``: ``body(args)``'s exit status, or one error line and status 2 for bad input."""
    try:
        return body(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
