"""Causal LMs a user adds (``ken models add NAME PATH``), kept in the model store beside the
packaged ones.

An added LM is the store entry ``<KEN_HOME>/models/<NAME>``: a transformers folder (config,
tokenizer, safetensors weights) with a card, ``ken-model.json`` (where it came from, its
architecture and size). The card is one of the entry's files, so it is sealed in the entry's
manifest with the weights and verified with them on every load: the folder *is* the
registration, and there is no second list that could disagree with it. A folder is added
whole or not at all (it is built in a staging folder and renamed into place).

What a user gives is checked before anything is written, because it is input ken did not
make: weights only from safetensors or GGUF tensors (a folder whose weights are pickled is
refused with how to convert it), no remote code (a config whose ``auto_map`` names code is
refused; transformers is never asked to trust remote code), and the model must be a causal LM
transformers builds itself: it is loaded once on the CPU and scores a one-token continuation
before the folder is kept.

>>> # add("my-lm", Path("~/models/my-lm"))        # a transformers folder
>>> # add("tiny", Path("~/models/tiny.Q4.gguf"))  # converted like the packaged GGUFs
>>> # added_dir("my-lm")                          # what Resources.causal_lm("my-lm") loads
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ken import store
from ken.errors import ModelError, StoreError
from ken.models import convert, family
from ken.models.fetch import CHUNKED_MODELS
from ken.models.gguf_file import read_header
from ken.paths import ken_home
from ken.progress import QUIET, Reporter

#: the card of an added LM, inside its folder (and its manifest)
CARD = "ken-model.json"
CARD_VERSION = 1
#: a plain slug, starting with a letter or digit (so never a hidden or leftover name)
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: weight formats that unpickle (run code) when loaded: never loaded from a user's folder
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
#: the files of a transformers folder that are copied: configs, tokenizers, chat templates
#: and safetensors weights (never code, pickles or anything else the folder holds)
COPIED_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".safetensors")
#: what the load check scores: the first token of the continuation after the context
CHECK_CONTEXT = "The capital of France is"
CHECK_CONTINUATION = " Paris"


@dataclass(frozen=True)
class AddedLM:
    """A causal LM added with ``ken models add``, as its card records it."""

    name: str
    folder: Path
    source: str  # the path it was added from (absolute)
    source_format: str  # "transformers" or "gguf"
    architecture: str  # the transformers class that loads it, e.g. "LlamaForCausalLM"
    num_params: int
    size_bytes: int  # of its files in the store

    def card(self) -> dict[str, object]:
        out = asdict(self)
        del out["folder"]
        return {"version": CARD_VERSION, **out}


# --------------------------------------------------------------------------- names


def packaged_names() -> tuple[str, ...]:
    """Names of the models ken makes in ``KEN_HOME/models`` itself (the packaged causal LMs
    and the family members' bodies): an added LM may not take one."""
    return tuple(dict.fromkeys((*family.ALL_MEMBER_NAMES, *CHUNKED_MODELS)))


def check_name(name: str) -> None:
    """ModelError unless ``name`` is a plain slug that no packaged model has."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ModelError(f"{name!r} is not a valid model name: use 1 to 64 letters, digits, "
                         "'.', '-' or '_', starting with a letter or digit")
    taken = {n.lower(): n for n in (*packaged_names(), "gguf")}
    if name.lower() in taken:
        raise ModelError(f"{name!r} is the name of a model packaged with ken "
                         f"({taken[name.lower()]}); choose another name for your model")


def _models_dir(home: Path | None) -> Path:
    return (Path(home) if home is not None else ken_home()) / "models"


def is_added(name: str, home: Path | None = None) -> bool:
    """Whether ``name`` is an added LM's name (its folder holds a card; cheap, no hashing)."""
    return (isinstance(name, str) and NAME_PATTERN.fullmatch(name) is not None
            and name not in packaged_names()
            and (_models_dir(home) / name / CARD).is_file())


def added_names(home: Path | None = None) -> tuple[str, ...]:
    """Names of every added LM in the store at ``home``, sorted."""
    folder = _models_dir(home)
    if not folder.is_dir():
        return ()
    return tuple(sorted(p.name for p in folder.iterdir() if is_added(p.name, home)))


def entry(name: str, home: Path | None = None) -> store.Entry:
    """The store entry of the added LM ``name`` (its folder, card included)."""
    return store.Entry(_models_dir(home) / name, f"the language model {name} added with "
                       "`ken models add`",
                       f"add it again: `ken models add {name} PATH --force` (PATH: the "
                       f"folder or .gguf file it came from), or `ken models remove {name}`")


def added_dir(name: str, home: Path | None = None) -> Path:
    """The verified folder of the added LM ``name`` (StoreError, naming the file and the fix,
    when a file changed since it was added)."""
    e = entry(name, home)
    store.ensure(e)
    return e.root


def load(name: str, home: Path | None = None) -> AddedLM:
    """The card of the added LM ``name``, verified with its folder."""
    folder = added_dir(name, home)
    card = store.check_json(folder / CARD, entry(name, home))
    keys = ("source", "source_format", "architecture", "num_params", "size_bytes")
    if not isinstance(card, dict) or card.get("version") != CARD_VERSION or \
            any(k not in card for k in keys):
        raise StoreError(f"model store: {folder / CARD} is not a card this ken wrote. To fix "
                         f"it: {entry(name, home).fix}.")
    return AddedLM(name, folder, str(card["source"]), str(card["source_format"]),
                   str(card["architecture"]), int(card["num_params"]), int(card["size_bytes"]))


# --------------------------------------------------------------------------- adding


def add(name: str, source: str | Path, home: Path | None = None, force: bool = False,
        reporter: Reporter = QUIET) -> AddedLM:
    """Add the causal LM at ``source`` (a transformers folder or a ``.gguf`` file) as ``name``.

    The folder is copied (its configs, tokenizer files and safetensors weights only) or the
    GGUF converted (:func:`ken.models.convert.write_gguf_folder`) into a staging folder, loaded
    once on the CPU and checked to score a continuation, then sealed and renamed to
    ``KEN_HOME/models/<name>``. Anything wrong raises ModelError naming ``source`` and the
    reason, and leaves the store as it was. An existing ``name`` is replaced only with
    ``force``.
    """
    check_name(name)
    home = Path(home) if home is not None else ken_home()
    source = Path(source).expanduser().absolute()

    def refuse(reason: str) -> ModelError:
        return ModelError(f"cannot add {source} as {name!r}: {reason}")

    if not source.exists():
        raise refuse("no such file or folder; give a transformers model folder or a .gguf file")
    try:
        fmt = _source_format(source)
        files = _folder_files(source) if fmt == "transformers" else []
    except ModelError as exc:
        raise refuse(str(exc)) from None
    folder = _models_dir(home) / name
    with store.store_lock(home, f"adding the language model {name}", reporter.note):
        if folder.exists() or folder.is_symlink():
            if not is_added(name, home):
                raise refuse(f"{folder} exists and was not made by `ken models add`; move it "
                             "away or choose another name")
            if not force:
                raise refuse(f"a language model named {name!r} is already added; pass --force "
                             "to replace it, or choose another name")
        try:
            with reporter.long_work(f"adding {name} from {source} (copied or converted, then "
                                    "loaded once to check it) ..."), \
                    store.staging_dir(folder) as staging:
                if fmt == "gguf":
                    convert.write_gguf_folder(source.parent, source.name, staging)
                else:
                    for path in files:
                        shutil.copyfile(path, staging / path.name)
                num_params, architecture = check_causal_lm(staging)
                size = sum(p.stat().st_size for p in staging.iterdir() if p.is_file())
                added = AddedLM(name, folder, str(source), fmt, architecture, num_params, size)
                store.write_text(staging / CARD, json.dumps(added.card(), indent=1))
                store.seal(store.Entry(staging, "", ""))
        except ModelError as exc:  # StoreError included
            raise refuse(str(exc)) from None
        except OSError as exc:
            raise refuse(f"cannot copy it into {folder} ({exc})") from None
    return load(name, home)


def _source_format(source: Path) -> str:
    """"gguf" (a file with GGUF's magic number) or "transformers" (a folder)."""
    if source.is_dir():
        return "transformers"
    if source.suffix.lower() != ".gguf":
        raise ModelError("it is neither a transformers model folder nor a .gguf file")
    try:
        with source.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ModelError(f"it cannot be read ({exc.strerror or exc})") from None
    if magic != b"GGUF":
        raise ModelError("it is not a GGUF file (it does not start with the GGUF magic number)")
    header = read_header(source)  # every count and offset within the file, before a reader
    template = header.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and len(template) > MAX_TEMPLATE_CHARS:  # before converting
        check_chat_template(template)
    return "gguf"


def _folder_files(source: Path) -> list[Path]:
    """The files of a transformers folder to copy, after the checks that need no loading:
    a config without remote code, and complete safetensors weights (not pickles)."""
    files = sorted(p for p in source.iterdir()
                   if p.is_file() and not p.name.startswith(".") and p.name != CARD)
    if not any(p.name == "config.json" for p in files):
        raise ModelError("it has no config.json (a transformers model folder has one)")
    for name in ("config.json", "tokenizer_config.json"):
        path = source / name
        if not path.is_file():
            continue
        try:
            config = json.loads(path.read_bytes())
        except (OSError, ValueError) as exc:
            raise ModelError(f"{name} is not readable JSON ({exc})") from None
        if not isinstance(config, dict):
            raise ModelError(f"{name} is not a JSON object")
        if config.get("auto_map"):
            raise ModelError(
                f"its {name} asks for remote code (auto_map: {json.dumps(config['auto_map'])}); "
                "ken never runs code from a model folder: use a model whose architecture "
                "transformers has built in")
    weights = [p for p in files if p.suffix == ".safetensors"]
    if not weights:
        pickled = [p.name for p in files if p.suffix.lower() in PICKLED]
        if pickled:
            raise ModelError(
                f"its weights are pickled ({', '.join(pickled)}), a format that runs code when "
                "loaded, so ken does not load it; if you trust the file, convert it to "
                "safetensors in Python, AutoModelForCausalLM.from_pretrained(folder)"
                ".save_pretrained(new_folder) (transformers writes model.safetensors), and "
                "add new_folder")
        raise ModelError("it holds no weights (no .safetensors file)")
    for path in weights:
        try:
            store.check_safetensors(path)
        except StoreError as exc:
            raise ModelError(str(exc).removeprefix("model store: ")) from None
    return [p for p in files if p.suffix in COPIED_SUFFIXES]


def check_causal_lm(folder: Path) -> tuple[int, str]:
    """Load ``folder`` on the CPU as transformers' ``AutoModelForCausalLM`` (safetensors only,
    no remote code) and score a one-token continuation: ``(parameters, class name)``.
    ModelError says why it is not a causal LM ken can run."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ken.models.transformers_backend import count_params

    with convert.quiet_transformers():
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True,
                                                      trust_remote_code=False)
            net, info = AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, trust_remote_code=False, use_safetensors=True,
                dtype=torch.float32, output_loading_info=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds on a bad folder
            raise ModelError("transformers cannot load it as a causal language model "
                             f"({_short(exc)})") from None
    missing = sorted(info.get("missing_keys") or ())
    mismatched = [str(k[0]) if isinstance(k, tuple) else str(k)
                  for k in info.get("mismatched_keys") or ()]
    if missing or mismatched:
        wrong = missing + [f"{k} (wrong shape)" for k in mismatched]
        raise ModelError(f"its weights do not fill a {type(net).__name__}: "
                         f"{len(wrong)} parameter(s) missing or mis-shaped "
                         f"({', '.join(wrong[:5])}); is it a causal LM checkpoint?")
    context = tokenizer.encode(CHECK_CONTEXT, add_special_tokens=False)
    target = tokenizer.encode(CHECK_CONTINUATION, add_special_tokens=False)[:1]
    if not context or not target:
        raise ModelError("its tokenizer turns text into no tokens")
    ids = torch.tensor([context + target], dtype=torch.long)
    try:
        with torch.inference_mode():
            # the call CausalLM makes (positions given, no cache, logits of the last columns)
            logits = net(input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=torch.arange(ids.shape[1])[None], use_cache=False,
                         logits_to_keep=2).logits
        logp = float(torch.log_softmax(logits[0, 0].float(), dim=-1)[target[0]])
    except Exception as exc:  # noqa: BLE001 - a model that cannot score is refused, any reason
        raise ModelError(f"it fails to score a continuation ({_short(exc)})") from None
    if not math.isfinite(logp):
        raise ModelError(f"it scores a continuation as {logp} (its weights hold NaN or inf?)")
    check_chat_template(getattr(tokenizer, "chat_template", None),
                        dict(getattr(tokenizer, "special_tokens_map", {}) or {}))
    return count_params(net), type(net).__name__


#: a chat template is a program (Jinja) the model's files carry; ken renders it only if it is
#: at most this long, renders a probe conversation within ``TEMPLATE_SECONDS`` in a separate
#: process (the sandboxed renderer transformers uses, under a memory limit) and produces at
#: most ``MAX_RENDERED_CHARS`` for it. Real templates are 1-5 KB and render in milliseconds.
MAX_TEMPLATE_CHARS = 64 * 1024
TEMPLATE_SECONDS = 5.0
MAX_RENDERED_CHARS = 64 * 1024
TEMPLATE_MEMORY_BYTES = 2 * 2**30
PROBE_CHAT = [{"role": "system", "content": "Answer in a few words."},
              {"role": "user", "content": "Which city is the capital of France? " * 4},
              {"role": "assistant", "content": "Paris."},
              {"role": "user", "content": "And of Italy?"}]
_RENDER = """
import json, math, resource, sys
memory, seconds = int(sys.argv[1]), float(sys.argv[2])
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
job = json.loads(sys.stdin.read())
from transformers.utils.chat_template_utils import render_jinja_template
use = resource.getrusage(resource.RUSAGE_SELF)
cpu = math.ceil(use.ru_utime + use.ru_stime + seconds)  # the imports, then the render's own
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
out, _ = render_jinja_template(conversations=[job["chat"]], chat_template=job["template"],
                               add_generation_prompt=True, **job["special"])
print(len(out[0]))
"""


def check_chat_template(template: str | dict | None, special: dict | None = None) -> None:
    """Refuse a chat template ken should not render (ModelError saying why): one longer than
    ``MAX_TEMPLATE_CHARS``, one that does not render the probe conversation (a syntax
    error, something the sandbox forbids), takes more than ``TEMPLATE_SECONDS`` or more
    memory than ``TEMPLATE_MEMORY_BYTES`` doing so, or renders more than
    ``MAX_RENDERED_CHARS``. A model without a template passes. Each named template of a
    dict is checked."""
    import signal
    import subprocess
    import sys

    if template is None:
        return
    named = template if isinstance(template, dict) else {"": template}
    for name, text in named.items():
        what = f"its chat template{f' {name!r}' if name else ''}"
        if not isinstance(text, str):
            raise ModelError(f"{what} is not text")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ModelError(f"{what} is {len(text):,} characters, over ken's limit of "
                             f"{MAX_TEMPLATE_CHARS:,} (real templates are a few thousand)")
        job = json.dumps({"chat": PROBE_CHAT, "template": text, "special": {
            k: v for k, v in (special or {}).items() if isinstance(v, str)}})
        slow = ModelError(f"{what} did not render a four-message conversation within "
                          f"{TEMPLATE_SECONDS:g} s of CPU; ken does not use it")
        try:
            done = subprocess.run([sys.executable, "-c", _RENDER, str(TEMPLATE_MEMORY_BYTES),
                                   str(TEMPLATE_SECONDS)], input=job, capture_output=True,
                                  text=True, timeout=60.0)  # a stall the CPU limit misses
        except subprocess.TimeoutExpired:
            raise slow from None
        if done.returncode in (-signal.SIGXCPU, -signal.SIGKILL):  # past its CPU limit
            raise slow
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["no error message"])[-1]
            if "MemoryError" in done.stderr:
                last = f"more than {TEMPLATE_MEMORY_BYTES / 2**30:g} GB of memory"
            raise ModelError(f"{what} cannot render a four-message conversation ({last[:300]})")
        rendered = int(done.stdout.strip().splitlines()[-1])
        if rendered > MAX_RENDERED_CHARS:
            raise ModelError(f"{what} renders a four-message conversation as {rendered:,} "
                             f"characters, over ken's limit of {MAX_RENDERED_CHARS:,}")


def _short(exc: BaseException, limit: int = 400) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[:limit] + " ..."


# --------------------------------------------------------------------------- removing


def remove(name: str, home: Path | None = None) -> Path:
    """Delete the added LM ``name`` (its folder, card included); returns the folder. Packaged
    models cannot be removed this way."""
    home = Path(home) if home is not None else ken_home()
    if not is_added(name, home):
        if isinstance(name, str) and name.lower() in {n.lower() for n in packaged_names()}:
            raise ModelError(f"{name!r} is packaged with ken, not added with `ken models "
                             "add`; only added models can be removed")
        added = ", ".join(added_names(home)) or "none"
        raise ModelError(f"no language model named {name!r} was added (added: {added})")
    folder = _models_dir(home) / name
    with store.store_lock(home, f"removing the language model {name}"):
        # renamed first, so that no half-deleted folder is ever taken for the model
        doomed = store.temporary_name(folder, ".old")
        os.replace(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return folder
