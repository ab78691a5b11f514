"""The one exception type of the text layer."""


class TextError(ValueError):
    """A tokenizer, template, chat format or model output that the text layer refuses, with the reason."""
