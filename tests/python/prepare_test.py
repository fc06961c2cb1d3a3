"""fsdp8-prepare (client/python/fsdp8/prepare.py); `fsdp8 prepare --tokenizer` handing over to it.

Tokenizers are trained here on a small corpus (a byte-level BPE with the `tokenizers` package, a
SentencePiece model with `sentencepiece`); the shards are read back with numpy from their headers
(llm.c's layout, independently of the writer), cut at the separators and decoded by the tokenizer:
they must give back exactly the input documents, in order, split between train and validation as
the documented rule says. Run: python3 prepare_test.py [TestClass ...]
(PYTHONPATH: the installed SDK; FSDP8_BIN_DIR: the fsdp8 binary, for HandOverTest).
"""
import contextlib
import glob
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import unittest

import numpy as np

import fsdp8
import fsdp8.prepare

LICENSES = "/usr/share/common-licenses"
FORMATS = {(20240520, 1): "<u2", (20240801, 7): "<u4"}  # llm.c: (magic, version) -> token type


def read_split(out_dir, split):
    """((magic, version), [token arrays of each shard in order]) of OUT/<split>_*.bin."""
    paths = sorted(glob.glob(os.path.join(out_dir, f"{split}_*.bin")))
    formats, shards = set(), []
    for path in paths:
        with open(path, "rb") as f:
            raw = f.read()
        header = np.frombuffer(raw[:1024], dtype="<i4")
        magic, version, count = (int(x) for x in header[:3])
        assert not header[3:].any(), f"{path}: header[3:] not zero"
        tokens = np.frombuffer(raw[1024:], dtype=FORMATS[(magic, version)])
        assert len(tokens) == count, f"{path}: header says {count} tokens, file holds {len(tokens)}"
        formats.add((magic, version))
        shards.append(tokens)
    assert len(formats) <= 1, formats
    return (formats.pop() if formats else None), shards


def split_docs(stream, eos, bos=None):
    """Token lists of the documents of a stream [BOS] doc EOS [BOS] doc EOS ..."""
    assert len(stream) == 0 or stream[-1] == eos, "the stream does not end with EOS"
    docs, cur = [], []
    for t in stream.tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    if bos is not None:
        for d in docs:
            assert d and d[0] == bos, "a document without its BOS"
        docs = [d[1:] for d in docs]
    return docs


def corpus_documents():
    """Varied documents: licence texts, Unicode, runs of spaces and newlines, tabs, a literal
    special token spelled inside a text."""
    texts = []
    for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "Artistic"):
        with open(os.path.join(LICENSES, name), encoding="utf-8") as f:
            texts.append(f.read()[:3000])
    extra = ["naïve café — 東京 😀 end", "  leading spaces\n\n\nthree newlines\tand a tab  ",
             "spelled: <|endoftext|> and <|eot_id|> and </s> stay text", "x", "\n"]
    docs = []
    for i in range(40):
        docs.append(f"Document {i}: {extra[i % len(extra)]} " + texts[i % 4][i * 50:i * 50 + 300])
    return texts, docs


def write_inputs(d, texts, docs):
    """Inputs t0.txt, data.jsonl (a blank line and an empty text inside), t1.txt, empty.txt;
    returns (paths, the non-empty documents in input order)."""
    paths = [os.path.join(d, n) for n in ("t0.txt", "data.jsonl", "t1.txt", "empty.txt")]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write(texts[0])
    with open(paths[1], "w", encoding="utf-8") as f:
        for i, doc in enumerate(docs):
            f.write(json.dumps({"id": i, "text": doc}, ensure_ascii=i % 2 == 0) + "\n")
            if i == 10:
                f.write("\n" + json.dumps({"text": ""}) + "\n")
    with open(paths[2], "w", encoding="utf-8") as f:
        f.write("second text file\n\n  with 東京 ✓\n")
    open(paths[3], "w").close()
    return paths, [texts[0], *docs, "second text file\n\n  with 東京 ✓\n"]


def prepare(*args):
    """Runs fsdp8-prepare; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "fsdp8.prepare", *args], capture_output=True,
                          text=True, timeout=120)


def prepare_here(*args):
    """fsdp8.prepare.main in this process (no start-up time): (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = fsdp8.prepare.main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())


def train_bpe(texts, specials, vocab_size=1000):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


