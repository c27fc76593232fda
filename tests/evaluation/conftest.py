"""Re-use the offline tokenizer and tiny-Llama fixtures defined in `tests/calibration/conftest.py`."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_optimum_prune_calibration_fixtures", Path(__file__).resolve().parents[1] / "calibration" / "conftest.py"
)
_fixtures = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_fixtures)

smollm2_tokenizer = _fixtures.smollm2_tokenizer
tiny_llama = _fixtures.tiny_llama
