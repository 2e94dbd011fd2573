"""What agent libraries send that the weather script does not: the conversations the tiny
Qwen3 model also learns, so that each library plays one short episode on it.

Each is the library's request at the version pinned in pyproject.toml's dev extras, copied
verbatim (a real model needs none of this; the tiny one knows only the prompts it was taught).
`tests/test_agent_libraries.py` checks every recorded prompt against these, so a library that
changes what it sends fails there, on the prompt, not on a reply.

- pydantic-ai (`Agent(model, output_type=Forecast)` with the weather tool): its output tool
  `final_result` is strict and forced (`tool_choice: "required"`), so both replies are
  constrained turns.
- smolagents' `ToolCallingAgent`: its own long system prompt, every call forced
  (`tool_choice: "required"`); one step, `final_answer`.
- DSPy's `ReAct`: each step a fresh system and user prompt with the trajectory in text, then
  the extraction of the answer.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from devtools.scripts import Conversation

QUESTION = "What is the weather in Paris?"
SMOLAGENTS_TASK = "What is 2 + 2?"
PARIS = "Sunny, 22 C."
ANSWER = "It is sunny and 22 C in Paris."


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


# --- pydantic-ai --------------------------------------------------------------------------

PYDANTIC_AI_OUTPUT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "final_result",
        "description": "The final response which ends this conversation",
        "parameters": {
            "properties": {"city": {"type": "string"}, "temperature_c": {"type": "integer"}},
            "required": ["city", "temperature_c"],
            "type": "object",
            "additionalProperties": False,
        },
        "strict": True,
    },
}
"""The output tool of `output_type=Forecast` (`city: str`, `temperature_c: int`)."""


def pydantic_ai_output_episode(weather_tool: dict[str, Any]) -> Conversation:
    """The weather tool, then the structured answer through the output tool."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather assistant."},
        {"role": "user", "content": QUESTION},
        _call("call_0", "get_weather", {"city": "Paris"}),
        {"role": "tool", "tool_call_id": "call_0", "content": PARIS},
        _call("call_1", "final_result", {"city": "Paris", "temperature_c": 22}),
    ]
    return {"family": "hermes", "tools": [weather_tool, PYDANTIC_AI_OUTPUT_TOOL], "messages": messages}


# --- smolagents ---------------------------------------------------------------------------

SMOLAGENTS_FINAL_ANSWER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "final_answer",
        "description": "Provides a final answer to the given problem.",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The final answer to the problem"}},
            "required": ["answer"],
        },
    },
}
_SMOLAGENTS_SYSTEM = (
    "You are an expert assistant who can solve any task using tool calls. You will be given a "
    "task to solve as best you can.\n"
    "To do so, you have been given access to some tools.\n"
    "\n"
    "The tool call you write is an action: after the tool is executed, you will get the result "
    'of the tool call as an "observation".\n'
    "This Action/Observation can repeat N times, you should take several steps when needed.\n"
    "\n"
    "You can use the result of the previous action as input for the next action.\n"
    'The observation will always be a string: it can represent a file, like "image_1.jpg".\n'
    "Then you can use it as input for the next action. You can do it for instance as follows:\n"
    "\n"
    'Observation: "image_1.jpg"\n'
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "image_transformer",\n'
    '  "arguments": {"image": "image_1.jpg"}\n'
    "}\n"
    "\n"
    'To provide the final answer to the task, use an action blob with "name": "final_answer" '
    "tool. It is the only way to complete the task, else you will be stuck on a loop. So your "
    "final output should look like this:\n"
    "Action:\n"
    "{\n"
    '  "name": "final_answer",\n'
    '  "arguments": {"answer": "insert your final answer here"}\n'
    "}\n"
    "\n"
    "\n"
    "Here are a few examples using notional tools:\n"
    "---\n"
    'Task: "Generate an image of the oldest person in this document."\n'
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "document_qa",\n'
    '  "arguments": {"document": "document.pdf", "question": "Who is the oldest person '
    'mentioned?"}\n'
    "}\n"
    'Observation: "The oldest person in the document is John Doe, a 55 year old lumberjack '
    'living in Newfoundland."\n'
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "image_generator",\n'
    '  "arguments": {"prompt": "A portrait of John Doe, a 55-year-old man living in Canada."}\n'
    "}\n"
    'Observation: "image.png"\n'
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "final_answer",\n'
    '  "arguments": "image.png"\n'
    "}\n"
    "\n"
    "---\n"
    'Task: "What is the result of the following operation: 5 + 3 + 1294.678?"\n'
    "\n"
    "Action:\n"
    "{\n"
    '    "name": "python_interpreter",\n'
    '    "arguments": {"code": "5 + 3 + 1294.678"}\n'
    "}\n"
    "Observation: 1302.678\n"
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "final_answer",\n'
    '  "arguments": "1302.678"\n'
    "}\n"
    "\n"
    "---\n"
    'Task: "Which city has the highest population , Guangzhou or Shanghai?"\n'
    "\n"
    "Action:\n"
    "{\n"
    '    "name": "web_search",\n'
    '    "arguments": "Population Guangzhou"\n'
    "}\n"
    "Observation: ['Guangzhou has a population of 15 million inhabitants as of 2021.']\n"
    "\n"
    "\n"
    "Action:\n"
    "{\n"
    '    "name": "web_search",\n'
    '    "arguments": "Population Shanghai"\n'
    "}\n"
    "Observation: '26 million (2019)'\n"
    "\n"
    "Action:\n"
    "{\n"
    '  "name": "final_answer",\n'
    '  "arguments": "Shanghai"\n'
    "}\n"
    "\n"
    "Above example were using notional tools that might not exist for you. You only have access "
    "to these tools:\n"
    "- get_weather: Get the current weather in a city.\n"
    "    Takes inputs: {'city': {'type': 'string', 'description': 'The city name.'}}\n"
    "    Returns an output of type: string\n"
    "- final_answer: Provides a final answer to the given problem.\n"
    "    Takes inputs: {'answer': {'type': 'any', 'description': 'The final answer to the "
    "problem'}}\n"
    "    Returns an output of type: any\n"
    "\n"
    "Here are the rules you should always follow to solve your task:\n"
    "1. ALWAYS provide a tool call, else you will fail.\n"
    "2. Always use the right arguments for the tools. Never use variable names as the action "
    "arguments, use the value instead.\n"
    "3. Call a tool only when needed: do not call the search agent if you do not need "
    "information, try to solve the task yourself. If no tool call is needed, use final_answer "
    "tool to return your answer.\n"
    "4. Never re-do a tool call that you previously did with the exact same parameters.\n"
    "\n"
    "Now Begin!"
)


