"""Tool calls in a model turn: the parser lives with the OpenAI protocol code that also needs it
(`relax.engine_api.openai.tool_calls`); agentic code keeps importing it from here."""

from relax.engine_api.openai.tool_calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    ToolCall,
    parse_tool_calls,
)

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ParsedTurn", "ToolCall", "parse_tool_calls"]
