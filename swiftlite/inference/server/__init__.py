"""`swiftlite deploy`: an OpenAI-compatible HTTP server over the inference engine.

  scheduler   the generation worker: a bounded queue, dynamic batches (one adapter per batch),
              a decode loop that streams each row's text and drops finished or abandoned rows
  openai_api  request checks and response shapes of OpenAI's chat and completions APIs
  logprobs    log-probabilities in OpenAI's chat and completions shapes
  app         the FastAPI routes, API-key check and OpenAI-shaped errors
"""
