"""Greedy decoding with llama.cpp itself (llama-cpp-python), run in the llama.cpp venv by the
export tests: a GGUF (and optionally a GGUF LoRA) answers token ids, until an end-of-generation
token or max_tokens; with them, the file's metadata as llama.cpp reads it (each value a string,
arrays left out).

  python llamacpp_generate.py JOB.json   ->  one JSON line per job on stdout
  JOB: {"model": PATH, "lora": PATH|null, "jobs": [{"prompt_ids": [...], "max_tokens": N}],
        "chat": [{"messages": [...], "tools": [...]}],    (chat: the GGUF's own template)
        "render": [{"messages": [...], "tools": [...]}],  (the prompt that template makes)
        "logprobs": [[token ids]]}   (each token's log-probability after the ones before it)
"""
import json
import sys

import llama_cpp
import numpy as np
from llama_cpp import Llama
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


def _plain_buffers_on_amx() -> None:
    """On CPUs with AMX, llama.cpp's AMX weight buffers crash at the first product of a k-quant
    model on some hosts (ggml-org/llama.cpp#20824; seen here: 0.3.36, q4_k_m SmolLM2, a Xeon
    with amx_int8). There the weights stay in its plain CPU buffers, as `llama-cli --no-repack`
    keeps them: the file is what is tested, not llama.cpp's AMX kernels."""
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        if " amx_int8" not in f.read():
            return
    import llama_cpp.llama as module
    defaults = llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p
    module.llama_cpp.llama_model_default_params = params


def main(path: str) -> None:
    _plain_buffers_on_amx()
    with open(path, encoding="utf-8") as f:
        job = json.load(f)
    llm = Llama(model_path=job["model"], lora_path=job.get("lora"), n_ctx=1024, n_threads=2,
                n_batch=256, seed=0, verbose=False, logits_all=bool(job.get("logprobs")))
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    out = {"eos": llm.token_eos(), "metadata": llm.metadata, "results": [], "chat": [],
           "render": [], "logprobs": []}
    for j in job.get("jobs", []):
        llm.reset()
        tokens, stopped = [], False
        for tok in llm.generate(j["prompt_ids"], top_k=1, top_p=1.0, temp=0.0,
                                repeat_penalty=1.0, reset=True):
            if llama_cpp.llama_vocab_is_eog(vocab, tok):
                tokens.append(tok)
                stopped = True
                break
            tokens.append(tok)
            if len(tokens) >= j["max_tokens"]:
                break
        out["results"].append({"tokens": tokens, "stopped": stopped,
                               "text": llm.detokenize(tokens).decode("utf-8", "replace")})
    for c in job.get("chat", []):
        r = llm.create_chat_completion(c["messages"], tools=c.get("tools"), temperature=0.0,
                                       top_k=1, max_tokens=c.get("max_tokens", 32), seed=0)
        out["chat"].append({"content": r["choices"][0]["message"].get("content"),
                            "finish_reason": r["choices"][0]["finish_reason"]})
    for r in job.get("render", []):
        # llama-cpp-python's own renderer of a GGUF's tokenizer.chat_template
        formatter = Jinja2ChatFormatter(llm.metadata["tokenizer.chat_template"],
                                        eos_token="", bos_token="")
        out["render"].append(formatter(messages=r["messages"], tools=r.get("tools")).prompt)
    for ids in job.get("logprobs", []):
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[:len(ids) - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        out["logprobs"].append(logp[np.arange(len(ids) - 1), ids[1:]].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1])
