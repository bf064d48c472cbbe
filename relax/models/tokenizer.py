"""A small byte-level BPE tokenizer built in process, shaped like Qwen2's.

No tokenizer can be downloaded on the development machines, so tests and toy runs train one here: the
same normalizer (NFC), pre-tokenizer (Qwen2's split regex, one token per digit, then byte-level), decoder,
special tokens and chat template as Qwen2.5-Instruct, only with a vocabulary of a few hundred tokens.
The result is a `transformers` `Qwen2Tokenizer`, so it saves and loads exactly as a real Qwen one.
"""

from __future__ import annotations

import json
import logging
import random

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AddedToken, PreTrainedTokenizerFast
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX, Qwen2Tokenizer

logger = logging.getLogger(__name__)

# Special tokens in Qwen's id order (they follow the BPE vocabulary, as in Qwen's 151643+ block).
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)
# Added tokens that are kept when decoding with skip_special_tokens=True (as in Qwen).
ADDED_TOKENS: tuple[str, ...] = ("<tool_call>", "</tool_call>", "<think>", "</think>")
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
DEFAULT_SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

# Qwen2.5-Instruct's chat template, behaviour for behaviour: default system prompt, tools listed in the
# system turn, assistant tool calls as <tool_call> JSON, consecutive tool results folded into one user turn.
QWEN25_CHAT_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- '" + DEFAULT_SYSTEM_PROMPT + "' }}\n"
    "    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n'
    'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
    "    {%- for tool in tools %}\n"
    '        {{- "\\n" }}\n'
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    "arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
    '{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    '    {%- elif message.role == "assistant" %}\n'
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
    "            {{- tool_call.name }}\n"
    '            {{- \'", "arguments": \' }}\n'
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "You are a helpful assistant. Please answer the question step by step.",
    "What is the sum of these two numbers? The answer is given below.",
    "Reinforcement learning improves the model with rewards from its own samples.",
    "The policy generates a response, the reward function scores it, and the trainer updates the weights.",
    "Please think about the problem carefully before you write the final answer.",
    "I will call the calculator tool to add the numbers and then report the result.",
    "Hello! How can I help you today? Let me know if you have any other questions.",
    "This image shows a small red house next to a tall green tree under a blue sky.",
    "Listen to the audio clip and describe what you hear in one sentence.",
    "She said that it's a good day, and they'll go to the park if it doesn't rain.",
    "Let's solve this together: first add the ones, then carry the tens.",
    "The weather in Paris is sunny with a temperature of twenty degrees.",
    "Error: the file was not found. Check the path and try again.",
    "def add(a, b):\n    return a + b\n\nprint(add(3, 4))\n",
)
_WORDS = (
    "the a an of to and in is it that for on with as was he she they we you I this be at by or from "
    "answer question number sum add plus minus equals result tool call function name arguments think "
    "user assistant system model reward step train data value true false null image video audio text"
).split()


def _builtin_corpus(seed: int = 0) -> list[str]:
    """Arithmetic, English, chat-shaped and JSON/tool-call-shaped text; deterministic for a seed."""
    rng = random.Random(seed)
    corpus: list[str] = []
    for _ in range(400):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        corpus.append(f"{a}+{b}={a + b}")
        corpus.append(f"What is {a} + {b}? The answer is {a + b}.")
    corpus.extend(_SENTENCES * 20)
    for _ in range(300):
        corpus.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, 15))) + ".")
    for sentence in _SENTENCES:
        # Chat-shaped text without the special markers (those are added tokens, never merged).
        corpus.append(f"system\n{DEFAULT_SYSTEM_PROMPT}\nuser\n{sentence}\nassistant\n{sentence}\n")
        corpus.append(f"<think>\n{sentence}\n</think>\n\n{sentence}")
    for _ in range(100):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        corpus.append(f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>')
        corpus.append(
            f'{{"type": "function", "function": {{"name": "get_weather", "city": "{rng.choice(_WORDS)}"}}}}'
        )
        corpus.append(f'<tool_response>\n{{"result": {a + b}, "ok": true}}\n</tool_response>')
    return corpus


def _backend(add_prefix_space: bool = False) -> Tokenizer:
    """An empty BPE pipeline identical to `Qwen2Tokenizer`'s."""
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tiny_tokenizer(
    vocab_size: int = 512, extra_corpus: list[str] | None = None
) -> PreTrainedTokenizerFast:
    """Train a Qwen2-style byte-level BPE with `vocab_size` tokens in all (special tokens included).

    The vocabulary holds the 256 byte symbols, the learned merges, then the Qwen special tokens and the
    added tokens. The built-in corpus yields about 800 tokens at most; past that the vocabulary comes out
    smaller than asked (logged) unless `extra_corpus` adds text.
    """
    n_extra = len(SPECIAL_TOKENS) + len(ADDED_TOKENS)
    if vocab_size < 256 + n_extra:
        raise ValueError(
            f"vocab_size must be at least {256 + n_extra} (256 bytes + {n_extra} special/added tokens)"
        )
    backend = _backend()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_extra,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    backend.train_from_iterator(_builtin_corpus() + list(extra_corpus or []), trainer=trainer)
    vocab = backend.get_vocab()
    merges = _merges(backend)
    # Special and added tokens take the ids right after the BPE vocabulary, in Qwen's order.
    for token in SPECIAL_TOKENS + ADDED_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        errors="replace",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )
    tokenizer.add_special_tokens(
        {"extra_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]}
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.chat_template = QWEN25_CHAT_TEMPLATE
    if len(tokenizer) != vocab_size:
        logger.info("tiny tokenizer has %d tokens (asked for %d)", len(tokenizer), vocab_size)
    return tokenizer


def _merges(backend: Tokenizer) -> list[tuple[str, str]]:
    """The learned merges, in rank order, read from the serialized model."""
    model = json.loads(backend.to_str())["model"]
    return [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
