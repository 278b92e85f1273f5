"""The checks of a ``chunkscan lora`` run's local data folder, made before the model
loads: the split files it reads exist and hold enough examples, every line reads as one
JSON example as mlx-lm reads it (:func:`_read_examples`), in the first line's format and
with values mlx-lm's tokenizer takes, and the model's tokenizer has a chat template
where the examples need one (:func:`_check_data`)."""

from __future__ import annotations

import functools
import json
import pathlib
import re
import types
from typing import Any

from ._lora_common import PROG, _stamp


def _check_data(args: types.SimpleNamespace) -> None:
    """The data folder holds the splits this run reads, none of them empty, and each
    split a batch reads holds at least ``--batch-size`` examples (mlx-lm: an
    ``IndexError`` for an empty one, a ``ValueError`` traceback after the model loaded
    for a short one; found by probing)."""
    data = pathlib.Path(args.data)
    for wanted, split in ((args.train, "train"), (args.test, "test")):
        if wanted and not (data / f"{split}.jsonl").is_file():
            raise SystemExit(
                f"{PROG}: --data {args.data} has no {split}.jsonl, which "
                f"--{split} reads (mlx_lm.lora reads train.jsonl, valid.jsonl and "
                f"test.jsonl from the folder). Add it, or pass another folder."
            )
    # the splits read in batches of --batch-size: train and (for validation) valid with
    # --train, test with --test
    batched = {"train": args.train, "valid": args.train and args.val_batches != 0,
               "test": args.test}  # fmt: skip
    # the splits whose examples this run reads (mlx-lm parses every file's lines, but
    # takes an example's keys only when it reads the example)
    read = {split for split, wanted in batched.items() if wanted}
    for split in ("train", "valid", "test"):
        path = data / f"{split}.jsonl"
        if path.exists() and not path.is_file():  # mlx-lm opens it (found by probing)
            raise SystemExit(
                f"{PROG}: --data {args.data}: {split}.jsonl is not a file; mlx-lm "
                f"reads every split file of the folder. Remove or rename it."
            )
        if not path.is_file():
            continue
        examples = _read_examples(path, args, keys=split in read)
        if examples == 0:
            raise SystemExit(
                f"{PROG}: --data {args.data}: {split}.jsonl is empty (no line "
                f"holds an example). Add examples, or remove the file."
            )
        if batched[split] and examples < args.batch_size:
            raise SystemExit(
                f"{PROG}: --data {args.data}: {split}.jsonl holds {examples} "
                f"example{'s' if examples != 1 else ''}, fewer than --batch-size "
                f"{args.batch_size} (mlx-lm makes no batch of them). Pass --batch-size "
                f"{examples} or less, or add examples."
            )


def _read_examples(path: pathlib.Path, args: types.SimpleNamespace, keys: bool = True) -> int:
    """The examples of a data file, read as mlx-lm reads them (every line one JSON
    object; the first line's keys choose the format: ``prompt`` and ``completion``,
    ``messages`` or ``text``, under their ``*_feature`` names; with ``keys``, for a split
    this run reads, every line then needs that format's keys); 0 for a file of blank
    lines only. Else the command stops naming the file and the line, before the model
    loads: mlx-lm parsed each line with ``json.loads`` after loading the model, so one
    blank line (a trailing empty line too) was a ``JSONDecodeError`` naming neither,
    and a missing key a ``KeyError`` (found by probing). Read a line at a time."""
    # read as mlx-lm reads them, a YAML null or "" as given (read here as the default
    # name, one passed and failed in mlx-lm; found by probing, session 52): one that
    # names the format in use is refused by _example_format, one that does not is never
    # looked up, and mlx-lm trains (refused in -c before; found by review, session 52)
    prompt = getattr(args, "prompt_feature", "prompt")
    completion = getattr(args, "completion_feature", "completion")
    chat = getattr(args, "chat_feature", "messages")
    text = getattr(args, "text_feature", "text")
    where = f"{PROG}: --data {args.data}: {path.name}"
    needed: tuple[str, ...] = ()
    blank = None  # the first blank line: an error unless every line is blank
    count = 0
    # as mlx-lm iterates it (text mode: lines end at \n, \r\n or \r, where
    # str.splitlines would also cut at a U+2028 inside a JSON string)
    # strictly decoded, as mlx-lm decodes it (errors="replace" passed a file that is not
    # UTF-8, then mlx-lm's UnicodeDecodeError came after loading; found by probing)
    with open(path, encoding="utf-8") as f:
        for number, line in _numbered_lines(f, where):
            if not line.strip():
                blank = blank or number
                continue
            if blank is not None:  # a blank line before an example (the first too)
                _blank_line(where, blank)
            count += 1
            example = _parse_example(where, number, line)
            if count == 1:
                needed = _example_format(where, example, prompt, completion, chat, text, args)
                if keys and needed != (text,):
                    _check_chat_template(where, needed, args)
            lacking = [k for k in needed if k not in example] if keys else []
            if lacking:
                raise SystemExit(
                    f"{where} line {number} lacks {' and '.join(map(repr, lacking))}, which "
                    f"line 1 has: mlx-lm reads every example in line 1's format."
                )
            if keys:
                _check_example_values(where, number, example, needed, chat)
                _check_example_not_empty(where, number, example, needed, chat, args)
    if blank is not None and count:  # blank lines at the end (all blank: "is empty")
        _blank_line(where, blank)
    return count


