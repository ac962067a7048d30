"""The chat templates of the families whose tool calls have a format of their own (``mpserve.families``): gpt-oss
(Harmony), Qwen3-Coder, GLM 4.5+, Kimi K2 and DeepSeek V3.1+, written from the formats as Hugging Face chat
templates (``messages``, ``tools``, ``add_generation_prompt``; ``bos_token`` left to the engines).

    FAMILY ──▶ its head (the system text and the tools, in the family's words) ──▶ each turn in its markers,
        an assistant's calls in the family's call format, a tool's answer where the family puts it ──▶ the
        assistant's opening for the reply (thinking families: ``enable_thinking`` false closes the thinking)

Each renders the conversation so that its family's parser reads the calls the model writes after it, and each
writes its family's markers, by which ``mpserve.families.for_template`` recognises it.
"""

from __future__ import annotations

import json


def _lit(text: str) -> str:
    """``text`` as a Jinja2 expression: literal text next to tags would lose newlines to trim_blocks."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}"


_SYSTEM = (
    "{% set system = messages | selectattr('role', 'in', ['system', 'developer']) | map(attribute='content')"
    " | join('\\n\\n') %}"
    "{% set turns = messages | rejectattr('role', 'in', ['system', 'developer']) | list %}"
)
_ARGS = "{{ call['function']['arguments'] | tojson }}"
_NAME = "{{ call['function']['name'] }}"
_TOOL_LIST = "{% for tool in tools %}{{ tool | tojson }}" + _lit("\n") + "{% endfor %}"


def _family(head: str, user: str, assistant: str, call: str, tool: str, prompt: str) -> str:
    """A template: ``head``, then each turn (a user's, an assistant's with its calls, ``call`` per call, or a tool's
    answer), each Jinja2 with ``m`` the message, then ``prompt`` for the reply."""
    return (_SYSTEM + "{% set ns = namespace(last='') %}" + head + "{% for m in turns %}"
            "{% if m['role'] == 'assistant' %}" + assistant.replace(
                "CALLS", "{% for call in m.get('tool_calls', []) %}{% set ns.last = call['function']['name'] %}"
                + call + "{% endfor %}")
            + "{% elif m['role'] == 'tool' %}" + tool + "{% else %}" + user + "{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}" + prompt + "{% endif %}")


_OFF = "{% if enable_thinking is defined and enable_thinking is false %}"

GPT_OSS = _family(
    _lit("<|start|>system<|message|>You are a helpful assistant.\nReasoning: medium\n\n# Valid channels: analysis, "
         "commentary, final. Channel must be included for every message.")
    + "{% if tools %}" + _lit("\nCalls to these tools must go to the commentary channel: 'functions'.") + "{% endif %}"
    + _lit("<|end|>") + "{% if system or tools %}" + _lit("<|start|>developer<|message|>")
    + "{% if system %}" + _lit("# Instructions\n\n") + "{{ system }}" + _lit("\n\n") + "{% endif %}"
    + "{% if tools %}" + _lit("# Tools\n\n## functions\n\nnamespace functions {\n\n")
    + "{% for tool in tools %}" + _lit("// ") + "{{ tool['function'].get('description', '') }}" + _lit("\ntype ")
    + "{{ tool['function']['name'] }}" + _lit(" = (_: ") + "{{ tool['function'].get('parameters', {}) | tojson }}"
    + _lit(") => any;\n\n") + "{% endfor %}" + _lit("} // namespace functions") + "{% endif %}"
    + _lit("<|end|>") + "{% endif %}",
    _lit("<|start|>user<|message|>") + "{{ m['content'] }}" + _lit("<|end|>"),
    "{% if m['content'] %}" + _lit("<|start|>assistant<|channel|>final<|message|>") + "{{ m['content'] }}"
    + _lit("<|end|>") + "{% endif %}CALLS",
    _lit("<|start|>assistant<|channel|>commentary to=functions.") + _NAME + _lit(" <|constrain|>json<|message|>")
    + _ARGS + _lit("<|call|>"),
    _lit("<|start|>functions.") + "{{ ns.last or 'tool' }}" + _lit(" to=assistant<|channel|>commentary<|message|>")
    + "{{ m['content'] }}" + _lit("<|end|>"),
    _lit("<|start|>assistant"))
"""gpt-oss's Harmony: its thinking the analysis channel (the gateway opens it), its answer the final one, a call a
commentary message to ``functions.NAME``, a tool's answer a message from it."""

QWEN3_CODER = _family(
    "{% if system or tools %}" + _lit("<|im_start|>system\n") + "{{ system }}" + "{% if tools %}"
    + _lit("\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n") + _TOOL_LIST
    + _lit("</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
           "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
           "</function>\n</tool_call>") + "{% endif %}" + _lit("<|im_end|>\n") + "{% endif %}",
    _lit("<|im_start|>user\n") + "{{ m['content'] }}" + _lit("<|im_end|>\n"),
    _lit("<|im_start|>assistant\n") + "{{ m['content'] }}CALLS" + _lit("<|im_end|>\n"),
    _lit("\n<tool_call>\n<function=") + _NAME + _lit(">\n")
    + "{% for key, value in call['function']['arguments'].items() %}" + _lit("<parameter=") + "{{ key }}" + _lit(">\n")
    + "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}" + _lit("\n</parameter>\n")
    + "{% endfor %}" + _lit("</function>\n</tool_call>"),
    _lit("<|im_start|>user\n<tool_response>\n") + "{{ m['content'] }}" + _lit("\n</tool_response><|im_end|>\n"),
    _lit("<|im_start|>assistant\n"))
