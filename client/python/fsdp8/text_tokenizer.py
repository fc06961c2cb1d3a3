"""A real tokenizer for fsdp8-prepare: a Hugging Face tokenizer.json (the `tokenizers` package) or a
SentencePiece model (the `sentencepiece` package), with the ids of its document separators.

Which kind: a directory is read as its tokenizer.json, else its tokenizer.model; a file ending in
.json is a Hugging Face tokenizer, one ending in .model a SentencePiece model; any other file is a
Hugging Face tokenizer when it starts with '{', else a SentencePiece model.

Separators, each document becoming [BOS] + tokens + [EOS]:
  EOS  --eos-token TOKEN if given; else, for a Hugging Face tokenizer, "eos_token" of
       tokenizer_config.json (then special_tokens_map.json) beside the tokenizer file, else the
       first of its special tokens named <|end_of_text|>, <|endoftext|>, </s>, <eos>; for
       SentencePiece, the model's eos id. No EOS at all is an error (TokenizerError).
  BOS  --bos-token TOKEN if given; else the same sources ("bos_token"; <|begin_of_text|>,
       <|startoftext|>, <s>, <bos>; the model's bos id). A BOS equal to the EOS (GPT-2's
       <|endoftext|>) or --no-bos means none: documents are then separated by the EOS alone.
A token given by name must be in the vocabulary.
  PAD  (not written into the shards; recorded for exports) "pad_token" of the config files, else
       the special token <pad>, <|pad|> or [PAD]; for SentencePiece, the model's pad id; else none.

Encoding adds no special tokens of the tokenizer's own (no template), and text that spells a
special token ("<|endoftext|>" inside a document) is encoded as plain text, not as that token.

Thread-safety: a TextTokenizer is used by one thread; each worker process loads its own.
"""
import json
import os

EOS_NAMES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
BOS_NAMES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>")
PAD_NAMES = ("<pad>", "<|pad|>", "[PAD]")
HF_CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class TokenizerError(Exception):
    """A tokenizer that cannot be used; the message names the file and what is wrong."""


def resolve_path(path):
    """The tokenizer file of path: a file, or a directory's tokenizer.json or tokenizer.model."""
    if os.path.isdir(path):
        for name in ("tokenizer.json", "tokenizer.model"):
            if os.path.isfile(os.path.join(path, name)):
                return os.path.join(path, name)
        raise TokenizerError(f"{path}: directory holds neither tokenizer.json nor tokenizer.model")
    if not os.path.isfile(path):
        raise TokenizerError(f"{path}: no such file")
    return path


def kind_of(path):
    """'hf' or 'sentencepiece' for a tokenizer file (rules in the module doc)."""
    if path.endswith(".json"):
        return "hf"
    if path.endswith(".model"):
        return "sentencepiece"
    with open(path, "rb") as f:
        return "hf" if f.read(64).lstrip().startswith(b"{") else "sentencepiece"


