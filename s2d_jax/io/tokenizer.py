"""Tokenizers loaded through `transformers`, with Llama sentencepiece tokenizers made exact.

Vicuna and Llama-2 were trained on ids from `sentencepiece` with Llama's `tokenizer.model`.
transformers 5 converts that file into a `tokenizers` BPE that differs from sentencepiece
on runs of spaces and leading spaces ("a  b", " x", indented code), for two reasons:
  1. its merges are ranked by vocabulary id, but sentencepiece merges by piece *score*,
     and the whitespace-only pieces ("▁▁", "▁▁▁", ...) have score -1e9: sentencepiece
     merges them last, the converted BPE merges "▁▁" first;
  2. sentencepiece always prepends "▁" and splits the text into words that start at each
     run of "▁" (a run plus the following non-space characters); the converted
     pre-tokenizer prepends only if the text does not already start with a space and
     does not split at all.
`_sentencepiece_exact` rebuilds the backend with merges re-ranked by score, a
Prepend+Replace normalizer and a Split pre-tokenizer reproducing those words. A probe of
tricky strings is checked against sentencepiece itself at load, so a tokenizer.model for
which this reasoning does not hold fails loudly instead of training on wrong ids.

`encode` never parses special-token text: "</s>" in user text stays text, as in
sentencepiece. Callers that need EOS/BOS insert the ids (see s2d_jax.data.chat).
`TOKENIZER_FILES` are the files that make a directory a tokenizer; every model writer
(`io/orbax_params.py`, `io/hf.py`) copies them along with `tokenizer_files`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from typing import Any

from s2d_jax.errors import S2DError
from s2d_jax.readers import expand_path, read_json

SPACE = "\u2581"  # sentencepiece's whitespace symbol "▁"
# One sentencepiece word: a run of "▁" with the non-space characters that follow it, or a
# trailing run of "▁" alone (the text always starts with "▁": the normalizer prepends it).
_SP_WORD = f"{SPACE}*[^{SPACE}]+|{SPACE}+"
_PROBES = ("a  b", " x", "  leading", "hello\n\nworld", "def f():\n    return 1\n",
           "x   ", " ", "", "h\u00e9llo \u4e16\u754c \U0001F916", "a" + " " * 20 + "b",
           "12  345", "\t x\r\n", "USER: hi ASSISTANT: yo")


# chat_template.jinja / .json: where transformers >= 4.43 saves the chat template
TOKENIZER_FILES = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json", "generation_config.json",
                   "chat_template.jinja", "chat_template.json")


def has_tokenizer(directory: str) -> bool:
    return any(os.path.isfile(os.path.join(directory, f))
               for f in ("tokenizer.model", "tokenizer.json"))


def tokenizer_files(directory: str | None, required: bool = False) -> list[str]:
    """Paths of the tokenizer files in `directory` (a written model carries them along)."""
    if directory is None:
        return []
    found = [os.path.join(directory, f) for f in TOKENIZER_FILES
             if os.path.isfile(os.path.join(directory, f))]
    if required and not has_tokenizer(directory):
        raise S2DError(f"no tokenizer files in {directory} (expected tokenizer.model or "
                       f"tokenizer.json); pass a tokenizer directory")
    return found


@dataclasses.dataclass(frozen=True, eq=False)
class Tokenizer:
    """A loaded tokenizer. `hf` is the transformers tokenizer (fast, `tokenizers`-backed)."""

    hf: Any
    path: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        ids = self.hf(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        return ([self.bos_id] if bos and self.bos_id is not None else []) + list(ids)

    def encode_batch(self, texts: list[str], bos: bool = True) -> list[list[int]]:
        out = self.hf(list(texts), add_special_tokens=False, split_special_tokens=True)
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return [head + list(ids) for ids in out["input_ids"]]

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of text rendered by a chat template: special-token strings in it become their
        ids and nothing is added (the template already holds BOS where the model wants it)."""
        return list(self.hf(text, add_special_tokens=False, split_special_tokens=False)
                    ["input_ids"])

    @property
    def chat_template(self) -> str | None:
        """The tokenizer's own chat template (Jinja text), None when it has none."""
        template = getattr(self.hf, "chat_template", None)
        return template if isinstance(template, str) and template.strip() else None

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids (no BOS) and each token's [start, end) character span in `text`."""
        out = self.hf(text, add_special_tokens=False, split_special_tokens=True,
                      return_offsets_mapping=True)
        return list(out["input_ids"]), [tuple(o) for o in out["offset_mapping"]]

    def decode(self, ids) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=True)

    def fingerprint(self) -> str:
        """Stable hash of the vocabulary (token -> id) and BOS/EOS ids.

        Two tokenizers with the same fingerprint give token ids the same meaning, which is
        what a draft and a target must share.
        """
        vocab = sorted(self.hf.get_vocab().items(), key=lambda kv: kv[1])
        blob = json.dumps({"vocab": vocab, "bos": self.bos_id, "eos": self.eos_id},
                          ensure_ascii=False, separators=(",", ":"))
        return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def load_tokenizer(path: str) -> Tokenizer:
    """Load a local tokenizer directory (no hub): Llama `tokenizer.model` or `tokenizer.json`;
    or the tokenizer in a `.gguf` file's metadata."""
    from s2d_jax import validate
    path = expand_path(validate.path(path, "path"))
    if path.lower().endswith(".gguf"):  # a llama.cpp model file carries its tokenizer
        from s2d_jax.io.gguf import gguf_tokenizer
        hf = gguf_tokenizer(path)
        pad = hf.pad_token_id if hf.pad_token_id is not None else (hf.eos_token_id or 0)
        return Tokenizer(hf=hf, path=path, bos_id=hf.bos_token_id, eos_id=hf.eos_token_id,
                         pad_id=pad)
    if not os.path.isdir(path) and not os.path.isabs(path):
        # Defaults such as "assets/llama2_tokenizer" name the repository's own copy.
        in_repo = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
        path = in_repo if os.path.isdir(in_repo) else path
    if not os.path.isdir(path):
        raise S2DError(f"tokenizer directory {path!r} does not exist; pass a local directory "
                       "holding tokenizer.model or tokenizer.json")
    sp_file = os.path.join(path, "tokenizer.model")
    has_json = os.path.isfile(os.path.join(path, "tokenizer.json"))
    if not os.path.isfile(sp_file) and not has_json:
        raise S2DError(f"tokenizer directory {path!r} has neither tokenizer.model nor "
                       "tokenizer.json; point data.tokenizer at a tokenizer directory")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "config.json"):  # transformers reads them all: say which one is broken
        file = os.path.join(path, name)
        try:
            if os.path.isfile(file) and not isinstance(read_json(file, name), dict):
                raise S2DError(f"{name} {file} is not a JSON object; fix or re-export it")
        except S2DError as e:
            raise S2DError(f"cannot load the tokenizer in {path!r}: {e}") from None
    try:
        hf = _from_pretrained(path)
    except Exception as e:  # transformers raises many types for unreadable files
        raise S2DError(f"cannot load the tokenizer in {path!r}: {type(e).__name__}: "
                       f"{str(e).splitlines()[0] if str(e) else ''}") from e
    if not getattr(hf, "is_fast", False) or not hasattr(hf, "backend_tokenizer"):
        raise S2DError(f"tokenizer in {path!r} did not load as a fast (tokenizers) tokenizer; "
                       "provide tokenizer.json or a Llama tokenizer.model")
    if os.path.isfile(sp_file):
        sp = _llama_sentencepiece(sp_file)
        if sp is not None:
            hf = _sentencepiece_exact(hf, sp, path)
        elif not has_json:
            raise S2DError(f"{sp_file} is not a Llama-style sentencepiece BPE model "
                           "(identity normalizer, dummy prefix); provide a tokenizer.json")
    bos, eos = hf.bos_token_id, hf.eos_token_id
    pad = hf.pad_token_id if hf.pad_token_id is not None else (eos if eos is not None else 0)
    return Tokenizer(hf=hf, path=path, bos_id=bos, eos_id=eos, pad_id=pad)


