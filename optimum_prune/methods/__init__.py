"""Built-in pruning methods; importing a subpackage registers it."""

from . import flap, magnitude, numerical  # noqa: F401
