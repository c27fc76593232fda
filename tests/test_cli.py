"""The `optimum-prune` command line, end to end on a tiny random Llama saved with SmolLM2's tokenizer (offline)."""

import importlib.util
import json
import re
from pathlib import Path

import pytest
import torch

from optimum_prune import AutoPrunedModelForCausalLM, NumericalConfig
from optimum_prune.cli import main

WORDS = "the bank said profits rose sharply as markets recovered while the minister warned of slower growth".split()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    """A 2-layer random Llama (GQA: 4 query heads, 2 KV heads) over the SmolLM2 vocabulary, with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = smollm2_tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("cli") / "tiny-llama"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, len(WORDS), (3000,), generator=g).tolist()
    path = tmp_path_factory.mktemp("text") / "news.txt"
    path.write_text(" ".join(WORDS[i] for i in idx) + ".\n")
    return path


def _calib_args(calib_file):
    return ["--calib", str(calib_file), "--num-samples", "4", "--seq-len", "32"]


def test_prune_end_to_end(model_dir, calib_file, tmp_path, capsys):
    out, report = tmp_path / "pruned", tmp_path / "report.json"
    argv = ["prune", str(model_dir), "--method", "numerical", "--ratio", "0.25", *_calib_args(calib_file)]
    assert main([*argv, "--output", str(out), "--report", str(report)]) == 0
    printed = capsys.readouterr()
    summary = json.loads(printed.out)
    assert summary["method"] == "numerical" and summary["output"] == str(out)
    # a summary to read: the config and per-layer shapes stay in the files, floats without binary noise
    assert len(printed.out.splitlines()) <= 25 and "config" not in summary, printed.out
    floats = [v for v in [*summary.values(), *summary["timings"].values()] if isinstance(v, float)]
    assert floats and all(float(f"{v:.6g}") == v for v in floats), printed.out  # no 0.30000000000000004
    assert re.search(r"PruningReport\(method='numerical'.*, \d+\.\d s\); saved to ", printed.err), printed.err
    full = json.loads(report.read_text())
    assert full["params_after"] < full["params_before"]
    assert abs(full["measured"] - 0.25) < 0.1
    assert full["calibration"]["num_samples"] == 4
    assert {"config.json", "model.safetensors", "pruning_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    model = AutoPrunedModelForCausalLM.from_pretrained(out)
    # at 25% the per-layer default refits o_proj / down_proj biases; the stock checkpoint this uniform model saves as
    # holds Llama's bias flags, so q/k/v/gate/up get zero biases there: the report counts the model without them
    padding = sum(p.numel() for n, p in model.named_parameters() if n.endswith(".bias") and not p.any())
    assert model.config.attention_bias and padding > 0
    assert sum(p.numel() for p in model.parameters()) - padding == full["params_after"]

    # eval and bench read the saved checkpoint (bench: dense reference first, then the pruned model)
    assert main(["eval", str(out), "--data", str(calib_file), "--seq-len", "32", "--max-tokens", "128"]) == 0
    assert json.loads(capsys.readouterr().out)["perplexity"] > 1
    bench = ["bench", str(model_dir), str(out), "--prompt-len", "8", "--new-tokens", "2", "--warmup", "0"]
    assert main([*bench, "--repeats", "1", "--output", str(tmp_path / "bench.json")]) == 0
    assert "| model | prefill ms (median) |" in capsys.readouterr().err  # the comparison as a table, to read
    speed = json.loads((tmp_path / "bench.json").read_text())
    assert speed["ratios"][str(out)]["parameter_ratio"] < 1


def test_prune_from_config_json(model_dir, calib_file, tmp_path, capsys):
    config_path = tmp_path / "np.json"
    NumericalConfig(pruning_ratio=0.3, allocation="uniform", compensation_damping=0.05).to_json_file(config_path)
    out = tmp_path / "pruned"
    argv = ["prune", str(model_dir), "--config", str(config_path), "--set", "seed=3", *_calib_args(calib_file)]
    assert main([*argv, "--output", str(out)]) == 0
    capsys.readouterr()
    applied = json.loads((out / "pruning_config.json").read_text())["history"][-1]["config"]
    assert applied["method"] == "numerical" and applied["pruning_ratio"] == 0.3
    assert applied["allocation"] == "uniform" and applied["compensation_damping"] == 0.05 and applied["seed"] == 3
    # the applied config round-trips through --config again (a saved pruning_config.json is accepted as is)
    assert (
        main(
            [
                "prune",
                str(out),
                "--config",
                str(out / "pruning_config.json"),
                "--ratio",
                "0.1",
                "-o",
                str(tmp_path / "twice"),
                *_calib_args(calib_file),
            ]
        )
        == 0
    )


def test_data_free_method_needs_no_calibration(model_dir, tmp_path, capsys):
    out = tmp_path / "magnitude"
    out.mkdir()  # an existing empty output directory is fine
    assert main(["prune", str(model_dir), "--method", "magnitude", "--ratio", "0.2", "--output", str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert json.loads(capsys.readouterr().out)["method"] == "magnitude"
    # with an unstructured / N:M pattern, --ratio is the sparsity
    out = tmp_path / "magnitude24"
    assert (
        main(["prune", str(model_dir), "--method", "magnitude", "--pattern", "2:4", "--ratio", "0.5", "-o", str(out)])
        == 0
    )
    applied = json.loads((out / "pruning_config.json").read_text())["history"][-1]["config"]
    assert applied["pattern"] == "2:4" and applied["sparsity"] == 0.5
    capsys.readouterr()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--method", "numerical", "--ratio", "1.5"], "pruning_ratio"),
        (["--method", "no_such_method"], "Unknown pruning method"),
        (["--method", "numerical", "--set", "bogus=1"], "no option"),
        (["--method", "numerical"], "needs calibration text"),
        (["--method", "numerical", "--calib", "/no/such/dir"], "neither an existing file"),
        (["--method", "magnitude", "--report", "/no/such/dir/report.json"], "does not exist"),
        (
            ["--method", "spp", "--ratio", "0.2", "--solution-path", "/no/such/path", "--calib", "bbc"],
            "not a saved solution path",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(model_dir, tmp_path, capsys, extra, message):
    out = tmp_path / "never"
    assert main(["prune", str(model_dir), *extra, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("optimum-prune prune: error:") and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_existing_output_is_refused_before_pruning(model_dir, calib_file, tmp_path, capsys):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["prune", str(model_dir), "--method", "numerical", *_calib_args(calib_file), "--output", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert (
        "already exists" in err and "keep.txt" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    )
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_missing_model_path(calib_file, tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope"), "--data", str(calib_file)]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_console_script_is_declared():
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'optimum-prune = "optimum_prune.cli:main"' in text


def test_demo_refuses_a_foreign_output_dir_before_loading(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not a demo checkpoint")
    assert main(["demo", "--output-dir", str(out)]) == 2
    assert "not written by the demo" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_demo_table_formatting():
    """The verdict comes first (size, quality, per-round speedups with their interval); a busy machine is flagged
    before it, with by how much."""
    from optimum_prune.cli.demo import format_demo_table
    from optimum_prune.evaluation import speedup_spread

    side = {"parameters": 134.5e6, "perplexity": 30.0, "prefill_ms": 200.0, "decode_tokens_per_s": 20.0}
    per_round = {
        "prefill_speedup": speedup_spread([210.0] * 5, [170.0, 168.0, 171.0, 169.0, 172.0]),
        "decode_speedup": speedup_spread([50.0] * 5, [48.0, 52.0, 40.0, 55.0, 45.0]),
    }
    speed = {
        "settings": {"machine": {"cpus": 2, "threads": 2, "other_processes_cpus": 0.1, "busy": False}},
        "models": {"dense": {}, "pruned": {}},
        "ratios": {"pruned": {"per_round": per_round}},
    }
    result = {
        "settings": {
            "model": "SmolLM2",
            "method": {"pruning_ratio": 0.2},
            "calibration": {"num_samples": 32, "seq_len": 256},
            "evaluation": {"max_tokens": 8192, "documents": 445, "seq_len": 512},
            "speed": {"prompt_len": 128, "new_tokens": 32, "repeats": 5, "load_average_1min": [1.0, 1.5]},
            "torch_threads": 2,
        },
        "dense": {**side, "prefill_ms_median": 210.0, "decode_tokens_per_s_median": 19.0},
        "pruned": {
            **side,
            "parameters": 113.4e6,
            "perplexity": 45.0,
            "prefill_ms_median": 170.0,
            "decode_tokens_per_s_median": 24.0,
        },
        "ratios": {"parameters": 0.843, "perplexity": 1.5},
        "speed": speed,
        "report": {"measured": 0.199},
        "reload": {"max_abs_logit_diff": 0.0},
        "generation": {"prompt": "Hi", "dense": "Hello there.", "pruned_reloaded": "Hello."},
        "output_dir": "demo_output",
        "timings_s": {"total_s": 300.0},
    }
    table = format_demo_table(result)
    first = table.splitlines()[0]
    assert first.startswith("pruned: 15.7% fewer parameters, held-out perplexity 1.500x (30.00 -> 45.00)"), first
    assert "prefill 1.24x [1.23, 1.24] faster, decode 1.04x [0.96, 1.11] tie" in first, first
    for text in ("134.50 M", "113.40 M", "210.0 ms", "24.0 tok/s", "Hello.", "total time 300 s"):
        assert text in table
    assert "UNRELIABLE" not in table
    speed["settings"]["machine"].update(other_processes_cpus=8.2, busy=True)
    first = format_demo_table(result).splitlines()[0]
    assert first.startswith("UNRELIABLE speed: other processes used 8.2 of the 2 CPUs"), first
    # a results file written before the machine's load was measured: its load average against the threads
    del speed["settings"]["machine"]
    result["settings"]["speed"]["load_average_1min"] = [1.0, 6.0]
    assert format_demo_table(result).startswith("UNRELIABLE speed: load average 6.0 > 2 threads")
    # noisy medians can leave the decode rate undefined (generate median <= prefill median)
    result["pruned"]["decode_tokens_per_s_median"] = float("nan")
    assert "n/a" in format_demo_table(result)


def test_committed_demo_results_are_rendered_from_their_json():
    """benchmarks/results/demo_smollm2.md is `format_demo_markdown` of the JSON next to it (the figures the README and
    `make help` quote come from that run, never from a hand-written string)."""
    from optimum_prune.cli.demo import DEMO_RESULTS_NAME, format_demo_markdown, format_demo_table

    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    result = json.loads((results / f"{DEMO_RESULTS_NAME}.json").read_text(encoding="utf-8"))
    markdown = (results / f"{DEMO_RESULTS_NAME}.md").read_text(encoding="utf-8")
    assert markdown == format_demo_markdown(result)
    assert f"| held-out perplexity | {result['dense']['perplexity']:.2f} | {result['pruned']['perplexity']:.2f} |" in (
        markdown
    )
    assert f"| total | {result['timings_s']['total_s']:.1f} |" in markdown
    verdict = result["speed"]["ratios"]["pruned"]["per_round"]["prefill_speedup"]["verdict"]
    assert verdict in ("faster", "slower", "tie") and verdict in markdown and verdict in format_demo_table(result)


def test_prune_amp_and_a_recipe_file(model_dir, calib_file, tmp_path, capsys):
    from optimum_prune import AMPConfig, PruningConfig, WandaConfig

    out = tmp_path / "amp"
    argv = ["prune", str(model_dir), "--method", "amp", "--ratio", "0.5", "--set", "steps=2", *_calib_args(calib_file)]
    assert main([*argv, "--output", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "amp"
    assert PruningConfig.from_pretrained(out) == AMPConfig(sparsity=0.5, steps=2)
    recipe = [AMPConfig(steps=2), WandaConfig(targets=["v_proj", "o_proj", "mlp"])]
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps([c.to_dict() for c in recipe]))
    out2 = tmp_path / "recipe-out"
    argv = ["prune", str(model_dir), "--config", str(path), *_calib_args(calib_file), "--output", str(out2)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["method"] == "recipe" and [s["method"] for s in summary["sections"]] == ["amp", "wanda"]
    assert PruningConfig.from_pretrained(out2) == recipe
    # the saved pruning_config.json re-runs the recipe; flags cannot edit a recipe
    saved = out2 / "pruning_config.json"
    assert (
        main(["prune", str(model_dir), "--config", str(saved), "--ratio", "0.3", "--output", str(tmp_path / "x")]) == 2
    )
    assert "cannot change a recipe" in capsys.readouterr().err
    path.write_text(json.dumps([recipe[0].to_dict(), WandaConfig().to_dict()]))
    assert (
        main(["prune", str(model_dir), "--config", str(path), *_calib_args(calib_file), "-o", str(tmp_path / "y")])
        == 2
    )
    assert "both target 'q_proj'" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_spp_search_then_extract_without_calibration(model_dir, calib_file, tmp_path, capsys):
    search = ["--steps", "10", "--set", "lr=0.08", "--set", "lambda_=0.7", "--set", "betas=[0.5, 0.9]"]
    assert main(["search", str(model_dir), *_calib_args(calib_file), *search, "-o", str(tmp_path / "path")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 10 and (tmp_path / "path" / "solution_path.safetensors").is_file()
    for ratio in ("0.2", "0.3"):
        argv = ["prune", str(model_dir), "--method", "spp", "--ratio", ratio, "--solution-path", str(tmp_path / "path"),
                "--round-to", "1", "--set", "head_dim_multiple=2", "--set", "compensate=false", "-o", str(tmp_path / ratio)]  # fmt: skip
        assert main(argv) == 0
        report = json.loads(capsys.readouterr().out)
        assert abs(report["measured"] - float(ratio)) < 0.03
        AutoPrunedModelForCausalLM.from_pretrained(tmp_path / ratio)
    assert main(["search", str(model_dir), *_calib_args(calib_file), "--set", "lr=-1", "-o", str(tmp_path / "x")]) == 2
    assert "lr" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_prune_servable_writes_the_deci_format(model_dir, smollm2_tokenizer, calib_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    argv = ["prune", str(model_dir), "--method", "numerical", "--allocation", "servable", *_calib_args(calib_file)]
    assert main([*argv, "--output", str(tmp_path / "never")]) == 2  # 128 MLP channels: not a multiple of 256
    err = capsys.readouterr().err
    assert "multiple of 256" in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "never").exists()
    wide = tmp_path / "wide"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.intermediate_size = 512
    AutoModelForCausalLM.from_config(model.config).save_pretrained(wide)
    smollm2_tokenizer.save_pretrained(wide)
    argv[1] = str(wide)
    assert main([*argv, "--ratio", "0.3", "--format", "deci", "--output", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nemotron-nas"


def _subcommands():
    import argparse

    from optimum_prune.cli import build_parser

    actions = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return actions[0].choices


def test_help_imports_neither_torch_nor_transformers_and_takes_under_a_second_of_cpu():
    import resource
    import subprocess
    import sys

    probe = (
        "import sys\nfrom optimum_prune.cli import main\n"
        "for argv in (['--help'], *([c, '--help'] for c in sys.argv[1:])):\n"
        "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
        "print('HEAVY', sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules), file=sys.stderr)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *_subcommands()], capture_output=True, text=True, timeout=60, check=True
    )
    assert "HEAVY []" in out.stderr, out.stderr[-500:]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-m", "optimum_prune.cli", "--help"], capture_output=True, timeout=60, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    assert cpu < 1.0, f"`optimum-prune --help` took {cpu:.2f} s of CPU"


def test_every_option_says_what_it_does_and_its_default():
    import argparse

    for name, sub in _subcommands().items():
        text = sub.format_help()
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[0] if action.option_strings else action.dest
            assert action.help, f"`{name} {flag}` has no help text"
            if action.default not in (None, False, []) and action.option_strings:
                assert f"(default: {action.default})" in " ".join(text.split()), f"`{name} {flag}` hides its default"


def test_cost_model_writes_a_table_per_workload(model_dir, tmp_path, capsys):
    from optimum_prune.evaluation.cost_model import CostTable

    out = tmp_path / "tables"
    argv = ["cost-model", str(model_dir), "--workload", "decode:2:16", "--workload", "prefill:1:16", "-o", str(out)]
    assert main([*argv, "--rounds", "1", "--warmup", "0", "--layers", "2", "--check"]) == 0
    decode = CostTable.load(out / "cost_table_decode_2_16.json")
    assert decode.source == "measured" and decode.workload.batch == 2 and "error" in decode.info["check_dense"]
    assert decode.info["threads"] == 1 and decode.info["layers"] == 2
    assert CostTable.load(out / "cost_table_prefill_1_16.json").workload.phase == "prefill"
    assert main(["cost-model", str(model_dir), "--workload", "decode:2:16", "--rounds", "1", "--warmup", "0",
                 "--layers", "2", "--fit", "3", "-o", str(out)]) == 0  # fmt: skip
    assert CostTable.load(out / "cost_table_decode_2_16.json").info["fit"]["assemblies"] == 3
    assert main(["cost-model", str(model_dir), "--analytic", "20", "0.2", "-o", str(out)]) == 0
    assert CostTable.load(out / "cost_table_decode_1_2048.json").source == "analytic"
    assert main(["cost-model", str(model_dir), "--workload", "decode:16", "-o", str(out)]) == 2
    assert "phase:batch:context" in capsys.readouterr().err
    llama = ["cost-model", str(model_dir), "--runtime", "llama.cpp", "--layers", "2", "--rounds", "1", "--warmup", "0"]
    assert main([*llama, "--workload", "decode:1000:16", "-o", str(tmp_path / "never")]) == 2  # before any timing
    refusal = "sequences at once" if importlib.util.find_spec("llama_cpp") is not None else "optimum-prune[llamacpp]"
    assert refusal in capsys.readouterr().err and not (tmp_path / "never").exists()
    if importlib.util.find_spec("llama_cpp") is not None:  # the llamacpp extra
        assert main([*llama, "--workload", "prefill:1:16", "--check", "-o", str(out)]) == 0
        table = CostTable.load(out / "cost_table_prefill_1_16.json")
        assert "llama.cpp" in table.info["runtime"] and "error" in table.info["check_dense"]


def test_prune_serving_meets_a_speed_target_from_a_cost_table(model_dir, smollm2_tokenizer, calib_file, tmp_path,
                                                              capsys):  # fmt: skip
    from transformers import AutoModelForCausalLM

    wide = tmp_path / "wide"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.intermediate_size = 512
    AutoModelForCausalLM.from_config(model.config).save_pretrained(wide)
    smollm2_tokenizer.save_pretrained(wide)
    tables = tmp_path / "tables"
    assert (
        main(["cost-model", str(wide), "--analytic", "20", "0.2", "--workload", "decode:4:512", "-o", str(tables)])
        == 0
    )
    argv = ["prune", str(wide), "--method", "serving", "--workload", "decode:4:512", "--speedup", "1.05",
            *_calib_args(calib_file)]  # fmt: skip
    assert main([*argv, "--output", str(tmp_path / "never")]) == 2  # no cost table
    err = capsys.readouterr().err
    assert "cost-model" in err and not (tmp_path / "never").exists()
    table = tables / "cost_table_decode_4_512.json"
    report = tmp_path / "report.json"
    argv += ["--cost-table", str(table), "--report", str(report), "--output", str(tmp_path / "out")]
    assert main(argv) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "nemotron-nas"
    assembly = json.loads(report.read_text())["info"]["assembly"]
    assert assembly["target"] == "speed" and assembly["predicted_speedup"] >= 1.05
