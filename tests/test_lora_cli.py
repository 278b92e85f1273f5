"""``chunkscan lora``: mlx_lm.lora's flags plus --scan-chunk-size, a real run whose
adapters load back, and --demo."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402
import mlx_lm.lora  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402
from test_mlx_lm import small_config  # noqa: E402

import chunkscan.mlx_lm as cmlx  # noqa: E402
from chunkscan import cli, lora  # noqa: E402
from chunkscan._demo_model import write_dataset, write_model  # noqa: E402


def small_model(path):
    # The tokenizer of the demo needs its 256-word vocabulary.
    return write_model(path, small_config(vocab_size=256))


def test_parser_wraps_mlx_lm():
    ours = {a.dest for a in lora.build_parser()._actions}
    theirs = {a.dest for a in mlx_lm.lora.build_parser()._actions}
    assert theirs <= ours
    assert {"scan_chunk_size", "demo"} <= ours


def test_precedence_cli_yaml_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scan_chunk_size: 8\nbatch_size: 3\nclear_cache_threshold: 123\n")
    args = lora.resolve_args(["-c", str(cfg), "--batch-size", "5"])
    assert (args.scan_chunk_size, args.batch_size, args.clear_cache_threshold) == (8, 5, 123)
    args = lora.resolve_args(["-c", str(cfg), "--scan-chunk-size", "32"])
    assert args.scan_chunk_size == 32
    args = lora.resolve_args([])
    assert args.scan_chunk_size == lora.op_default_chunk_size()
    assert args.iters == mlx_lm.lora.CONFIG_DEFAULTS["iters"]
    with pytest.raises(SystemExit, match="must be a positive integer"):
        lora.resolve_args(["--scan-chunk-size", "0"])


def test_real_run_saves_adapters_that_load_back(tmp_path, capsys):
    model_path = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=6, n_valid=2, min_words=20, max_words=50)
    adapters = tmp_path / "adapters"
    rc = cli.main(
        ["lora", "--model", str(model_path), "--data", str(data), "--train",
         "--iters", "2", "--batch-size", "2", "--num-layers", "-1",
         "--max-seq-length", "64", "--val-batches", "1", "--steps-per-report", "1",
         "--adapter-path", str(adapters), "--scan-chunk-size", "16",
         "--learning-rate", "1e-2"]
    )  # fmt: skip
    assert rc == 0
    assert cmlx.patched_families() == ()  # undone after the run
    out = capsys.readouterr().out
    assert "chunkscan.gated_delta_rule (chunk_size=16" in out
    assert "peak memory" in out
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["scan_chunk_size"] == 16
    saved = mx.load(str(adapters / "adapters.safetensors"))
    assert any("linear_attn" in k for k in saved)
    model, _ = mlx_lm.load(str(model_path), adapter_path=str(adapters))
    params = dict(tree_flatten(model.parameters()))
    for name, value in saved.items():
        assert mx.array_equal(params[name], value).item(), name
    # Training moved the adapters away from their init (lora_b starts at zero).
    assert any(k.endswith("lora_b") and mx.abs(v).max().item() > 0 for k, v in saved.items())


def test_demo_runs(capsys):
    rc = lora.main(["--demo", "--iters", "2", "--max-seq-length", "48", "--steps-per-report", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "chunkscan lora --demo: done" in out and "tok/s" in out
