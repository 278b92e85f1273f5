"""``chunkscan lora``: mlx_lm.lora's flags plus --gdn-chunk-size (and its deprecated
alias --scan-chunk-size), a real run whose adapters load back, and --demo."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
import types
import warnings

import mlx.core as mx
import pytest
from helpers import small_config

pytest.importorskip("mlx_lm")

import mlx_lm  # noqa: E402
import mlx_lm.lora  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

import chunkscan  # noqa: E402
import chunkscan.mlx_lm as cmlx  # noqa: E402
from chunkscan.commands import (  # noqa: E402
    _lora_adapters,
    _lora_common,
    _lora_demo,
    _lora_inputs,
    _lora_reports,
    cli,
    lora,
)
from chunkscan.commands.demo_model import write_dataset, write_model  # noqa: E402


def small_model(path):
    # The tokenizer of the demo needs its 256-word vocabulary.
    return write_model(path, small_config(vocab_size=256))


def earlier_adapters(tmp_path, tensors=None, config=None) -> pathlib.Path:
    """An earlier run's ``adapters.safetensors`` in ``tmp_path / "earlier"`` (its path):
    ``tensors`` (default none), with ``config`` as its ``adapter_config.json`` where
    given."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    mx.save_safetensors(str(earlier / "adapters.safetensors"), tensors or {})
    if config is not None:
        (earlier / "adapter_config.json").write_text(json.dumps(config))
    return earlier / "adapters.safetensors"


def test_parser_wraps_mlx_lm():
    ours = {a.dest for a in lora.build_parser()._actions}
    theirs = {a.dest for a in mlx_lm.lora.build_parser()._actions}
    assert theirs <= ours
    assert {"gdn_chunk_size", "gdn_save_states", "demo"} <= ours


