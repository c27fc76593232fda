"""`optimum-prune`: the command-line interface (`prune`, `search`, `eval`, `bench`, `export-gguf`, `demo`, `finetune`,
`push`); `python -m optimum_prune.cli` runs it too.

`main` (`main.py`) parses the arguments with the parser of `parser.py` (every command and option; no torch, so that
`--help` answers at once) and runs the command's function, imported then: `prune.py` (`prune`), `spp.py` (`search`),
`tools.py` (`eval`, `bench`, `export-gguf`, `demo`) and `recovery.py` (`finetune`, `push`), on the helpers of
`common.py` (errors, JSON output) and `inputs.py` (the models and texts named on the command line); `demo.py` is the
end-to-end demo.
"""

from .main import add_prune_arguments, build_parser, main, run_command

__all__ = ["main", "build_parser", "add_prune_arguments", "run_command"]