def _numbered_lines(f, where: str):
    """``(number, line)`` of a text file opened strictly as UTF-8; bytes that do not
    decode stop the command naming their line (counted in the raw bytes: the text
    layer decodes a chunk of lines at a time)."""
    try:
        yield from enumerate(f, 1)
    except UnicodeDecodeError:
        with open(f.name, "rb") as raw:
            data = raw.read()
        try:
            data.decode("utf-8")
            at = len(data)  # (not reached: the same bytes failed above)
        except UnicodeDecodeError as e:
            at = e.start
        # lines as the text layer ends them: at \r\n, \n or a lone \r (a review
        # found the line of a \r-ended file miscounted)
        line = len(re.findall(rb"\r\n|\r|\n", data[:at])) + 1
        raise SystemExit(
            f"{where} line {line} is not UTF-8 (byte {at} of the "
            f"file); mlx-lm reads the file as UTF-8. Convert the file."
        ) from None


def _check_example_values(where: str, number: int, example: dict, needed, chat: str) -> None:
    """The values of an example's format keys have the type mlx-lm's tokenizer calls
    take (a string; the chat's messages, a list of objects): ``{"text": null}`` failed
    mid-training (found by probing). So do a message that is not an object
    (transformers' ``apply_chat_template`` takes each as a dict: ``"messages": ["one
    two"]`` was its ``TypeError`` mid-training; found by probing, session 52; which keys
    a message needs, ``role`` and ``content`` or others, is the chat template's to say,
    not checked) and, in the formats that go through the chat template, a ``tools`` that
    is not a list of objects (transformers iterates it and takes each tool as a JSON
    schema, a dict: ``"tools": 5`` or ``"x"`` failed mid-training, the same session).
    ``tools: null`` is none, as mlx-lm reads it; an empty string or object, which
    transformers iterates as no tools, passes as in mlx-lm."""
    for key in needed:
        value, want = example[key], (list if key == chat else str)
        if not isinstance(value, want):
            raise SystemExit(
                f"{where} line {number}: {key!r} is a JSON {_kind(value)}, not a "
                f"{'list of messages' if want is list else 'string'}, which mlx-lm reads."
            )
        if key == chat:
            for i, message in enumerate(value, 1):
                if not isinstance(message, dict):
                    raise SystemExit(
                        f"{where} line {number}: message {i} of {key!r} is a JSON "
                        f'{_kind(message)}, not an object such as {{"role": "user", '
                        f'"content": "..."}}, which the chat template takes. Make '
                        f"each message an object."
                    )
    if len(needed) == 1 and needed[0] != chat:
        return  # text examples: mlx-lm's TextDataset reads no tools
    tools = example.get("tools")
    if tools is None or (isinstance(tools, (str, dict)) and not tools):
        return
    if not isinstance(tools, list):
        raise SystemExit(
            f"{where} line {number}: 'tools' is a JSON {_kind(tools)}, not a list of "
            f"tools (JSON schema objects), which the chat template iterates. Make it a "
            f"list, or remove it."
        )
    for i, tool in enumerate(tools, 1):
        if not isinstance(tool, dict):
            raise SystemExit(
                f"{where} line {number}: tool {i} of 'tools' is a JSON {_kind(tool)}, not "
                f"an object (a tool's JSON schema), which the chat template takes."
            )


def _kind(value: Any, yaml: bool = False) -> str:
    """The JSON type of a parsed value, as the messages name it (``yaml``: a dict is a
    YAML mapping)."""
    kinds = {type(None): "null", bool: "boolean", int: "number", float: "number",
             dict: "mapping" if yaml else "object", list: "list", str: "string"}  # fmt: skip
    return kinds.get(type(value), type(value).__name__)


