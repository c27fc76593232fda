"""`optimum-cli prune`: registers optimum_prune's `prune` command with the Optimum CLI.

Optimum imports every module of the `optimum.commands.register` namespace package (no `__init__.py`, PEP 420) and
registers the commands listed in its `REGISTER_COMMANDS`. This module stays light: optimum_prune (and torch) are
imported only when the command runs.
"""

import sys

from optimum.commands.base import BaseOptimumCLICommand, CommandInfo


class PruneCommand(BaseOptimumCLICommand):
    COMMAND = CommandInfo(
        name="prune", help="Prune a model with optimum-prune and save it (same as `optimum-prune prune`)."
    )

    @staticmethod
    def parse_args(parser):
        from optimum_prune.cli import add_prune_arguments  # noqa: PLC0415  (lazy: see the module docstring)

        parser.add_argument("-v", "--verbose", action="store_true", help="INFO logging and tracebacks on errors")
        add_prune_arguments(parser)

    def run(self):
        from optimum_prune.cli import run_command  # noqa: PLC0415  (lazy: see the module docstring)

        code = run_command("prune", self.args, prog="optimum-cli")
        if code:
            sys.exit(code)


REGISTER_COMMANDS = [PruneCommand]
