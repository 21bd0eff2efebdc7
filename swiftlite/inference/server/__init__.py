"""`swiftlite deploy`: an OpenAI-compatible HTTP server over the inference engine.

  scheduler   the generation worker: a bounded queue, dynamic batches (one adapter per batch),
              a decode loop that streams each row's text and drops finished or abandoned rows
  openai_api  request checks and response shapes of OpenAI's chat and completions APIs
  logprobs    log-probabilities in OpenAI's chat and completions shapes
  replies     a request's answer from its jobs' events: waited for (cancelled when the client
              leaves) or streamed
  app         the FastAPI routes, API-key check, request limits and OpenAI-shaped errors
"""
