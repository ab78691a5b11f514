"""The one exception type users see: a readable message naming the problem and what to do."""


class WasteError(Exception):
    """An error meant for the user. The CLI prints its message alone, never a traceback."""


class DamagedContainer(WasteError):
    """A container file is truncated, corrupted or inconsistent with its manifest."""
