"""forklm's OpenAI-compatible HTTP server (`forklm serve`): FastAPI on uvicorn over an `EngineLoop`."""