_BOM = b"\xef\xbb\xbf"


def _from_pretrained(path: str):
    """transformers' fast tokenizer of `path`. transformers and tokenizers refuse a JSON
    file that starts with a UTF-8 byte order mark (some Windows editors write one), which
    every reader of ours ignores: such a dir is loaded from a temporary view of it, the
    marks stripped and every other file linked, so the user's files stay as they are."""
    import shutil
    import tempfile

    def load(d):
        if _plain_fast(d):  # what AutoTokenizer would build, without its imports (torch: ~3 s)
            light = _LightFast.load(d)  # without transformers at all (its import: ~1 s)
            if light is not None:
                return light
            from transformers import PreTrainedTokenizerFast
            return PreTrainedTokenizerFast.from_pretrained(d, local_files_only=True)
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(d, local_files_only=True, use_fast=True)

    marked = []
    for name in os.listdir(path):
        file = os.path.join(path, name)
        if name.endswith(".json") and os.path.isfile(file):
            with open(file, "rb") as f:
                if f.read(3) == _BOM:
                    marked.append(name)
    if not marked:
        return load(path)
    with tempfile.TemporaryDirectory(prefix="s2d-tokenizer-") as view:
        for name in os.listdir(path):
            file = os.path.join(os.path.abspath(path), name)
            if name in marked:
                with open(file, "rb") as src, open(os.path.join(view, name), "wb") as dst:
                    src.read(3)
                    shutil.copyfileobj(src, dst)
            elif os.path.isfile(file):
                os.symlink(file, os.path.join(view, name))
        return load(view)


