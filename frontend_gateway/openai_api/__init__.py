"""The OpenAI request and response shapes: request types, pre-processing, chat output, encodings, the Responses API."""
