"""HTTP entry points: the OpenAI protocol, the serving handlers and the server launcher."""
