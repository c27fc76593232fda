"""Built-in pruning methods; importing a subpackage registers it."""

from . import amp, experts, fista, flap, magnitude, numerical, ria, sparsegpt, spp, wanda  # noqa: F401