def test_no_command_prints_usage_to_stderr(capsys):
    """``chunkscan`` alone exits 2 with its usage on stderr (it went to stdout, found by
    probing); ``chunkscan -h`` prints it to stdout and exits 0."""
    assert cli.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: chunkscan <command>")
    assert cli.main(["-h"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and out.startswith("usage: chunkscan <command>")
    # --version and -V (an unknown command before; found by probing)
    for flag in ("--version", "-V"):
        assert cli.main([flag]) == 0
        assert capsys.readouterr().out == f"chunkscan {chunkscan.__version__}\n"
    # extra arguments were ignored, exit 0 (found by probing)
    assert cli.main(["--version", "extra"]) == 2
    assert "--version takes no arguments, got ['extra']" in capsys.readouterr().err


def test_precedence_cli_yaml_defaults(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gdn_chunk_size: 8\nbatch_size: 3\nclear_cache_threshold: 123\n")
    args = lora.resolve_args(["-c", str(cfg), "--batch-size", "5"])
    assert (args.gdn_chunk_size, args.batch_size, args.clear_cache_threshold) == (8, 5, 123)
    args = lora.resolve_args(["-c", str(cfg), "--gdn-chunk-size", "32"])
    assert args.gdn_chunk_size == 32
    args = lora.resolve_args([])
    assert args.gdn_chunk_size == lora.op_default_chunk_size()
    assert args.gdn_save_states == "groups"


def test_save_states_flag_and_yaml_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gdn_save_states: chunks\n")
    assert lora.resolve_args(["-c", str(cfg)]).gdn_save_states == "chunks"
    args = lora.resolve_args(["-c", str(cfg), "--gdn-save-states", "groups"])
    assert args.gdn_save_states == "groups"
    cfg.write_text("gdn_save_states: all\n")
    with pytest.raises(SystemExit, match="gdn_save_states must be one of 'chunks', 'groups'"):
        lora.resolve_args(["-c", str(cfg)])
    assert args.iters == mlx_lm.lora.CONFIG_DEFAULTS["iters"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("0", "chunk_size must be at least 1 but got 0. Pass a positive int such as"),
        ("2.5", "chunk_size must be an int but got '2.5'. Pass e.g. chunk_size="),
        ("1_6", "chunk_size must be an int but got '1_6'"),  # int() read 16 (probing)
    ],
    ids=["zero", "float", "underscore"],
)
def test_bad_gdn_chunk_size_flag(text, message, capsys):
    with pytest.raises(SystemExit) as info:
        lora.resolve_args(["--gdn-chunk-size", text])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument --gdn-chunk-size/--scan-chunk-size: [chunkscan lora] {message}" in err


def test_bad_gdn_chunk_size_in_yaml(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gdn_chunk_size: -4\n")
    message = (
        f"chunkscan lora: gdn_chunk_size (from -c {cfg}): [chunkscan lora] chunk_size must "
        "be at least 1 but got -4."
    )
    with pytest.raises(SystemExit, match=re.escape(message)):
        lora.resolve_args(["-c", str(cfg)])


def test_yaml_keys_that_would_be_ignored(tmp_path):
    """A YAML key spelled as its flag raises (mlx-lm's merge matched keys exactly, so
    ``gdn-chunk-size: 16`` was ignored and the op ran its default), a top level that is
    no mapping raises a message (a list gave an AttributeError), and a key no option
    knows warns that it is ignored; mlx-lm's own keys (``lora_parameters``) pass."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gdn-chunk-size: 16\n")
    msg = "'gdn-chunk-size' is spelled as a flag; YAML keys use underscores: 'gdn_chunk_size'."
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["-c", str(cfg)])
    cfg.write_text("- gdn_chunk_size: 16\n")
    with pytest.raises(SystemExit, match=re.escape("must hold a mapping of option names")):
        lora.resolve_args(["-c", str(cfg)])
    cfg.write_text("gdn_chunk_sise: 16\nlora_parameters: {rank: 4}\n")
    with pytest.warns(UserWarning, match=re.escape("the key 'gdn_chunk_sise' is no option")):
        args = lora.resolve_args(["-c", str(cfg)])
    assert args.lora_parameters == {"rank": 4}
    # mlx-lm reads its dataset keys with getattr (no flag, no default): they were called
    # ignored, and a run without them failed on a dataset of other columns (probing)
    cfg.write_text(
        "prompt_feature: input\ncompletion_feature: output\ntext_feature: body\n"
        "chat_feature: turns\nhf_dataset: {path: x}\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = lora.resolve_args(["-c", str(cfg)])
    assert args.prompt_feature == "input" and args.hf_dataset == {"path": "x"}
    assert args.text_feature == "body" and args.chat_feature == "turns"


def test_scan_chunk_size_is_a_deprecated_alias(tmp_path):
    with pytest.warns(FutureWarning, match=re.escape("--scan-chunk-size is deprecated")):
        args = lora.resolve_args(["--scan-chunk-size", "24"])
    assert args.gdn_chunk_size == 24 and not hasattr(args, "scan_chunk_size")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("scan_chunk_size: 12\n")
    with pytest.warns(FutureWarning, match="the YAML key scan_chunk_size is deprecated"):
        args = lora.resolve_args(["-c", str(cfg)])
    assert args.gdn_chunk_size == 12 and not hasattr(args, "scan_chunk_size")


def test_real_run_saves_adapters_that_load_back(tmp_path, capsys, monkeypatch):
    model_path = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=6, n_valid=2, min_words=20, max_words=50)
    adapters = tmp_path / "adapters"
    op, seen = cmlx._op(), []  # what reaches the op (the banner only echoes the flags)

    def spy(*args, **kwargs):
        if cmlx._stack:  # under the run's patch (not patch()'s own probe)
            seen.append((kwargs.get("chunk_size"), kwargs.get("save_states")))
        return op(*args, **kwargs)

    monkeypatch.setattr(cmlx, "_op", lambda: spy)
    rc = cli.main(
        ["lora", "--model", str(model_path), "--data", str(data), "--train",
         "--iters", "2", "--batch-size", "2", "--num-layers", "-1",
         "--max-seq-length", "64", "--val-batches", "1", "--steps-per-report", "1",
         "--adapter-path", str(adapters), "--gdn-chunk-size", "16",
         "--gdn-save-states", "chunks", "--learning-rate", "1e-2"]
    )  # fmt: skip
    assert rc == 0
    # the settings reach the op (passing neither to patch() went unnoticed; mutation)
    assert seen and set(seen) == {(16, "chunks")}
    assert cmlx.patched_families() == ()  # undone after the run
    out = capsys.readouterr().out
    assert "chunkscan.gated_delta_rule (chunk_size=16" in out
    assert "peak memory" in out
    # the first report counts the paths' calls of the run (not patch()'s probes)
    routes = re.search(r"where the calls went so far .*-> chunkscan.gated_delta_rule (\d+); "
                       r"attention without a cache -> chunkscan.attention (\d+), "
                       r"mlx-lm's (\d+)\n", out)  # fmt: skip
    assert routes and int(routes[1]) > 0 and int(routes[2]) > 0, out
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["gdn_chunk_size"] == 16
    saved = mx.load(str(adapters / "adapters.safetensors"))
    assert any("linear_attn" in k for k in saved)
    model, _ = mlx_lm.load(str(model_path), adapter_path=str(adapters))
    params = dict(tree_flatten(model.parameters()))
    for name, value in saved.items():
        assert mx.array_equal(params[name], value).item(), name
    # Training moved the adapters away from their init (lora_b starts at zero).
    assert any(k.endswith("lora_b") and mx.abs(v).max().item() > 0 for k, v in saved.items())


def test_the_routes_line_counts_where_attention_calls_went(monkeypatch):
    """Every attention call of kimi_linear (and DeepSeek's MLA) passes a floating mask,
    gpt_oss's sinks: all stay with mlx-lm while the banner named chunkscan.attention, as
    the model's modules hold the patched function (found by probing). The first report
    now counts where the calls went."""
    monkeypatch.setattr(cmlx, "routed_calls", collections.Counter())
    q = mx.zeros((1, 2, 4, 8))
    with cmlx.patch(verify=False):
        cmlx.scaled_dot_product_attention(q, q, q, None, 1.0, "causal")
        cmlx.scaled_dot_product_attention(q, q, q, None, 1.0, mx.zeros((4, 4)))  # floating
        cmlx.scaled_dot_product_attention(q, q, q, None, 1.0, None, sinks=mx.zeros((2,)))
    line = _lora_reports._routes_line()
    assert "-> chunkscan.attention 1, mlx-lm's 2 (sinks, a floating mask" in line
    assert "-> chunkscan.gated_delta_rule 0;" in line
    assert "Mamba2" not in line
    x = mx.zeros((1, 5, 2, 3))
    bc = mx.zeros((1, 5, 1, 4))
    with cmlx.patch(verify=False):
        import mlx_lm.models.ssm as ssm

        ssm.ssm_attn(x, mx.zeros(2), bc, bc, mx.zeros(2), mx.zeros((1, 5, 2)), mx.zeros(2))
    assert (
        "; Mamba2 SSD without padding -> chunkscan.linear_attention 1"
        in _lora_reports._routes_line()
    )
    assert "selective_scan" not in _lora_reports._routes_line()
    cmlx.routed_calls["chunkscan.selective_scan"] += 2  # (two Mamba layers' calls)
    assert "; Mamba's selective scan -> chunkscan.selective_scan 2" in _lora_reports._routes_line()
    assert "dplr_delta_rule" not in _lora_reports._routes_line()
    cmlx.routed_calls["chunkscan.dplr_delta_rule"] += 3  # (three RWKV-7 layers' calls)
    assert "; RWKV-7's recurrence -> chunkscan.dplr_delta_rule 3" in _lora_reports._routes_line()
    assert "diagonal_recurrence" not in _lora_reports._routes_line()
    cmlx.routed_calls["chunkscan.diagonal_recurrence"] += 2  # (two RG-LRU layers' calls)
    assert "; RG-LRU's scan -> chunkscan.diagonal_recurrence 2" in _lora_reports._routes_line()


def test_the_routes_line_names_the_models_routes_even_at_zero(monkeypatch):
    """Given the model's routes (the banner's reading of its folder): a Mamba model's
    selective-scan route with its count at 0 (a quantized model's calls all went to
    mlx-lm and the line said nothing of them), and no Gated DeltaNet route or its
    validation note, which were printed for Mamba and RWKV models too (found by
    probing, session 47). A Gated DeltaNet model keeps both."""
    monkeypatch.setattr(cmlx, "routed_calls", collections.Counter())
    mamba = _lora_reports._Routes("mamba", gated_deltanet=False, attention=False, mamba=True)
    line = _lora_reports._routes_line(mamba)
    assert "; Mamba's selective scan -> chunkscan.selective_scan 0" in line
    assert "gated_delta_rule" not in line and "its per-token loop" not in line
    assert "dplr_delta_rule" not in line
    qwen = _lora_reports._Routes("qwen3_next", gated_deltanet=True, attention=True)
    line = _lora_reports._routes_line(qwen)
    assert "gated_delta_rule 0" in line and "its per-token loop" in line
    assert "selective_scan" not in line


def _completions(path: pathlib.Path, prompt_words: int) -> pathlib.Path:
    """A data folder of ``{"prompt", "completion"}`` lines (``--mask-prompt``'s form)."""
    path.mkdir(parents=True, exist_ok=True)
    words = "one two three four five six seven eight nine ten".split()
    line = json.dumps({"prompt": " ".join(words[i % 10] for i in range(prompt_words)),
                       "completion": "red green blue"})  # fmt: skip
    for split in ("train", "valid"):
        (path / f"{split}.jsonl").write_text((line + "\n") * 4)
    return path


def test_a_loss_that_is_not_finite_stops_the_run(tmp_path, capsys):
    """``--mask-prompt`` with prompts longer than ``--max-seq-length``: no target token,
    a loss of 0 / 0. mlx-lm trained on and saved NaN adapters, exit 0 (found by
    probing); the run stops at the report, saves nothing at the end, and says that the
    folder's weights are an earlier run's."""
    model_path = small_model(tmp_path / "model")
    data = _completions(tmp_path / "data", prompt_words=40)
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    earlier = {"earlier": mx.zeros((2,))}
    mx.save_safetensors(str(adapters / "adapters.safetensors"), earlier)
    argv = ["lora", "--model", str(model_path), "--data", str(data), "--train",
            "--iters", "3", "--batch-size", "2", "--num-layers", "-1", "--mask-prompt",
            "--max-seq-length", "16", "--val-batches", "1", "--steps-per-report", "1",
            "--adapter-path", str(adapters)]  # fmt: skip
    with pytest.raises(SystemExit, match=r"the training loss is nan at iteration 1;") as e:
        cli.main(argv)
    assert "--mask-prompt, a batch whose prompts fill --max-seq-length (16)" in str(e.value)
    assert "is still an earlier run's, beside this run's adapter_config" in capsys.readouterr().err
    assert set(mx.load(str(adapters / "adapters.safetensors"))) == {"earlier"}
    # Prompts that leave room for the completion: the same run trains and saves.
    _completions(tmp_path / "data", prompt_words=4)
    assert cli.main(argv) == 0
    saved = mx.load(str(adapters / "adapters.safetensors"))
    assert "earlier" not in saved and all(mx.isfinite(v).all().item() for v in saved.values())
    assert "earlier run's" not in capsys.readouterr().err


def test_an_adapter_path_that_is_not_writable_is_refused(tmp_path, monkeypatch, no_load):
    """mlx-lm's PermissionError came after the model had loaded (found by probing). The
    tests run as root here, which may write anywhere: ``os.access`` is faked."""
    model, data = small_model(tmp_path / "model"), write_dataset(tmp_path / "data")
    folder = tmp_path / "out"
    folder.mkdir()
    real = os.access
    monkeypatch.setattr(_lora_adapters.os, "access", lambda p, mode: p != folder and real(p, mode))
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    with pytest.raises(SystemExit, match=f"--adapter-path {folder / 'a'}: {folder} is not w"):
        lora.main([*argv, "--adapter-path", str(folder / "a")])


def test_demo_runs(capsys):
    rc = lora.main(["--demo", "--iters", "2", "--max-seq-length", "48", "--steps-per-report", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "chunkscan lora --demo: done" in out and "tok/s" in out


def test_demo_with_test_evaluates(capsys):
    """``--demo --test``: the demo data set has a test split (it had none: mlx-lm's
    "Test set not found or empty", exit 1; found by probing)."""
    argv = ["--demo", "--iters", "1", "--max-seq-length", "48", "--test", "--test-batches", "1"]
    assert lora.main(argv) == 0
    assert "Test loss" in capsys.readouterr().out


def test_demo_checks_its_adapter_path(tmp_path, monkeypatch):
    """``--demo`` skipped the adapter-path checks: a file there was mlx-lm's
    FileExistsError after the model loaded, and '~/x' wrote into ./~/x while the demo
    said "adapters in ~/x" (found by probing)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit, match=re.escape("afile is a file; training writes")):
        lora.main(["--demo", "--iters", "1", "--adapter-path", str(afile)])
    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args.adapter_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    assert lora.main(["--demo", "--iters", "1", "--adapter-path", "~/kept"]) == 0
    assert ran == [str(tmp_path / "kept")]


def test_demo_never_replaces_adapters_it_did_not_write(tmp_path, monkeypatch):
    """An existing ``--adapter-path`` folder the demo did not make (an earlier run's
    adapters) is refused before anything is written: the demo replaced those adapters
    with ones whose config named its deleted temporary model (found by probing). A new
    folder is made and marked, and a later demo may write it again."""
    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args.adapter_path))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "adapters.safetensors").write_text("an earlier run's")
    fresh = tmp_path / "fresh_data"
    argv = ["--demo", "--iters", "1", "--data", str(fresh), "--adapter-path"]
    msg = f"--adapter-path {theirs} is a folder that the demo did not create"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, str(theirs)])
    assert sorted(x.name for x in theirs.iterdir()) == ["adapters.safetensors"]
    assert not fresh.exists() and ran == []  # refused before writing anything
    ours = tmp_path / "ours"
    assert lora.main([*argv, str(ours)]) == 0
    assert (ours / _lora_demo.DEMO_MARKER).is_file() and ran == [str(ours)]
    assert lora.main([*argv, str(ours)]) == 0 and ran == [str(ours)] * 2


def test_demo_refuses_a_file_as_its_folder(tmp_path):
    path = tmp_path / "a_file"
    path.write_text("")
    msg = f"chunkscan lora --demo: --data {path} is a file, not a folder, so the demo cannot"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--demo", "--data", str(path), "--iters", "1"])


# ------------------------------------------------- the demo never writes others' folders


def test_demo_refuses_an_existing_folder_it_did_not_make(tmp_path, capsys):
    """The user's folder, without config.json / train.jsonl: refused before anything is
    written (the demo used to rewrite tokenizer*.json and valid.jsonl there, exit 0)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tokenizer.json").write_text("my tokenizer")
    (mine / "valid.jsonl").write_text("my data")
    fresh = tmp_path / "fresh"
    msg = (
        f"chunkscan lora --demo: --model {mine} is a folder that the demo did not create "
        "(no .chunkscan-demo file in it) and has no config.json, so the demo will not "
        "write its files there. Pass a path that does not exist yet (the demo creates it "
        "and keeps it), a folder an earlier demo made, or one that already has config.json."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--demo", "--model", str(mine), "--data", str(fresh), "--iters", "1"])
    with pytest.raises(SystemExit, match=re.escape(f"--data {mine} is a folder that the demo")):
        lora.main(["--demo", "--model", str(fresh), "--data", str(mine), "--iters", "1"])
    assert sorted(p.name for p in mine.iterdir()) == ["tokenizer.json", "valid.jsonl"]
    assert (mine / "tokenizer.json").read_text() == "my tokenizer"
    assert (mine / "valid.jsonl").read_text() == "my data"
    assert not fresh.exists()  # checked both before writing either


def test_demo_writes_new_folders_and_reuses_its_own(tmp_path):
    args = types.SimpleNamespace(model=str(tmp_path / "m"), data=str(tmp_path / "d"))
    _lora_demo._write_demo(args)
    for sub, key in (("m", "config.json"), ("d", "train.jsonl"), ("d", "test.jsonl")):
        assert (tmp_path / sub / _lora_demo.DEMO_MARKER).is_file() and (
            tmp_path / sub / key
        ).is_file()
    # Its own folder, incomplete: written again. A complete one: used as it is.
    (tmp_path / "m" / "config.json").unlink()
    (tmp_path / "d" / "train.jsonl").write_text("kept\n")
    _lora_demo._write_demo(args)
    assert (tmp_path / "m" / "config.json").is_file()
    assert (tmp_path / "d" / "train.jsonl").read_text() == "kept\n"


def test_demo_uses_a_complete_model_folder_without_writing(tmp_path):
    model = small_model(tmp_path / "user_model")
    before = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}
    _lora_demo._write_demo(types.SimpleNamespace(model=str(model), data=str(tmp_path / "d")))
    assert {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == before
    # the banner says whose model it is (it named the user's "tiny random Qwen3-Next")
    assert _lora_demo._demo_banner(str(model)).endswith("your model in " + str(model) + ", as it "
                                                  "is (not the demo's)")  # fmt: skip
    assert "tiny random Qwen3-Next" in _lora_demo._demo_banner(str(tmp_path / "d"))


# --------------------------------------------- what is missing, said before loading


def test_no_arguments_says_what_to_pass(capsys):
    assert cli.main(["lora"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: chunkscan lora")
    assert (
        "chunkscan lora: no arguments. Pass --model (a folder or a Hugging Face repo id), "
        "--data and --train, plus any mlx_lm.lora flag; or try --demo (offline)."
    ) in err


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if mlx_lm.lora.run is reached (the checks must stop first)."""

    def never(*a, **k):
        raise AssertionError("mlx_lm.lora.run was called")

    monkeypatch.setattr(mlx_lm.lora, "run", never)


def test_missing_model_path_is_reported_before_loading(tmp_path, no_load):
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    missing = tmp_path / "no_such_model"
    msg = (
        f"chunkscan lora: --model {missing}: no such folder (and not a Hugging Face repo "
        "id, namespace/name). Pass an MLX model folder that exists, or a repo id such as "
        "mlx-community/...; or try chunkscan lora --demo."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--model", str(missing), "--data", str(data), "--train"])
    with pytest.raises(SystemExit, match=re.escape(f"--model {tmp_path} is a folder without")):
        lora.main(["--model", str(tmp_path), "--data", str(data), "--train"])
    model = small_model(tmp_path / "model")
    with pytest.raises(SystemExit, match=re.escape(f"--data {missing}: no such folder")):
        lora.main(["--model", str(model), "--data", str(missing), "--train"])
    with pytest.raises(SystemExit, match=re.escape("chunkscan lora: nothing to do: pass --train")):
        lora.main(["--model", str(model), "--data", str(data)])
    # found by probing: the demo with train: false in its -c wrote and loaded the model
    # first; --train --adapter-path '' wrote the adapters into the working folder; a
    # model folder without weights was mlx-lm's error after the checks
    cfg = tmp_path / "no_train.yaml"
    cfg.write_text("train: false\n")
    with pytest.raises(SystemExit, match=re.escape("chunkscan lora: nothing to do: pass --train")):
        lora.main(["--demo", "-c", str(cfg)])
    with pytest.raises(SystemExit, match=re.escape("--adapter-path '' means no adapters")):
        lora.main(["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
                   "--adapter-path", ""])  # fmt: skip
    (model / "model.safetensors").rename(model / "weights.bin")
    with pytest.raises(SystemExit, match=re.escape("holds no model*.safetensors")):
        lora.main(["--model", str(model), "--data", str(data), "--train"])
    (model / "weights.bin").rename(model / "model.safetensors")


def test_what_the_probe_found_is_said_before_loading(tmp_path, monkeypatch, no_load):
    """Found by probing the CLI: a missing -c file was a raw FileNotFoundError; a data
    folder without train.jsonl (or test.jsonl for --test) was mlx-lm's error after the
    model loaded; a quoted '~/...' model folder passed the check and reached mlx-lm
    unexpanded (read as a repo id)."""
    with pytest.raises(SystemExit, match=re.escape("chunkscan lora: -c nope.yaml: the config")):
        lora.main(["-c", "nope.yaml", "--train"])
    model = small_model(tmp_path / "my model")
    empty = tmp_path / "empty data"
    empty.mkdir()
    msg = f"chunkscan lora: --data {empty} has no train.jsonl, which --train reads"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--model", str(model), "--data", str(empty), "--train"])
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    (data / "test.jsonl").unlink()  # (the demo's data set has one since session 30)
    with pytest.raises(SystemExit, match=re.escape("has no test.jsonl, which --test reads")):
        lora.main(["--model", str(model), "--data", str(data), "--test"])
    monkeypatch.setenv("HOME", str(tmp_path))
    args = lora.resolve_args(["--model", "~/my model", "--data", "~/data", "--train",
                              "--num-layers", "-1"])  # fmt: skip
    lora.check_args(args)
    assert (args.model, args.data) == (str(model), str(data))
    # the adapters' paths too: mlx-lm wrote '~/out' into ./~/out and failed to open a
    # '~/...' --resume-adapter-file that the check had found (found by probing)
    (tmp_path / "first").mkdir()
    mx.save_safetensors(str(tmp_path / "first" / "adapters.safetensors"), {})
    args = lora.resolve_args(["--model", "~/my model", "--data", "~/data", "--train",
                              "--num-layers", "-1", "--adapter-path", "~/out",
                              "--resume-adapter-file", "~/first/adapters.safetensors"])  # fmt: skip
    lora.check_args(args)
    assert args.adapter_path == str(tmp_path / "out")
    assert args.resume_adapter_file == str(tmp_path / "first" / "adapters.safetensors")
    # -c '~/x.yaml' too (it was read as written; found by probing)
    (tmp_path / "c.yaml").write_text("batch_size: 3\n")
    assert lora.resolve_args(["-c", "~/c.yaml", "--train"]).batch_size == 3
    # a Hugging Face dataset needs the datasets package, which mlx-lm imports only then:
    # a ModuleNotFoundError after the model loaded (found by probing)
    import importlib.util

    hub = [*["--model", str(model), "--data", "someone/some-data"], "--train", "--num-layers", "-1"]
    have = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets"
                        else have(name, *a))  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape("--data someone/some-data is a Hugging Face")):
        lora.check_args(lora.resolve_args(hub))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "datasets"
                        else have(name, *a))  # fmt: skip
    lora.check_args(lora.resolve_args(hub))  # goes on: the package is there
    monkeypatch.setattr(importlib.util, "find_spec", have)
    # a file where training writes its folder, and --test alone without adapters: mlx-lm
    # raised after the model loaded (found by probing)
    (tmp_path / "a_file").write_text("")
    base = ["--model", str(model), "--data", str(data), "--num-layers", "-1"]
    args = lora.resolve_args([*base, "--train", "--adapter-path", str(tmp_path / "a_file")])
    with pytest.raises(SystemExit, match=re.escape("a_file is a file; training writes")):
        lora.check_args(args)
    (data / "test.jsonl").write_text((data / "valid.jsonl").read_text())
    args = lora.resolve_args([*base, "--test", "--adapter-path", str(tmp_path / "none")])
    with pytest.raises(SystemExit, match=re.escape("holds no adapters.safetensors or adapter")):
        lora.check_args(args)
    # a folder with adapters but no adapter_config.json (mlx-lm reads both), a file above
    # the folder training makes, a broken link there, a seed numpy refuses
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "adapters.safetensors").write_bytes(b"")
    args = lora.resolve_args([*base, "--test", "--adapter-path", str(tmp_path / "half")])
    with pytest.raises(SystemExit, match=re.escape("which holds no adapter_config.json")):
        lora.check_args(args)
    args = lora.resolve_args([*base, "--train", "--adapter-path", str(tmp_path / "a_file/x")])
    with pytest.raises(SystemExit, match=re.escape("a_file is a file; training writes")):
        lora.check_args(args)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    args = lora.resolve_args([*base, "--train", "--adapter-path", str(tmp_path / "dangling")])
    with pytest.raises(SystemExit, match=re.escape("dangling is a broken link")):
        lora.check_args(args)
    with pytest.raises(SystemExit, match=re.escape("--seed must be at most 2**32 - 1, not")):
        lora.resolve_args([*base, "--train", "--seed", str(2**32)])
    lora.resolve_args([*base, "--train", "--seed", str(2**32 - 1)])
    lora.check_args(lora.resolve_args([*base, "--test", "--adapter-path", ""]))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batch-size", "-2"], "--batch-size must be a whole number of at least 1, not -2."),
        (
            ["--num-layers", "0"],
            "--num-layers must be a whole number of at least 1, or -1 for all, not 0.",
        ),  # fmt: skip
        (["--val-batches", "-2"], "--val-batches must be a whole number of at least 0, or -1"),
        (["--iters", "0"], "--iters must be a whole number of at least 1, not 0."),
        (["--max-seq-length", "1"], "--max-seq-length must be a whole number of at least 2"),
        (["--steps-per-report", "0"], "--steps-per-report must be a whole number of at least"),
        (["--save-every", "0"], "--save-every must be a whole number of at least 1, not 0."),
        (["--learning-rate", "-1"], "--learning-rate must be a number of at least 0, not -1.0."),
        (["--learning-rate", "nan"], "--learning-rate must be a number of at least 0, not nan."),
        (["--seed", "-1"], "--seed must be a whole number of at least 0, not -1."),
    ],
    ids=["batch", "layers", "val", "iters", "seq", "report", "save", "lr", "lr-nan", "seed"],
)
def test_numbers_mlx_lm_takes_unchecked_are_refused(argv, message):
    """Found by probing: --batch-size -2 hung for ever, --num-layers 0 trained every
    layer, --val-batches 0 reported nan, --iters 0 saved untrained adapters; the rest
    ended in tracebacks. Every one passes through mlx_lm.lora unchecked."""
    with pytest.raises(SystemExit, match=re.escape(f"chunkscan lora: {message}")):
        lora.resolve_args(["--train", *argv])
    fine = (["--num-layers", "-1"], ["--val-batches", "-1"], ["--val-batches", "0"],
            ["--iters", "1"], ["--learning-rate", "0"])  # fmt: skip
    for ok in fine:
        lora.resolve_args(["--train", *ok])
    if argv[0] not in ("--batch-size", "--max-seq-length", "--seed"):  # --test reads these
        lora.resolve_args(["--test", *argv])


def test_test_batches_is_checked_where_test_reads_it():
    """``--test-batches 0`` was refused in a training run, which never reads it (found
    by probing, session 49); with ``--test`` it is still refused (the control)."""
    lora.resolve_args(["--train", "--test-batches", "0"])
    with pytest.raises(SystemExit, match=re.escape("--test-batches must be a whole number")):
        lora.resolve_args(["--train", "--test", "--test-batches", "0"])


def test_a_yaml_value_out_of_range_names_the_file(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("batch_size: 0\n")
    msg = f"--batch-size (from the command line or -c {cfg}) must be a whole number of at"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["-c", str(cfg), "--train"])
    cfg.write_text("learning_rate: fast\n")
    with pytest.raises(SystemExit, match=re.escape("must be a number of at least 0, not 'fast'")):
        lora.resolve_args(["-c", str(cfg), "--train"])
    # With a schedule mlx-lm reads no learning_rate (found by review).
    cfg.write_text("learning_rate: -1\nlr_schedule: {name: cosine_decay, arguments: [0.1, 10]}\n")
    lora.resolve_args(["-c", str(cfg), "--train"])


@pytest.mark.parametrize("key", ["demo", "train", "mask_prompt"])
def test_a_yaml_switch_must_be_true_or_false(key, tmp_path):
    """``demo: "no"`` (a quoted string, so true to Python) ran the demo with its
    settings, and ``train: "false"`` trained (found by probing): refused, naming the
    key; an unquoted ``no`` is YAML's false and passes."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f'{key}: "no"\n')
    msg = f"-c {cfg}: {key} must be true or false (unquoted), not 'no'."
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["-c", str(cfg)])
    cfg.write_text(f"{key}: no\n")
    assert getattr(lora.resolve_args(["-c", str(cfg)]), key) is False
    cfg.write_text(f"{key}: 0\n")  # a number reads as mlx-lm reads it, by its truth (review)
    assert getattr(lora.resolve_args(["-c", str(cfg)]), key) == 0


def test_malformed_yaml_and_empty_data_are_one_line(tmp_path, no_load):
    """Found by probing: a YAML syntax error was a ``yaml.scanner`` traceback, an empty
    train.jsonl or valid.jsonl mlx-lm's ``IndexError`` after the model loaded."""
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("iters: [1\n")
    msg = f"chunkscan lora: -c {cfg}: the config file is not valid YAML at line 2, column 1"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["-c", str(cfg), "--train"])
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    for split in ("valid", "train"):
        kept = (data / f"{split}.jsonl").read_text()
        (data / f"{split}.jsonl").write_text("\n  \n")
        msg = f"--data {data}: {split}.jsonl is empty (no line holds an example)."
        with pytest.raises(SystemExit, match=re.escape(msg)):
            lora.main(["--model", str(model), "--data", str(data), "--train"])
        (data / f"{split}.jsonl").write_text(kept)


def test_data_lines_mlx_lm_cannot_read_are_refused_naming_file_and_line(tmp_path, no_load):
    """mlx-lm parses every line of each split with ``json.loads`` after the model
    loaded: one blank line (a trailing empty line, even in a valid.jsonl that
    ``--val-batches 0`` never reads) was a ``JSONDecodeError`` naming neither file nor
    line, and a line without the first line's key a ``KeyError`` (found by probing)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "--val-batches", "0"]  # fmt: skip
    train = (data / "train.jsonl").read_text()
    example = train.splitlines()[0]
    where = f"chunkscan lora: --data {data}:"
    cases = [
        ("valid", train + "\n", "valid.jsonl line 5 is blank; mlx-lm reads every line"),
        ("valid", "\n" + train, "valid.jsonl line 1 is blank"),  # (read as empty: review)
        ("train", train + "  \n", "train.jsonl line 5 is blank"),
        ("train", train + "{'text': 1}\n", "train.jsonl line 5 is not valid JSON (Expecting"),
        ("train", train + "[1, 2]\n", "train.jsonl line 5 is a JSON list, not an object"),
        ("train", train + '{"prompt": "a"}\n', "train.jsonl line 5 lacks 'text', which line 1"),
        ("train", '{"txt": "a b"}\n' + train, "train.jsonl line 1 has none of the keys mlx-lm"),
    ]
    # after the model loaded too (found by probing): bytes that are not UTF-8 (the check
    # read them replaced), a value of another type (mid-training)
    number = train.replace('"text"', '"text": 1, "x"', 1)
    cases += [
        ("train", train + '{"text": null}\n', "train.jsonl line 5: 'text' is a JSON null, not a"),
        ("train", number, "train.jsonl line 1: 'text' is a JSON number, not a string"),
        ("train", train + '{"text": "a \udcff"}\n', "train.jsonl line 5 is not UTF-8 (byte"),
        # lines ended by a lone \r, as the text layer reads them (a review: "line 1")
        ("train", train.replace("\n", "\r") + '{"text": "\udcff"}\r', "train.jsonl line 5 is not"),
    ]  # fmt: skip
    for split, content, msg in cases:
        kept = (data / f"{split}.jsonl").read_text()
        (data / f"{split}.jsonl").write_bytes(content.encode("utf-8", "surrogateescape"))
        with pytest.raises(SystemExit, match=re.escape(f"{where} {msg}")):
            lora.main(argv)
        (data / f"{split}.jsonl").write_text(kept)
    # a split that is a folder: mlx-lm opens every split file of the folder
    kept = (data / "valid.jsonl").read_text()
    (data / "valid.jsonl").unlink()
    (data / "valid.jsonl").mkdir()
    with pytest.raises(SystemExit, match=re.escape(f"{where} valid.jsonl is not a file")):
        lora.main(argv)
    (data / "valid.jsonl").rmdir()
    (data / "valid.jsonl").write_text(kept)
    # prompt / completion and chat examples, and CRLF line ends, pass
    pairs = json.dumps({"prompt": "a b", "completion": "c d"})
    chat = json.dumps({"messages": [{"role": "user", "content": "a\u2028b"}]}, ensure_ascii=False)
    for content in ((pairs + "\n") * 4, (chat + "\r\n") * 4, (example + "\r\n") * 4):
        (data / "train.jsonl").write_text(content, newline="")
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)
    # ... but the first two go through the tokenizer's chat template: a model without
    # one (the demo's had none) was a traceback after loading (found by probing)
    tokenizer = json.loads((model / "tokenizer_config.json").read_text())
    del tokenizer["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    for content, kind in ((pairs, "'prompt' / 'completion'"), (chat, "'messages'")):
        (data / "train.jsonl").write_text((content + "\n") * 4)
        msg = f"{where} train.jsonl holds {kind} examples, which mlx-lm formats with the"
        with pytest.raises(SystemExit, match=re.escape(msg)):
            lora.main(argv)


def test_a_model_config_mlx_lm_cannot_read_is_refused_before_loading(tmp_path, no_load):
    """A ``config.json`` that is not JSON, or names a model type mlx-lm has no model for,
    was mlx-lm's traceback (found by probing)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    config = (model / "config.json").read_text()
    where = f"chunkscan lora: --model {model}: config.json"
    cases = [
        ("{not json", f"{where} is not valid JSON (Expecting property name"),
        ("[1]", f"{where} names no model_type"),
        (json.dumps(dict(json.loads(config), model_type="foo_bar")),
         f"{where}: Model type foo_bar not supported. (mlx-lm "),
    ]  # fmt: skip
    for text, msg in cases:
        (model / "config.json").write_text(text)
        with pytest.raises(SystemExit, match=re.escape(msg)):
            lora.main(argv)
    (model / "config.json").write_text(config)
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)


def test_the_prechecks_leave_to_mlx_lm_what_it_accepts(tmp_path, monkeypatch):
    """Found by reviewing session 36's prechecks: a model of its own code
    (``model_file``, with ``trust_remote_code``) is built by mlx-lm without the model
    types it knows, so its type is not checked; a data file's examples are held to
    line 1's keys only in the splits the run reads (mlx-lm takes the keys of an example
    only when it reads it; every file's lines must still be JSON); and the resumed
    adapters' layers are not checked where the config's ``num_layers`` disagrees with
    ``num_hidden_layers`` (LongCat-Flash builds ``num_layers``)."""
    import mlx.core as mx

    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(
        json.dumps(dict(config, model_type="my_arch", model_file="my_model.py"))
    )
    argv = ["--model", str(model), "--data", str(data), "--num-layers", "-1"]
    assert lora.main([*argv, "--train"]) == 0
    (model / "config.json").write_text(json.dumps(config))
    train = (data / "train.jsonl").read_text()
    (data / "train.jsonl").write_text(train + '{"prompt": "a"}\n')
    assert lora.main([*argv, "--test", "--adapter-path", ""]) == 0  # train.jsonl unread
    with pytest.raises(SystemExit, match=re.escape("train.jsonl line 5 lacks 'text'")):
        lora.main([*argv, "--train"])
    (data / "train.jsonl").write_text(train)
    names = [f"model.layers.{i}.mlp.up_proj.lora_{ab}" for i in (0, 1) for ab in "ab"]
    earlier = earlier_adapters(tmp_path, {n: mx.zeros((2,)) for n in names})
    resume = [*argv[:4], "--train", "--num-layers", "1", "--resume-adapter-file", str(earlier)]
    with pytest.raises(SystemExit, match=re.escape("holds adapters of layer 0, which")):
        lora.main(resume)
    (model / "config.json").write_text(json.dumps(dict(config, num_layers=1)))
    assert lora.main(resume) == 0 and len(ran) == 3


def test_a_model_folder_without_tokenizer_files_is_refused_before_loading(tmp_path, no_load):
    """mlx-lm loaded a tokenizer that made no tokens of any example, and training
    stopped at its first batch with an ``IndexError`` traceback (found by probing,
    session 40): refused before loading. Any tokenizer's files pass."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    saved = {p.name: p.read_bytes() for p in model.glob("tokenizer*")}
    assert saved
    for name in saved:
        (model / name).unlink()
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    with pytest.raises(SystemExit, match=re.escape(f"--model {model} holds no tokenizer files")):
        lora.main(argv)
    for name in ("tokenizer.model", "tekken.json"):  # SentencePiece's; Mistral's (review)
        (model / name).write_bytes(b"")
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)
        (model / name).unlink()


def test_lora_parameters_without_the_keys_mlx_lm_reads_are_refused(tmp_path, no_load):
    """A YAML ``lora_parameters`` replaces mlx-lm's whole, and mlx-lm reads ``rank``,
    ``scale`` and ``dropout`` without a default: one left out was a ``KeyError`` after
    the model loaded (found by probing). Full fine-tuning reads none of them."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    cfg = tmp_path / "rank.yaml"
    cfg.write_text("lora_parameters: {rank: 4}\n")
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "-c", str(cfg)]  # fmt: skip
    msg = (f"lora_parameters (from -c {cfg}) lacks 'scale' and "
           "'dropout', which mlx-lm reads without a default")  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(argv)
    cfg.write_text("lora_parameters: 4\n")
    with pytest.raises(SystemExit, match=re.escape("must be a mapping such as")):
        lora.main(argv)
    cfg.write_text("lora_parameters: {rank: 4}\nfine_tune_type: full\n")
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)


def test_resumed_adapters_of_another_rank_are_refused_before_loading(tmp_path, monkeypatch):
    """mlx-lm loads ``--resume-adapter-file`` with ``strict=False``: rank-4 adapters were
    loaded with their own shapes into a rank-8 run, trained, and saved beside a rank-8
    config that then failed to load (found by probing)."""
    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 4, "scale": 20.0}}
    earlier = earlier_adapters(tmp_path, config=config)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "--resume-adapter-file", str(earlier)]  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape("was trained with rank 4 (")):
        lora.main(argv)
    with pytest.raises(SystemExit, match=re.escape("was trained with fine_tune_type 'lora'")):
        lora.main([*argv, "--fine-tune-type", "dora"])
    cfg = tmp_path / "rank4.yaml"
    cfg.write_text("lora_parameters: {rank: 4, scale: 20.0, dropout: 0.0}\n")
    assert lora.main([*argv, "-c", str(cfg)]) == 0 and len(ran) == 1
    missing = ["--resume-adapter-file", str(tmp_path / "none.safetensors")]
    with pytest.raises(SystemExit, match=re.escape("none.safetensors: no such file")):
        lora.main([*argv[:7], *missing])