class Case(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="fsdp8-prepare-")
        self.out = os.path.join(self.dir, "out")
        self.texts, self.docs = corpus_documents()
        self.inputs, self.expected = write_inputs(self.dir, self.texts, self.docs)

    def tearDown(self):
        shutil.rmtree(self.dir)

    def assertRoundTrip(self, fmt, decode, eos, bos, every=4, shard_tokens=None):
        """The shards hold self.expected: train the documents g with g % every != every - 1,
        validation the others (--val-fraction 1/every)."""
        got = {}
        for split in ("train", "val"):
            f, shards = read_split(self.out, split)
            self.assertEqual(f, fmt, split)
            if shard_tokens:
                self.assertTrue(all(len(s) == shard_tokens for s in shards[:-1]), split)
                self.assertTrue(0 < len(shards[-1]) <= shard_tokens, split)
            got[split] = [decode(d) for d in split_docs(np.concatenate(shards), eos, bos)]
        held_out = [g % every == every - 1 for g in range(len(self.expected))]
        self.assertEqual(got["train"], [d for d, v in zip(self.expected, held_out) if not v])
        self.assertEqual(got["val"], [d for d, v in zip(self.expected, held_out) if v])

    def assertNoShards(self):
        left = os.listdir(self.out) if os.path.isdir(self.out) else []
        self.assertEqual(left, [], "files left in --out")


