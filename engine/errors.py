class EngineError(ValueError):
    """Bad input or an unusable model/setting. The message names the cause and the fix;
    the CLI and the app show it instead of a traceback."""