def test_resumed_adapters_are_checked_by_their_own_shapes_and_names(tmp_path, monkeypatch):
    """Without an ``adapter_config.json`` beside ``--resume-adapter-file`` (a file copied
    alone) a rank-4 file resumed at rank 8 went on, exit 0, and saved adapters that do
    not load; a full fine-tune resumed with fewer ``--num-layers`` dropped the other
    layers' weights from the saved file (both found by probing). The rank is read off
    the ``lora_b`` shapes, the layers off the names; the same file at the right rank,
    or with every layer trained, goes on."""
    import mlx.core as mx

    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    model = small_model(tmp_path / "model")  # 2 layers
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    lone = tmp_path / "lone" / "adapters.safetensors"
    lone.parent.mkdir()
    up = "model.layers.1.mlp.up_proj"
    mx.save_safetensors(str(lone), {f"{up}.lora_a": mx.zeros((16, 4)),
                                    f"{up}.lora_b": mx.zeros((4, 32))})  # fmt: skip
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "--resume-adapter-file", str(lone)]  # fmt: skip
    msg = "holds adapters of rank 4 (its tensors' shapes), this run asks for rank 8"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(argv)
    # the same tensors in an .npz file, which mx.load reads as mlx-lm does (a safetensors
    # header reader read no names or shapes in it, and the run went on; found by review)
    npz = lone.with_suffix(".npz")
    mx.savez(str(npz), **mx.load(str(lone)))
    with pytest.raises(SystemExit, match=re.escape(f"--resume-adapter-file {npz} {msg}")):
        lora.main([*argv[:-1], str(npz)])
    cfg = tmp_path / "rank4.yaml"
    cfg.write_text("lora_parameters: {rank: 4, scale: 20.0, dropout: 0.0}\n")
    assert lora.main([*argv, "-c", str(cfg)]) == 0 and len(ran) == 1
    full = tmp_path / "full" / "adapters.safetensors"
    full.parent.mkdir()
    mx.save_safetensors(str(full), {f"model.layers.{i}.mlp.up_proj.weight": mx.zeros((2,))
                                    for i in (0, 1)})  # fmt: skip
    argv = ["--model", str(model), "--data", str(data), "--train", "--fine-tune-type", "full",
            "--resume-adapter-file", str(full)]  # fmt: skip
    with pytest.raises(
        SystemExit, match=re.escape("holds adapters of layer 0, which --num-layers 1")
    ):
        lora.main([*argv, "--num-layers", "1"])
    assert lora.main([*argv, "--num-layers", "2"]) == 0 and len(ran) == 2


