"""Special tokens shared by the tokenizer (c2jax.data) and the chat format (c2jax.agent).

Every tokenizer c2jax trains or imports gets these added as single, never-split tokens.
"""

PAD = "<|pad|>"
BOS = "<|bos|>"
EOS = "<|eos|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
THINK = "<|think|>"
END_THINK = "<|/think|>"
TOOL_CALL = "<|tool_call|>"
END_TOOL_CALL = "<|/tool_call|>"
TOOL_RESULT = "<|tool_result|>"
END_TOOL_RESULT = "<|/tool_result|>"
SUMMARY = "<|summary|>"
END_SUMMARY = "<|/summary|>"
END_TURN = "<|end_turn|>"

ALL = (
    PAD, BOS, EOS, SYSTEM, USER, ASSISTANT, THINK, END_THINK, TOOL_CALL, END_TOOL_CALL,
    TOOL_RESULT, END_TOOL_RESULT, SUMMARY, END_SUMMARY, END_TURN,
)
