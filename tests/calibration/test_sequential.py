"""The layer-by-layer runner must reproduce the model's own forward when nothing is pruned."""

import pytest
import torch
from testing_utils import calibration_ids, tiny_model

from optimum_prune.calibration.sequential import LayerwiseRunner
from optimum_prune.modeling.architectures import get_layers, get_spec

FINAL_NORM = {
    "llama_gqa": lambda m: m.model.norm,
    "gemma3": lambda m: m.model.norm,
    "opt": lambda m: m.model.decoder.final_layer_norm,
    "gpt2": lambda m: m.transformer.ln_f,
}


@pytest.mark.parametrize("arch", sorted(FINAL_NORM))
def test_runner_reproduces_the_full_forward(arch):
    model = tiny_model(arch)
    ids = calibration_ids(4, 12)
    runner = LayerwiseRunner(model, get_spec(model), ids, batch_size=3)
    assert len(runner.hidden) == 2  # chunks of 3 + 1
    for i in range(runner.num_layers):
        runner.advance(runner.run_layer(i))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False)
    got = FINAL_NORM[arch](model)(torch.cat(runner.hidden))
    torch.testing.assert_close(got, out.hidden_states[-1], rtol=1e-5, atol=1e-5)
    # the identity stubs used for capturing are gone
    assert all("forward" not in layer.__dict__ for layer in get_layers(model, get_spec(model)))
