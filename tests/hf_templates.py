# ruff: noqa: E501 -- the chat templates are kept verbatim, one Jinja statement a line
"""The fixtures' chat templates (tests/make_hf_fixtures.py writes them into the folders),
each written to reproduce its family's real template's structure."""

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
QWEN_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "<start_of_turn>{{ role }}\n{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Qwen3's structure (Qwen/Qwen3-0.6B): an optional system turn, <think> blocks on the
# assistant turns after the last user query (from reasoning_content or split out of the
# content; the last turn always gets one, empty without reasoning), and
# enable_thinking=false closing an empty think block in the generation prompt.
QWEN3_TEMPLATE = """{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- endif %}
{%- endif %}
"""
# Gemma 3's structure (google/gemma-3-1b-it): no system role, its text folded into the
# first user turn; "model" turns; text parts of list content; roles must alternate.
GEMMA3_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
{%- if messages[0]['content'] is string -%}
{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
{%- else -%}
{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}
{%- endif -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = "" -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
{{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
{%- endif -%}
{%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
{%- if message['content'] is string -%}
{{ message['content'] | trim }}
{%- elif message['content'] is iterable -%}
{%- for item in message['content'] -%}
{%- if item['type'] == 'image' -%}
{{ '<start_of_image>' }}
{%- elif item['type'] == 'text' -%}
{{ item['text'] | trim }}
{%- endif -%}
{%- endfor -%}
{%- else -%}
{{ raise_exception("Invalid content type") }}
{%- endif -%}
{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{ '<start_of_turn>model\n' }}
{%- endif -%}
"""
# Mistral's structure (mistralai/Mistral-7B-Instruct-v0.3): [INST] ... [/INST], the system
# message joined to the last user turn, each assistant turn ended by the eos token.
MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
{%- set system_message = messages[0]["content"] %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set loop_messages = messages %}
{%- endif %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
{%- endif %}
{%- if message["role"] == "user" %}
{%- if loop.last and system_message is defined %}
{{- "[INST] " + system_message + "\n\n" + message["content"] + "[/INST]" }}
{%- else %}
{{- "[INST] " + message["content"] + "[/INST]" }}
{%- endif %}
{%- elif message["role"] == "assistant" %}
{{- " " + message["content"]|trim + eos_token }}
{%- else %}
{{- raise_exception("Only user and assistant roles are supported, with the exception of an initial optional system message!") }}
{%- endif %}
{%- endfor %}
"""
# Qwen3.5's structure (Qwen/Qwen3.5-9B): Qwen3's turns and <think> blocks, content given as
# a string or as a list of parts (text parts rendered, images as vision placeholders), and a
# generation prompt that opens a think block by default (thinking is on), or closes an
# empty one with enable_thinking=false.
QWEN3_5_TEMPLATE = """{%- macro render_content(content) %}
{%- if content is string %}
{{- content }}
{%- else %}
{%- for item in content %}
{%- if item.type == 'text' %}
{{- item.text }}
{%- elif item.type == 'image' %}
{{- '<|vision_start|><|image_pad|><|vision_end|>' }}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- endmacro %}
{%- if messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- set index = (messages|length - 1) - loop.index0 %}
{%- if ns.multi_step_tool and message.role == 'user' %}
{%- set ns.multi_step_tool = false %}
{%- set ns.last_query_index = index %}
{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- set content = render_content(message.content) %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{%- set reasoning_content = '' %}
{%- if message.reasoning_content is string %}
{%- set reasoning_content = message.reasoning_content %}
{%- elif '</think>' in content %}
{%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
{%- set content = content.split('</think>')[-1].lstrip('\n') %}
{%- endif %}
{%- if loop.index0 > ns.last_query_index %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
{%- else %}
{{- '<|im_start|>assistant\n' + content }}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\n\n</think>\n\n' }}
{%- else %}
{{- '<think>\n' }}
{%- endif %}
{%- endif %}
"""
# Gemma 4's structure (google/gemma-4-E2B-it's chat_template.jinja, July 2026; tools and
# audio/video left out): <bos>, then "<|turn>ROLE\n" ... "<turn|>\n" turns, assistant turns
# as "model"; a system turn when the chat opens with a system (or developer) message or
# enable_thinking is true, which puts <|think|> at its start; thought channels
# (<|channel>thought\n...<channel|>) stripped from the model turns' content, and
# reasoning_content rendered as one only on model turns after the last user turn;
# consecutive assistant messages sharing one model turn; text parts trimmed, images as
# <|image|>. The generation prompt is E2B/E4B's "<|turn>model\n" (the 26B/31B templates
# add an empty "<|channel>thought\n<channel|>" to it when thinking is off).
GEMMA4_TEMPLATE = """{%- macro strip_thinking(text) -%}
{%- set ns = namespace(result='') -%}
{%- for part in text.split('<channel|>') -%}
{%- if '<|channel>' in part -%}
{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}
{%- else -%}
{%- set ns.result = ns.result + part -%}
{%- endif -%}
{%- endfor -%}
{{- ns.result | trim -}}
{%- endmacro -%}
{%- macro render_text(text, role) -%}
{{- strip_thinking(text) if role == 'model' else text | trim -}}
{%- endmacro -%}
{%- set enable_thinking = enable_thinking | default(false) -%}
{%- set loop_messages = messages -%}
{{- bos_token -}}
{%- if enable_thinking or (messages and messages[0]['role'] in ['system', 'developer']) -%}
{{- '<|turn>system\n' -}}
{%- if enable_thinking -%}
{{- '<|think|>\n' -}}
{%- endif -%}
{%- if messages and messages[0]['role'] in ['system', 'developer'] -%}
{%- if messages[0]['content'] is string -%}
{{- messages[0]['content'] | trim -}}
{%- else -%}
{%- for item in messages[0]['content'] -%}
{{- item['text'] | trim + ' ' -}}
{%- endfor -%}
{%- endif -%}
{%- set loop_messages = messages[1:] -%}
{%- endif -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1, previous_role=none) -%}
{%- for message in loop_messages -%}
{%- if message['role'] == 'user' -%}
{%- set ns.last_user = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for message in loop_messages -%}
{%- if message['role'] != 'tool' -%}
{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
{%- if not (role == 'model' and ns.previous_role == 'assistant') -%}
{{- '<|turn>' + role + '\n' -}}
{%- endif -%}
{%- set thinking = message.get('reasoning') or message.get('reasoning_content') -%}
{%- if thinking and loop.index0 > ns.last_user -%}
{{- '<|channel>thought\n' + thinking + '\n<channel|>' -}}
{%- endif -%}
{%- if message['content'] is string -%}
{{- render_text(message['content'], role) -}}
{%- elif message['content'] is sequence -%}
{%- for item in message['content'] -%}
{%- if item['type'] == 'text' -%}
{{- render_text(item['text'], role) -}}
{%- elif item['type'] in ['image', 'image_url'] -%}
{{- '<|image|>' -}}
{%- endif -%}
{%- endfor -%}
{%- endif -%}
{%- set later = loop_messages[loop.index0 + 1:] | rejectattr('role', 'equalto', 'tool') | list -%}
{%- if not (role == 'model' and later and later[0]['role'] == 'assistant') -%}
{{- '<turn|>\n' -}}
{%- endif -%}
{%- set ns.previous_role = message['role'] -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|turn>model\n' -}}
{%- endif -%}
"""
# Mistral 3's structure (Ministral 3, Mistral Small 3.1+): a system prompt, the default one
# when the chat has none (the real one also names today's date with strftime_now, left out
# here so the fixture's cases do not change by the day), [INST] turns, content given as a
# string or as a list of parts (text parts rendered, images as [IMG]), </s> after answers.
MISTRAL3_TEMPLATE = """{%- set default_system_message = "You are Ministral 3, a Large Language Model (LLM) created by Mistral AI." %}
{%- macro render_content(content) %}
{%- if content is string %}
{{- content }}
{%- else %}
{%- for part in content %}
{%- if part["type"] == "text" %}
{{- part["text"] }}
{%- elif part["type"] in ["image", "image_url"] %}
{{- "[IMG]" }}
{%- endif %}
{%- endfor %}
{%- endif %}
{%- endmacro %}
{{- bos_token }}
{%- if messages[0]["role"] == "system" %}
{%- set system_message = render_content(messages[0]["content"]) %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set system_message = default_system_message %}
{%- set loop_messages = messages %}
{%- endif %}
{{- "[SYSTEM_PROMPT]" + system_message + "[/SYSTEM_PROMPT]" }}
{%- for message in loop_messages %}
{%- if message["role"] == "user" %}
{{- "[INST]" + render_content(message["content"]) + "[/INST]" }}
{%- elif message["role"] == "system" %}
{{- "[SYSTEM_PROMPT]" + render_content(message["content"]) + "[/SYSTEM_PROMPT]" }}
{%- elif message["role"] == "assistant" %}
{{- render_content(message["content"]) + eos_token }}
{%- else %}
{{- raise_exception("Only user, system and assistant roles are supported!") }}
{%- endif %}
{%- endfor %}
"""
