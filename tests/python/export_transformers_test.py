"""`fsdp8 export` read by Hugging Face transformers: an export loads as the job was trained.

Real processes: `fsdp8-prepare` with a byte-level BPE tokenizer.json trained here (the `tokenizers`
package; its special tokens put the EOS at id 0, the padding token at 1 and the BOS at 3, none of
them LlamaConfig's defaults bos 1 / eos 2), a coordinator and a CPU worker, jobs submitted and
exported with the `fsdp8` CLI. The expected ids come from the tokenizer itself and from the shards
the job trained on (every document ends with the EOS), never from fsdp8's record of them:
  - AutoTokenizer, AutoConfig and GenerationConfig of the export report those bos/eos/pad ids, and
    loading them logs no transformers warning (LlamaForCausalLM too when torch is installed);
  - a job initialised from a Hugging Face directory whose config.json has Llama 3.1's
    max_position_embeddings 131072 and llama3 rope_scaling exports them unchanged (a job trained
    from scratch gets its seq_len);
  - a byte-level corpus (`fsdp8 prepare`) has no special tokens: the export's config.json says
    null, not transformers' defaults.
Run: python3 export_transformers_test.py (PYTHONPATH: the installed SDK; FSDP8_BIN_DIR: binaries).
"""
import contextlib
import glob
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import unittest
import warnings

import numpy as np

import cluster

SEQ = 32
EOS, PAD, BOS = "<|endoftext|>", "<|pad|>", "<|begin_of_text|>"
# Llama 3.1's position range and RoPE scaling (its published config.json).
LLAMA31_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"}
LLAMA31_MAX_POS = 131072