"""Qwen3-Coder's: ChatML, the tools listed in the system turn with the XML call format."""

GLM = _family(
    _lit("[gMASK]<sop>") + "{% if system or tools %}" + _lit("<|system|>\n") + "{{ system }}" + "{% if tools %}"
    + _lit("\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n<tools>\n")
    + _TOOL_LIST + _lit("</tools>\n\nFor each function call, output the function name and arguments within the "
                        "following XML format:\n<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n"
                        "<arg_value>{arg-value-1}</arg_value>\n...\n</tool_call>") + "{% endif %}{% endif %}",
    _lit("<|user|>\n") + "{{ m['content'] }}",
    _lit("<|assistant|>\n<think></think>\n") + "{{ m['content'] }}CALLS",
    _lit("\n<tool_call>") + _NAME + _lit("\n") + "{% for key, value in call['function']['arguments'].items() %}"
    + _lit("<arg_key>") + "{{ key }}" + _lit("</arg_key>\n<arg_value>")
    + "{% if value is string %}{{ value }}{% else %}{{ value | tojson }}{% endif %}" + _lit("</arg_value>\n")
    + "{% endfor %}" + _lit("</tool_call>"),
    _lit("<|observation|>\n<tool_response>\n") + "{{ m['content'] }}" + _lit("\n</tool_response>"),
    _lit("<|assistant|>") + _OFF + _lit("\n<think></think>") + "{% endif %}")
"""GLM 4.5's: it thinks (``<think>``), its calls are ``<arg_key>``/``<arg_value>`` pairs, a tool's answer an
observation turn."""

KIMI = _family(
    "{% if tools %}" + _lit("<|im_system|>tool_declare<|im_middle|>") + "{{ tools | tojson }}" + _lit("<|im_end|>")
    + "{% endif %}" + _lit("<|im_system|>system<|im_middle|>")
    + "{{ system or 'You are Kimi, an AI assistant created by Moonshot AI.' }}" + _lit("<|im_end|>"),
    _lit("<|im_user|>user<|im_middle|>") + "{{ m['content'] }}" + _lit("<|im_end|>"),
    _lit("<|im_assistant|>assistant<|im_middle|>") + "{{ m['content'] }}"
    + "{% if m.get('tool_calls') %}" + _lit("<|tool_calls_section_begin|>") + "CALLS"
    + _lit("<|tool_calls_section_end|>") + "{% endif %}" + _lit("<|im_end|>"),
    _lit("<|tool_call_begin|>functions.") + _NAME + _lit(":") + "{{ loop.index0 }}"
    + _lit("<|tool_call_argument_begin|>") + _ARGS + _lit("<|tool_call_end|>"),
    _lit("<|im_system|>tool<|im_middle|>## Return of ") + "{{ m.get('tool_call_id', '') }}" + _lit("\n")
    + "{{ m['content'] }}" + _lit("<|im_end|>"),
    _lit("<|im_assistant|>assistant<|im_middle|>"))
"""Kimi K2's: the tools declared in a turn of their own, each call's id ``functions.NAME:INDEX``."""

DEEPSEEK_V3 = _family(
    "{{ system }}" + "{% if tools %}" + _lit("\n\n## Tools\nYou have access to the following tools:\n")
    + "{% for tool in tools %}" + _lit("\n### ") + "{{ tool['function']['name'] }}" + _lit("\nDescription: ")
    + "{{ tool['function'].get('description', '') }}" + _lit("\n\nParameters: ")
    + "{{ tool['function'].get('parameters', {}) | tojson }}" + _lit("\n") + "{% endfor %}"
    + _lit("\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
           "tool_call_name<｜tool▁sep｜>tool_call_arguments<｜tool▁call▁end｜>{{additional_tool_calls}}"
           "<｜tool▁calls▁end｜>") + "{% endif %}",
    _lit("<｜User｜>") + "{{ m['content'] }}",
    _lit("<｜Assistant｜></think>") + "{{ m['content'] }}" + "{% if m.get('tool_calls') %}"
    + _lit("<｜tool▁calls▁begin｜>") + "CALLS" + _lit("<｜tool▁calls▁end｜>") + "{% endif %}"
    + _lit("<｜end▁of▁sentence｜>"),
    _lit("<｜tool▁call▁begin｜>") + _NAME + _lit("<｜tool▁sep｜>") + _ARGS + _lit("<｜tool▁call▁end｜>"),
    _lit("<｜tool▁output▁begin｜>") + "{{ m['content'] }}" + _lit("<｜tool▁output▁end｜>"),
    _lit("<｜Assistant｜>") + _OFF + _lit("</think>") + "{% else %}" + _lit("<think>") + "{% endif %}")
"""DeepSeek V3.1's: thinking mode by default (``<think>`` opens the reply), ``</think>`` alone when it is off."""

TOOL_FAMILIES = {"gpt-oss": GPT_OSS, "qwen3-coder": QWEN3_CODER, "glm": GLM, "kimi": KIMI,
                 "deepseek-v3": DEEPSEEK_V3}
