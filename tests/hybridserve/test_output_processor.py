"""The output processor's incremental text equals a whole decode, and stop strings cut it where
a whole decode finds them (the reference: `Tokenizer.decode` of every token, then `str.find`)."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from hybridserve.core.request import Request
from hybridserve.entrypoints import DEFAULT_MODEL
from hybridserve.output_processor import IncrementalDetokenizer, OutputProcessor
from hybridserve.sampling_params import SamplingParams
from hybridserve.tokenizer import Tokenizer

CORPUS = [
    "def main():\n    return 0  # naïve café, 日本語のテキスト, emoji 🙂🚀",
    "The quick brown fox jumps over the lazy dog. Ünïcödé ŝtrīngs ärë fün.",
    "    indented lines\n\tand tabs, numbers 12345 and symbols <>{}[]",
]


def _metaspace(tmp_path) -> Tokenizer:
    """A SentencePiece-style tokenizer (Metaspace: a leading space is dropped on decode)."""
    tok = HFTokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return Tokenizer(tmp_path)


@pytest.fixture(scope="module", params=["default-bytelevel", "metaspace"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    if request.param == "metaspace":
        return _metaspace(tmp_path_factory.mktemp("metaspace"))
    return Tokenizer(DEFAULT_MODEL)


def _sequences(tok: Tokenizer, n: int, seed: int) -> list[list[int]]:
    """Random ids (bytes split mid-character, special tokens) and encoded real text."""
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, tok.vocab_size, int(rng.integers(1, 40))).tolist() for _ in range(n)]
    seqs += [tok.encode(text) for text in CORPUS]
    return seqs


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_a_whole_decode(tokenizer, skip):
    rng = np.random.default_rng(1)
    for ids in _sequences(tokenizer, 150, seed=2):
        detok = IncrementalDetokenizer(tokenizer, skip)
        pieces, i = [], 0
        while i < len(ids):  # tokens arrive one at a time or several (speculative decoding)
            step = int(rng.integers(1, 4))
            pieces.append(detok.add(ids[i : i + step]))
            i += step
            assert detok.text == "".join(pieces)
            assert tokenizer.decode(ids[:i], skip).startswith(detok.text)
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip), ids


def test_stop_strings_cut_the_text_where_a_whole_decode_finds_them(tokenizer):
    ids = tokenizer.encode(CORPUS[1])
    full = tokenizer.decode(ids)
    for stop in ("fox", "dog.", "ä", "fün"):
        at = full.find(stop)
        assert at > 0
        ended: list[tuple[str, str]] = []
        request = Request("r", [1, 2, 3], max_tokens=len(ids))

        def finish(req_id, s, request=request, ended=ended):
            ended.append((req_id, s))
            request.finish("stop", s)

        processor = OutputProcessor(tokenizer, finish)
        processor.add(request, [1, 2, 3], SamplingParams(stop=[stop, "never there"]))
        last = None
        for token in ids:
            request.output_token_ids.append(token)
            (last,) = processor.process({"r": [token]}, {}, set())
            if last.finished:
                break
        assert ended == [("r", stop)]
        assert last.finished and last.outputs[0].text == full[:at]
        assert last.outputs[0].stop_reason == stop and "r" not in processor
