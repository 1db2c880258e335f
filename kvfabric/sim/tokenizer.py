"""A word-level tokenizer for ``kvfabric sim-serve --tokenizer words``: text prompts without downloading a model.

Token id ``i`` in ``[TOKEN_ID_LOW, TOKEN_ID_HIGH)`` is the pseudo-word :func:`kvfabric.bench.prompts.word` ``(i)``;
words are split on whitespace and joined with single spaces when decoded. So the benchmark's text prompts (one
pseudo-word per drawn token) tokenize to exactly the token ids the token-prompt format would send, and the
simulated model's answers (token ids in the same range) detokenize to words that tokenize back to themselves: a
text conversation's next turn shares its whole history with the previous turn, block for block.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfabric.bench.prompts import word
from kvfabric.sim.harness import TOKEN_ID_HIGH, TOKEN_ID_LOW

__all__ = ["write_word_tokenizer"]


def write_word_tokenizer(directory: str | Path) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (a Hugging Face fast tokenizer) into ``directory``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab = dict(specials)
    for i in range(len(specials), TOKEN_ID_LOW):
        vocab[f"<reserved_{i}>"] = i  # ids stay contiguous below the word range
    for i in range(TOKEN_ID_LOW, TOKEN_ID_HIGH):
        vocab[word(i)] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with one space
    out = Path(directory)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>",
              "eos_token": "</s>", "model_max_length": 1_000_000, "add_bos_token": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config) + "\n")
