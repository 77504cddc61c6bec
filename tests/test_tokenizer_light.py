"""The light tokenizer (io/tokenizer.py `_LightFast`: tokenizer.json on `tokenizers` alone,
chat templates on jinja2, no transformers import) gives transformers' ids, text and rendered
templates, and leaves every tokenizer it might not match to transformers."""

import json
import os
import shutil

import pytest

from s2d_jax.io import tokenizer as tokmod

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "models", "demo", "draft")
SMOLLM2 = os.path.expanduser("~/.cache/s2d-jax/SmolLM2-135M-Instruct")
TEXTS = ["", " ", "Hello world", "a  b", "  leading", "x   ", "def f():\n    return 1\n",
         "h\u00e9llo \u4e16\u754c \U0001F916", "</s> <s> <unk> stay text", "12  345\t x\r\n",
         "<|im_start|>user\nhi<|im_end|>\n", "ROMEO: What, ho! " * 20]
# a template with what transformers' environment offers: its globals, filters, loop controls
TEMPLATE = ("{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{% if m['role'] == 'system' %}{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}"
            "{{ m['role'] | upper }}: {{ m['content'] | trim }}{{ eos_token }}\n"
            "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}"
            "{% endif %}{% endfor %}{{ {'n': ns.n, 'x': 'é<>'} | tojson }}"
            "{% if tools is defined and tools is none %}[no tools]{% endif %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": " Hi! "},
            {"role": "assistant", "content": "Hello</s>"}, {"role": "user", "content": "Why?"}]


def _transformers(path):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)


def _dirs():
    yield DEMO
    if os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")):
        yield SMOLLM2


@pytest.mark.parametrize("path", list(_dirs()))
def test_ids_text_and_specials_equal_transformers(path):
    light, ref = tokmod._LightFast.load(path), _transformers(path)
    assert light is not None, path
    assert len(light) == len(ref) and light.get_vocab() == ref.get_vocab()
    for name in tokmod._NAMED:
        assert getattr(light, name + "_id") == getattr(ref, name + "_id"), name
    assert light.all_special_ids == ref.all_special_ids
    assert set(light.all_special_ids) | set(light.added_tokens_decoder) == \
        set(ref.all_special_ids) | {int(i) for i in ref.added_tokens_decoder}
    for split in (True, False):
        kw = dict(add_special_tokens=False, split_special_tokens=split)
        for text in TEXTS:
            got, want = light(text, **kw), ref(text, **kw)
            assert got["input_ids"] == list(want["input_ids"]), (text, split)
        assert light(TEXTS, **kw)["input_ids"] == [list(x) for x in ref(TEXTS, **kw)["input_ids"]]
    got = light(TEXTS[7], add_special_tokens=False, split_special_tokens=True,
                return_offsets_mapping=True)
    want = ref(TEXTS[7], add_special_tokens=False, split_special_tokens=True,
               return_offsets_mapping=True)
    assert [tuple(o) for o in got["offset_mapping"]] == [tuple(o) for o in want["offset_mapping"]]
    ids = [i for text in TEXTS for i in ref(text, add_special_tokens=False)["input_ids"]]
    ids += sorted(light.added_tokens_decoder)[:5] + [light.eos_token_id]
    for skip in (True, False):
        assert light.decode(ids, skip_special_tokens=skip) == \
            ref.decode(ids, skip_special_tokens=skip)


def test_the_tokenizer_object_loads_without_transformers():
    tok = tokmod.load_tokenizer(DEMO)
    assert isinstance(tok.hf, tokmod._LightFast)
    assert tok.decode(tok.encode("ROMEO: hi", bos=False)) == "ROMEO: hi"


@pytest.mark.skipif(not os.path.isfile(os.path.join(SMOLLM2, "tokenizer.json")),
                    reason="SmolLM2 not fetched (python -m infer.fetch_smollm2)")
def test_smollm2_chat_template_renders_as_transformers():
    light, ref = tokmod._LightFast.load(SMOLLM2), _transformers(SMOLLM2)
    for gen in (True, False):
        assert light.apply_chat_template(MESSAGES, add_generation_prompt=gen) == \
            ref.apply_chat_template(MESSAGES, add_generation_prompt=gen, tokenize=False)


def _dir_with(tmp_path, **config):
    d = tmp_path / "tok"
    d.mkdir()
    shutil.copy(os.path.join(DEMO, "tokenizer.json"), d)
    base = json.load(open(os.path.join(DEMO, "tokenizer_config.json")))
    (d / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return str(d)


def test_a_template_renders_as_transformers(tmp_path):
    path = _dir_with(tmp_path, chat_template=TEMPLATE, pad_token="</s>")
    light, ref = tokmod._LightFast.load(path), _transformers(path)
    assert light is not None and light.all_special_ids == ref.all_special_ids
    for gen in (True, False):
        got = light.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert got == ref.apply_chat_template(MESSAGES, add_generation_prompt=gen,
                                              tokenize=False)
        assert "[no tools]" in got and "\\u" not in got
    bad = MESSAGES + [{"role": "tool", "content": "x"}]
    for tok in (light, ref):
        with pytest.raises(Exception, match="bad role"):
            tok.apply_chat_template(bad, tokenize=False)


@pytest.mark.parametrize("config", [{"add_bos_token": True}, {"add_prefix_space": True},
                                    {"bos_token": {"content": "<s>", "special": True}},
                                    {"pad_token": "<a token the vocabulary lacks>"},
                                    {"chat_template": "{% generation %}x{% endgeneration %}"}])
def test_what_transformers_might_read_otherwise_goes_to_transformers(tmp_path, config):
    path = _dir_with(tmp_path, **config)
    assert tokmod._LightFast.load(path) is None
    if not isinstance(config.get("bos_token", ""), dict):  # which transformers 5 refuses
        assert not isinstance(tokmod.load_tokenizer(path).hf, tokmod._LightFast)


def test_another_tokenizer_file_goes_to_transformers(tmp_path):
    path = _dir_with(tmp_path)
    assert tokmod._LightFast.load(path) is not None
    (tmp_path / "tok" / "special_tokens_map.json").write_text("{}")
    assert tokmod._LightFast.load(path) is None