def test_lora_parameters_values_are_checked(tmp_path, no_load):
    """mlx-lm takes ``lora_parameters`` as they are: rank 0 trained nothing and scale
    .nan gave NaN adapters, both with exit 0; a negative rank, dropout 1.5 or a key that
    is not a string failed after the model loaded (found by probing)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    cfg = tmp_path / "lora.yaml"
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "-c", str(cfg)]  # fmt: skip
    for given, message in (
        ("rank: 0, scale: 20.0, dropout: 0.0", "rank must be a whole number of at least 1, not 0"),
        ("rank: -2, scale: 20.0, dropout: 0.0", "not -2"),
        ("rank: 8.0, scale: 20.0, dropout: 0.0", "not 8.0"),
        ("rank: 8, scale: .nan, dropout: 0.0", "scale must be a finite number, not nan"),
        ("rank: 8, scale: 20.0, dropout: 1.5", "dropout must be a number from 0 up to"),
        ("rank: 8, scale: 20.0, dropout: 0.0, keys: [1]", "keys must be a list of module names"),
        ("rank: 8, scale: 20.0, dropout: 0.0, keys: []", "keys must be a list of module names"),
    ):
        cfg.write_text(f"lora_parameters: {{{given}}}\n")
        with pytest.raises(SystemExit, match=re.escape(message)):
            lora.main(argv)
    cfg.write_text("lora_parameters: {rank: 8, scale: 20.0, dropout: 0.0, keys: [mlp.up_proj]}\n")
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)


def test_resumed_adapters_of_layers_or_keys_this_run_skips_are_refused(tmp_path, monkeypatch):
    """Adapters of layers 0 and 1 resumed with ``--num-layers 1`` (the last layer only):
    mlx-lm loads the file with ``strict=False``, so layer 0's were dropped, trained no
    further and left out of the saved file, exit status 0 (found by probing). So are
    adapters of a projection the run's ``lora_parameters.keys`` leave out. A run that
    wraps every resumed layer and key goes on."""
    import mlx.core as mx

    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    model = small_model(tmp_path / "model")  # 2 layers
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    names = [f"model.layers.{i}.mlp.{p}_proj.lora_{ab}" for i in (0, 1) for p in ("up", "down")
             for ab in "ab"]  # fmt: skip
    mx.save_safetensors(str(earlier / "adapters.safetensors"), {n: mx.zeros((2,)) for n in names})
    config = {
        "fine_tune_type": "lora",
        "lora_parameters": {
            "rank": 8,
            "scale": 20.0,
            "dropout": 0.0,
            "keys": ["mlp.up_proj", "mlp.down_proj"],
        },
    }
    (earlier / "adapter_config.json").write_text(json.dumps(config))
    argv = ["--model", str(model), "--data", str(data), "--train",
            "--resume-adapter-file", str(earlier / "adapters.safetensors")]  # fmt: skip
    msg = ("holds adapters of layer 0, which --num-layers 1 does not wrap (the last 1 of the "
           "model's 2: from layer 1)")  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, "--num-layers", "1"])
    cfg = tmp_path / "keys.yaml"
    cfg.write_text("lora_parameters: {rank: 8, scale: 20.0, dropout: 0.0, keys: [mlp.up_proj]}\n")
    msg = "holds adapters of mlp.down_proj, which this run's lora_parameters keys ['mlp.up_proj']"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, "--num-layers", "-1", "-c", str(cfg)])
    # read off the file's tensor names: without its adapter_config.json beside it (a
    # run of mlx-lm's default keys saves none) the adapters were dropped (probing)
    (earlier / "adapter_config.json").unlink()
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, "--num-layers", "-1", "-c", str(cfg)])
    (earlier / "adapter_config.json").write_text(json.dumps(config))
    assert not ran
    # a key naming a module by its full path: mlx-lm wraps that module in any layer (a
    # review found it refused, and its layer taken as outside --num-layers 1)
    full = "model.layers.0.mlp.down_proj"
    keys = f"[mlp.up_proj, {full}]"
    cfg.write_text(f"lora_parameters: {{rank: 8, scale: 20.0, dropout: 0.0, keys: {keys}}}\n")
    with pytest.raises(SystemExit, match=re.escape("holds adapters of mlp.down_proj, which")):
        lora.main([*argv, "--num-layers", "-1", "-c", str(cfg)])  # layer 1's down_proj
    kept = {f"{full}.lora_{ab}": mx.zeros((2,)) for ab in "ab"}
    kept |= {f"model.layers.1.mlp.up_proj.lora_{ab}": mx.zeros((2,)) for ab in "ab"}
    mx.save_safetensors(str(earlier / "adapters.safetensors"), kept)
    assert lora.main([*argv, "--num-layers", "1", "-c", str(cfg)]) == 0 and len(ran) == 1
    mx.save_safetensors(str(earlier / "adapters.safetensors"), {n: mx.zeros((2,)) for n in names})
    ran.clear()
    # the negative control: every resumed layer and key wrapped
    assert lora.main([*argv, "--num-layers", "2"]) == 0 and len(ran) == 1
    assert lora.main([*argv, "--num-layers", "-1"]) == 0 and len(ran) == 2


def test_the_banner_says_when_the_model_has_no_gated_deltanet(tmp_path, monkeypatch, capsys):
    """A llama model's run said "Gated DeltaNet training path -> ... patched:
    qwen3_next, ..." (found by probing)."""
    monkeypatch.setattr(mlx_lm.lora, "run", lambda args: None)
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    assert lora.main(argv) == 0
    assert "Gated DeltaNet training path -> chunkscan.gated_delta_rule" in capsys.readouterr().out
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(dict(config, model_type="llama")))
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunkscan: llama has no Gated DeltaNet layers; attention training path" in out
    # gemma2 computes its attention itself (and plamo2 calls mx.fast's): the banner said
    # "attention training path -> chunkscan.attention" for them (found by probing)
    for family in ("gemma2", "plamo2"):
        (model / "config.json").write_text(json.dumps(dict(config, model_type=family)))
        assert lora.main(argv) == 0
        out = capsys.readouterr().out
        assert f"{family} does not call mlx-lm's scaled_dot_product_attention (its" in out
    # gemma3 runs gemma3_text's model, whose module holds the patched attention
    (model / "config.json").write_text(json.dumps(dict(config, model_type="gemma3")))
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "; attention training path -> chunkscan.attention (calls without sinks" in out
    # mlx-lm remaps a model_type by its architecture: Bailing MoE V3 checkpoints say
    # bailing_hybrid, and run bailing_moe_v3's Gated DeltaNet layers (found by review).
    hybrid = dict(config, model_type="bailing_hybrid", architectures=["BailingMoeV3ForCausalLM"])
    (model / "config.json").write_text(json.dumps(hybrid))
    assert lora.main(argv) == 0
    assert "Gated DeltaNet training path -> chunkscan.gated_delta_rule" in capsys.readouterr().out
    # bailing_moe_linear's Lightning attention goes to chunkscan.linear_attention
    (model / "config.json").write_text(json.dumps(dict(config, model_type="bailing_moe_linear")))
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunkscan: Lightning attention (mlx-lm's recurrent_gla) training path -> " in out
    # mamba2 and nemotron_h run Mamba2 layers, whose ssm_attn goes to linear_attention
    for family in ("mamba2", "nemotron_h"):
        (model / "config.json").write_text(json.dumps(dict(config, model_type=family)))
        assert lora.main(argv) == 0
        out = capsys.readouterr().out
        assert "chunkscan: Mamba2 SSD (mlx-lm's ssm_attn) training path -> chunkscan." in out
    # mamba and jamba run Mamba (S6) layers, whose loops go to selective_scan
    for family in ("mamba", "jamba"):
        (model / "config.json").write_text(json.dumps(dict(config, model_type=family)))
        assert lora.main(argv) == 0
        out = capsys.readouterr().out
        assert "chunkscan: Mamba's selective scan (mlx-lm's per-token loop) training path" in out
    # rwkv7's recurrence goes to dplr_delta_rule
    (model / "config.json").write_text(json.dumps(dict(config, model_type="rwkv7")))
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunkscan: RWKV-7's recurrence (mlx-lm's per-token loop) training path -> " in out
    # recurrent_gemma's rnn_scan goes to diagonal_recurrence
    (model / "config.json").write_text(json.dumps(dict(config, model_type="recurrent_gemma")))
    assert lora.main(argv) == 0
    out = capsys.readouterr().out
    assert "chunkscan: RG-LRU's scan (mlx-lm's rnn_scan) training path -> chunkscan." in out
    assert "recurrent_gemma.Model skips nn.Module.__init__" in out  # (untrainable there)


@pytest.mark.parametrize("how", ["--dem", "yaml"])
def test_demo_from_an_abbreviation_or_the_yaml_key(how, tmp_path, monkeypatch):
    """argparse takes ``--dem`` for ``--demo`` and ``-c`` may say ``demo: true``; both
    used to end in 'nothing to do' (main looked for the literal string)."""
    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    argv = ["--dem"]
    if how == "yaml":
        cfg = tmp_path / "c.yaml"
        cfg.write_text("demo: true\n")
        argv = ["-c", str(cfg)]
    assert lora.main([*argv, "--iters", "1"]) == 0
    (args,) = ran
    assert args.demo and args.train and pathlib.Path(args.model).name == "model"


