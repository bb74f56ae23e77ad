"""`SetupError`: a problem found before training starts; its message names the option and values."""


class SetupError(ValueError):
    """A problem found before training starts; the message names the option and values."""