def smolagents_episode(weather_tool: dict[str, Any]) -> Conversation:
    """One step: a task the agent answers at once, through `final_answer`. A second step would
    show the first call's id in its folded history, and the proxy's ids are random: taught
    with twelve ids the model looked past any id, but learned its script three times slower."""
    messages = [
        {"role": "system", "content": _SMOLAGENTS_SYSTEM},
        {"role": "user", "content": f"New task:\n{SMOLAGENTS_TASK}"},
        _call("call_0", "final_answer", {"answer": "4"}),
    ]
    return {"family": "hermes", "tools": [weather_tool, SMOLAGENTS_FINAL_ANSWER_TOOL], "messages": messages}


# --- DSPy ---------------------------------------------------------------------------------

_DSPY_REACT_SYSTEM = (
    "Your input fields are:\n"
    "1. `question` (str): \n"
    "2. `trajectory` (str):\n"
    "Your output fields are:\n"
    "1. `next_thought` (str): \n"
    "2. `next_tool_name` (Literal['get_weather', 'finish']): \n"
    "3. `next_tool_args` (dict[str, Any]):\n"
    "All interactions will be structured in the following way, with the appropriate values "
    "filled in.\n"
    "\n"
    "[[ ## question ## ]]\n"
    "{question}\n"
    "\n"
    "[[ ## trajectory ## ]]\n"
    "{trajectory}\n"
    "\n"
    "[[ ## next_thought ## ]]\n"
    "{next_thought}\n"
    "\n"
    "[[ ## next_tool_name ## ]]\n"
    "{next_tool_name}        # note: the value you produce must exactly match (no extra "
    "characters) one of: get_weather; finish\n"
    "\n"
    "[[ ## next_tool_args ## ]]\n"
    "{next_tool_args}        # note: the value you produce must adhere to the JSON schema: "
    '{"type": "object", "additionalProperties": true}\n'
    "\n"
    "[[ ## completed ## ]]\n"
    "In adhering to this structure, your objective is: \n"
    "        Given the fields `question`, produce the fields `answer`.\n"
    "        \n"
    "        You are an Agent. In each episode, you will be given the fields `question` as "
    "input. And you can see your past trajectory so far.\n"
    "        Your goal is to use one or more of the supplied tools to collect any necessary "
    "information for producing `answer`.\n"
    "        \n"
    "        To do this, you will interleave next_thought, next_tool_name, and next_tool_args in "
    "each turn, and also when finishing the task.\n"
    "        After each tool call, you receive a resulting observation, which gets appended to "
    "your trajectory.\n"
    "        \n"
    "        When writing next_thought, you may reason about the current situation and plan for "
    "future steps.\n"
    "        When selecting the next_tool_name and its next_tool_args, the tool must be one of:\n"
    "        \n"
    "        (1) get_weather, whose description is <desc>Get the current weather in a "
    "city.</desc>. It takes arguments {'city': {'type': 'string'}}.\n"
    "        (2) finish, whose description is <desc>Marks the task as complete. That is, signals "
    "that all information for producing the outputs, i.e. `answer`, are now available to be "
    "extracted.</desc>. It takes arguments {}.\n"
    "        When providing `next_tool_args`, the value inside the field must be in JSON format"
)

