"""`ConfigError`, in a module of its own so that the family registry can raise it without
importing `core.config` (which asks the registry to validate each `ModelConfig`)."""


class ConfigError(ValueError):
    """A configuration that cannot work; the message says which numbers clash and what to do."""