class TextTokenizer:
    """Loads the tokenizer at path (see the module doc). Attributes: path, kind ('hf' or
    'sentencepiece'), vocab_size (largest id + 1), eos_id, bos_id and pad_id (None when there is
    none).
    Raises TokenizerError naming the file."""

    def __init__(self, path, eos_token=None, bos_token=None, no_bos=False):
        self.path = resolve_path(path)
        self.kind = kind_of(self.path)
        try:
            if self.kind == "hf":
                self._load_hf()
            else:
                self._load_sentencepiece()
        except TokenizerError:
            raise
        except ImportError as e:
            raise TokenizerError(f"{self.path}: {e} (pip install 'fsdp8-client[prepare]')") from e
        except Exception as e:  # the libraries raise their own types for unreadable files
            what = "Hugging Face tokenizer.json" if self.kind == "hf" else "SentencePiece model"
            raise TokenizerError(f"{self.path}: not a readable {what}: {e}") from e
        self.eos_id = self._pick(eos_token, "eos")
        self.bos_id = None if no_bos else self._pick(bos_token, "bos")
        if self.eos_id is None:
            raise TokenizerError(
                f"{self.path}: the tokenizer has no end-of-text token (none in its config or "
                f"special tokens); name one with --eos-token TOKEN")
        if self.bos_id == self.eos_id:
            self.bos_id = None
        self.pad_id = self._pad()

    def encode(self, texts):
        """Token ids (lists of int) of each text, without special tokens of the tokenizer's own."""
        if self.kind == "hf":
            return [e.ids for e in self._hf.encode_batch(texts, add_special_tokens=False)]
        return self._sp.encode(texts, out_type=int)

    def decode(self, ids):
        """The text of token ids (special tokens included)."""
        if self.kind == "hf":
            return self._hf.decode(ids, skip_special_tokens=False)
        return self._sp.decode(ids)

    def token_name(self, token_id):
        """The vocabulary entry of token_id (for messages)."""
        if self.kind == "hf":
            return self._hf.id_to_token(token_id)
        return self._sp.id_to_piece(token_id)

    # --- loading -------------------------------------------------------------------------------
    def _load_hf(self):
        from tokenizers import Tokenizer
        self._hf = Tokenizer.from_file(self.path)
        if hasattr(self._hf, "encode_special_tokens"):
            self._hf.encode_special_tokens = True  # "<|endoftext|>" in a text stays text
        self.vocab_size = max(self._hf.get_vocab(with_added_tokens=True).values()) + 1
        self._specials = {t.content: i for i, t in self._hf.get_added_tokens_decoder().items()
                          if t.special}

    def _load_sentencepiece(self):
        import sentencepiece
        self._sp = sentencepiece.SentencePieceProcessor(model_file=self.path)
        self.vocab_size = self._sp.get_piece_size()

    # --- separators ----------------------------------------------------------------------------
    def _pick(self, flag_token, which):
        """The id of the EOS or BOS (which: 'eos'/'bos'): from the flag, else the tokenizer."""
        if flag_token is not None:
            token_id = self._id_of(flag_token)
            if token_id is None:
                raise TokenizerError(f"--{which}-token: {flag_token!r} is not in the vocabulary of "
                                     f"{self.path}")
            return token_id
        if self.kind == "sentencepiece":
            token_id = self._sp.eos_id() if which == "eos" else self._sp.bos_id()
            return token_id if token_id >= 0 else None
        configured, found = self._hf_config_token(which)
        if found:
            if configured is None:
                return None
            token_id = self._id_of(configured)
            if token_id is None:
                raise TokenizerError(f"{self.path}: {which}_token {configured!r} of its config "
                                     f"is not in the vocabulary; name one with --{which}-token")
            return token_id
        for name in EOS_NAMES if which == "eos" else BOS_NAMES:
            if name in self._specials:
                return self._specials[name]
        return None

    def _pad(self):
        """The padding token's id (module doc), or None."""
        if self.kind == "sentencepiece":
            token_id = self._sp.pad_id()
            return token_id if token_id >= 0 else None
        configured, found = self._hf_config_token("pad")
        if found:
            return None if configured is None else self._id_of(configured)
        for name in PAD_NAMES:
            if name in self._specials:
                return self._specials[name]
        return None

    def hf_config(self):
        """tokenizer_config.json beside a Hugging Face tokenizer file as a dict ({} when there is
        none or it is not an object)."""
        if self.kind != "hf":
            return {}
        config = os.path.join(os.path.dirname(os.path.abspath(self.path)), HF_CONFIG_FILES[0])
        try:
            with open(config, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{config}: not readable JSON: {e}") from e
        return data if isinstance(data, dict) else {}

    def _hf_config_token(self, which):
        """(token or None, found): '<which>_token' of the first config file beside the tokenizer
        that has the key."""
        key = which + "_token"
        for name in HF_CONFIG_FILES:
            config = os.path.join(os.path.dirname(os.path.abspath(self.path)), name)
            if not os.path.isfile(config):
                continue
            try:
                with open(config, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{config}: not readable JSON: {e}") from e
            if isinstance(data, dict) and key in data:
                value = data[key]
                if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
                    value = value.get("content")
                return (value if isinstance(value, str) else None), True
        return None, False

    def _id_of(self, token):
        if self.kind == "hf":
            return self._hf.token_to_id(token)
        token_id = self._sp.piece_to_id(token)
        return token_id if self._sp.id_to_piece(token_id) == token else None
