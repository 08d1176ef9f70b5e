"""OpenAI-compatible HTTP serving (`moet serve`): FastAPI app over the async engine
(contract 2), tool-call and reasoning parsers, Prometheus metrics. See docs/serve.md."""
