"""models/tokenizer.py: the engine's tokenizer on `tokenizers` alone, transformers' where needed."""
import json
import shutil

from mixserve.models.tokenizer import Tokenizer, load_tokenizer_folder
from mixserve.models.weights import gguf_meta_dir
from tests.tiny_gguf import write_float_gguf


def _folder(tmp_path):
    return gguf_meta_dir(write_float_gguf(tmp_path / "m.gguf", tokenizer=True))


def test_light_where_tokenizer_json_is_enough_and_delegates_the_rest(tmp_path):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path)
    tok = load_tokenizer_folder(folder)
    hf = AutoTokenizer.from_pretrained(str(folder))
    assert isinstance(tok, Tokenizer) and tok._hf is None
    for text in ("ab", "abba cab", ""):
        assert tok.encode(text) == hf.encode(text) and tok(text)["input_ids"] == hf(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text))
    assert len(tok) == len(hf) and tok.eos_token_id == hf.eos_token_id
    assert tok._hf is None, "an engine call loaded transformers' tokenizer"
    assert tok.get_vocab() == hf.get_vocab()  # not ours: transformers', loaded on first use
    assert tok._hf is not None


def test_a_config_that_changes_behaviour_gets_transformers_tokenizer(tmp_path):
    folder = _folder(tmp_path)
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    cfg = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True}))
    assert Tokenizer.from_folder(copy) is None
    assert not isinstance(load_tokenizer_folder(copy), Tokenizer)
    (copy / "tokenizer_config.json").write_text("{not json")
    assert Tokenizer.from_folder(copy) is None  # transformers says what is wrong with it
    (copy / "tokenizer.json").unlink()
    assert Tokenizer.from_folder(copy) is None


def test_prepare_chat_template_loads_transformers_only_where_a_template_exists(tmp_path):
    tok = load_tokenizer_folder(_folder(tmp_path))
    tok.chat_template = None
    tok.prepare_chat_template()
    assert tok._hf is None
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tok.prepare_chat_template()
    assert tok._hf is not None
