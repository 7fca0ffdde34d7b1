"""`hybridserve serve`: an OpenAI-compatible HTTP server over one `LLMEngine`.

Modules: `async_engine` (the engine loop in one background thread, asyncio streams),
`protocol` (request/response bodies), `chat` (chat templates), `serving` (the endpoints'
logic), `formatting` (response bodies and stream chunks), `metrics` (Prometheus), `app`
(FastAPI routes and errors), `launch` (uvicorn, signals). The server imports the engine;
nothing in the engine imports the server.
"""
