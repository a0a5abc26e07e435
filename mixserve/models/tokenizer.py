"""A model's tokenizer on `tokenizers` alone, with transformers loaded only when something needs it.

Importing transformers and building its tokenizer cost ~2.2 s of a warm 0.5B start on 2 cores;
`tokenizers.Tokenizer.from_file` costs ~0.3 s (issue 32: "warm starts import only what they use").
The engine's hot calls (encode a prompt, decode output, token strings for logprobs, the vocabulary
size) are the Rust tokenizer's own, so they run here directly. Everything else (the chat template,
whose rendering transformers owns, and any attribute of an HF tokenizer not defined here) is
delegated to the HF tokenizer of the same folder, loaded on first use: a command that never uses
the chat template never imports transformers for it.

Only folders whose tokenizer_config.json asks for nothing beyond tokenizer.json (no BOS/EOS or
prefix-space switches, no clean-up of decoded spaces) get this class; `load_tokenizer` gives the
others transformers' tokenizer. tests/integration/test_real_models.py checks both real models
against transformers' tokenizer, call by call.
"""
from __future__ import annotations

import json
import threading
from pathlib import Path

# tokenizer_config.json keys through which transformers changes what tokenizer.json alone does
_CHANGES_BEHAVIOUR = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "clean_up_tokenization_spaces",
                      "do_lower_case", "split_special_tokens")


def _token_text(v) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict with `content`."""
    if isinstance(v, dict):
        return v.get("content")
    return v if isinstance(v, str) else None


class Tokenizer:
    """The subset of a transformers tokenizer the engine calls, on `tokenizers.Tokenizer`.

    encode(text, add_special_tokens=True) -> list[int]; tok(text, add_special_tokens=...) ->
    {"input_ids": list[int]}; decode(ids, skip_special_tokens=False) -> str;
    convert_ids_to_tokens(int | list[int]) -> str | list[str]; len(tok): vocabulary size with the
    added tokens; eos_token(_id), bos_token(_id), pad_token(_id); chat_template: the template's
    text or None. Any other attribute (apply_chat_template, ...) is the HF tokenizer's, loaded
    from the same folder on first use (`hf`). Like an HF fast tokenizer, one instance must not be
    used from two threads at once (the Rust object's "Already borrowed").
    """

    def __init__(self, folder: str | Path, config: dict):
        from tokenizers import Tokenizer as RustTokenizer

        self.name_or_path = str(folder)
        self._folder = Path(folder)
        self._tok = RustTokenizer.from_file(str(self._folder / "tokenizer.json"))
        self._config = config
        self._hf = None
        self._hf_lock = threading.Lock()
        for name in ("eos", "bos", "pad", "unk"):
            text = _token_text(config.get(f"{name}_token"))
            setattr(self, f"{name}_token", text)
            setattr(self, f"{name}_token_id", self._tok.token_to_id(text) if text is not None else None)
        template = config.get("chat_template")
        path = self._folder / "chat_template.jinja"
        if template is None and path.exists():
            template = path.read_text(encoding="utf-8")
        self.chat_template = template

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer | None:
        """The light tokenizer of an HF folder, or None where transformers' own is needed (no
        tokenizer.json, or a tokenizer_config.json key that changes what tokenizer.json does)."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").exists():
            return None
        try:
            config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        except FileNotFoundError:
            config = {}
        except (OSError, ValueError):
            return None  # transformers reports what is wrong with it
        if not isinstance(config, dict) or any(config.get(k) for k in _CHANGES_BEHAVIOUR):
            return None
        return cls(folder, config)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (str), special tokens written in it recognised as such."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        if not isinstance(text, str):
            return self.hf(text, add_special_tokens=add_special_tokens)
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a list of ints or an int)."""
        if isinstance(ids, int):
            ids = [ids]
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids):
        """The vocabulary string of an id, or of each id in a list (None for an unknown id)."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(i) for i in ids]

    def __len__(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def hf(self):
        """transformers' tokenizer of the same folder, loaded on first use (~2 s)."""
        with self._hf_lock:
            if self._hf is None:
                from transformers import AutoTokenizer

                self._hf = AutoTokenizer.from_pretrained(str(self._folder))
            return self._hf

    def prepare_chat_template(self) -> None:
        """Load what apply_chat_template needs (transformers' tokenizer) now, where a template exists."""
        if self.chat_template:
            self.hf  # noqa: B018 (the load is the point)

    def __getattr__(self, name):
        if name.startswith("_"):  # never for our own fields (copy, pickle, half-made instances)
            raise AttributeError(name)
        return getattr(self.hf, name)


def load_tokenizer_folder(folder: str | Path):
    """The tokenizer of an HF folder: `Tokenizer` where tokenizer.json is enough, else
    transformers' AutoTokenizer. Raises what AutoTokenizer raises for a folder it cannot read."""
    tok = Tokenizer.from_folder(folder)
    if tok is not None:
        return tok
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))
