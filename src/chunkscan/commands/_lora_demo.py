"""``chunkscan lora --demo``'s folders: its settings (:data:`DEMO_DEFAULTS`), where
it may write (only folders it made, marked with :data:`DEMO_MARKER`:
:func:`_demo_dir_needs_writing`, :func:`_demo_adapter_folder`), writing the tiny model
and data set (:func:`_write_demo`) and what its first and last lines say."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import sys
import types

DEMO_DEFAULTS = {
    "train": True,
    "iters": 30,
    "batch_size": 2,
    "num_layers": -1,
    "learning_rate": 2e-3,
    "max_seq_length": 512,
    "steps_per_report": 5,
    "steps_per_eval": 30,
    "val_batches": 2,
    "save_every": 1000,
}


DEMO_MARKER = ".chunkscan-demo"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _demo_dir_needs_writing(flag: str, path: str, files: tuple[str, ...]) -> bool:
    """Whether the demo must write ``path``; raises if it would write someone's folder.

    It writes a folder that does not exist, or one it made earlier (marked with
    :data:`DEMO_MARKER`) that lacks one of ``files`` (what the demo writes there:
    ``--test`` needs the ``test.jsonl`` that demos before session 30 did not write; in
    the data folder only the missing splits are written); it uses any other folder that
    has ``files[0]`` as it is; it refuses everything else.
    """
    p = pathlib.Path(path)
    if (p / DEMO_MARKER).is_file():
        return not all((p / f).is_file() for f in files)
    if (p / files[0]).is_file():
        return False
    for part in (p, *p.parents):  # mkdir failed on a broken link or a file: a traceback
        if part.is_symlink() and not part.exists():  # (found by probing, and review)
            raise SystemExit(
                f"chunkscan lora --demo: {flag} {path}: {part} is a link to "
                f"{os.readlink(part)}, which does not exist, so the demo cannot make its "
                f"folder there. Pass another path, or make the folder the link names."
            )
        if part.exists():
            if part != p and not part.is_dir():
                raise SystemExit(
                    f"chunkscan lora --demo: {flag} {path}: {part} is a file, so the demo "
                    f"cannot make its folder there. Pass another path."
                )
            break
    if not p.exists():
        if _reads_as_repo_id(path):
            # written there, the random model stands in for that repo in later runs
            # from this folder, mlx-lm's own too: it reads a local folder first (found
            # by probing; not refused: it may be the user's own folder's name)
            print(
                f"chunkscan lora --demo: {flag} {path} also reads as a Hugging Face repo "
                f"id; runs from this folder that name it will load the demo's folder (a "
                f"local folder comes first). Pass a path of another form, such as "
                f"demos/{path}, to keep the two apart.",
                file=sys.stderr,
                flush=True,
            )
        return True
    if not p.is_dir():
        raise SystemExit(
            f"chunkscan lora --demo: {flag} {path} is a file, not a folder, so the demo "
            f"cannot write its files there. Pass a path that does not exist yet (the demo "
            f"creates it and keeps it), or a folder."
        )
    raise SystemExit(
        f"chunkscan lora --demo: {flag} {path} is a folder that the demo did not create "
        f"(no {DEMO_MARKER} file in it) and has no {files[0]}, so the demo will not write "
        f"its files there. Pass a path that does not exist yet (the demo creates it and "
        f"keeps it), a folder an earlier demo made, or one that already has {files[0]}."
    )


def _reads_as_repo_id(value: str) -> bool:
    """``value`` has a Hugging Face repo id's form (``namespace/name``; :data:`_REPO_ID`
    starts with a letter or digit, so never ``./`` or ``~``)."""
    return bool(_REPO_ID.match(value))


def _demo_adapter_folder(args: types.SimpleNamespace, demo_dir: str) -> pathlib.Path | None:
    """The folder the demo must make and mark (:data:`DEMO_MARKER`) for its adapters
    when it trains, or ``None``: one in its temporary directory, or made by an earlier
    demo. An existing folder it did not make is refused, before anything is written (the
    demo replaced the adapters of an earlier run there, their ``adapter_config.json``
    then naming a model deleted at exit; found by probing)."""
    path = getattr(args, "adapter_path", None)
    if not args.train or not isinstance(path, str) or path == "":
        return None
    where = pathlib.Path(path)
    if where.resolve().is_relative_to(pathlib.Path(demo_dir).resolve()):
        return None
    if (where / DEMO_MARKER).is_file():
        return None
    if where.exists():
        raise SystemExit(
            f"chunkscan lora --demo: --adapter-path {path} is a folder that the demo did not "
            f"create (no {DEMO_MARKER} file in it), so the demo will not write its adapters "
            f"there (it would replace what is there). Pass a path that does not exist yet "
            f"(the demo creates it and keeps it) or a folder an earlier demo made."
        )
    return where


def _demo_kept(args: types.SimpleNamespace, demo_dir: str) -> str:
    """What the demo's last line says it keeps: the model, data and adapters outside
    its temporary directory (it said the model was removed with the directory when
    only the adapters were in it; found by probing)."""
    temporary = pathlib.Path(demo_dir).resolve()
    kept, gone = [], []
    for what, path in (("model", args.model), ("data", args.data),
                       ("adapters", args.adapter_path)):  # fmt: skip
        if not path:  # --adapter-path '': nothing written
            continue
        inside = pathlib.Path(path).resolve().is_relative_to(temporary)
        (gone if inside else kept).append(what if inside else f"{what} in {path}")
    said = [f"kept: {', '.join(kept)}"] if kept else []
    if gone:
        said.append(
            f"the temporary directory ({', '.join(gone)}) is removed now (pass --model, "
            f"--data and --adapter-path to keep them)"
        )
    return "; ".join(said)


def _mark_demo_folder(path: str | pathlib.Path) -> None:
    """Make ``path`` and mark it as the demo's (:data:`DEMO_MARKER`)."""
    pathlib.Path(path).mkdir(parents=True, exist_ok=True)
    pathlib.Path(path, DEMO_MARKER).write_text(
        "made by chunkscan lora --demo; it may rewrite the files in this folder\n"
    )


def _write_demo(args: types.SimpleNamespace) -> None:
    from . import demo_model

    todo = [
        (path, write)
        for flag, path, files, write in (
            ("--model", args.model, ("config.json",), demo_model.write_model),
            (
                "--data",
                args.data,
                demo_model.DATASET_FILES,
                functools.partial(demo_model.write_dataset, keep_existing=True),
            ),
        )
        if _demo_dir_needs_writing(flag, path, files)
    ]  # every check first: refuse before writing anything
    for path, write in todo:
        _mark_demo_folder(path)
        write(path)


def _demo_banner(model: str) -> str:
    """The demo's model, or the user's own in a ``--model`` folder that had one (the
    banner said "tiny random Qwen3-Next model" whatever it was; found by probing)."""
    if pathlib.Path(model, DEMO_MARKER).exists():
        return f"chunkscan lora --demo: tiny random Qwen3-Next model in {model}"
    return f"chunkscan lora --demo: your model in {model}, as it is (not the demo's)"