def _check_example_not_empty(
    where: str, number: int, example: dict, needed, chat: str, args: types.SimpleNamespace
) -> None:
    """An example mlx-lm cannot make a sequence of, refused (found by probing: each
    failed mid-training, after the model loaded): a chat of no messages (transformers:
    "Cannot apply chat template to an empty conversation"), and an empty or
    whitespace-only ``text`` where the local model's ``tokenizer.json`` makes no tokens
    of it (an ``IndexError`` in mlx-lm's ``TextDataset``: a word-level tokenizer, as the
    demo's). A tokenizer that adds a BOS token makes BOS + EOS of ``""``, and a
    byte-level BPE tokens of spaces: mlx-lm trains on them, and so does this command
    (an empty ``text`` was refused for every tokenizer; found by review, session 50);
    where ``tokenizer.json`` cannot be read up front, it is left to mlx-lm. ``prompt`` /
    ``completion`` go through the chat template, which adds its own text: not checked.
    With ``--mask-prompt``, a chat of one message: mlx-lm templates the messages before
    the last (the prompt it masks), none, and transformers raised the same "empty
    conversation" mid-training (found by probing, session 52)."""
    model = args.model
    if needed == (chat,):
        if not example[chat]:
            raise SystemExit(
                f"{where} line {number}: {chat!r} is an empty list; mlx-lm's chat template "
                f"takes at least one message. Remove the line or give it messages."
            )
        if len(example[chat]) == 1 and getattr(args, "mask_prompt", False):
            raise SystemExit(
                f"{where} line {number}: {chat!r} holds one message; with --mask-prompt "
                f"mlx-lm runs the chat template on the messages before the last (the prompt "
                f"it masks), and it takes at least one. Give the line a prompt's messages "
                f"before the last, or remove it (or leave out --mask-prompt)."
            )
        return
    if len(needed) != 1:
        return
    (key,) = needed
    value = example[key]
    if (value == "" or value.isspace()) and _tokenizer_ids(model, value) == []:
        what = "empty" if value == "" else "only whitespace"
        raise SystemExit(
            f"{where} line {number}: {key!r} is {what}, of which --model {model}'s "
            f"tokenizer makes no tokens (mlx-lm: an IndexError mid-training). Remove the "
            f"line or give it text."
        )


def _tokenizer_ids(model: Any, text: str) -> list[int] | None:
    """The token ids a local model folder's ``tokenizer.json`` gives ``text`` (special
    tokens added, as mlx-lm's ``tokenizer.encode``); ``None`` where it cannot be read."""
    path = pathlib.Path(str(model)).expanduser() / "tokenizer.json"
    stamp = _stamp(path)
    tokenizer = None if stamp is None else _local_tokenizer(str(path), stamp)
    return None if tokenizer is None else tokenizer.encode(text).ids


@functools.lru_cache(maxsize=4)
def _local_tokenizer(path: str, stamp: tuple[int, int]):
    """``path`` read as a ``tokenizers`` tokenizer (once per ``stamp``); ``None`` where
    it cannot be."""
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(path)
    except Exception:  # noqa: BLE001 (another format, no package: left to mlx-lm)
        return None


def _blank_line(where: str, number: int) -> None:
    raise SystemExit(
        f"{where} line {number} is blank; mlx-lm reads every line as one JSON example. "
        "Remove the line."
    )


def _parse_example(where: str, number: int, line: str) -> dict:
    """One line of a data file as the JSON object it must be."""
    try:
        example = json.loads(line)
    except ValueError as e:
        raise SystemExit(f"{where} line {number} is not valid JSON ({e}).") from None
    if not isinstance(example, dict):
        raise SystemExit(
            f"{where} line {number} is a JSON {type(example).__name__}, not an object "
            f"of an example's fields."
        )
    return example


