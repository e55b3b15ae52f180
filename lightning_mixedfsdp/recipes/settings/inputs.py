"""What a recipe points at: the HF model config or pretrained directory, the data files, the tokenizer. Resolved and
checked in the launching process, before any training process starts; every problem comes with its fix."""

import dataclasses
import glob
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from lightning_mixedfsdp.checkpoint.load import _safetensors_files
from lightning_mixedfsdp.compat.extras import installed, missing_message
from lightning_mixedfsdp.recipes.models.tiny_llama import TinyLlamaConfig
from lightning_mixedfsdp.recipes.settings.schema import DataSection, ModelSection, Recipe

JSONL_SUFFIX = ".jsonl"
"""A document per line, its text in ``data.text_field``; any other UTF-8 text file is one document."""
SNIFF_BYTES = 65536
"""How much of each file is checked for being text before launch."""


def load_hf_config(source: Any, trust_remote_code: bool = False) -> Any:
    """An HF config from a ``config.json``, a directory holding one, or a mapping with ``model_type``. A directory
    whose model type transformers does not know is read by the config class its ``auto_map`` names, which runs the
    directory's own code: only with ``trust_remote_code`` (``model.trust_remote_code``)."""
    from transformers import AutoConfig

    fields = hf_config_fields(source)
    if not isinstance(source, dict) and _ships_model_code(fields):
        folder = Path(source) if Path(source).is_dir() else Path(source).parent
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, **fields)


def _ships_model_code(fields: Dict[str, Any]) -> bool:
    """Whether a config's fields have transformers run the folder's own code to build the model: an ``auto_map`` for
    a model type transformers does not know."""
    from transformers import CONFIG_MAPPING

    return bool(fields.get("auto_map")) and fields.get("model_type") not in CONFIG_MAPPING


def read_json(path: Path) -> Any:
    """A JSON file's value; a file that is not JSON raises ``ValueError`` in one line: the file, json's message, its
    line and column."""
    text = path.read_text(encoding="utf-8")
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path} is not valid JSON: {error.msg} at line {error.lineno}, column {error.colno}; fix the file (or"
            " write it again with save_pretrained)"
        ) from None


def hf_config_fields(source: Any) -> dict:
    """The raw fields of an HF config source, checked for a ``model_type``."""
    if isinstance(source, dict):
        fields = dict(source)
        where = "the inline model.hf_config"
    else:
        path = Path(source)
        path = path / "config.json" if path.is_dir() else path
        if not path.is_file():
            raise FileNotFoundError(
                f"{str(source)!r} is neither a config.json nor a directory holding one; check the path."
            )
        fields = read_json(path)
        if not isinstance(fields, dict):
            raise ValueError(f"{path} holds a JSON {type(fields).__name__}, not an object of config fields")
        where = str(path)
    if "model_type" not in fields:
        raise ValueError(
            f"{where} has no 'model_type'; add it (e.g. model_type: llama), so transformers knows which model to build."
        )
    return fields


REFERENCE_MODEL_TYPE = "mixedfsdp_tinyllama"
"""The ``model_type`` of the reference model's export (``hf_export.write_reference_config``)."""
REFERENCE_MODULE = "hf_tinyllama"
"""The modelling file the runner copies into that export, which its ``auto_map`` names."""


def project_export(directory: Union[str, Path]) -> bool:
    """Whether ``directory`` is this project's export of the reference model: a ``config.json`` of the reference
    model's ``model_type`` whose ``auto_map`` names only the modelling file the runner copied beside it, so the code
    transformers would run is this package's own."""
    path = Path(directory)
    fields = _json_object(path / "config.json")
    auto_map = fields.get("auto_map")
    return (
        fields.get("model_type") == REFERENCE_MODEL_TYPE
        and isinstance(auto_map, dict)
        and all(str(ref).split(".")[0] == REFERENCE_MODULE for ref in auto_map.values())
        and (path / f"{REFERENCE_MODULE}.py").is_file()
    )


