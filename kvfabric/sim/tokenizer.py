"""The simulated model's built-in tokenizer (``kvfabric sim-serve``, default ``--tokenizer words``): text and chat
prompts without downloading a model.

A Hugging Face fast tokenizer built in code (no file to fetch), written next to the model's ``config.json``:

* token ``i`` in ``[TOKEN_ID_LOW, TOKEN_ID_HIGH)`` is the pseudo-word :func:`word` ``(i)``
  (SentencePiece style: ``"▁" + word``). Words are split on spaces, so the benchmark's text prompts (one
  pseudo-word per drawn token) tokenize to exactly the token ids the token-prompt format would send, and the
  simulated model's answers (token ids in the same range) detokenize to words that tokenize back to themselves: a
  text conversation's next turn shares its whole history with the previous turn, block for block;
* any other text is tokenized too, byte by byte (``<0x00>`` .. ``<0xFF>``, SentencePiece's byte fallback), so a
  prompt a person types ("Hello, how are you?") is accepted and two different prompts never look alike to the
  prefix cache (no catch-all unknown token);
* a chat template (:data:`CHAT_TEMPLATE`) with one special token per role, so ``/v1/chat/completions`` works and a
  conversation's rendered prompt only grows from turn to turn (its prefix stays cached);
* ids up to the model's ``vocab_size`` exist (``<reserved_N>`` fill the gaps), so every token id the model accepts
  can be decoded.

Ids: 0 ``<unk>``, 1 ``<s>``, 2 ``</s>`` (EOS; the simulated model never samples it), 3..258 the bytes, 259 ``▁``,
then the role tokens, reserved ids up to 999, the words, reserved ids up to ``vocab_size``.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvfabric.sim.harness import TOKEN_ID_HIGH, TOKEN_ID_LOW

__all__ = ["CHAT_TEMPLATE", "ROLE_TOKENS", "SPACE", "word", "write_word_tokenizer"]

_SYLLABLES = [c + v for c in "bcdfghjklmnprstvz" for v in "aeiou"]  # 85 syllables


def word(token_id: int) -> str:
    """The pseudo-word standing for ``token_id`` in text prompts (two or three syllables, lowercase ASCII)."""
    n = len(_SYLLABLES)
    a, rest = token_id % n, token_id // n
    b, rest = rest % n, rest // n
    return _SYLLABLES[a] + _SYLLABLES[b] + (_SYLLABLES[rest % n] if rest else "")


SPACE = "\u2581"  # "▁": SentencePiece's word-start mark
SPECIALS = ("<unk>", "<s>", "</s>")
#: One special token per chat role; other roles are spelled out in bytes.
ROLE_TOKENS = {role: f"<|{role}|>" for role in ("system", "user", "assistant", "tool", "developer")}
#: Each message is ``<|role|> content`` (content stripped); the generation prompt is ``<|assistant|>``, after which
#: the answer's first word carries its own space mark. So a conversation re-sent with the assistant's reply
#: renders, token for token, as the earlier prompt followed by the tokens the model produced.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else "
    "message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join(' ') -%}"
    "<|{{ message['role'] }}|> {{ content | trim }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def _vocab(vocab_size: int) -> list[str]:
    pieces = [*SPECIALS, *(f"<0x{b:02X}>" for b in range(256)), SPACE, *ROLE_TOKENS.values()]
    pieces += [f"<reserved_{i}>" for i in range(len(pieces), TOKEN_ID_LOW)]
    pieces += [SPACE + word(i) for i in range(TOKEN_ID_LOW, TOKEN_ID_HIGH)]
    pieces += [f"<reserved_{i}>" for i in range(TOKEN_ID_HIGH, max(vocab_size, TOKEN_ID_HIGH))]
    return pieces


def write_word_tokenizer(directory: str | Path, vocab_size: int | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with :data:`CHAT_TEMPLATE`) into ``directory``.

    ``vocab_size`` (default: ``config.json``'s in ``directory``, else just the word range) sets how many ids exist.
    """
    # tokenizers: only when a tokenizer is written, not for `kvfabric bench --help`
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    out = Path(directory)
    if vocab_size is None:
        config = out / "config.json"
        vocab_size = int(json.loads(config.read_text()).get("vocab_size", 0)) if config.is_file() else 0
    pieces = _vocab(vocab_size)
    # Every piece scores the same, so the best segmentation is the one with the fewest pieces: a whole word is
    # always one token. Characters that no piece covers fall back to their UTF-8 bytes.
    tok = Tokenizer(models.Unigram([(p, -1.0) for p in pieces], unk_id=0, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="first", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (*SPECIALS, *ROLE_TOKENS.values())])
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 1_000_000, "add_bos_token": False, "add_eos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