def test_uncached_repo_offline_is_reported(monkeypatch, no_load):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    msg = (
        "chunkscan lora: --model nobody/no-such-model-7f3 is not a local folder and not in "
        "the local Hugging Face cache, and HF_HUB_OFFLINE is set, so it cannot be downloaded."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--model", "nobody/no-such-model-7f3", "--train"])


def test_hub_failure_is_one_line(monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*a, **k):
        raise LocalEntryNotFoundError("Cannot find an appropriate cached snapshot.\nMore.")

    monkeypatch.setattr(mlx_lm.lora, "run", offline)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(_lora_inputs, "_hub_offline", lambda: False)
    import importlib.util  # a Hub dataset needs the datasets package: taken as installed

    have = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "datasets"
                        else have(name, *a))  # fmt: skip
    msg = (
        "chunkscan lora: a Hugging Face Hub lookup failed for --model nobody/m or --data "
        "nobody/d (LocalEntryNotFoundError: Cannot find an appropriate cached snapshot.). "
        "Check the repo id and the network, or pass local folders."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--model", "nobody/m", "--data", "nobody/d", "--train"])


def test_demo_with_a_config_warns_once(tmp_path):
    """``--demo -c`` resolves the arguments twice (before and after the demo's folder
    exists); an unknown YAML key was warned about twice (found by probing)."""
    import warnings

    config = tmp_path / "c.yaml"
    config.write_text("bogus_key: 1\n")
    argv = ["--demo", "--iters", "1", "--max-seq-length", "32", "-c", str(config)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lora.main(argv) == 0
    assert sum("bogus_key" in str(w.message) for w in caught) == 1


def test_demo_adds_a_missing_split_and_keeps_the_others(tmp_path):
    """An earlier demo's data folder without test.jsonl: the demo writes that file only
    (it rewrote the whole folder, the user's train.jsonl included; found by probing)."""
    data = tmp_path / "d"
    args = types.SimpleNamespace(model=str(tmp_path / "m"), data=str(data))
    _lora_demo._write_demo(args)
    fresh_test = (data / "test.jsonl").read_text()
    (data / "test.jsonl").unlink()
    (data / "train.jsonl").write_text("mine\n")
    _lora_demo._write_demo(args)
    assert (data / "train.jsonl").read_text() == "mine\n"
    assert (data / "test.jsonl").read_text() == fresh_test


@pytest.mark.parametrize("name", _lora_common._LORA_NAMES)
def test_an_mlx_lm_without_what_lora_wraps_stops_with_one_line(monkeypatch, name):
    """A release of mlx-lm whose ``mlx_lm.lora`` lacks a name the command wraps ended in
    an AttributeError after the banner (found by probing)."""
    monkeypatch.delattr(mlx_lm.lora, name)
    msg = f"mlx_lm.lora {mlx_lm.__version__} has no {name}, which chunkscan"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(["--demo", "--iters", "1"])


def test_demo_runs_the_checks_made_without_it(tmp_path, monkeypatch, no_load):
    """``--demo`` may use the user's own folders, and skipped the resume and data checks:
    rank-8 adapters resumed into a rank-4 demo trained and saved adapters that did not
    load (exit status 0), a missing resume file and an empty valid.jsonl of a --data
    folder were mlx-lm's tracebacks (found by probing)."""
    model = small_model(tmp_path / "model")
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 20.0}}
    earlier = earlier_adapters(tmp_path, config=config)
    cfg = tmp_path / "rank4.yaml"
    cfg.write_text("lora_parameters: {rank: 4, scale: 20.0, dropout: 0.0}\n")
    demo = ["--demo", "--iters", "1", "--model", str(model), "--adapter-path", str(tmp_path / "a")]
    resume = ["--resume-adapter-file", str(earlier)]
    with pytest.raises(SystemExit, match=re.escape("was trained with rank 8 (")):
        lora.main([*demo, *resume, "-c", str(cfg)])
    with pytest.raises(SystemExit, match=re.escape("none.safetensors: no such file")):
        lora.main([*demo, "--resume-adapter-file", str(tmp_path / "none.safetensors")])
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    (data / "valid.jsonl").write_text("")
    with pytest.raises(SystemExit, match=re.escape("valid.jsonl is empty")):
        lora.main([*demo, "--data", str(data)])
    # the negative control: the same demo with a full data folder reaches the run
    (data / "valid.jsonl").write_text((data / "train.jsonl").read_text())
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*demo, "--data", str(data)])


def test_more_layers_or_a_larger_batch_than_there_are_is_refused_before_loading(tmp_path, no_load):
    """``--num-layers`` above the model's layers (mlx-lm's default 16 on a smaller
    model too) and a split with fewer examples than ``--batch-size`` were mlx-lm's
    ``ValueError`` tracebacks after the model loaded (found by probing)."""
    model = small_model(tmp_path / "model")  # 2 layers
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    base = ["--model", str(model), "--data", str(data), "--train"]
    for argv, message in (
        ([], "--num-layers 16 (mlx_lm.lora default) asks for more layers than --model"),
        (["--num-layers", "3"], "(2: num_hidden_layers in its config.json). Pass --num-layers 2"),
        (["--num-layers", "2", "--batch-size", "5"], "train.jsonl holds 4 examples, fewer than "
         "--batch-size 5 (mlx-lm makes no batch of them). Pass --batch-size 4 or less"),
    ):  # fmt: skip
        with pytest.raises(SystemExit, match=re.escape(message)):
            lora.main([*base, *argv])
    (data / "valid.jsonl").write_text((data / "valid.jsonl").read_text().splitlines()[0])
    with pytest.raises(SystemExit, match=re.escape("valid.jsonl holds 1 example, fewer")):
        lora.main([*base, "--num-layers", "2"])
    # the negative controls: within range, or a split no batch reads, reaches the run
    for ok in (["--num-layers", "2", "--val-batches", "0"], ["--num-layers", "-1",
               "--batch-size", "1"]):  # fmt: skip
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main([*base, *ok])
    # a config whose layers it cannot count says nothing (text_config's are read)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": None}))
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*base, "--batch-size", "1"])
    text = {**config, "num_hidden_layers": None, "text_config": {"num_hidden_layers": 2}}
    (model / "config.json").write_text(json.dumps(text))
    with pytest.raises(SystemExit, match=re.escape("--num-layers 3 asks for more layers")):
        lora.main([*base, "--batch-size", "1", "--num-layers", "3"])


@pytest.mark.parametrize("text", ["abc", "-5", "1.5T"])
def test_a_bad_clear_cache_threshold_is_one_line(text, capsys):
    """mlx-lm's size parser raised ``decimal.InvalidOperation`` (or ``KeyError``) out of
    argparse: a traceback (found by probing)."""
    with pytest.raises(SystemExit) as exc:
        lora.build_parser().parse_args(["--clear-cache-threshold", text])
    assert exc.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.endswith(f"argument --clear-cache-threshold: must be a size in bytes such as "
                        f"512, 100MB or 1.5G, not {text!r}")  # fmt: skip
    parsed = lora.build_parser().parse_args(["--clear-cache-threshold", "1.5G"])
    assert parsed.clear_cache_threshold == 1_500_000_000


def test_a_users_tokenizers_parallelism_is_kept(tmp_path, monkeypatch, no_load):
    """chunkscan lora set TOKENIZERS_PARALLELISM=true over a user's own value (found by
    probing); it sets it only where unset."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    for given, after in (("false", "false"), (None, "true")):
        if given is None:
            monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
        else:
            monkeypatch.setenv("TOKENIZERS_PARALLELISM", given)
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)
        assert os.environ["TOKENIZERS_PARALLELISM"] == after


# ------------------------------------------------------------- session 48's probe findings


def test_resumed_adapters_of_another_fine_tune_type_are_refused(tmp_path, monkeypatch):
    """Without an ``adapter_config.json`` beside it, a LoRA file resumed as ``full``
    restarted from the base model and a DoRA file resumed as LoRA lost its magnitudes,
    both exit 0 (found by probing, session 48). The type is read off the tensor names;
    files of this run's type go on (afm7's fused LoRA names ``lora_a.0``, ...)."""
    import mlx.core as mx

    ran = []
    monkeypatch.setattr(lora, "run", lambda args: ran.append(args))
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    up = "model.layers.1.mlp.up_proj"
    files = {
        "lora": {f"{up}.lora_a": mx.zeros((16, 8)), f"{up}.lora_b": mx.zeros((8, 32))},
        "dora": {f"{up}.lora_a": mx.zeros((16, 8)), f"{up}.lora_b": mx.zeros((8, 32)),
                 f"{up}.m": mx.zeros((32,))},
        "full": {f"{up}.weight": mx.zeros((32, 16))},
        "fused": {f"{up}.lora_a.0": mx.zeros((16, 8)), f"{up}.lora_b.0": mx.zeros((8, 32))},
    }  # fmt: skip
    for name, tensors in files.items():
        (tmp_path / name).mkdir()
        mx.save_safetensors(str(tmp_path / name / "adapters.safetensors"), tensors)

    def main(name, kind):
        return lora.main(["--model", str(model), "--data", str(data), "--train",
                          "--num-layers", "-1", "--fine-tune-type", kind,
                          "--resume-adapter-file",
                          str(tmp_path / name / "adapters.safetensors")])  # fmt: skip

    refused = [("lora", "full"), ("lora", "dora"), ("dora", "lora"), ("full", "lora"),
               ("fused", "full"), ("fused", "dora")]  # fmt: skip
    for name, kind in refused:
        stored = "lora" if name == "fused" else name
        msg = (
            f"holds {stored} weights (its tensor names), this run asks for --fine-tune-type {kind}"
        )
        with pytest.raises(SystemExit, match=re.escape(msg)):
            main(name, kind)
    assert not ran
    for name, kind in (("lora", "lora"), ("dora", "dora"), ("full", "full"), ("fused", "lora")):
        assert main(name, kind) == 0
    assert len(ran) == 4


def test_yaml_values_are_checked_as_their_flags_are(tmp_path, no_load):
    """A YAML value skipped the parser's checks: ``fine_tune_type: qlora`` and
    ``optimizer: sgdx`` failed after the model loaded, ``adapter_path: 5`` was a
    TypeError, ``clear_cache_threshold: abc`` passed (found by probing, session 48)."""
    cfg = tmp_path / "c.yaml"
    for text, message in (
        ("fine_tune_type: qlora", "fine_tune_type must be one of 'lora', 'dora', 'full' (as "
         "--fine-tune-type), not 'qlora'"),
        ("optimizer: sgdx", "optimizer must be one of 'adam', "),
        ("adapter_path: 5", "adapter_path must be a string (as --adapter-path), not 5; quote"),
        ("model: [a]", "model must be a string"),
        ("clear_cache_threshold: abc", "clear_cache_threshold must be a size in bytes"),
        ("gdn_save_states: all", "gdn_save_states must be one of 'chunks', 'groups'"),
    ):  # fmt: skip
        cfg.write_text(text + "\n")
        with pytest.raises(SystemExit, match=re.escape(f"-c {cfg}: {message}")):
            lora.resolve_args(["-c", str(cfg)])
    # what mlx-lm reads as valid stays valid: its optimizer names lower-cased, a
    # project_name read only with report_to; a value the command line overrides is
    # not read (both refused by the first cut; review)
    cfg.write_text("optimizer: Adam\nclear_cache_threshold: 100MB\nproject_name: 2024\n")
    args = lora.resolve_args(["-c", str(cfg)])
    assert args.optimizer == "Adam" and args.clear_cache_threshold == 100 * 1000**2
    cfg.write_text("fine_tune_type: qlora\ngdn_save_states: all\n")
    args = lora.resolve_args(["-c", str(cfg), "--fine-tune-type", "lora",
                              "--gdn-save-states", "groups"])  # fmt: skip
    assert (args.fine_tune_type, args.gdn_save_states) == ("lora", "groups")


def test_lora_keys_that_name_no_module_are_refused_once_the_model_loads(tmp_path, capsys):
    """Keys naming no module of the wrapped layers: mlx-lm skipped them all and
    ``mx.grad`` failed ("Must specify at least one argument"; found by probing, session
    48). One such key beside good ones is warned about; the run goes on."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=2)
    cfg = tmp_path / "keys.yaml"
    argv = ["--model", str(model), "--data", str(data), "--train", "--iters", "1",
            "--batch-size", "2", "--num-layers", "-1", "--max-seq-length", "32",
            "--val-batches", "1", "--adapter-path", str(tmp_path / "a"),
            "-c", str(cfg)]  # fmt: skip
    lora_parameters = "lora_parameters: {rank: 4, scale: 10.0, dropout: 0.0, keys: %s}\n"
    cfg.write_text(lora_parameters % "[self_attn.nonexistent]")
    with pytest.raises(SystemExit, match=re.escape(
        "lora_parameters keys ['self_attn.nonexistent'] name no module of the 2 layers this "
        "run wraps (nor of the model, by full path), so there is nothing to train. Give "
        "keys such as"
    )):  # fmt: skip
        lora.main(argv)
    assert not (tmp_path / "a" / "adapter_config.json").exists()  # before mlx-lm wrote it
    # A module mlx-lm cannot wrap: its ValueError was a traceback (found by probing,
    # session 54); one line now, still before mlx-lm writes its adapter_config.json
    cfg.write_text(lora_parameters % "[linear_attn.conv1d]")
    with pytest.raises(SystemExit, match=re.escape(
        "mlx-lm cannot wrap a layer this run asks for (Can't convert layer of type Conv1d "
        "to LoRA): give lora_parameters keys (-c) that name linear layers, such as"
    )):  # fmt: skip
        lora.main(argv)
    assert not (tmp_path / "a" / "adapter_config.json").exists()
    cfg.write_text(lora_parameters % "[mlp.up_proj, mlp.nonexistent]")
    with pytest.warns(UserWarning, match=re.escape("keys ['mlp.nonexistent'] name no module")):
        assert lora.main(argv) == 0
    assert any("up_proj.lora_b" in k for k in mx.load(str(tmp_path / "a" / "adapters.safetensors")))


def test_demo_refuses_a_broken_link_and_warns_of_a_repo_ids_form(tmp_path, capsys, monkeypatch):
    """A broken link as the demo's folder was a FileExistsError traceback; a path of a
    repo id's form (``namespace/name``) made a random model that later runs naming that
    repo loaded from the working folder, silently (both found by probing, session 48)."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")
    for path in (link, link / "model"):  # the link below the folder too (review)
        msg = f"--demo: --model {path}: {link} is a link to {tmp_path / 'nowhere'}, which"
        with pytest.raises(SystemExit, match=re.escape(msg)):
            _lora_demo._demo_dir_needs_writing("--model", str(path), ("config.json",))
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit, match=re.escape(f"{tmp_path / 'a_file'} is a file, so")):
        _lora_demo._demo_dir_needs_writing(
            "--data", str(tmp_path / "a_file" / "d"), ("train.jsonl",)
        )
    monkeypatch.chdir(tmp_path)
    assert _lora_demo._demo_dir_needs_writing("--model", "org/repo", ("config.json",))
    assert "--model org/repo also reads as a Hugging Face repo id" in capsys.readouterr().err
    assert _lora_demo._demo_dir_needs_writing("--model", "./org/repo", ("config.json",))
    assert capsys.readouterr().err == ""
    _lora_demo._write_demo(types.SimpleNamespace(model="org/repo", data="./data"))
    capsys.readouterr()
    assert _lora_inputs._check_source("--model", "org/repo", "a model folder", model=True).endswith(
        "org/repo"
    )
    err = capsys.readouterr().err
    assert "--model org/repo is the local folder of a tiny random model" in err


def test_the_demos_last_line_says_what_it_keeps(tmp_path):
    """It said the temporary directory's removal took the model when only the adapters
    were in it (found by probing, session 48)."""
    temp = tmp_path / "temp"
    args = types.SimpleNamespace(model=str(tmp_path / "m"), data=str(temp / "data"),
                                 adapter_path=str(temp / "adapters"))  # fmt: skip
    assert _lora_demo._demo_kept(args, str(temp)) == (
        f"kept: model in {tmp_path / 'm'}; the temporary directory (data, adapters) is removed "
        "now (pass --model, --data and --adapter-path to keep them)"
    )
    args.data, args.adapter_path = str(tmp_path / "d"), ""
    assert _lora_demo._demo_kept(args, str(temp)) == (
        f"kept: model in {tmp_path / 'm'}, data in {tmp_path / 'd'}"
    )


def test_the_routes_line_says_the_recurrences_count_validation_too(monkeypatch):
    """The recurrences other than Gated DeltaNet take validation's calls too; the note
    said attention's alone did (found by probing, session 48)."""
    monkeypatch.setattr(cmlx, "routed_calls", collections.Counter())
    mamba = _lora_reports._Routes("mamba", gated_deltanet=False, attention=False, mamba=True)
    assert "attention's and the recurrences' include validation's" in _lora_reports._routes_line(
        mamba
    )
    qwen = _lora_reports._Routes("qwen3_next", gated_deltanet=True, attention=True)
    assert "; attention's include validation's, which runs" in _lora_reports._routes_line(qwen)