def custom_code(directory: Union[str, Path], tokenizer: bool = True) -> List[str]:
    """The files of a model or tokenizer directory whose ``auto_map`` has transformers run the directory's own Python
    code to load it: ``config.json`` naming a config of a model type transformers does not know (this project's
    export excepted) and, with ``tokenizer``, ``tokenizer_config.json`` naming a tokenizer class. Empty: it loads with
    transformers' own code."""
    path = Path(directory)
    found = []
    config = _json_object(path / "config.json")
    if _ships_model_code(config) and not project_export(path):
        found.append(f"config.json's auto_map {config['auto_map']}")
    tokenizer_config = _json_object(path / "tokenizer_config.json") if tokenizer else {}
    if tokenizer_config.get("auto_map"):
        found.append(f"tokenizer_config.json's auto_map {tokenizer_config['auto_map']}")
    return found


JSON_FILES = ("config.json", "tokenizer_config.json")
"""The JSON files transformers reads from a model or tokenizer folder first."""


def json_problems(key: str, directory: Union[str, Path]) -> List[str]:
    """Each of a folder's :data:`JSON_FILES` that is not JSON, in one line naming the key, the file, json's message
    and where."""
    problems = []
    for name in JSON_FILES:
        path = Path(directory) / name
        if path.is_file():
            try:
                read_json(path)
            except ValueError as error:
                problems.append(f"{key}={str(directory)!r}: {error}")
    return problems


def _json_object(path: Path) -> Dict[str, Any]:
    """A JSON file's object; empty when the file is missing or holds something else."""
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return fields if isinstance(fields, dict) else {}


def load_hf_tokenizer(directory: Union[str, Path], trust_remote_code: bool = False) -> Any:
    """The HF tokenizer in a local ``directory``, never by asking: transformers prompts on a terminal only when
    ``trust_remote_code`` is left out, so it is always passed. This project's export is read without its modelling
    code (a plain config in place of the one its ``auto_map`` names; the tokenizer needs none of it), so neither a
    prompt nor a warning about the config's model type comes."""
    from transformers import AutoTokenizer, PretrainedConfig

    plain = {"config": PretrainedConfig()} if project_export(directory) else {}
    return AutoTokenizer.from_pretrained(str(directory), trust_remote_code=trust_remote_code, **plain)


def byte_tokenizer_json() -> Dict[str, Any]:
    """The byte tokenizer's ``tokenizer.json`` (``hf_export.write_byte_tokenizer`` writes it, :func:`is_byte_tokenizer`
    knows it again)."""
    symbols = _byte_symbols()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {symbols[b]: b for b in range(256)},
            "merges": [],
        },
    }


def is_byte_tokenizer(directory: Union[str, Path]) -> bool:
    """Whether ``directory`` holds the byte tokenizer ``hf_export.write_byte_tokenizer`` writes (token i is byte i; also
    as transformers saves it again): the same vocabulary, no merges, no added tokens, nothing that changes the text
    before it is split into bytes, no code of its own."""
    path = Path(directory)
    try:
        saved = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not (isinstance(saved, dict) and isinstance(config, dict)):
        return False
    ours = byte_tokenizer_json()
    model, pre_tokenizer = saved.get("model") or {}, saved.get("pre_tokenizer") or {}
    post = saved.get("post_processor") or {}  # transformers saves a template that adds nothing
    adds_nothing = post.get("type") == "TemplateProcessing" and not post.get("special_tokens")
    return (
        not config.get("auto_map")
        and model.get("type") == "BPE"
        and model.get("vocab") == ours["model"]["vocab"]
        and not model.get("merges")
        and not saved.get("added_tokens")
        and saved.get("normalizer") is None
        and (not post or (adds_nothing and post.get("single") == [{"Sequence": {"id": "A", "type_id": 0}}]))
        and pre_tokenizer.get("type") == "ByteLevel"
        and not pre_tokenizer.get("add_prefix_space")
    )