# the tokenizer_class values for which AutoTokenizer builds PreTrainedTokenizerFast itself
# (transformers 5 names it TokenizersBackend): no model-specific class to look up
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _plain_fast(path: str) -> bool:
    """Whether `path` is a tokenizer.json whose config names the plain fast class, so that
    PreTrainedTokenizerFast loads it as AutoTokenizer does: importing AutoTokenizer imports
    every model's config and, where installed, torch (2.5 s of a 10 s warm start)."""
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(os.path.join(path, "tokenizer.json")) or not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8-sig") as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False  # AutoTokenizer then says what is wrong
    return cls in _PLAIN_FAST


# tokenizer_config.json keys _LightFast reads, or knows to change nothing it uses; any other
# key (add_bos_token, add_prefix_space, ...) makes transformers load the tokenizer
_LIGHT_KEYS = {"backend", "tokenizer_class", "bos_token", "eos_token", "unk_token", "pad_token",
               "sep_token", "cls_token", "mask_token", "chat_template", "model_max_length",
               "added_tokens_decoder", "clean_up_tokenization_spaces", "is_local",
               "local_files_only", "model_input_names", "padding_side", "truncation_side"}
_NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
          "mask_token")  # transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order


class _LightFast:
    """What `Tokenizer` uses of transformers' PreTrainedTokenizerFast, on the `tokenizers`
    backend alone, for a plain tokenizer.json dir (`_plain_fast`) whose config holds nothing
    transformers would change the backend for (`_LIGHT_KEYS`, string tokens, no other
    tokenizer files): importing transformers is ~1 s of a warm start's 3 s. Ids, decoded
    text and rendered chat templates equal transformers' (tests/test_tokenizer_light.py);
    `load` returns None where they might not, and transformers loads the tokenizer."""

    is_fast = True

    def __init__(self, backend, config: dict, chat_template: str | None):
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = {k: config[k] for k in _NAMED if config.get(k) is not None}
        for name in _NAMED:
            token = self.special_tokens_map.get(name)
            setattr(self, name, token)
            setattr(self, name + "_id", None if token is None else backend.token_to_id(token))
        self.added_tokens_decoder = backend.get_added_tokens_decoder()
        self.all_special_ids = list(dict.fromkeys(  # transformers': each id once
            getattr(self, n + "_id") for n in _NAMED if getattr(self, n + "_id") is not None))

    @classmethod
    def load(cls, path: str):
        """The tokenizer of `path`, or None where transformers must load it."""
        if any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES
               if f not in ("tokenizer.json", "tokenizer_config.json", "generation_config.json")):
            return None  # special_tokens_map.json, a chat_template file, tokenizer.model ...
        try:
            with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
                config = json.load(f)
            if not isinstance(config, dict) or set(config) - _LIGHT_KEYS:
                return None
            if any(config.get(k) is not None and not isinstance(config[k], str)
                   for k in (*_NAMED, "chat_template")):
                return None  # AddedToken dicts, named templates: transformers' own reading
            from tokenizers import Tokenizer as Backend
            backend = Backend.from_file(os.path.join(path, "tokenizer.json"))
        except Exception:  # noqa: BLE001 - transformers then says what is wrong
            return None
        if re.search(r"\{%-?\s*(end)?generation\b", config.get("chat_template") or ""):
            return None  # transformers' own Jinja extension renders {% generation %}
        if config.get("clean_up_tokenization_spaces") and \
                type(backend.model).__name__ != "BPE":  # transformers cleans up all but BPE
            return None
        added = {int(i): t.get("content") if isinstance(t, dict) else None
                 for i, t in (config.get("added_tokens_decoder") or {}).items()}
        have = backend.get_added_tokens_decoder()
        if any(i not in have or have[i].content != c for i, c in added.items()):
            return None  # the config adds tokens: transformers adds them to the backend
        if any(config.get(k) is not None and backend.token_to_id(config[k]) is None
               for k in _NAMED):
            return None  # a special token the vocabulary lacks: transformers adds it
        backend.no_padding()
        backend.no_truncation()
        return cls(backend, config, config.get("chat_template"))

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def __call__(self, text, add_special_tokens: bool = False,
                 split_special_tokens: bool = False, return_offsets_mapping: bool = False):
        batch = not isinstance(text, str)
        backend = self.backend_tokenizer
        backend.encode_special_tokens = split_special_tokens
        try:
            encs = backend.encode_batch(list(text) if batch else [text],
                                        add_special_tokens=add_special_tokens)
        finally:
            backend.encode_special_tokens = False
        out = {"input_ids": [e.ids for e in encs]}
        if return_offsets_mapping:
            out["offset_mapping"] = [e.offsets for e in encs]
        return out if batch else {k: v[0] for k, v in out.items()}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages, add_generation_prompt: bool = False,
                            tokenize: bool = False, **kwargs) -> str:
        """transformers' rendering (utils/chat_template_utils.py: the same sandboxed Jinja
        environment, filters and globals, the named special tokens as variables)."""
        if tokenize:
            raise S2DError("the light tokenizer renders chat templates as text only")
        return _jinja_template(self.chat_template).render(
            messages=[dict(m) for m in messages], tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **{**self.special_tokens_map, **kwargs})


