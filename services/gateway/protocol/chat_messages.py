"""A chat's messages and tools as the chat body (schemas.py) and /tokenize accept them."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from services.gateway.protocol.fields import Text


class TextPart(BaseModel):
    """The one kind of content part accepted: text."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """One message. Content may be null (or absent) only on an assistant message that carries tool
    calls, as in OpenAI's API: any other null message used to reach the model as an empty turn."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    tool_calls: list[dict[str, Any]] | None = None  # before content: its validator reads them
    tool_call_id: Text | None = None  # a tool message: the call it answers
    content: Text | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_unless_tool_calls(cls, v, info):
        role = info.data.get("role")
        if v is None and role is not None and not (role == "assistant" and info.data.get("tool_calls")):
            raise PydanticCustomError("missing_content", "a {role} message needs content; only an assistant "
                                      "message with tool_calls may leave it null", {"role": role})
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments (an object)")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: NamedFunction


def check_continue(messages: list[ChatMessage], add_generation_prompt: bool, continue_final_message: bool) -> None:
    """continue_final_message's rules (a chat's, and /tokenize's): vLLM's, that the template cannot both
    continue a message and open a new turn, and that the message continued is an assistant's."""
    if continue_final_message:
        if add_generation_prompt:
            raise PydanticCustomError("invalid_value", "continue_final_message needs add_generation_prompt false "
                                      "(the template cannot both continue a message and open a new turn)")
        if messages[-1].role != "assistant":
            raise PydanticCustomError("invalid_value", "continue_final_message needs the last message to be an "
                                      "assistant's")
