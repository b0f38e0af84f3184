"""A small synthetic tokenizer with the structure of the Qwen3.5/3.6 one (architecture.md §11.1).

The real 248k-token `tokenizer.json` is not available to tests. This module trains a byte-level BPE
on a small built-in corpus with the same normaliser, pre-tokenizer and decoder, then appends the 33
Qwen added tokens right after the regular tokens, in the real order. Ids therefore differ from the
real ones (regular tokens are 256 bytes + `n_merges` merges, not 248 044), but the layout is the same.
"""

import json
import random

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

__all__ = ["QWEN35_SPLIT_REGEX", "TINY_ADDED_TOKENS", "TINY_NON_SPECIAL_TOKENS", "TINY_CHAT_TEMPLATE",
           "make_tokenizer_json", "tiny_vocab_size"]

# The Qwen3.5 split regex: `\p{M}` joins letter runs and digits are split one at a time.
QWEN35_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Added tokens in id order, starting at the first id after the regular tokens (`<|endoftext|>`).
# The four TTS names follow Qwen3-Omni's spelling; architecture.md §13 marks them unverified.
TINY_ADDED_TOKENS: list[str] = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
    "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>",
    "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>",
]

# Added tokens that are not special: `skip_special_tokens` keeps them.
TINY_NON_SPECIAL_TOKENS: frozenset[str] = frozenset(
    ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog. It's a test, isn't it? We'll see, they'd say.",
    "Large language models predict the next token; the tokenizer turns text into integer ids.",
    "In 2024 the team shipped version 3.6 with 35 billion parameters and 3 billion active ones.",
    "Please summarise the following paragraph in three sentences, keeping the original meaning.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < n; ++i) {\n    sum += a[i] * b[i];\n}\nreturn sum;\n",
    "import numpy as np\nx = np.zeros((4, 8), dtype=np.float32)\nprint(x.shape, x.dtype)\n",
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2, "units": "celsius"}}',
    "<html>\n  <body>\n    <p class=\"note\">Hello, world!</p>\n  </body>\n</html>\n",
    "SELECT id, name FROM users WHERE created_at > '2024-01-01' ORDER BY name;",
    "Café, naïve, résumé, façade, coöperate: accents and diaeresis in English loanwords.",
    "Grüße aus München! Ça va très bien. ¿Dónde está la biblioteca? Ελληνικά κείμενα εδώ.",
    "你好，世界！今天天气很好，我们去公园散步吧。机器学习和自然语言处理。",
    "こんにちは、世界。日本語のテキストも少し含めます。カタカナとひらがな。",
    "안녕하세요, 세계! 한국어 문장도 조금 넣습니다.",
    "Привет, мир! Это небольшой корпус для обучения токенизатора.",
    "مرحبا بالعالم، هذا نص عربي قصير. नमस्ते दुनिया, यह हिंदी पाठ है।",
    "Emoji: 😀 🎉 🚀 👍🏽 👨‍👩‍👧 ❤️ — and symbols: ∑ ∫ √ π ≈ ≠ ≤ ≥ → ⇒ ∞ © ® ™ €",
    "Math: e^{i\\pi} + 1 = 0, a^2 + b^2 = c^2, f(x) = 3x + 7, 12 * 34 = 408.",
    "   Indented line with trailing spaces   \n\n\tTabbed line\r\nWindows newline\n",
]


def _training_lines(seed: int) -> list[str]:
    """Each corpus line repeated a seed-dependent number of times, so that `seed` changes the merges."""
    rng = random.Random(seed)
    return [line for line in _CORPUS for _ in range(rng.randint(1, 8))]


def _bare_tokenizer(model: models.Model) -> Tokenizer:
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def make_tokenizer_json(n_merges: int = 200, seed: int = 0) -> str:
    """JSON text of a byte-level BPE with 256 byte tokens, `n_merges` merges and the 33 added tokens.

    Deterministic for given arguments; `seed` changes the training mix and so the merges. The built-in
    corpus supports up to about 870 merges.
    """
    if n_merges < 0:
        raise ValueError(f"n_merges must be >= 0, got {n_merges}")
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + n_merges, show_progress=False,
                                  initial_alphabet=alphabet)
    trained = _bare_tokenizer(models.BPE())
    trained.train_from_iterator(_training_lines(seed), trainer)
    merges = json.loads(trained.to_str())["model"]["merges"]
    if len(merges) != n_merges:
        raise ValueError(f"the built-in corpus yields only {len(merges)} merges, {n_merges} requested")

    # Byte tokens first, in GPT-2 byte→unicode order as in Qwen's vocabulary, then one token per merge.
    # Sorting the ByteLevel alphabet by code point gives exactly that order.
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    for left, right in merges:
        vocab[left + right] = len(vocab)
    tok = _bare_tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in merges]))
    tok.add_tokens([AddedToken(t, special=t not in TINY_NON_SPECIAL_TOKENS, normalized=False)
                    for t in TINY_ADDED_TOKENS])
    return tok.to_str()


def tiny_vocab_size(n_merges: int = 200) -> int:
    """Regular tokens (256 bytes + merges) plus added tokens: the tokenizer's full size."""
    return 256 + n_merges + len(TINY_ADDED_TOKENS)


# A short ChatML template for Lily's built-in tiny random model (not the real Qwen template). As Qwen's, it renders
# an assistant turn's thinking block only after the last user message (conversation.py: Conversation.keeps_thinking).
TINY_CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('Unexpected message role: ' + message.role) }}"
    "{%- endif %}"
    "{%- if message.role == 'assistant' and loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + (message.reasoning_content or '') + '\\n</think>\\n\\n' }}"
    "{{- (message.content or '') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
