"""Chat rendering with real model templates: the CLIENTS.md message shapes reach the model."""

from __future__ import annotations

import pytest

from kamado.models import ModelSource, load_tokenizer
from kamado.server.chat_template import ChatTemplate
from kamado.server.errors import APIError
from kamado.server.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command; use <, > and & freely",
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string"}},
            "required": ["command"],
        },
    },
}


@pytest.fixture(scope="module")
def qwen(qwen05_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(ModelSource("gguf", "qwen", qwen05_path)))


@pytest.fixture(scope="module")
def smol(smollm2_path) -> ChatTemplate:
    return ChatTemplate(load_tokenizer(ModelSource("gguf", "smol", smollm2_path)))


def req(messages, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": messages, **kw})


AGENT_TURN = [
    {"role": "system", "content": [{"type": "text", "text": "You are an agent."}]},
    {
        "role": "user",
        "content": [{"type": "text", "text": "List"}, {"type": "text", "text": "files"}],
    },
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "bash", "arguments": '{"command": "ls <dir> && echo"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "a.py\nb.py"},
]


def test_agent_turn_renders_tool_calls_results_and_parts(qwen):
    r = req(AGENT_TURN, tools=[BASH])
    text = qwen.render(r.messages, r.tools)
    assert "You are an agent." in text
    assert "List\nfiles" in text  # parts flattened, not a Python repr
    assert "[{" not in text.split("<tools>")[0]
    assert '"command": "ls <dir> && echo"' in text  # arguments as an object, not re-encoded
    assert "a.py\nb.py" in text  # the tool result reaches the model
    assert "use <, > and & freely" in text  # never HTML-escaped
    assert "&lt;" not in text and "&amp;" not in text and "\\u003c" not in text
    assert text.endswith("<|im_start|>assistant\n")


def test_template_without_tools_still_shows_tools_and_calls(smol):
    assert not smol.knows_tools and smol.tool_format == "hermes"
    r = req(AGENT_TURN, tools=[BASH])
    text = smol.render(r.messages, r.tools)
    assert "<tools>" in text and '"name": "bash"' in text
    assert '<tool_call>\n{"name": "bash", "arguments": {"command": "ls <dir> && echo"}}' in text
    assert "a.py\nb.py" in text


def test_developer_role(qwen):
    r = req([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    text = qwen.render(r.messages, None)
    assert "<|im_start|>system\nBe brief." in text
    assert text.endswith("<|im_start|>assistant\n")


def test_non_text_parts_are_a_clear_400(qwen):
    r = req([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(APIError) as e:
        qwen.render(r.messages)
    assert e.value.status == 400 and "image_url" in e.value.message


def test_custom_template_file(tmp_path, qwen):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}>>")
    custom = ChatTemplate(qwen.tokenizer, str(f))
    r = req([{"role": "user", "content": "a < b"}])
    assert custom.render(r.messages) == "[user] a < b\n>>"


THINKING = (
    "{% for m in messages %}"
    "{% if m.reasoning_content and preserve_thinking %}<think>{{ m.reasoning_content }}</think>"
    "{% endif %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)


def test_history_keeping_template_options_are_on_unless_turned_off(tmp_path, qwen):
    f = tmp_path / "thinking.jinja"
    f.write_text(THINKING)
    messages = req(
        [
            {"role": "user", "content": "fix it"},
            {"role": "assistant", "content": "done", "reasoning_content": "look at a.py"},
            {"role": "user", "content": "thanks"},
        ]
    ).messages
    kept = "[user] fix it\n<think>look at a.py</think>[assistant] done\n[user] thanks\n"
    dropped = kept.replace("<think>look at a.py</think>", "")
    template = ChatTemplate(qwen.tokenizer, str(f))
    assert template.options == {"preserve_thinking": True}
    assert template.render(messages) == kept
    assert template.render(messages, options={"preserve_thinking": False}) == dropped
    server_off = ChatTemplate(qwen.tokenizer, str(f), {"preserve_thinking": False})
    assert server_off.render(messages) == dropped
    assert server_off.render(messages, options={"preserve_thinking": True}) == kept
    assert qwen.options == {}  # a template without such an option renders as it always did
    with pytest.raises(APIError) as e:
        template.render(messages, options={"add_generation_prompt": False})
    assert e.value.status == 400 and e.value.param == "chat_template_kwargs"