@functools.lru_cache(maxsize=8)
def _jinja_template(text: str):
    """A chat template compiled as transformers compiles it (its AssistantTracker
    extension aside: `{% generation %}` blocks are for training masks)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        import datetime
        return datetime.datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore-prefixed attributes ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(text)


def _llama_sentencepiece(sp_file: str):
    """The SentencePieceProcessor if `sp_file` is a Llama-style BPE model, else None."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    try:
        proto = pb.ModelProto()
        with open(sp_file, "rb") as f:
            proto.ParseFromString(f.read())
    except Exception as e:
        raise S2DError(f"cannot read sentencepiece model {sp_file} ({e}); re-download "
                       f"it") from e
    t, n = proto.trainer_spec, proto.normalizer_spec
    llama_style = (t.model_type == pb.TrainerSpec.BPE and n.name == "identity"
                   and n.add_dummy_prefix and not n.remove_extra_whitespaces
                   and not t.treat_whitespace_as_suffix)
    return spm.SentencePieceProcessor(model_file=sp_file) if llama_style else None


def _sentencepiece_exact(hf, sp, path: str):
    """A copy of `hf` whose ids equal `sp.encode` (see the module docstring)."""
    from tokenizers import Regex, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(hf.backend_tokenizer.to_str())
    model = spec["model"]
    n = sp.get_piece_size()
    if model.get("type") != "BPE" or any(model["vocab"].get(sp.id_to_piece(i)) != i
                                          for i in range(n)):
        raise S2DError(f"tokenizer files in {path!r} disagree with its tokenizer.model "
                       "(vocabulary differs); remove the stale tokenizer.json")
    score = {sp.id_to_piece(i): sp.get_score(i) for i in range(n)}
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    # Stable sort: highest score of the merged piece first, as sentencepiece picks merges.
    model["merges"] = sorted(merges, key=lambda m: -score.get(m[0] + m[1], -1e30))
    backend = Backend.from_str(json.dumps(spec))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(_SP_WORD), behavior="isolated")
    exact = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=hf.bos_token, eos_token=hf.eos_token,
        unk_token=hf.unk_token, pad_token=hf.pad_token,
        clean_up_tokenization_spaces=False)  # sentencepiece's decode does no clean-up
    exact.chat_template = getattr(hf, "chat_template", None)  # a -chat model keeps its own
    for text in _PROBES:
        got = exact(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        if list(got) != sp.encode(text):
            raise S2DError(f"tokenizer in {path!r} cannot reproduce sentencepiece on {text!r}; "
                           "this tokenizer.model is not supported")
    return exact