def _example_format(where, example, prompt, completion, chat, text, args) -> tuple[str, ...]:
    """The keys of the format mlx-lm picks from the first example, looked up as its
    ``create_dataset`` looks them up: ``prompt`` (then ``completion``), ``chat``,
    ``text``, each name as given, so a YAML null, ``""`` or number matters only for the
    format it names (``chat_feature: null`` with text examples: mlx-lm trains; refused
    in ``-c`` before, found by review, session 52). A setting that cannot be looked up
    (a YAML list or mapping: ``in`` raises ``TypeError``) is refused where mlx-lm
    reaches it; where no format matches, the message names the null, empty or
    non-string settings that are why (:func:`_feature_causes`)."""

    def has(setting: str, key: Any) -> bool:
        try:
            return key in example
        except TypeError:  # unhashable: mlx-lm's lookup fails the same, after loading
            raise SystemExit(
                f"{where} line 1: {_feature_setting(setting, key, args)}, not a key's "
                f"name; mlx-lm's create_dataset looks it up in the example and fails "
                f"(TypeError: unhashable type: {type(key).__name__!r}). Name the examples' "
                f"key, or leave {setting} out (mlx-lm then reads {_FEATURES[setting]!r})."
            ) from None

    if has("prompt_feature", prompt) and has("completion_feature", completion):
        return (prompt, completion)
    if has("chat_feature", chat):
        return (chat,)
    if not has("text_feature", text):
        msg = (
            f"{where} line 1 has none of the keys mlx-lm reads ({text!r}; {prompt!r} and "
            f"{completion!r}; or {chat!r}; its keys: {sorted(example)!r})"
        )
        causes = _feature_causes(example, args)
        if not causes:
            raise SystemExit(f"{msg}. See mlx-lm's LORA.md, section Data.")
        why = "; ".join(_feature_setting(s, getattr(args, s), args, why=True) for s in causes)
        defaults = " and ".join(repr(_FEATURES[s]) for s in causes)
        raise SystemExit(
            f"{msg}: {why}. Leave {' and '.join(causes)} out (mlx-lm then reads line 1's "
            f"{defaults}), or set {'them' if len(causes) > 1 else 'it'} to the examples' "
            f"key{'s' if len(causes) > 1 else ''}."
        )
    if getattr(args, "mask_prompt", False):
        raise SystemExit(
            f"{where} holds {text!r} examples, which have no prompt to mask: "
            f"--mask-prompt takes {prompt!r} / {completion!r} or {chat!r} examples."
        )
    return (text,)


# mlx-lm's data key settings (YAML only, no flag), in the order its create_dataset looks
# them up, with their defaults and what each names
_FEATURES = {"prompt_feature": "prompt", "completion_feature": "completion",
             "chat_feature": "messages", "text_feature": "text"}  # fmt: skip
_FEATURE_NAMES = {"prompt_feature": "the prompts", "completion_feature": "the completions",
                  "chat_feature": "chats", "text_feature": "text examples"}  # fmt: skip


def _feature_causes(example: dict, args: types.SimpleNamespace) -> list[str]:
    """The null, empty or non-string feature settings that are why the first example
    matched no format: those of the format that the defaults in their place match
    (none where the defaults match none either: then the data's keys are why)."""
    names = {s: getattr(args, s, d) for s, d in _FEATURES.items()}
    bad = [s for s, v in names.items() if not (isinstance(v, str) and v)]
    fixed = {s: (_FEATURES[s] if s in bad else v) for s, v in names.items()}
    for settings in (("prompt_feature", "completion_feature"), ("chat_feature",),
                     ("text_feature",)):  # fmt: skip
        if all(fixed[s] in example for s in settings):
            return [s for s in settings if s in bad]
    return []


def _feature_setting(setting: str, value: Any, args, why: bool = False) -> str:
    """``<setting> is <value> in -c <file>``; with ``why``, and what mlx-lm then looks
    up for the examples it names."""
    config = getattr(args, "config", None)
    source = f" in -c {config}" if config else ""
    what = _FEATURE_NAMES[setting]
    if value is None:
        is_, then = "null", f"no key is looked up for {what}"
    elif isinstance(value, str):  # (the empty one: others match or name no format)
        is_, then = '""', f"the empty key is looked up for {what}"
    else:
        is_ = f"a YAML {_kind(value, yaml=True)} ({value!r})"
        then = f"it is no key of the example (JSON keys are strings): none is found for {what}"
    return f"{setting} is {is_}{source}" + (f", so {then}" if why else "")


def _check_chat_template(where: str, needed: tuple[str, ...], args: types.SimpleNamespace) -> None:
    """``prompt`` / ``completion`` and chat examples go through the tokenizer's chat
    template: a local model folder whose tokenizer has none (the demo's had none) was a
    traceback after the model loaded (found by probing). Not asked of a Hub model."""
    model = pathlib.Path(str(args.model)).expanduser()
    if not model.is_dir() or _has_chat_template(model):
        return
    raise SystemExit(
        f"{where} holds {' / '.join(map(repr, needed))} examples, which mlx-lm formats with "
        f"the tokenizer's chat template, but --model {args.model} has none (no "
        f"chat_template in tokenizer_config.json, no chat_template.jinja). Use 'text' "
        f"examples, or a model whose tokenizer has a chat template."
    )


def _has_chat_template(model: pathlib.Path) -> bool:
    """Whether a local model folder's tokenizer has a chat template (the places
    transformers reads it from)."""
    if (model / "chat_template.jinja").is_file() or (model / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((model / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return True  # unread: left to mlx-lm
    return not isinstance(config, dict) or bool(config.get("chat_template"))