_DSPY_EXTRACT_SYSTEM = (
    "Your input fields are:\n"
    "1. `question` (str): \n"
    "2. `trajectory` (str):\n"
    "Your output fields are:\n"
    "1. `reasoning` (str): \n"
    "2. `answer` (str):\n"
    "All interactions will be structured in the following way, with the appropriate values "
    "filled in.\n"
    "\n"
    "[[ ## question ## ]]\n"
    "{question}\n"
    "\n"
    "[[ ## trajectory ## ]]\n"
    "{trajectory}\n"
    "\n"
    "[[ ## reasoning ## ]]\n"
    "{reasoning}\n"
    "\n"
    "[[ ## answer ## ]]\n"
    "{answer}\n"
    "\n"
    "[[ ## completed ## ]]\n"
    "In adhering to this structure, your objective is: \n"
    "        Given the fields `question`, produce the fields `answer`."
)
_DSPY_RESPOND_REACT = (
    "Respond with the corresponding output fields, starting with the field `[[ ## next_thought ## ]]`, "
    "then `[[ ## next_tool_name ## ]]` (must be formatted as a valid Python Literal['get_weather', "
    "'finish']), then `[[ ## next_tool_args ## ]]` (must be formatted as a valid Python dict[str, Any]), "
    "and then ending with the marker for `[[ ## completed ## ]]`."
)
_DSPY_RESPOND_EXTRACT = (
    "Respond with the corresponding output fields, starting with the field `[[ ## reasoning ## ]]`, "
    "then `[[ ## answer ## ]]`, and then ending with the marker for `[[ ## completed ## ]]`."
)


def _dspy_fields(**fields: str) -> str:
    """DSPy's chat adapter: each field as `[[ ## name ## ]]` and its value, a blank line apart."""
    return "\n\n".join(f"[[ ## {name} ## ]]\n{value}" for name, value in fields.items())


def _dspy_step(system: str, trajectory: str, respond: str, reply: str) -> Conversation:
    user = _dspy_fields(question=QUESTION, trajectory=trajectory) + "\n\n" + respond
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": reply + "\n\n[[ ## completed ## ]]"},
    ]
    return {"family": "hermes", "tools": None, "messages": messages}


def dspy_react_episodes() -> list[Conversation]:
    """ReAct's three calls: the weather tool, `finish`, and the answer extracted from the
    trajectory (each call its own prompt)."""
    call = _dspy_fields(
        thought_0="I need the weather in Paris.", tool_name_0="get_weather", tool_args_0='{"city": "Paris"}'
    )
    observed = call + "\n\n" + _dspy_fields(observation_0=PARIS)
    finish = _dspy_fields(thought_1="I have the weather.", tool_name_1="finish", tool_args_1="{}")
    finished = observed + "\n\n" + finish + "\n\n" + _dspy_fields(observation_1="Completed.")
    return [
        _dspy_step(
            _DSPY_REACT_SYSTEM,
            "",
            _DSPY_RESPOND_REACT,
            _dspy_fields(
                next_thought="I need the weather in Paris.",
                next_tool_name="get_weather",
                next_tool_args='{"city": "Paris"}',
            ),
        ),
        _dspy_step(
            _DSPY_REACT_SYSTEM,
            observed,
            _DSPY_RESPOND_REACT,
            _dspy_fields(next_thought="I have the weather.", next_tool_name="finish", next_tool_args="{}"),
        ),
        _dspy_step(
            _DSPY_EXTRACT_SYSTEM,
            finished,
            _DSPY_RESPOND_EXTRACT,
            _dspy_fields(reasoning="The tool says sunny, 22 C.", answer=ANSWER),
        ),
    ]


def library_scripts(weather_tool: dict[str, Any]) -> list[Conversation]:
    """What the tiny Qwen3 model learns besides its weather and thinking scripts, given the
    weather tool as the script defines it (the libraries send the same)."""
    return [
        pydantic_ai_output_episode(weather_tool),
        smolagents_episode(weather_tool),
        *dspy_react_episodes(),
    ]
