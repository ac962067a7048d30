"""The OpenAI Agents SDK run the real-model tests share: an agent with two function tools, asked the weather in Paris,
on a gateway's Responses API; it must call a tool first (``tool_choice: required``), then the SDK resets the choice
to auto and the model answers.

    run_agent(url, model) ─▶ agents.Runner.run ─▶ POST /v1/responses (a call) ─▶ the tool ─▶ /v1/responses ─▶ Run
"""

from __future__ import annotations

import asyncio
from typing import Any


def run_agent(url: str, model: str) -> tuple[list[str], Any]:
    """The tools' calls as they ran (``get_weather(Paris)``), and the SDK's run result."""
    import agents
    import openai

    agents.set_tracing_disabled(True)  # nothing leaves this machine
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(f"get_weather({city})")
        return f"It is 18 degrees and sunny in {city}."

    @agents.function_tool
    def get_population(city: str) -> str:
        """How many people live in a city."""
        ran.append(f"get_population({city})")
        return f"{city} has 2 million people."

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
            agent = agents.Agent(
                name="assistant", instructions="Use the tools, then answer in one sentence.",
                model=agents.OpenAIResponsesModel(model, client), tools=[get_weather, get_population],
                model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=160))
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4,
                                           run_config=agents.RunConfig(tracing_disabled=True))

    return ran, asyncio.run(run())
