"""One exception type for every refusal, so the CLI can print one clear line and exit non-zero."""


class SlimWiseError(Exception):
    """A user-facing error: the message names the problem and the fix, in one line."""