class BpeTest(Case):
    def test_gpt2_style_eos_only(self):
        tok = train_bpe(self.texts + self.docs, ["<|endoftext|>"])
        path = os.path.join(self.dir, "tokenizer.json")
        tok.save(path)
        r = prepare("--tokenizer", path, "--out", self.out, "--val-fraction", "0.25",
                    "--shard-tokens", "257", "--workers", "2", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        eos = tok.token_to_id("<|endoftext|>")
        self.assertRoundTrip((20240520, 1), lambda ids: tok.decode(ids, skip_special_tokens=False),
                             eos, None, shard_tokens=257)
        self.assertIn(f"{len(self.expected)} documents", r.stdout)
        self.assertIn("2 empty skipped", r.stdout)
        self.assertNotIn("partial", " ".join(os.listdir(self.out)))
        # A second run into the same directory is refused unless --overwrite; with it, the
        # shards of the first run that the second does not write are gone.
        r = prepare_here("--tokenizer", path, "--out", self.out, "--val-fraction", "0.25",
                         "--workers", "1", *self.inputs)
        self.assertEqual(r.returncode, 1)
        self.assertIn("--overwrite", r.stderr)
        r = prepare_here("--tokenizer", path, "--out", self.out, "--val-fraction", "0.25",
                         "--workers", "1", "--overwrite", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        # The shards and the record of the tokenizer (docs/usage.md, Tokenizer record): GPT-2 style,
        # the EOS alone, no BOS, no padding token.
        self.assertEqual(sorted(os.listdir(self.out)),
                         ["tokenizer", "train_000000.bin", "val_000000.bin"])
        self.assertEqual(sorted(os.listdir(os.path.join(self.out, "tokenizer"))),
                         ["token_ids.json", "tokenizer.json", "tokenizer_config.json"])
        with open(os.path.join(self.out, "tokenizer", "token_ids.json")) as f:
            record = json.load(f)
        self.assertEqual((record["eos_token_id"], record["bos_token_id"], record["pad_token_id"]),
                         (eos, None, None))
        self.assertEqual((record["kind"], record["eos_token"]), ("hf", "<|endoftext|>"))
        with open(os.path.join(self.out, "tokenizer", "tokenizer.json")) as f, open(path) as g:
            self.assertEqual(f.read(), g.read())
        self.assertRoundTrip((20240520, 1), lambda ids: tok.decode(ids, skip_special_tokens=False),
                             eos, None)

    def test_llama3_style_bos_and_configured_eos(self):
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
        tok = train_bpe(self.texts + self.docs, specials)
        tok_dir = os.path.join(self.dir, "model")
        os.mkdir(tok_dir)
        tok.save(os.path.join(tok_dir, "tokenizer.json"))
        with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
            json.dump({"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"}}, f)
        r = prepare_here("--tokenizer", tok_dir, "--out", self.out, "--val-fraction", "0.25",
                         "--workers", "1", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        decode = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
        self.assertRoundTrip((20240520, 1), decode, tok.token_to_id("<|eot_id|>"),
                             tok.token_to_id("<|begin_of_text|>"))
        # --eos-token overrides the config.
        shutil.rmtree(self.out)
        r = prepare_here("--tokenizer", os.path.join(tok_dir, "tokenizer.json"), "--out",
                         self.out, "--val-fraction", "0.25", "--workers", "1", "--eos-token",
                         "<|end_of_text|>", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRoundTrip((20240520, 1), decode, tok.token_to_id("<|end_of_text|>"),
                             tok.token_to_id("<|begin_of_text|>"))

    def test_no_eos_is_refused(self):
        tok = train_bpe(self.texts, [])
        path = os.path.join(self.dir, "tokenizer.json")
        tok.save(path)
        r = prepare_here("--tokenizer", path, "--out", self.out, *self.inputs)
        self.assertEqual(r.returncode, 1)
        self.assertIn(path, r.stderr)
        self.assertIn("--eos-token", r.stderr)
        self.assertNoShards()


class SentencePieceTest(Case):
    def test_round_trip(self):
        import sentencepiece as spm
        model = io.BytesIO()
        # identity normalisation, no dummy prefix, whitespace kept and byte fallback: encoding
        # is then lossless, so decoding gives back the exact text.
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(self.texts + self.docs), model_writer=model, vocab_size=600,
            model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
            add_dummy_prefix=False, remove_extra_whitespaces=False, hard_vocab_limit=False,
            minloglevel=2)
        path = os.path.join(self.dir, "sp.model")
        with open(path, "wb") as f:
            f.write(model.getvalue())
        sp = spm.SentencePieceProcessor(model_file=path)
        r = prepare("--tokenizer", path, "--out", self.out, "--val-fraction", "0.25",
                    "--shard-tokens", "300", "--workers", "2", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRoundTrip((20240520, 1), sp.decode, sp.eos_id(), sp.bos_id(), shard_tokens=300)


class LargeVocabTest(Case):
    def test_uint32_shards_and_uint16_refusal(self):
        tok = train_bpe(self.texts, ["<|endoftext|>"], vocab_size=500)
        tok.add_tokens([f"<w{i}>" for i in range(70000)])
        self.assertGreater(tok.get_vocab_size(), 65536)
        path = os.path.join(self.dir, "tokenizer.json")
        tok.save(path)
        big = os.path.join(self.dir, "big.jsonl")
        self.expected = ["small ids only", "alpha <w69999> beta <w3>", "<w70> gamma"]
        with open(big, "w") as f:
            for doc in self.expected:
                f.write(json.dumps({"text": doc}) + "\n")
        r = prepare_here("--tokenizer", path, "--out", self.out, "--val-fraction", "0",
                         "--workers", "1", big)
        self.assertEqual(r.returncode, 0, r.stderr)
        fmt, shards = read_split(self.out, "train")
        self.assertEqual(fmt, (20240801, 7))
        stream = np.concatenate(shards)
        self.assertIn(tok.token_to_id("<w69999>"), stream.tolist())
        self.assertGreater(tok.token_to_id("<w69999>"), 65535)
        docs = split_docs(stream, tok.token_to_id("<|endoftext|>"))
        self.assertEqual([tok.decode(d, skip_special_tokens=False) for d in docs], self.expected)
        # The same into uint16: refused at the line that needs a larger id, nothing written.
        shutil.rmtree(self.out)
        r = prepare_here("--tokenizer", path, "--out", self.out, "--dtype", "uint16",
                         "--workers", "1", big)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"{big}:2: token id {tok.token_to_id('<w69999>')}", r.stderr)
        self.assertIn("uint16", r.stderr)
        self.assertNoShards()
        # In a text file, the line of the token.
        text = os.path.join(self.dir, "big.txt")
        with open(text, "w") as f:
            f.write("first line\n\nthird <w69000> line\n")
        r = prepare_here("--tokenizer", path, "--out", self.out, "--dtype", "uint16",
                         "--workers", "1", text)
        self.assertEqual(r.returncode, 1)
        self.assertIn(f"{text}:3: token id {tok.token_to_id('<w69000>')}", r.stderr)
        self.assertNoShards()


class ErrorTest(Case):
    def setUp(self):
        super().setUp()
        tok = train_bpe(self.texts, ["<|endoftext|>"], vocab_size=400)
        self.tok = os.path.join(self.dir, "tokenizer.json")
        tok.save(self.tok)

    def check_refused(self, name, content, message, workers="1"):
        path = os.path.join(self.dir, name)
        with open(path, "wb") as f:
            f.write(content)
        run = prepare_here if workers == "1" else prepare
        r = run("--tokenizer", self.tok, "--out", self.out, "--workers", workers,
                self.inputs[0], path)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn(f"{path}:{message}", r.stderr)
        self.assertNoShards()

    def test_bad_inputs_name_file_and_line(self):
        self.check_refused("bad.jsonl", b'{"text": "a"}\n{"text": "b"}\n{"text": oops}\n',
                           "3: not JSON")
        self.check_refused("missing.jsonl", b'{"text": "a"}\n{"body": "b"}\n',
                           '2: no field "text"', workers="2")
        self.check_refused("number.jsonl", b'{"text": 5}\n', '1: field "text" is not a string')
        self.check_refused("list.jsonl", b'\n["text"]\n', "2: not a JSON object")
        self.check_refused("bad.txt", b"l1\nl2\nl3\nab\xffcd\n", "4: invalid UTF-8 (byte 0xff")
        self.check_refused("badutf.jsonl", b'{"text": "ok"}\n{"text": "\xfe"}\n',
                           "2: invalid UTF-8 (byte 0xfe")
        self.check_refused("surrogate.jsonl", b'{"text": "ok \\ud800"}\n',
                           '1: field "text" is not valid Unicode')

    def test_flag_out_of_range_is_a_usage_error(self):
        for flag, value in (("--val-fraction", "1"), ("--shard-tokens", "0"), ("--workers", "0")):
            r = prepare_here("--tokenizer", self.tok, "--out", self.out, flag, value,
                             self.inputs[0])
            self.assertEqual(r.returncode, 2, flag)
            self.assertIn(f"{flag}: must be", r.stderr)
        self.assertNoShards()

    def test_line_numbers_across_chunks(self):
        # About 2 MB: the bad line lies beyond the first chunk handed to a worker (1 MiB).
        line = json.dumps({"text": "y" * 90}).encode() + b"\n"
        self.check_refused("long.jsonl", line * 20000 + b"{oops\n", "20001: not JSON",
                           workers="2")


class HandOverTest(Case):
    def setUp(self):
        super().setUp()
        self.cli = os.path.join(os.environ["FSDP8_BIN_DIR"], "fsdp8")
        tok = train_bpe(self.texts, ["<|endoftext|>"], vocab_size=400)
        self.tok_path = os.path.join(self.dir, "tokenizer.json")
        tok.save(self.tok_path)
        self.tok = tok

    def run_cli(self, path_dirs, *args):
        env = dict(os.environ, PATH=":".join(path_dirs))
        return subprocess.run([self.cli, *args], capture_output=True, text=True, env=env,
                              timeout=120)

    def test_installed_command_runs_with_the_same_arguments(self):
        fake = os.path.join(self.dir, "fakebin")
        os.mkdir(fake)
        script = os.path.join(fake, "fsdp8-prepare")
        with open(script, "w") as f:
            f.write('#!/bin/sh\nprintf "%s\\n" "$@"\nexit 7\n')
        os.chmod(script, os.stat(script).st_mode | stat.S_IXUSR)
        args = ["prepare", "--tokenizer", "t.json", "--out", "o d", "--workers", "3", "a.jsonl"]
        r = self.run_cli([fake], "--coordinator", "h:1", *args)
        self.assertEqual(r.returncode, 7, r.stderr)
        self.assertEqual(r.stdout.splitlines(), args[1:])

    def test_real_run_through_the_cli(self):
        bin_dir = os.path.join(os.path.dirname(os.path.dirname(fsdp8.__file__)), "bin")
        self.assertTrue(os.path.isfile(os.path.join(bin_dir, "fsdp8-prepare")), bin_dir)
        r = self.run_cli([bin_dir, os.path.dirname(sys.executable), "/usr/bin", "/bin"],
                         "prepare", "--tokenizer", self.tok_path, "--out", self.out,
                         "--val-fraction", "0.25", "--workers", "1", *self.inputs)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertRoundTrip((20240520, 1),
                             lambda ids: self.tok.decode(ids, skip_special_tokens=False),
                             self.tok.token_to_id("<|endoftext|>"), None)

    def test_missing_command_says_how_to_install_and_call_it(self):
        empty = os.path.join(self.dir, "emptybin")
        os.mkdir(empty)
        r = self.run_cli([empty], "prepare", "--tokenizer", self.tok_path, "--out", self.out,
                         "a b.jsonl")
        self.assertEqual(r.returncode, 2)
        self.assertIn("python3 -m pip install './client/python[prepare]'", r.stderr)
        self.assertIn(f"fsdp8-prepare --tokenizer {self.tok_path} --out {self.out} 'a b.jsonl'",
                      r.stderr)
        self.assertNoShards()


class ByteLevelWriterTest(unittest.TestCase):
    def test_same_bytes_as_fsdp8_prepare(self):
        """fsdp8.token_shards writes a uint16 shard byte for byte as the C++ byte-level prepare."""
        from fsdp8 import token_shards
        with tempfile.TemporaryDirectory() as d:
            data = bytes(range(256)) * 7 + "東京 ✓\n".encode()
            with open(os.path.join(d, "in.txt"), "wb") as f:
                f.write(data)
            cli = os.path.join(os.environ["FSDP8_BIN_DIR"], "fsdp8")
            r = subprocess.run([cli, "prepare", "--out", os.path.join(d, "cli"), "--val-fraction",
                                "0.25", os.path.join(d, "in.txt")], capture_output=True, text=True)
            self.assertEqual(r.returncode, 0, r.stderr)
            n_train = len(data) - len(data) // 4
            for split, tokens in (("train", data[:n_train]), ("val", data[n_train:])):
                w = token_shards.ShardSetWriter(d, split, 10**6, "uint16")
                w.add(np.frombuffer(tokens, dtype=np.uint8))
                [path] = w.commit()
                with open(path, "rb") as f, open(os.path.join(d, "cli", split + ".bin"), "rb") as g:
                    self.assertEqual(f.read(), g.read(), split)


if __name__ == "__main__":
    unittest.main()