def saved_chat_template(directory: Union[str, Path]) -> Optional[str]:
    """The chat template a tokenizer directory carries: ``tokenizer_config.json``'s (as
    ``hf_export.write_byte_tokenizer`` writes it), or ``chat_template.jinja`` (as transformers saves it)."""
    path = Path(directory)
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    if isinstance(config.get("chat_template"), str):
        return str(config["chat_template"])
    jinja = path / "chat_template.jinja"
    return jinja.read_text(encoding="utf-8") if jinja.is_file() else None


def _byte_symbols() -> Dict[int, str]:
    """GPT-2's printable stand-in for each byte (``bytes_to_unicode``), the alphabet of HF's ByteLevel
    pre-tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    symbols = {b: chr(b) for b in printable}
    symbols.update({b: chr(256 + i) for i, b in enumerate(others)})
    return symbols


def reference_model_config(model: ModelSection) -> Optional[TinyLlamaConfig]:
    """The reference model's sizes: the recipe's own (no HF model named), or those of a reference model's export that
    ``model.pretrained`` names (the main job's, to fine-tune); None for an HF model."""
    if model.hf_source() is None:
        return model
    if model.pretrained is None:
        return None
    fields = hf_config_fields(model.pretrained)
    if fields.get("model_type") != REFERENCE_MODEL_TYPE:
        return None
    names = {f.name for f in dataclasses.fields(TinyLlamaConfig)}
    return TinyLlamaConfig(**{name: value for name, value in fields.items() if name in names})


def data_files(data: DataSection) -> Tuple[List[Path], List[str]]:
    """The files ``data.files`` names (globs expanded, directories walked, sorted), and the problems with them: a
    pattern that matches nothing, a file that is not UTF-8 text."""
    files: List[Path] = []
    problems = []
    for pattern in data.files:
        matched = sorted(Path(p) for p in glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matched:
            problems.append(f"data.files: {pattern!r} matches no file; fix the path or the glob")
        for path in (file for match in matched for file in _walk(match)):
            problem = _text_problem(path)
            if problem is None:
                files.append(path)
            else:
                problems.append(f"data.files: {str(path)!r} {problem}; leave it out or convert it to text")
    return files, problems


def _walk(path: Path) -> List[Path]:
    """A file, or every file under a directory (hidden ones left out, e.g. ``.git``)."""
    if not path.is_dir():
        return [path]
    found = (p for p in path.rglob("*") if p.is_file())
    return sorted(p for p in found if not any(part.startswith(".") for part in p.relative_to(path).parts))


def _text_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a text document (judged by its first bytes), or None."""
    import codecs

    with path.open("rb") as handle:
        head = handle.read(SNIFF_BYTES)
    if b"\0" in head:
        return "is binary (it holds NUL bytes)"
    try:  # a character the sniff cut at its end is fine; at the file's end it is not
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < SNIFF_BYTES)
    except UnicodeDecodeError as error:
        return f"is not UTF-8 text (byte {error.start})"
    return None


def jsonl_problems(files: Sequence[Path], text_field: str) -> List[str]:
    """Each jsonl line must be an object holding ``text_field`` as a string (the first bad line per file)."""
    problems = []
    for path in files:
        if path.suffix != JSONL_SUFFIX:
            continue
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip("\r\n"))  # json's "line 1 column N" then points into this line
                except json.JSONDecodeError as error:
                    problems.append(f"data.files: {path}:{number} is not JSON ({error}); fix the line")
                    break
                if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    problems.append(
                        f"data.files: {path}:{number} has no text field {text_field!r} (it has {keys}); set"
                        " data.text_field to the field that holds the text"
                    )
                    break
    return problems


def detected_format(record: Any, text_field: str) -> Optional[str]:
    """The format a ``.jsonl`` record's fields say: ``messages`` and ``images`` -> vision, ``messages`` -> chat,
    ``prompt``, ``chosen`` and ``rejected`` -> preference, ``prompt`` and ``completion`` -> instruction, ``prompt``
    alone -> prompts (reinforcement learning), the text field -> text."""
    if not isinstance(record, dict):
        return None
    if "messages" in record:
        return "vision" if "images" in record else "chat"
    if "chosen" in record and "rejected" in record:
        return "preference"
    if "prompt" in record and "completion" in record:
        return "instruction"
    if "prompt" in record:
        return "prompts"
    return "text" if text_field in record else None


def resolved_format(data: DataSection) -> str:
    """``data.format``, or what the first ``.jsonl`` line's fields say (text files and the stdlib source: text)."""
    if data.format is not None:
        return data.format
    files, _ = data_files(data)
    for path in (p for p in files if p.suffix == JSONL_SUFFIX):
        with path.open(encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    try:
                        return detected_format(json.loads(line), data.text_field) or "text"
                    except json.JSONDecodeError:
                        return "text"  # the text checks name the line
    return "text"


def model_vocab_size(model: ModelSection) -> Optional[int]:
    """The model's embedding size, read from its config without building it."""
    source = model.hf_source()
    if source is None:
        return model.vocab_size
    fields = hf_config_fields(source)
    vocab = fields.get("vocab_size", fields.get("text_config", {}).get("vocab_size"))
    return int(vocab) if vocab is not None else None


def tokenizer_vocab_size(spec: str, trust_remote_code: bool = False) -> int:
    if spec == "bytes" or is_byte_tokenizer(spec):
        return 256
    return len(load_hf_tokenizer(spec, trust_remote_code))


def pretrained_problems(key: str, folder: str) -> List[str]:
    """A model folder a recipe key names that holds no ``config.json``, with the fix (a run's export: run it)."""
    if (Path(folder) / "config.json").is_file():
        return []
    run_export = Path(folder).name == "export"
    return [
        f"{key}={folder!r} is not a directory holding a config.json; "
        + (
            "it names a run's export, which exists once that run has finished: run it first (the recipe whose"
            f" output.dir is {Path(folder).parent}; the main job: python -m lightning_mixedfsdp.train --config"
            " conf/stdlib_llama.yaml)"
            if run_export
            else "point it at a save_pretrained() directory"
        )
    ]


def remote_code_problems(key: str, directory: str, trust_remote_code: bool) -> List[str]:
    """A model folder whose config has transformers run the folder's own code, without ``model.trust_remote_code``."""
    shipped = custom_code(directory, tokenizer=False)
    if not shipped or trust_remote_code:
        return []
    return [
        f"{key}={directory!r} ships Python code that transformers would run to build the model ({shipped[0]}); set"
        " model.trust_remote_code=true if you trust that code, or point it at a model transformers builds with its"
        " own code"
    ]


def input_problems(recipe: Recipe) -> List[str]:
    """Every problem with what the recipe points at, each with its fix."""
    model, data = recipe.model, recipe.data
    problems = []
    if model.hf_config is not None and model.pretrained is not None:
        problems.append(
            "model.hf_config and model.pretrained are both set; keep hf_config to train from scratch, or pretrained"
            " to fine-tune a checkpoint (its config.json comes with it)"
        )
    if model.pretrained is not None:
        problems += pretrained_problems("model.pretrained", model.pretrained)
        problems += json_problems("model.pretrained", model.pretrained)
        if not problems:
            problems += remote_code_problems("model.pretrained", model.pretrained, model.trust_remote_code)
    elif isinstance(model.hf_config, str) and Path(model.hf_config).is_dir():
        problems += remote_code_problems("model.hf_config", model.hf_config, model.trust_remote_code)
    vocab = None
    if not any("model." in p for p in problems):
        try:
            vocab = model_vocab_size(model)
        except (FileNotFoundError, ValueError) as error:
            problems.append(f"model.hf_config: {error}")
    if recipe.peft.enabled and model.hf_source() is None:
        problems.append("peft.enabled needs a Hugging Face model; set model.hf_config or model.pretrained")
    files, file_problems = data_files(data)
    problems += file_problems
    if not file_problems and resolved_format(data) == "text":
        problems += jsonl_problems(files, data.text_field)
    problems += tokenizer_problems(data, vocab, model)
    return problems


def tokenizer_problems(data: DataSection, vocab: Optional[int], model: ModelSection) -> List[str]:
    """What is wrong with ``data.tokenizer``: not a folder, JSON files that are not JSON (the model folder's are
    checked with it), code of its own without ``data.trust_remote_code`` (the model's code in the model's own folder
    is trusted by ``model.trust_remote_code``), more tokens than the model's embedding (``vocab``)."""
    if data.tokenizer == "bytes":
        # image-text rows without data.tokenizer take the processor of the model's folder (or the generated task's)
        return [] if resolved_format(data) == "vision" else _vocab_problems(data, vocab)
    if not Path(data.tokenizer).is_dir():
        return [
            f"data.tokenizer={data.tokenizer!r} is neither 'bytes' nor a directory; point it at a local HF tokenizer"
            " (tokenizer.save_pretrained(dir))"
        ]
    unreadable = json_problems("data.tokenizer", data.tokenizer)
    model_folder = data.tokenizer == model.pretrained
    if unreadable:
        return [] if model_folder else unreadable  # said once, as model.pretrained's
    shipped = custom_code(data.tokenizer)
    if model_folder and model.trust_remote_code:
        shipped = [found for found in shipped if not found.startswith("config.json")]
    if shipped and not data.trust_remote_code:
        return [
            f"data.tokenizer={data.tokenizer!r} ships Python code that transformers would run to load it"
            f" ({'; '.join(shipped)}); set data.trust_remote_code=true if you trust that code, or point"
            " data.tokenizer at a tokenizer transformers loads with its own code"
        ]
    return _vocab_problems(data, vocab)


def _vocab_problems(data: DataSection, vocab: Optional[int]) -> List[str]:
    if vocab is None:
        return []
    tokens = tokenizer_vocab_size(data.tokenizer, data.trust_remote_code)
    if tokens <= vocab:
        return []
    return [
        f"data.tokenizer={data.tokenizer!r} has {tokens} tokens, more than the model's embedding ({vocab}); use a"
        " model with vocab_size >= the tokenizer's, or another tokenizer"
    ]


def _text_format(data: DataSection) -> bool:
    return resolved_format(data) == "text"


def package_problems(recipe: Recipe) -> List[str]:
    """The optional packages the recipe needs and this machine lacks: peft for LoRA, torchft for fault tolerance, the
    package ``trainer.logger`` needs; each with its install line."""
    problems = []
    if recipe.peft.enabled and not installed("peft"):
        problems.append(missing_message("peft", "peft.enabled=true"))
    if recipe.strategy.fault_tolerance is not None and not installed("torchft"):
        problems.append(missing_message("torchft", "strategy.fault_tolerance"))
    choice = recipe.trainer.logger
    needs = {"tensorboard": ("tensorboard", "tensorboardX"), "wandb": ("wandb",)}.get(choice, ())
    if needs and not any(installed(name) for name in needs):
        problems.append(missing_message(needs[0], f"trainer.logger={choice!r}"))
    return problems


def checkpoint_fp32_patterns(directory: str) -> List[str]:
    """Keep-fp32 rules for the tensors a mixed-dtype checkpoint holds in fp32 (promote(checkpoint dtype, requested
    dtype) for them), read from the safetensors headers; repeated blocks collapse into one rule. A checkpoint stored
    all in fp32 gets none: the precision flag decides its bulk."""
    import re

    from safetensors import safe_open

    dtypes = {}
    for file in _safetensors_files(Path(directory)):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            dtypes.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    floating = {name: dtype for name, dtype in dtypes.items() if dtype in ("F32", "F16", "BF16", "F64")}
    if set(floating.values()) <= {"F32", "F64"}:
        return []
    fp32 = [name for name, dtype in floating.items() if dtype in ("F32", "F64")]
    collapsed = {"^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(name)) + "$" for name in fp32}
    return sorted(collapsed)