def test_demo_expands_a_tilde_in_model_and_data(tmp_path, monkeypatch, no_load):
    """``--demo --model '~/dm/model'`` (quoted, or from ``-c``) wrote the model and data
    into a folder named ``~`` in the working folder while the adapters went to the real
    home, and adapter_config.json named a model that was not there (found by probing,
    session 49). Without --demo ``_check_source`` expands them; now the demo does too."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(["--demo", "--iters", "1", "--model", "~/dm/model", "--data", "~/dm/data",
                   "--adapter-path", "~/dm/ad"])  # fmt: skip
    assert (home / "dm" / "model" / "config.json").is_file()
    assert (home / "dm" / "data" / "train.jsonl").is_file()
    assert not (cwd / "~").exists()


def test_demo_counts_the_layers_of_the_model_it_is_about_to_write(tmp_path, no_load):
    """``--demo --resume-adapter-file F --num-layers 1`` where the demo writes its model
    in this run: the layer check read a config.json not yet written, counted no layers
    and let mlx-lm drop the other layers' adapters, exit 0 (found by probing, session
    49); it refused only where the model folder was there already. Negative control:
    ``--num-layers 4`` (all the demo's) reaches the run."""
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    names = [f"model.layers.{i}.linear_attn.in_proj_qkvz.lora_{ab}" for i in range(4)
             for ab in "ab"]  # fmt: skip
    rank8 = {n: mx.zeros((8, 8)) for n in names}  # the demo's rank
    mx.save_safetensors(str(earlier / "adapters.safetensors"), rank8)
    demo = ["--demo", "--iters", "1", "--adapter-path", str(tmp_path / "a"),
            "--resume-adapter-file", str(earlier / "adapters.safetensors")]  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape("holds adapters of layers 0, 1, 2, which "
                                                   "--num-layers 1 does not wrap")):  # fmt: skip
        lora.main([*demo, "--num-layers", "1"])
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*demo, "--num-layers", "4"])


# ------------------------------------------------------------- session 50's probe findings


def test_fewer_iters_than_grad_accumulation_steps_are_refused():
    """mlx-lm updates the weights where ``it % grad_accumulation_steps == 0``: ``--iters
    3 --grad-accumulation-steps 4`` updated nothing and saved untrained adapters, exit 0
    (found by probing, session 50). Refused; ``--iters`` not a multiple warns of the
    batches whose gradients are never applied; a multiple passes."""
    msg = ("chunkscan lora: --iters 3 is less than --grad-accumulation-steps 4: mlx-lm "
           "updates the weights once every 4 iterations")  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["--train", "--iters", "3", "--grad-accumulation-steps", "4"])
    with pytest.warns(UserWarning, match=re.escape(
        "--iters 10 is not a multiple of --grad-accumulation-steps 4: the gradients of the "
        "last 2 iterations are never applied (mlx-lm updates the weights at every 4th). "
        "Pass --iters 8 or 12"
    )):  # fmt: skip
        lora.resolve_args(["--train", "--iters", "10", "--grad-accumulation-steps", "4"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lora.resolve_args(["--train", "--iters", "8", "--grad-accumulation-steps", "4"])
        lora.resolve_args(["--test", "--iters", "3", "--grad-accumulation-steps", "4"])


def test_a_learning_rate_float32_cannot_hold_is_refused():
    """``--learning-rate 1e39`` is finite to Python but inf in MLX's float32 optimizer:
    NaN adapters were saved, exit 0 (found by probing, session 50)."""
    msg = "--learning-rate must be at most float32's largest value (3.402823e+38; MLX's"
    for rate in ("1e39", "inf"):
        with pytest.raises(SystemExit, match=re.escape(msg)):
            lora.resolve_args(["--train", "--learning-rate", rate])
    assert lora.resolve_args(["--train", "--learning-rate", "3e38"]).learning_rate == 3e38


def test_adapters_saved_with_values_that_are_not_finite_fail_the_run(tmp_path):
    """The loss check sees each report's loss, computed before that step's update: one
    SGD step at a learning rate near float32's largest made every ``lora_b`` inf or NaN
    after a finite loss, and the adapters were saved, exit 0 (found by probing, session
    50). The saved file is read back; the run fails naming it."""
    model_path = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=2)
    adapters = tmp_path / "adapters"
    argv = ["lora", "--model", str(model_path), "--data", str(data), "--train",
            "--iters", "1", "--batch-size", "2", "--num-layers", "-1",
            "--max-seq-length", "32", "--val-batches", "1", "--optimizer", "sgd",
            "--learning-rate", "3e38", "--adapter-path", str(adapters)]  # fmt: skip
    file = adapters / "adapters.safetensors"
    with pytest.raises(SystemExit, match=re.escape(f"the adapters saved in {file} hold NaN or")):
        cli.main(argv)


def test_resumed_adapters_that_do_not_fit_the_model_are_refused_once_it_loads(
    tmp_path, monkeypatch
):
    """``--resume-adapter-file`` of another model: mlx-lm loads it with ``strict=False``,
    so tensors of names the model lacks were dropped in silence, exit 0, and tensors of
    other shapes failed with a ``[matmul]`` traceback mid-training; the run's
    ``adapter_config.json`` as the file was ``[load] Unknown file format json`` after the
    model loaded (found by probing, session 50). Checked against the wrapped model
    before mlx-lm loads the file (LoRA and full); the model's own adapters pass."""
    trained = []
    monkeypatch.setattr(mlx_lm.lora, "train", lambda **k: trained.append(k))  # no steps
    model_path = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=2)
    model, _ = mlx_lm.load(str(model_path))
    mlx_lm.tuner.utils.linear_to_lora_layers(model, 2, {"rank": 8, "scale": 20.0, "dropout": 0.0})
    own = dict(tree_flatten(model.trainable_parameters()))
    resume = tmp_path / "earlier" / "adapters.safetensors"
    resume.parent.mkdir()
    argv = ["--model", str(model_path), "--data", str(data), "--train", "--iters", "1",
            "--batch-size", "2", "--num-layers", "-1", "--max-seq-length", "32",
            "--adapter-path", str(tmp_path / "a"),
            "--resume-adapter-file", str(resume)]  # fmt: skip
    where = f"--resume-adapter-file {resume} does not fit --model {model_path} as this run "
    where += "wraps it: "
    name = next(n for n in own if n.endswith("mlp.up_proj.lora_a"))
    stranger = name.replace("up_proj", "nope_proj")
    wide = mx.zeros((own[name].shape[0] + 1, own[name].shape[1]))
    for tensors, msg in (
        ({**own, stranger: own[name]}, f"1 of its {len(own) + 1} tensors name no parameter of "
         f"the model ({stranger}), which mlx-lm would drop in silence"),
        ({**own, name: wide}, f"1 of its {len(own)} tensors have another shape than the "
         f"model's ({name}: {list(wide.shape)} in the file, {list(own[name].shape)} in the "
         "model)"),
    ):  # fmt: skip
        mx.save_safetensors(str(resume), tensors)
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.main(argv)
        # an .npz file, which mlx-lm loads too: checked alike (its foreign tensors were
        # dropped in silence, exit 0: a safetensors header reader read none; review)
        npz = resume.with_suffix(".npz")
        mx.savez(str(npz), **tensors)
        with pytest.raises(SystemExit, match=re.escape(where.replace(str(resume), str(npz)) + msg)):
            lora.main([*argv[:-1], str(npz)])
    assert not (tmp_path / "a" / "adapter_config.json").exists()  # before mlx-lm wrote it
    weight = name.replace(".lora_a", ".weight")
    mx.save_safetensors(str(resume), {weight: mx.zeros((3, 3))})
    with pytest.raises(SystemExit, match=re.escape(f"{weight}: [3, 3] in the file")):
        lora.main([*argv, "--fine-tune-type", "full"])
    config = tmp_path / "earlier" / "adapter_config.json"
    config.write_text("{}")
    msg = f"--resume-adapter-file {config} is not a weights file mlx-lm can load ([load] Unkno"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv[:-1], str(config)])
    assert not trained
    # the negative control: the model's own adapters go on to training
    mx.save_safetensors(str(resume), own)
    assert lora.main(argv) == 0 and len(trained) == 1


def test_resumed_adapters_of_another_lora_scale_are_refused_before_loading(tmp_path, no_load):
    """Adapters trained with ``lora_parameters.scale`` 1 resumed at mlx-lm's default 20:
    training went on from another model than the one trained, in silence (found by
    probing, session 50). Compared where the adapters' ``adapter_config.json`` says;
    the same scale reaches the run."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    config = {"fine_tune_type": "lora", "lora_parameters": {"rank": 8, "scale": 1.0}}
    earlier = earlier_adapters(tmp_path, config=config)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "--resume-adapter-file", str(earlier)]  # fmt: skip
    msg = ("was trained with scale 1.0 ({}), this run asks for 20.0: mlx-lm would load it "
           "anyway (strict=False) and start from another model than the one trained (the "
           "scale multiplies the adapters' output). Give this run the same scale "
           "(lora_parameters in -c)").format(earlier.parent / "adapter_config.json")  # fmt: skip
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(argv)
    cfg = tmp_path / "scale1.yaml"
    cfg.write_text("lora_parameters: {rank: 8, scale: 1, dropout: 0.0}\n")
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*argv, "-c", str(cfg)])


def test_a_folder_named_as_an_adapter_file_is_refused_before_loading(tmp_path, capsys, no_load):
    """A folder ``adapters.safetensors`` in ``--adapter-path``: the run trained to the end
    and failed at the final save, then called the folder "an earlier run's" weights
    (found by probing, session 50). Refused before loading; the failure message no
    longer takes a folder for weights."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    out = tmp_path / "out"
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1",
            "--adapter-path", str(out)]  # fmt: skip
    for name, when in (("adapters.safetensors", " at its end"), ("adapter_config.json", "")):
        (out / name).mkdir(parents=True)
        msg = f"--adapter-path {out}: {out / name} is a folder, where training writes its {name}"
        with pytest.raises(SystemExit, match=re.escape(msg + when)):
            lora.main(argv)
        (out / name).rmdir()
    (out / "adapters.safetensors").mkdir()
    args = types.SimpleNamespace(train=True, adapter_path=str(out))
    before = _lora_adapters._adapter_stamps(args)
    with pytest.raises(IsADirectoryError):
        with _lora_adapters._say_what_a_failure_left(args, before):
            (out / "adapter_config.json").write_text("{}")  # this run's config, then
            raise IsADirectoryError(str(out / "adapters.safetensors"))  # the failed save
    assert "earlier run's" not in capsys.readouterr().err


def _add_bos(model: pathlib.Path) -> None:
    """The ``tokenizer.json`` of the model folder ``model`` made to add a ``<bos>`` token
    before every text (a ``TemplateProcessing`` post-processor)."""
    path = model / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    bos = len(tokenizer["model"]["vocab"])
    tokenizer["model"]["vocab"]["<bos>"] = bos
    tokenizer["added_tokens"].append({"id": bos, "content": "<bos>", "single_word": False,
                                      "lstrip": False, "rstrip": False, "normalized": False,
                                      "special": True})  # fmt: skip
    first = [
        {"SpecialToken": {"id": "<bos>", "type_id": 0}},
        {"Sequence": {"id": "A", "type_id": 0}},
    ]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": first,
        "pair": [*first, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<bos>": {"id": "<bos>", "ids": [bos], "tokens": ["<bos>"]}},
    }
    path.write_text(json.dumps(tokenizer))


