"""`optimum-prune`: the command-line interface (`prune`, `search`, `eval`, `bench`, `export-gguf`, `demo`, `finetune`,
`push`); `python -m optimum_prune.cli` runs it too.

`main` parses the arguments and runs the command (`main.py`); the commands live in `main.py` (`prune`), `spp.py`
(`search`), `tools.py` (`eval`, `bench`, `export-gguf`, `demo`) and `recovery.py` (`finetune`, `push`), on the
helpers of `common.py`; `demo.py` is the end-to-end demo.
"""

from .main import add_prune_arguments, build_parser, main, run_command

__all__ = ["main", "build_parser", "add_prune_arguments", "run_command"]
