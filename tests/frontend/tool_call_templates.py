# ruff: noqa: E501  (template lines are kept as the models' templates write them)
"""The parts of each model family's chat template that write an assistant's tool calls
(and the turn around them), as the models' own templates have them, for the tool-parser
tests: a parser must read back what its family's template writes. Each entry: the
template, the text that opens the assistant's turn, and the text that ends it."""

from __future__ import annotations

# Llama 3.1 (JSON tool calling): one call per turn, its arguments as "parameters".
LLAMA3_JSON = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
        {{- message['content'] | trim }}
        {{- '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if message.tool_calls|length > 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name|trim + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
"""

# Mistral (tokenizer v3 / v7, parallel calls): a JSON array after [TOOL_CALLS], each call
# with the last nine characters of its id.
MISTRAL_ARRAY = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message["role"] == "user" %}
        {{- "[INST] " + message["content"] + "[/INST]" }}
    {%- elif message.tool_calls is defined %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- set out = tool_call.function|tojson %}
            {{- out[:-1] }}
            {%- if not tool_call.id is defined or tool_call.id|length < 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length >= 9!") }}
            {%- endif %}
            {{- ', "id": "' + tool_call.id[-9:] + '"}' }}
            {%- if not loop.last %}
                {{- ", " }}
            {%- else %}
                {{- "]" + eos_token }}
            {%- endif %}
        {%- endfor %}
    {%- endif %}
{%- endfor %}
"""

# Mistral (tokenizer v11+: Mistral Small 3.2, Devstral, Magistral): name[ARGS]{...} per call.
MISTRAL_ARGS = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'user' %}
        {{- '[INST]' + message['content'] + '[/INST]' }}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'] %}
            {{- message['content'] }}
        {%- endif %}
        {%- for tool in message['tool_calls'] or [] %}
            {%- set arguments = tool['function']['arguments'] %}
            {%- if arguments is not string %}
                {%- set arguments = arguments|tojson %}
            {%- endif %}
            {{- '[TOOL_CALLS]' + tool['function']['name'] + '[ARGS]' + arguments }}
        {%- endfor %}
        {{- eos_token }}
    {%- endif %}
{%- endfor %}
"""

# Llama 4 (pythonic): a Python list of calls, each value written in double quotes.
PYTHONIC = """\
{{- bos_token }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or ('tool_calls' in message and message.tool_calls|length != 0)) %}
        {{- '<|header_start|>' + message['role'] + '<|header_end|>\\n\\n' }}
        {{- message['content'] }}
        {{- "<|eot|>" }}
    {%- elif 'tool_calls' in message %}
        {{- '<|header_start|>assistant<|header_end|>\\n\\n' -}}
        {{- message['content'] }}
        {{- "[" }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- tool_call.name + '(' -}}
            {%- for param in tool_call.arguments %}
                {{- param + '="' -}}
                {{- "%s" | format(tool_call.arguments[param]) -}}
                {{- '"' -}}
                {% if not loop.last %}, {% endif %}
            {%- endfor %}
            {{- ')' -}}
            {% if not loop.last %}, {% endif %}
        {%- endfor %}
        {{- "]<|eot|>" }}
    {%- endif %}
{%- endfor %}
"""

# Qwen3-Coder: XML-like blocks, one <parameter=...> per argument.
QWEN3_CODER = """\
{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls is defined and message.tool_calls is iterable and message.tool_calls | length > 0 %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content is defined and message.content is string and message.content | trim | length > 0 %}
            {{- '\\n' + message.content | trim + '\\n' }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
            {%- if tool_call.arguments is defined %}
                {%- for args_name, args_value in tool_call.arguments|items %}
                    {{- '<parameter=' + args_name + '>\\n' }}
                    {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                    {{- args_value }}
                    {{- '\\n</parameter>\\n' }}
                {%- endfor %}
            {%- endif %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "user" or message.role == "system" or message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

#: parser name -> (template, start of the assistant's turn, end of it)
FAMILIES = {
    "llama3_json": (LLAMA3_JSON, "<|start_header_id|>assistant<|end_header_id|>\n\n",
                    "<|eot_id|>"),
    "mistral": (MISTRAL_ARRAY, "[/INST]", "</s>"),
    "mistral_args": (MISTRAL_ARGS, "[/INST]", "</s>"),
    "pythonic": (PYTHONIC, "<|header_start|>assistant<|header_end|>\n\n", "<|eot|>"),
    "qwen3_coder": (QWEN3_CODER, "<|im_start|>assistant\n", "<|im_end|>"),
}