def test_empty_examples_are_refused_naming_file_and_line(tmp_path, no_load):
    """``{"text": ""}``, ``{"text": "   "}`` (with a word-level tokenizer) and
    ``{"messages": []}`` passed the data checks and failed after the model loaded, an
    ``IndexError`` or transformers' "empty conversation" (found by probing, session
    50). Empty and whitespace-only text are refused only where the model's
    ``tokenizer.json`` makes no tokens of them: a tokenizer that adds a BOS token makes
    BOS + EOS of ``""`` and mlx-lm trains on it (refused before; found by review, session
    50), a byte-level BPE makes tokens of spaces; where the tokenizer cannot be read up
    front, both are left to mlx-lm."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    train = (data / "train.jsonl").read_text()
    chat = json.dumps({"messages": [{"role": "user", "content": "one two"}]}) + "\n"
    where = f"chunkscan lora: --data {data}: train.jsonl line 5: "
    for content, msg in (
        (train + '{"text": ""}\n', f"'text' is empty, of which --model {model}'s tokenizer "
         "makes no tokens (mlx-lm: an IndexError mid-training)"),
        (train + '{"text": " \\t "}\n', f"'text' is only whitespace, of which --model {model}'s "
         "tokenizer makes no tokens"),
        (chat * 4 + '{"messages": []}\n', "'messages' is an empty list; mlx-lm's chat template"),
    ):  # fmt: skip
        (data / "train.jsonl").write_text(content)
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.main(argv)
    # a tokenizer that adds a BOS token: "" is BOS + EOS to mlx-lm, which trains on it
    _add_bos(model)
    (data / "train.jsonl").write_text(train + '{"text": ""}\n')
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)
    # a tokenizer not read up front (no tokenizer.json): "" and whitespace left to mlx-lm
    (model / "tokenizer.json").rename(model / "tokenizer.json.away")
    for text in ("", "   "):
        (data / "train.jsonl").write_text(train + json.dumps({"text": text}) + "\n")
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)


def test_report_to_names_a_service_whose_package_is_installed(monkeypatch):
    """``--report-to foo`` was mlx-lm's ``ValueError`` traceback, ``--report-to wandb``
    without the package its ``ImportError`` (found by probing, session 50): one line,
    read as mlx-lm reads the value (comma-separated, any case)."""
    from mlx_lm.tuner import callbacks

    monkeypatch.setattr(callbacks, "wandb", None)
    monkeypatch.setattr(callbacks, "swanlab", object())  # taken as installed
    msg = "--report-to swanlab,foo: 'foo' is no service mlx-lm reports to; it takes wandb, swan"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["--test", "--report-to", "swanlab,foo"])
    msg = "--report-to SwanLab, WandB: the wandb package is not installed (mlx-lm reports to"
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["--train", "--report-to", "SwanLab, WandB"])
    assert lora.resolve_args(["--train", "--report-to", "SwanLab"]).report_to == "SwanLab"


def test_an_lr_schedule_mlx_lm_cannot_build_is_refused_before_loading(tmp_path):
    """``lr_schedule: {name: cosine, ...}`` (an ``AttributeError``) or one without
    ``arguments`` (a ``KeyError``) failed after the model had loaded and mlx-lm had
    rewritten ``adapter_config.json`` (found by probing, session 50). Checked as mlx-lm's
    ``build_schedule`` reads it, then built, and its rate at every step up to ``--iters``
    must be finite and not negative; a schedule mlx-lm builds and trains with passes."""
    cfg = tmp_path / "c.yaml"
    where = f"chunkscan lora: lr_schedule (from -c {cfg})"
    for schedule, msg in (
        ("{name: cosine, arguments: [1.0e-5, 100]}", ": name must be one of mlx.optimizers."
         "schedulers' exponential_decay, step_decay, cosine_decay, join_schedules, "
         "linear_schedule, not 'cosine'."),
        ("{name: cosine_decay}", ": arguments must be the list of cosine_decay's arguments"),
        ("[cosine_decay]", " must be a mapping such as {name: cosine_decay, arguments: ["),
        ("{name: cosine_decay, arguments: [1.0e-5]}", ": mlx-lm's build_schedule fails on "
         "{'name': 'cosine_decay', 'arguments': [1e-05]} (TypeError: cosine_decay() missing"),
        ("{name: cosine_decay, arguments: [1.0e-5, 100], warmup: -3}",
         ": mlx-lm's build_schedule fails on {'name': 'cosine_decay', 'arguments': [1e-05, "
         "100], 'warmup': -3} (ValueError: steps must be greater than 0, but got -3.). Give "
         "it the arguments mlx.optimizers.schedulers.cosine_decay takes, and a warmup of"),
        ("{name: cosine_decay, arguments: [1.0e39, 100]}", ": the learning rate at step 0 is "
         "inf; at every step up to --iters 1000 it must be finite, at least 0 and at most "
         "float32's largest value (3.402823e+38; MLX's optimizers hold it as a float32). "
         "Change the schedule's arguments (or warmup_init)."),
        # step 0 alone was read: a warmup hid an infinite rate (NaN mid-training), and a
        # negative rate or a linear_schedule ending at 1e39 passed (found by review)
        ("{name: cosine_decay, arguments: [1.0e39, 100], warmup: 10}",
         ": the learning rate at step 4 is inf; at every step up to --iters 1000"),
        ("{name: cosine_decay, arguments: [-1.0e-3, 100]}",
         ": the learning rate at step 0 is -0.001; at every step"),
        ("{name: linear_schedule, arguments: [1.0e-5, 1.0e39, 100]}",
         ": the learning rate at step 35 is inf"),
        ("{name: cosine_decay, arguments: [1.0e-5, 100], warmup: 10, warmup_init: 1.0e39}",
         ": the learning rate at step 0 is inf"),
    ):  # fmt: skip
        cfg.write_text(f"lr_schedule: {schedule}\n")
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.resolve_args(["-c", str(cfg), "--train"])
        lora.resolve_args(["-c", str(cfg), "--test"])  # only training builds it
    cfg.write_text("lr_schedule: {name: cosine_decay, arguments: [1.0e-5, 100], warmup: 10}\n")
    lora.resolve_args(["-c", str(cfg), "--train"])
    # a rate that leaves the bounds after --iters is never read: not refused
    cfg.write_text("lr_schedule: {name: exponential_decay, arguments: [1.0e-5, 2.0]}\n")
    with pytest.raises(SystemExit, match=re.escape(": the learning rate at step 128 is inf")):
        lora.resolve_args(["-c", str(cfg), "--train", "--iters", "200"])
    lora.resolve_args(["-c", str(cfg), "--train", "--iters", "100"])


def test_resume_adapter_file_without_train_is_refused(tmp_path, no_load):
    """``--test --resume-adapter-file F`` (even a missing F) tested the adapters of
    ``--adapter-path`` and ignored F, exit 0 (found by probing, session 50): refused
    where F comes from the command line; from ``-c`` a warning says it is not read."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--test", "--adapter-path", "",
            "--resume-adapter-file", "/no/such/adapters.safetensors"]  # fmt: skip
    msg = (
        "--resume-adapter-file /no/such/adapters.safetensors is read only with --train "
        "(training resumes from it); --test alone reads the adapters in --adapter-path "
        "(''). Pass --train, or pass the adapters' folder as --adapter-path instead."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(argv)
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv[:-2])
    # from -c, as mlx-lm runs it: not refused (it was, naming the flag; found by review),
    # a warning that it is not read; with --train it is read, and checked
    cfg = tmp_path / "c.yaml"
    cfg.write_text("resume_adapter_file: /no/such/adapters.safetensors\n")
    warned = "resume_adapter_file /no/such/adapters.safetensors (from -c {}) is read only "
    warned += "with --train (training resumes from it); this run does not train, so it is not "
    with pytest.warns(UserWarning, match=re.escape(warned.format(cfg))):
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main([*argv[:-2], "-c", str(cfg)])
    with pytest.raises(SystemExit, match=re.escape("/no/such/adapters.safetensors: no such")):
        lora.main([*argv[:-5], "-c", str(cfg), "--train", "--num-layers", "-1",
                   "--adapter-path", str(tmp_path / "a")])  # fmt: skip


@pytest.mark.parametrize("plain_print", [False, True], ids=["say", "plain-print-control"])
def test_a_closed_stdout_does_not_stop_the_run(plain_print, tmp_path):
    """``chunkscan lora --demo | head -1`` died with a ``BrokenPipeError`` traceback at
    the banner (found by probing, session 50): the command's own lines now go through
    ``say`` (as ``chunkscan repro``'s), which sends stdout to ``os.devnull`` once the
    reader has gone, and the run ends as usual. Here the reader is gone before the first
    line; mlx-lm's run is a no-op. Control: ``lora.say`` as a plain print, without the
    command's stdout guard, raises."""
    import subprocess
    import sys

    prelude = "import mlx_lm.lora as m; m.run = lambda args: None; "
    if plain_print:
        prelude += (
            "import contextlib, chunkscan.commands.lora as l; l.say = lambda t: "
            "print(t, flush=True); l.guarded_stdout = contextlib.nullcontext; "
        )
    code = prelude + "import sys, chunkscan.commands.cli as c; sys.exit(c.main(sys.argv[1:]))"
    argv = ["lora", "--demo", "--iters", "1", "--model", str(tmp_path / "m"),
            "--data", str(tmp_path / "d"), "--adapter-path", str(tmp_path / "a")]  # fmt: skip
    read, write = os.pipe()
    os.close(read)  # the reader has left
    try:
        env = dict(os.environ, CHUNKSCAN_CPU_THREADS="1")
        proc = subprocess.run([sys.executable, "-c", code, *argv], stdout=write,
                              stderr=subprocess.PIPE, text=True, timeout=120, env=env)  # fmt: skip
    finally:
        os.close(write)
    if plain_print:
        assert proc.returncode != 0 and "BrokenPipeError" in proc.stderr
    else:
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
        assert (tmp_path / "m" / "config.json").is_file()


# mlx-lm's training run as a stand-in: it waits for the reader of stdout to leave, then
# prints through mlx-lm's own paths (rprint, flushed as PYTHONUNBUFFERED=1 makes it, and
# the rich console, which flushes) and saves adapters of one value (sys.argv[-1]: the path
# the parent makes once it has closed its end of the pipe)
_FAKE_MLX_LM_RUN = """
import math, os, sys, time
import mlx.core as mx, mlx_lm.lora as m
from mlx_lm.cli_ui import make_console
def run(args):
    while not os.path.exists(os.environ["READER_GONE"]):
        time.sleep(0.02)
    m.rprint("Loading pretrained model", flush=True)
    make_console().print("[ui.strong]mlx_lm.lora[/ui.strong] " + "-" * 20000)
    print("Training")
    os.makedirs(args.adapter_path, exist_ok=True)
    value = float(os.environ["ADAPTER_VALUE"])
    mx.save_safetensors(os.path.join(args.adapter_path, "adapters.safetensors"),
                        {"w": mx.array([value])})
m.run = run
import chunkscan.commands.cli as c
sys.exit(c.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(
    "unbuffered, value", [(False, "1.0"), (True, "nan")], ids=["buffered", "unbuffered-nan"]
)
def test_a_closed_stdout_does_not_stop_mlx_lm_printing(unbuffered, value, tmp_path):
    """``chunkscan lora ... | head -1`` (no ``--demo``): after the banner the reader left,
    and mlx-lm's own ``rprint`` raised ``BrokenPipeError`` (its rich console: rich's
    ``SystemExit(1)``), no adapters saved; ``say`` guarded chunkscan's lines alone (found
    by review, session 50). Now the whole command's stdout is guarded: the run ends, its
    adapters saved, and the post-run check reads them (NaN adapters: exit 1, naming
    them); no "Exception ignored" at Python's flush of stdout on exit."""
    import subprocess
    import sys

    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    adapters = tmp_path / "adapters"
    gone = tmp_path / "reader-gone"
    argv = ["lora", "--model", str(model), "--data", str(data), "--train", "--iters", "1",
            "--batch-size", "2", "--num-layers", "-1", "--adapter-path", str(adapters)]  # fmt: skip
    env = dict(os.environ, CHUNKSCAN_CPU_THREADS="1", READER_GONE=str(gone),
               ADAPTER_VALUE=value)  # fmt: skip
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-c", _FAKE_MLX_LM_RUN, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout.readline().startswith("chunkscan: ")  # the banner, then
        proc.stdout.close()  # the reader leaves
        gone.touch()
        err = proc.stderr.read()
    finally:
        code = proc.wait(timeout=120)
    assert "BrokenPipeError" not in err and "Exception ignored" not in err, err
    assert (adapters / "adapters.safetensors").is_file()
    if value == "nan":
        assert code == 1 and "hold NaN or inf values (1 of 1 tensors: w)" in err, err
    else:
        assert code == 0 and "Traceback" not in err, err


def test_chat_messages_and_tools_the_chat_template_cannot_take_are_refused(tmp_path, no_load):
    """``{"messages": ["one two", "three four"]}`` passed the data check (a list) and
    transformers' ``apply_chat_template`` raised a ``TypeError`` mid-training (it takes
    each message as a dict); so did ``"tools": 5``, and ``"tools": "x"`` its
    ``ValueError`` (it iterates the tools and takes each as a JSON schema, a dict; found
    by probing, session 52). What mlx-lm trains on passes: a message without ``role``
    (the chat template's to say), ``tools`` null, empty or a list of objects, and a
    ``text`` example's ``tools``, which mlx-lm never reads."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    where = f"chunkscan lora: --data {data}: train.jsonl line 1: "
    user = {"role": "user", "content": "one two"}
    pairs = {"prompt": "one two", "completion": "three"}
    for example, msg in (
        ({"messages": ["one two", "three four"]}, "message 1 of 'messages' is a JSON string, "
         'not an object such as {"role": "user", "content": "..."}, which the chat template '
         "takes. Make each message an object."),
        ({"messages": [user, 5]}, "message 2 of 'messages' is a JSON number, not an object"),
        ({"messages": [[user]]}, "message 1 of 'messages' is a JSON list, not an object"),
        (dict(pairs, tools=5), "'tools' is a JSON number, not a list of tools (JSON schema "
         "objects), which the chat template iterates. Make it a list, or remove it."),
        ({"messages": [user], "tools": "x"}, "'tools' is a JSON string, not a list of tools"),
        ({"messages": [user], "tools": [{"type": "function"}, "x"]},
         "tool 2 of 'tools' is a JSON string, not an object (a tool's JSON schema)"),
    ):  # fmt: skip
        (data / "train.jsonl").write_text((json.dumps(example) + "\n") * 4)
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.main(argv)
    tool = {"type": "function", "function": {"name": "f", "description": "d",
            "parameters": {"type": "object", "properties": {}}}}  # fmt: skip
    for example in (
        {"messages": [{"content": "one two"}]},
        {"messages": [user], "tools": None},
        {"messages": [user], "tools": []},
        {"messages": [user], "tools": ""},  # transformers iterates it: no tools
        dict(pairs, tools=[tool]),
        {"text": "one two", "tools": 5},  # TextDataset reads no tools
    ):
        (data / "train.jsonl").write_text((json.dumps(example) + "\n") * 4)
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)


def test_a_one_message_chat_with_mask_prompt_is_refused(tmp_path, no_load):
    """With ``--mask-prompt`` (or ``mask_prompt: true`` in ``-c``) mlx-lm runs the chat
    template on the messages before the last: a chat of one message failed mid-training
    with transformers' "Cannot apply chat template to an empty conversation" (found by
    probing, session 52). Without ``--mask-prompt``, or with two messages, it trains."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    one = {"messages": [{"role": "assistant", "content": "one two"}]}
    two = {"messages": [{"role": "user", "content": "one"}, *one["messages"]]}
    for split in ("valid", "test"):  # --mask-prompt takes no text examples
        (data / f"{split}.jsonl").write_text((json.dumps(two) + "\n") * 4)
    (data / "train.jsonl").write_text((json.dumps(one) + "\n") * 4)
    msg = (
        f"chunkscan lora: --data {data}: train.jsonl line 1: 'messages' holds one message; "
        "with --mask-prompt mlx-lm runs the chat template on the messages before the last"
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, "--mask-prompt"])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mask_prompt: true\n")
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main([*argv, "-c", str(cfg)])
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)
    (data / "train.jsonl").write_text((json.dumps(two) + "\n") * 4)
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*argv, "--mask-prompt"])