def fsdp8(*args, timeout=300):
    r = subprocess.run([os.path.join(cluster.BIN, "fsdp8"), *args], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise AssertionError(f"fsdp8 {' '.join(args)}: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r.stdout


def train_tokenizer(texts, path):
    """A byte-level BPE (GPT-2 / Llama 3 style) whose specials take ids 0..3 in this order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=[EOS, PAD, "<|unused|>", BOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(path)
    return tok


def shard_tokens(path):
    """The tokens of an llm.c shard, read from its header (uint16, magic 20240520)."""
    with open(path, "rb") as f:
        raw = f.read()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert (header[0], header[1]) == (20240520, 1), header[:3]
    return np.frombuffer(raw[1024:], dtype="<u2")


@contextlib.contextmanager
def transformers_warnings():
    """Collects what transformers logs at WARNING or above and every Python warning raised."""
    import transformers
    records = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(f"{record.name}: {record.getMessage()}")

    handler = Collect(level=logging.WARNING)
    transformers.logging.set_verbosity_warning()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield records
        records.extend(f"{w.category.__name__}: {w.message}" for w in caught)
    finally:
        root.removeHandler(handler)


def torch_available():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


class ExportTransformersTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        with contextlib.redirect_stderr(io.StringIO()):  # "PyTorch was not found" on import
            import transformers  # noqa: F401  (a missing package fails the test, not skips it)
        cls.cluster = cluster.Cluster(workers=1)
        cls.root = cls.cluster.data
        try:
            cls._prepare_bpe()
            cls.cluster.start()
        except Exception:
            cls.cluster.cleanup(keep=True)
            raise

    @classmethod
    def _prepare_bpe(cls):
        texts = []
        for path in cluster.fortunes_files()[:6]:
            with open(path, encoding="utf-8", errors="replace") as f:
                texts += [t.strip() for t in f.read().split("\n%\n") if t.strip()]
        texts = texts[:400]
        tokdir = os.path.join(cls.root, "tok-src")
        os.makedirs(tokdir)
        cls.tok = train_tokenizer(texts, os.path.join(tokdir, "tokenizer.json"))
        cls.eos, cls.pad, cls.bos = (cls.tok.token_to_id(t) for t in (EOS, PAD, BOS))
        assert (cls.eos, cls.pad, cls.bos) == (0, 1, 3), (cls.eos, cls.pad, cls.bos)
        cls.vocab = cls.tok.get_vocab_size()
        corpus = os.path.join(cls.root, "docs.jsonl")
        with open(corpus, "w", encoding="utf-8") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
        cls.bpe = os.path.join(cls.root, "bpe")
        r = subprocess.run([sys.executable, "-m", "fsdp8.prepare", "--tokenizer",
                            os.path.join(tokdir, "tokenizer.json"), "--out", cls.bpe,
                            "--workers", "1", "--val-fraction", "0.1", corpus],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        # The id training used: every document of the shards ends with it.
        train = np.concatenate([shard_tokens(p)
                                for p in sorted(glob.glob(os.path.join(cls.bpe, "train_*.bin")))])
        assert train[-1] == cls.eos and train[0] == cls.bos, (train[:3], train[-3:])
        assert int(np.sum(train == cls.eos)) == int(np.sum(train == cls.bos)) > 100

    @classmethod
    def tearDownClass(cls):
        failed = getattr(cls, "_failed", False)
        if failed:
            print(cls.cluster.dump_logs(), file=sys.stderr)
        cls.cluster.cleanup(keep=failed)

    def run(self, result=None):
        r = super().run(result)
        if result is not None and (result.failures or result.errors):
            type(self)._failed = True
        return r

    def train_and_export(self, name, model_extra=None, init=None, data=None, vocab=None):
        """Submits a 3-step job with the CLI, waits for it, exports it: the export's directory."""
        model = {"d_model": 32, "n_layers": 1, "n_heads": 2, "ffn_dim": 64,
                 "vocab_size": vocab or self.vocab, "seq_len": SEQ}
        model.update(model_extra or {})
        data = data or self.bpe
        spec = {"name": name, "backend": "cpu", "model": model,
                "data": {"train_path": os.path.join(data, "train_*.bin") if data == self.bpe
                         else os.path.join(data, "train.bin")},
                "training": {"steps": 3, "global_batch": 2, "seed": 5, "eval_every": 0},
                "sharding": {"min_workers": 1, "max_workers": 1},
                "checkpoint": {"dir": os.path.join(self.root, "ckpt-" + name)}}
        if init:
            spec["init"] = init
        spec_path = os.path.join(self.root, name + ".yaml")
        with open(spec_path, "w") as f:
            json.dump(spec, f)  # JSON is YAML
        out = fsdp8("--coordinator", self.cluster.address, "submit", spec_path)
        job = out.splitlines()[0].strip()
        export = os.path.join(self.root, "export-" + name)
        self.export_line = fsdp8("--coordinator", self.cluster.address, "export", job, "--out",
                                 export)
        return export

    def load_quietly(self, export):
        """AutoConfig, GenerationConfig, AutoTokenizer (and LlamaForCausalLM with torch) of the
        export, asserting that transformers logged and warned nothing."""
        import transformers
        with transformers_warnings() as said:
            config = transformers.AutoConfig.from_pretrained(export)
            generation = transformers.GenerationConfig.from_pretrained(export)
            tokenizer = transformers.AutoTokenizer.from_pretrained(export)
            model = None
            if torch_available():
                model = transformers.LlamaForCausalLM.from_pretrained(export)
        self.assertEqual(said, [], f"transformers warned loading {export}")
        return config, generation, tokenizer, model

    def test_bpe_export_has_the_trained_special_tokens(self):
        export = self.train_and_export("bpe")
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            self.assertIn(name, self.export_line)  # the files the CLI says it wrote
        config, generation, tokenizer, model = self.load_quietly(export)
        for what, obj in (("AutoTokenizer", tokenizer), ("AutoConfig", config),
                          ("GenerationConfig", generation)):
            with self.subTest(what):
                self.assertEqual(obj.eos_token_id, self.eos)
                self.assertEqual(obj.bos_token_id, self.bos)
                self.assertEqual(obj.pad_token_id, self.pad)
        self.assertEqual((tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token),
                         (EOS, BOS, PAD))
        text = "You will be surprised by a loud noise."
        self.assertEqual(tokenizer(text, add_special_tokens=False)["input_ids"],
                         self.tok.encode(text, add_special_tokens=False).ids)
        # Trained from scratch: the positions it was trained on.
        self.assertEqual(config.max_position_embeddings, SEQ)
        if model is not None:
            self.assertEqual(model.generation_config.eos_token_id, self.eos)

    def test_imported_model_keeps_its_positions_and_rope_scaling(self):
        # A Hugging Face directory shaped as this test's model with Llama 3.1's config values:
        # the first export, its config.json given max_position_embeddings 131072 and llama3 RoPE.
        base = self.train_and_export("base", model_extra={"rope_scaling": LLAMA31_ROPE})
        src = os.path.join(self.root, "llama31-like")
        shutil.copytree(base, src)
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        self.assertEqual(cfg["max_position_embeddings"], SEQ)  # from scratch: seq_len
        cfg["max_position_embeddings"] = LLAMA31_MAX_POS
        cfg["rope_scaling"] = dict(LLAMA31_ROPE)
        with open(os.path.join(src, "config.json"), "w") as f:
            json.dump(cfg, f)
        export = self.train_and_export("imported", model_extra={"rope_scaling": LLAMA31_ROPE},
                                       init={"from_hf": src})
        with open(os.path.join(export, "config.json")) as f:
            written = json.load(f)
        self.assertEqual(written["max_position_embeddings"], LLAMA31_MAX_POS)
        self.assertEqual(written["rope_scaling"], LLAMA31_ROPE)
        config, _, tokenizer, _ = self.load_quietly(export)
        self.assertEqual(config.max_position_embeddings, LLAMA31_MAX_POS)
        rope = getattr(config, "rope_parameters", None) or config.rope_scaling
        for k, v in LLAMA31_ROPE.items():
            self.assertEqual(rope[k], v, k)
        self.assertEqual(tokenizer.eos_token_id, self.eos)

    def test_byte_level_export_has_no_special_tokens(self):
        data = os.path.join(self.root, "bytes")
        fsdp8("prepare", "--out", data, *cluster.fortunes_files()[:4])
        export = self.train_and_export("bytes", data=data, vocab=256)
        with open(os.path.join(export, "config.json")) as f:
            written = json.load(f)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
            self.assertIn(k, written)
            self.assertIsNone(written[k], k)
        import transformers
        with transformers_warnings() as said:
            config = transformers.AutoConfig.from_pretrained(export)
        self.assertEqual(said, [])
        self.assertEqual((config.bos_token_id, config.eos_token_id), (None, None))


if __name__ == "__main__":
    unittest.main()