def test_an_optimizer_config_mlx_lm_cannot_build_is_refused_before_loading(tmp_path):
    """mlx-lm builds the optimizer as ``<class>(learning_rate=...,
    **optimizer_config.get(<--optimizer>, {}))`` after the model loaded and after it wrote
    ``adapter_config.json``: ``optimizer_config: 5`` (an ``AttributeError``), an
    unknown keyword or a ``learning_rate`` there (``TypeError``s) failed then (found by
    probing, session 52). Checked as mlx-lm reads it, the class built with those
    keywords; what mlx-lm does not read (another optimizer's entry, any entry without
    ``--train``) is not checked, and a key naming no optimizer warns that it is unread."""
    cfg = tmp_path / "c.yaml"
    where = f"chunkscan lora: optimizer_config (from -c {cfg})"
    for text, msg in (
        ("optimizer_config: 5", " must be a mapping of optimizer names to their settings, "
         "such as {adamw: {weight_decay: 0.01}}, not 5."),
        ("optimizer_config: {adam: {bogus: 1}}", ": mlx-lm's mlx.optimizers.Adam("
         "learning_rate=..., **{'bogus': 1}) fails (TypeError: Adam.__init__() got an "
         "unexpected keyword argument 'bogus'). Give it the keywords (and values) Adam takes."),
        ("optimizer_config: {adam: {learning_rate: 0.1}}", ": adam sets learning_rate, which "
         "mlx-lm passes itself (from --learning-rate or lr_schedule). Remove it; set "
         "--learning-rate (YAML: learning_rate) instead."),
        ("optimizer_config: {adam: null}", ": adam (this run's --optimizer) must be a mapping "
         "of Adam's keywords (or be left out), not None."),
        ("optimizer: SGD\noptimizer_config: {sgd: {nesterov: true}}",
         ": mlx-lm's mlx.optimizers.SGD(learning_rate=..., **{'nesterov': True}) fails "
         "(ValueError: Nesterov momentum requires"),
    ):  # fmt: skip
        cfg.write_text(text + "\n")
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.resolve_args(["-c", str(cfg), "--train"])
        lora.resolve_args(["-c", str(cfg), "--test"])  # only training builds it
    cfg.write_text("optimizer_config: {adam: {bogus: 1}}\n")
    lora.resolve_args(["-c", str(cfg), "--train", "--optimizer", "adamw"])  # not read
    cfg.write_text("optimizer: adamw\noptimizer_config: {adamw: {weight_decay: 0.1}}\n")
    args = lora.resolve_args(["-c", str(cfg), "--train"])
    assert args.optimizer_config == {"adamw": {"weight_decay": 0.1}}
    cfg.write_text("optimizer_config: {Adam: {betas: [0.8, 0.9]}}\n")
    with pytest.warns(UserWarning, match=re.escape(where + ": 'Adam' names no optimizer mlx-lm")):
        lora.resolve_args(["-c", str(cfg), "--train"])


def test_demo_checks_what_depends_on_iters_with_its_own_iters(tmp_path, no_load):
    """``--demo`` trains 30 steps, but the first of its two argument passes checked
    ``--grad-accumulation-steps`` and an ``lr_schedule`` against mlx-lm's default
    ``--iters 1000``, and the second pass's warnings were silenced: 30 % 4 left no
    warning, 30 % 3 warned of ``--iters 1000``, and a schedule fine for 30 steps was
    refused (found by probing, session 52). Now both passes read the demo's settings:
    one warning, of the demo's numbers."""
    argv = ["--demo", "--grad-accumulation-steps", "4", "--model", str(tmp_path / "m")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
            lora.main(argv)
    said = [str(w.message) for w in caught if "grad-accumulation" in str(w.message)]
    assert len(said) == 1, said
    right = "--iters 30 is not a multiple of --grad-accumulation-steps 4: the gradients of "
    assert right + "the last 2 iterations" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lora.resolve_args(["--demo", "--grad-accumulation-steps", "3"]).iters == 30
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr_schedule: {name: exponential_decay, arguments: [1.0e-4, 1.2]}\n")
    lora.resolve_args(["--demo", "-c", str(cfg)])  # 1e-4 * 1.2**30: within bounds
    with pytest.raises(SystemExit, match=re.escape("the learning rate at step 487 is inf")):
        lora.resolve_args(["--demo", "-c", str(cfg), "--iters", "1000"])


def test_a_tokenizer_config_alone_is_no_tokenizer(tmp_path, no_load):
    """A model folder whose only tokenizer file was ``tokenizer_config.json`` passed the
    tokenizer-files check (its pattern ``tokenizer*``), then transformers failed with a
    30-line traceback while mlx-lm loaded the tokenizer (found by probing, session 52)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    kept = (model / "tokenizer.json").read_bytes()
    for path in model.glob("tokenizer*"):
        if path.name != "tokenizer_config.json":
            path.unlink()
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    msg = (
        f"chunkscan lora: --model {model} holds no tokenizer files (tokenizer.json, "
        "tokenizer.model, vocab.json, ...; its tokenizer_config.json holds settings, not a "
        "tokenizer: mlx-lm loads"
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.main(argv)
    (model / "tokenizer.json").write_bytes(kept)
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main(argv)


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path):
    """A ``-c`` file with a Latin-1 comment was a ``UnicodeDecodeError`` traceback
    (found by probing, session 52); one line now, naming the line and byte as counted in
    the file (past the text layer's first chunk too)."""
    import codecs
    import locale

    if codecs.lookup(locale.getpreferredencoding(False)).name != "utf-8":
        pytest.skip("open() reads another encoding than UTF-8 here")
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"# caf\xe9\niters: 5\n")
    msg = (
        f"chunkscan lora: -c {cfg}: the config file is not UTF-8 text at line 1 (byte 5 of "
        "the file); mlx_lm.lora reads it as UTF-8. Convert the file, or pass another file."
    )
    with pytest.raises(SystemExit, match=re.escape(msg)):
        lora.resolve_args(["-c", str(cfg), "--train"])
    cfg.write_bytes(b"# a comment\n" * 3000 + b"iters: 5 # caf\xe9\n")
    with pytest.raises(SystemExit, match=re.escape("at line 3001 (byte 36014 of the file)")):
        lora.resolve_args(["-c", str(cfg), "--train"])
    cfg.write_bytes("# café\niters: 5\n".encode())
    assert lora.resolve_args(["-c", str(cfg), "--train"]).iters == 5


@pytest.mark.parametrize("value", ["null", '""', "5"])
def test_a_feature_name_that_names_no_key_is_refused(value, tmp_path, no_load):
    """A ``*_feature: null``, ``""`` or ``5`` in ``-c`` is read as mlx-lm reads it, as
    given, and mlx-lm's ``create_dataset`` looks up only the format's names it reaches:
    for the format the data is in, it found no key and failed after the model loaded
    while the data check read the default name (found by probing, session 52): refused
    before loading, naming the setting. For a format the data is not in, mlx-lm trains:
    the run goes on (refused in ``-c``, found by review, session 52)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    cfg = tmp_path / "c.yaml"
    shown = {"null": "null", '""': '""', "5": "a YAML number (5)"}[value]
    then = {
        "null": "no key is looked up for {}",
        '""': "the empty key is looked up for {}",
        "5": "it is no key of the example (JSON keys are strings): none is found for {}",
    }[value]
    text = (data / "train.jsonl").read_text()
    pairs = json.dumps({"prompt": "one two", "completion": "three"}) + "\n"
    chat = json.dumps({"messages": [{"role": "user", "content": "one two"}]}) + "\n"
    where = f"chunkscan lora: --data {data}: train.jsonl line 1 has none of the keys mlx-lm reads"

    def put(lines):  # every split: mlx-lm picks each file's format from its first line
        for split in ("train", "valid", "test"):
            (data / f"{split}.jsonl").write_text(lines)

    # settings for formats the data is not in: never looked up, mlx-lm trains; the run
    # goes on (text data with the other three, chat data with text_feature, ...)
    for lines, keys in (
        (text, ("prompt_feature", "completion_feature", "chat_feature")),
        (chat * 4, ("prompt_feature", "completion_feature", "text_feature")),
        (pairs * 4, ("chat_feature", "text_feature")),
    ):
        put(lines)
        for key in keys:
            cfg.write_text(f"{key}: {value}\n")
            with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
                lora.main([*argv, "-c", str(cfg)])
    # ... for the format in use: refused before loading, naming the setting (and what
    # its default reads)
    for lines, key, what, default in (
        (text, "text_feature", "text examples", "text"),
        (chat * 4, "chat_feature", "chats", "messages"),
        (pairs * 4, "prompt_feature", "the prompts", "prompt"),
        (pairs * 4, "completion_feature", "the completions", "completion"),
    ):
        put(lines)
        cfg.write_text(f"{key}: {value}\n")
        msg = (
            f": {key} is {shown} in -c {cfg}, so {then.format(what)}. Leave {key} out "
            f"(mlx-lm then reads line 1's {default!r}), or set it to the examples' key."
        )
        with pytest.raises(SystemExit, match=re.escape(where)) as e:
            lora.main([*argv, "-c", str(cfg)])
        assert msg in str(e.value)
    # ... both names of prompt / completion examples: both named
    cfg.write_text(f"prompt_feature: {value}\ncompletion_feature: {value}\n")
    with pytest.raises(SystemExit, match=re.escape(where)) as e:
        lora.main([*argv, "-c", str(cfg)])
    assert (
        "Leave prompt_feature and completion_feature out (mlx-lm then reads line 1's "
        "'prompt' and 'completion'), or set them to the examples' keys."
    ) in str(e.value)
    # a feature name the examples use passes
    put(text.replace('"text"', '"body"'))
    cfg.write_text("text_feature: body\n")
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*argv, "-c", str(cfg)])


def test_a_feature_name_that_cannot_be_looked_up_is_refused_where_mlx_lm_looks(tmp_path, no_load):
    """A ``*_feature`` that is a YAML list or mapping: mlx-lm's ``create_dataset`` fails
    on it (``TypeError``: unhashable) where its lookup reaches it, after the model
    loaded: refused there, before loading. Where it is never reached (a
    ``completion_feature`` with text data: its lookup comes after a ``prompt`` found),
    mlx-lm trains, and so does this command."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=4)
    argv = ["--model", str(model), "--data", str(data), "--train", "--num-layers", "-1"]
    cfg = tmp_path / "c.yaml"
    cfg.write_text("completion_feature: [a]\n")
    with pytest.raises(AssertionError, match="mlx_lm.lora.run was called"):
        lora.main([*argv, "-c", str(cfg)])
    where = f"chunkscan lora: --data {data}: train.jsonl line 1: "
    for key, value, kind, default in (
        ("chat_feature", "[a]", "list (['a'])", "messages"),
        ("text_feature", "{a: 1}", "mapping ({'a': 1})", "text"),
        ("prompt_feature", "[a]", "list (['a'])", "prompt"),
    ):
        cfg.write_text(f"{key}: {value}\n")
        msg = (
            f"{key} is a YAML {kind} in -c {cfg}, not a key's name; mlx-lm's create_dataset "
            f"looks it up in the example and fails (TypeError: unhashable type: "
            f"'{'list' if kind.startswith('list') else 'dict'}'). Name the examples' key, or "
            f"leave {key} out (mlx-lm then reads {default!r})."
        )
        with pytest.raises(SystemExit, match=re.escape(where + msg)):
            lora.main([*argv, "-c", str(cfg)])


def test_full_fine_tuning_of_a_quantized_model_is_refused_before_loading(tmp_path):
    """``--fine-tune-type full`` on a quantized model: MLX cannot differentiate quantized
    weights, and mlx-lm ran validation, wrote its ``adapter_config.json`` and failed at
    the first step with a traceback (found by probing, session 54). Refused before
    anything loads, as mlx-lm tells a quantized layer (its weights have ``scales``); lora
    on the same model, and full on the unquantized one (whatever its config says:
    a review found an fp8 ``quantization_config`` that mlx-lm dequantizes refused),
    pass the check (the negative control)."""
    model = small_model(tmp_path / "model")
    data = write_dataset(tmp_path / "data", n_train=4, n_valid=2)
    argv = ["--model", str(model), "--data", str(data), "--train", "--iters", "1",
            "--batch-size", "2", "--num-layers", "-1",
            "--adapter-path", str(tmp_path / "a")]  # fmt: skip
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8"}
    (model / "config.json").write_text(json.dumps(config))
    lora.check_args(lora.resolve_args([*argv, "--fine-tune-type", "full"]))
    (weights,) = model.glob("model*.safetensors")
    tensors = dict(mx.load(str(weights)))
    name = next(n for n in tensors if n.endswith("up_proj.weight")).replace("weight", "scales")
    tensors[name] = mx.ones((4, 2))
    mx.save_safetensors(str(weights), tensors)
    with pytest.raises(SystemExit, match=re.escape(
        f"--fine-tune-type full on --model {model}, a quantized model ({weights.name} holds "
        f"{name}): MLX cannot differentiate quantized weights."
    )):  # fmt: skip
        lora.check_args(lora.resolve_args([*argv, "--fine-tune-type", "full"]))
    lora.check_args(lora.resolve_args([*argv, "--fine-tune-type", "lora"]))
    assert not (tmp_path / "a").exists()
